"""Feature reuse and guidance boost through ComfyUI's real ``WanModel`` (tiny, random weights, CPU).

Skips with a visible reason when no ComfyUI checkout is found (COMFYUI_DIR, /opt/ComfyUI, or the
ComfyUI folder the pack sits in). The sampler is ComfyUI's own (``comfy.sample.sample``), the models
are ``ModelPatcher``s patched by the nodes' functions, in both orders with ChorusSparseSampler.

The input latent is smooth in its right half and textured in its left half; the sampler starts at
step 2 of 4 with no added noise, so every run sees the same input and the miss run's region scores
have something to find.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from host import tiny_wan as tiny  # tests/host (pytest pythonpath)
from testing import full_map_hit

SKIP_REASON = tiny.import_comfy()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")

from chorus.engine import Plan, SparseConfig, build_signature  # noqa: E402
from chorus.engine.feature_reuse import FeatureReuseConfig, feature_state  # noqa: E402
from chorus.kernels import pooling  # noqa: E402

BS = 128
LATENT = (1, 16, 5, 32, 32)         # grid (5, 16, 16) = 1280 tokens = 10 blocks of 128
GRID = (5, 16, 16)
REGION = (2, 8, 8)
LAYERS = 3
SPARSE = SparseConfig(top_p=0.9, k_min=1, block_size=BS)


@pytest.fixture(scope="module")
def nodes():
    from chorus.nodes import feature_reuse, guidance_boost, sparse_sampler

    return sparse_sampler, feature_reuse, guidance_boost


@pytest.fixture(scope="module")
def model():
    return tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0, num_layers=LAYERS))


def smooth_textured_latent(seed=0):
    """Low-frequency content everywhere, plus strong pixel texture where latent x < 16 (token w < 8)."""
    g = torch.Generator().manual_seed(seed)
    _, c, t, h, w = LATENT
    tt, yy, xx = torch.meshgrid(torch.arange(t, dtype=torch.float32), torch.arange(h, dtype=torch.float32),
                                torch.arange(w, dtype=torch.float32), indexing="ij")
    lat = torch.zeros(LATENT)
    for ch in range(c):
        fy, fx, ft, ph = (torch.rand(4, generator=g) * torch.tensor([0.15, 0.15, 0.3, 6.28])).tolist()
        lat[0, ch] = torch.sin(fy * yy + fx * xx + ft * tt + ph)
    texture = torch.randn(LATENT, generator=g) * 1.5
    lat[..., :16] += texture[..., :16]
    return lat


def _sample(m, latent):
    import comfy.sample

    positive, negative = tiny.random_conditioning(3), tiny.random_conditioning(103)
    noise = torch.zeros(LATENT)
    return comfy.sample.sample(m, noise, 4, 1.0, "euler", "simple", positive, negative, latent, start_step=2,
                               last_step=10000, force_full_denoise=True, disable_noise=True, disable_pbar=True,
                               seed=0)


def _hit_from(miss: Plan, token_order=None) -> Plan:
    """A hit on the miss's own entry, every block kept (``testing.full_map_hit``)."""
    return full_map_hit(miss, token_order)


def _seam_and_deviation(out, dense, regions):
    """Seam: mean |jump of the error field| across the w-boundaries of the downsampled regions (latent
    pixels on both sides), relative to the mean |dense|. Deviation: mean |out - dense| / mean |dense|."""
    err = (out - dense).abs().sum(1)[0]  # [T, H, W] latent
    scale = float(dense.abs().sum(1).mean())
    counts = pooling.region_counts(GRID, REGION)
    jumps = []
    for r in regions.tolist():
        a, rem = divmod(r, counts[1] * counts[2])
        b, c = divmod(rem, counts[2])
        t0, t1 = a * REGION[0], (a + 1) * REGION[0]
        y0, y1 = 2 * b * REGION[1], 2 * (b + 1) * REGION[1]
        for x_in, x_out in ((2 * c * REGION[2], 2 * c * REGION[2] - 1), (2 * (c + 1) * REGION[2] - 1, 2 * (c + 1) * REGION[2])):
            if 0 <= x_out < err.shape[-1]:
                jumps.append((err[t0:t1, y0:y1, x_in] - err[t0:t1, y0:y1, x_out]).abs().mean())
    seam = float(torch.stack(jumps).mean()) / scale
    return seam, float((out - dense).abs().sum(1).mean()) / scale


