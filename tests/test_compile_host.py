"""Chorus under ComfyUI's ``TorchCompileModel`` (``comfy_api.torch_helpers.set_torch_compile_wrapper``,
what the node calls) on ComfyUI's tiny ``WanModel``: counted, not assumed.

Two requests of the Wan 2.2 A14B shape (two experts, KSamplerAdvanced-style high 0-2 / low 2-4 of 4
steps) on compiled models: from ``torch._dynamo``'s counters and the graphs the backend receives,
every self-attention call of a forward is inside one graph with its block (``torch.ops.chorus.attend``
once per layer, no graph break inside a transformer block), and the second request compiles nothing
(no new graph, no recompile: steps, sigmas, experts and requests of the same shape reuse the first
request's graphs). A compiled miss records every call and writes its entry, with feature reuse's
region scores recorded inside the graph too; a compiled hit matches the eager hit; a hit with feature
reuse and guidance keeps its reduced blocks inside the graph too and matches the eager one.

ComfyUI's current ``TorchCompileModel`` compiles with a guard filter that drops every guard on
``transformer_options`` (``tests/host/comfy038.py``): the tests marked ``guards`` run both ways, and the
last ones show what that filter needs from Chorus (a plain compiled model in the same process; a hit after
a miss and the layer of each call where the host's attention breaks the graph). One more compiles the
blocks one by one, as KJNodes' compile nodes do by default.

The backend is ``aot_eager`` (dynamo + AOTAutograd with the ops' fake implementations, no code
generation: what breaks or recompiles is decided by dynamo, whatever backend follows). The Wan blocks
attend with ``attention_pytorch`` (SDPA), ComfyUI's attention on a GPU, which the test harness picks on the
CPU too (``tests/host/tiny_wan.py``): ComfyUI's CPU default, ``attention_sub_quad``, reads free memory
through psutil -- a graph break dynamo cannot avoid, also for a dense model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from host import comfy038, tiny_wan as tiny  # tests/host (pytest pythonpath)

SKIP_REASON = tiny.import_comfy()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")


def _whole_model_compiles() -> bool:
    """Whether a Chorus-patched forward is compiled under TorchCompileModel with this torch (>= 2.10)."""
    if SKIP_REASON is not None:
        return True
    from chorus.nodes import comfy_patch

    return comfy_patch.DYNAMO_KEEPS_THE_FORWARD_COMPILED


# tests that count Chorus's ops inside the compiled graphs: before torch 2.10 there are none by design
compiled_forward = pytest.mark.skipif(not _whole_model_compiles(), reason=f"torch {torch.__version__} runs a "
                                      "Chorus-patched forward outside dynamo (test_before_torch_2_10_...)")

LATENT = torch.zeros(1, 16, 3, 16, 16)  # grid (3, 8, 8) = 192 tokens: 2 blocks of 128
# feature reuse pools complete 2x8x8 regions past frame 0: grid (5, 8, 8) has one
LATENT_FR = torch.zeros(1, 16, 5, 16, 16)
LAYERS = tiny.TINY_LAYERS


class CountingBackend:
    """A ``torch.compile`` backend that keeps every FX graph it is given and runs it with aot_eager."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def op_counts(self, name: str) -> list[int]:
        """Per graph, how many calls of ``torch.ops.chorus.<name>`` it holds."""
        target = getattr(torch.ops.chorus, name).default
        counts = []
        for gm in self.graphs:
            counts.append(sum(1 for node in gm.graph.nodes if node.op == "call_function"
                              and node.target in (target, getattr(torch.ops.chorus, name))))
        return counts


@pytest.fixture(scope="module")
def experts():
    return [tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=s)) for s in (0, 1)]


@pytest.fixture()
def nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "cache"))
    import chorus.nodes as nodes_pkg

    return nodes_pkg


@pytest.fixture()
def dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


# TorchCompileModel's guards: all (ComfyUI 0.3.64) or none on transformer_options (current ComfyUI)
GUARDS = {"all": None, "comfyui_filter": comfy038.torch_compile_guard_filter}


def _compiled(model, backend, guards="all"):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    m = model.clone()
    guard_filter = GUARDS[guards]
    set_torch_compile_wrapper(m, backend=backend,
                              options=None if guard_filter is None else {"guard_filter_fn": guard_filter})
    return m


