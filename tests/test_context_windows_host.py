"""ComfyUI's context windows (the core "WAN Context Windows (Manual)" node) with the Chorus nodes, on the
vendored host with ComfyUI's tiny ``WanModel`` (CPU, random weights).

In windows, each sampler step runs the model once per window of latent frames: every forward's token grid is
the window's. A miss records one map per (expert, step, layer) as the union over the windows (the recorder
ORs the calls of one key), so its entry holds the window's grid; a hit of that entry runs every window's
self-attention sparse (feature reuse too). Retrieval sees the latent only, which is the same with windows
or without: a request without windows hits that entry, and its first forward tells another grid of the same
aspect: the entry is served resampled to it, in feature reuse's region order at that grid, its region scores
carried there (a grid of another aspect moves the hit or demotes it: ``tests/test_engine_runtime.py``). Later
ComfyUI's causal window fix (the host's own on 0.28.2 and 0.33.0, where the Wan node turns it on; a test double
on 0.3.64) runs windows of two lengths in one run: recorded and served at the first window's grid (the others'
maps carried over), in raster order and in feature reuse's region order, eagerly and under TorchCompileModel; the
plain-windows test turns the host's fix off.
0.3.64's windows leave Wan I2V's ``c_concat`` whole (an I2V model cannot sample in windows there); later
ComfyUI cuts it to the window, as ``tests/host/comfy038.py``'s double does on 0.3.64.
"""

from __future__ import annotations

import math

import pytest
import torch

from host import comfy038  # tests/host (pytest pythonpath)
from host import tiny_wan as tiny

SKIP_REASON = tiny.import_comfy()
pytestmark = [pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}"),
              pytest.mark.filterwarnings("ignore:Using a non-tuple sequence:UserWarning")]  # the host's indexing

LATENT = {"samples": torch.zeros(1, 16, 9, 32, 32)}  # 9 latent frames of 16 x 16 tokens
WINDOW_FRAMES, OVERLAP_FRAMES = 17, 5                 # pixel frames: windows of 5 latent frames, 2 shared
STEPS = 2


@pytest.fixture()
def nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "cache"))
    comfy038.install_context_window_conds(monkeypatch)
    import chorus.nodes as nodes_pkg

    return nodes_pkg


@pytest.fixture(scope="module")
def model():
    return tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0))


def _host_anchors_windows() -> bool:
    """Whether this ComfyUI has the causal window fix itself (on by default; 0.28.2 and 0.33.0 do, 0.3.64 not):
    the benchmark's check (``benchmarks/comfy_e2e/windows.host_runs_i2v_in_windows``, the fix and the per-window image
    conditioning came in the same releases)."""
    from chorus.benchmarks.comfy_e2e.windows import host_runs_i2v_in_windows

    return host_runs_i2v_in_windows()


def _windows(model, anchored: bool = False, schedule: str = "standard_static"):
    """``model`` through the core "WAN Context Windows (Manual)" node as the benchmark of record puts it there
    (``benchmarks/comfy_e2e/windows.context_windows``: the node's ``schedule``, its later inputs at their defaults);
    ``anchored``: with the causal window fix (the host's own where it has one, else the test double), else
    without (turned off in the host's handler where it is on by default)."""
    from chorus.benchmarks.comfy_e2e.windows import context_windows

    windowed = context_windows(model, WINDOW_FRAMES, OVERLAP_FRAMES, schedule)
    if _host_anchors_windows():
        windowed.model_options["context_handler"].causal_window_fix = anchored
    return windowed


def _window_count(windowed) -> int:
    handler = windowed.model_options["context_handler"]
    return len(handler.context_schedule.func(LATENT["samples"].shape[2], handler, {}))


