"""Shared pieces of the Chorus II nodes: the CHORUS_PLAN type, workspaces, UI text."""

from __future__ import annotations

import logging
import threading

from comfy_api.latest import io

from ..cache_store import Workspace, resolve_workspace

log = logging.getLogger("chorus.nodes")

CATEGORY = "Chorus II"
ChorusPlan = io.Custom("CHORUS_PLAN")

_WORKSPACES: dict[str, Workspace] = {}
_WS_LOCK = threading.Lock()


def open_workspace(name: str) -> Workspace:
    """Open (creating if needed) the workspace ``name`` under the cache root (ComfyUI's user
    directory ``/chorus`` unless ``CHORUS_CACHE_DIR`` is set); one open handle per process.
    Raises ``ValueError`` for an invalid name (path separators, ``..``, absolute paths)."""
    path = resolve_workspace(name)
    key = str(path)
    with _WS_LOCK:
        ws = _WORKSPACES.get(key)
        if ws is None or getattr(ws, "_closed", False):
            ws = _WORKSPACES[key] = Workspace.open(path)
        return ws


def ui_text(*lines: str) -> dict:
    """UI payload shown under a node and stored in ``/history`` outputs (``{"text": [...]}``)."""
    return {"text": [line for line in lines if line]}