def _request(high, low, seed=0, latent=LATENT):
    """KSamplerAdvanced high (steps 0-2 of 4, leftover noise) then low (2-4, no added noise)."""
    import comfy.sample

    positive, negative = tiny.random_conditioning(3), tiny.random_conditioning(103)
    noise = comfy.sample.prepare_noise(latent, seed)
    mid = comfy.sample.sample(high, noise, 4, 1.0, "euler", "simple", positive, negative, latent, start_step=0,
                              last_step=2, force_full_denoise=False, disable_pbar=True, seed=seed)
    return comfy.sample.sample(low, torch.zeros_like(latent), 4, 1.0, "euler", "simple", positive, negative, mid,
                               start_step=2, last_step=10000, force_full_denoise=True, disable_noise=True,
                               disable_pbar=True, seed=seed)


def _retrieve(nodes, image, latent=LATENT, workspace="compiled"):
    return nodes.ChorusMaskRetrieve.execute(latent={"samples": latent}, workspace=workspace, similarity_threshold=0.9,
                                            start_image=image, positive=tiny.random_conditioning(3),
                                            prompt="a red fox").args[0]


def _patch(nodes, experts, plan, backend=None, feature_reuse=None, guards="all"):
    models = []
    for model in experts:
        if backend is not None:
            model = _compiled(model, backend, guards)
        model = nodes.ChorusSparseSampler.execute(model=model, plan=plan, top_p=0.9, k_min=1, refresh_steps=0,
                                                  backend="auto").args[0]
        if feature_reuse is not None:
            model = nodes.ChorusFeatureReuse.execute(model=model, plan=plan, downsample_share=feature_reuse).args[0]
        models.append(model)
    return models


def _graph_break_reasons(counters) -> list[str]:
    return [reason.splitlines()[0] + " " + reason for reason in counters["graph_break"]]


IMAGE = torch.rand(1, 32, 32, 3, generator=torch.Generator().manual_seed(0))


@compiled_forward
@pytest.mark.parametrize("guards", GUARDS)
def test_compiled_miss_records_then_two_compiled_hits_compile_once(nodes, experts, dynamo, guards):
    backend = CountingBackend()
    miss = _retrieve(nodes, IMAGE)
    assert not miss.is_hit
    out = _request(*_patch(nodes, experts, miss, backend, guards=guards))
    assert torch.isfinite(out).all()
    assert miss.stats.recorded_calls == 4 * LAYERS and miss.stats.dense_calls == 4 * LAYERS
    assert miss.stats.fallback_calls == 0, miss.stats.messages
    written = nodes.ChorusCacheWrite.execute(latent={"samples": out}, plan=miss).args[0]
    assert written.startswith("wrote entry 1") and f"recorded {4 * LAYERS}" in written, written
    # the miss's graphs record every layer: one record_mass per layer, inside the graph of its block
    assert max(backend.op_counts("record_mass")) == LAYERS, backend.op_counts("record_mass")

    eager_hit = _retrieve(nodes, IMAGE)
    assert eager_hit.is_hit
    eager_out = _request(*_patch(nodes, experts, eager_hit))

    outputs, graphs_after = [], []
    for request in range(2):
        plan = _retrieve(nodes, IMAGE)
        assert plan.is_hit and plan.entry_id == 1
        outputs.append(_request(*_patch(nodes, experts, plan, backend, guards=guards)))
        assert plan.stats.sparse_calls == 4 * LAYERS and plan.stats.fallback_calls == 0, plan.stats.summary()
        assert plan.stats.dense_calls == 0
        graphs_after.append((len(backend.graphs), dict(dynamo["stats"]), dict(dynamo["frames"])))  # frames: every compile, recompiles too
    # every self-attention call of a forward is in one graph with its block: one attend per layer
    attend = backend.op_counts("attend")
    assert max(attend) == LAYERS and all(c in (0, LAYERS) for c in attend), attend
    # the only graph breaks are the host side of each forward (torch.compiler.disable'd), none in a block
    reasons = _graph_break_reasons(dynamo)
    assert reasons and all("_begin_forward" in r for r in reasons), reasons
    # the second hit request compiled nothing: no new graph, no recompile
    assert graphs_after[1] == graphs_after[0], graphs_after
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    torch.testing.assert_close(outputs[0], eager_out, rtol=1e-4, atol=1e-4)