def _patched(nodes, model, *, windows: bool, feature_reuse: bool = True, workspace: str = "windows",
             anchored: bool = False, schedule: str = "standard_static", image_strength: float = 0.0,
             images: str | None = None):
    """``(plan, patched model, positive conditioning)`` of one request: retrieve, sparse sampler (+ feature reuse,
    + Chorus Guidance Boost's start-image bias where ``image_strength``), (windows). ``images``: the positive
    conditioning as WanImageToVideo (``"start"``) or WanFirstLastFrameToVideo (``"start_end"``) leaves it, else
    none on the latent."""
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
    positive = tiny.random_conditioning(5)
    if images is not None:
        positive = tiny.with_input_images(positive, LATENT["samples"].shape, images == "start_end", seed=7)
    plan = nodes.ChorusMaskRetrieve.execute(latent=LATENT, workspace=workspace, start_image=image, positive=positive,
                                            prompt="a fox").args[0]
    patched = nodes.ChorusSparseSampler.execute(model=model, plan=plan).args[0]
    if feature_reuse:
        patched = nodes.ChorusFeatureReuse.execute(patched, plan).args[0]
    if image_strength:
        patched = nodes.ChorusGuidanceBoost.execute(patched, plan, strength=0.0, image_strength=image_strength).args[0]
    if windows:
        patched = _windows(patched, anchored, schedule)
    return plan, patched, positive


def _sample(patched, positive) -> torch.Tensor:
    import comfy.sample

    latent = LATENT["samples"]
    return comfy.sample.sample(patched, comfy.sample.prepare_noise(latent, 0), STEPS, 1.0, "euler", "simple",
                               positive, tiny.random_conditioning(1), latent, disable_pbar=True, seed=0)


def _request(nodes, model, **options):
    """``(plan, samples)`` of one request (:func:`_patched`'s options), sampled."""
    plan, patched, positive = _patched(nodes, model, **options)
    return plan, _sample(patched, positive)


def test_in_context_windows_a_miss_records_the_window_s_maps_and_a_hit_runs_every_window_sparse_or_the_whole_latent(
        nodes, model):
    window_count = _window_count(_windows(model))
    calls = STEPS * window_count * tiny.TINY_LAYERS
    assert window_count > 1

    miss, samples = _request(nodes, model, windows=True)
    assert not miss.is_hit and miss.stats.recorded_calls == calls and miss.stats.fallback_calls == 0
    assert miss.recorder.grid == (5, 16, 16) and len(miss.recorder) == STEPS * tiny.TINY_LAYERS  # windows OR'ed
    written = nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=miss).args[0]
    assert "wrote entry 1" in written, written

    hit, samples = _request(nodes, model, windows=True)
    assert hit.is_hit and torch.isfinite(samples).all()
    assert hit.stats.sparse_calls == calls and hit.stats.fallback_calls == 0, hit.stats.messages
    assert hit.state.feature_reuse.blocks_reduced > 0

    # the whole latent, not the entry's grid: its first forward has the entry served resampled there, in feature
    # reuse's region order at that grid, with the entry's region scores carried to it
    whole, samples = _request(nodes, model, windows=False)
    assert whole.is_hit and whole.entry_id == 1 and whole.resample_to == (9, 16, 16) and torch.isfinite(samples).all()
    assert whole.stats.sparse_calls == STEPS * tiny.TINY_LAYERS and whole.stats.fallback_calls == 0
    assert any("masks resampled (token order regions2x8x8)" in m for m in whole.stats.messages), whole.stats.messages
    assert any("region scores for grid (5, 16, 16) carried to grid (9, 16, 16)" in m for m in whole.stats.messages)
    assert whole.state.feature_reuse.blocks_reduced > 0


