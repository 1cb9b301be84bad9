"""engine/guidance.py: when the boost acts, its gain and image biases (the first frame's; the last frame's for a
first-last-frame request), and that strength 0 changes nothing; the biased dense attention and the engine's
sparse path against the fp64 oracle."""

import math

import pytest
import torch

from chorus.engine.guidance import (CFG_GAIN_PER_STRENGTH, GAIN_PER_STRENGTH, IMAGE_GAIN_PER_STRENGTH,
                                    GuidanceBoost, image_biased_attention)
from chorus.engine.plan import Plan
from chorus.kernels.reference import dense_attention_oracle
from testing import assert_matches_oracle, make_qkv


def _hit(step_sigmas=(1.0, 0.75, 0.5, 0.25)):
    sig = {"step_sigmas": list(step_sigmas), "token_grid": [1, 2, 2]}
    return Plan("hit", masks={(0, 0, 0, 0): torch.ones(1, 1, 1, dtype=torch.bool)}, entry_meta={"signature": sig},
                similarity=0.95, entry_id=1)


def test_strength_zero_returns_the_same_object():
    out = torch.randn(1, 8, 4)
    for plan in (None, _hit(), Plan.miss("m")):
        boost = GuidanceBoost(plan, 0.0, 0.0)
        assert boost.is_off and not boost.active_at(1.0)
        assert boost.cross_attention(out, 1.0) is out and boost.first_frame_bias(1.0) == 0.0


def test_each_part_has_its_own_strength():
    out = torch.ones(1, 3, 2)
    text_only = GuidanceBoost(None, 1.0, 0.0)
    assert text_only.first_frame_bias(0.5) == 0.0 and torch.equal(text_only.cross_attention(out, 0.5), out * 1.2)
    image_only = GuidanceBoost(None, 0.0, 1.0)
    assert image_only.cross_attention(out, 0.5) is out
    assert image_only.first_frame_bias(0.5) == pytest.approx(math.log(1 + IMAGE_GAIN_PER_STRENGTH))


def test_acts_only_where_reuse_acted():
    out = torch.ones(1, 3, 2)
    hit = GuidanceBoost(_hit(), 0.5, 0.5)
    assert hit.gain == pytest.approx(1 + 0.5 * GAIN_PER_STRENGTH)
    assert torch.equal(hit.cross_attention(out, torch.tensor([0.75])), out * hit.gain)
    assert hit.first_frame_bias(torch.tensor([0.75])) == pytest.approx(math.log(1 + 0.5 * IMAGE_GAIN_PER_STRENGTH))
    assert hit.cross_attention(out, 0.6) is out and hit.first_frame_bias(0.6) == 0.0  # not a step of the entry
    hit.sample_sigmas = [1.0, 0.75, 0.5, 0.25, 0.0]
    assert hit.active_at(0.6)  # an intermediate sigma of step 0.75 (multi-evaluation samplers)
    miss = GuidanceBoost(Plan.miss("m"), 2.0, 2.0)
    assert miss.cross_attention(out, 1.0) is out and miss.first_frame_bias(1.0) == 0.0
    no_plan = GuidanceBoost(None, 1.0, 1.0)
    assert torch.equal(no_plan.cross_attention(out, 0.3), out * (1 + GAIN_PER_STRENGTH))
    assert hit.boosted_calls == 1 and no_plan.boosted_calls == 1 and hit.biased_calls == 1