def test_before_torch_2_10_a_compiled_chorus_forward_runs_eagerly_once_noted_and_never_recompiles(
        nodes, experts, dynamo, monkeypatch):
    """torch 2.8 / 2.9 recompiled every Chorus-patched forward under TorchCompileModel (the resume frame after the
    host side guards ComfyUI's per-forward bound ``_forward``) until dynamo's limit: there the forward runs outside
    dynamo. Forced here on the CI's torch: a miss records and two hits run sparse with the eager request's output,
    dynamo compiles no Chorus op and no frame twice, and the run's notes say why once."""
    from chorus.nodes import comfy_patch

    monkeypatch.setattr(comfy_patch, "DYNAMO_KEEPS_THE_FORWARD_COMPILED", False)
    backend = CountingBackend()
    miss = _retrieve(nodes, IMAGE)
    out = _request(*_patch(nodes, experts, miss, backend))
    assert miss.stats.recorded_calls == 4 * LAYERS and miss.stats.fallback_calls == 0, miss.stats.messages
    assert sum(f"torch {torch.__version__} recompiles" in m for m in miss.stats.messages) == 1, miss.stats.messages
    nodes.ChorusCacheWrite.execute(latent={"samples": out}, plan=miss)
    eager_out = _request(*_patch(nodes, experts, _retrieve(nodes, IMAGE)))
    frames_after = []
    for request in range(2):
        plan = _retrieve(nodes, IMAGE)
        assert plan.is_hit
        got = _request(*_patch(nodes, experts, plan, backend))
        assert plan.stats.sparse_calls == 4 * LAYERS and plan.stats.fallback_calls == 0, plan.stats.summary()
        torch.testing.assert_close(got, eager_out, rtol=1e-4, atol=1e-4)
        frames_after.append(dict(dynamo["frames"]))  # every compile, recompiles too
    assert all(max(backend.op_counts(op), default=0) == 0 for op in ("attend", "record_mass")), len(backend.graphs)
    assert frames_after[1] == frames_after[0], frames_after


@compiled_forward
def test_compiled_miss_records_region_scores_and_a_feature_reuse_hit_works(nodes, experts, dynamo):
    backend = CountingBackend()
    miss = _retrieve(nodes, IMAGE, LATENT_FR)
    _request(*_patch(nodes, experts, miss, backend, feature_reuse=1.0), latent=LATENT_FR)
    assert nodes.ChorusCacheWrite.execute(latent={"samples": LATENT_FR}, plan=miss).args[0].startswith("wrote entry")
    # a compiled miss keeps its blocks in the graph: one record_block per layer (region scores) and one
    # record_mass per layer (block mass), no graph break inside a block
    assert max(backend.op_counts("record_block")) == LAYERS and max(backend.op_counts("record_mass")) == LAYERS
    assert all("_begin_forward" in r for r in _graph_break_reasons(dynamo)), _graph_break_reasons(dynamo)

    def guided(plan, compiled):
        return [nodes.ChorusGuidanceBoost.execute(model=m, plan=plan, strength=0.5, image_strength=0.5,
                                                  cfg_strength=0.0).args[0]
                for m in _patch(nodes, experts, plan, backend if compiled else None, feature_reuse=1.0)]

    eager_plan = _retrieve(nodes, IMAGE, LATENT_FR)
    eager_out = _request(*guided(eager_plan, False), latent=LATENT_FR)
    assert eager_plan.state.feature_reuse.blocks_reduced > 0

    graphs_before = len(backend.graphs)
    outputs, after = [], []
    for request in range(2):
        plan = _retrieve(nodes, IMAGE, LATENT_FR)
        assert plan.is_hit
        outputs.append(_request(*guided(plan, True), latent=LATENT_FR))
        assert plan.stats.fallback_calls == 0, plan.stats.messages
        assert plan.stats.sparse_calls == 4 * LAYERS
        # every forward reduces the blocks past full_layers (1), as the eager hit does
        assert plan.state.feature_reuse.blocks_reduced == eager_plan.state.feature_reuse.blocks_reduced > 0, (
            plan.state.feature_reuse.summary(), plan.stats.messages)
        assert np.isfinite(plan.stats.density)
        after.append((len(backend.graphs), dict(dynamo["frames"])))
    # the reduced blocks are in the hit's graph: per layer past the first, its inputs compacted, its
    # self-attention on the compact sequence, its output expanded; the first layer attends in full
    hit_graphs = slice(graphs_before, None)
    assert max(backend.op_counts("attend_compact")[hit_graphs]) == LAYERS - 1, backend.op_counts("attend_compact")
    assert max(backend.op_counts("expand_block")[hit_graphs]) == LAYERS - 1
    assert max(backend.op_counts("attend")[hit_graphs]) == 1
    reasons = _graph_break_reasons(dynamo)
    assert all("_begin_forward" in r for r in reasons), reasons
    assert after[1] == after[0], after  # the second request compiled nothing
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    torch.testing.assert_close(outputs[0], eager_out, rtol=1e-4, atol=1e-4)


