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
    """Open (creating if needed) the cache store of workspace ``name``; one open handle per process.
    The store follows ``chorus.cache_store.protocol`` (the engine calls nothing else): the fleet
    store (PostgreSQL) when ``CHORUS_CACHE_URL`` is set, else the one-host workspace directory
    under the cache root (ComfyUI's user directory ``/chorus`` unless ``CHORUS_CACHE_DIR`` is set;
    the fleet store keeps its local tier there). Raises ``ValueError`` for an invalid name (path
    separators, ``..``, absolute paths) or URL, ``OSError`` (``StoreUnavailableError``) when
    PostgreSQL cannot be reached (not cached: the next request tries again)."""
    from ..cache_store.protocol import open_store, store_key

    key = store_key(name)
    with _WS_LOCK:
        ws = _WORKSPACES.get(key)
        if ws is None or getattr(ws, "_closed", False):
            ws = _WORKSPACES[key] = open_store(name)
        return ws


def ui_text(*lines: str) -> dict:
    """UI payload shown under a node and stored in ``/history`` outputs (``{"text": [...]}``)."""
    return {"text": [line for line in lines if line]}
