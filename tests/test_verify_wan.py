"""Self-verifying hits through ComfyUI's tiny WanModel on the CPU (random weights), driven by the
ChorusSparseSampler node: the request's own recorded maps pass; a wrong entry forced as a hit
(maps of another request permuted across heads and layers, thinned to the diagonal band) is caught
at the first step, the rest runs dense and the request writes its own entry; the node input
(optional, default 0 = off, bad values -> not patched with a message). Thresholds are on the fit
ratio (estimated recall / best recall at the same density), which random weights pass for a fitting
map: the suggested 0.95 is used here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from host import tiny_wan as tiny  # tests/host (pytest pythonpath)

SKIP_REASON = tiny.import_comfy()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")

from chorus.cache_store import Workspace  # noqa: E402
from chorus.engine import Plan, build_signature, commit_plan  # noqa: E402
from chorus.engine.config import DEFAULT_VERIFY_THRESHOLD, SUGGESTED_VERIFY_THRESHOLD  # noqa: E402

LATENT = (1, 16, 3, 16, 16)  # grid (3, 8, 8) = 192 tokens; block 128 -> 2 blocks


@pytest.fixture(scope="module")
def node():
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

    return ChorusSparseSampler


@pytest.fixture(scope="module")
def model():
    return tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=4, num_layers=2))


def _sample(m, steps=2):
    import comfy.sample

    positive, negative = tiny.random_conditioning(3), tiny.random_conditioning(103)
    latent = torch.zeros(LATENT)
    noise = comfy.sample.prepare_noise(latent, 0)
    return comfy.sample.sample(m, noise, steps, 1.0, "euler", "simple", positive, negative, latent,
                               disable_pbar=True, seed=0)


def _recorded(node, model):
    plan = Plan.miss("miss", latent_shape=LATENT[1:], embedding=np.ones(4, np.float32))
    _sample(node.execute(model, plan, k_min=1).result[0])
    return plan


def _hit(miss, masks):
    return Plan("hit", entry_id=3, similarity=0.97, masks=masks, entry_meta={"signature": build_signature(miss)},
                latent_shape=LATENT[1:], embedding=np.ones(4, np.float32))


def test_schema_input_is_optional_with_a_default(node):
    schema = node.define_schema()
    names = [i.id for i in schema.inputs]
    # inputs added later come after the older ones: a graph saved before them keeps its widget values
    assert names[-3:] == ["backend", "verify_threshold", "pooled_tail"]
    spec = schema.inputs[names.index("verify_threshold")]
    assert spec.optional and spec.default == DEFAULT_VERIFY_THRESHOLD == 0.0 and spec.tooltip


def test_own_maps_pass_and_a_wrong_entry_is_caught_and_rewritten(node, model, tmp_path):
    miss = _recorded(node, model)
    maps = miss.recorder.block_maps()
    hit = _hit(miss, maps)
    out = node.execute(model, hit, k_min=1, verify_threshold=SUGGESTED_VERIFY_THRESHOLD)
    assert "verification: fit ratio" in " ".join(out.ui["text"])
    _sample(out.result[0])
    assert hit.is_hit and hit.stats.verification[0]["verdict"] == "pass", hit.stats.summary()
    assert hit.stats.verification[0]["ratio"] >= SUGGESTED_VERIFY_THRESHOLD

    # a wrong entry: another request's maps permuted across layers and heads, thinned to the diagonal
    gen = torch.Generator().manual_seed(0)
    keys = sorted(maps)
    wrong = {}
    for key in keys:
        src = maps[keys[int(torch.randint(len(keys), (1,), generator=gen))]]
        src = src[torch.randperm(src.shape[0], generator=gen)]
        wrong[key] = src & torch.eye(src.shape[-1], dtype=torch.bool)
    bad = _hit(miss, wrong)
    patched = node.execute(model, bad, k_min=1, verify_threshold=SUGGESTED_VERIFY_THRESHOLD).result[0]
    dense = _sample(model)
    got = _sample(patched)
    assert torch.isfinite(got).all()
    assert not bad.is_hit and bad.stats.verification[0]["verdict"] == "fail", bad.stats.summary()
    assert bad.stats.sparse_calls == 2 and bad.stats.fallback_calls == 0  # step 0's two layers, then dense
    assert "estimated recall" in bad.stats.summary() and "fit ratio" in bad.stats.summary()
    assert "fail" in bad.stats.summary() and bad.stats.verification[0]["ratio"] < SUGGESTED_VERIFY_THRESHOLD
    assert bad.recorder.complete
    assert commit_plan(Workspace.open(tmp_path / "ws"), bad).startswith("wrote entry")
    assert bad.stats.dense_calls == 2  # the second step's two layers, dense (and recorded)
    # the same wrong entry without verification runs sparse throughout: further from dense than the demoted run
    all_sparse = _sample(node.execute(model, _hit(miss, wrong), k_min=1, verify_threshold=0.0).result[0])
    assert 0 < (got - dense).abs().max() < 0.5 * (all_sparse - dense).abs().max()


def test_default_is_off(node, model):
    """The node's default (DEFAULT_VERIFY_THRESHOLD = 0): a hit runs without verification."""
    miss = _recorded(node, model)
    hit = _hit(miss, miss.recorder.block_maps())
    out = node.execute(model, hit, k_min=1)
    assert "verification off" in " ".join(out.ui["text"])
    _sample(out.result[0])
    assert hit.is_hit and hit.stats.verification == {}


def test_off_and_bad_values(node, model):
    miss = _recorded(node, model)
    maps = {k: m & torch.eye(m.shape[-1], dtype=torch.bool) for k, m in miss.recorder.block_maps().items()}
    hit = _hit(miss, maps)
    out = node.execute(model, hit, k_min=1, verify_threshold=0.0)
    assert "verification off" in " ".join(out.ui["text"])
    _sample(out.result[0])
    assert hit.is_hit and hit.stats.verification == {}
    plan = _hit(miss, maps)
    out = node.execute(model, plan, verify_threshold=1.5)
    assert out.result[0] is model and "not patched" in out.ui["text"][0] and "verify_threshold" in out.ui["text"][0]