@compiled_forward
def test_a_compiled_feature_reuse_hit_leaves_later_compiled_requests_compiled(nodes, dynamo):
    """With more layers than dynamo's recompile limit (8 per code object): a compiled hit with feature
    reuse keeps its reduced blocks inside its graph (no frame per layer), so the limit is not spent and a
    compiled miss after it in the same process still compiles (its blocks record inside a graph). When
    the reduced blocks ran on the host side, each layer's block patch became a frame of its own, the
    limit was hit, and that miss ran eagerly (docs/BENCHMARK_LOG.md, runs 30 and 32)."""
    import torch._dynamo

    layers = torch._dynamo.config.recompile_limit + 2
    deep = [tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=s, num_layers=layers)) for s in (0, 1)]
    first = _retrieve(nodes, IMAGE, LATENT_FR)
    _request(*_patch(nodes, deep, first, feature_reuse=1.0), latent=LATENT_FR)  # eager miss: the entry
    assert nodes.ChorusCacheWrite.execute(latent={"samples": LATENT_FR}, plan=first).args[0].startswith("wrote entry")

    backend = CountingBackend()
    hit = _retrieve(nodes, IMAGE, LATENT_FR)
    assert hit.is_hit
    _request(*_patch(nodes, deep, hit, backend, feature_reuse=1.0), latent=LATENT_FR)
    assert hit.state.feature_reuse.blocks_reduced > 0 and hit.stats.fallback_calls == 0, hit.stats.messages
    assert hit.stats.sparse_calls == 4 * layers
    assert max(backend.op_counts("attend_compact")) == layers - 1  # the reduced blocks: in the graph

    graphs_before = len(backend.graphs)
    other = nodes.ChorusMaskRetrieve.execute(latent={"samples": LATENT_FR}, workspace="compiled_other",
                                             similarity_threshold=0.9, start_image=IMAGE.flip(1) * 0.5,
                                             positive=tiny.random_conditioning(3), prompt="a red fox").args[0]
    assert not other.is_hit
    _request(*_patch(nodes, deep, other, backend, feature_reuse=1.0), latent=LATENT_FR)
    assert other.stats.recorded_calls == 4 * layers, other.stats.messages
    # the miss compiled: new graphs, its blocks' mass recorded inside one of them
    assert max(backend.op_counts("record_mass")[graphs_before:], default=0) == layers, backend.op_counts("record_mass")


