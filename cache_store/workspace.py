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

The in-memory index follows SQLite's ``generation``: every search compares it with the index's
and catches up (adds/removes the difference) when another process wrote. On open, the newest
``index.g*.safetensors`` is loaded and caught up the same way; when it is missing or corrupt the
index is rebuilt from the embeddings stored in SQLite (which are also inside each entry file).

Size cap: ``max_bytes`` and/or ``max_entries`` (settings in SQLite); after each add the workspace
evicts by ``eviction`` policy, ``"lru"`` (oldest ``last_used`` first) or ``"lfu"`` (fewest
``hits``, then oldest). :meth:`touch` (called by :meth:`load`) counts a hit and updates
``last_used``.

Read-only handles (``Workspace.open(path, readonly=True)``, used by ``cache stats`` and ``cache
list``) create, write, move and delete nothing: the directory must already be a workspace
(``ValueError`` otherwise), SQLite is opened read-only (``immutable`` while no other process has
the database open, so not even SQLite's ``-wal``/``-shm`` files appear), damaged entries are
reported but not quarantined, and the index is built in memory only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import sqlite3
import stat
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock
from filelock import Timeout as FileLockTimeout

from .entry_format import (MAX_ENTRY_RAW_BYTES, MAX_HEADER_BYTES, EntryFormatError, decode_entry, encode_entry,
                           json_depth_ok)
from .errors import StoreBusyError, StoreError, StoreReadOnlyError, UnsafeLayoutError, store_timeout
from .index import DEFAULT_APPROX_THRESHOLD, PartitionedIndex, normalise
from .limits import check_limits, eviction_caps, over_caps, prune_targets
from .paths import check_not_in_pack
from .rows import QUIET_FLOATS, check_embedding, row_meta
from .signature import signature_key

LOG = logging.getLogger(__name__)

DB_NAME = "chorus.sqlite3"
LOCK_NAME = "write.lock"
ENTRY_DIR = "entries"
QUARANTINE_DIR = "quarantine"
DEFAULT_MAX_BYTES = 20 << 30
MAX_ENTRY_FILE_BYTES = MAX_ENTRY_RAW_BYTES + MAX_HEADER_BYTES + (1 << 20)  # an entry file never exceeds this
MAX_INDEX_FILE_BYTES = 16 << 30
ENTRY_NAME_RE = re.compile(r"[0-9a-f]{32}\.safetensors")  # names the store gives entry files (fullmatch)
TEMP_NAME_RE = re.compile(r"\.tmp-[0-9]+-[0-9a-f]{32}")  # names of its temporary files
INDEX_NAME_RE = re.compile(r"index\.g([0-9]{1,18})\.safetensors")
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
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


@dataclass(frozen=True)
class NewEntry:
    """A new entry, checked and encoded: what every store writes (see :func:`encode_new_entry`)."""

    sig_key: str
    embedding: np.ndarray  # float32 [dim], as given (rows.check_embedding)
    data: bytes            # the entry file's bytes
    digest: str            # sha256 of ``data``
    meta_json: str
    created: float


def encode_new_entry(embedding, masks: dict, meta: dict) -> NewEntry:
    """Check and encode a new entry once, the same way for every store (one-host and fleet).

    Raises ``ValueError`` for metadata without a ``"signature"`` dict or nested deeper than 64 levels,
    an embedding ``rows.check_embedding`` refuses (NaN/inf/zero, more than ``MAX_EMBEDDING_DIM``
    values: the checks every row read back passes too), masks the entry format refuses, and an entry larger than the
    ``MAX_ENTRY_FILE_BYTES`` a store ever reads back (so nothing is written that could not be loaded).
    ``meta`` gets ``"created"`` when it has none (the caller's dict is not modified)."""
    if not isinstance(meta, dict) or not isinstance(meta.get("signature"), dict):
        raise ValueError('meta must be a dict holding a "signature" dict')
    if not json_depth_ok(meta):
        raise ValueError("meta is nested deeper than 64 levels; the store cannot keep it")
    sig_key = signature_key(meta["signature"])
    with np.errstate(**QUIET_FLOATS):
        emb = check_embedding(embedding)
    now = time.time()
    meta = dict(meta)
    meta.setdefault("created", now)
    data = encode_entry(emb, masks, meta)
    if len(data) > MAX_ENTRY_FILE_BYTES:
        raise ValueError(f"the entry takes {len(data)} bytes, more than the {MAX_ENTRY_FILE_BYTES} the store reads")
    return NewEntry(sig_key, emb, data, hashlib.sha256(data).hexdigest(), json.dumps(meta, sort_keys=True), now)


class CorruptEntryError(ValueError):
    """An entry failed its checks (file kind, size, checksum, decoding); it has been quarantined
    (or, on a read-only or busy store, set aside for this handle)."""


class _EntryGone(Exception):
    """The entry's row disappeared (evicted or removed) while it was being read."""


def _crash_hook(phase: str) -> None:
    """Test seam: called between the steps of the write protocol (no-op in production)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def _is_busy(exc: sqlite3.Error) -> bool:
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def _store_call(method):
    """Public methods: ``sqlite3`` errors leave as StoreError / StoreBusyError (OSError subclasses)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as exc:
            if _is_busy(exc):
                raise StoreBusyError(f"workspace {self.path}: the metadata database stayed locked by another "
                                     f"process for the time bound ({self.timeout:g} s); nothing was changed") from exc
            raise StoreError(f"workspace {self.path}: metadata database error: {type(exc).__name__}: {exc}") from exc
        except RecursionError as exc:  # a hostile row nested too deep for some json call
            raise StoreError(f"workspace {self.path}: metadata nested too deeply") from exc

    return wrapper


def read_regular_file(name: str, *, dir_fd: int, max_bytes: int, expected_size: int | None = None) -> bytes:
    """Read the regular file ``name`` (relative to ``dir_fd``) whole, never following a link and
    never blocking on a FIFO or device. Raises ``FileNotFoundError`` if absent and
    :class:`UnsafeLayoutError` (before reading a byte) if it is not a regular file, is larger than
    ``max_bytes`` or its size is not ``expected_size``."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeLayoutError(f"{name} is {_kind(st.st_mode)}, not a regular file")
    fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the lstat and the open
            raise UnsafeLayoutError(f"{name} is {_kind(st.st_mode)}, not a regular file")
        if expected_size is not None and st.st_size != expected_size:
            raise UnsafeLayoutError(f"{name} has {st.st_size} bytes, its row says {expected_size}")
        if st.st_size > max_bytes:
            raise UnsafeLayoutError(f"{name} has {st.st_size} bytes, more than the {max_bytes} the store reads")
        parts, size = [], st.st_size
        while size > 0:
            part = os.read(fd, min(size, 0x7FFFF000))  # one read for any entry (Linux's per-call maximum)
            if not part:
                break
            parts.append(part)
            size -= len(part)
        if size or os.read(fd, 1):
            raise UnsafeLayoutError(f"{name} changed size while being read")
        return parts[0] if len(parts) == 1 else b"".join(parts)  # (an empty file: b"")
    finally:
        os.close(fd)


class Workspace:
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
        self._pending_hits: dict[int, int] = {}  # hits of load(touch=True) not yet counted (store was busy)
        self._closed = False
        self._fds: list[int] = []
        self._rdb = self._wdb = None
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

    # -- opening -----------------------------------------------------------------------------
    def _open_layout(self, *, create: bool) -> None:
        """Hold the workspace directory, ``entries/`` and ``quarantine/`` open (no links followed)
        and check the kind of every store file (see the module docstring)."""
        try:
            self._dir_fd = os.open(self.path, _DIR_FLAGS)
        except FileNotFoundError:
            raise ValueError(f"workspace {self.path} does not exist") from None
        except NotADirectoryError:
            raise ValueError(f"workspace path {self.path} exists and is not a directory") from None
        self._fds.append(self._dir_fd)
        for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", LOCK_NAME):
            try:
                st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeLayoutError(self._refusal(name, st.st_mode, "a regular file"))
        self._entry_fd = self._subdir(ENTRY_DIR, create)
        self._quarantine_fd = self._subdir(QUARANTINE_DIR, create)

    def _refusal(self, name: str, mode: int, wanted: str) -> str:
        what = _kind(mode)
        if stat.S_ISLNK(mode):
            try:
                what += f" to {os.readlink(name, dir_fd=self._dir_fd)}"
            except OSError:
                pass
        return (f"workspace {self.path}: {name} is {what}, not {wanted}; the store never follows links or uses "
                "other kinds of files inside a workspace (remove it, or restore it from a backup)")

    def _subdir(self, name: str, create: bool) -> int | None:
        try:
            st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(name, dir_fd=self._dir_fd)
            except FileExistsError:  # another process created it at the same moment
                pass
            st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeLayoutError(self._refusal(name, st.st_mode, "a directory"))
        fd = os.open(name, _DIR_FLAGS, dir_fd=self._dir_fd)
        self._fds.append(fd)
        return fd

    def _connect(self, *, create: bool) -> None:
        db_path = self.path / DB_NAME
        exists = os.path.lexists(db_path)
        if not exists and not create:
            raise ValueError(f"{self.path} is not a Chorus cache workspace (no {DB_NAME}); nothing was created there")
        try:
            if self.readonly:
                live = any(os.path.lexists(self.path / (DB_NAME + s)) for s in ("-wal", "-shm"))
                uri = db_path.as_uri() + ("?mode=ro" if live else "?immutable=1")
                self._rdb = sqlite3.connect(uri, uri=True, timeout=self.timeout, isolation_level=None,
                                            check_same_thread=False)
            else:
                self._rdb = sqlite3.connect(str(db_path), timeout=self.timeout, isolation_level=None,
                                            check_same_thread=False)
            workspace_id = self._read_workspace_id()
            if workspace_id is None:
                if not create:
                    raise ValueError(f"{self.path} is not a Chorus cache workspace ({DB_NAME} holds no workspace)")
                self._initialise()
                workspace_id = self._read_workspace_id()
        except sqlite3.Error as exc:
            if _is_busy(exc):
                raise StoreBusyError(f"workspace {self.path}: the metadata database stayed locked for the time bound "
                                     f"({self.timeout:g} s)") from exc
            raise StoreError(f"workspace {self.path}: {DB_NAME} could not be opened as a SQLite database "
                             f"({type(exc).__name__}: {exc})") from exc
        self._workspace_id = workspace_id

    def _read_workspace_id(self):
        try:
            row = self._rdb.execute("SELECT value FROM settings WHERE key='workspace_id'").fetchone()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return None
            raise
        return None if row is None else row[0]

    def _writer_db(self):
        """The write connection (opened on first use); caller holds ``_wmutex``."""
        if self.readonly:
            raise StoreReadOnlyError(f"workspace {self.path} was opened read-only; nothing was written")
        if self._wdb is None:
            self._wdb = sqlite3.connect(str(self.path / DB_NAME), timeout=self.timeout, isolation_level=None,
                                        check_same_thread=False)
            self._wdb.execute("PRAGMA synchronous=FULL")
        return self._wdb

    def _initialise(self) -> None:
        # Switching a new database to WAL does not wait on SQLite's busy timeout: processes opening a
        # fresh workspace at the same moment got "database is locked". Initialise under the writers' lock.
        with self._writing():
            db = self._writer_db()
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            # A random id of this database: an index file written for another database (the SQLite
            # file was deleted or replaced, entry ids restarted) must not be caught up by id.
            db.execute("INSERT OR IGNORE INTO settings(key, value) VALUES('workspace_id', ?)", (uuid.uuid4().hex,))

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

    def _close_handles(self) -> None:
        for db in (self._wdb, self._rdb):
            if db is not None:
                try:
                    db.close()
                except sqlite3.Error:
                    pass
        self._wdb = self._rdb = None
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []

    def close(self) -> None:
        """Save the index if it changed since the last save (skipped when the writers' lock stays
        busy past the time bound: the index is rebuildable), and close the database."""
        if self._closed:
            return
        if self._pending_hits and not self.readonly:
            try:
                self._flush_hits()
            except Exception as exc:  # noqa: BLE001 - hit counts steer eviction only
                LOG.warning("%d hits of %s not counted: %s", sum(self._pending_hits.values()), self.path, exc)
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
                    self._close_handles()
        finally:
            if got_writer:
                self._wmutex.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @_store_call
    def __len__(self) -> int:
        with self._rmutex:
            return self._rdb.execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    # -- locking -----------------------------------------------------------------------------
    @contextmanager
    def _writing(self, *, file_lock: bool = True, timeout: float | None = None):
        """Hold this handle's writer mutex, then (``file_lock``) the cross-process writers' lock, each
        waited for at most what is left of the time bound (or ``timeout``); set SQLite's busy
        timeout to the rest."""
        if self.readonly:
            raise StoreReadOnlyError(f"workspace {self.path} was opened read-only; nothing was written")
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if not self._wmutex.acquire(timeout=timeout):
            raise StoreBusyError(f"workspace {self.path}: another thread of this process kept writing for the "
                                 f"time bound ({self.timeout:g} s); nothing was changed")
        try:
            locked = False
            if file_lock:
                try:
                    self._file_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
                    locked = True
                except FileLockTimeout:
                    raise StoreBusyError(f"workspace {self.path}: another process held the writers' lock "
                                         f"({LOCK_NAME}) for the time bound ({self.timeout:g} s); nothing was "
                                         "changed") from None
            try:
                db = self._writer_db()
                db.execute(f"PRAGMA busy_timeout={max(1, int((deadline - time.monotonic()) * 1000))}")
                yield db
            finally:
                if locked:
                    self._file_lock.release()
        finally:
            self._wmutex.release()

    # -- settings ----------------------------------------------------------------------------
    def _get(self, key, default=None, db=None):
        row = (db or self._rdb).execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return default if row is None else row[0]

    def _set(self, db, key, value):
        db.execute("INSERT OR REPLACE INTO settings(key, value) VALUES(?, ?)", (key, str(value)))

    def _generation(self, db=None) -> int:
        return int(self._get("generation", 0, db))

    def _stored_limits(self, db=None) -> dict:
        """The limits as stored (settings are text: digit strings become ints, anything else is
        left for :func:`limits.check_limits` to refuse)."""
        raw = {key: self._get(key, default, db) for key, default in
               (("max_bytes", DEFAULT_MAX_BYTES), ("max_entries", 0), ("eviction", "lru"))}
        return {key: int(value) if key != "eviction" and str(value).isdigit() else value for key, value in raw.items()}

    @_store_call
    def limits(self, db=None) -> dict:
        """The stored limits: ``max_bytes``, ``max_entries`` (None: no entry cap), ``eviction``.
        Raises ``ValueError`` for a setting that is not a valid limit."""
        valid = check_limits(**self._stored_limits(db))
        return {"max_bytes": valid["max_bytes"], "max_entries": valid["max_entries"] or None,
                "eviction": valid["eviction"]}

    def _limits_or_reason(self) -> dict:
        try:
            return self.limits()
        except ValueError as exc:  # stats still answer for a workspace whose settings were edited badly
            return {"invalid": str(exc)}

    @_store_call
    def set_limits(self, *, max_bytes: int | None = None, max_entries: int | None = None,
                   eviction: str | None = None) -> None:
        """Store the size cap (``max_entries=0`` means no entry cap) and eviction policy."""
        valid = check_limits(max_bytes, max_entries, eviction)
        with self._writing() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                for key, value in valid.items():
                    if value is not None:
                        self._set(db, key, value)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    # -- index -------------------------------------------------------------------------------
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
        """Index rows ``(id, sig_key, embedding bytes)``; a row whose embedding fails the row
        checks (``rows.check_embedding``: e.g. a database edited by hand) is set aside, logged."""
        groups: dict[str, tuple[list, list]] = {}
        with np.errstate(**QUIET_FLOATS):
            for entry_id, key, blob in rows:
                if entry_id in self._set_aside:
                    continue
                try:
                    vec = check_embedding(blob, index.dim)
                except (ValueError, TypeError) as exc:
                    LOG.error("entry %d of %s is left out of the index: %s", entry_id, self.path, exc)
                    self._set_aside.add(int(entry_id))
                    continue
                ids, vecs = groups.setdefault(key, ([], []))
                ids.append(entry_id)
                vecs.append(vec)
        for key, (ids, vecs) in groups.items():
            index.add(key, np.array(ids, dtype=np.int64), np.stack(vecs))

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
                    try:  # files appear complete (rename), so this is never a write in progress
                        os.unlink(name, dir_fd=self._dir_fd)
                    except OSError:
                        pass
        return None

    def _sync_index(self, force_rebuild: bool = False) -> None:
        """Bring the in-memory index to SQLite's generation (load / catch up / rebuild). Reads only."""
        with self._rmutex:
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

    @_store_call
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
            self._atomic_write(self._dir_fd, name, data)
            for file_gen, old in self._index_files():
                if file_gen < generation:
                    try:
                        os.unlink(old, dir_fd=self._dir_fd)
                    except FileNotFoundError:
                        pass
            return self.path / name

    @_store_call
    def rebuild_index(self, progress: bool = False) -> dict:
        """Rebuild the index from the entries' embeddings in SQLite (tqdm bar if ``progress``) and save it."""
        with self._rmutex:
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

    # -- writing -----------------------------------------------------------------------------
    def _atomic_write(self, dir_fd: int, name: str, data: bytes) -> None:
        """temp file (``O_EXCL | O_NOFOLLOW``) -> write -> fsync -> rename -> fsync dir, all relative
        to ``dir_fd``. Caller holds the writers' lock."""
        tmp = f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            fd = os.open(tmp, _WRITE_FLAGS, 0o644, dir_fd=dir_fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                _crash_hook("temp_written")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            _crash_hook("renamed")
            _fsync_fd(dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
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

    def add_unique(self, embedding, masks: dict, meta: dict, *, min_similarity: float) -> tuple[int, bool]:
        """Like :meth:`add`, unless the workspace already holds an entry with the same signature and
        cosine similarity >= ``min_similarity`` (checked under the writer lock, after catching up
        with other processes): then nothing is written and ``(that entry id, False)`` is returned;
        else ``(new entry id, True)``. Several workers that missed on the same request at once thus
        write it once. Raises as :meth:`add`.
        """
        min_similarity = float(min_similarity)
        if not (min_similarity == min_similarity):  # NaN
            raise ValueError("min_similarity must be a number")
        return self._add(embedding, masks, meta, min_similarity)

    @_store_call
    def _add(self, embedding, masks: dict, meta: dict, min_similarity: float | None) -> tuple[int, bool]:
        new = encode_new_entry(embedding, masks, meta)
        sig_key, emb, data, digest, meta_json, now = (new.sig_key, new.embedding, new.data, new.digest,
                                                       new.meta_json, new.created)
        file_name = f"{uuid.uuid4().hex}.safetensors"
        with self._writing() as db:
            self._sync_index()
            dim = self._get("dim", db=db)
            if dim is not None and int(dim) != emb.size:
                raise ValueError(f"embedding has dim {emb.size}, this workspace holds dim {dim}")
            if min_similarity is not None:
                with self._rmutex:
                    found = self._index.search(emb, 1, sig_key) if self._index is not None else []
                if found and found[0][1] >= min_similarity:
                    return found[0][0], False
            self._atomic_write(self._entry_fd, file_name, data)
            _crash_hook("file_durable")
            try:
                db.execute("BEGIN IMMEDIATE")
                generation = self._generation(db)
                if self._get("dim", db=db) is None:
                    self._set(db, "dim", emb.size)
                cur = db.execute(
                    "INSERT INTO entries(file, sig_key, sha256, nbytes, embedding, meta_json, created, last_used, hits)"
                    " VALUES(?, ?, ?, ?, ?, ?, ?, ?, 0)",
                    (file_name, sig_key, digest, len(data), emb.tobytes(), meta_json, now, now))
                entry_id = int(cur.lastrowid)
                self._set(db, "generation", generation + 1)
                _crash_hook("before_commit")
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                try:
                    os.unlink(file_name, dir_fd=self._entry_fd)
                except OSError:
                    pass
                raise
            _crash_hook("committed")
            self._index_committed(generation, added=(entry_id, sig_key, emb))
            self._evict_locked(db, protect=entry_id)
            self._maybe_save_index()
        return entry_id, True

    def _delete_locked(self, db, ids, *, quarantine_reason: str | None = None, expect_file: str | None = None) -> list[int]:
        """Delete rows (and files, or move them to quarantine). Caller holds the writers' lock.
        With ``expect_file``, only a row still naming that file is touched."""
        ids = [int(i) for i in ids]
        if not ids:
            return []
        rows = []
        for start in range(0, len(ids), 500):
            part = ids[start : start + 500]
            rows.extend(db.execute(
                f"SELECT id, file, sig_key, meta_json FROM entries WHERE id IN ({','.join('?' * len(part))})",
                part).fetchall())
        if expect_file is not None:
            rows = [r for r in rows if r[1] == expect_file]
        if not rows:
            return []
        if quarantine_reason is not None:
            for _, file, _, _ in rows:
                if not ENTRY_NAME_RE.fullmatch(file):
                    continue  # a row naming something the store never makes: leave the path alone
                try:  # moves the directory entry itself: a link is moved, never followed
                    os.replace(file, file, src_dir_fd=self._entry_fd, dst_dir_fd=self._quarantine_fd)
                except FileNotFoundError:
                    pass
            _fsync_fd(self._quarantine_fd)
        db.execute("BEGIN IMMEDIATE")
        try:
            generation = self._generation(db)
            for entry_id, file, key, meta_json in rows:
                db.execute("DELETE FROM entries WHERE id=?", (entry_id,))
                if quarantine_reason is not None:
                    db.execute("INSERT INTO quarantine VALUES(?, ?, ?, ?, ?, ?)",
                               (entry_id, file, quarantine_reason, time.time(), key, meta_json))
            self._set(db, "generation", generation + 1)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        if quarantine_reason is None:
            for _, file, _, _ in rows:  # after the commit: a crash here leaves orphans, never dangling rows
                if ENTRY_NAME_RE.fullmatch(file):
                    try:
                        os.unlink(file, dir_fd=self._entry_fd)
                    except (FileNotFoundError, IsADirectoryError, PermissionError):
                        pass  # a directory under an entry's name is reported by verify as stray
        removed = [r[0] for r in rows]
        self._index_committed(generation, removed=removed)
        return removed

    @_store_call
    def remove(self, entry_id: int) -> bool:
        """Delete an entry; returns whether it existed."""
        with self._writing() as db:
            self._sync_index()
            return bool(self._delete_locked(db, [entry_id]))

    def _quarantine(self, entry_id: int, file: str, reason: str) -> bool:
        """Move a damaged entry aside. Returns False when its row is gone already (evicted or
        removed meanwhile: not damage). On a read-only handle, or when the store stays busy past
        the time bound, the entry is only set aside in this handle (left out of its searches) and
        logged; the next writable handle that reads it quarantines it."""
        if self.readonly:
            LOG.error("entry %d of %s is damaged (%s); read-only: not quarantined", entry_id, self.path, reason)
            self._set_aside_entry(entry_id)
            return True
        LOG.error("quarantining entry %d of %s: %s", entry_id, self.path, reason)
        try:
            with self._writing() as db:
                self._sync_index()
                done = bool(self._delete_locked(db, [entry_id], quarantine_reason=reason, expect_file=file))
        except (StoreBusyError, sqlite3.OperationalError) as exc:
            LOG.error("entry %d of %s is damaged (%s); quarantine deferred: %s", entry_id, self.path, reason, exc)
            self._set_aside_entry(entry_id)
            return True
        if done:
            return True
        with self._rmutex:
            return self._rdb.execute("SELECT 1 FROM entries WHERE id=? AND file=?", (entry_id, file)).fetchone() is not None

    def _set_aside_entry(self, entry_id: int) -> None:
        with self._rmutex:
            self._set_aside.add(int(entry_id))
            if self._index is not None and int(entry_id) in self._index.where:
                self._index.remove([int(entry_id)])

    def _victims(self, db, count: int, policy: str, protect) -> list[tuple[int, int]]:
        order = "last_used ASC, id ASC" if policy == "lru" else "hits ASC, last_used ASC, id ASC"
        return db.execute(f"SELECT id, nbytes FROM entries WHERE id != ? ORDER BY {order} LIMIT ?",
                          (protect if protect is not None else -1, count)).fetchall()

    def _evict_locked(self, db, protect=None, max_bytes=None, max_entries=None, *, strict: bool = False) -> list[int]:
        """Evict down to the caps (:func:`limits.eviction_caps`: the prune targets given, else the
        stored limits). Limits that are not valid evict nothing: ``ValueError`` when ``strict``
        (``prune``), else logged (the eviction after a write)."""
        try:
            cap_bytes, cap_entries, policy = eviction_caps(self._stored_limits(db), max_bytes, max_entries)
        except ValueError as exc:
            if strict:
                raise
            LOG.error("workspace %s: %s", self.path, exc)
            return []
        count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM entries").fetchone()
        if not over_caps(count, total, cap_bytes, cap_entries):
            return []
        victims = []
        for entry_id, nbytes in self._victims(db, count, policy, protect):
            if not over_caps(count, total, cap_bytes, cap_entries):
                break
            victims.append(entry_id)
            total -= nbytes
            count -= 1
        if victims:
            LOG.info("evicting %d entries (%s) from %s", len(victims), policy, self.path)
        return self._delete_locked(db, victims)

    @_store_call
    def prune(self, *, max_bytes: int | None = None, max_entries: int | None = None) -> list[int]:
        """Evict (by the workspace policy) until at most ``max_bytes`` bytes and ``max_entries``
        entries are left (each ``None``: the stored limit; 0 keeps nothing); returns removed ids.
        Raises ``ValueError`` (having deleted nothing) for a negative, NaN, infinite, non-integral
        or absurd target (:mod:`~chorus.cache_store.limits`)."""
        prune_targets(max_bytes, max_entries)
        with self._writing() as db:
            self._sync_index()
            removed = self._evict_locked(db, max_bytes=max_bytes, max_entries=max_entries, strict=True)
            self._maybe_save_index()
            return removed

    # -- reading -----------------------------------------------------------------------------
    @_store_call
    def search(self, embedding, k: int = 1, signature=None) -> list[tuple[int, float]]:
        """Top ``k`` ``(entry_id, cosine similarity)``, best first (ties: lower id first).

        ``signature``: a signature dict (or its :func:`signature_key`) restricting results to
        compatible entries. An empty workspace returns ``[]``; a query of the wrong dimension,
        NaN/inf or zero raises ``ValueError``. Never waits for a writer.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        key = None if signature is None else (signature if isinstance(signature, str) else signature_key(signature))
        with self._rmutex:
            self._sync_index()
            if self._index is None:
                normalise(np.asarray(embedding, dtype=np.float32).reshape(1, -1))
                return []
            return self._index.search(embedding, int(k), key)

    def _row(self, entry_id: int):
        """``(file, sha256, meta_json, nbytes)`` of an entry, or None."""
        with self._rmutex:
            return self._rdb.execute("SELECT file, sha256, meta_json, nbytes FROM entries WHERE id=?",
                                     (int(entry_id),)).fetchone()

    def _damaged(self, entry_id: int, file: str, reason: str):
        """Quarantine and return the CorruptEntryError to raise; raise _EntryGone if the row went."""
        if not self._quarantine(entry_id, file, reason):
            raise _EntryGone(entry_id)
        return CorruptEntryError(f"entry {entry_id}: {reason} " +
                                 ("(read-only: not quarantined)" if self.readonly else "(quarantined)"))

    def _read_checked(self, entry_id: int, row) -> bytes:
        """The entry's bytes after the checks of the module docstring (kind, size, sha256)."""
        file, digest, _, nbytes = row
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

    def _decode_checked(self, entry_id: int, file: str, data: bytes, *, packed: bool):
        try:
            return decode_entry(data, packed=packed)
        except (EntryFormatError, MemoryError, RecursionError) as exc:
            reason = f"undecodable: {exc}" if isinstance(exc, EntryFormatError) else f"undecodable: {type(exc).__name__}"
            raise self._damaged(entry_id, file, reason) from None

    @_store_call
    def load(self, entry_id: int, *, packed: bool = False, touch: bool = True):
        """``(masks, meta)`` of an entry. Bool maps come back with the shape they were added with
        (as :class:`~chorus.cache_store.entry_format.PackedMap` when ``packed``; unpack on the GPU
        with ``.unpack(device)``). Counts a hit unless ``touch=False``, without waiting (a hit that
        cannot be written this instant is kept pending, see the module docstring). Raises
        ``KeyError`` for an unknown id (or one evicted while it was read) and
        :class:`CorruptEntryError` for a damaged (now quarantined) entry. Never waits for a writer
        except to quarantine a damaged entry (within the time bound).
        """
        row = self._row(entry_id)
        if row is None:
            raise KeyError(f"no entry {entry_id} in workspace {self.path}")
        if int(entry_id) in self._set_aside:
            raise CorruptEntryError(f"entry {entry_id} was found damaged earlier (quarantine pending)")
        try:
            data = self._read_checked(entry_id, row)
            masks, _, meta = self._decode_checked(entry_id, row[0], data, packed=packed)
        except _EntryGone:
            raise KeyError(f"entry {entry_id} of workspace {self.path} was removed (evicted) while it was read") from None
        if touch:
            self._count_hit(entry_id)
        return masks, meta

    def _count_hit(self, entry_id: int) -> None:
        """Count a hit without waiting: if SQLite's write lock is busy this instant, the hit is kept
        in memory and counted by this handle's next touch or close (or lost if the process ends)."""
        if self.readonly:
            return
        with self._rmutex:
            self._pending_hits[int(entry_id)] = self._pending_hits.get(int(entry_id), 0) + 1
        try:
            self._flush_hits(timeout=0.0)
        except (StoreBusyError, sqlite3.OperationalError) as exc:
            LOG.warning("hit of entry %d not counted yet (kept for the next write): %s", entry_id,
                        exc if isinstance(exc, StoreBusyError) else "the store is busy")

    def _flush_hits(self, timeout: float | None = None) -> None:
        with self._writing(file_lock=False, timeout=timeout) as db:
            with self._rmutex:
                hits, self._pending_hits = self._pending_hits, {}
            if not hits:
                return
            try:
                db.execute("BEGIN IMMEDIATE")
                now = time.time()
                for entry_id, n in hits.items():
                    db.execute("UPDATE entries SET hits = hits + ?, last_used = ? WHERE id = ?", (n, now, entry_id))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                with self._rmutex:  # keep them for the next try
                    for entry_id, n in hits.items():
                        self._pending_hits[entry_id] = self._pending_hits.get(entry_id, 0) + n
                raise

    @_store_call
    def touch(self, entry_id: int) -> None:
        """Count a hit: ``hits += 1``, ``last_used = now`` (drives LRU/LFU eviction), together with
        hits :meth:`load` could not count earlier. Takes SQLite's write lock only (not the writers'
        file lock); raises ``StoreBusyError`` past the time bound (the hits stay pending)."""
        with self._rmutex:
            self._pending_hits[int(entry_id)] = self._pending_hits.get(int(entry_id), 0) + 1
        self._flush_hits()

    @_store_call
    def entries(self) -> list[dict]:
        """One dict per entry (id, sig_key, nbytes, hits, created, last_used, meta), in id order."""
        with self._rmutex:
            rows = self._rdb.execute(
                "SELECT id, sig_key, nbytes, hits, created, last_used, meta_json FROM entries ORDER BY id").fetchall()
        return [{"id": r[0], "sig_key": r[1], "nbytes": r[2], "hits": r[3], "created": r[4],
                 "last_used": r[5], "meta": row_meta(r[6])} for r in rows]

    @_store_call
    def quarantined(self) -> list[dict]:
        with self._rmutex:
            rows = self._rdb.execute("SELECT entry_id, file, reason, time FROM quarantine ORDER BY rowid").fetchall()
        return [{"id": r[0], "file": r[1], "reason": r[2], "time": r[3]} for r in rows]

    @_store_call
    def stats(self) -> dict:
        """Counts, bytes, hits, limits, index kinds per signature, generation, quarantine, time bound."""
        with self._rmutex:
            self._sync_index()
            count, total, hits = self._rdb.execute(
                "SELECT COUNT(*), COALESCE(SUM(nbytes), 0), COALESCE(SUM(hits), 0) FROM entries").fetchone()
            signatures = self._rdb.execute("SELECT COUNT(DISTINCT sig_key) FROM entries").fetchone()[0]
            dim = self._get("dim")
            return {
                "path": str(self.path),
                "entries": count,
                "bytes": total,
                "hits": hits,
                "signatures": signatures,
                "dim": int(dim) if dim is not None else None,
                "generation": self._generation(),
                "limits": self._limits_or_reason(),
                "index": self._index.kinds() if self._index is not None else {},
                "indexed": len(self._index) if self._index is not None else 0,
                "quarantined": self.quarantined(),
                "timeout_s": self.timeout,
            }

    # -- maintenance -------------------------------------------------------------------------
    def _clean_locked(self, known: set) -> dict:
        """Delete store-named temporary files and entry files without a row; report the rest."""
        temps, orphans, stray = 0, 0, []
        for dir_fd, prefix, entry_names in ((self._entry_fd, ENTRY_DIR + "/", True), (self._dir_fd, "", False)):
            if dir_fd is None:
                continue
            with os.scandir(dir_fd) as it:
                names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            for name, is_dir in names:
                is_temp = TEMP_NAME_RE.fullmatch(name) is not None
                is_entry = entry_names and ENTRY_NAME_RE.fullmatch(name) is not None
                if not entry_names and not is_temp:
                    continue  # the workspace directory's own files
                if is_dir or not (is_temp or is_entry):
                    stray.append(prefix + name + ("/" if is_dir else ""))
                    continue
                if is_entry and name in known:
                    continue
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    continue
                if is_temp:
                    temps += 1
                else:
                    orphans += 1
        if stray:
            LOG.warning("workspace %s holds files the store did not make (left alone): %s", self.path,
                        ", ".join(stray[:20]))
        return {"temp_files_removed": temps, "orphans_removed": orphans, "stray": stray}

    @_store_call
    def clean_orphans(self) -> dict:
        """Under the writers' lock: delete temporary files and entry files that have no row, by the
        names the store makes; other things (``stray``) are reported and left alone."""
        with self._writing() as db:
            known = {r[0] for r in db.execute("SELECT file FROM entries")}
            return self._clean_locked(known)

    @_store_call
    def verify(self, progress: bool = False) -> dict:
        """Check every entry (a regular file of its recorded size, sha256, decodes), quarantine the
        damaged ones, clean orphans (under the writers' lock; skipped, with ``cleanup_skipped``
        saying why, when that stays busy past the time bound), and check that the index holds
        exactly the live entries (compared at one generation). ``report["damaged"]`` lists what
        this run quarantined; ``report["evicted"]`` the entries whose row went away while the run
        read them (evicted or removed by a worker: not damage); ``report["stray"]`` what the store
        did not make and left alone; ``report["ok"]`` is true when nothing was damaged. Safe beside
        busy workers: it waits for the writers' lock only to quarantine and to clean up.
        """
        with self._rmutex:
            rows = self._rdb.execute("SELECT id, file, sha256, meta_json, nbytes FROM entries ORDER BY id").fetchall()
        _crash_hook("verify_listed")
        damaged, evicted = [], []
        iterator = rows
        if progress:
            from tqdm import tqdm

            iterator = tqdm(rows, desc="verify", unit="entry")
        for entry_id, file, digest, meta_json, nbytes in iterator:
            try:
                data = self._read_checked(entry_id, (file, digest, meta_json, nbytes))
                self._decode_checked(entry_id, file, data, packed=True)
            except _EntryGone:
                evicted.append(entry_id)
            except CorruptEntryError as exc:
                damaged.append({"id": entry_id, "file": file, "reason": str(exc)})
        cleaned = {"temp_files_removed": 0, "orphans_removed": 0, "stray": []}
        if self.readonly:
            cleaned["cleanup_skipped"] = "read-only: damaged entries are not quarantined, orphans are not removed"
        else:
            try:
                with self._writing() as db:
                    known = {r[0] for r in db.execute("SELECT file FROM entries")}
                    cleaned = self._clean_locked(known)
            except StoreBusyError as exc:  # the checks above stand; only the cleanup waits for next time
                LOG.warning("verify of %s: orphan cleanup skipped: %s", self.path, exc)
                cleaned["cleanup_skipped"] = str(exc)
        consistent = self._index_matches()
        return {"checked": len(rows), "damaged": damaged, "evicted": evicted, "ok": not damaged,
                "index_consistent": consistent, **cleaned}

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
                    generation = self._generation(db)
                    live = {r[0] for r in db.execute("SELECT id FROM entries")} - self._set_aside
                finally:
                    db.execute("COMMIT")
                indexed = set(self._index.where) if self._index is not None else set()
                same = live == indexed
                if generation == self._index_generation:
                    return same
        return same


def _fsync_fd(dir_fd) -> None:
    """fsync an open directory so a rename inside it is durable (errors ignored: not all file
    systems support it)."""
    if dir_fd is None:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
