"""Chorus cache store: persistent per-workspace mask cache with faiss retrieval.

Imports without ComfyUI. Public API: :class:`Workspace` (``Workspace.open(path)``),
:func:`resolve_workspace`, :func:`signature_key`, :mod:`embedders`; the store protocol
(:class:`CacheStore`, :func:`open_store`) and the PostgreSQL :class:`FleetStore`. See README.md in this folder.
Names are resolved lazily (PEP 562), so ``python -m chorus cache`` rejects bad arguments without
importing torch and faiss.
"""

from importlib import import_module

from .paths import default_cache_root, resolve_workspace, validate_workspace_name
from .signature import canonical_signature, signature_key

_LAZY = {
    "Workspace": ".workspace",
    "CorruptEntryError": ".entries",
    "EntryFormatError": ".entry_format",
    "PackedMap": ".entry_format",
    "CacheStore": ".protocol",
    "open_store": ".protocol",
    "StoreUnavailableError": ".errors",
    "FleetStore": ".fleet",
    "StoreError": ".errors",
    "StoreBusyError": ".errors",
    "UnsafeLayoutError": ".errors",
    "StoreFullError": ".errors",
    "StoreReadOnlyError": ".errors",
}

__all__ = [
    "Workspace",
    "CorruptEntryError",
    "EntryFormatError",
    "PackedMap",
    "CacheStore",
    "open_store",
    "StoreUnavailableError",
    "FleetStore",
    "StoreError",
    "StoreBusyError",
    "UnsafeLayoutError",
    "StoreFullError",
    "StoreReadOnlyError",
    "resolve_workspace",
    "validate_workspace_name",
    "default_cache_root",
    "signature_key",
    "canonical_signature",
    "embedders",
]


def __getattr__(name):
    if name == "embedders":
        return import_module(".embedders", __name__)
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
