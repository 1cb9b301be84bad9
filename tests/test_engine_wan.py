"""The engine driven through ComfyUI's real ``WanModel`` (tiny, random weights) on CPU.

Skips with a visible reason when no ComfyUI checkout is found (COMFYUI_DIR, /opt/ComfyUI, or the
ComfyUI folder the pack sits in). Covers: sampling through ``comfy.sample.sample`` with a patched
model (miss records every (step, layer); a hit then runs every self-attention call sparse),
routing by sigma with KSamplerAdvanced-style slices and the Wan 2.2 A14B split across two models
patched with one plan, cond-only recording under CFG, the full-map equality with dense attention
against an fp64 oracle, and the override chaining / fallbacks.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch

from host import tiny_wan as tiny  # tests/host (pytest pythonpath)

SKIP_REASON = tiny.import_comfy()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")

from chorus.cache_store import Workspace  # noqa: E402
from chorus.engine import Plan, SparseConfig, build_signature, commit_plan, retrieve_plan  # noqa: E402

BS = 32                       # small blocks so the tiny latent has several: 3 x 8 x 8 = 192 tokens = 6 blocks
LATENT = (1, 16, 3, 16, 16)   # [B, C, T, H, W]
GRID = (3, 8, 8)
CONFIG = SparseConfig(top_p=0.9, k_min=1, block_size=BS)


@pytest.fixture(scope="module")
def adapter():
    """The ComfyUI glue: ``patch_model`` (ChorusSparseSampler's part of the model's Chorus patch),
    ``comfy_model_info`` (LoRA-aware identity) and the patch module itself."""
    import types

    from chorus.nodes import comfy_adapter, comfy_patch, sparse_sampler

    return types.SimpleNamespace(patch_model=sparse_sampler.patch_model,
                                 comfy_model_info=comfy_adapter.comfy_model_info, patch=comfy_patch)


@pytest.fixture(scope="module")
def experts():
    """Two tiny Wan 2.2 A14B-I2V shaped models with different weights (high / low noise experts)."""
    return [tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=s)) for s in (0, 1)]


def _conds(seed=3):
    return tiny.random_conditioning(seed), tiny.random_conditioning(seed + 100)


def _sample(model, *, steps=4, cfg=1.0, start_step=None, last_step=None, latent=None, seed=0,
            disable_noise=False, force_full_denoise=True):
    import comfy.sample

    positive, negative = _conds()
    latent_image = torch.zeros(LATENT) if latent is None else latent
    noise = torch.zeros(LATENT) if disable_noise else comfy.sample.prepare_noise(latent_image, seed)
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative, latent_image,
                               start_step=start_step, last_step=last_step, force_full_denoise=force_full_denoise,
                               disable_noise=disable_noise, disable_pbar=True, seed=seed)


def _embedding(seed):
    return np.random.default_rng(seed).standard_normal(16).astype(np.float32)


def _full_hit(plan_like: Plan, keys) -> Plan:
    """A hit whose every map keeps every block, built from a recorded plan's signature."""
    from chorus.engine import build_signature

    sig = build_signature(plan_like)
    qb = -(-GRID[0] * GRID[1] * GRID[2] // BS)
    masks = {k: torch.ones(2, qb, qb, dtype=torch.bool) for k in keys}
    return Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": sig},
                latent_shape=LATENT, embedding=_embedding(0))


