"""The store protocol: what the engine and the nodes may call on a cache store, whatever is behind it.

Two implementations:

* :class:`chorus.cache_store.Workspace` — one host: a directory with SQLite (WAL), entry files and
  a faiss index (``workspace.py``);
* :class:`chorus.cache_store.fleet.FleetStore` — many hosts: entries in PostgreSQL, a faiss index
  per worker fed by a change feed, a bounded local disk tier (``fleet.py``).

:func:`open_store` picks one: ``CHORUS_CACHE_URL=postgresql://...`` (or ``url=``) selects the fleet
store, whose local tier lives under the cache root; without it, the workspace directory under the
cache root (``CHORUS_CACHE_DIR``, see :func:`chorus.cache_store.default_cache_root`), as before.

Contract shared by both (tested against both in ``tests/test_fleet_store.py::test_protocol_*``):

* ``search(embedding, k=1, signature=None) -> [(entry_id, similarity), ...]`` best first, from the
  local index only (no network round trip); ``[]`` when empty; ``ValueError`` for a bad query.
* ``load(entry_id, *, packed=False, touch=True) -> (masks, meta)``; ``KeyError`` for an unknown id,
  :class:`~chorus.cache_store.CorruptEntryError` (a ``ValueError``) for a damaged entry, which is
  quarantined first; a store that cannot be reached raises :class:`StoreUnavailableError`.
* ``add(embedding, masks, meta) -> entry_id`` and ``add_unique(..., min_similarity=, replacing=None) ->
  (entry_id, created)`` (no second entry for a request an entry already serves, checked under the
  store's writer lock; ``replacing``: an entry that does not count, a hit that failed its
  verification); an entry is visible whole or not at all.
* ``touch(entry_id, run=None)`` (a hit; ``run``: its run stats, some of ``entries.RUN_COUNTERS`` summed per
  entry, ``ValueError`` for a bad one), ``remove(entry_id) -> bool``, ``stats() -> dict``, ``verify(progress=False)
  -> dict`` (keys ``checked``, ``damaged``, ``unchecked``, ``ok``, ``index_consistent``, ``orphans_removed``,
  ``temp_files_removed``), ``prune(*, max_bytes=None, max_entries=None) -> [removed ids]``,
  ``set_limits(...)``, ``rebuild_index(progress=False) -> index kinds``, ``entries() -> [dict]`` (each with ``runs``, the summed run stats),
  ``quarantined() -> [dict]``, ``len(store)``, ``close()``; usable as a context manager.

Errors follow the store contract of ``errors.py`` (README.md): problems of the store itself leave
as :class:`~chorus.cache_store.errors.StoreError` (an ``OSError``; :class:`StoreBusyError` when
another worker held what the call needed past the time bound, ``CHORUS_CACHE_TIMEOUT``, 2 s by
default; :class:`StoreUnavailableError` when the fleet's server is down or silent), bad input and
damaged entries as ``ValueError``. Every call made while a prompt runs returns within a few
seconds; the engine turns an error into a miss, or a write not made, with a message, never a
failed prompt.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

from .errors import MissingDriverError, StoreUnavailableError  # noqa: F401 - also importable from here, as before

URL_ENV = "CHORUS_CACHE_URL"


@runtime_checkable
class CacheStore(Protocol):
    """Structural type of a cache store (see the module docstring for the contract)."""

    def search(self, embedding, k: int = 1, signature=None) -> list[tuple[int, float]]: ...

    def load(self, entry_id: int, *, packed: bool = False, touch: bool = True): ...

    def add(self, embedding, masks: dict, meta: dict) -> int: ...

    def add_unique(self, embedding, masks: dict, meta: dict, *, min_similarity: float,
                   replacing: int | None = None) -> tuple[int, bool]: ...

    def touch(self, entry_id: int, run=None) -> None: ...

    def remove(self, entry_id: int) -> bool: ...

    def stats(self) -> dict: ...

    def verify(self, progress: bool = False) -> dict: ...

    def prune(self, *, max_bytes: int | None = None, max_entries: int | None = None) -> list[int]: ...

    def set_limits(self, *, max_bytes: int | None = None, max_entries: int | None = None,
                   eviction: str | None = None) -> None: ...

    def rebuild_index(self, progress: bool = False) -> dict: ...

    def entries(self) -> list[dict]: ...

    def quarantined(self) -> list[dict]: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...


def cache_url(url: str | None = None) -> str | None:
    """The fleet store URL: ``url`` if given, else ``CHORUS_CACHE_URL``, else None (one-host store).
    Raises ``ValueError`` for a URL that is not ``postgresql://`` / ``postgres://`` (the message
    does not repeat the URL, which may hold a password)."""
    url = url if url is not None else os.environ.get(URL_ENV)
    if url is None or not url.strip():
        return None
    url = url.strip()
    if not url.startswith(("postgresql://", "postgres://")):
        raise ValueError(f"the cache URL must start with postgresql:// (set {URL_ENV} or --url)")
    return url


def store_key(workspace: str, *, root=None, url: str | None = None) -> tuple[str, str]:
    """A key naming one store (for a per-process cache of open handles): (url or "", local path)."""
    from .paths import resolve_workspace

    return (cache_url(url) or "", str(resolve_workspace(workspace, root)))


def open_store(workspace: str, *, root=None, url: str | None = None, **options) -> CacheStore:
    """Open the store of workspace ``workspace`` (a validated name): the fleet store when a URL is
    given or ``CHORUS_CACHE_URL`` is set, else the one-host :class:`Workspace` under the cache root.
    ``options`` go to the store's ``open``. Raises ``ValueError`` for a bad name or URL and
    :class:`StoreUnavailableError` when PostgreSQL cannot be reached."""
    from .paths import resolve_workspace

    path = resolve_workspace(workspace, root)
    url = cache_url(url)
    if url is None:
        from .workspace import Workspace

        return Workspace.open(path, **options)
    from .fleet import FleetStore

    return FleetStore.open(url, workspace, local_path=path, **options)