@compiled_forward
@pytest.mark.parametrize("guards", GUARDS)
def test_feature_reuse_compiles_each_block_patch_once_where_the_host_attention_breaks_the_graph(nodes, dynamo,
                                                                                                monkeypatch, guards):
    """A host attention backend dynamo does not trace (here ComfyUI's PyTorch attention behind
    ``torch.compiler.disable`` inside ComfyUI's ``wrap_attn``, as compile-disabled SageAttention runs) breaks each
    block at its cross-attention (self-attention is Chorus's override, reached before the backend), so every
    block call is a frame of its own. Feature reuse's block patch then compiles once per kind (a layer that runs in full, a
    reducible one), not once per layer: with more layers than dynamo's recompile limit, a compiled miss and a
    compiled hit keep their block ops inside graphs, the patch's methods hold a few compiled variants each (per
    patch kind and request mode, not per layer), and both match the eager requests. (A patch
    object per layer made a recompile per layer, and past the limit the later layers ran eagerly.) With
    ComfyUI's guard filter too: the hit after the miss reduces its blocks (it ran the miss's full blocks
    while the forward's constants were guarded through ``transformer_options`` alone)."""
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan
    import torch._dynamo

    from chorus.nodes.comfy_forward import ChorusBlock

    backend_function = torch.compiler.disable(attention.attention_pytorch.__wrapped__)
    monkeypatch.setattr(wan, "optimized_attention", attention.wrap_attn(backend_function))
    layers = torch._dynamo.config.recompile_limit + 2
    deep = [tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=s, num_layers=layers)) for s in (0, 1)]

    eager_plan = _retrieve(nodes, IMAGE, LATENT_FR)
    eager_miss = _request(*_patch(nodes, deep, eager_plan, feature_reuse=1.0), latent=LATENT_FR)
    assert nodes.ChorusCacheWrite.execute(latent={"samples": LATENT_FR}, plan=eager_plan).args[0].startswith("wrote")

    backend = CountingBackend()
    compiled_plan = _retrieve(nodes, IMAGE, LATENT_FR, workspace="compiled_miss")
    assert not compiled_plan.is_hit
    compiled_miss = _request(*_patch(nodes, deep, compiled_plan, backend, feature_reuse=1.0, guards=guards),
                             latent=LATENT_FR)
    torch.testing.assert_close(compiled_miss, eager_miss, rtol=1e-4, atol=1e-4)
    assert any(backend.op_counts("record_block")), "the miss's blocks recorded outside every graph"
    variants = _compiled_variants(ChorusBlock)
    assert 0 < variants["__call__"] <= 2 and 0 < variants["_run"] <= 2, variants  # one per patch kind

    graphs_before = len(backend.graphs)
    hit = _retrieve(nodes, IMAGE, LATENT_FR)
    assert hit.is_hit
    eager_hit = _request(*_patch(nodes, deep, hit, feature_reuse=1.0), latent=LATENT_FR)
    hit = _retrieve(nodes, IMAGE, LATENT_FR)
    compiled_hit = _request(*_patch(nodes, deep, hit, backend, feature_reuse=1.0, guards=guards), latent=LATENT_FR)
    assert hit.state.feature_reuse.blocks_reduced > 0 and hit.stats.fallback_calls == 0, hit.stats.messages
    torch.testing.assert_close(compiled_hit, eager_hit, rtol=1e-4, atol=1e-4)
    assert any(backend.op_counts("attend_compact")[graphs_before:]), "the hit's reduced blocks ran outside every graph"
    variants = _compiled_variants(ChorusBlock)
    # per (patch kind, the request's mode), whatever the layer count (a patch per layer: the recompile limit, 8)
    assert variants["__call__"] <= 4 and variants["_run"] <= 4 and 0 < variants["_reduced"] <= 2, variants


def test_with_comfyui_s_guard_filter_chorus_runs_on_a_model_compiled_plain_earlier(nodes, experts,
                                                                                      dynamo):
    """The same diffusion models compiled without Chorus first (a plain request, or the Chorus nodes
    bypassed), then with them, under ``TorchCompileModel``'s guard filter (one backend, so one set of
    compiled graphs per code object): the Chorus requests compile graphs of their own, told apart by the
    keyword Chorus's APPLY_MODEL wrapper adds, so the miss records every call and the hit after it is sparse
    on every call; the plain models afterwards still give their first output. (The plain graph, guarded on
    nothing in ``transformer_options``, ran the Chorus requests without Chorus: nothing recorded.)"""
    plain = [_compiled(m, "aot_eager", "comfyui_filter") for m in experts]
    plain_out = _request(*plain)
    miss = _retrieve(nodes, IMAGE)
    miss_out = _request(*_patch(nodes, experts, miss, "aot_eager", guards="comfyui_filter"))
    assert miss.stats.recorded_calls == 4 * LAYERS and miss.stats.fallback_calls == 0, miss.stats.summary()
    torch.testing.assert_close(miss_out, plain_out, rtol=1e-5, atol=1e-5)  # a miss attends densely
    assert nodes.ChorusCacheWrite.execute(latent={"samples": miss_out}, plan=miss).args[0].startswith("wrote entry")
    hit = _retrieve(nodes, IMAGE)
    assert hit.is_hit
    _request(*_patch(nodes, experts, hit, "aot_eager", guards="comfyui_filter"))
    assert hit.stats.sparse_calls == 4 * LAYERS and hit.stats.fallback_calls == 0, hit.stats.summary()
    torch.testing.assert_close(_request(*plain), plain_out, rtol=0, atol=0)