def test_windows_with_an_anchor_frame_are_recorded_and_served_whole(nodes, model, monkeypatch):
    """Later ComfyUI's causal window fix puts the frame before each window but the first in front of it: one
    run, forwards of two grids ((5, 16, 16) for the first window, (6, 16, 16) for the others). The miss records
    every call at the first window's grid (the others' mass carried there) and the hit runs every call sparse
    (its maps resampled to the longer windows); with feature reuse the same in its region order at each grid,
    the longer windows downsampled by the entry's region scores carried to their grid."""
    if not _host_anchors_windows():
        comfy038.install_context_window_anchor(monkeypatch)
    window_count = _window_count(_windows(model, anchored=True))
    calls = STEPS * window_count * tiny.TINY_LAYERS

    for feature_reuse, workspace in ((False, "anchored"), (True, "anchored_regions")):
        miss, samples = _request(nodes, model, windows=True, feature_reuse=feature_reuse, workspace=workspace,
                                 anchored=True)
        assert not miss.is_hit and torch.isfinite(samples).all()
        assert miss.recorder.grid == (5, 16, 16) and miss.stats.recorded_calls == calls, miss.stats.messages
        assert miss.recorder.token_order == ("regions2x8x8" if feature_reuse else None)
        assert "wrote entry 1" in nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=miss).args[0]
        hit, samples = _request(nodes, model, windows=True, feature_reuse=feature_reuse, workspace=workspace,
                                anchored=True)
        assert hit.is_hit and torch.isfinite(samples).all()
        assert hit.stats.sparse_calls == calls and hit.stats.fallback_calls == 0, hit.stats.messages
        if feature_reuse:  # every window's reducible blocks downsampled: the first's and the longer ones'
            reducible = STEPS * window_count * (tiny.TINY_LAYERS - 1)  # full_layers = 1
            assert hit.state.feature_reuse.blocks_reduced == reducible, hit.stats.messages
            assert any("carried to grid (6, 16, 16)" in m for m in hit.stats.messages), hit.stats.messages


@pytest.mark.parametrize("schedule", ["standard_uniform", "looped_uniform", "batched"])
def test_every_window_schedule_is_recorded_and_served_whole(nodes, model, monkeypatch, schedule):
    """The node's other schedules, anchored windows, feature reuse on: ``standard_uniform`` (the node's default
    from 0.28.2 on) and ``looped_uniform`` move the windows from step to step, so a step may have no window at
    the first window's grid (here the second step: windows at frames 4-8 and 8, 0-3, each with its anchor) --
    feature reuse's region scores of such a step are carried to the entry's grid like the attention mass; ``batched``
    cuts the latent without overlap. The miss records every call, the hit runs every call sparse and downsamples
    every reducible block of every window."""
    if not _host_anchors_windows():
        comfy038.install_context_window_anchor(monkeypatch)
    workspace = f"schedule_{schedule}"
    miss, samples = _request(nodes, model, windows=True, workspace=workspace, anchored=True, schedule=schedule)
    assert not miss.is_hit and torch.isfinite(samples).all()
    calls = miss.stats.recorded_calls
    assert calls >= 2 * STEPS * tiny.TINY_LAYERS and miss.stats.fallback_calls == 0, miss.stats.messages
    assert "wrote entry 1" in nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=miss).args[0]
    hit, samples = _request(nodes, model, windows=True, workspace=workspace, anchored=True, schedule=schedule)
    assert hit.is_hit and torch.isfinite(samples).all()
    assert hit.stats.sparse_calls == calls and hit.stats.dense_calls == 0 and hit.stats.fallback_calls == 0, \
        hit.stats.messages
    reducible = calls // tiny.TINY_LAYERS * (tiny.TINY_LAYERS - 1)  # full_layers = 1
    assert hit.state.feature_reuse.blocks_reduced == reducible, hit.stats.messages