def test_miss_records_every_step_and_layer_then_hit_runs_sparse(tmp_path, adapter, experts):
    ws = Workspace.open(tmp_path / "ws")
    plan = retrieve_plan(ws, _embedding(0), LATENT, similarity_threshold=0.9)
    assert not plan.is_hit and "no entries" in plan.message
    model, _, msg = adapter.patch_model(experts[0], plan, CONFIG)
    assert "patched wan2.2-a14b-i2v" in msg
    dense_out = _sample(experts[0])
    miss_out = _sample(model)
    torch.testing.assert_close(miss_out, dense_out, rtol=0, atol=0)  # recording returns the dense result unchanged
    assert plan.stats.recorded_calls == 4 * 2 and plan.stats.fallback_calls == 0
    assert "wrote entry" in commit_plan(ws, plan)
    masks, meta = ws.load(1, touch=False)
    assert sorted(masks) == [(0, s, l, 0) for s in range(4) for l in range(2)]
    sig = meta["signature"]
    assert sig["token_grid"] == list(GRID) and len(sig["step_sigmas"]) == 4 and sig["block_size"] == BS

    hit = retrieve_plan(ws, _embedding(0) + 0.01, LATENT, similarity_threshold=0.9)
    assert hit.is_hit and hit.entry_id == 1 and hit.similarity > 0.99
    patched, _, _ = adapter.patch_model(experts[0], hit, CONFIG)
    out = _sample(patched)
    assert torch.isfinite(out).all()
    assert hit.stats.sparse_calls == 4 * 2 and hit.stats.fallback_calls == 0 and hit.stats.dense_calls == 0
    assert 0 < hit.stats.density <= 1
    assert "hit: updated stats of entry 1" in commit_plan(ws, hit)
    assert ws.entries()[0]["hits"] == 1
    # the hit's run stats are the entry's: its sparse calls, of them with the pooled tail (on by default)
    assert ws.entries()[0]["runs"] == {"sparse_calls": hit.stats.sparse_calls, "tail_calls": hit.stats.tail_calls,
                                       "fallback_calls": 0}
    assert hit.stats.tail_calls == hit.stats.sparse_calls > 0


def test_a14b_split_two_models_one_plan_routes_by_sigma(adapter, experts):
    """KSamplerAdvanced high (steps 0-2 of 4, leftover noise) then low (2-4, no added noise)."""
    plan = Plan.miss("test", embedding=_embedding(1), latent_shape=LATENT)
    high, _, _ = adapter.patch_model(experts[0], plan, CONFIG)
    low, _, _ = adapter.patch_model(experts[1], plan, CONFIG)
    mid = _sample(high, start_step=0, last_step=2, force_full_denoise=False)
    _sample(low, start_step=2, last_step=10000, latent=mid, disable_noise=True)
    maps = plan.recorder.block_maps()
    assert sorted(maps) == sorted([(0, s, l, 0) for s in (0, 1) for l in range(2)]
                                  + [(1, s, l, 0) for s in (2, 3) for l in range(2)])
    assert [e.fingerprint for e in plan.experts] == [
        adapter.comfy_model_info(experts[0]).fingerprint, adapter.comfy_model_info(experts[1]).fingerprint]

    # the full schedule of a plain 4-step run is the one the split run recorded
    import comfy.samplers

    full = comfy.samplers.calculate_sigmas(experts[0].get_model_object("model_sampling"), "simple", 4)
    np.testing.assert_allclose(plan.recorder.step_sigmas(), full[:-1].tolist(), rtol=1e-5)

    # one hit plan drives both experts; every call is sparse on the right expert's maps
    hit = _full_hit(plan, maps.keys())
    high, _, _ = adapter.patch_model(experts[0], hit, CONFIG)
    low, _, _ = adapter.patch_model(experts[1], hit, CONFIG)
    mid = _sample(high, start_step=0, last_step=2, force_full_denoise=False)
    _sample(low, start_step=2, last_step=10000, latent=mid, disable_noise=True)
    assert hit.is_hit and hit.stats.sparse_calls == 8 and hit.stats.fallback_calls == 0, hit.stats.messages


def test_hit_with_other_model_or_schedule_is_demoted(adapter, experts):
    plan = Plan.miss("test", embedding=_embedding(2), latent_shape=LATENT)
    model, _, _ = adapter.patch_model(experts[0], plan, CONFIG)
    _sample(model, steps=2)
    maps = plan.recorder.block_maps()
    # another model's weights: demoted to a miss that records, output stays dense
    hit = _full_hit(plan, maps.keys())
    other, _, _ = adapter.patch_model(experts[1], hit, CONFIG)
    torch.testing.assert_close(_sample(other, steps=2), _sample(experts[1], steps=2), rtol=0, atol=0)
    assert not hit.is_hit and "another model" in hit.message and hit.stats.sparse_calls == 0
    assert hit.recorder.complete
    # another step count: the schedule differs from the entry's -> demoted before any sparse call
    hit = _full_hit(plan, maps.keys())
    model, _, _ = adapter.patch_model(experts[0], hit, CONFIG)
    _sample(model, steps=3)
    assert not hit.is_hit and "schedule" in hit.message and hit.recorder.complete


