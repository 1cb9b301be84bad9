"""The workspace's layout and SQLite metadata: names, schema, settings, and the mapping of
``sqlite3`` errors onto the store contract.

Names: ``chorus.sqlite3`` (+ ``-wal``/``-shm``), ``write.lock``, ``entries/<32 hex>.safetensors``,
``quarantine/``. Tables: ``entries`` (file name, signature key, sha256, size, embedding, metadata, times, hits),
``settings`` (``workspace_id``, ``generation``, ``dim``, the limits; values are text) and
``quarantine``. :func:`store_call` wraps every public method of the workspace: ``sqlite3`` errors
leave as :class:`~chorus.cache_store.errors.StoreBusyError` (a lock held past the time bound) or
:class:`~chorus.cache_store.errors.StoreError`. Tested through the workspace
(``tests/test_cache_hardening.py``: damaged databases, a held SQLite transaction, rows edited by hand).

:class:`WorkspaceConnections` is the opening and locking part of
:class:`~chorus.cache_store.workspace.Workspace` (a mixin): it holds the workspace directory,
``entries/`` and ``quarantine/`` as descriptors opened without following links (``_dir_fd``,
``_entry_fd``, ``_quarantine_fd``) after checking the kind of every store file, the read and
write SQLite connections (``_rdb``, ``_wdb``, with ``_rmutex`` / ``_wmutex``) and the writers'
lock (``_writing``: this handle's writer mutex, then the cross-process ``filelock``, within the
time bound).
"""

from __future__ import annotations

import functools
import os
import re
import sqlite3
import stat
import time
import uuid
from contextlib import contextmanager

from filelock import Timeout as FileLockTimeout

from .entries import DEFAULT_MAX_BYTES, RUN_COUNTERS
from .errors import StoreBusyError, StoreError, StoreReadOnlyError, UnsafeLayoutError
from .safe_fs import file_kind, open_dir

DB_NAME = "chorus.sqlite3"
LOCK_NAME = "write.lock"
ENTRY_DIR = "entries"
QUARANTINE_DIR = "quarantine"
ENTRY_NAME_RE = re.compile(r"[0-9a-f]{32}\.safetensors")  # names the store gives entry files (fullmatch)
# A row's size as SQL reads it where sizes are added up or listed: NULL unless the column holds an
# integer (a row edited by hand may hold text; SQLite's INTEGER affinity keeps it): such a row's size
# counts as 0 in sums and eviction, lists as unknown, and its load finds the row damaged.
ROW_NBYTES = "(CASE WHEN typeof(nbytes) = 'integer' THEN nbytes END)"
SCHEMA = """
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
    hits INTEGER NOT NULL DEFAULT 0,
    sparse_calls INTEGER NOT NULL DEFAULT 0,
    tail_calls INTEGER NOT NULL DEFAULT 0,
    fallback_calls INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS entries_sig ON entries(sig_key);
CREATE INDEX IF NOT EXISTS entries_last_used ON entries(last_used);
CREATE TABLE IF NOT EXISTS settings(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS quarantine(
    entry_id INTEGER, file TEXT, reason TEXT, time REAL, sig_key TEXT, meta_json TEXT
);
"""


def is_busy(exc: sqlite3.Error) -> bool:
    """Whether a ``sqlite3`` error says the database was locked by another connection."""
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def store_call(method):
    """Decorator of the workspace's public methods: ``sqlite3`` errors leave as StoreError /
    StoreBusyError (OSError subclasses). The instance has ``path`` and ``timeout``."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            self._reopen_if_written()
            return method(self, *args, **kwargs)
        except sqlite3.Error as exc:
            if is_busy(exc):
                raise StoreBusyError(f"workspace {self.path}: the metadata database stayed locked by another "
                                     f"process for the time bound ({self.timeout:g} s); nothing was changed") from exc
            raise StoreError(f"workspace {self.path}: metadata database error: {type(exc).__name__}: {exc}") from exc
        except RecursionError as exc:  # a hostile row nested too deep for some json call
            raise StoreError(f"workspace {self.path}: metadata nested too deeply") from exc

    return wrapper


def setting(db, key: str, default=None):
    """The text value of setting ``key`` (``default`` when unset)."""
    row = db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
    return default if row is None else row[0]


def set_setting(db, key: str, value) -> None:
    db.execute("INSERT OR REPLACE INTO settings(key, value) VALUES(?, ?)", (key, str(value)))


def read_generation(db) -> int:
    """The workspace's generation: bumped by every commit that adds or removes entries."""
    return int(setting(db, "generation", 0))


def stored_limits(db) -> dict:
    """The limits as stored (settings are text: digit strings become ints, anything else is left
    for :func:`limits.check_limits` to refuse)."""
    raw = {key: setting(db, key, default) for key, default in
           (("max_bytes", DEFAULT_MAX_BYTES), ("max_entries", 0), ("eviction", "lru"))}
    return {key: int(value) if key != "eviction" and str(value).isdigit() else value for key, value in raw.items()}


