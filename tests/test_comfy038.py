"""ComfyUI 0.38.x's calling conventions and its core "Model Sparse Attention" node, on the vendored
0.3.64 host with ComfyUI's tiny ``WanModel`` (CPU, random weights).

``tests/host/comfy038.py`` gives the host 0.38.x's ``wrap_attn`` (single-owner q/k/v containers,
``preferred_attention`` popped, ``scale=`` / ``enable_gqa=``), its Wan attention and block calling
convention (``block_index`` in ``transformer_options``, contiguous stream, FFN with the GELU folded in)
and its ``prepare_state(timestep, model_options)``; ``tests/host/nodes_sparse_attention.py`` is a
stand-in for the core node that re-installs its override on top at every step through that callback
and chains the previous override for the calls it declines. Covers: Chorus's override, block patches
(feature reuse) and guidance in the 0.38.x convention give what they give in 0.3.64's; containers
are taken once; ``scale`` is honoured on a miss and on a hit; ``enable_gqa``, low-precision refusals
and unknown kwargs run dense with a note; with the core node before or after Chorus's nodes a hit
really runs Chorus's map (sparse calls counted, the core node's sparse attention never runs on
self-attention) and a miss really records dense attention (output equal to the unpatched model's);
without a sparse sampler part the core node keeps self-attention; the UI / log lines say so; another
pack's patch inside Wan's blocks (``attn1_patch`` / ``attn2_patch``, MultiTalk's audio) makes feature reuse
run the blocks in full, a post-block ``double_block`` patch does not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from host import comfy038, nodes_sparse_attention as core  # tests/host (pytest pythonpath)
from host import tiny_wan as tiny
from testing import full_map_hit

SKIP_REASON = tiny.import_comfy()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")

from chorus.engine import ChorusAttention, ModelInfo, Plan, SparseConfig  # noqa: E402
from chorus.engine.feature_reuse import FeatureReuseConfig  # noqa: E402

LATENT = (1, 16, 5, 32, 32)  # grid (5, 16, 16) = 1280 tokens = 10 blocks of 128
LAYERS = 3
STEPS = 2                    # model calls per run: steps 2-4 of 4, cfg 1
SPARSE = SparseConfig(top_p=0.9, k_min=1, block_size=128)
OVERRIDE = "optimized_attention_override"


@pytest.fixture(scope="module")
def model():
    return tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0, num_layers=LAYERS))


@pytest.fixture(scope="module")
def latent():
    return torch.randn(LATENT, generator=torch.Generator().manual_seed(7))


@pytest.fixture
def conv038(monkeypatch):
    comfy038.install(monkeypatch)
    return monkeypatch


@pytest.fixture(scope="module")
def cp():
    from chorus.nodes import comfy_patch

    return comfy_patch


def _sample(m, latent):
    return tiny.sample_last_steps(m, latent)


def _miss():
    return Plan.miss("test miss", latent_shape=LATENT[1:], embedding=np.ones(4, np.float32))


def _patch(m, plan, *, sparse=True, feature_reuse=False, guidance=0.0):
    from chorus.nodes import feature_reuse as fr_node, guidance_boost, sparse_sampler

    if sparse:
        m, _, _ = sparse_sampler.patch_model(m, plan, SPARSE)
    if feature_reuse:
        m, _, _ = fr_node.patch_feature_reuse(m, plan, FeatureReuseConfig(downsample_share=0.5))
    if guidance:
        m, _, _ = guidance_boost.patch_guidance(m, plan, guidance, 0.0)
    return m


# -- the 0.38.x attention convention, call by call ----------------------------------------------------

GRID = (2, 4, 4)  # 32 tokens, 2 heads of 128


@pytest.fixture(autouse=True)
def _no_current_forward():
    from chorus.engine import attend

    yield
    attend.activate(None)


def _direct(cp, plan, sparse=SPARSE):
    """``(override, options, attention)``: the Chorus override and a forward's options as the patch's
    DIFFUSION_MODEL wrapper makes them (its ForwardContext made current), for direct override calls."""
    from chorus.engine import attend

    info = ModelInfo("wan", "wan2.2-a14b-i2v", LAYERS, 2, 128, 36, "fp")
    attention = ChorusAttention(plan, sparse, info)
    attend.activate(attend.ForwardContext(attention, None, GRID, 0.5, [0], plan.note))
    options = {cp.MODE_KEY: "attend" if plan.is_hit else "record", cp.TOKENS_KEY: GRID[0] * GRID[1] * GRID[2]}
    return cp.ChorusOverride.chaining(None), options, attention


def _qkv(kv_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 32, 256, generator=gen)
    return q, torch.randn(1, 32, 128 * kv_heads, generator=gen), torch.randn(1, 32, 128 * kv_heads, generator=gen)


def test_containers_are_taken_once_and_preferred_attention_is_never_invented(cp, conv038):
    seen = []

    def spy(q, k, v, heads, **kwargs):
        seen.append((tuple(type(t).__name__ for t in (q, k, v)), sorted(kwargs)))
        return comfy038.sdpa_backend(q, k, v, heads, **kwargs)

    attention = comfy038.wrap_attn(spy)
    plan = Plan.miss("test", latent_shape=(16, 2, 8, 8))
    patch, options, _ = _direct(cp, plan)
    q, k, v = _qkv()
    boxes = [comfy038.AttentionTensorContainer(t) for t in (q, k, v)]
    options = dict(options, **{OVERRIDE: patch, "block_index": 1})
    out = attention(*boxes, heads=2, preferred_attention=comfy038.ComfyAttention(), transformer_options=options)
    assert all(b.tensor is None for b in boxes)  # each taken exactly once (a second take would have raised)
    assert seen == [(("Tensor",) * 3, ["_inside_attn_wrapper", "transformer_options"])]
    torch.testing.assert_close(out, comfy038.sdpa_backend(q, k, v, 2), rtol=0, atol=0)  # a miss: dense
    assert plan.stats.recorded_calls == 1 and sorted(k[2] for k in plan.recorder.block_maps()) == [1]

    # a chained caller that does pass preferred_attention (0.38.x's wrap_attn pops it): handed on as is
    preferred = comfy038.ComfyAttention()
    calls = []

    def func(q_, k_, v_, heads, **kwargs):
        calls.append(kwargs.get("preferred_attention"))
        return q_

    text = torch.randn(1, 7, 256)
    patch(func, q, text, text, heads=2, preferred_attention=preferred, transformer_options=options)  # cross
    patch(func, q, k, v, heads=2, preferred_attention=preferred, transformer_options=options)  # self: dense
    assert calls == [preferred, preferred]


def test_scale_is_honoured_on_a_miss_and_on_a_hit(cp):
    q, k, v = _qkv(seed=1)
    want = comfy038.sdpa_backend(q, k, v, 2, scale=0.02)
    default = comfy038.sdpa_backend(q, k, v, 2)
    assert (want - default).abs().max() > 0.05  # the scale matters for these inputs

    miss = Plan.miss("test", latent_shape=(16, 2, 8, 8))
    patch, options, _ = _direct(cp, miss)
    out = patch(comfy038.sdpa_backend, q, k, v, heads=2, scale=0.02, transformer_options=options)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert miss.stats.recorded_calls == 1

    info = ModelInfo("wan", "wan2.2-a14b-i2v", LAYERS, 2, 128, 36, "fp")
    sig = {"format": 1, "family": "wan", "variant": info.variant, "experts": [info.fingerprint],
           "num_layers": LAYERS, "num_heads": 2, "latent_shape": [16, 2, 8, 8], "token_grid": list(GRID),
           "block_size": 16, "token_order": "thw", "step_sigmas": [0.5], "head_groups": 1}
    masks = {(0, 0, layer, 0): torch.ones(2, 2, 2, dtype=torch.bool) for layer in range(LAYERS)}
    hit = Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": sig})
    patch, options, attention = _direct(cp, hit, SparseConfig(top_p=0.9, k_min=1, block_size=16))
    attention.begin_run([0.5, 0.0])
    out = patch(comfy038.sdpa_backend, q, k, v, heads=2, scale=0.02, transformer_options=dict(options, block_index=0))
    attention.end_run()
    assert hit.stats.sparse_calls == 1, hit.stats.messages
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)  # every block kept: Chorus's path = dense


@pytest.mark.parametrize("kwargs, note", [
    ({"enable_gqa": True}, "grouped-query attention"),
    ({"low_precision_attention": False}, "low_precision_attention=False"),
    ({"attn_window": 4}, "Chorus does not know (attn_window)"),
])
def test_calls_chorus_cannot_take_run_dense_with_a_note(cp, kwargs, note):
    plan = Plan.miss("test", latent_shape=(16, 2, 8, 8))
    patch, options, _ = _direct(cp, plan)
    q, k, v = _qkv(kv_heads=1 if kwargs.get("enable_gqa") else 2, seed=2)
    out = patch(comfy038.sdpa_backend, q, k, v, heads=2, transformer_options=options, **kwargs)
    torch.testing.assert_close(out, comfy038.sdpa_backend(q, k, v, 2, **kwargs), rtol=0, atol=0)
    assert plan.stats.recorded_calls == 0 and plan.stats.fallback_calls == 1
    assert any(note in m for m in plan.stats.messages), plan.stats.messages


def test_enable_gqa_with_as_many_kv_heads_is_taken(cp):
    plan = Plan.miss("test", latent_shape=(16, 2, 8, 8))
    patch, options, _ = _direct(cp, plan)
    q, k, v = _qkv(seed=3)
    patch(comfy038.sdpa_backend, q, k, v, heads=2, enable_gqa=True, transformer_options=options)
    assert plan.stats.recorded_calls == 1 and plan.stats.fallback_calls == 0


# -- sampling in the 0.38.x convention -----------------------------------------------------------------

def test_sampling_in_the_038_convention_matches_0364_on_a_miss_and_a_hit(model, latent, monkeypatch):
    """Sparse sampler + feature reuse + guidance: the miss records and returns the unpatched model's
    output bit for bit in either convention; the hit (full maps, half the regions pooled) runs every
    self-attention call sparse and gives the same output in both conventions."""
    dense_0364 = _sample(model, latent)
    miss = _miss()
    assert torch.equal(_sample(_patch(model, miss, feature_reuse=True, guidance=0.5), latent), dense_0364)
    hit = full_map_hit(miss)
    hit_0364 = _sample(_patch(model, hit, feature_reuse=True, guidance=0.5), latent)
    reduced_0364 = hit.state.feature_reuse.blocks_reduced
    assert hit.stats.sparse_calls == STEPS * LAYERS and reduced_0364 > 0

    comfy038.install(monkeypatch)
    dense_038 = _sample(model, latent)
    torch.testing.assert_close(dense_038, dense_0364, rtol=1e-5, atol=1e-5)  # the double is the same model
    miss038 = _miss()
    assert torch.equal(_sample(_patch(model, miss038, feature_reuse=True, guidance=0.5), latent), dense_038)
    assert miss038.stats.recorded_calls == STEPS * LAYERS and miss038.stats.fallback_calls == 0
    assert sorted({key[2] for key in miss038.recorder.block_maps()}) == list(range(LAYERS))
    hit038 = full_map_hit(miss038)
    hit_038 = _sample(_patch(model, hit038, feature_reuse=True, guidance=0.5), latent)
    assert hit038.stats.sparse_calls == STEPS * LAYERS and hit038.stats.fallback_calls == 0, hit038.stats.messages
    assert hit038.state.feature_reuse.blocks_reduced == reduced_0364
    torch.testing.assert_close(hit_038, hit_0364, rtol=1e-4, atol=1e-4)
    assert not torch.equal(hit_038, dense_038)  # feature reuse and guidance acted


def test_feature_reuse_runs_blocks_in_full_where_another_pack_s_attention_patch_reads_the_sequence(model, latent,
                                                                                                      conv038):
    """0.38.x's Wan calls ``attn1_patch`` / ``attn2_patch`` patches inside each block with the block's tokens
    (ComfyUI's MultiTalk audio patch lays them out by ``grid_sizes``, which a compact sequence breaks): with such a
    patch a hit with feature reuse runs every block in full, sparse as before, and says why; a post-block
    ``double_block`` patch sees the whole sequence either way, so feature reuse still reduces beside it; a
    ``cross_attn`` patch (earlier MultiTalk versions' key, not called by these doubles) is taken as the first kind."""
    tokens = LATENT[2] * (LATENT[3] // 2) * (LATENT[4] // 2)
    seen = {"attn1_patch": [], "attn2_patch": [], "double_block": []}

    def by_grid(name):
        def patch(args):
            x = args["img"] if name == "double_block" else args["x"]
            grid = args["transformer_options"]["grid_sizes"]
            seen[name].append(x.shape[1])
            if x.shape[1] != grid[0] * grid[1] * grid[2]:
                raise RuntimeError(f"{name}: {x.shape[1]} tokens do not lay out as the grid {tuple(grid)}")
            return {"img": x} if name == "double_block" else x
        return patch

    miss = _miss()
    _sample(_patch(model, miss, feature_reuse=True), latent)  # records the entry's maps and region scores
    hit = full_map_hit(miss)
    patched = _patch(model, hit, feature_reuse=True).clone()
    patched.set_model_attn1_patch(by_grid("attn1_patch"))
    patched.set_model_attn2_patch(by_grid("attn2_patch"))
    out = _sample(patched, latent)
    assert torch.isfinite(out).all()
    assert seen["attn1_patch"] == seen["attn2_patch"] == [tokens] * (STEPS * LAYERS)
    assert hit.stats.sparse_calls == STEPS * LAYERS and hit.stats.fallback_calls == 0, hit.stats.messages
    assert hit.state.feature_reuse.blocks_reduced == 0
    assert any("attn1_patch, attn2_patch" in m and "run in full" in m for m in hit.stats.messages), hit.stats.messages

    hit = full_map_hit(miss)
    patched = _patch(model, hit, feature_reuse=True).clone()
    patched.set_model_patch(by_grid("double_block"), "double_block")
    _sample(patched, latent)
    assert seen["double_block"] == [tokens] * (STEPS * LAYERS)
    assert hit.state.feature_reuse.blocks_reduced > 0 and hit.stats.sparse_calls == STEPS * LAYERS

    hit = full_map_hit(miss)  # earlier MultiTalk versions' key for the same kind of patch
    patched = _patch(model, hit, feature_reuse=True).clone()
    patched.set_model_patch(by_grid("cross_attn"), "cross_attn")
    _sample(patched, latent)
    assert hit.state.feature_reuse.blocks_reduced == 0 and hit.stats.sparse_calls == STEPS * LAYERS
    assert any("(cross_attn," in m for m in hit.stats.messages), hit.stats.messages


# -- ComfyUI's core Model Sparse Attention node in the same graph -------------------------------------

@pytest.mark.parametrize("order", ["core_first", "chorus_first"])
def test_with_the_core_node_a_miss_records_dense_and_a_hit_runs_chorus_map(model, latent, conv038, cp, order):
    stand_in = core.SparseAttnPatch()

    def graph(plan):
        if order == "core_first":
            return _patch(core.apply(model, stand_in), plan)
        return core.apply(_patch(model, plan), stand_in)

    dense = _sample(model, latent)
    miss = _miss()
    patched = graph(miss)
    assert torch.equal(_sample(patched, latent), dense)  # the recording saw dense attention, nothing else ran
    assert miss.stats.recorded_calls == STEPS * LAYERS and miss.stats.fallback_calls == 0
    # the text cross-attention, declined; applied first, the node wraps Chorus's override again at the
    # first step, so its two overrides (above and below Chorus's) each decline it
    assert stand_in.sparse_calls == 0
    assert stand_in.declined_calls == STEPS * LAYERS * (2 if order == "core_first" else 1)
    assert stand_in.installs == (2 if order == "core_first" else 1)
    assert any("Model Sparse Attention node is on this model" in m for m in miss.stats.messages), miss.stats.messages

    hit = full_map_hit(miss)
    sparse_before = stand_in.sparse_calls
    out = _sample(graph(hit), latent)
    assert hit.stats.sparse_calls == STEPS * LAYERS and hit.stats.dense_calls == 0, hit.stats.messages
    assert stand_in.sparse_calls == sparse_before  # Chorus's map won every self-attention call
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-4)  # full maps: Chorus's path = dense


def test_the_core_node_alone_and_without_the_routing_takes_self_attention(model, latent, conv038, cp, monkeypatch):
    """The controls: the stand-in really is a different, sparse attention; and without Chorus taking
    the top back per forward, the core node on top takes every self-attention call (nothing recorded)."""
    from chorus.nodes import override_stack

    stand_in = core.SparseAttnPatch()
    dense = _sample(model, latent)
    assert not torch.allclose(_sample(core.apply(model, stand_in), latent), dense, atol=1e-3)
    assert stand_in.sparse_calls == STEPS * LAYERS

    def keep_the_top(previous_override, top):
        return override_stack.Route(top=False, passing=previous_override, dense=previous_override)

    monkeypatch.setattr(override_stack, "forward_route", keep_the_top)
    miss = _miss()
    _sample(core.apply(_patch(model, miss), stand_in), latent)
    assert miss.stats.recorded_calls == 0 and stand_in.sparse_calls == 2 * STEPS * LAYERS


def test_without_a_sparse_sampler_the_core_node_keeps_self_attention(model, latent, conv038, cp):
    """Feature reuse / guidance only: Chorus declines self-attention, so the core node runs it sparse
    (and says so in the UI line)."""
    stand_in = core.SparseAttnPatch()
    plan = _miss()
    m = _patch(core.apply(model, stand_in), plan, sparse=False, guidance=0.5)
    line = cp.describe(cp.get_patch(m))
    assert "Model Sparse Attention" in line and "no Chorus Sparse Sampler" in line, line
    _sample(m, latent)
    assert stand_in.sparse_calls == STEPS * LAYERS


def test_patch_time_and_run_lines_say_where_the_core_node_is(model, latent, conv038, cp, caplog):
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

    stand_in = core.SparseAttnPatch()
    plan = _miss()
    out = ChorusSparseSampler.execute(model=core.apply(model, stand_in), plan=plan, top_p=0.9, k_min=1,
                                      refresh_steps=0, backend="auto")
    ui = " ".join(out.ui["text"])
    assert "Model Sparse Attention node is also on this model (applied before this node" in ui, ui
    assert "node order does not matter" in ui

    # applied after: nothing to see at patch time; the sampler run says it (log + the plan's notes)
    later = _miss()
    m = core.apply(_patch(model, later), stand_in)
    assert "Model Sparse Attention" not in cp.describe(cp.get_patch(_patch(model, _miss())))
    with caplog.at_level("WARNING", logger="chorus"):
        _sample(m, latent)
    assert any("Model Sparse Attention node is on this model (applied after the Chorus nodes" in msg
               for msg in later.stats.messages), later.stats.messages
    assert any("Model Sparse Attention" in r.getMessage() for r in caplog.records)


def test_a_failing_chorus_call_logs_one_line_naming_comfyuis_version(model, latent, caplog):
    """A sampler run that fails inside a call Chorus makes (here: the host's attention rejects it, as
    a changed calling convention would) still fails as it would without Chorus, and the log gets ONE
    error line naming ComfyUI's version and the first failing Chorus call; the same failure again is
    not logged twice."""
    from chorus.nodes import host_report

    def changed_backend(func, *args, **kwargs):
        raise TypeError("attention_pytorch() got an unexpected keyword argument 'heads'")

    base = model.clone()
    base.model_options["transformer_options"][OVERRIDE] = changed_backend
    m = _patch(base, _miss())
    for _ in range(2):
        with caplog.at_level("DEBUG", logger="chorus"), pytest.raises(TypeError, match="unexpected keyword"):
            _sample(m, latent)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "sampling failed" in r.getMessage()]
    assert len(lines) == 1, lines
    version = host_report.comfyui_version()
    checkout = (tiny.find_comfyui_dir() / "comfyui_version.py").read_text()
    assert f'__version__ = "{version}"' in checkout, (version, checkout)  # the host's own, read from its checkout
    assert f"ComfyUI {version} (torch {torch.__version__})" in lines[0]
    assert "first failing Chorus call nodes/comfy_call.py:" in lines[0] and "dense_call" in lines[0], lines[0]
    assert "TypeError: attention_pytorch() got an unexpected keyword argument 'heads'" in lines[0]
    assert "\n" not in lines[0]


def test_feature_reuse_runs_blocks_in_full_under_an_override_that_replaces_chorus_s(model, latent, conv038):
    """0.38.x's core Model Attention Backend node (``ModelPatcher.set_model_optimized_attention``) and the
    SageAttention patch nodes put an override in the slot that calls their own backend instead of the one
    they replaced. Applied after the Chorus nodes, it takes every attention call: a reduced block's
    self-attention would run on the compact sequence as if it were the whole one. So a hit's feature reuse
    runs every block in full there, with a note; an override that shows what it chains (``previous_override``)
    is seen through and feature reuse reduces beside it."""
    taken = []

    def optimized_attention_override(func, *args, **kwargs):  # as the backend node installs it: its own backend
        taken.append(args[0].shape[1])  # q's length (0.38.x: [B, L, H*D] or in a container)
        return func(*args, **kwargs)

    class Timer:  # an override that chains the one it replaced and says so
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        @property
        def previous_override(self):
            return self.inner

        def __call__(self, func, *args, **kwargs):
            self.calls += 1
            return self.inner(func, *args, **kwargs)

    miss = _miss()
    _sample(_patch(model, miss, feature_reuse=True), latent)  # records the entry's maps and region scores
    hit = full_map_hit(miss)
    patched = _patch(model, hit, feature_reuse=True).clone()
    patched.model_options["transformer_options"][OVERRIDE] = optimized_attention_override
    assert torch.isfinite(_sample(patched, latent)).all()
    tokens = LATENT[2] * (LATENT[3] // 2) * (LATENT[4] // 2)
    assert len(taken) == 2 * STEPS * LAYERS and set(taken) == {tokens}  # self- and cross-attention, none compact
    assert hit.state.feature_reuse.blocks_reduced == 0 and hit.stats.sparse_calls == 0
    assert any("feature reuse: another attention override (" in m and "optimized_attention_override" in m
               and "runs every block in full" in m for m in hit.stats.messages), hit.stats.messages

    hit = full_map_hit(miss)
    patched = _patch(model, hit, feature_reuse=True).clone()
    options = patched.model_options["transformer_options"]
    options[OVERRIDE] = timer = Timer(options[OVERRIDE])
    _sample(patched, latent)
    assert timer.calls > 0 and hit.state.feature_reuse.blocks_reduced > 0
    assert hit.stats.sparse_calls == STEPS * LAYERS and hit.stats.fallback_calls == 0, hit.stats.messages
    assert not any("runs every block in full" in m for m in hit.stats.messages), hit.stats.messages