def test_windows_of_two_lengths_under_torch_compile_run_as_the_eager_request(nodes, model, monkeypatch):
    """The anchored windows with feature reuse under TorchCompileModel (the host's compile wrapper with later
    ComfyUI's guard filter; dynamo with aot_eager here): the miss records every window, the hit runs every call sparse
    (layer 0 in full, the others on the compact sequence) and downsamples as many blocks as the eager hit, whose output
    it gives; a second compiled hit compiles no new frame and breaks no more graphs. (On a torch whose dynamo cannot keep a Chorus forward compiled, the forward runs eagerly: the same
    assertions hold.)"""
    import torch._dynamo
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from torch._dynamo.utils import counters

    if not _host_anchors_windows():
        comfy038.install_context_window_anchor(monkeypatch)
    compiled = model.clone()
    set_torch_compile_wrapper(compiled, backend="aot_eager",
                              options={"guard_filter_fn": comfy038.torch_compile_guard_filter})
    window_count = _window_count(_windows(model, anchored=True))
    calls = STEPS * window_count * tiny.TINY_LAYERS
    feature_reuse, workspace = True, "anchored_compiled"
    torch._dynamo.reset()
    counters.clear()
    try:
        miss, samples = _request(nodes, compiled, windows=True, feature_reuse=feature_reuse, workspace=workspace,
                                 anchored=True)
        assert miss.stats.recorded_calls == calls and not miss.stats.messages, miss.stats.messages
        assert "wrote entry 1" in nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=miss).args[0]
        eager, eager_samples = _request(nodes, model, windows=True, feature_reuse=feature_reuse, workspace=workspace,
                                        anchored=True)
        hit, samples = _request(nodes, compiled, windows=True, feature_reuse=feature_reuse, workspace=workspace,
                                anchored=True)
        assert counters["frames"]["ok"] > 0  # dynamo compiled frames of the compiled model's forwards
        compiled_after_first = (dict(counters["frames"]), sum(counters["graph_break"].values()))
        again, _ = _request(nodes, compiled, windows=True, feature_reuse=feature_reuse, workspace=workspace,
                            anchored=True)
        # a second hit of the same shape compiles nothing and breaks no more (both window grids were met before)
        assert (dict(counters["frames"]), sum(counters["graph_break"].values())) == compiled_after_first
        assert again.stats.sparse_calls == calls and again.stats.fallback_calls == 0
    finally:
        torch._dynamo.reset()
    assert hit.is_hit and hit.stats.sparse_calls == calls and hit.stats.fallback_calls == 0, hit.stats.messages
    assert hit.state.feature_reuse.blocks_reduced == eager.state.feature_reuse.blocks_reduced
    assert hit.state.feature_reuse.blocks_reduced > 0
    torch.testing.assert_close(samples, eager_samples, rtol=1e-4, atol=1e-4)



def test_guidance_boost_biases_the_start_image_only_in_the_window_that_begins_with_it(nodes, model, monkeypatch):
    """Chorus Guidance Boost reinforces the start image through a logit bias on the keys of the forward's first
    latent frame. In context windows only the first window begins with the start image; a later one begins with a
    later frame of the video (with the causal window fix, the frame before it): the bias applies in the first
    window's calls alone (before, in every window's: a later frame was reinforced as if it were the image). A
    request without windows still biases every call."""
    from chorus.nodes.comfy_patch import get_patch

    if not _host_anchors_windows():
        comfy038.install_context_window_anchor(monkeypatch)
    window_count = _window_count(_windows(model, anchored=True))
    miss, samples = _request(nodes, model, windows=True, feature_reuse=False, workspace="boost", anchored=True)
    assert "wrote entry 1" in nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=miss).args[0]

    for windows, biased_windows in ((True, 1), (False, None)):
        hit, patched, positive = _patched(nodes, model, windows=windows, feature_reuse=False, workspace="boost",
                                          anchored=True, image_strength=2.0)
        samples = _sample(patched, positive)
        boost = get_patch(patched).guidance
        assert hit.is_hit and torch.isfinite(samples).all() and hit.stats.fallback_calls == 0, hit.stats.messages
        calls = hit.stats.sparse_calls
        assert calls == STEPS * (window_count if windows else 1) * tiny.TINY_LAYERS, hit.stats.messages
        assert boost.biased_calls == (STEPS * biased_windows * tiny.TINY_LAYERS if windows else calls), \
            (boost.biased_calls, calls, window_count)


