"""Shared pieces of the Chorus II nodes: the CHORUS_PLAN type, the schema keywords a newer node API takes
(advanced inputs, search aliases), workspaces, input checks, UI text."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import numbers
import threading

from comfy_api.latest import io

from ..cache_store import Workspace
from ..cache_store.redaction import RedactingFilter, redact

log = logging.getLogger("chorus.nodes")
log.addFilter(RedactingFilter())

MAX_INT_INPUT = 1 << 53  # past this an INT input is absurd for every Chorus setting

CATEGORY = "Chorus II"
ChorusPlan = io.Custom("CHORUS_PLAN")


def _inputs_take_advanced() -> bool:
    """Whether this ComfyUI's V3 inputs take ``advanced`` (0.33.0 and later do; 0.3.64 does not)."""
    try:
        return "advanced" in inspect.signature(io.Input.__init__).parameters
    except (AttributeError, TypeError, ValueError):
        return False


# Keywords of an expert input (one the defaults serve): ``advanced=True`` where the host takes it (the graph
# editor's Nodes 2.0 view then hides it behind "Show advanced inputs"; its value stays in saved workflows and
# API graphs); none on an older ComfyUI, where every input shows as before.
EXPERT_INPUT: dict = {"advanced": True} if _inputs_take_advanced() else {}


def _schema_has(field_name: str) -> bool:
    try:
        return field_name in {f.name for f in dataclasses.fields(io.Schema)}
    except TypeError:
        return False


_SCHEMA_HAS_ALIASES = _schema_has("search_aliases")


def search_aliases(*aliases: str) -> dict:
    """Schema keywords: other words the graph editor's node search finds the node by, where the host's ``Schema``
    has ``search_aliases`` (0.33.0 and later); none on an older ComfyUI."""
    return {"search_aliases": list(aliases)} if _SCHEMA_HAS_ALIASES else {}


_WORKSPACES: dict[str, Workspace] = {}
_WS_LOCK = threading.Lock()


def open_workspace(name: str, *, create: bool = True) -> Workspace:
    """Open (creating if needed; with ``create=False`` a workspace that does not exist is a ``ValueError``
    that creates nothing) the cache store of workspace ``name``; one open handle per process.
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
        if ws is None or ws.closed:
            ws = _WORKSPACES[key] = open_store(name, create=create)
        return ws


def boolean_input(value, name: str) -> bool:
    """A node's boolean input, whatever was wired to it: a bool (or a 0 / 1 int); anything else raises
    ``ValueError`` naming ``name`` (the node turns it into its message and dense attention)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(int(value))
    raise ValueError(f"{name} must be a boolean, got {type(value).__name__}")


def number_input(value, name: str, *, integer: bool = False):
    """A node's numeric input as a float (or, with ``integer``, an int), whatever was wired to it:
    ComfyUI range-checks only literal widget values, so a linked or API-queued input may be of
    any type. Raises ``ValueError`` (one message naming ``name``) for bools, strings, None,
    tensors and other non-numbers, NaN, infinities, non-integral values where an int is needed
    and ints past ``MAX_INT_INPUT``; the node turns it into its message and dense attention.
    Ranges are checked by the node's own config (``SparseConfig`` ...)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if isinstance(value, numbers.Integral):
        number = int(value)
        if abs(number) > MAX_INT_INPUT:
            raise ValueError(f"{name} is out of range ({number})")
        return number if integer else float(number)
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {number}")
    if not integer:
        return number
    if number != math.floor(number) or abs(number) > MAX_INT_INPUT:
        raise ValueError(f"{name} must be a whole number, got {number}")
    return int(number)


def model_input_problem(model) -> str | None:
    """Why ``model`` cannot be patched (it is not a ComfyUI MODEL: no ``clone()`` and
    ``model_options`` dict), or None. The patching nodes then return it unchanged with the message."""
    if callable(getattr(model, "clone", None)) and isinstance(getattr(model, "model_options", None), dict):
        return None
    return f"the model input is not a ComfyUI MODEL ({type(model).__name__})"


def node_text(text: str) -> str:
    """A node's message as shown and output: credentials removed (``cache_store.redaction``)."""
    return redact(text)


def ui_text(*lines: str) -> dict:
    """UI payload shown under a node and stored in ``/history`` outputs (``{"text": [...]}``),
    redacted (:func:`node_text`)."""
    return {"text": [node_text(line) for line in lines if line]}
