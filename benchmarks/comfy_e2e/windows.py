"""ComfyUI's context windows as the benchmark's ``--frames N --windows LENGTH OVERLAP`` rows run them: whether the
host samples a Wan I2V model in windows at all, the core "WAN Context Windows (Manual)" node on a model, and the
latent frames of each window (tests: ``tests/test_comfy_e2e_bench.py``, ``tests/test_context_windows_host.py``)."""

from __future__ import annotations


def host_runs_i2v_in_windows() -> bool:
    """Whether this ComfyUI samples a Wan I2V model in context windows: from 0.28.2 (its context handler cuts
    the image conditioning to each window and has the causal window fix, which the Wan node turns on); 0.3.64
    leaves the conditioning whole."""
    import inspect

    from comfy.context_windows import IndexListContextHandler

    return "causal_window_fix" in inspect.signature(IndexListContextHandler.__init__).parameters


WINDOW_SCHEDULES = ("standard_static", "standard_uniform", "looped_uniform", "batched")


def context_windows(model, length: int, overlap: int, schedule: str = "standard_static"):
    """``model`` through the core "WAN Context Windows (Manual)" node as a user's graph runs it: windows of
    ``length`` pixel frames overlapping by ``overlap`` in ``schedule`` (one of :data:`WINDOW_SCHEDULES`; the
    node's default from 0.28.2 on is ``standard_uniform``, whose windows move from step to step), the node's
    defaults otherwise (stride 1, no loop, ``pyramid`` fusing, FreeNoise on, and the host's causal window fix,
    which its Wan node turns on)."""
    import inspect

    from comfy_extras.nodes_context_windows import WanContextWindowsManualNode

    inputs = dict(context_length=length, context_overlap=overlap, context_schedule=schedule,
                  context_stride=1, closed_loop=False, fuse_method="pyramid")
    if "freenoise" in inspect.signature(WanContextWindowsManualNode.execute).parameters:
        inputs["freenoise"] = True
    return WanContextWindowsManualNode.execute(model, **inputs).result[0]


def windows_of(model, frames: int) -> list[list[int]]:
    """The latent frames of each context window ``model``'s handler runs on a latent of ``frames`` latent frames
    (at the first step: a uniform schedule moves them at later steps)."""
    handler = model.model_options["context_handler"]
    return [list(w) for w in handler.context_schedule.func(frames, handler, {})]