def test_a_start_and_an_end_image_in_windows_are_read_from_the_request_and_placed_in_each_window(
        nodes, model, monkeypatch):
    """A first-last-frame request in anchored windows: each window's input holds its own frames, so the first window
    shows the start image alone and the last the end image alone. The request's images are read from the run's
    whole conditioning: the entry records ``[1, 1, 0]`` (before, the first window's ``[1, 0, 0]``), a start-image
    entry in windows does not serve it, and its hit keeps each window's own image frames: feature reuse never
    downsamples a region on one (the end image's frame in the last window), and guidance's end-image bias goes on
    the calls of the window that ends the video alone (every sparse call there: the entry's region order keeps the
    last frame out of its tiles, so it ends the anchored windows' even frame counts too), its start-image bias on the
    first window's alone."""
    from chorus.engine import attend as engine_attend
    from chorus.engine import feature_reuse as engine_feature_reuse
    from chorus.kernels import pooling
    from chorus.nodes.comfy_patch import get_patch

    if not _host_anchors_windows():
        comfy038.install_context_window_anchor(monkeypatch)
    frames = LATENT["samples"].shape[2]
    options = dict(windows=True, anchored=True, workspace="first_last")

    start_only, samples = _request(nodes, model, images="start", **options)
    assert start_only.state.image_frames == (1, 0, 0), start_only.stats.messages
    assert "wrote entry 1" in nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=start_only).args[0]
    moved, _ = _request(nodes, model, images="start_end", **options)  # the start-image entry does not fit it
    assert moved.state.image_frames == (1, 1, 0) and not moved.is_hit, moved.stats.messages
    assert any("start image" in m and "end image" in m for m in moved.stats.messages), moved.stats.messages

    options["workspace"] = "first_last_own"
    miss, samples = _request(nodes, model, images="start_end", **options)
    assert not miss.is_hit and miss.state.image_frames == (1, 1, 0), miss.stats.messages
    assert "wrote entry 1" in nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=miss).args[0]

    picked, last_biases = [], []
    select_regions = engine_feature_reuse.select_regions
    last_frame_bias = engine_attend.ForwardContext.last_frame_bias

    def seen_select_regions(scores, grid, region, share, **kwargs):
        regions = select_regions(scores, grid, region, share, **kwargs)
        picked.append((tuple(grid), kwargs.get("held_frames"), pooling.region_frames(grid, region)[regions]))
        return regions

    def seen_last_frame_bias(context):
        value = last_frame_bias(context)
        last_biases.append((context.window_start, context.grid[0], value))
        return value

    monkeypatch.setattr(engine_feature_reuse, "select_regions", seen_select_regions)
    monkeypatch.setattr(engine_attend.ForwardContext, "last_frame_bias", seen_last_frame_bias)
    hit, patched, positive = _patched(nodes, model, images="start_end", image_strength=2.0, **options)
    samples = _sample(patched, positive)
    assert hit.is_hit and hit.state.image_frames == (1, 1, 0) and torch.isfinite(samples).all(), hit.stats.messages
    assert hit.stats.fallback_calls == 0 and hit.state.feature_reuse.blocks_reduced > 0, hit.stats.messages
    # the entry's region order keeps the last frame out of its tiles: it ends every window's order, the anchored
    # windows of an even frame count too, so every sparse call there biases the end image
    assert hit.entry_order.name == "regions2x8x8-last", hit.entry_order
    assert not any("end-image bias" in m for m in hit.stats.messages), hit.stats.messages

    ends_video = {(start, length) for start, length, _ in last_biases if start + length == frames}
    assert ends_video and {(start, length) for start, length, bias in last_biases if bias > 0} == ends_video
    for grid, held, region_starts in picked:
        assert held is not None and len(held) == grid[0]
        for start in region_starts.tolist():  # a downsampled region holds no image frame
            assert not any(held[start:start + 2]), (grid, held, region_starts)
    assert any(held[-1] for _, held, _ in picked)  # the last window's end image was met and kept whole
    biased_calls = get_patch(patched).guidance.biased_calls
    first_window_calls = sum(1 for start, _, _ in last_biases if start == 0)
    assert biased_calls == first_window_calls > 0 and first_window_calls < len(last_biases)


