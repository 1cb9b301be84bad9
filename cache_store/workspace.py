"""A workspace: a directory of immutable mask entries, their SQLite metadata and a faiss index.

Layout of a workspace directory::

    chorus.sqlite3           metadata (WAL): entries, settings (generation, dim, limits), quarantine
    entries/<uuid>.safetensors   one immutable file per entry (see entry_format.py)
    index.g<generation>.safetensors   the saved faiss index and the generation it matches
    quarantine/              damaged entry files, moved here with the reason in SQLite
    write.lock               cross-process writer lock (filelock)

Write protocol of :meth:`Workspace.add` (under the writer lock): encode (``entries.py``) -> write a temporary file
in ``entries/`` -> fsync -> rename to its final name -> fsync the directory -> one SQLite
transaction inserting the row and bumping ``generation``. A process killed before the commit
leaves at most an orphan or temporary file with no row (removed by :meth:`Workspace.verify` and by
the next writer that cleans up); a row exists only for a complete, fsynced file.

Readers take no lock: SQLite WAL gives them a consistent snapshot and files are never modified in
place. :meth:`Workspace.open` of an existing workspace, :meth:`search`, :meth:`load` and
``len()`` read through their own SQLite connection and never wait for a writer, in this process
or another; writes (add, touch, remove, quarantine, eviction, limits) use a second connection.

Time bound (``timeout``, default :func:`chorus.cache_store.errors.store_timeout`: 2 s or
``CHORUS_CACHE_TIMEOUT``): no call waits longer than that for another thread or process (the
writers' lock, SQLite's write lock). Past it the call raises
:class:`~chorus.cache_store.errors.StoreBusyError` (an ``OSError``) having changed nothing, except
:meth:`load` with ``touch=True``, which never waits to count its hit: when SQLite's write lock is
busy that instant the hit is kept in memory (logged) and counted by the handle's next
:meth:`touch` or :meth:`close`.
Every other ``sqlite3`` error leaves as :class:`~chorus.cache_store.errors.StoreError` (an
``OSError``).

Nothing outside the workspace: the workspace directory, ``entries/`` and ``quarantine/`` are held
open as directory descriptors (opened without following links) and every file operation is made
relative to them. A symbolic link, or a file of the wrong kind (FIFO, device, directory), where the
store keeps ``entries/``, ``quarantine/``, ``chorus.sqlite3`` (+ ``-wal``/``-shm``) or
``write.lock`` makes :meth:`open` raise :class:`~chorus.cache_store.errors.UnsafeLayoutError`.
Entry and index files are opened with ``O_NOFOLLOW | O_NONBLOCK`` after an ``lstat``: a link, FIFO
or other non-regular file is never read (the entry is quarantined with the reason; moving a link
moves the link, never its target). :meth:`verify` deletes only files whose names the store makes
(``<32 hex>.safetensors`` without a row, ``.tmp-<pid>-<32 hex>``); anything else in ``entries/``
(a ``lost+found`` directory, a stray file, a temporary *directory*) is reported in ``stray``.

Loads check the file before reading it: a regular file (checked without blocking), its size equal
to the row's ``nbytes`` and at most ``MAX_ENTRY_FILE_BYTES``; then its sha256 against SQLite, then
the decoder's caps (see entry_format.py: element cap from the signature's geometry, bounded
decompression, bounded JSON depth). A missing, mis-sized, non-regular, truncated, bit-flipped or
undecodable entry is moved to ``quarantine/``, logged, recorded (``stats()["quarantined"]``,
:meth:`verify`), removed from the index, and :class:`CorruptEntryError` (a ``ValueError``) is
raised, so the caller falls back to dense attention while later searches go on without the entry.
An entry whose row is gone by the time its file is found missing was evicted (by this or another
process) meanwhile: :meth:`load` raises ``KeyError`` and :meth:`verify` lists it under
``evicted``, neither quarantines nor reports damage.

The parts of a handle, each in its own module: the index generations (``workspace_index.py``:
the in-memory index follows SQLite's ``generation``, loaded from ``index.g*.safetensors`` or
rebuilt), maintenance (``workspace_maintenance.py``: quarantine, eviction by ``max_bytes`` /
``max_entries`` with ``"lru"`` or ``"lfu"``, prune, orphan cleanup, verify), the SQLite layout
(``workspace_db.py``) and the no-follow file I/O (``safe_fs.py``, shared with the fleet's local
tier). :meth:`touch` (called by :meth:`load`) counts a hit and updates ``last_used``.

Read-only handles (``Workspace.open(path, readonly=True)``, used by ``cache stats`` and ``cache
list``) create, write, move and delete nothing: the directory must already be a workspace
(``ValueError`` otherwise), SQLite is opened read-only (``immutable`` while no other process has
the database open, so not even SQLite's ``-wal``/``-shm`` files appear), damaged entries are
reported but not quarantined, and the index is built in memory only.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path

from filelock import FileLock

from . import seams
from .entries import COUNTED, MAX_ENTRY_FILE_BYTES, RUN_COUNTERS, CorruptEntryError, EntryGone, PendingHits, \
    check_k, checked_entry_id, counted_increments, encode_new_entry, run_counts, search_index, serving_entry, \
    similarity_bound
from .entry_format import EntryFormatError, decode_entry
from .errors import StoreBusyError, StoreError, UnsafeLayoutError, store_timeout
from .index import DEFAULT_APPROX_THRESHOLD, PartitionedIndex
from .limits import check_limits, stored_limits_shown
from .paths import check_not_in_pack
from .rows import row_meta
from .safe_fs import atomic_write, read_regular_file, unlink
from .workspace_db import (DB_NAME, ENTRY_DIR, ENTRY_NAME_RE, LOCK_NAME, QUARANTINE_DIR, ROW_NBYTES,
                           WorkspaceConnections, read_generation, set_setting, setting, store_call, stored_limits)
from .workspace_index import WorkspaceIndex
from .workspace_maintenance import WorkspaceMaintenance

LOG = logging.getLogger(__name__)


class Workspace(WorkspaceConnections, WorkspaceIndex, WorkspaceMaintenance):
    """One cache workspace (see the module docstring). Use :meth:`open`; usable as a context manager.

    Thread-safe within a process; safe across processes (SQLite WAL for readers, a file lock for
    writers). Readers and writers of one handle use separate SQLite connections and separate
    mutexes, so a search never waits behind a write of another thread.
    """

    def __init__(self, path: Path, *, approx_threshold: int = DEFAULT_APPROX_THRESHOLD, timeout: float,
                 readonly: bool = False, create: bool = True):
        self.path = path
        self.entry_dir = path / ENTRY_DIR
        self.quarantine_dir = path / QUARANTINE_DIR
        self.timeout = float(timeout)
        self.readonly = bool(readonly)
        self._approx_threshold = int(approx_threshold)
        self._index: PartitionedIndex | None = None
        self._index_generation = -1
        self._unsaved_changes = 0
        self._set_aside: set[int] = set()  # damaged entries this handle could not quarantine (read-only/busy)
        self._pending = PendingHits()  # hits (and their run stats) not written yet: the store was busy
        self._closed = False
        self._fds: list[int] = []
        self._rdb = self._wdb = None
        self._immutable_stamp = None  # a read-only handle's immutable read: the database stamp it read
        self._rmutex = threading.RLock()  # the read connection and the in-memory index
        self._wmutex = threading.RLock()  # the write connection; writers of this handle
        try:
            if not create and not os.path.lexists(path / DB_NAME):  # checked before anything is created
                raise ValueError(f"{path} is not a Chorus cache workspace (no {DB_NAME}); nothing was created there")
            self._open_layout(create=not readonly)  # a writable handle of a workspace restores missing subdirs
            self._file_lock = None if self.readonly else FileLock(str(path / LOCK_NAME), timeout=self.timeout)
            self._connect(create=create and not readonly)
        except BaseException:
            self._close_handles()
            raise

    @classmethod
    def open(cls, path, *, max_bytes: int | None = None, max_entries: int | None = None,
             eviction: str | None = None, approx_threshold: int = DEFAULT_APPROX_THRESHOLD,
             timeout: float | None = None, create: bool = True, readonly: bool = False) -> "Workspace":
        """Open the workspace directory ``path`` (a trusted path; for user-given names use
        :func:`chorus.cache_store.resolve_workspace` first), creating it unless ``create=False`` or
        ``readonly=True``. Limits given here are stored and persist; ``None`` keeps the stored value
        (default: 20 GiB, no entry cap, LRU). ``approx_threshold``: partition size at which the index
        switches from exact to HNSW. ``timeout``: the time bound in seconds (module docstring).

        Opening an existing workspace takes no lock and writes nothing. Raises ``ValueError`` for a
        path that is not a directory, a missing workspace with ``create=False``/``readonly``, bad
        limits or timeout; :class:`~chorus.cache_store.errors.UnsafeLayoutError` for links or
        wrong kinds of files where the store keeps its own;
        :class:`~chorus.cache_store.errors.StoreError` for an unreadable database;
        :class:`~chorus.cache_store.errors.StoreBusyError` when a new workspace cannot be
        initialised within the time bound. All are ``ValueError`` or ``OSError``.
        """
        timeout = store_timeout(timeout)
        path = check_not_in_pack(path)
        if os.path.lexists(path) and not path.is_dir():
            raise ValueError(f"workspace path {path} exists and is not a directory")
        if create and not readonly:
            path.mkdir(parents=True, exist_ok=True)
        ws = cls(path, approx_threshold=approx_threshold, timeout=timeout, readonly=readonly, create=create)
        try:
            if max_bytes is not None or max_entries is not None or eviction is not None:
                ws.set_limits(max_bytes=max_bytes, max_entries=max_entries, eviction=eviction)
            ws._sync_index()
        except sqlite3.Error as exc:
            ws._close_handles()
            raise StoreError(f"workspace {path}: metadata database error: {exc}") from exc
        except BaseException:
            ws._close_handles()
            raise
        return ws

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (a closed handle is opened anew, never reused)."""
        return self._closed

    def close(self) -> None:
        """Save the index if it changed since the last save (skipped when the writers' lock stays
        busy past the time bound: the index is rebuildable), and close the database. A write of
        another thread of this handle still running past the time bound keeps the handle's files
        open until it ends (it closes them then): no descriptor is closed under a write."""
        if self._closed:
            return
        if self._pending and not self.readonly:
            try:
                self._flush_hits()
            except Exception as exc:  # noqa: BLE001 - hit counts steer eviction only
                LOG.warning("%d hits of %s not counted: %s", self._pending.hits, self.path, exc)
        if self._unsaved_changes and not self.readonly:
            try:
                self.save_index()
            except Exception as exc:  # saving is an optimisation; the index is rebuildable
                LOG.warning("could not save the index of %s: %s", self.path, exc)
        got_writer = self._wmutex.acquire(timeout=self.timeout)  # lock order: writer mutex, then reader mutex
        try:
            with self._rmutex:
                if not self._closed:
                    self._closed = True
                    if got_writer:
                        self._close_handles()
                    else:
                        LOG.warning("workspace %s closed while another thread writes; its files close when "
                                    "that write ends", self.path)
        finally:
            if got_writer:
                self._wmutex.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @store_call
    def __len__(self) -> int:
        with self._rmutex:
            return self._rdb.execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    @store_call
    def limits(self) -> dict:
        """The stored limits: ``max_bytes``, ``max_entries`` (None: no entry cap), ``eviction``.
        Raises ``ValueError`` for a setting that is not a valid limit."""
        return stored_limits_shown(**stored_limits(self._rdb))

    def _limits_or_reason(self) -> dict:
        try:
            return self.limits()
        except ValueError as exc:  # stats still answer for a workspace whose settings were edited badly
            return {"invalid": str(exc)}

    @store_call
    def set_limits(self, *, max_bytes: int | None = None, max_entries: int | None = None,
                   eviction: str | None = None) -> None:
        """Store the size cap (``max_entries=0`` means no entry cap) and eviction policy."""
        valid = check_limits(max_bytes, max_entries, eviction)
        with self._writing() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                for key, value in valid.items():
                    if value is not None:
                        set_setting(db, key, value)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise


    def add(self, embedding, masks: dict, meta: dict) -> int:
        """Store one entry; returns its id (ids are never reused).

        ``embedding``: 1-D finite float vector (all entries of a workspace share its dimension).
        ``masks``: ``{(expert, step, layer, head_group): bool block map}`` (shape kept as given;
        float16/uint8/... tensors such as quantised block mass are also accepted). ``meta``: a
        JSON-serialisable dict with a ``"signature"`` dict, nested at most 64 deep. Raises
        ``ValueError`` on bad input, including metadata the store cannot keep (too deep, too large,
        not JSON) and masks past the signature's element cap; ``StoreBusyError`` (nothing written)
        when another process holds the store past the time bound; ``OSError`` when the disk refuses
        (nothing written: no row, no file left behind).
        """
        return self._add(embedding, masks, meta, None)[0]

    def add_unique(self, embedding, masks: dict, meta: dict, *, min_similarity: float,
                   replacing: int | None = None) -> tuple[int, bool]:
        """Like :meth:`add`, unless the workspace already holds an entry with the same signature and
        cosine similarity >= ``min_similarity`` (checked under the writer lock, after catching up
        with other processes): then nothing is written and ``(that entry id, False)`` is returned;
        else ``(new entry id, True)``. Several workers that missed on the same request at once thus
        write it once. ``replacing``: an entry that does not count as serving the request (a hit
        that failed its verification; it stays, the new entry is written beside it). Raises as :meth:`add`.
        """
        return self._add(embedding, masks, meta, similarity_bound(min_similarity), replacing)

    @store_call
    def _add(self, embedding, masks: dict, meta: dict, min_similarity: float | None,
             replacing: int | None = None) -> tuple[int, bool]:
        new = encode_new_entry(embedding, masks, meta)
        sig_key, emb, data, digest, meta_json, now = (new.sig_key, new.embedding, new.data, new.digest,
                                                       new.meta_json, new.created)
        file_name = f"{uuid.uuid4().hex}.safetensors"
        with self._writing() as db:
            self._sync_index()
            dim = setting(db, "dim")
            if dim is not None and int(dim) != emb.size:
                raise ValueError(f"embedding has dim {emb.size}, this workspace holds dim {dim}")
            if min_similarity is not None:
                with self._rmutex:
                    served = serving_entry(self._index, emb, sig_key, min_similarity, replacing)
                if served is not None:
                    return served, False
            atomic_write(self._entry_fd, file_name, data, phase=seams.workspace_phase)
            seams.workspace_phase("file_durable")
            try:
                db.execute("BEGIN IMMEDIATE")
                generation = read_generation(db)
                if setting(db, "dim") is None:
                    set_setting(db, "dim", emb.size)
                cur = db.execute(
                    "INSERT INTO entries(file, sig_key, sha256, nbytes, embedding, meta_json, created, last_used, hits)"
                    " VALUES(?, ?, ?, ?, ?, ?, ?, ?, 0)",
                    (file_name, sig_key, digest, len(data), emb.tobytes(), meta_json, now, now))
                entry_id = int(cur.lastrowid)
                set_setting(db, "generation", generation + 1)
                seams.workspace_phase("before_commit")
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                unlink(file_name, self._entry_fd)
                raise
            seams.workspace_phase("committed")
            self._index_committed(generation, added=(entry_id, sig_key, emb))
            self._evict_after_write(db, entry_id)
        return entry_id, True

    @store_call
    def remove(self, entry_id: int) -> bool:
        """Delete an entry; returns whether it existed (``ValueError`` for an id that is not an int)."""
        try:
            entry_id = checked_entry_id(entry_id)
        except KeyError:
            return False
        with self._writing() as db:
            self._sync_index()
            return bool(self._delete_locked(db, [entry_id]))

    # -- reading -----------------------------------------------------------------------------
    @store_call
    def search(self, embedding, k: int = 1, signature=None) -> list[tuple[int, float]]:
        """Top ``k`` ``(entry_id, cosine similarity)``, best first (ties: lower id first).

        ``signature``: a signature dict (or its :func:`signature_key`) restricting results to
        compatible entries. An empty workspace returns ``[]``; a query of the wrong dimension,
        NaN/inf or zero raises ``ValueError``. Never waits for a writer.
        """
        check_k(k)  # before the sync: a bad argument costs no database read
        with self._rmutex:
            self._sync_index()
            return search_index(self._index, embedding, k, signature)

    def _row(self, entry_id: int):
        """``(file, sha256, meta_json, nbytes)`` of an entry, or None."""
        with self._rmutex:
            return self._rdb.execute("SELECT file, sha256, meta_json, nbytes FROM entries WHERE id=?",
                                     (int(entry_id),)).fetchone()

    @store_call
    def entry_path(self, entry_id: int) -> Path | None:
        """The path of an entry's file (``entries/<32 hex>.safetensors``), or None for an unknown id.
        For operators and tests that inspect or damage a file; the store reads it only through its
        checks (never follow what is found there)."""
        try:
            row = self._row(checked_entry_id(entry_id))
        except KeyError:
            return None
        return None if row is None else self.entry_dir / row[0]

    def _damaged(self, entry_id: int, file: str, reason: str):
        """Quarantine and return the CorruptEntryError to raise; raise EntryGone if the row went."""
        if not self._quarantine(entry_id, file, reason):
            raise EntryGone(entry_id)
        return CorruptEntryError(f"entry {entry_id}: {reason} " +
                                 ("(read-only: not quarantined)" if self.readonly else "(quarantined)"))

    def _read_checked(self, entry_id: int, row) -> bytes:
        """The entry's bytes after the checks of the module docstring (kind, size, sha256)."""
        file, digest, _, nbytes = row
        if type(nbytes) is not int:
            raise self._damaged(entry_id, file, f"the row's size {str(nbytes)[:40]!r} is not an integer")
        if self._entry_fd is None:  # read-only handle of a workspace without entries/
            raise self._damaged(entry_id, file, "file missing (no entries/ directory)")
        if not ENTRY_NAME_RE.fullmatch(file):
            raise self._damaged(entry_id, file, f"file name {file[:80]!r} is not one the store makes")
        try:
            data = read_regular_file(file, dir_fd=self._entry_fd, max_bytes=MAX_ENTRY_FILE_BYTES,
                                     expected_size=int(nbytes))
        except FileNotFoundError:
            raise self._damaged(entry_id, file, "file missing") from None
        except UnsafeLayoutError as exc:
            raise self._damaged(entry_id, file, str(exc)) from None
        except OSError as exc:  # e.g. EACCES, EIO: the file is not readable, the entry is not usable
            raise self._damaged(entry_id, file, f"unreadable ({exc.strerror or exc})") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise self._damaged(entry_id, file, "sha256 mismatch")
        return data

    def _decode_checked(self, entry_id: int, file: str, data: bytes, decode):
        """``decode(data)``, or :class:`CorruptEntryError` with the entry quarantined. ``decode``: the entry
        decoder, ``bytes -> (masks, embedding, meta)``: ``functools.partial(decode_entry, packed=...)`` for a
        load, ``decode_entry_arrays`` for verify (every check of decoding, without torch). A ``MemoryError``
        leaves as it is, the entry untouched (the machine is short of memory; the entry passed its caps)."""
        try:
            return decode(data)
        except (EntryFormatError, RecursionError) as exc:
            reason = f"undecodable: {exc}" if isinstance(exc, EntryFormatError) else f"undecodable: {type(exc).__name__}"
            raise self._damaged(entry_id, file, reason) from None

    @store_call
    def load(self, entry_id: int, *, packed: bool = False, touch: bool = True):
        """``(masks, meta)`` of an entry. Bool maps come back with the shape they were added with
        (as :class:`~chorus.cache_store.entry_format.PackedMap` when ``packed``; unpack on the GPU
        with ``.unpack(device)``). Counts a hit unless ``touch=False``, without waiting (a hit that
        cannot be written this instant is kept pending, see the module docstring). Raises
        ``KeyError`` for an unknown id (or one evicted while it was read; ``ValueError`` for an id that
        is not an int: :func:`~chorus.cache_store.entries.checked_entry_id`) and
        :class:`CorruptEntryError` for a damaged (now quarantined) entry. Never waits for a writer
        except to quarantine a damaged entry (within the time bound).
        """
        entry_id = checked_entry_id(entry_id)
        row = self._row(entry_id)
        if row is None:
            raise KeyError(f"no entry {entry_id} in workspace {self.path}")
        seams.workspace_phase("row_read")
        if int(entry_id) in self._set_aside:
            raise CorruptEntryError(f"entry {entry_id} was found damaged earlier (quarantine pending)")
        try:
            data = self._read_checked(entry_id, row)
            masks, _, meta = self._decode_checked(entry_id, row[0], data, functools.partial(decode_entry, packed=packed))
        except EntryGone:
            raise KeyError(f"entry {entry_id} of workspace {self.path} was removed (evicted) while it was read") from None
        if touch:
            self._count_hit(entry_id)
        return masks, meta

    def _count_hit(self, entry_id: int) -> None:
        """Count a hit without waiting: if SQLite's write lock is busy this instant, the hit is kept
        in memory and counted by this handle's next touch or close (or lost if the process ends)."""
        if self.readonly:
            return
        self._pending.add(entry_id)
        try:
            self._flush_hits(timeout=0.0)
        except (StoreBusyError, sqlite3.OperationalError) as exc:
            LOG.warning("hit of entry %d not counted yet (kept for the next write): %s", entry_id,
                        exc if isinstance(exc, StoreBusyError) else "the store is busy")

    def _flush_hits(self, timeout: float | None = None) -> None:
        """Write every pending hit and its run stats in one transaction (SQLite's write lock only,
        within ``timeout``); on any error they stay pending (:class:`~chorus.cache_store.entries.PendingHits`)."""
        with self._writing(file_lock=False, timeout=timeout) as db, self._pending.flushing() as batch:
            if not batch:
                return
            sets = counted_increments(COUNTED, "?")
            try:
                db.execute("BEGIN IMMEDIATE")
                now = time.time()
                db.executemany(f"UPDATE entries SET {sets}, last_used = ? WHERE id = ?",
                               [(*counts, now, entry_id) for entry_id, counts in sorted(batch.items())])
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    @store_call
    def touch(self, entry_id: int, run=None) -> None:
        """Count a hit: ``hits += 1``, ``last_used = now`` (drives LRU/LFU eviction), and ``run``'s
        stats (a mapping of some :data:`~chorus.cache_store.entries.RUN_COUNTERS` to counts, added to
        the entry's; ``ValueError`` for a bad one, nothing counted), together with hits :meth:`load`
        could not count earlier. Takes SQLite's write lock only (not the writers' file lock); raises
        ``StoreBusyError`` past the time bound (the hits stay pending). An id that is not an int is a
        ``ValueError``, an int no entry can have a ``KeyError``; nothing is counted then."""
        self._pending.add(checked_entry_id(entry_id), run_counts(run))
        self._flush_hits()

    @store_call
    def entries(self) -> list[dict]:
        """One dict per entry (id, sig_key, nbytes, hits, created, last_used, meta, runs: the summed
        run stats of its hits, :data:`~chorus.cache_store.entries.RUN_COUNTERS`), in id order. (A
        read-only handle of a workspace older than the run stats shows them as 0, as a counter edited by
        hand to something other than an integer; a size that is not an integer shows as None.)"""
        with self._rmutex:
            counted = self._run_columns_present(self._rdb)
            runs = ", ".join(f"(CASE WHEN typeof({name}) = 'integer' THEN {name} ELSE 0 END)" if counted else "0"
                             for name in RUN_COUNTERS)
            rows = self._rdb.execute(
                f"SELECT id, sig_key, {ROW_NBYTES}, hits, created, last_used, meta_json, {runs} FROM entries ORDER BY id"
            ).fetchall()
        return [{"id": r[0], "sig_key": r[1], "nbytes": r[2], "hits": r[3], "created": r[4],
                 "last_used": r[5], "meta": row_meta(r[6]), "runs": dict(zip(RUN_COUNTERS, r[7:]))} for r in rows]

    @store_call
    def quarantined(self) -> list[dict]:
        with self._rmutex:
            rows = self._rdb.execute("SELECT entry_id, file, reason, time FROM quarantine ORDER BY rowid").fetchall()
        return [{"id": r[0], "file": r[1], "reason": r[2], "time": r[3]} for r in rows]

    @store_call
    def stats(self) -> dict:
        """Counts, bytes, hits, limits, index kinds per signature, generation, quarantine, time bound."""
        with self._rmutex:
            self._sync_index()
            count, total, hits = self._rdb.execute(
                f"SELECT COUNT(*), COALESCE(SUM({ROW_NBYTES}), 0), COALESCE(SUM(hits), 0) FROM entries").fetchone()
            signatures = self._rdb.execute("SELECT COUNT(DISTINCT sig_key) FROM entries").fetchone()[0]
            dim = setting(self._rdb, "dim")
            return {
                "path": str(self.path),
                "entries": count,
                "bytes": total,
                "hits": hits,
                "signatures": signatures,
                "dim": int(dim) if dim is not None else None,
                "generation": read_generation(self._rdb),
                "limits": self._limits_or_reason(),
                "index": self._index.kinds() if self._index is not None else {},
                "indexed": len(self._index) if self._index is not None else 0,
                "quarantined": self.quarantined(),
                "timeout_s": self.timeout,
            }
