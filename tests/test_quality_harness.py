"""The quality harness (benchmarks/quality) on tiny sizes: numerics of its pieces and a --quick run.

Attention source: the synthetic structured source with random weights (benchmarks/quality/source.py);
end to end: the tiny diffusers Wan pair with random weights. Real weights are never used here.
"""

from __future__ import annotations

import json
import math

import pytest
import torch


from chorus import kernels
from chorus.kernels.reference import dense_attention_oracle

quality = pytest.importorskip("chorus.benchmarks.quality.harness")
source = pytest.importorskip("chorus.benchmarks.quality.source")


@pytest.mark.parametrize("length,block", [(97, 32), (300, 64), (256, 128)])
def test_exact_block_mass_and_masked_output_match_the_kernels_reference(length, block):
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, 3, length, 32, generator=gen) for _ in range(3))
    probs = quality.exact_probs(q * 0.3, k)
    mass = quality.block_mass_from_probs(probs, block)
    ref = kernels.block_mass(q * 0.3, k, block_size=block, scale=1.0, backend="reference")
    torch.testing.assert_close(mass, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(mass.sum(-1), torch.ones_like(mass.sum(-1)), atol=1e-5, rtol=0)
    for rows in (None, 16, 5):
        sampled = quality.sampled_block_mass(q * 0.3, k, block, rows)
        api = kernels.block_mass(q * 0.3, k, block_size=block, sample_rows=rows, scale=1.0, backend="reference")
        torch.testing.assert_close(sampled, api, atol=2e-6, rtol=1e-5)
    bmap = kernels.select_blocks(mass, top_p=0.6, k_min=1)[0]
    out = quality.masked_output(probs, v, bmap, block)
    oracle = dense_attention_oracle(q * 0.3, k, v, bmap[None], block_size=block, scale=1.0)[0]
    assert float((out.double() - oracle).abs().max()) < 1e-5


def test_structured_source_is_local_and_content_dependent():
    cfg = source.SourceConfig(grid=(4, 8, 12), heads=6, layers=1, step_sigmas=(0.3,), high_steps=1)
    model = source.build_model(cfg)
    import numpy as np

    img = np.random.default_rng(0).random((64, 96, 3))
    req = source.RequestAttention(model, source.Request("a", img, "p", 1))
    q, k, _ = req.qkv(0, 0, 0)
    probs = quality.exact_probs(q, k)
    mass = quality.block_mass_from_probs(probs, 16)[0]
    # positional heads: the diagonal block row-mass beats the uniform share by far
    diag = mass.diagonal(dim1=-2, dim2=-1).mean()
    assert float(diag) > 4.0 / mass.shape[-1]
    # a different image changes the content part of q/k (same positional part)
    other = source.RequestAttention(model, source.Request("b", img[::-1].copy(), "p", 1))
    q2, k2, _ = other.qkv(0, 0, 0)
    assert not torch.allclose(k, k2)
    assert torch.allclose(k[..., : cfg.pos_dim], k2[..., : cfg.pos_dim])


def test_quick_run_writes_sane_results(tmp_path):
    from chorus.benchmarks.quality import run

    assert run.main(["--out", str(tmp_path), "--quick"]) == 0
    for name in ("results.json", "summary.md", "recall_vs_similarity.png", "error_vs_similarity.png"):
        assert (tmp_path / name).is_file() and (tmp_path / name).stat().st_size > 0
    res = json.loads((tmp_path / "results.json").read_text())
    attn = res["attention"]
    assert "synthetic structured source" in attn["source"] and "random weights" in attn["source"]
    fam = attn["per_family"]
    assert fam["near_duplicate"]["hit_rate"] == 1.0
    assert fam["unrelated"]["hit_rate"] == 0.0
    assert fam["near_duplicate"]["retrieved_expected"] == 1.0
    assert fam["near_duplicate"]["recall"] > fam["unrelated"]["recall"]
    assert fam["near_duplicate"]["similarity"] > fam["unrelated"]["similarity"] + 0.3
    for row in attn["per_query"]:
        assert 0.0 < row["density"] <= 1.0 and 0.0 < row["recall"] <= 1.0 + 1e-6
        assert row["own_recall"] >= 0.9 - 1e-3          # the oracle map reaches top_p by construction
        assert row["cosine"] > 0.9 and math.isfinite(row["rel_l2"])
    e2e = res["e2e"]
    assert "random weights" in e2e["label"]
    assert {r["family"] for r in e2e["rows"]} == {"near_duplicate", "unrelated"}
    for r in e2e["rows"]:
        assert r["plan"] == "hit" and r["fallback_calls"] == 0
        assert r["density"] < 1.0                      # reuse really skipped blocks
        assert 10.0 < r["latent_psnr"] < 200.0 and r["frames_psnr"] > 10.0
    text = (tmp_path / "summary.md").read_text()
    assert "near_duplicate" in text and "random weights" in text
