"""Chorus cache store: persistent per-workspace mask cache with faiss retrieval.

Imports without ComfyUI. Public API: :class:`Workspace` (``Workspace.open(path)``),
:func:`resolve_workspace`, :func:`signature_key`, :mod:`embedders`. See README.md in this folder.
"""

from . import embedders
from .entry_format import EntryFormatError, PackedMap
from .paths import default_cache_root, resolve_workspace, validate_workspace_name
from .signature import canonical_signature, signature_key
from .workspace import CorruptEntryError, Workspace

__all__ = [
    "Workspace",
    "CorruptEntryError",
    "EntryFormatError",
    "PackedMap",
    "resolve_workspace",
    "validate_workspace_name",
    "default_cache_root",
    "signature_key",
    "canonical_signature",
    "embedders",
]