class WorkspaceConnections:
    """The opening and locking part of a workspace handle (see the module docstring)."""

    def _open_layout(self, *, create: bool) -> None:
        """Hold the workspace directory, ``entries/`` and ``quarantine/`` open (no links followed)
        and check the kind of every store file (see the module docstring)."""
        try:
            self._dir_fd = open_dir(self.path)
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
        what = file_kind(mode)
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
        fd = open_dir(name, dir_fd=self._dir_fd)
        self._fds.append(fd)
        return fd

    def _connect(self, *, create: bool) -> None:
        db_path = self.path / DB_NAME
        exists = os.path.lexists(db_path)
        if not exists and not create:
            raise ValueError(f"{self.path} is not a Chorus cache workspace (no {DB_NAME}); nothing was created there")
        try:
            if self.readonly:
                self._rdb, self._immutable_stamp = self._readonly_connection()
            else:
                self._rdb = sqlite3.connect(str(db_path), timeout=self.timeout, isolation_level=None,
                                            check_same_thread=False)
            workspace_id = self._read_workspace_id()
            if workspace_id is None:
                if not create:
                    raise ValueError(f"{self.path} is not a Chorus cache workspace ({DB_NAME} holds no workspace)")
                self._initialise()
                workspace_id = self._read_workspace_id()
            if not self.readonly:
                self._add_run_columns()
        except sqlite3.Error as exc:
            if is_busy(exc):
                raise StoreBusyError(f"workspace {self.path}: the metadata database stayed locked for the time bound "
                                     f"({self.timeout:g} s)") from exc
            raise StoreError(f"workspace {self.path}: {DB_NAME} could not be opened as a SQLite database "
                             f"({type(exc).__name__}: {exc})") from exc
        self._workspace_id = workspace_id

    def _db_stamp(self):
        """``(device, inode, size, mtime)`` of the database file while no process has it open for
        writing (no ``-wal`` / ``-shm`` beside it), else None."""
        if any(os.path.lexists(self.path / (DB_NAME + s)) for s in ("-wal", "-shm")):
            return None
        st = os.stat(DB_NAME, dir_fd=self._dir_fd, follow_symlinks=False)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def _readonly_connection(self):
        """A read-only handle's read connection, and the stamp (:meth:`_db_stamp`) it read the database
        at when it reads it as immutable (else None). ``immutable=1`` only while no writer has the
        database open: a ``mode=ro`` connection would create the ``-wal`` / ``-shm`` files, and a
        read-only handle creates nothing; ``mode=ro`` otherwise, which sees every commit."""
        stamp = self._db_stamp()
        uri = (self.path / DB_NAME).as_uri() + ("?mode=ro" if stamp is None else "?immutable=1")
        return sqlite3.connect(uri, uri=True, timeout=self.timeout, isolation_level=None,
                               check_same_thread=False), stamp

    def _reopen_if_written(self) -> None:
        """Run by every public call (:func:`store_call`): an immutable read connection whose database a
        writer has opened or changed since is replaced (:meth:`_readonly_connection`), so a read-only
        handle never goes on reading a changed file as one that cannot change (a stale view: entries
        evicted since would read as damage, entries added since would be missed)."""
        if getattr(self, "_immutable_stamp", None) is None:
            return
        with self._rmutex:
            if self._immutable_stamp is None or self._rdb is None or self._rdb.in_transaction \
                    or self._db_stamp() == self._immutable_stamp:
                return
            stale = self._rdb
            self._rdb, self._immutable_stamp = self._readonly_connection()
            stale.close()

    def _run_columns_present(self, db) -> bool:
        names = {row[1] for row in db.execute("PRAGMA table_info(entries)").fetchall()}
        return all(name in names for name in RUN_COUNTERS)

    def _add_run_columns(self) -> None:
        """A workspace made before entries counted their hits' run stats gets the columns (0 for the
        hits counted before), under the writers' lock; each ``ADD COLUMN`` alone changes nothing else."""
        if self._run_columns_present(self._rdb):
            return
        with self._writing() as db:
            names = {row[1] for row in db.execute("PRAGMA table_info(entries)").fetchall()}
            for name in RUN_COUNTERS:
                if name not in names:
                    db.execute(f"ALTER TABLE entries ADD COLUMN {name} INTEGER NOT NULL DEFAULT 0")

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
            db.executescript(SCHEMA)
            # A random id of this database: an index file written for another database (the SQLite
            # file was deleted or replaced, entry ids restarted) must not be caught up by id.
            db.execute("INSERT OR IGNORE INTO settings(key, value) VALUES('workspace_id', ?)", (uuid.uuid4().hex,))


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
            if self._closed:  # close() ran during this write and left the files to it
                with self._rmutex:
                    self._close_handles()
            self._wmutex.release()