def test_cfg_records_cond_rows_only(adapter, experts, monkeypatch):
    from chorus import kernels

    seen = []
    real = kernels.block_mass

    def spy(q, k, **kw):
        seen.append(q.shape[0])
        return real(q, k, **kw)

    monkeypatch.setattr(kernels, "block_mass", spy)
    plan = Plan.miss("test", embedding=_embedding(3), latent_shape=LATENT)
    model, _, _ = adapter.patch_model(experts[0], plan, CONFIG)
    _sample(model, steps=2, cfg=3.0)  # cond and uncond are evaluated at every step
    assert seen and all(b == 1 for b in seen)  # only the positive row of each call is recorded
    assert plan.stats.recorded_calls == 2 * 2 and plan.stats.dense_calls == 2 * 2


def _direct_forward(model_patcher, x, t, context, dtype, extra_options=None):
    """One diffusion-model call with the patcher's transformer_options and wrappers (as sampling does)."""
    dm = model_patcher.model.diffusion_model
    options = copy.deepcopy(model_patcher.model_options.get("transformer_options", {}))
    options["wrappers"] = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in model_patcher.wrappers.items()}
    options.update(extra_options or {})
    with torch.no_grad():
        return dm(x.to(dtype), t.to(dtype), context.to(dtype), transformer_options=options).double()


@contextlib.contextmanager
def _host_pure_torch_forms():
    """The host's own PyTorch forms of RoPE and its other fused ops (ComfyUI after 0.3.64 picks them with
    ``model_management.in_training``; its comfy_kitchen forms, the same math, take no float64)."""
    import comfy.model_management as mm

    if not hasattr(mm, "in_training"):  # 0.3.64: PyTorch forms only
        yield
        return
    before, mm.in_training = mm.in_training, True
    try:
        yield
    finally:
        mm.in_training = before


def test_full_block_map_equals_dense_within_oracle_tolerance(adapter):
    """Patched (hit, every block kept) vs unpatched model output, against an fp64 run of the model."""
    sd = tiny.tiny_wan_state_dict(seed=5)
    model = tiny.load_tiny_wan(sd)
    qb = -(-GRID[0] * GRID[1] * GRID[2] // BS)
    sigma = 0.75
    sig = {"format": 1, "family": "wan", "variant": "wan2.2-a14b-i2v",
           "experts": [adapter.comfy_model_info(model).fingerprint], "num_layers": 2, "num_heads": 2,
           "latent_shape": list(LATENT[1:]), "token_grid": list(GRID), "block_size": BS, "token_order": "thw",
           "step_sigmas": [sigma], "head_groups": 1}
    masks = {(0, 0, l, 0): torch.ones(2, qb, qb, dtype=torch.bool) for l in range(2)}
    hit = Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": sig})
    patched, attention, _ = adapter.patch_model(model, hit, CONFIG)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 36, *LATENT[2:], generator=gen)
    t = torch.tensor([sigma * 1000.0])
    context = torch.randn(1, 512, 4096, generator=gen)
    extra = {"sigmas": torch.tensor([sigma]), "cond_or_uncond": [0]}
    dense32 = _direct_forward(model, x, t, context, torch.float32, extra)
    attention.begin_run([sigma, 0.0])
    sparse32 = _direct_forward(patched, x, t, context, torch.float32, extra)
    attention.end_run()
    assert hit.stats.sparse_calls == 2 and hit.stats.fallback_calls == 0, hit.stats.messages

    model64 = tiny.load_tiny_wan({k: v.double() for k, v in sd.items()})
    model64.model.diffusion_model.double()
    model64.model.diffusion_model.patch_embedding.float()  # WanModel runs its patch embedding in fp32 always
    with _host_pure_torch_forms():
        oracle = _direct_forward(model64, x, t, context, torch.float64, extra)
    err_dense = (dense32 - oracle).abs().max().item()
    err_sparse = (sparse32 - oracle).abs().max().item()
    assert err_dense > 0
    assert err_sparse <= 2 * err_dense, (err_sparse, err_dense)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_full_map_hit_in_16_bits_matches_dense_as_closely(dtype):
    """Sampled through the nodes in the 16-bit dtype the model computes in (fp16: what ComfyUI's loader picks for
    Wan on a GPU with fp16, from any weight file), a full-map hit is as close to the fp32 model as ComfyUI's own
    dense attention in that dtype (within 2x its error), every call sparse; ``tests/test_comfy_gpu.py`` asks the
    same of the GPU kernels at a token count not a multiple of 128."""
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

    latent = torch.randn(LATENT, generator=torch.Generator().manual_seed(0))
    oracle = tiny.sample_last_steps(tiny.tiny_wan_in(torch.float32), latent)
    model = tiny.tiny_wan_in(dtype)
    dense = tiny.sample_last_steps(model, latent)
    hit = tiny.full_map_hit(model, latent)  # 192 tokens: 2 blocks of 128, the last partial
    out = tiny.sample_last_steps(ChorusSparseSampler.execute(model, hit).result[0], latent)
    assert hit.is_hit and hit.stats.sparse_calls == 2 * tiny.TINY_LAYERS and hit.stats.fallback_calls == 0, \
        hit.stats.messages
    err_dense, err_hit = ((x - oracle).norm().item() / oracle.norm().item() for x in (dense, out))
    print(f"{dtype}: dense {err_dense:.3g}, hit {err_hit:.3g}")
    assert 0 < err_hit <= 2 * err_dense, (err_hit, err_dense)