@compiled_forward
def test_with_comfyui_s_guard_filter_a_hit_after_a_miss_is_sparse_on_each_layer_where_attention_breaks_the_graph(
        nodes, dynamo, monkeypatch):
    """ComfyUI 0.38.x's calling convention (``block_index`` in ``transformer_options``), a host attention
    dynamo does not trace (so blocks compile as frames of their own) and ``TorchCompileModel``'s guard
    filter: a compiled miss records every layer, and the compiled hit after it in the same process runs
    every self-attention call sparse, each on its own layer in order, and gives the eager hit's output.
    (Guarded through ``transformer_options`` alone, the hit ran the miss's frames -- dense, nothing noted
    -- and a block frame kept the block index it was traced with, one layer's map for every call.)"""
    from chorus.engine import attend as engine_attend

    comfy038.install(monkeypatch)
    monkeypatch.setattr(comfy038, "optimized_attention",
                        comfy038.wrap_attn(torch.compiler.disable(comfy038.sdpa_backend)))
    layers = 4
    deep = [tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=s, num_layers=layers)) for s in (0, 1)]
    backend = CountingBackend()
    miss = _retrieve(nodes, IMAGE)
    miss_out = _request(*_patch(nodes, deep, miss, backend, guards="comfyui_filter"))
    assert miss.stats.recorded_calls == 4 * layers, miss.stats.summary()
    assert sorted({key[2] for key in miss.recorder.block_maps()}) == list(range(layers))
    assert nodes.ChorusCacheWrite.execute(latent={"samples": miss_out}, plan=miss).args[0].startswith("wrote entry")

    eager_hit = _retrieve(nodes, IMAGE)
    eager_out = _request(*_patch(nodes, deep, eager_hit))
    layer_of_call = []
    next_layer = engine_attend.ForwardContext.next_layer

    def logged_next_layer(context, hint=-1):
        layer_of_call.append(next_layer(context, hint))
        return layer_of_call[-1]

    monkeypatch.setattr(engine_attend.ForwardContext, "next_layer", logged_next_layer)
    hit = _retrieve(nodes, IMAGE)
    assert hit.is_hit
    hit_out = _request(*_patch(nodes, deep, hit, backend, guards="comfyui_filter"))
    assert hit.stats.sparse_calls == 4 * layers and hit.stats.fallback_calls == 0, hit.stats.summary()
    assert layer_of_call == list(range(layers)) * 4  # 4 forwards (2 steps per expert), layers in order
    assert any(backend.op_counts("attend")), "the hit's attention ran outside every graph"
    torch.testing.assert_close(hit_out, eager_out, rtol=1e-4, atol=1e-4)


def test_blocks_compiled_one_by_one_run_a_miss_and_hits_as_the_eager_requests(nodes, experts, dynamo):
    """KJNodes' compile nodes compile each transformer block on its own by default
    (``set_torch_compile_wrapper(keys=["diffusion_model.blocks.<i>", ...])``; no guard filter): the model's
    forward, Chorus's wrappers and block patches stay eager, the blocks' self-attention reaches Chorus's
    override inside each compiled block. A compiled miss records every call, and two compiled hits run
    every call sparse, compile nothing in the second request and give the eager hit's output."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    backend = CountingBackend()

    def blockwise(plan):
        models = []
        for model in experts:
            m = model.clone()
            set_torch_compile_wrapper(m, backend=backend, keys=[f"diffusion_model.blocks.{i}" for i in range(LAYERS)])
            models.append(nodes.ChorusSparseSampler.execute(model=m, plan=plan, top_p=0.9, k_min=1, refresh_steps=0,
                                                            backend="auto").args[0])
        return models

    miss = _retrieve(nodes, IMAGE)
    out = _request(*blockwise(miss))
    assert miss.stats.recorded_calls == 4 * LAYERS and miss.stats.fallback_calls == 0, miss.stats.summary()
    assert max(backend.op_counts("record_mass")) == 1  # one block per graph, its call recorded inside it
    assert nodes.ChorusCacheWrite.execute(latent={"samples": out}, plan=miss).args[0].startswith("wrote entry")
    eager_plan = _retrieve(nodes, IMAGE)
    eager_out = _request(*_patch(nodes, experts, eager_plan))
    outputs, after = [], []
    for request in range(2):
        hit = _retrieve(nodes, IMAGE)
        assert hit.is_hit
        outputs.append(_request(*blockwise(hit)))
        assert hit.stats.sparse_calls == 4 * LAYERS and hit.stats.fallback_calls == 0, hit.stats.summary()
        after.append((len(backend.graphs), dict(dynamo["frames"])))
    assert any(backend.op_counts("attend")), "the hit's attention ran outside every compiled block"
    assert after[1] == after[0], after
    torch.testing.assert_close(outputs[0], eager_out, rtol=1e-4, atol=1e-4)


def _compiled_variants(cls) -> dict:
    """How many compiled variants (dynamo cache entries) each method of ``cls`` has."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return {name: len(_debug_get_cache_entry_list(fn.__code__)) for name, fn in vars(cls).items()
            if callable(fn) and hasattr(fn, "__code__")}


