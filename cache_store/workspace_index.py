"""The workspace's index generations: its in-memory faiss index kept at SQLite's ``generation``.

Every commit that adds or removes entries bumps ``generation`` in the same SQLite transaction. A
handle's index remembers the generation it matches; every search compares it with SQLite's and
catches up (adds and removes the difference) when another handle or process wrote. On open, the
newest ``index.g<generation>.safetensors`` is loaded (a regular file, within a size derived from
the entry count, made for this database: its ``workspace_id``) and caught up the same way; when it
is missing, damaged or of another database, the index is rebuilt from the embeddings in SQLite
(which are also inside each entry file). The index is saved atomically, under the writers' lock,
after every ``max(256, size / 10)`` changes and on close; older index files are deleted. Rows
whose signature key or embedding fails ``rows.is_sig_key`` / ``rows.check_embedding`` are left out of the
index, logged.

:class:`WorkspaceIndex` is a part of :class:`~chorus.cache_store.workspace.Workspace` (a mixin):
it uses the handle's read connection and reader mutex (``_rdb``, ``_rmutex``: callers of the
underscored methods hold ``_rmutex``), its directory descriptor and writers' lock (``_dir_fd``,
``_writing``), and keeps ``_index``, ``_index_generation``, ``_unsaved_changes`` and ``_set_aside``.
Tested in ``tests/test_cache_workspace.py`` (reopen / missing / corrupt / stale index files, two
handles catching up, an index file of another database) and ``tests/test_cache_hardening.py``
(``index_consistent`` beside an evicting worker).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import numpy as np

from . import seams
from .index import PartitionedIndex
from .rows import QUIET_FLOATS, check_embedding, is_sig_key
from .safe_fs import atomic_write, read_regular_file, unlink
from .workspace_db import read_generation, setting, store_call

LOG = logging.getLogger(__name__)

MAX_INDEX_FILE_BYTES = 16 << 30
INDEX_NAME_RE = re.compile(r"index\.g([0-9]{1,18})\.safetensors")


class WorkspaceIndex:
    """The index part of a workspace handle (see the module docstring)."""

    def _index_files(self):
        files = []
        for name in os.listdir(self._dir_fd):
            m = INDEX_NAME_RE.fullmatch(name)
            if m:
                files.append((int(m.group(1)), name))
        return sorted(files, reverse=True)

    def _rows_for_index(self, ids=None):
        if ids is None:
            return self._rdb.execute("SELECT id, sig_key, embedding FROM entries ORDER BY id").fetchall()
        ids = list(ids)
        rows = []
        for start in range(0, len(ids), 500):
            part = ids[start : start + 500]
            q = f"SELECT id, sig_key, embedding FROM entries WHERE id IN ({','.join('?' * len(part))}) ORDER BY id"
            rows.extend(self._rdb.execute(q, part).fetchall())
        return rows

    def _add_rows_to_index(self, index: PartitionedIndex, rows) -> None:
        """Index rows ``(id, sig_key, embedding bytes)``; a row whose signature key or embedding fails
        the row checks (``rows.is_sig_key``, ``rows.check_embedding``: e.g. a database edited by hand) is
        set aside, logged."""
        good = []
        with np.errstate(**QUIET_FLOATS):
            for entry_id, key, blob in rows:
                if entry_id in self._set_aside:
                    continue
                try:
                    if not is_sig_key(key):
                        raise ValueError(f"signature key {str(key)[:40]!r} is not one the store makes")
                    good.append((entry_id, key, check_embedding(blob, index.dim)))
                except (ValueError, TypeError) as exc:
                    LOG.error("entry %d of %s is left out of the index: %s", entry_id, self.path, exc)
                    self._set_aside.add(int(entry_id))
        index.add_rows(good)

    def _index_file_cap(self, dim: int) -> int:
        """The most bytes a saved index of this workspace can take: per entry its vector, its id and
        HNSW links (generously), twice over for tombstones, plus headers; at most MAX_INDEX_FILE_BYTES."""
        count = self._rdb.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        return min(MAX_INDEX_FILE_BYTES, (1 << 20) + 2 * count * (4 * dim + 1024))

    def _load_index_file(self, dim: int):
        cap = self._index_file_cap(dim)
        for file_gen, name in self._index_files():
            try:
                data = read_regular_file(name, dir_fd=self._dir_fd, max_bytes=cap)
                index, saved_gen = PartitionedIndex.from_bytes(data)
                if index.dim != dim or saved_gen != file_gen or index.owner != self._workspace_id:
                    raise ValueError("index file does not match the workspace")
                index.approx_threshold = self._approx_threshold
                LOG.debug("loaded %s (generation %d)", name, saved_gen)
                return index
            except FileNotFoundError:
                continue  # replaced by a newer one meanwhile
            except (OSError, ValueError, MemoryError) as exc:
                LOG.warning("ignoring %s index file %s: %s", "the" if self.readonly else "and deleting", name, exc)
                if not self.readonly:
                    unlink(name, self._dir_fd)  # files appear complete (rename): never a write in progress
        return None

    def _sync_index(self, force_rebuild: bool = False) -> None:
        """Bring the in-memory index to SQLite's generation (load / catch up / rebuild). Reads only."""
        with self._rmutex:
            generation = read_generation(self._rdb)
            if not force_rebuild and self._index is not None and generation == self._index_generation:
                return
            dim = setting(self._rdb, "dim")
            if dim is None:
                self._index, self._index_generation = None, generation
                return
            dim = int(dim)
            if force_rebuild:
                self._index = None
            elif self._index is None:
                self._index = self._load_index_file(dim)
            if self._index is None:
                LOG.info("building the index of %s from SQLite", self.path)
                self._index = PartitionedIndex(dim, self._approx_threshold)
                self._add_rows_to_index(self._index, self._rows_for_index())
                self._unsaved_changes += 1
            else:
                rows = self._rdb.execute("SELECT id, sig_key FROM entries").fetchall()
                live = {entry_id: key for entry_id, key in rows if entry_id not in self._set_aside}
                stale = [i for i, key in self._index.where.items() if live.get(i) != key]
                if stale:
                    self._index.remove(stale)
                missing = [i for i in live if i not in self._index.where]
                if missing:
                    self._add_rows_to_index(self._index, self._rows_for_index(sorted(missing)))
                self._unsaved_changes += len(stale) + len(missing)
            self._index_generation = generation

    def _index_committed(self, generation_before: int, *, added=None, removed=()) -> None:
        """After this handle committed ``generation_before + 1``: apply its own change to the
        in-memory index when the index was at ``generation_before``, else catch up from SQLite."""
        with self._rmutex:
            if self._index_generation == generation_before and (self._index is not None or added is not None):
                if self._index is None:
                    self._index = PartitionedIndex(added[2].size, self._approx_threshold)
                if removed:
                    self._index.remove(list(removed))
                if added is not None:
                    self._index.add(added[1], [added[0]], added[2][None])
                self._index_generation = generation_before + 1
                self._unsaved_changes += len(removed) + (added is not None)
            self._sync_index()

    @store_call
    def save_index(self) -> Path | None:
        """Write the index atomically as ``index.g<generation>.safetensors`` (under the writers'
        lock, within the time bound); drop older ones."""
        with self._writing():
            self._sync_index()
            with self._rmutex:
                if self._index is None:
                    return None
                generation = self._index_generation
                data = self._index.to_bytes(generation, self._workspace_id)
                self._unsaved_changes = 0
            name = f"index.g{generation}.safetensors"
            atomic_write(self._dir_fd, name, data, phase=seams.workspace_phase)
            for file_gen, old in self._index_files():
                if file_gen < generation:
                    try:
                        os.unlink(old, dir_fd=self._dir_fd)
                    except FileNotFoundError:
                        pass
            return self.path / name

    @store_call
    def rebuild_index(self, progress: bool = False) -> dict:
        """Rebuild the index from the entries' embeddings in SQLite (tqdm bar if ``progress``) and save it."""
        with self._rmutex:
            generation = read_generation(self._rdb)
            dim = setting(self._rdb, "dim")
            if dim is None:
                self._index, self._index_generation = None, generation
                return {}
            index = PartitionedIndex(int(dim), self._approx_threshold)
            rows = self._rows_for_index()
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=len(rows), desc="rebuild-index", unit="entry")
            for start in range(0, len(rows), 2048):
                self._add_rows_to_index(index, rows[start : start + 2048])
                if bar is not None:
                    bar.update(len(rows[start : start + 2048]))
            if bar is not None:
                bar.close()
            self._index, self._index_generation = index, generation
            self._sync_index()
        if not self.readonly:
            self.save_index()
        with self._rmutex:
            return self._index.kinds()

    def _maybe_save_index(self) -> None:
        size = len(self._index) if self._index is not None else 0
        if self._unsaved_changes >= max(256, size // 10):
            try:
                self.save_index()
            except OSError as exc:  # an optimisation: the index is rebuildable
                LOG.warning("could not save the index of %s: %s", self.path, exc)

    def _index_matches(self) -> bool:
        """Whether the in-memory index holds exactly the live entries, compared at one generation:
        the generation and the live ids are read in one snapshot, and the comparison is retried
        until the index has caught up to that same generation (writers keep committing)."""
        same = False
        for _ in range(50):
            with self._rmutex:
                self._sync_index()
                db = self._rdb
                db.execute("BEGIN")
                try:
                    generation = read_generation(db)
                    live = {r[0] for r in db.execute("SELECT id FROM entries")} - self._set_aside
                finally:
                    db.execute("COMMIT")
                indexed = set(self._index.where) if self._index is not None else set()
                same = live == indexed
                if generation == self._index_generation:
                    return same
        return same