def test_override_chains_previous_and_leaves_cross_attention_alone(adapter, experts):
    calls = []

    def previous(func, *args, **kwargs):
        calls.append((args[0].shape[1], args[1].shape[1]))
        return func(*args, **kwargs)

    base = experts[0].clone()
    base.model_options["transformer_options"]["optimized_attention_override"] = previous
    plan = Plan.miss("test", embedding=_embedding(4), latent_shape=LATENT)
    model, _, _ = adapter.patch_model(base, plan, CONFIG)
    # re-patching replaces the Chorus patch instead of stacking a second one
    model, _, _ = adapter.patch_model(model, plan, CONFIG)
    override = model.model_options["transformer_options"]["optimized_attention_override"]
    assert isinstance(override, adapter.patch.ChorusOverride) and override.previous is previous
    assert adapter.patch.get_patch(model).previous_override is previous
    assert "optimized_attention_override" not in experts[0].model_options["transformer_options"]
    _sample(model, steps=2)
    tokens = GRID[0] * GRID[1] * GRID[2]
    assert (tokens, tokens) in calls and (tokens, 512) in calls  # self (dense under recording) and text cross
    assert plan.stats.recorded_calls == 2 * 2
    # deep copies (clone() of model_options) keep the one shared handle
    override = model.model_options["transformer_options"]["optimized_attention_override"]
    assert copy.deepcopy(override) is override and copy.deepcopy(plan) is plan


def test_block_index_from_transformer_options_wins(adapter):
    """Newer ComfyUI puts block_index into transformer_options: the override uses it as the layer."""
    from chorus.engine import ChorusAttention, ModelInfo

    info = ModelInfo("wan", "wan2.2-a14b-i2v", 4, 2, 128, 36, "fp")
    plan = Plan.miss("test", latent_shape=LATENT)
    from chorus.engine import attend

    cp = adapter.patch
    attention = ChorusAttention(plan, CONFIG, info)
    tokens = GRID[0] * GRID[1] * GRID[2]
    q = torch.randn(1, tokens, 256)

    def func(q, k, v, heads, **kw):
        return q

    attend.activate(attend.ForwardContext(attention, None, GRID, 0.5, [0], plan.note))
    try:
        for layer in (3, 1):
            opts = {cp.MODE_KEY: "record", cp.TOKENS_KEY: tokens, "block_index": layer}
            cp.ChorusOverride.chaining(None)(func, q, q, q, heads=2, transformer_options=opts)
    finally:
        attend.activate(None)
    assert sorted(k[2] for k in plan.recorder.block_maps()) == [1, 3]