def _patch(nodes, model, plan, *, fr_config=None, order="sparse_first", strength=None, image_strength=0.0):
    adapter, fr_node, gb_node = nodes
    m = model
    steps = ["sparse", "fr"] if order == "sparse_first" else ["fr", "sparse"]
    for step in steps:
        if step == "sparse":
            m, _, _ = adapter.patch_model(m, plan, SPARSE)
        elif fr_config is not None:
            m, _, _ = fr_node.patch_feature_reuse(m, plan, fr_config)
    if strength is not None:
        m, _, _ = gb_node.patch_guidance(m, plan, strength, image_strength)
    return m


@pytest.fixture(scope="module")
def recorded(nodes, model):
    """Dense output, and a miss run (sparse sampler + feature reuse) that recorded region scores."""
    latent = smooth_textured_latent()
    dense = _sample(model, latent)
    miss = Plan.miss("test miss", latent_shape=LATENT[1:], embedding=np.ones(4, np.float32))
    out_miss = _sample(_patch(nodes, model, miss, fr_config=FeatureReuseConfig()), latent)
    return latent, dense, miss, out_miss


def test_downsampling_leaves_no_seam_where_skipping_does(nodes, model, recorded):
    latent, dense, miss, out_miss = recorded
    torch.testing.assert_close(out_miss, dense, rtol=0, atol=0)  # recording changes nothing
    fr_meta = miss.request_meta["feature_reuse"]
    assert fr_meta["token_grid"] == list(GRID) and len(fr_meta["scores"]["0"]) == 2  # 2 steps, expert 0

    # the scores found the smooth half: the selected (share 0.25 = 2 of 8) regions are the smooth ones
    sigma0 = max(fr_meta["scores"]["0"], key=float)
    regions = pooling.region_cells(GRID, REGION, (2, 2, 2))
    scores = torch.tensor(fr_meta["scores"]["0"][sigma0])
    smooth = regions[:, 0, 0] % GRID[2] >= 8
    assert float(scores[smooth].mean()) > float(scores[~smooth].mean())

    results = {}
    for mode in ("downsample", "skip"):
        hit = _hit_from(miss)
        cfg = FeatureReuseConfig(downsample_share=0.25, mode=mode)
        out = _sample(_patch(nodes, model, hit, fr_config=cfg), latent)
        state = feature_state(hit)
        assert state.blocks_reduced == 2 * (LAYERS - 1) and hit.stats.fallback_calls == 0
        if mode == "downsample":  # self-attention stayed sparse (full maps) on every call, on the full grid
            assert hit.stats.sparse_calls == 2 * LAYERS
        used = _selected_regions(hit)
        results[mode] = _seam_and_deviation(out, dense, used)
        assert used.numel() >= 2 and bool(smooth[used].all())
    hit_only = _hit_from(miss)
    out_sparse = _sample(_patch(nodes, model, hit_only), latent)
    base_seam, base_dev = _seam_and_deviation(out_sparse, dense, used)

    (seam_down, dev_down), (seam_skip, dev_skip) = results["downsample"], results["skip"]
    print(f"seam skip {seam_skip:.4g} downsample {seam_down:.4g} sparse-only {base_seam:.3g}; "
          f"deviation skip {dev_skip:.4g} downsample {dev_down:.4g} sparse-only {base_dev:.3g}")
    assert base_seam < 1e-4 and base_dev < 1e-4
    # measured here (torch 2.14 CPU, these seeds): seam skip 0.588 vs downsample 0.0061 (97x);
    # deviation from dense skip 0.133 vs downsample 0.0013 (100x); sparse-only with full maps ~1e-7
    assert seam_skip > 0.1 and seam_skip > 20 * seam_down, (seam_skip, seam_down)
    assert dev_down < 0.1 * dev_skip, (dev_down, dev_skip)


