"""Feature reuse in a diffusers ``WanTransformer3DModel`` (tiny, random weights, CPU), with and without
the engine's sparse self-attention processor, in both patch orders."""

from __future__ import annotations

import math

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from chorus.engine import ChorusAttention, Plan, SparseConfig, build_signature, wan_model_info  # noqa: E402
from chorus.engine.feature_reuse import FeatureReuse, FeatureReuseConfig, feature_state  # noqa: E402
from chorus.hosts.diffusers import patch_diffusers_feature_reuse, patch_diffusers_wan  # noqa: E402
from testing import tiny_diffusers_wan  # noqa: E402

BS = 32
SHAPE = (1, 36, 5, 16, 16)   # token grid (5, 8, 8) = 320 tokens
GRID = (5, 8, 8)
CFG = SparseConfig(top_p=0.9, k_min=1, block_size=BS, sample_rows=None)
FR = FeatureReuseConfig(downsample_share=0.25, region=(2, 4, 4), full_layers=1)


def tiny_transformer():
    return tiny_diffusers_wan(num_layers=3)


def inputs(sigma):
    g = torch.Generator().manual_seed(0)
    t, y, x = torch.meshgrid(torch.arange(5.0), torch.arange(16.0), torch.arange(16.0), indexing="ij")
    smooth = torch.stack([torch.sin(0.2 * y + 0.3 * x + 0.1 * t + c) for c in range(36)])[None]
    hidden = smooth + (x < 8) * torch.randn(SHAPE, generator=g)  # textured left half, smooth right half
    hidden[:, 16:20] = 0.0
    hidden[:, 16:20, 0] = 1.0  # the I2V mask channels: a start image on frame 0
    return dict(hidden_states=hidden, timestep=torch.tensor([sigma * 1000.0]),
                encoder_hidden_states=torch.randn(1, 8, 64, generator=g), return_dict=False)


def _run(model, plan, *, fr=True, sparse=True, fr_first=False, config=FR):
    info = wan_model_info(model)
    patches = []
    attn = ChorusAttention(plan, CFG, info)
    handle = FeatureReuse(plan, config, info)
    steps = [("fr", handle), ("sparse", attn)] if fr_first else [("sparse", attn), ("fr", handle)]
    for kind, h in steps:
        if kind == "sparse" and sparse:
            patches.append(patch_diffusers_wan(model, h))
        if kind == "fr" and fr:
            patches.append(patch_diffusers_feature_reuse(model, h))
    attn.begin_run([0.8, 0.4, 0.0])
    handle.begin_run([0.8, 0.4, 0.0])
    try:
        with torch.no_grad():
            return [model(**inputs(s))[0] for s in (0.8, 0.4)]
    finally:
        handle.end_run()
        attn.end_run()
        for p in reversed(patches):
            p.remove()


def _hit(miss):
    masks = {k: torch.ones_like(v) for k, v in miss.recorder.block_maps().items()}
    meta = {"signature": build_signature(miss), "feature_reuse": miss.request_meta["feature_reuse"]}
    return Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta=meta)


def test_miss_records_then_hit_downsamples_with_sparse_attention_in_either_order():
    model = tiny_transformer()
    with torch.no_grad():
        dense = [model(**inputs(s))[0] for s in (0.8, 0.4)]
    miss = Plan.miss("test", latent_shape=SHAPE)
    outs = _run(model, miss)
    for out, ref in zip(outs, dense):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert set(miss.request_meta["feature_reuse"]["scores"]["0"]) == {"0.8", "0.4"}
    results = []
    for fr_first in (False, True):
        hit = _hit(miss)
        results.append(_run(model, hit, fr_first=fr_first))
        state = feature_state(hit)
        assert state.blocks_reduced == 2 * 2 and state.blocks_full == 2  # layer 0 full
        assert hit.stats.sparse_calls == 2 * 3 and hit.stats.fallback_calls == 0, hit.stats.messages
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    # downsampling moves the output far less than skipping the same regions
    skip_hit = _hit(miss)
    skipped = _run(model, skip_hit, config=FeatureReuseConfig(downsample_share=0.25, region=(2, 4, 4), mode="skip"))
    dev = lambda out: float((out - dense[1]).norm() / dense[1].norm())  # noqa: E731
    d_down, d_skip = dev(results[0][1]), dev(skipped[1])
    # measured here (torch 2.14 CPU): downsample 0.0162, skip 0.125 (7.7x)
    assert math.isfinite(d_down) and d_down < 0.25 * d_skip, (d_down, d_skip)


def test_share_zero_and_removal_leave_the_model_unchanged():
    model = tiny_transformer()
    with torch.no_grad():
        dense = [model(**inputs(s))[0] for s in (0.8, 0.4)]
    miss = Plan.miss("test", latent_shape=SHAPE)
    _run(model, miss, sparse=True)
    hit = _hit(miss)
    outs = _run(model, hit, sparse=False, config=FeatureReuseConfig(downsample_share=0.0, region=(2, 4, 4)))
    for out, ref in zip(outs, dense):
        assert torch.equal(out, ref)
    assert all("forward" not in b.__dict__ and "forward" not in b.attn1.__dict__ for b in model.blocks)
    with pytest.raises(ValueError, match="not a diffusers"):
        patch_diffusers_feature_reuse(torch.nn.Linear(2, 2), FeatureReuse(hit, FR, wan_model_info(model)))


def test_other_libraries_block_hooks_keep_running_under_the_patch_and_after_its_removal():
    """diffusers' HookRegistry (group offloading, the caching hooks) and accelerate keep their hooks as an
    instance-level ``forward`` of each block: the patch wraps it (the hook runs on every forward), patching
    again replaces the older Chorus wrapper instead of stacking, and ``remove()`` puts the hook back."""
    from diffusers.hooks import HookRegistry, ModelHook

    calls = []

    class Counting(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(type(module).__name__)
            return args, kwargs

    model = tiny_transformer()
    for block in model.blocks:
        HookRegistry.check_if_exists_or_initialize(block).register_hook(Counting(), "count")
    hooked = [block.__dict__["forward"] for block in model.blocks]
    plan = Plan.miss("t", latent_shape=(1, 36, 3, 8, 8))
    first = patch_diffusers_feature_reuse(model, FeatureReuse(plan, FR, wan_model_info(model)))
    second = patch_diffusers_feature_reuse(model, FeatureReuse(plan, FR, wan_model_info(model)))
    with torch.no_grad():
        model(**inputs(0.5))
    assert len(calls) == len(model.blocks), calls  # each hook once: wrapped, not dropped, not stacked
    second.remove()
    first.remove()
    assert [block.__dict__["forward"] for block in model.blocks] == hooked
    calls.clear()
    with torch.no_grad():
        model(**inputs(0.5))
    assert len(calls) == len(model.blocks)