def test_a_block_s_region_scores_take_the_layer_of_its_own_self_attention_call():
    """A block patch records a miss's region scores without a layer (it holds no layer index, so one patch serves
    every layer of a compiled model): the context gives them the layer of the self-attention call since the
    previous block's record (the counter, or the host's ``block_index``); a block whose self-attention never
    reached Chorus gets a note and no scores, not its predecessor's layer."""
    from chorus.engine import attend

    class RegionScores:  # the context's collaborator, recording what it is handed
        def __init__(self):
            self.layers = []

        def record_block(self, x, y, *, layer, sigma, grid):
            self.layers.append(layer)

    scores, notes = RegionScores(), []
    context = attend.ForwardContext(None, None, GRID, 0.5, note=notes.append, feature_reuse=scores)
    x = torch.zeros(1, GRID[0] * GRID[1] * GRID[2], 8)
    for hint in (-1, -1, 5):  # two counted self-attention calls, then one with the host's block index
        context.next_layer(hint)
        context.record_block(x, x)
    context.record_block(x, x)  # no self-attention call since the last block
    context.next_layer()
    context.record_block(x, x)
    assert scores.layers == [0, 1, 5, 3], scores.layers
    assert notes == ["feature reuse: a block whose self-attention did not reach Chorus; no region scores from it"]


def test_unsupported_model_passes_through_with_message(adapter):
    sd = tiny.tiny_wan_state_dict(seed=0, in_dim=16)  # a Wan text-to-video model
    model = tiny.load_tiny_wan(sd)
    plan = Plan.miss("test", latent_shape=LATENT)
    patched, attention, msg = adapter.patch_model(model, plan, CONFIG)
    assert attention is None and "not supported" in msg and patched is not model
    assert "optimized_attention_override" not in patched.model_options["transformer_options"]
    assert any("unsupported model" in m for m in plan.stats.messages)


@pytest.mark.parametrize("variant,kwargs,channels", [
    ("wan2.1-i2v", dict(i2v_clip=True), 16),
    ("wan2.2-ti2v-5b", dict(in_dim=48, out_dim=48), 48),
    ("wan2.2-a14b-i2v", dict(), 16),
])
def test_each_supported_variant_records_then_reuses(adapter, variant, kwargs, channels):
    """Wan 2.1 I2V (CLIP image projection), Wan 2.2 TI2V 5B (48 channels, per-frame timesteps) and a
    Wan 2.2 A14B expert: detected, recorded on a miss, every call sparse on the hit."""
    import comfy.sample

    model = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=9, **kwargs))
    assert adapter.comfy_model_info(model).variant == variant
    latent = torch.zeros(1, channels, 2, 8, 8)
    positive, negative = _conds()

    def sample(m):
        noise = comfy.sample.prepare_noise(latent, 0)
        return comfy.sample.sample(m, noise, 2, 1.0, "euler", "simple", positive, negative, latent,
                                   disable_pbar=True, seed=0)

    plan = Plan.miss("test", embedding=_embedding(5), latent_shape=latent.shape)
    patched, _, _ = adapter.patch_model(model, plan, CONFIG)
    sample(patched)
    maps = plan.recorder.block_maps()
    assert len(maps) == 2 * 2 and plan.stats.fallback_calls == 0, plan.stats.messages
    hit = Plan("hit", entry_id=1, similarity=1.0, masks=maps, entry_meta={"signature": build_signature(plan)})
    patched, _, _ = adapter.patch_model(model, hit, CONFIG)
    assert torch.isfinite(sample(patched)).all()
    assert hit.is_hit and hit.stats.sparse_calls == 2 * 2 and hit.stats.fallback_calls == 0, hit.stats.messages