def test_a_first_last_frame_hit_with_feature_reuse_biases_the_end_image_on_its_compact_calls(nodes, model,
                                                                                            monkeypatch):
    """The whole latent (9 frames: the region order ends with the last frame), a first-last-frame hit with feature
    reuse and Chorus Guidance Boost: the full-grid calls bias the end image as the keys' suffix; the compact calls,
    whose suffix holds the cells' weight, lead with the last frame, so one prefix of both image frames' keys takes
    the bias (before, they biased the start image alone, with a note). Without Guidance Boost the layouts do not
    lead (it costs blocks on the two image frames' query rows)."""
    from chorus import kernels
    from chorus.kernels import pooling

    options = dict(windows=False, images="start_end", workspace="first_last_whole")
    miss, samples = _request(nodes, model, **options)
    assert miss.state.image_frames == (1, 1, 0), miss.stats.messages
    assert "wrote entry 1" in nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=miss).args[0]

    calls, sparse = [], kernels.block_sparse_attention

    def seen(q, k, v, block_map, **options):
        calls.append((q.shape[-2], options["prefix_len"], options["prefix_bias"], options["suffix_len"],
                      options["suffix_bias"]))
        return sparse(q, k, v, block_map, **options)

    leads, build_layout = [], pooling.build_layout

    def seen_build_layout(*args, **options):
        layout = build_layout(*args, **options)
        leads.append(layout.end_image_leads)
        return layout

    monkeypatch.setattr(pooling, "build_layout", seen_build_layout)
    plain, _ = _request(nodes, model, **options)  # without Guidance Boost the layouts keep the order's own sequence
    assert plain.is_hit and plain.state.feature_reuse.blocks_reduced > 0 and leads and not any(leads)

    leads.clear()
    monkeypatch.setattr(kernels, "block_sparse_attention", seen)
    hit, samples = _request(nodes, model, image_strength=2.0, **options)
    assert leads and all(leads)
    assert hit.is_hit and torch.isfinite(samples).all() and hit.stats.fallback_calls == 0, hit.stats.messages
    assert not any("end-image bias" in m for m in hit.stats.messages), hit.stats.messages
    grid = LATENT["samples"].shape[2], 16, 16
    frame, length = grid[1] * grid[2], grid[0] * grid[1] * grid[2]
    full = [c for c in calls if c[0] == length]
    compact = [c for c in calls if c[0] < length]
    assert full and compact and len(calls) == hit.stats.sparse_calls, calls
    bias = full[0][2]
    assert bias > 0 and all(c[1:] == (frame, bias, frame, bias) for c in full), full
    assert all(c[1:3] == (2 * frame, bias) and c[4] == math.log(8) for c in compact), compact  # cells of 2 x 2 x 2


def test_a_start_image_kept_in_every_window_is_reinforced_in_every_window(nodes, model, monkeypatch):
    """The Wan context-windows node's ``cond_retain_index_list`` "0" (ComfyUI 0.28.2 on) puts the start image's
    conditioning at the first frame of every window: every window's own input then shows an image there, so
    guidance's start-image bias goes on every window's calls (where the option is off, the first window's only)."""
    from chorus.nodes.comfy_patch import get_patch

    windowed = _windows(model, anchored=True)
    if not hasattr(windowed.model_options["context_handler"], "cond_retain_index_list"):
        pytest.skip("this ComfyUI's context windows keep no conditioning frame in every window")
    window_count = _window_count(windowed)
    options = dict(windows=True, anchored=True, feature_reuse=False, workspace="retained", images="start")
    miss, samples = _request(nodes, model, **options)
    assert "wrote entry 1" in nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=miss).args[0]
    for retained, biased_windows in (([], 1), ([0], window_count)):
        hit, patched, positive = _patched(nodes, model, image_strength=2.0, **options)
        patched.model_options["context_handler"].cond_retain_index_list = retained
        samples = _sample(patched, positive)
        assert hit.is_hit and hit.state.image_frames == (1, 0, 0) and torch.isfinite(samples).all()
        assert hit.stats.sparse_calls == STEPS * window_count * tiny.TINY_LAYERS, hit.stats.messages
        assert get_patch(patched).guidance.biased_calls == STEPS * biased_windows * tiny.TINY_LAYERS, retained


