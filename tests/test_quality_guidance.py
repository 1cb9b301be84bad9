"""benchmarks/quality/guidance.py runs end to end on the tiny diffusers pair (CPU): every variant is a
hit with no fallback, and guidance at strength 0 is bit-identical to feature reuse alone."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("diffusers")
guidance = pytest.importorskip("chorus.benchmarks.quality.guidance")
tiny_e2e = pytest.importorskip("chorus.benchmarks.quality.tiny_e2e")

from chorus.engine.feature_reuse import FeatureReuseConfig  # noqa: E402


def test_study_on_one_similar_request(monkeypatch):
    variants = dict(guidance.VARIANTS)
    variants["reuse+fr+zero"] = (True, (0.0, 0.0))
    monkeypatch.setattr(guidance, "VARIANTS", variants)
    cfg = tiny_e2e.TinyConfig(latent_grid=(4, 16, 16), block_size=16, decode=False)
    experts, vae = tiny_e2e.tiny_models(cfg)
    pairs = [p for p in guidance.study_pairs(quick=True) if p[0] == "near_duplicate"][:1]
    res = guidance.run_study(pairs, cfg, experts, vae, FeatureReuseConfig(region=(2, 4, 4)), "tiny", log=lambda *_: None)
    (row,) = res["rows"]
    for name, v in row["variants"].items():
        assert v["hit"] and v["fallback_calls"] == 0, name
        assert math.isfinite(v["latent_rel_l2"]) and math.isfinite(v["first_frame_to_image"])
    got = row["variants"]
    assert got["reuse+fr+zero"]["latent_rel_l2"] == got["reuse+fr"]["latent_rel_l2"]
    assert got["reuse+fr+text+image"]["latent_rel_l2"] != got["reuse+fr"]["latent_rel_l2"]
    assert got["reuse"]["latent_rel_l2"] < got["reuse+fr"]["latent_rel_l2"]  # downsampling costs something
    assert "| reuse+fr+image |" in guidance.summary_markdown(res)