def test_fingerprint_is_stable_under_in_place_lora_patching(adapter):
    """ComfyUI applies weight patches (LoRAs) in place when it loads a model: the fingerprint must not
    depend on whether that happened yet, but must change with the patches themselves."""
    model = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=11))
    base_fp = adapter.comfy_model_info(model).fingerprint
    dm = model.model.diffusion_model
    keys = ["patch_embedding.weight", "head.head.weight", "blocks.0.self_attn.q.weight"]
    lora = model.clone()
    lora.add_patches({f"diffusion_model.{k}": (torch.zeros_like(dict(dm.named_parameters())[k]),) for k in keys}, 0.5)
    fp_unloaded = adapter.comfy_model_info(lora).fingerprint
    assert fp_unloaded != base_fp
    with torch.no_grad():  # what loading with the patches applied does to the weights
        saved = {k: dict(dm.named_parameters())[k].clone() for k in keys}
        for k in keys:
            dict(dm.named_parameters())[k].add_(0.1)
        fp_loaded = adapter.comfy_model_info(lora).fingerprint
        for k in keys:
            dict(dm.named_parameters())[k].copy_(saved[k])
    assert fp_loaded == fp_unloaded
    other = model.clone()
    other.add_patches({f"diffusion_model.{k}": (torch.zeros_like(dict(dm.named_parameters())[k]),) for k in keys}, 1.0)
    assert adapter.comfy_model_info(other).fingerprint not in (fp_unloaded, base_fp)


def test_fingerprint_is_the_same_before_and_after_a_dynamic_vram_load(adapter):
    """ComfyUI 0.38.x with dynamic VRAM (its default on NVIDIA GPUs) keeps the weights as the file stores
    them until the model is loaded, then casts small ones in place to the dtype it recorded when it built
    the model (``<name>_comfy_model_dtype`` on the owning module). Here: a bf16 model from an fp32 file.
    Unloaded, loaded, and as a host without dynamic VRAM loads it (bf16 from the start), the fingerprint is
    the same; the raw values alone would give two."""
    from chorus.engine import weights_fingerprint

    model = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=12))
    dm = model.model.diffusion_model
    with torch.no_grad():  # as built by a bf16 host, then given the file's fp32 tensors (assign=True)
        for module in dm.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, f"{name}_comfy_model_dtype", torch.bfloat16)
                param.data = (param.data.float() + 1e-3 * torch.randn_like(param.data.float())).float()
    fp32_values = {name: p.data.clone() for name, p in dm.named_parameters()}
    unloaded = adapter.comfy_model_info(model)
    raw_unloaded = weights_fingerprint(dm)
    with torch.no_grad():  # the load: every parameter cast in place to its recorded dtype
        for param in dm.parameters():
            param.data = param.data.to(torch.bfloat16)
    loaded = adapter.comfy_model_info(model)
    assert unloaded.supported and unloaded.fingerprint == loaded.fingerprint
    assert weights_fingerprint(dm) != raw_unloaded  # what rounding to the recorded dtype removes

    plain = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=12))  # no dynamic VRAM, no recorded dtypes
    with torch.no_grad():
        for name, param in plain.model.diffusion_model.named_parameters():
            param.data = fp32_values[name].to(torch.bfloat16)
    assert adapter.comfy_model_info(plain).fingerprint == loaded.fingerprint


def test_a_model_with_scaled_rope_has_its_own_fingerprint(adapter):
    """ComfyUI's ScaleROPE node (``transformer_options["rope_options"]``, read by 0.38.x's Wan) moves the
    positions attention sees: such a model's masks are its own, so its fingerprint differs; the node's
    identity values change nothing."""
    model = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=13))
    base = adapter.comfy_model_info(model).fingerprint

    def with_rope(**rope):
        m = model.clone()
        m.model_options.setdefault("transformer_options", {})["rope_options"] = rope
        return adapter.comfy_model_info(m).fingerprint

    identity = dict(scale_t=1.0, scale_y=1.0, scale_x=1.0, shift_t=0.0, shift_y=0.0, shift_x=0.0)
    assert with_rope(**identity) == base
    scaled = with_rope(**dict(identity, scale_t=0.5))
    assert scaled != base and scaled == with_rope(**dict(identity, scale_t=0.5))
    assert with_rope(**dict(identity, shift_x=4.0)) not in (base, scaled)