def _selected_regions(plan):
    """Union over the steps of the regions a hit downsamples (what FeatureReuse.layout_for selects)."""
    from chorus.engine.feature_reuse import select_regions

    fr = plan.entry_meta["feature_reuse"]
    picked = [select_regions(torch.tensor(vals), GRID, REGION, 0.25) for vals in fr["scores"]["0"].values()]
    return torch.cat(picked).unique()


@pytest.fixture(scope="module")
def reused(nodes, model, recorded):
    """Hit outputs (sparse sampler + feature reuse, full maps) in both node orders, with their plans."""
    latent, _, miss, _ = recorded
    runs = []
    for order in ("sparse_first", "fr_first"):
        hit = _hit_from(miss)
        runs.append((_sample(_patch(nodes, model, hit, fr_config=FeatureReuseConfig(), order=order), latent), hit))
    return runs


def test_feature_reuse_composes_with_sparse_sampler_in_either_order(recorded, reused):
    _, _, miss, _ = recorded
    assert "feature_reuse" in miss.request_meta and miss.stats.recorded_calls == 2 * LAYERS
    for _, hit in reused:
        assert hit.stats.sparse_calls == 2 * LAYERS and hit.stats.fallback_calls == 0
        assert feature_state(hit).blocks_reduced == 2 * (LAYERS - 1)
    torch.testing.assert_close(reused[0][0], reused[1][0], rtol=0, atol=0)


def test_guidance_strength_zero_is_bit_identical_and_acts_only_on_hits(nodes, model, recorded, reused):
    latent, dense, miss, _ = recorded
    _, _, gb_node = nodes
    # strength 0 through the node's patch function: the model object comes back unpatched
    same, boost, _ = gb_node.patch_guidance(model, miss, 0.0, 0.0)
    assert same is model and boost is None
    # strength 0 inside an installed override chain is bit-identical as well
    from chorus.engine.guidance import GuidanceBoost

    plain = reused[0][0]  # sparse sampler + feature reuse on a hit, no guidance
    hit2 = _hit_from(miss)
    zero = _patch(nodes, model, hit2, fr_config=FeatureReuseConfig())
    from chorus.nodes.comfy_patch import configure

    zero, patch, _ = configure(zero, hit2, guidance=GuidanceBoost(hit2, 0.0, 0.0))  # past the node's shortcut
    assert patch.guidance is not None and patch.attention is not None and patch.feature_reuse is not None
    assert torch.equal(_sample(zero, latent), plain)
    # on a miss (no reuse acted) a boost does nothing
    miss2 = Plan.miss("test miss 2", latent_shape=LATENT[1:], embedding=np.ones(4, np.float32))
    assert torch.equal(_sample(gb_node.patch_guidance(model, miss2, 2.0, 2.0)[0], latent), dense)
    # on a hit it changes the result, in either order with the other nodes
    hit3 = _hit_from(miss)
    boosted = _sample(_patch(nodes, model, hit3, fr_config=FeatureReuseConfig(), strength=1.0), latent)
    assert not torch.equal(boosted, plain) and torch.isfinite(boosted).all()
    # ... and the same result when the guidance node comes first in the chain
    hit4 = _hit_from(miss)
    m = gb_node.patch_guidance(model, hit4, 1.0, 0.0)[0]
    m = _patch(nodes, m, hit4, fr_config=FeatureReuseConfig(), order="fr_first")
    torch.testing.assert_close(_sample(m, latent), boosted, rtol=1e-5, atol=1e-6)
    assert math.isfinite(float(boosted.abs().mean()))


