"""A workspace: a directory of immutable mask entries, their SQLite metadata and a faiss index.

Layout of a workspace directory::

    chorus.sqlite3           metadata (WAL): entries, settings (generation, dim, limits), quarantine
    entries/<uuid>.safetensors   one immutable file per entry (see entry_format.py)
    index.g<generation>.safetensors   the saved faiss index and the generation it matches
    quarantine/              damaged entry files, moved here with the reason in SQLite
    write.lock               cross-process writer lock (filelock)

Write protocol of :meth:`Workspace.add` (under the writer lock): encode -> write a temporary file
in ``entries/`` -> fsync -> rename to its final name -> fsync the directory -> one SQLite
transaction inserting the row and bumping ``generation``. A process killed before the commit
leaves at most an orphan or temporary file with no row (removed by :meth:`Workspace.verify` and by
the next writer that cleans up); a row exists only for a complete, fsynced file. Readers take no
lock: SQLite WAL gives them a consistent snapshot and files are never modified in place.

The in-memory index follows SQLite's ``generation``: every search compares it with the index's
and catches up (adds/removes the difference) when another process wrote. On open, the newest
``index.g*.safetensors`` is loaded and caught up the same way; when it is missing or corrupt the
index is rebuilt from the embeddings stored in SQLite (which are also inside each entry file).

Loads verify the file's sha256 against SQLite; a missing, truncated or bit-flipped entry is moved
to ``quarantine/``, logged, recorded (``stats()["quarantined"]``, :meth:`verify`), removed from the
index, and :class:`CorruptEntryError` (a ``ValueError``) is raised, so the caller falls back to
dense attention while later searches go on without the entry.

Size cap: ``max_bytes`` and/or ``max_entries`` (settings in SQLite); after each add the workspace
evicts by ``eviction`` policy, ``"lru"`` (oldest ``last_used`` first) or ``"lfu"`` (fewest
``hits``, then oldest). :meth:`touch` (called by :meth:`load`) counts a hit and updates
``last_used``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from filelock import FileLock

from .entry_format import EntryFormatError, decode_entry, encode_entry, fsync_dir
from .index import DEFAULT_APPROX_THRESHOLD, PartitionedIndex, normalise
from .paths import check_not_in_pack
from .signature import signature_key

LOG = logging.getLogger(__name__)

DB_NAME = "chorus.sqlite3"
LOCK_NAME = "write.lock"
ENTRY_DIR = "entries"
QUARANTINE_DIR = "quarantine"
DEFAULT_MAX_BYTES = 20 << 30
EVICTION_POLICIES = ("lru", "lfu")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    file TEXT NOT NULL UNIQUE,
    sig_key TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    embedding BLOB NOT NULL,
    meta_json TEXT NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS entries_sig ON entries(sig_key);
CREATE INDEX IF NOT EXISTS entries_last_used ON entries(last_used);
CREATE TABLE IF NOT EXISTS settings(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS quarantine(
    entry_id INTEGER, file TEXT, reason TEXT, time REAL, sig_key TEXT, meta_json TEXT
);
"""


class CorruptEntryError(ValueError):
    """An entry failed its checksum or did not decode; it has been quarantined."""


def _crash_hook(phase: str) -> None:
    """Test seam: called between the steps of the write protocol (no-op in production)."""