def test_last_frame_bias_only_for_a_forward_that_ends_with_an_end_image():
    """The end image's bias: the first frame's value where the forward's own frames (a context window holds part of
    the video) hold an image in the last frame, else, where the forward cannot tell, where the plan's request does;
    nothing without one, on a step where reuse did not act, or when neither can tell."""
    asked = []

    def frames_of(value):
        return lambda: asked.append(value) or value

    bias = math.log(1 + IMAGE_GAIN_PER_STRENGTH)
    no_plan = GuidanceBoost(None, 0.0, 1.0)
    assert no_plan.last_frame_bias(0.5, frames_of((1, 1, 0))) == pytest.approx(bias)
    assert no_plan.last_frame_bias(0.5, frames_of((1, 0, 0))) == 0.0
    assert no_plan.last_frame_bias(0.5, frames_of(None)) == 0.0 and no_plan.last_frame_bias(0.5) == 0.0
    assert no_plan.last_frame_bias(0.5, lambda: 1 / 0) == 0.0  # never raises
    assert no_plan.biased_calls == 0  # the call's first-frame bias counts it
    plan = _hit()
    hit = GuidanceBoost(plan, 0.0, 1.0)
    plan.state.image_frames = (1, 1, 0)
    assert hit.last_frame_bias(0.75) == pytest.approx(bias)  # the request's, where the forward is not asked
    assert hit.last_frame_bias(0.75, frames_of(None)) == pytest.approx(bias)  # ... or cannot tell
    asked.clear()
    # a window of a first-last-frame request that does not end the video: its own frames hold no end image
    assert hit.last_frame_bias(0.75, frames_of((1, 0, 0))) == 0.0 and asked == [(1, 0, 0)]
    assert hit.last_frame_bias(0.75, frames_of((0, 1, 0))) == pytest.approx(bias)  # the window that ends it
    assert hit.last_frame_bias(0.6, frames_of((1, 1, 0))) == 0.0  # not a step of the entry
    plan.state.image_frames = (1, 0, 0)
    assert hit.last_frame_bias(0.75) == 0.0
    assert GuidanceBoost(plan, 1.0, 0.0).last_frame_bias(0.75, frames_of((1, 1, 0))) == 0.0  # image strength 0


def test_image_biased_attention_biases_the_last_frame_too():
    q, k, v = make_qkv(batch=1, heads=2, q_len=300, seed=4)
    first, last = math.log(1.5), math.log(1.3)
    out = image_biased_attention(q, k, v, 100, first, 100, last)
    assert_matches_oracle(out, q, k, v, None, 64, prefix_len=100, prefix_bias=first, suffix_len=100, suffix_bias=last)
    only_first = image_biased_attention(q, k, v, 100, first)
    assert (out - only_first).abs().max() > 1e-3
    assert torch.equal(image_biased_attention(q, k, v, 0, 0.0, 100, 0.0),
                       torch.nn.functional.scaled_dot_product_attention(q, k, v))
    with pytest.raises(ValueError, match="disjoint"):
        image_biased_attention(q, k, v, 200, first, 101, last)
    with pytest.raises(ValueError, match="finite"):
        image_biased_attention(q, k, v, 100, first, 100, math.inf)


@pytest.mark.parametrize("name", ["strength", "image_strength", "cfg_strength"])
@pytest.mark.parametrize("bad", [-0.1, 5.1, math.nan, math.inf, "1", True])
def test_bad_strength_raises(name, bad):
    with pytest.raises(ValueError, match=name):
        GuidanceBoost(None, **{name: bad})


def test_cfg_correction_amplifies_the_guidance_direction_where_cfg_above_one():
    g = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(1, 4, 2, 3, 3, generator=g), torch.randn(1, 4, 2, 3, 3, generator=g)
    cfg = 3.0
    denoised = uncond + cfg * (cond - uncond)
    hit = GuidanceBoost(_hit(), 0.0, 0.0, 1.0)
    out = hit.cfg_correction(denoised, cond, uncond, cfg, torch.tensor([0.5]))
    scaled = uncond + cfg * (1 + CFG_GAIN_PER_STRENGTH) * (cond - uncond)  # the step at cfg x 1.2
    torch.testing.assert_close(out, scaled, rtol=1e-6, atol=1e-6)
    assert hit.cfg_corrected_calls == 1
    # left alone: cfg 1 (no uncond prediction), a non-step sigma, a miss, strength 0, missing/odd inputs
    assert hit.cfg_correction(cond, cond, uncond, 1.0, 0.5) is cond
    assert hit.cfg_correction(denoised, cond, uncond, cfg, 0.6) is denoised
    assert GuidanceBoost(Plan.miss("m"), 0, 0, 2.0).cfg_correction(denoised, cond, uncond, cfg, 0.5) is denoised
    assert GuidanceBoost(None, 1.0, 1.0, 0.0).cfg_correction(denoised, cond, uncond, cfg, 0.5) is denoised
    for bad in ((None, uncond, cfg), (cond, None, cfg), (cond, uncond[..., :2], cfg), (cond, uncond, math.nan),
                (cond, uncond, "x")):
        assert hit.cfg_correction(denoised, *bad, 0.5) is denoised