def test_first_frame_bias_is_applied_exactly_once_in_any_node_order(nodes, model, recorded):
    """image_strength on a hit with full maps: ChorusSparseSampler's kernel applies the bias (guidance
    after or before it in the chain), the guidance override applies it as a dense call when there is
    no sparse sampler: the three agree (applied once, never twice or not at all) and differ from the
    unbiased run; with feature reuse too, both node orders agree."""
    latent, dense, miss, _ = recorded
    _, _, gb_node = nodes
    runs = {}
    for name in ("sparse_then_guidance", "guidance_then_sparse", "guidance_only", "sparse_only"):
        hit = _hit_from(miss)
        if name == "sparse_then_guidance":
            m = gb_node.patch_guidance(_patch(nodes, model, hit), hit, 0.0, 2.0)[0]
        elif name == "guidance_then_sparse":
            m = _patch(nodes, gb_node.patch_guidance(model, hit, 0.0, 2.0)[0], hit)
        elif name == "guidance_only":
            m = gb_node.patch_guidance(model, hit, 0.0, 2.0)[0]
        else:
            m = _patch(nodes, model, hit)
        runs[name] = (_sample(m, latent), hit)
    base = runs["sparse_only"][0]
    change = float((runs["guidance_only"][0] - base).abs().mean() / base.abs().mean())
    mismatch = max(float((runs[n][0] - runs["guidance_only"][0]).abs().mean() / base.abs().mean())
                   for n in ("sparse_then_guidance", "guidance_then_sparse"))
    print(f"first-frame bias x1.4: relative change of the output {change:.4g}, between paths {mismatch:.3g}")
    # measured here: change 8.7e-4 (random weights, 2 steps), the paths agree to ~1e-7
    assert change > 3e-4 and mismatch < 0.01 * change, (change, mismatch)
    for name in ("sparse_then_guidance", "guidance_then_sparse"):
        out, hit = runs[name]
        assert hit.stats.sparse_calls == 2 * LAYERS and hit.stats.fallback_calls == 0
    from chorus.nodes.comfy_patch import get_patch

    fr_runs = []
    for order in ("sparse_first", "fr_first"):
        hit = _hit_from(miss)
        m = _patch(nodes, model, hit, fr_config=FeatureReuseConfig(), order=order, strength=0.5, image_strength=2.0)
        boost = get_patch(m).guidance
        fr_runs.append(_sample(m, latent))
        assert boost.biased_calls == 2 * LAYERS and boost.boosted_calls > 0  # 2 steps (cond and uncond in one call)
    torch.testing.assert_close(fr_runs[0], fr_runs[1], rtol=1e-5, atol=1e-6)


