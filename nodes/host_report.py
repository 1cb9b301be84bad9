"""The one log line a user reports when sampling fails with a Chorus patch on the model.

ComfyUI changes its calling conventions between releases (``nodes/comfy_call.py``); when a sampler run
with a Chorus patch raises, :func:`report_failure` (called by the patch's OUTER_SAMPLE wrapper, which
then re-raises) logs ONE error line naming ComfyUI's version, torch's, the innermost Chorus call the
error passed through and where it was raised, e.g.::

    Chorus II: sampling failed on ComfyUI 0.38.1 (torch 2.14.1); first failing Chorus call
    nodes/comfy_call.py:185 dense_call; raised at /opt/ComfyUI/comfy/ldm/modules/attention.py:512
    attention_pytorch: TypeError: ... -- if the same graph runs without the Chorus nodes, report this
    line (docs/INSTALL.md, "Newer ComfyUI")

(one line in the log). The same failure (same place, same exception type) is logged once per process;
repeats go to debug. A user's interrupt is not a failure. The traceback itself stays ComfyUI's.
"""

from __future__ import annotations

import logging
import os
import traceback

import torch

from ..engine.state import failure_text

log = logging.getLogger("chorus.nodes")

PACK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_FAILURES = ("InterruptProcessingException", "KeyboardInterrupt", "SystemExit", "GeneratorExit")
_REPORTED: set = set()


def comfyui_version() -> str:
    """ComfyUI's ``comfyui_version.__version__`` (a module at ComfyUI's root), or ``"unknown"``."""
    try:
        import comfyui_version
    except ImportError:
        return "unknown"
    return str(getattr(comfyui_version, "__version__", "unknown"))


def _pack_relative(filename: str) -> str | None:
    """``filename`` relative to the pack when it is Chorus product code (not its tests), else None."""
    path = os.path.abspath(filename)
    if not path.startswith(PACK_DIR + os.sep):
        return None
    relative = os.path.relpath(path, PACK_DIR)
    return None if relative.split(os.sep, 1)[0] == "tests" else relative.replace(os.sep, "/")


def _where(frame: traceback.FrameSummary, relative: str | None = None) -> str:
    return f"{relative or frame.filename}:{frame.lineno} {frame.name}"


def failure_line(exc: BaseException) -> str | None:
    """The report line for ``exc`` (see the module docstring), or None when it is not a failure (an
    interrupt) or its traceback passes through no Chorus call below the caller's frame."""
    if type(exc).__name__ in NOT_FAILURES:
        return None
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0] is the frame catching it (the wrapper)
    chorus = [(f, rel) for f in frames if (rel := _pack_relative(f.filename)) is not None]
    if not chorus:
        return None
    call, relative = chorus[-1]
    raised = frames[-1]
    origin = _where(raised, _pack_relative(raised.filename))
    return (f"Chorus II: sampling failed on ComfyUI {comfyui_version()} (torch {torch.__version__}); first "
            f"failing Chorus call {_where(call, relative)}; raised at {origin}: "
            f"{failure_text(exc)} -- if the same graph runs without the Chorus nodes, report this "
            "line (docs/INSTALL.md, \"Newer ComfyUI\")")


def report_failure(exc: BaseException) -> None:
    """Log :func:`failure_line` once per (place, exception type) per process. Never raises."""
    try:
        line = failure_line(exc)
    except Exception:  # noqa: BLE001 - the report must never hide the real error
        return
    if line is None:
        return
    frames = traceback.extract_tb(exc.__traceback__)
    key = (type(exc).__name__, frames[-1].filename, frames[-1].lineno) if frames else (type(exc).__name__,)
    if key in _REPORTED:
        log.debug("%s", line)
        return
    _REPORTED.add(key)
    log.error("%s", line)