@pytest.mark.parametrize("case", ["all", "comfyui_filter", "comfyui_filter_block_frames"])
def test_compiled_skip_layer_guidance_forwards_skip_their_layers_and_keep_the_others_maps(nodes,
                                                                                           dynamo, case,
                                                                                           monkeypatch):
    """ComfyUI's Skip Layer Guidance node on a compiled Chorus hit: its extra forward per step skips the
    chosen layer (its block patch returns its arguments) in the compiled graph too -- with all guards, under
    the guard filter (the block patches are read in the frames after the forward's host-side break, whose
    guards the filter keeps) and where each block is a frame of its own (``block_frames``: 0.38.x's
    convention, an attention dynamo does not trace) -- and every other self-attention call of it keeps its
    own layer (the engine's count passes over the skipped one). The compiled request gives the eager one's
    output."""
    from comfy_extras.nodes_slg import SkipLayerGuidanceDiT

    from chorus.engine import attend as engine_attend

    guards = "all" if case == "all" else "comfyui_filter"
    if case.endswith("block_frames"):
        comfy038.install(monkeypatch)
        monkeypatch.setattr(comfy038, "optimized_attention",
                            comfy038.wrap_attn(torch.compiler.disable(comfy038.sdpa_backend)))

    three = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0, num_layers=3))
    layers = []
    next_layer = engine_attend.ForwardContext.next_layer

    def spy(self, hint=-1):
        layer = next_layer(self, hint)
        layers.append((self, layer))
        return layer

    monkeypatch.setattr(engine_attend.ForwardContext, "next_layer", spy)

    def request(plan, backend=None):
        import comfy.sample

        model = three if backend is None else _compiled(three, backend, guards)
        model = nodes.ChorusSparseSampler.execute(model=model, plan=plan, top_p=0.9, k_min=1, refresh_steps=0,
                                                  backend="auto").args[0]
        model = SkipLayerGuidanceDiT.execute(model, scale=3.0, start_percent=0.0, end_percent=1.0,
                                             double_layers="1", single_layers="").result[0]
        return comfy.sample.sample(model, torch.zeros_like(LATENT), 2, 1.0, "euler", "simple",
                                   tiny.random_conditioning(3), tiny.random_conditioning(103), LATENT,
                                   disable_pbar=True, seed=0)

    def forwards():
        by_context = {}
        for context, layer in layers:
            by_context.setdefault(id(context), []).append(layer)
        layers.clear()
        return sorted(map(tuple, by_context.values()))

    miss = _retrieve(nodes, IMAGE, workspace="slg")
    out = request(miss)
    assert nodes.ChorusCacheWrite.execute(latent={"samples": out}, plan=miss).args[0].startswith("wrote entry")
    layers.clear()
    eager = request(_retrieve(nodes, IMAGE, workspace="slg"))
    assert forwards() == [(0, 1, 2)] * 2 + [(0, 2)] * 2
    hit = _retrieve(nodes, IMAGE, workspace="slg")
    compiled = request(hit, "aot_eager")
    assert forwards() == [(0, 1, 2)] * 2 + [(0, 2)] * 2
    assert hit.stats.sparse_calls == 2 * 3 + 2 * 2 and hit.stats.fallback_calls == 0, hit.stats.summary()
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