def test_guidance_survives_a_failing_biased_attention_call(nodes, model, recorded, monkeypatch):
    """If the biased dense call raises (out of memory where SDPA has no fused masked kernel), the
    call runs plain dense attention (PyTorch SDPA): the result is no image guidance at all, up to the
    rounding between SDPA and the host's CPU attention, far below what the bias changes."""
    import chorus.engine.guidance as guidance_module

    latent, dense, miss, _ = recorded
    _, _, gb_node = nodes
    guided = _sample(gb_node.patch_guidance(model, _hit_from(miss), 0.0, 2.0)[0], latent)

    def broken(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(guidance_module, "image_biased_attention", broken)
    hit = _hit_from(miss)
    out = _sample(gb_node.patch_guidance(model, hit, 0.0, 2.0)[0], latent)
    bias_effect = float((guided - dense).abs().mean())
    assert float((out - dense).abs().mean()) < 0.01 * bias_effect, (float((out - dense).abs().mean()), bias_effect)
    assert any("image bias not applied" in m for m in hit.stats.messages), hit.stats.messages


def test_cfg_correction_runs_the_reused_steps_at_a_higher_cfg(nodes, model, recorded):
    """cfg_strength in ComfyUI's real sampler (cfg 2): without a plan (every step) the result equals a
    plain run at cfg 2 x 1.2; on a miss, or with cfg 1, it is bit-identical to no patch."""
    import comfy.sample

    latent, _, _, _ = recorded
    _, _, gb_node = nodes

    def sample(m, cfg):
        positive, negative = tiny.random_conditioning(3), tiny.random_conditioning(103)
        return comfy.sample.sample(m, torch.zeros(LATENT), 4, cfg, "euler", "simple", positive, negative, latent,
                                   start_step=2, last_step=10000, force_full_denoise=True, disable_noise=True,
                                   disable_pbar=True, seed=0)

    corrected, boost, message = gb_node.patch_guidance(model, None, 0.0, 0.0, 1.0)
    assert "cfg x1.20" in message
    got, want = sample(corrected, 2.0), sample(model, 2.4)
    assert boost.cfg_corrected_calls == 2
    assert float((got - sample(model, 2.0)).abs().mean()) > 100 * float((got - want).abs().mean())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    miss = Plan.miss("m", latent_shape=LATENT[1:], embedding=np.ones(4, np.float32))
    assert torch.equal(sample(gb_node.patch_guidance(model, miss, 0.0, 0.0, 1.0)[0], 2.0), sample(model, 2.0))
    assert torch.equal(sample(corrected, 1.0), sample(model, 1.0))
    twice = gb_node.patch_guidance(corrected, None, 0.0, 0.0, 2.0)[0]  # re-patching replaces, never stacks
    assert len(twice.model_options["sampler_post_cfg_function"]) == 1


@pytest.mark.parametrize("grid,frames,batch", [((4, 8, 8), 4, 1), ((5, 16, 16), 5, 2), ((5, 9, 13), 4, 2)])
def test_per_frame_modulation_compacts_as_its_per_token_copy_would(grid, frames, batch):
    """``compact_per_frame`` (cells' frame shares times the frames' vectors) gives what pooling ComfyUI's per-token
    copy of the modulation (``repeat_e``: whole frames, and a last frame cut short where the tokens do not divide)
    gives, within one bf16 rounding, in float32 and bfloat16."""
    from comfy.ldm.wan.model import repeat_e

    from chorus.nodes.comfy_forward import compact_per_frame

    length = grid[0] * grid[1] * grid[2]
    n = pooling.region_counts(grid, REGION)
    layout = pooling.build_layout(grid, REGION, (2, 2, 2), list(range(0, n[0] * n[1] * n[2], 2)))
    for dtype in (torch.float32, torch.bfloat16):
        vec = torch.randn(batch, frames, 6, 32, generator=torch.Generator().manual_seed(frames)).to(dtype)
        per_token = repeat_e(vec, torch.empty(batch, length, 1))
        want = pooling.pool_tokens_torch(per_token.float(), layout)
        got = compact_per_frame(vec, length, lambda t: pooling.pool_tokens_torch(t, layout))
        assert got.shape == (batch, layout.compact_length, 6, 32) and got.dtype == dtype
        tol = 2 * torch.finfo(dtype).eps * float(want.abs().max())
        assert float((got.float() - want).abs().max()) <= tol, dtype
    assert compact_per_frame(vec[:, :1], length, None) is None  # one vector per sample: nothing to compact


def test_per_frame_modulation_and_a_chained_block_patch_fall_back_safely(nodes):
    """Wan 2.2 TI2V 5B shape (48 channels) with per-frame timesteps ([B, T'] -> vec [B, T', 6, C]): the
    modulation is pooled per token; a layer whose block carries another pack's block patch (which may need
    the whole sequence) runs in full."""
    from chorus.nodes import comfy_patch
    from chorus.nodes.comfy_adapter import comfy_model_info

    _, fr_node, _ = nodes
    ti2v = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=2, in_dim=48, out_dim=48, num_layers=2))
    info = comfy_model_info(ti2v)
    assert info.variant == "wan2.2-ti2v-5b"
    grid = (4, 8, 8)
    n = pooling.region_counts(grid, REGION)  # 2 x 1 x 1 complete regions; frame 0's never pooled
    scores = {"0": {"0.5": [1.0] * (n[0] * n[1] * n[2])}}
    sig = {"variant": info.variant, "experts": [info.fingerprint], "num_layers": 2, "num_heads": 2,
           "token_grid": list(grid), "step_sigmas": [0.5], "block_size": BS}
    meta = {"signature": sig, "feature_reuse": {"version": 1, "token_grid": list(grid), "region": list(REGION),
                                                "pool": [2, 2, 2], "scores": scores}}
    hit = Plan("hit", entry_id=1, similarity=1.0, masks={(0, 0, 0, 0): torch.ones(2, 1, 1, dtype=torch.bool)},
               entry_meta=meta, latent_shape=(48, 4, 16, 16))
    patched, handle, message = fr_node.patch_feature_reuse(ti2v, hit, FeatureReuseConfig(downsample_share=0.5,
                                                                                        full_layers=0))
    # the user is told that on this model it pays only under TorchCompileModel
    assert "Wan 2.2 TI2V 5B it pays only under TorchCompileModel" in message, message
    patch = comfy_patch.get_patch(patched)
    assert patch.feature_reuse is handle
    handle.begin_run([0.5, 0.0])
    dm = ti2v.model.diffusion_model
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 48, 4, 16, 16, generator=g)
    t = torch.tensor([[0.0, 500.0, 500.0, 500.0]])  # frame 0 is the clean start image
    context = torch.randn(1, 512, 4096, generator=g)

    def call(options):
        opts = dict(options, sigmas=torch.tensor([0.5]))
        if comfy_patch.PATCH_KEY in opts:  # what the patch's DIFFUSION_MODEL wrapper does in a sampler run
            opts = patch.begin_forward(x, (x, t, context), {}, opts)
        with torch.no_grad():
            return dm(x, t, context, transformer_options=opts)

    full = call(ti2v.model_options["transformer_options"])
    reduced = call(patched.model_options["transformer_options"])
    state = feature_state(hit)
    assert state.blocks_reduced == 2 and torch.isfinite(reduced).all()
    rel = float((reduced - full).norm() / full.norm())
    assert 0 < rel < 0.5, rel

    def broken(args, extra):
        if args["img"].shape[1] != grid[0] * grid[1] * grid[2]:
            raise RuntimeError("this patch needs the full sequence")
        return extra["original_block"](args)

    opts = dict(patched.model_options["transformer_options"])
    opts["patches_replace"] = {"dit": {("double_block", i): comfy_patch.ChorusBlock.at(True, broken) for i in range(2)}}
    reduced_before = state.blocks_reduced
    out = call(opts)
    # a layer with another block patch runs in full (that patch may need the whole sequence), with a note
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    assert state.blocks_reduced == reduced_before
    assert any("layers [0, 1] carry another block patch" in m for m in hit.stats.messages), hit.stats.messages
    handle.end_run()


