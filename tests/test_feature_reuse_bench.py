"""benchmarks/feature_reuse_bench.py runs end to end on a tiny block on CPU (timing replaced by one call),
so the GPU benchmark's code paths are exercised in CI; its guidance proxies move the right way."""

import math

import pytest
import torch
import torch.nn.functional as F

from chorus.benchmarks import feature_reuse_bench as bench


def _plain_sdpa(heads):
    return lambda q, k, v: bench._sdpa(q, k, v, heads)


def test_measure_block_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "cuda_median_ms", lambda fn, reps: (calls.append(fn()), 0.0)[1])
    monkeypatch.setattr(bench, "_dense_attention", _plain_sdpa)
    res = bench.measure_block((5, 8, 16), density=0.3, share=0.5, reps=1, backend="reference", dim=128, heads=2,
                              ffn=256, device="cpu", log=lambda *_: None)
    assert res["tokens"] == 640 and res["device"] == "cpu" and res["regions"] >= 1
    assert all(v == 0.0 for v in res["ms"].values())  # every variant ran (a failure is None)
    q = res["quality"]
    for name in ("sparse", "sparse+image", "sparse+fr", "sparse+fr+text", "sparse+fr+image", "sparse+fr+text+image",
                 "dense+fr"):
        assert math.isfinite(q[name]["rel_dev_update"]) and math.isfinite(q[name]["rel_dev_update_first_frame"])
    share = res["first_frame_attention_share"]
    assert 0 < share["dense"] < share["dense+image"] < 1
    assert share["sparse"] < share["sparse+image"] < 1
    assert res["image_bias"] == pytest.approx(math.log(1.1))


def test_first_frame_share_matches_a_direct_softmax():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 300, 64, generator=g), torch.randn(1, 300, 64, generator=g)
    got = bench.first_frame_share(q, k, 2, 70, bias=0.5, rows=300)
    qh, kh = q[0].view(300, 2, 32).transpose(0, 1), k[0].view(300, 2, 32).transpose(0, 1)
    logits = qh @ kh.transpose(-1, -2) / math.sqrt(32)
    logits[..., :70] += 0.5
    want = float(F.softmax(logits, -1)[..., :70].sum(-1).mean())
    assert got == pytest.approx(want, rel=1e-5)