def test_bad_plan_raises():
    with pytest.raises(ValueError, match="plan"):
        GuidanceBoost(object(), 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length,prefix_len", [(300, 100), (97, 36)])
def test_image_biased_attention_matches_oracle(dtype, length, prefix_len):
    q, k, v = make_qkv(batch=2, heads=2, q_len=length, dtype=dtype, seed=length)
    bias = math.log(1.5)
    out = image_biased_attention(q, k, v, prefix_len, bias)
    assert out.dtype == dtype and out.shape == q.shape
    assert_matches_oracle(out, q, k, v, None, 64, prefix_len=prefix_len, prefix_bias=bias)
    assert (out.double() - dense_attention_oracle(q, k, v)).abs().max() > 1e-3
    assert torch.equal(image_biased_attention(q, k, v, prefix_len, 0.0),
                       torch.nn.functional.scaled_dot_product_attention(q, k, v))
    with pytest.raises(ValueError, match="prefix_len"):
        image_biased_attention(q, k, v, length + 1, bias)


def test_engine_applies_the_bias_on_the_sparse_path_and_in_dense_calls():
    """ChorusAttention with a first-frame bias: a hit's sparse call equals the biased block-sparse
    oracle; a miss's dense call (the host's dense_fn replaced) equals the biased dense oracle."""
    from chorus.engine import ChorusAttention, SparseConfig
    from chorus.engine.model_info import ModelInfo

    grid, bs = (3, 5, 20), 64  # 300 tokens, first frame 100 tokens (ends inside block 1)
    q, k, v = make_qkv(batch=1, heads=2, q_len=300, seed=9)
    info = ModelInfo("wan2.2-a14b-i2v", "WanModel", 1, 2, 64, 16, "fp0", True, "")
    qb = 5
    band = torch.zeros(2, qb, qb, dtype=torch.bool)
    for i in range(qb):
        band[:, i, max(0, i - 1):i + 1] = True
    band[:, :, :2] = True  # the first frame's key blocks, as the recorder's keep-set stores them
    sig = {"variant": info.variant, "experts": [info.fingerprint], "num_layers": 1, "num_heads": 2,
           "token_grid": list(grid), "step_sigmas": [0.5], "block_size": bs}
    hit = Plan("hit", masks={(0, 0, 0, 0): band}, entry_meta={"signature": sig}, similarity=0.95, entry_id=1)
    handle = ChorusAttention(hit, SparseConfig(k_min=1, block_size=bs, backend="reference", pooled_tail=False), info)
    bias = math.log(1.4)
    out = handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=grid, dense_fn=None, first_frame_bias=bias)
    assert hit.stats.sparse_calls == 1 and hit.stats.fallback_calls == 0
    used = handle.used_map(0, 0)
    want = dense_attention_oracle(q, k, v, used, bs, prefix_len=100, prefix_bias=bias)
    assert (out.double() - want).abs().max() < 1e-5
    plain = handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=grid, dense_fn=None)
    assert (plain.double() - want).abs().max() > 1e-3

    miss = Plan.miss("m")
    dense_handle = ChorusAttention(miss, SparseConfig(block_size=bs), info)
    out = dense_handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=grid, dense_fn=None, first_frame_bias=bias)
    assert (out.double() - dense_attention_oracle(q, k, v, prefix_len=100, prefix_bias=bias)).abs().max() < 1e-5

    # a first-last-frame request: the last frame's 100 keys (the raster suffix) get the bias too, sparse and dense
    both = handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=grid, dense_fn=None, first_frame_bias=bias,
                                 last_frame_bias=bias)
    want = dense_attention_oracle(q, k, v, used, bs, prefix_len=100, prefix_bias=bias, suffix_len=100, suffix_bias=bias)
    assert (both.double() - want).abs().max() < 1e-5 and (both - out).abs().max() > 1e-3
    assert hit.stats.fallback_calls == 0
    out = dense_handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=grid, dense_fn=None, first_frame_bias=bias,
                                      last_frame_bias=bias)
    want = dense_attention_oracle(q, k, v, prefix_len=100, prefix_bias=bias, suffix_len=100, suffix_bias=bias)
    assert (out.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["tile", "regions"])