def _image_conds(end_image: bool, seed=3):
    """The (positive, negative) CONDITIONING of a start-image or a first-last-frame request
    (``tiny.with_input_images``)."""
    return tuple(tiny.with_input_images(cond, LATENT, end_image, seed) for cond in _conds(seed))


def _sample_conds(model, conds, steps=2):
    import comfy.sample

    latent_image = torch.zeros(LATENT)
    noise = comfy.sample.prepare_noise(latent_image, 0)
    return comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", conds[0], conds[1], latent_image,
                               disable_pbar=True, seed=0)


def test_an_entry_serves_only_requests_with_images_on_the_same_latent_frames(tmp_path, adapter, experts):
    """A start-image request's entry is not reused for a first-last-frame request (its attention runs to a second
    image frame: the map does not fit it), nor the other way round: the hit moves to the entry recorded with the
    same images, or, where none is, is demoted before any sparse call (dense, recording the new entry). Entries
    record the frames as ``image_frames`` (first, last, other)."""
    from chorus.engine.model_info import image_frames

    start, first_last = _image_conds(end_image=False), _image_conds(end_image=True)
    info = adapter.comfy_model_info(experts[0])
    ws = Workspace.open(tmp_path / "ws")

    def request(conds):
        plan = retrieve_plan(ws, _embedding(7), LATENT, similarity_threshold=0.9)
        # top-p 0.4: the random model's near-uniform rows leave blocks out, so the keep-sets show
        model, _, _ = adapter.patch_model(experts[0], plan, SparseConfig(top_p=0.4, k_min=1, block_size=BS))
        out = _sample_conds(model, conds)
        return plan, out, commit_plan(ws, plan)

    plan, _, written = request(start)
    assert not plan.is_hit and "wrote entry 1" in written
    assert ws.load(1, touch=False)[1]["signature"]["image_frames"] == [1, 0, 0]

    plan, out, written = request(first_last)  # entry 1 found, and demoted: another image layout
    assert not plan.is_hit and plan.stats.sparse_calls == 0, plan.message
    assert "recorded with a start image (1 first, 0 last, 0 other latent frames), this request has a start and " \
           "an end image (1 first, 1 last" in plan.message, plan.message
    torch.testing.assert_close(out, _sample_conds(experts[0], first_last), rtol=0, atol=0)  # dense
    assert "wrote entry 2" in written and ws.load(2, touch=False)[1]["signature"]["image_frames"] == [1, 1, 0]
    # every row of the new entry keeps the end image's key blocks (the last frame: blocks 4, 5), as every row keeps
    # the start image's; the start-image entry's rows keep the last frame's blocks only where their mass asked
    end_image_kept = [bool(m[..., 4:].all()) for m in ws.load(2, touch=False)[0].values()]
    assert end_image_kept and all(end_image_kept)
    assert all(bool(m[..., :2].all()) for m in ws.load(1, touch=False)[0].values())
    assert not all(bool(m[..., 4:].all()) for m in ws.load(1, touch=False)[0].values())

    plan, _, _ = request(first_last)  # entry 1 ranks first (equal similarity, lower id): the hit moves to 2
    assert plan.is_hit and plan.entry_id == 2 and plan.stats.sparse_calls == 2 * 2, plan.stats.messages
    assert any("hit moved from entry 1" in m for m in plan.stats.messages), plan.stats.messages
    plan, _, _ = request(start)
    assert plan.is_hit and plan.entry_id == 1 and plan.stats.sparse_calls == 2 * 2, plan.stats.messages

    # what the forward's input tells: ComfyUI's I2V input channels [noise, mask (4), image]
    x = torch.zeros(2, 36, 5, 4, 4)
    x[:, 16:20, 0] = 1.0
    assert image_frames(x, info) == (1, 0, 0)
    x[:, 19, 4] = 1.0  # an end image covers the last of its frame's four pixel frames
    assert image_frames(x, info) == (1, 1, 0)
    x[:, 16:20, 2] = 1.0
    assert image_frames(x, info) == (1, 1, 1)
    assert image_frames(torch.zeros(2, 36, 5, 4, 4), info) == (0, 0, 0)
    assert image_frames(torch.zeros(2, 16, 5, 4, 4), info) is None  # not this model's input