def test_a_miss_with_feature_reuse_records_in_region_order_and_its_hit_attends_on_the_compact_sequence(
        nodes, model, recorded):
    """The sparse sampler configured with feature reuse records the miss in the region order
    (``regions2x8x8``: each tile one of feature reuse's regions and one block); a hit of that entry runs
    the downsampled blocks' self-attention on the compact sequence (fewer query and key blocks per call,
    each cell's key weighted as its 8 tokens) and matches the expanded full-grid computation of the same
    (full) maps, an entry relabelled raster."""
    latent, dense, miss, _ = recorded
    assert build_signature(miss)["token_order"] == "regions2x8x8"
    outs, plans = {}, {}
    for label, order in (("compact", None), ("expanded", "thw")):
        hit = _hit_from(miss, token_order=order)
        outs[label] = _sample(_patch(nodes, model, hit, fr_config=FeatureReuseConfig()), latent)
        plans[label] = hit
        assert hit.stats.sparse_calls == 2 * LAYERS and hit.stats.fallback_calls == 0, hit.stats.messages
    qb = 1280 // BS
    # per step: layer 0 in full (qb x qb per head), layers 1-2 on the compact sequence: 2 regions pooled
    # of 128 tokens each -> 16 cells each: 1280 - 256 + 32 = 1056 tokens = 9 x 9 blocks
    assert plans["expanded"].stats.blocks_total == 2 * LAYERS * 2 * qb * qb
    assert plans["compact"].stats.blocks_total == 2 * (2 * qb * qb + 2 * (2 * 9 * 9))
    torch.testing.assert_close(outs["compact"], outs["expanded"], atol=2e-4, rtol=1e-3)