def test_a_hit_in_a_token_order_biases_the_end_image_where_the_order_ends_with_it(kind):
    """A hit whose entry is in a token order: in a region order of an odd frame count the last frame is the order's
    suffix, and the sparse call biases it as the dense call does; in a tile order of an odd frame count (the last
    slab holds two frames) it is not: the sparse call keeps the first-frame bias, leaves the end image's out and
    says so once."""
    from chorus.engine import ChorusAttention, SparseConfig
    from chorus.engine.model_info import ModelInfo
    from chorus.kernels.tile_order import cached_region_order, cached_tile_order

    grid, bs = (5, 8, 16), 128  # 640 tokens, 5 blocks, frames of 128 tokens
    order = cached_tile_order(grid, bs) if kind == "tile" else cached_region_order(grid, (2, 8, 8), bs)
    assert order.last_frame_is_suffix == (kind == "regions")
    q, k, v = make_qkv(batch=1, heads=2, q_len=640, seed=11)
    info = ModelInfo("wan2.2-a14b-i2v", "WanModel", 1, 2, 64, 16, "fp0", True, "")
    sig = {"variant": info.variant, "experts": [info.fingerprint], "num_layers": 1, "num_heads": 2,
           "token_grid": list(grid), "step_sigmas": [0.5], "block_size": bs, "token_order": order.name}
    hit = Plan("hit", masks={(0, 0, 0, 0): torch.ones(2, 5, 5, dtype=torch.bool)}, entry_meta={"signature": sig},
               similarity=0.95, entry_id=1)
    handle = ChorusAttention(hit, SparseConfig(k_min=1, block_size=bs, backend="reference", pooled_tail=False), info)
    assert handle.token_order(grid) is not None
    bias = math.log(1.4)
    out = handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=grid, dense_fn=None, first_frame_bias=bias,
                                last_frame_bias=bias)
    end = dict(suffix_len=128, suffix_bias=bias) if kind == "regions" else {}
    want = dense_attention_oracle(q, k, v, prefix_len=128, prefix_bias=bias, **end)  # a full map: dense, biased
    assert (out.double() - want).abs().max() < 1e-5
    assert hit.stats.sparse_calls == 1 and hit.stats.fallback_calls == 0
    noted = [m for m in hit.stats.messages if "end-image bias is not applied" in m]
    assert (len(noted) == 1 and order.name in noted[0]) if kind == "tile" else not noted, hit.stats.messages


def test_a_failing_biased_dense_call_falls_back_to_plain_dense(monkeypatch):
    """Where SDPA cannot run the masked call (e.g. out of memory without a fused kernel), the dense call
    runs without the bias, with a note, and sampling goes on."""
    import chorus.engine.guidance as guidance_module
    from chorus.engine import ChorusAttention, SparseConfig
    from chorus.engine.model_info import ModelInfo

    def broken(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(guidance_module, "image_biased_attention", broken)
    q, k, v = make_qkv(batch=1, heads=2, q_len=300, seed=2)
    info = ModelInfo("wan2.2-a14b-i2v", "WanModel", 1, 2, 64, 16, "fp0", True, "")
    plan = Plan.miss("m")
    handle = ChorusAttention(plan, SparseConfig(block_size=64), info)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=(3, 5, 20), dense_fn=sdpa, first_frame_bias=0.3)
    assert torch.equal(out, sdpa(q, k, v))
    assert any("image bias not applied" in m for m in plan.stats.messages), plan.stats.messages