def test_guidance_biases_the_end_image_as_the_start_image(tmp_path, adapter, experts, monkeypatch):
    """Guidance's image bias on a first-last-frame hit (full maps: sparse attention computes dense attention): the
    last frame's keys (the end image; the raster sequence's suffix) get the bias the first frame's get, in the sparse
    kernel (guidance with ChorusSparseSampler; the plan tells the end image) and in the guidance-only dense call
    (the forward tells it) alike: the two agree, and both differ from the same run biasing the start image alone."""
    from chorus.engine.guidance import GuidanceBoost
    from chorus.nodes import guidance_boost
    from testing import full_map_hit

    first_last = _image_conds(end_image=True)
    miss = retrieve_plan(Workspace.open(tmp_path / "ws"), _embedding(7), LATENT, similarity_threshold=0.9)
    _sample_conds(adapter.patch_model(experts[0], miss, CONFIG)[0], first_last)
    assert build_signature(miss)["image_frames"] == [1, 1, 0]

    hit = full_map_hit(miss)
    sparse = _sample_conds(guidance_boost.patch_guidance(adapter.patch_model(experts[0], hit, CONFIG)[0], hit,
                                                         0.0, 2.0)[0], first_last)
    assert hit.stats.sparse_calls == 2 * 2 and hit.stats.fallback_calls == 0, hit.stats.messages
    assert not any("end-image bias" in m for m in hit.stats.messages), hit.stats.messages
    dense = _sample_conds(guidance_boost.patch_guidance(experts[0], full_map_hit(miss), 0.0, 2.0)[0], first_last)
    monkeypatch.setattr(GuidanceBoost, "last_frame_bias", lambda self, sigma, image_frames=None: 0.0)
    start_only = _sample_conds(guidance_boost.patch_guidance(experts[0], full_map_hit(miss), 0.0, 2.0)[0], first_last)
    effect = float((dense - start_only).abs().mean() / start_only.abs().mean())
    mismatch = float((sparse - dense).abs().mean() / start_only.abs().mean())
    # measured here: effect 9.7e-5 (random weights, 2 steps, one frame of three), mismatch 4e-8
    assert effect > 3e-5 and mismatch < 0.01 * effect, (effect, mismatch)


def test_wan22_5b_image_to_video_and_text_to_video_keep_their_own_entries(adapter):
    """Wan 2.2 TI2V 5B runs both from one model: with a start image (ComfyUI's Wan22ImageToVideoLatent keeps the
    first latent frame through a noise mask, its timestep 0) an entry records ``[1, 0, 0]``; a text-to-video
    request of the same latent is not served from it (demoted before any sparse call), and records ``[0, 0, 0]``."""
    import comfy.sample

    model = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=9, in_dim=48, out_dim=48))
    latent = torch.zeros(1, 48, 3, 8, 8)
    kept_first = torch.ones(1, 1, 3, 8, 8)
    kept_first[:, :, 0] = 0.0

    def sample(plan, noise_mask):
        patched, _, _ = adapter.patch_model(model, plan, CONFIG)
        noise = comfy.sample.prepare_noise(latent, 0)
        comfy.sample.sample(patched, noise, 2, 1.0, "euler", "simple", *_conds(), latent, noise_mask=noise_mask,
                            disable_pbar=True, seed=0)

    image_to_video = Plan.miss("test", embedding=_embedding(6), latent_shape=latent.shape)
    sample(image_to_video, kept_first)
    signature = build_signature(image_to_video)
    assert signature["image_frames"] == [1, 0, 0]
    hit = Plan("hit", entry_id=1, similarity=1.0, masks=image_to_video.recorder.block_maps(),
               entry_meta={"signature": signature}, latent_shape=latent.shape, embedding=_embedding(6))
    sample(hit, None)
    assert not hit.is_hit and hit.stats.sparse_calls == 0 and "this request has no input image" in hit.message
    assert build_signature(hit)["image_frames"] == [0, 0, 0]