class Workspace:
    """One cache workspace (see the module docstring). Use :meth:`open`; usable as a context manager.

    Thread-safe within a process (one internal lock); safe across processes (SQLite WAL for
    readers, a file lock for writers).
    """

    def __init__(self, path: Path, *, approx_threshold: int = DEFAULT_APPROX_THRESHOLD):
        self.path = path
        self.entry_dir = path / ENTRY_DIR
        self.quarantine_dir = path / QUARANTINE_DIR
        self._mutex = threading.RLock()
        self._file_lock = FileLock(str(path / LOCK_NAME))
        self._db = sqlite3.connect(str(path / DB_NAME), timeout=60.0, isolation_level=None,
                                   check_same_thread=False)
        # Switching a new database to WAL does not wait on SQLite's busy timeout: processes opening
        # a fresh workspace at the same moment got "database is locked". Initialise under the writers' lock.
        with self._file_lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            # A random id of this database: an index file written for another database (the SQLite
            # file was deleted or replaced, entry ids restarted) must not be caught up by id.
            self._db.execute("INSERT OR IGNORE INTO settings(key, value) VALUES('workspace_id', ?)",
                             (uuid.uuid4().hex,))
        self._workspace_id = self._get("workspace_id")
        self._approx_threshold = int(approx_threshold)
        self._index: PartitionedIndex | None = None
        self._index_generation = -1
        self._unsaved_changes = 0
        self._closed = False

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def open(cls, path, *, max_bytes: int | None = None, max_entries: int | None = None,
             eviction: str | None = None, approx_threshold: int = DEFAULT_APPROX_THRESHOLD) -> "Workspace":
        """Create or open the workspace directory ``path`` (a trusted path; for user-given names use
        :func:`chorus.cache_store.resolve_workspace` first). Limits given here are stored and
        persist; ``None`` keeps the stored value (default: 20 GiB, no entry cap, LRU).
        ``approx_threshold``: partition size at which the index switches from exact to HNSW.
        """
        path = check_not_in_pack(path)
        if path.exists() and not path.is_dir():
            raise ValueError(f"workspace path {path} exists and is not a directory")
        (path / ENTRY_DIR).mkdir(parents=True, exist_ok=True)
        (path / QUARANTINE_DIR).mkdir(exist_ok=True)
        ws = cls(path, approx_threshold=approx_threshold)
        if max_bytes is not None or max_entries is not None or eviction is not None:
            ws.set_limits(max_bytes=max_bytes, max_entries=max_entries, eviction=eviction)
        ws._sync_index()
        return ws

    def close(self) -> None:
        """Save the index if it changed since the last save, and close the database."""
        with self._mutex:
            if self._closed:
                return
            if self._unsaved_changes:
                try:
                    self.save_index()
                except Exception as exc:  # saving is an optimisation; the index is rebuildable
                    LOG.warning("could not save the index of %s: %s", self.path, exc)
            self._db.close()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __len__(self) -> int:
        with self._mutex:
            return self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    # -- settings ----------------------------------------------------------------------------
    def _get(self, key, default=None):
        row = self._db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return default if row is None else row[0]

    def _set(self, key, value):
        self._db.execute("INSERT OR REPLACE INTO settings(key, value) VALUES(?, ?)", (key, str(value)))

    def _generation(self) -> int:
        return int(self._get("generation", 0))

    def limits(self) -> dict:
        return {
            "max_bytes": int(self._get("max_bytes", DEFAULT_MAX_BYTES)),
            "max_entries": int(self._get("max_entries", 0)) or None,
            "eviction": self._get("eviction", "lru"),
        }

    def set_limits(self, *, max_bytes: int | None = None, max_entries: int | None = None,
                   eviction: str | None = None) -> None:
        """Store the size cap (``max_entries=0`` means no entry cap) and eviction policy."""
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        if max_entries is not None and (not isinstance(max_entries, int) or max_entries < 0):
            raise ValueError(f"max_entries must be an int >= 0, got {max_entries!r}")
        if eviction is not None and eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        with self._mutex, self._file_lock:
            self._db.execute("BEGIN IMMEDIATE")
            if max_bytes is not None:
                self._set("max_bytes", max_bytes)
            if max_entries is not None:
                self._set("max_entries", max_entries)
            if eviction is not None:
                self._set("eviction", eviction)
            self._db.execute("COMMIT")

    # -- index -------------------------------------------------------------------------------
    def _index_files(self):
        files = []
        for p in self.path.glob("index.g*.safetensors"):
            try:
                files.append((int(p.name[len("index.g"):-len(".safetensors")]), p))
            except ValueError:
                continue
        return sorted(files, reverse=True)

    def _rows_for_index(self, ids=None):
        if ids is None:
            cur = self._db.execute("SELECT id, sig_key, embedding FROM entries ORDER BY id")
        else:
            ids = list(ids)
            rows = []
            for start in range(0, len(ids), 500):
                part = ids[start : start + 500]
                q = f"SELECT id, sig_key, embedding FROM entries WHERE id IN ({','.join('?' * len(part))}) ORDER BY id"
                rows.extend(self._db.execute(q, part).fetchall())
            return rows
        return cur.fetchall()

    def _add_rows_to_index(self, index: PartitionedIndex, rows) -> None:
        groups: dict[str, tuple[list, list]] = {}
        for entry_id, key, blob in rows:
            ids, vecs = groups.setdefault(key, ([], []))
            ids.append(entry_id)
            vecs.append(np.frombuffer(blob, dtype=np.float32))
        for key, (ids, vecs) in groups.items():
            index.add(key, np.array(ids, dtype=np.int64), np.stack(vecs))

    def _sync_index(self, force_rebuild: bool = False) -> None:
        """Bring the in-memory index to SQLite's generation (load / catch up / rebuild)."""
        with self._mutex:
            generation = self._generation()
            if not force_rebuild and self._index is not None and generation == self._index_generation:
                return
            dim = self._get("dim")
            if dim is None:
                self._index, self._index_generation = None, generation
                return
            dim = int(dim)
            if force_rebuild:
                self._index = None
            if self._index is None and not force_rebuild:
                for file_gen, file in self._index_files():
                    try:
                        index, saved_gen = PartitionedIndex.from_bytes(file.read_bytes())
                        if index.dim != dim or saved_gen != file_gen or index.owner != self._workspace_id:
                            raise ValueError("index file does not match the workspace")
                        index.approx_threshold = self._approx_threshold
                        self._index = index
                        LOG.debug("loaded %s (generation %d, workspace at %d)", file.name, saved_gen, generation)
                        break
                    except (OSError, ValueError) as exc:
                        LOG.warning("ignoring and deleting index file %s: %s", file, exc)
                        file.unlink(missing_ok=True)  # files appear complete (rename), so this is never a write in progress
            if self._index is None:
                LOG.info("building the index of %s from SQLite", self.path)
                self._index = PartitionedIndex(dim, self._approx_threshold)
                self._add_rows_to_index(self._index, self._rows_for_index())
                self._unsaved_changes += 1
            else:
                rows = self._db.execute("SELECT id, sig_key FROM entries").fetchall()
                live = {entry_id: key for entry_id, key in rows}
                stale = [i for i, key in self._index.where.items() if live.get(i) != key]
                if stale:
                    self._index.remove(stale)
                missing = [i for i in live if i not in self._index.where]
                if missing:
                    self._add_rows_to_index(self._index, self._rows_for_index(sorted(missing)))
                self._unsaved_changes += len(stale) + len(missing)
            self._index_generation = generation

    def save_index(self) -> Path | None:
        """Write the index atomically as ``index.g<generation>.safetensors``; drop older ones."""
        with self._mutex:
            self._sync_index()
            if self._index is None:
                return None
            generation = self._index_generation
            target = self.path / f"index.g{generation}.safetensors"
            self._atomic_write(target, self._index.to_bytes(generation, self._workspace_id))
            for file_gen, file in self._index_files():
                if file_gen < generation:
                    file.unlink(missing_ok=True)
            self._unsaved_changes = 0
            return target

    def rebuild_index(self, progress: bool = False) -> dict:
        """Rebuild the index from the entries' embeddings in SQLite (tqdm bar if ``progress``) and save it."""
        with self._mutex:
            generation = self._generation()
            dim = self._get("dim")
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
            self.save_index()
            return self._index.kinds()

    def _maybe_save_index(self) -> None:
        size = len(self._index) if self._index is not None else 0
        if self._unsaved_changes >= max(256, size // 10):
            self.save_index()

    # -- writing -----------------------------------------------------------------------------
    def _atomic_write(self, target: Path, data: bytes) -> None:
        tmp = target.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                _crash_hook("temp_written")
                os.fsync(f.fileno())
            os.replace(tmp, target)
            _crash_hook("renamed")
            fsync_dir(target.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def add(self, embedding, masks: dict, meta: dict) -> int:
        """Store one entry; returns its id (ids are never reused).

        ``embedding``: 1-D finite float vector (all entries of a workspace share its dimension).
        ``masks``: ``{(expert, step, layer, head_group): bool block map}`` (shape kept as given;
        float16/uint8/... tensors such as quantised block mass are also accepted). ``meta``: a
        JSON-serialisable dict with a ``"signature"`` dict. Raises ``ValueError`` on bad input.
        """
        return self._add(embedding, masks, meta, None)[0]

    def add_unique(self, embedding, masks: dict, meta: dict, *, min_similarity: float) -> tuple[int, bool]:
        """Like :meth:`add`, unless the workspace already holds an entry with the same signature and
        cosine similarity >= ``min_similarity`` (checked under the writer lock, after catching up
        with other processes): then nothing is written and ``(that entry id, False)`` is returned;
        else ``(new entry id, True)``. Several workers that missed on the same request at once thus
        write it once. Raises ``ValueError`` on bad input (as :meth:`add`).
        """
        min_similarity = float(min_similarity)
        if not (min_similarity == min_similarity):  # NaN
            raise ValueError("min_similarity must be a number")
        return self._add(embedding, masks, meta, min_similarity)

    def _add(self, embedding, masks: dict, meta: dict, min_similarity: float | None) -> tuple[int, bool]:
        if not isinstance(meta, dict) or not isinstance(meta.get("signature"), dict):
            raise ValueError('meta must be a dict holding a "signature" dict')
        sig_key = signature_key(meta["signature"])
        emb = np.asarray(embedding, dtype=np.float32).reshape(-1)
        normalise(emb)  # raises on NaN/inf/zero
        now = time.time()
        meta = dict(meta)
        meta.setdefault("created", now)
        data = encode_entry(emb, masks, meta)
        digest = hashlib.sha256(data).hexdigest()
        file_name = f"{uuid.uuid4().hex}.safetensors"
        with self._mutex, self._file_lock:
            self._sync_index()
            dim = self._get("dim")
            if dim is not None and int(dim) != emb.size:
                raise ValueError(f"embedding has dim {emb.size}, this workspace holds dim {dim}")
            if min_similarity is not None and self._index is not None:
                found = self._index.search(emb, 1, sig_key)
                if found and found[0][1] >= min_similarity:
                    return found[0][0], False
            self._atomic_write(self.entry_dir / file_name, data)
            _crash_hook("file_durable")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                if dim is None:
                    self._set("dim", emb.size)
                cur = self._db.execute(
                    "INSERT INTO entries(file, sig_key, sha256, nbytes, embedding, meta_json, created, last_used, hits)"
                    " VALUES(?, ?, ?, ?, ?, ?, ?, ?, 0)",
                    (file_name, sig_key, digest, len(data), emb.tobytes(), json.dumps(meta, sort_keys=True), now, now))
                entry_id = int(cur.lastrowid)
                self._set("generation", self._generation() + 1)
                _crash_hook("before_commit")
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                (self.entry_dir / file_name).unlink(missing_ok=True)
                raise
            _crash_hook("committed")
            if self._index is None:
                self._index = PartitionedIndex(emb.size, self._approx_threshold)
            self._index.add(sig_key, [entry_id], emb[None])
            self._index_generation += 1
            self._unsaved_changes += 1
            self._sync_index()  # catches up if another process committed in between
            self._evict_locked(protect=entry_id)
            self._maybe_save_index()
        return entry_id, True

    def _delete_locked(self, ids, *, quarantine_reason: str | None = None) -> list[int]:
        """Delete rows (and files, or move them to quarantine). Caller holds both locks."""
        ids = [int(i) for i in ids]
        if not ids:
            return []
        rows = []
        for start in range(0, len(ids), 500):
            part = ids[start : start + 500]
            rows.extend(self._db.execute(
                f"SELECT id, file, sig_key, meta_json FROM entries WHERE id IN ({','.join('?' * len(part))})",
                part).fetchall())
        if not rows:
            return []
        if quarantine_reason is not None:
            for _, file, _, _ in rows:
                src = self.entry_dir / file
                if src.exists():
                    os.replace(src, self.quarantine_dir / file)
            fsync_dir(self.quarantine_dir)
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for entry_id, file, key, meta_json in rows:
                self._db.execute("DELETE FROM entries WHERE id=?", (entry_id,))
                if quarantine_reason is not None:
                    self._db.execute("INSERT INTO quarantine VALUES(?, ?, ?, ?, ?, ?)",
                                     (entry_id, file, quarantine_reason, time.time(), key, meta_json))
            self._set("generation", self._generation() + 1)
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        if quarantine_reason is None:
            for _, file, _, _ in rows:  # after the commit: a crash here leaves orphans, never dangling rows
                (self.entry_dir / file).unlink(missing_ok=True)
        removed = [r[0] for r in rows]
        if self._index is not None:
            self._index.remove(removed)
            self._index_generation += 1
            self._unsaved_changes += len(removed)
        self._sync_index()
        return removed

    def remove(self, entry_id: int) -> bool:
        """Delete an entry; returns whether it existed."""
        with self._mutex, self._file_lock:
            self._sync_index()
            return bool(self._delete_locked([entry_id]))

    def _quarantine(self, entry_id: int, reason: str) -> None:
        LOG.error("quarantining entry %d of %s: %s", entry_id, self.path, reason)
        with self._mutex, self._file_lock:
            self._sync_index()
            self._delete_locked([entry_id], quarantine_reason=reason)

    def _victims(self, count: int, policy: str, protect) -> list[tuple[int, int]]:
        order = "last_used ASC, id ASC" if policy == "lru" else "hits ASC, last_used ASC, id ASC"
        return self._db.execute(f"SELECT id, nbytes FROM entries WHERE id != ? ORDER BY {order} LIMIT ?",
                                (protect if protect is not None else -1, count)).fetchall()

    def _evict_locked(self, protect=None, max_bytes=None, max_entries=None) -> list[int]:
        limits = self.limits()
        max_bytes = limits["max_bytes"] if max_bytes is None else max_bytes
        max_entries = limits["max_entries"] if max_entries is None else max_entries
        count, total = self._db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM entries").fetchone()
        if total <= max_bytes and (not max_entries or count <= max_entries):
            return []
        victims = []
        for entry_id, nbytes in self._victims(count, limits["eviction"], protect):
            if total <= max_bytes and (not max_entries or count <= max_entries):
                break
            victims.append(entry_id)
            total -= nbytes
            count -= 1
        if victims:
            LOG.info("evicting %d entries (%s) from %s", len(victims), limits["eviction"], self.path)
        return self._delete_locked(victims)

    def prune(self, *, max_bytes: int | None = None, max_entries: int | None = None) -> list[int]:
        """Evict (by the workspace policy) down to the given or stored limits; returns removed ids."""
        with self._mutex, self._file_lock:
            self._sync_index()
            removed = self._evict_locked(max_bytes=max_bytes, max_entries=max_entries)
            self._maybe_save_index()
            return removed

    # -- reading -----------------------------------------------------------------------------
    def search(self, embedding, k: int = 1, signature=None) -> list[tuple[int, float]]:
        """Top ``k`` ``(entry_id, cosine similarity)``, best first (ties: lower id first).

        ``signature``: a signature dict (or its :func:`signature_key`) restricting results to
        compatible entries. An empty workspace returns ``[]``; a query of the wrong dimension,
        NaN/inf or zero raises ``ValueError``.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        key = None if signature is None else (signature if isinstance(signature, str) else signature_key(signature))
        with self._mutex:
            self._sync_index()
            if self._index is None:
                normalise(np.asarray(embedding, dtype=np.float32).reshape(1, -1))
                return []
            return self._index.search(embedding, int(k), key)

    def _row(self, entry_id: int):
        return self._db.execute("SELECT file, sha256, meta_json FROM entries WHERE id=?", (int(entry_id),)).fetchone()

    def _read_checked(self, entry_id: int, row) -> bytes:
        file, digest, _ = row
        try:
            data = (self.entry_dir / file).read_bytes()
        except FileNotFoundError:
            self._quarantine(entry_id, "file missing")
            raise CorruptEntryError(f"entry {entry_id}: file {file} is missing (quarantined)") from None
        if hashlib.sha256(data).hexdigest() != digest:
            self._quarantine(entry_id, "sha256 mismatch")
            raise CorruptEntryError(f"entry {entry_id}: checksum mismatch (quarantined)")
        return data

    def load(self, entry_id: int, *, packed: bool = False, touch: bool = True):
        """``(masks, meta)`` of an entry. Bool maps come back with the shape they were added with
        (as :class:`~chorus.cache_store.entry_format.PackedMap` when ``packed``; unpack on the GPU
        with ``.unpack(device)``). Counts a hit unless ``touch=False``. Raises ``KeyError`` for an
        unknown id and :class:`CorruptEntryError` for a damaged (now quarantined) entry.
        """
        with self._mutex:
            row = self._row(entry_id)
        if row is None:
            raise KeyError(f"no entry {entry_id} in workspace {self.path}")
        data = self._read_checked(entry_id, row)
        try:
            masks, _, meta = decode_entry(data, packed=packed)
        except EntryFormatError as exc:
            self._quarantine(entry_id, f"undecodable: {exc}")
            raise CorruptEntryError(f"entry {entry_id}: {exc} (quarantined)") from exc
        if touch:
            self.touch(entry_id)
        return masks, meta

    def touch(self, entry_id: int) -> None:
        """Count a hit: ``hits += 1``, ``last_used = now`` (drives LRU/LFU eviction)."""
        with self._mutex:
            self._db.execute("UPDATE entries SET hits = hits + 1, last_used = ? WHERE id = ?",
                             (time.time(), int(entry_id)))

    def entries(self) -> list[dict]:
        """One dict per entry (id, sig_key, nbytes, hits, created, last_used, meta), in id order."""
        with self._mutex:
            rows = self._db.execute(
                "SELECT id, sig_key, nbytes, hits, created, last_used, meta_json FROM entries ORDER BY id").fetchall()
        return [{"id": r[0], "sig_key": r[1], "nbytes": r[2], "hits": r[3], "created": r[4],
                 "last_used": r[5], "meta": json.loads(r[6])} for r in rows]

    def quarantined(self) -> list[dict]:
        with self._mutex:
            rows = self._db.execute("SELECT entry_id, file, reason, time FROM quarantine ORDER BY rowid").fetchall()
        return [{"id": r[0], "file": r[1], "reason": r[2], "time": r[3]} for r in rows]

    def stats(self) -> dict:
        """Counts, bytes, hits, limits, index kinds per signature, generation and quarantine."""
        with self._mutex:
            self._sync_index()
            count, total, hits = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(nbytes), 0), COALESCE(SUM(hits), 0) FROM entries").fetchone()
            signatures = self._db.execute("SELECT COUNT(DISTINCT sig_key) FROM entries").fetchone()[0]
            dim = self._get("dim")
            return {
                "path": str(self.path),
                "entries": count,
                "bytes": total,
                "hits": hits,
                "signatures": signatures,
                "dim": int(dim) if dim is not None else None,
                "generation": self._generation(),
                "limits": self.limits(),
                "index": self._index.kinds() if self._index is not None else {},
                "indexed": len(self._index) if self._index is not None else 0,
                "quarantined": self.quarantined(),
            }

    # -- maintenance -------------------------------------------------------------------------
    def clean_orphans(self) -> dict:
        """Under the writer lock: delete temporary files and entry files that have no row."""
        with self._mutex, self._file_lock:
            known = {r[0] for r in self._db.execute("SELECT file FROM entries")}
            temps, orphans = 0, 0
            for p in self.entry_dir.iterdir():
                if p.name.startswith(".tmp-"):
                    p.unlink(missing_ok=True)
                    temps += 1
                elif p.name not in known:
                    p.unlink(missing_ok=True)
                    orphans += 1
            for p in self.path.glob(".tmp-*"):
                p.unlink(missing_ok=True)
                temps += 1
            return {"temp_files_removed": temps, "orphans_removed": orphans}

    def verify(self, progress: bool = False) -> dict:
        """Check every entry (file present, sha256, decodes), quarantine the damaged ones, clean
        orphans and check that the index holds exactly the live entries. ``report["damaged"]``
        lists what was quarantined by this run; ``report["ok"]`` is true when nothing was.
        """
        with self._mutex:
            rows = self._db.execute("SELECT id, file, sha256, meta_json FROM entries ORDER BY id").fetchall()
        damaged = []
        iterator = rows
        if progress:
            from tqdm import tqdm

            iterator = tqdm(rows, desc="verify", unit="entry")
        for entry_id, file, digest, meta_json in iterator:
            try:
                data = self._read_checked(entry_id, (file, digest, meta_json))
                decode_entry(data, packed=True)
            except CorruptEntryError as exc:
                damaged.append({"id": entry_id, "file": file, "reason": str(exc)})
            except EntryFormatError as exc:
                self._quarantine(entry_id, f"undecodable: {exc}")
                damaged.append({"id": entry_id, "file": file, "reason": str(exc)})
        cleaned = self.clean_orphans()
        with self._mutex:
            self._sync_index()
            live = {r[0] for r in self._db.execute("SELECT id FROM entries")}
            indexed = set(self._index.where) if self._index is not None else set()
        return {"checked": len(rows), "damaged": damaged, "ok": not damaged,
                "index_consistent": live == indexed, **cleaned}