def test_a_forward_s_place_in_the_video_is_read_from_the_host_s_window():
    """``window_frames``: the video's latent frames a windowed forward's frames are, from the window ComfyUI puts in
    ``transformer_options["context_window"]`` (its anchor frame first where the causal window fix set one); None
    for a whole-latent forward or a window it cannot read."""
    from types import SimpleNamespace

    from chorus.nodes.comfy_forward import window_frames

    assert window_frames({}) is None and window_frames({"context_window": object()}) is None
    assert window_frames({"context_window": SimpleNamespace(index_list=[])}) is None
    assert window_frames({"context_window": SimpleNamespace(index_list=[4, 5, 6])}) == (4, 5, 6)
    anchored = SimpleNamespace(index_list=[4, 5, 6], causal_anchor_index=3)
    assert window_frames({"context_window": anchored}) == (3, 4, 5, 6)
    assert window_frames({"context_window": SimpleNamespace(index_list=[0, 1], causal_anchor_index=-1)}) == (0, 1)
    assert window_frames({"context_window": SimpleNamespace(index_list=torch.tensor([2, 3]))}) == (2, 3)
    assert window_frames({"context_window": SimpleNamespace(index_list=["a"])}) is None
    assert window_frames({"context_window": SimpleNamespace(index_list=7)}) is None


def test_the_request_s_images_are_read_from_the_run_s_processed_conditioning():
    """``request_image_flags``: per latent frame of the whole latent, an image where Wan I2V's ``c_concat`` (the 4
    mask channels first) says so, from the first positive cond that has one; None where the guider, its conds or a
    ``c_concat`` of that layout are missing, or the model has no mask channels (the caller reads the forward)."""
    from types import SimpleNamespace

    from chorus.engine import ModelInfo
    from chorus.nodes.comfy_adapter import request_image_flags

    info = ModelInfo("wan", "wan2.2-a14b-i2v", 2, 2, 4, 36, "fp0")
    concat = torch.zeros(2, 20, 5, 4, 4)
    concat[:, :4, 0] = 1.0         # a start image: the first frame's four mask channels
    concat[:, 3, 4] = 1.0          # an end image: one of the last frame's four
    concat[:, 4:] = 7.0            # the image latent's channels are not read

    def guider(*conds):
        return SimpleNamespace(conds={"positive": list(conds), "negative": []})

    with_concat = {"model_conds": {"c_concat": SimpleNamespace(cond=concat)}}
    assert request_image_flags(guider({"model_conds": {}}, with_concat), info) == (True, False, False, False, True)
    assert request_image_flags(guider(with_concat), ModelInfo("wan", "wan2.2-ti2v-5b", 2, 2, 4, 48, "fp0")) is None
    for bad in (None, SimpleNamespace(), SimpleNamespace(conds=[]), guider(), guider({"model_conds": None}),
                guider({"model_conds": {"c_concat": SimpleNamespace(cond=torch.zeros(1, 16, 5, 4, 4))}}),
                guider({"model_conds": {"c_concat": SimpleNamespace(cond=torch.zeros(20, 5))}}), guider("cond")):
        assert request_image_flags(bad, info) is None, bad
