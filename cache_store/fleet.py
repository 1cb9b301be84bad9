"""The fleet store: one cache shared by many ComfyUI workers on many hosts, through PostgreSQL.

Chosen by ``CHORUS_CACHE_URL=postgresql://...`` (see :func:`chorus.cache_store.protocol.open_store`);
it implements the store protocol of ``protocol.py`` like :class:`~chorus.cache_store.Workspace`.

Where things live:

* **PostgreSQL** (the source of truth; tables created on first use, or beforehand by an owner
  role, see docs/OPERATIONS.md "Fleet"): ``chorus_workspaces`` (one row per workspace: the change
  sequence number, embedding dim, limits, entry count and bytes; locking this row is the
  fleet-wide writer lock), ``chorus_entries`` (metadata, embedding and the entry bytes, ``bytea``
  with ``STORAGE EXTERNAL``: the bytes are the entry format of ``entry_format.py``, already
  compressed, with their sha256), ``chorus_changes`` (the change log: ``(workspace, seq, op,
  entry_id)``, ``op`` ``a``\\ dd or ``r``\\ emove) and ``chorus_quarantine``.
* **Each worker's memory**: a faiss :class:`~chorus.cache_store.index.PartitionedIndex` of the
  workspace, fed from PostgreSQL: an initial load (one consistent snapshot of the entries and the
  sequence number; exact partitions at once, large ones rebuilt as HNSW in a background thread
  and swapped in, so a new worker serves while the slow build runs), then the change log after
  each ``NOTIFY chorus_changes`` (a listener thread with its own connection) and every ``POLL_S``
  seconds; after a reconnect it catches up from the last sequence number it applied (a full
  reload when the log was trimmed past it). Searches never touch the network.
* **A local disk tier** under the cache root (``<CHORUS_CACHE_DIR>/<workspace>/fleet_tier/``,
  created by the first entry it keeps): the entry files of this worker's recent loads and writes,
  ``<id>-<sha256>.safetensors``, an LRU cache bounded by ``tier_bytes``
  (``CHORUS_FLEET_TIER_BYTES``, 20 GiB by default), so that a hit fetches an entry from PostgreSQL
  at most once per host.

Connections: a handle holds one connection for writes (entries, removals, limits, quarantine, hit
counts), one for reads (loads, listings, stats, catch-ups; a read-only session) and the
listener's; ``verify`` scans on a connection of its own. So a load never queues behind another
thread's write on the same handle, and a hit counted by ``load`` never waits: when the write
connection is busy that instant the hit stays pending and is counted with the next write,
``touch`` or ``close``.

Writes (:meth:`FleetStore.add_unique`): encode the entry, then one transaction: lock the workspace
row (``SELECT ... FOR UPDATE``, waiting at most ``lock_timeout``), catch up with the change log
(every earlier writer has committed), search for an entry that already serves the request (then
nothing is written), insert the row, append the change, evict down to the fleet-wide cap (more
changes), ``pg_notify``, commit. An entry is therefore visible whole or not at all, on every
worker, and the sequence numbers of a workspace are committed in order (the row lock serialises
its writers), so catching up by sequence number never skips a change.

Trust: the tables are writable by every worker, and a worker may be buggy or compromised, so every
row is checked like a file before its bytes are copied (:func:`_row_columns`, :func:`_check_row`,
the same checks as a local entry in ``rows.py``): declared sizes against the columns' lengths in
SQL (data, embedding, metadata, keys; a column that fails is never fetched), the embedding
dimension from the workspace row, finite and normalisable embeddings, hex sha256 and signature
keys (the local tier's file names), finite timestamps, metadata depth and size. A load also checks
the bytes' sha256 against the row (and against the sha256 the change feed announced), decodes them
with the shared codec, and checks that the embedding and signature inside the entry match the
row's. A row that fails is quarantined (the row moves to ``chorus_quarantine`` with the reason, is
dropped from every worker's index by an ``r`` change, one log line, and a load raises
:class:`~chorus.cache_store.CorruptEntryError`) or, in a listing, left out with one log line; it
never stops an open, the feed or a listing. The feed applies only changes up to the workspace's
own sequence number, contiguously (a gap, a sequence number that went backwards or a changed
dimension is a full reload); change rows found past that number are deleted by the next writer.
What a compromised worker can still do: docs/OPERATIONS.md, "What a compromised worker can do".

Bounded waits (the store contract of ``errors.py``): ``lock_timeout`` is the time bound
(``CHORUS_CACHE_TIMEOUT``, 2 s by default), also the longest a call waits for another thread of
this process using the same connection; ``connect_timeout`` (3 s) and ``statement_timeout`` (5 s)
on every connection, TCP keepalives and ``tcp_user_timeout``, and a client-side deadline (7 s)
that shuts the socket down when a call overruns (a server that stopped answering). PostgreSQL's
errors map onto the store's by SQLSTATE (``pg_errors.py``: disk full, read-only, lock timeout,
serialization failure, statement timeout, lost connection); the engine turns each into a miss
(dense attention) or a write not made, with a message. The next call reconnects.

Opening: a worker (``create=True``, the default) creates the tables if missing (needs CREATE on
the schema the first time only) and registers its workspace; ``create=False`` (the command line's
maintenance commands) refuses a database or workspace that does not exist, creating nothing;
``readonly=True`` (``cache stats``, ``cache list``, ``cache verify`` without ``--repair``) also
refuses, and then writes nothing at all: its sessions are read-only, damaged rows are reported but
not quarantined, hits are not counted and no local tier file or folder is made.

Security: credentials come from the URL, the environment (``PGPASSWORD``, ``PGUSER``...) or a
pgpass file, as libpq reads them; they are never logged or put in a message (``redaction.py``);
every statement is parameterised (table names are constants); URL options such as ``sslmode``
pass through to libpq unchanged.

Tests: ``tests/test_fleet_store.py`` (protocol, feed, dedupe, quarantine, hostile rows, SQLSTATE
mapping, credentials, bounded waits, SIGKILLed server, read-only opening),
``tests/test_fleet_serving.py`` (real ComfyUI servers).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .entry_format import MAX_META_BYTES, EntryFormatError, decode_entry
from .errors import StoreBusyError, StoreError, StoreReadOnlyError, StoreUnavailableError, store_timeout
from .index import DEFAULT_APPROX_THRESHOLD, PartitionedIndex, normalise
from .limits import check_limits, eviction_caps, over_caps, prune_targets
from .pg_errors import first_line, translate
from .protocol import MissingDriverError
from .redaction import RedactingFilter, redact
from .rows import (DIGEST_CHARS, MAX_EMBEDDING_DIM, QUIET_FLOATS, SIG_KEY_CHARS, check_dim, check_embedding,
                   check_entry_matches_row, finite_number, is_digest, is_sig_key, row_meta)
from .signature import signature_key
from .workspace import DEFAULT_MAX_BYTES, MAX_ENTRY_FILE_BYTES, CorruptEntryError, encode_new_entry

LOG = logging.getLogger(__name__)
LOG.addFilter(RedactingFilter())

CHANNEL = "chorus_changes"
TIER_DIR = "fleet_tier"
DEFAULT_TIER_BYTES = 20 << 30
TIER_ENV = "CHORUS_FLEET_TIER_BYTES"
CONNECT_TIMEOUT_S = 3
STATEMENT_TIMEOUT_MS = 5000
LOCK_TIMEOUT_MS = 2000  # the default; the store's time bound (errors.store_timeout) sets it
CALL_DEADLINE_S = 7.0  # client side: statement_timeout + margin for the transfer
POLL_S = 2.0
FEED_DEADLINE_S = 300.0  # the listener's catch-ups (a background thread; a full load of 100k entries)
FULL_LOAD_TIMEOUT_MS = 300_000
CATCH_UP_BATCH = 5000
CATCH_UP_BATCH_BYTES = 64 << 20  # embeddings fetched per batch at most
FLAT_ONLY = 1 << 62  # approx_threshold of the exact index a worker serves from while it builds HNSW
CHANGE_LOG_KEEP_S = 7 * 86400

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS chorus_workspaces(
        name TEXT PRIMARY KEY,
        seq BIGINT NOT NULL DEFAULT 0,
        trimmed_seq BIGINT NOT NULL DEFAULT 0,
        dim INTEGER,
        n_entries BIGINT NOT NULL DEFAULT 0,
        n_bytes BIGINT NOT NULL DEFAULT 0,
        max_bytes BIGINT NOT NULL DEFAULT %d,
        max_entries BIGINT NOT NULL DEFAULT 0,
        eviction TEXT NOT NULL DEFAULT 'lru')""" % DEFAULT_MAX_BYTES,
    """CREATE TABLE IF NOT EXISTS chorus_entries(
        id BIGSERIAL PRIMARY KEY,
        workspace TEXT NOT NULL REFERENCES chorus_workspaces(name),
        sig_key TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        nbytes BIGINT NOT NULL,
        embedding BYTEA NOT NULL,
        meta_json TEXT NOT NULL,
        data BYTEA NOT NULL,
        created DOUBLE PRECISION NOT NULL,
        last_used DOUBLE PRECISION NOT NULL,
        hits BIGINT NOT NULL DEFAULT 0)""",
    "ALTER TABLE chorus_entries ALTER COLUMN data SET STORAGE EXTERNAL",
    "CREATE INDEX IF NOT EXISTS chorus_entries_lru ON chorus_entries(workspace, last_used, id)",
    """CREATE TABLE IF NOT EXISTS chorus_changes(
        workspace TEXT NOT NULL,
        seq BIGINT NOT NULL,
        op CHAR(1) NOT NULL,
        entry_id BIGINT NOT NULL,
        time DOUBLE PRECISION NOT NULL,
        PRIMARY KEY(workspace, seq))""",
    """CREATE TABLE IF NOT EXISTS chorus_quarantine(
        workspace TEXT NOT NULL,
        entry_id BIGINT,
        reason TEXT NOT NULL,
        time DOUBLE PRECISION NOT NULL,
        sig_key TEXT,
        meta_json TEXT,
        data BYTEA)""",
]
_SCHEMA_LOCK = 0x63686F72  # advisory lock id serialising schema creation ("chor")


def _psycopg():
    try:
        import psycopg
    except ImportError:
        raise MissingDriverError("the fleet store (CHORUS_CACHE_URL=postgresql://...) needs psycopg 3: "
                          "pip install 'chorus-ii[fleet]' (or pip install 'psycopg[binary]')") from None
    return psycopg


# -- rows -----------------------------------------------------------------------------------

class _Row(NamedTuple):
    """One ``chorus_entries`` row as :func:`_row_columns` selects it: columns that failed their
    size guard in SQL (and those not asked for) are None and were never fetched."""

    id: int | None
    sig_key: str | None
    sha256: str | None
    nbytes: int | None
    data_len: int | None
    emb_len: int | None
    created: float | None
    last_used: float | None
    hits: int | None
    embedding: bytes | None
    meta_len: int | None
    meta_json: str | None
    data: bytes | None


def _row_columns(alias: str = "e", *, embedding: bool = False, meta: bool = False, data: bool = False) -> str:
    """The select list of :class:`_Row` for table alias ``alias``. Each variable-length column
    comes only when its length is one the store writes (checked in SQL, so a hostile length costs
    nothing): the signature key and sha256 of their hex lengths; the embedding when ``embedding`` and its length lies in
    ``[%(emb_min)s, %(emb_max)s]`` (named parameters the caller passes, see :func:`_emb_params`);
    metadata up to ``MAX_META_BYTES`` when ``meta``; the data when ``data`` and its length is the
    row's ``nbytes``, at most ``MAX_ENTRY_FILE_BYTES``."""
    e = alias
    return ", ".join([
        f"{e}.id",
        f"CASE WHEN octet_length({e}.sig_key) = {SIG_KEY_CHARS} THEN {e}.sig_key END",
        f"CASE WHEN octet_length({e}.sha256) = {DIGEST_CHARS} THEN {e}.sha256 END",
        f"{e}.nbytes", f"octet_length({e}.data)", f"octet_length({e}.embedding)",
        f"{e}.created", f"{e}.last_used", f"{e}.hits",
        f"CASE WHEN octet_length({e}.embedding) BETWEEN %(emb_min)s AND %(emb_max)s THEN {e}.embedding END"
        if embedding else "NULL::bytea",
        f"octet_length({e}.meta_json)",
        f"CASE WHEN octet_length({e}.meta_json) <= {MAX_META_BYTES} THEN {e}.meta_json END" if meta else "NULL::text",
        f"CASE WHEN octet_length({e}.data) = {e}.nbytes AND {e}.nbytes <= {MAX_ENTRY_FILE_BYTES} THEN {e}.data END"
        if data else "NULL::bytea",
    ])


def _emb_params(dim: int | None) -> dict:
    """The embedding length guard of :func:`_row_columns` for a workspace of ``dim`` (any valid
    dimension when None: the row is then refused by :func:`_check_row` for want of a dim)."""
    return {"emb_min": 4 * dim, "emb_max": 4 * dim} if dim else {"emb_min": 4, "emb_max": 4 * MAX_EMBEDDING_DIM}


def _check_row(row: _Row, dim: int | None, *, embedding: bool = False) -> np.ndarray | None:
    """The one check of a row's fields, for every path that reads rows (open, feed, load, verify,
    listing): a signature key and sha256 in hex (``rows.is_sig_key``, ``rows.is_digest``), a size the store writes equal to the data column's
    length, finite timestamps, a hit count; with ``embedding`` also the embedding (a vector of the
    workspace's ``dim`` that normalises, ``rows.check_embedding``), returned as float32. Raises
    ``ValueError`` with the reason."""
    if not is_sig_key(row.sig_key):
        raise ValueError(f"row signature key is not {SIG_KEY_CHARS} hex digits")
    if not is_digest(row.sha256):
        raise ValueError(f"row sha256 is not {DIGEST_CHARS} hex digits")
    if not isinstance(row.nbytes, int) or not 0 < row.nbytes <= MAX_ENTRY_FILE_BYTES:
        raise ValueError(f"row nbytes {row.nbytes!r} is not a size the store writes")
    if row.data_len != row.nbytes:
        raise ValueError(f"row data has {row.data_len} bytes, its nbytes says {row.nbytes}")
    if not finite_number(row.created) or not finite_number(row.last_used) or not isinstance(row.hits, int):
        raise ValueError("row timestamps or hit count are not finite numbers")
    if not embedding:
        return None
    if dim is None:
        raise ValueError("the workspace states no embedding dimension")
    if row.embedding is None:
        raise ValueError(f"row embedding has {row.emb_len} bytes, expected {4 * dim}")
    return check_embedding(row.embedding, dim)


def _own_row(entry_id: int, new) -> _Row:
    """The :class:`_Row` of an entry this handle just wrote (``workspace.NewEntry``)."""
    return _Row(entry_id, new.sig_key, new.digest, len(new.data), len(new.data), new.embedding.nbytes,
                new.created, new.created, 0, new.embedding.tobytes(), None, None, None)


# -- connections ----------------------------------------------------------------------------

class _Conn:
    """One psycopg connection with the store's session settings and a client-side deadline."""

    def __init__(self, params: dict, secrets, lock_timeout_ms: int = LOCK_TIMEOUT_MS, read_only: bool = False):
        psycopg = _psycopg()
        self.secrets = secrets
        try:
            self.conn = psycopg.connect(**params, autocommit=True)
        except psycopg.Error as exc:
            raise StoreUnavailableError(f"PostgreSQL unreachable: {redact(first_line(exc), secrets)}") from None
        try:
            self.conn.execute("SELECT set_config('statement_timeout', %s, false), set_config('lock_timeout', %s, false)",
                              (str(STATEMENT_TIMEOUT_MS), str(int(lock_timeout_ms))))
            if read_only:  # a read connection: the server refuses any write made through it
                self.conn.execute("SET default_transaction_read_only = on")
        except psycopg.Error as exc:
            self.close()
            raise StoreUnavailableError(f"PostgreSQL session setup failed: {redact(first_line(exc), secrets)}") from None

    def deadline(self, seconds: float = CALL_DEADLINE_S):
        """Context manager: past ``seconds`` the socket is shut down, so a blocked call returns."""
        return _Deadline(self.conn, seconds)

    @property
    def broken(self) -> bool:
        return self.conn.closed or self.conn.broken

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass


class _Deadline:
    def __init__(self, conn, seconds: float):
        self.conn, self.seconds, self.fired = conn, seconds, False
        self.timer = None

    def _fire(self):
        self.fired = True
        try:
            fd = self.conn.pgconn.socket
            socket.socket(fileno=os.dup(fd)).shutdown(socket.SHUT_RDWR)
        except Exception:  # noqa: BLE001 - already closed
            pass

    def __enter__(self):
        self.timer = threading.Timer(self.seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        return False


class _Slot:
    """A connection of the handle (opened on first use, reopened when broken) and the lock of the
    threads that share it."""

    def __init__(self, name: str, read_only: bool):
        self.name, self.read_only = name, read_only
        self.lock = threading.RLock()
        self.conn: _Conn | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class FleetStore:
    """The fleet store of one workspace (see the module docstring). Use :meth:`open`.

    Thread-safe within a process. ``len(store)`` and :meth:`search` answer from this worker's
    index (as fresh as its change feed); everything else asks PostgreSQL.
    """

    def __init__(self, url: str, workspace: str, local_path: Path, *, tier_bytes: int | None = None,
                 approx_threshold: int = DEFAULT_APPROX_THRESHOLD, listen: bool = True, timeout=None,
                 readonly: bool = False):
        psycopg = _psycopg()
        self.timeout = store_timeout(timeout)  # the longest wait for another worker (the row lock) or thread
        from .paths import check_not_in_pack, validate_workspace_name

        self.workspace = validate_workspace_name(workspace)
        try:
            params = psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.Error:
            raise ValueError("the cache URL does not parse as a PostgreSQL connection URL") from None
        params.setdefault("connect_timeout", str(CONNECT_TIMEOUT_S))
        params.setdefault("application_name", "chorus-fleet")
        for key, value in (("keepalives", "1"), ("keepalives_idle", "5"), ("keepalives_interval", "2"),
                           ("keepalives_count", "3"), ("tcp_user_timeout", str(int(CALL_DEADLINE_S * 1000)))):
            params.setdefault(key, value)
        self._params = params
        self._secrets = [s for s in (params.get("password"), os.environ.get("PGPASSWORD")) if s]
        self.url = redact(url, self._secrets)  # safe to show
        self.path = check_not_in_pack(Path(local_path))
        self.tier_dir = self.path / TIER_DIR
        if tier_bytes is None:  # the operator's setting, else 20 GiB
            raw = os.environ.get(TIER_ENV, "").strip()
            try:
                tier_bytes = int(raw) if raw else DEFAULT_TIER_BYTES
            except ValueError:
                raise ValueError(f"{TIER_ENV} must be a number of bytes, got {raw!r}") from None
        if tier_bytes < 0:
            raise ValueError("the local tier's byte cap must be >= 0")
        self.tier_bytes = int(tier_bytes)
        self.readonly = bool(readonly)
        self._approx_threshold = int(approx_threshold)
        self._mutex = threading.RLock()  # index, known rows, seq, pending hits, set-aside ids
        self._write = _Slot("write", read_only=self.readonly)
        self._read = _Slot("read", read_only=True)
        self._index: PartitionedIndex | None = None
        self._known: dict[int, tuple[str, str, int]] = {}  # id -> (sig_key, sha256, nbytes)
        self._set_aside: set[int] = set()  # damaged rows this handle could not quarantine (read-only or busy)
        self._pending_hits: dict[int, int] = {}  # hits of load(touch=True) not counted yet (write connection busy)
        self._dim: int | None = None
        self._bad_dim_logged = None  # the invalid dimension last logged (_workspace_dim)
        self._seq = -1  # last change applied; -1: never loaded
        self._closed = False
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None
        self.connected = False
        self.last_error: str | None = None
        self._tier_lock = threading.Lock()
        self._listen = listen
        self._build_token = None
        self._building: threading.Thread | None = None

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, url: str, workspace: str, *, local_path, max_bytes: int | None = None,
             max_entries: int | None = None, eviction: str | None = None, listen: bool = True,
             create: bool = True, readonly: bool = False, **options) -> "FleetStore":
        """Connect, load the workspace's index and start the change-feed listener (``listen``).
        ``local_path``: this host's directory of the workspace (the local tier goes under it; it is
        created by the first entry kept there, never by opening). ``create``: create the tables
        if missing (needs CREATE on the schema the first time only) and register the workspace;
        else a database without the tables or a workspace not registered is a ``ValueError``
        that created nothing. ``readonly``: as ``create=False``, and the handle writes nothing
        anywhere (module docstring). Limits given here are stored (see :meth:`set_limits`).
        Raises :class:`StoreUnavailableError` when PostgreSQL cannot be reached."""
        store = cls(url, workspace, local_path, listen=listen, readonly=readonly, **options)
        try:
            if readonly and not (max_bytes is None and max_entries is None and eviction is None):
                raise ValueError("a read-only handle cannot set limits")
            creating = create and not readonly
            store._call(store._setup, creating, read=not creating)
            if max_bytes is not None or max_entries is not None or eviction is not None:
                store.set_limits(max_bytes=max_bytes, max_entries=max_entries, eviction=eviction)
            store._call(store._full_load, deadline=FEED_DEADLINE_S, read=True)
        except BaseException:
            store.close()
            raise
        if not readonly and store.tier_dir.is_dir():
            for tmp in store.tier_dir.glob(".tmp-*"):
                tmp.unlink(missing_ok=True)
        if listen:
            store._listener = threading.Thread(target=store._listen_loop, name=f"chorus-fleet-{workspace}",
                                               daemon=True)
            store._listener.start()
        LOG.info("fleet store %s workspace %s: %d entries, seq %d%s", store.url, workspace, len(store), store._seq,
                 " (read-only)" if readonly else "")
        return store

    def _setup(self, conn, create: bool) -> None:
        """Create the tables and register the workspace (``create``), else check that they exist."""
        psycopg = _psycopg()
        exists = conn.execute("SELECT to_regclass('chorus_changes') IS NOT NULL").fetchone()[0]
        if not exists:
            if not create:
                raise ValueError(f"the database of {self.url} holds no Chorus fleet tables; nothing was created "
                                 "(workers create them on first use, or: python -m chorus cache init --url ...)")
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                if not conn.execute("SELECT to_regclass('chorus_changes') IS NOT NULL").fetchone()[0]:
                    try:
                        for statement in SCHEMA:
                            conn.execute(statement)
                    except psycopg.errors.InsufficientPrivilege:
                        raise ValueError("the chorus tables do not exist and this role may not create them: "
                                         "run the schema SQL of docs/OPERATIONS.md (Fleet) as the owner role") from None
        registered = conn.execute("SELECT 1 FROM chorus_workspaces WHERE name=%s", (self.workspace,)).fetchone()
        if registered is None:
            if not create:
                raise ValueError(f"fleet workspace {self.workspace!r} does not exist at {self.url}; nothing was "
                                 "created (workers create it on first use, or: python -m chorus cache init)")
            with conn.transaction():
                conn.execute("INSERT INTO chorus_workspaces(name) VALUES(%s) ON CONFLICT (name) DO NOTHING",
                             (self.workspace,))

    def close(self) -> None:
        """Count pending hits (within the time bound), stop the listener and close the
        connections (the local tier stays)."""
        if self._closed:
            return
        if self._pending_hits and not self.readonly:
            try:
                self._flush_hits()
            except StoreError as exc:  # hit counts steer eviction only
                LOG.warning("%d hits of fleet workspace %s not counted: %s", sum(self._pending_hits.values()),
                            self.workspace, exc)
        self._closed = True
        self._build_token = None  # a background index build stops at its swap
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=POLL_S + CALL_DEADLINE_S)
        for slot in (self._write, self._read):
            with slot.lock:
                slot.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"FleetStore({self.url!r}, workspace={self.workspace!r})"

    def __len__(self) -> int:
        with self._mutex:
            return len(self._known)

    # -- connections ------------------------------------------------------------------------
    def _connect(self, name: str = "write", read_only: bool = False) -> _Conn:
        """A new connection; ``name`` (``write``, ``read``, ``feed``, ``verify``) tells it apart in
        ``pg_stat_activity``: ``application_name`` is ``chorus-fleet`` for writes, else
        ``chorus-fleet-<name>``."""
        params = dict(self._params)
        if name != "write":
            params["application_name"] = f"{params['application_name']}-{name}"
        return _Conn(params, self._secrets, lock_timeout_ms=int(self.timeout * 1000), read_only=read_only)

    def _check_writable(self) -> None:
        if self.readonly:
            raise StoreReadOnlyError(f"fleet workspace {self.workspace} was opened read-only; nothing was written")

    def _call(self, fn, *args, deadline: float = CALL_DEADLINE_S, read: bool = False, wait: bool = True,
              slot: _Slot | None = None):
        """Run ``fn(conn, *args)`` on the read or write connection (or ``slot``), reconnecting as
        needed, within ``deadline`` seconds. Waits at most the time bound for another thread using
        that connection (not at all unless ``wait``): past it :class:`StoreBusyError`. PostgreSQL's
        errors leave as the store's (:func:`pg_errors.translate`)."""
        if self._closed:
            raise StoreUnavailableError("the fleet store is closed")
        slot = slot or (self._read if read else self._write)
        if not slot.read_only:
            self._check_writable()
        if not slot.lock.acquire(timeout=self.timeout if wait else 0):
            held = f"for the time bound ({self.timeout:g} s)" if wait else "this instant"
            raise StoreBusyError(f"fleet workspace {self.workspace}: another thread of this process kept its {slot.name} "
                                 f"connection busy {held}; nothing was changed")
        try:
            return self._call_on(slot, fn, args, deadline)
        finally:
            slot.lock.release()

    def _call_on(self, slot: _Slot, fn, args, deadline: float):
        psycopg = _psycopg()
        fresh = False
        if slot.conn is None or slot.conn.broken:
            slot.close()
            try:
                slot.conn = self._connect(slot.name, read_only=slot.read_only)
            except StoreUnavailableError as exc:
                self._down(str(exc))
                raise
            fresh = True
        conn = slot.conn
        if not fresh:  # a reused connection may have died with a server restart: ping first
            try:
                with conn.deadline(CONNECT_TIMEOUT_S):
                    conn.conn.execute("SELECT 1")
            except psycopg.Error:
                slot.close()
                return self._call_on(slot, fn, args, deadline)
        guard = conn.deadline(deadline)
        try:
            with guard:
                result = fn(conn.conn, *args)
            self.connected, self.last_error = True, None
            return result
        except psycopg.Error as exc:
            error, drop = translate(exc, workspace=self.workspace, timeout=self.timeout, secrets=self._secrets,
                                    deadline_fired=deadline if guard.fired else None, reading=slot.read_only)
            if drop:
                slot.close()
                if isinstance(error, StoreUnavailableError):
                    self._down(str(error))
            raise error from None

    def _down(self, reason: str) -> None:
        if self.connected:  # logged once per outage (a failed open is reported by its exception)
            LOG.warning("Chorus fleet store %s: %s", self.url, reason)
        self.connected, self.last_error = False, reason

    # -- the change feed --------------------------------------------------------------------
    def _in_snapshot(self, conn, body):
        """Run ``body(conn)`` in one consistent read-only snapshot (a REPEATABLE READ transaction)
        unless ``conn`` is inside a transaction already (a writer's, which holds the workspace row
        lock: nothing can change between its statements)."""
        psycopg = _psycopg()
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            return body(conn)
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            return body(conn)

    def _workspace_dim(self, raw) -> int | None:
        """The workspace row's embedding dimension; None when unset or not a valid dimension
        (logged: nothing is indexed until a writer sets a valid one)."""
        if raw is None:
            return None
        try:
            return check_dim(raw)
        except ValueError as exc:
            if self._bad_dim_logged != raw:  # once per value, not at every poll of the feed
                self._bad_dim_logged = raw
                LOG.error("fleet workspace %s: its row states %s; nothing is indexed", self.workspace, exc)
            return None

    def _full_load(self, conn) -> None:
        """Load every entry's embedding and the sequence number they match, from one snapshot."""
        self._in_snapshot(conn, self._load_rows)

    def _load_rows(self, conn) -> None:
        conn.execute("SELECT set_config('statement_timeout', %s, true)", (str(FULL_LOAD_TIMEOUT_MS),))
        row = conn.execute("SELECT seq, dim FROM chorus_workspaces WHERE name=%s", (self.workspace,)).fetchone()
        seq, dim = (int(row[0]), self._workspace_dim(row[1])) if row else (0, None)
        with self._mutex:
            set_aside = set(self._set_aside)
        good, bad = [], []
        if dim is not None:
            with conn.cursor(binary=True) as cur, np.errstate(**QUIET_FLOATS):
                cur.execute(f"SELECT {_row_columns(embedding=True)} FROM chorus_entries e WHERE e.workspace = %(ws)s "
                            "ORDER BY e.id", {"ws": self.workspace, **_emb_params(dim)})
                while True:
                    batch = cur.fetchmany(_batch_rows(dim))
                    if not batch:
                        break
                    for values in batch:
                        candidate = _Row(*values)
                        if candidate.id in set_aside:
                            continue
                        try:
                            vec = _check_row(candidate, dim, embedding=True)
                        except ValueError as exc:
                            bad.append((int(candidate.id), str(exc)))
                            continue
                        good.append((int(candidate.id), candidate.sig_key, candidate.sha256, candidate.nbytes, vec))
        # exact (flat) partitions first, so that the worker serves at once; partitions past the
        # approximate threshold are built as HNSW in a background thread and swapped in
        index = PartitionedIndex(dim, FLAT_ONLY) if dim else None
        if index is not None:
            self._index_add(index, good)
        known = {r[0]: (r[1], r[2], r[3]) for r in good}
        with self._mutex:
            self._index, self._known, self._dim, self._seq = index, known, dim, seq
            token = self._build_token = object()
            large = index is not None and any(p.live_count() >= self._approx_threshold for p in index.parts.values())
        if large:
            self._building = threading.Thread(target=self._build_approx, args=(token,), daemon=True,
                                              name=f"chorus-fleet-index-{self.workspace}")
            self._building.start()
        self._quarantine_all(bad)

    def _build_approx(self, token) -> None:
        """Build the index with approximate (HNSW) partitions from the exact one loaded at open,
        then swap it in, with whatever the feed added or removed meanwhile."""
        with self._mutex:
            if token is not self._build_token or self._index is None:
                return
            flat = self._index
            parts = {key: part.vectors() for key, part in flat.parts.items()}
        t = time.monotonic()
        built = PartitionedIndex(flat.dim, self._approx_threshold)
        for key, (ids, xb) in parts.items():
            if len(ids):
                built.add(key, ids, xb)
        with self._mutex:
            if token is not self._build_token or self._index is not flat:
                return  # reloaded meanwhile
            stale = [i for i in built.where if i not in self._known]
            if stale:
                built.remove(stale)
            missing = [i for i in self._known if i not in built.where]
            for i in missing:  # added by the feed during the build: take their vectors from the flat index
                key = self._known[i][0]
                built.add(key, [i], flat.parts[key].index.reconstruct(int(i))[None])
            self._index = built
        LOG.info("fleet workspace %s: approximate index of %d entries built in %.1f s", self.workspace,
                 len(built), time.monotonic() - t)

    def _index_add(self, index: PartitionedIndex, rows) -> None:
        groups: dict[str, tuple[list, list]] = {}
        for entry_id, sig_key, _, _, vec in rows:
            if entry_id in index.where:
                continue
            ids, vecs = groups.setdefault(sig_key, ([], []))
            ids.append(entry_id)
            vecs.append(vec)
        for key, (ids, vecs) in groups.items():
            index.add(key, np.array(ids, dtype=np.int64), np.stack(vecs))

    def _catch_up(self, conn) -> int:
        """Apply the change log after the last applied sequence number, up to the workspace's own
        sequence number, from one snapshot; returns changes applied (a full reload counts 1)."""
        return self._in_snapshot(conn, self._catch_up_in_snapshot)

    def _catch_up_in_snapshot(self, conn) -> int:
        with self._mutex:
            position, dim = self._seq, self._dim
        row = conn.execute("SELECT seq, trimmed_seq, dim FROM chorus_workspaces WHERE name=%s",
                           (self.workspace,)).fetchone()
        if row is None:
            return 0
        workspace_seq, trimmed, workspace_dim = int(row[0]), int(row[1]), self._workspace_dim(row[2])
        reload = None
        if position < 0:
            reload = "first load"
        elif trimmed > position:
            reload = "the change log was trimmed past this worker's position"
        elif workspace_dim != dim:
            reload = f"the workspace's embedding dimension is now {workspace_dim}"
        elif workspace_seq < position:
            reload = f"the workspace's sequence number went back from {position} to {workspace_seq}"
        if reload is not None:
            if position >= 0:
                LOG.warning("fleet workspace %s: reloading the index (%s)", self.workspace, reload)
            self._load_rows(conn)
            return 1
        applied = 0
        while position < workspace_seq:
            with conn.cursor(binary=True) as cur:
                cur.execute(
                    f"SELECT c.seq, c.op, c.entry_id, {_row_columns(embedding=True)} FROM chorus_changes c "
                    "LEFT JOIN chorus_entries e ON c.op = 'a' AND e.id = c.entry_id AND e.workspace = c.workspace "
                    "WHERE c.workspace = %(ws)s AND c.seq > %(after)s AND c.seq <= %(upto)s ORDER BY c.seq "
                    "LIMIT %(batch)s",
                    {"ws": self.workspace, "after": position, "upto": workspace_seq, "batch": _batch_rows(dim),
                     **_emb_params(dim)})
                changes = [(v[0], v[1], v[2], _Row(*v[3:]) if v[3] is not None else None) for v in cur.fetchall()]
            if not changes or int(changes[-1][0]) != position + len(changes):
                LOG.warning("fleet workspace %s: the change log has a gap after %d (changes deleted outside the "
                            "store); reloading the index", self.workspace, position)
                self._load_rows(conn)
                return applied + 1
            self._apply(changes, dim)
            applied += len(changes)
            position = int(changes[-1][0])
        return applied

    def _apply(self, changes, dim: int | None) -> None:
        """Apply ``(seq, op, entry_id, _Row or None)`` changes in order (those at or below the
        applied sequence number are skipped: the feed and writers both apply); ``dim``: the
        workspace row's embedding dimension. A row that fails :func:`_check_row` is quarantined."""
        bad = []
        gone = []
        with self._mutex, np.errstate(**QUIET_FLOATS):
            for seq, op, entry_id, row in changes:
                seq, entry_id = int(seq), int(entry_id)
                if seq <= self._seq:
                    continue
                self._seq = seq
                if op == "r":
                    if entry_id in self._known:
                        del self._known[entry_id]
                        if self._index is not None:
                            self._index.remove([entry_id])
                    gone.append(entry_id)
                    continue
                if op != "a" or row is None or entry_id in self._known or entry_id in self._set_aside:
                    continue  # not a change the store writes, removed since (its 'r' follows), or applied already
                try:
                    vec = _check_row(row, dim, embedding=True)
                except ValueError as exc:
                    bad.append((entry_id, str(exc)))
                    continue
                if self._index is None:
                    self._index = PartitionedIndex(dim, self._approx_threshold)
                self._dim = dim
                self._index_add(self._index, [(entry_id, row.sig_key, row.sha256, row.nbytes, vec)])
                self._known[entry_id] = (row.sig_key, row.sha256, int(row.nbytes))
        for entry_id in gone:
            self._tier_drop(entry_id)
        self._quarantine_all(bad)

    def _quarantine_all(self, bad) -> None:
        for entry_id, reason in bad:
            self._quarantine(entry_id, reason)

    def _listen_loop(self) -> None:
        """LISTEN on the change channel; catch up on each notification and every POLL_S seconds;
        on a lost connection, reconnect with backoff and catch up from the last sequence number."""
        psycopg = _psycopg()
        backoff = 0.2
        while not self._stop.is_set():
            conn = None
            try:
                conn = self._connect("feed", read_only=True)
                conn.conn.execute(f"LISTEN {CHANNEL}")
                with conn.deadline(FEED_DEADLINE_S):
                    self._catch_up(conn.conn)
                backoff = 0.2
                while not self._stop.is_set():
                    with conn.deadline(POLL_S + FEED_DEADLINE_S):
                        for _ in conn.conn.notifies(timeout=POLL_S, stop_after=1):
                            pass
                        self._catch_up(conn.conn)
            except (StoreError, psycopg.Error) as exc:
                if not self._stop.is_set():
                    LOG.debug("fleet change feed of %s: %s", self.workspace, redact(first_line(exc), self._secrets))
            except Exception as exc:  # noqa: BLE001 - the feed must keep running
                LOG.warning("fleet change feed of %s: %s", self.workspace, redact(repr(exc), self._secrets))
            finally:
                if conn is not None:
                    conn.close()
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 2.0)

    def wait_index(self, timeout: float | None = None) -> bool:
        """Wait until a background build of approximate partitions (after a load of a large
        workspace) is done; returns whether it is. Searches are exact while it runs."""
        thread = self._building
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def sync(self) -> int:
        """Catch up with the change log now (the listener does this by itself); returns changes applied."""
        return self._call(self._catch_up, read=True)

    # -- writing ----------------------------------------------------------------------------
    def add(self, embedding, masks: dict, meta: dict) -> int:
        """Store one entry fleet-wide; returns its id. Same input rules as :meth:`Workspace.add`."""
        return self._add(embedding, masks, meta, None)[0]

    def add_unique(self, embedding, masks: dict, meta: dict, *, min_similarity: float) -> tuple[int, bool]:
        """Like :meth:`add` unless an entry of the same signature with cosine >= ``min_similarity``
        exists fleet-wide (checked under the workspace row lock after catching up): then
        ``(that id, False)``. Each miss is thus written once across all workers."""
        min_similarity = float(min_similarity)
        if min_similarity != min_similarity:
            raise ValueError("min_similarity must be a number")
        return self._add(embedding, masks, meta, min_similarity)

    def _add(self, embedding, masks, meta, min_similarity):
        self._check_writable()
        new = encode_new_entry(embedding, masks, meta)  # the same checks and bytes as a one-host workspace
        entry_id, created = self._call(self._add_tx, new, min_similarity)
        _crash_hook("committed")
        if created:
            self._tier_put(entry_id, new.digest, new.data)
        if self._pending_hits:
            self._count_pending_hits()
        return entry_id, created

    def _add_tx(self, conn, new, min_similarity):
        emb = new.embedding
        with conn.transaction():
            row = conn.execute("SELECT dim FROM chorus_workspaces WHERE name=%s FOR UPDATE",
                               (self.workspace,)).fetchone()
            if row is None:
                raise ValueError(f"workspace {self.workspace} is not registered")
            dim = row[0]
            if dim is not None and dim != emb.size:
                raise ValueError(f"embedding has dim {emb.size}, this workspace holds dim {dim}")
            self._catch_up(conn)
            if min_similarity is not None:
                with self._mutex:
                    found = self._index.search(emb, 1, new.sig_key) if self._index is not None else []
                if found and found[0][1] >= min_similarity:
                    return int(found[0][0]), False
            if dim is None:
                conn.execute("UPDATE chorus_workspaces SET dim=%s WHERE name=%s", (emb.size, self.workspace))
            entry_id = conn.execute(
                "INSERT INTO chorus_entries(workspace, sig_key, sha256, nbytes, embedding, meta_json, data, created,"
                " last_used, hits) VALUES(%s, %s, %s, %s, %s, %s, %s, %s, %s, 0) RETURNING id",
                (self.workspace, new.sig_key, new.digest, len(new.data), emb.tobytes(), new.meta_json, new.data,
                 new.created, new.created)).fetchone()[0]
            entry_id = int(entry_id)
            conn.execute("UPDATE chorus_workspaces SET n_entries = n_entries + 1, n_bytes = n_bytes + %s "
                         "WHERE name=%s", (len(new.data), self.workspace))
            seq = self._log(conn, [("a", entry_id)])[0]
            changes = [(seq, "a", entry_id, _own_row(entry_id, new))]
            changes += self._evict(conn, protect=entry_id)
            _crash_hook("before_commit")
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, self.workspace))
        self._apply(changes, emb.size)
        return entry_id, True

    def _log(self, conn, ops) -> list[int]:
        """Append changes ``[(op, entry_id)]`` (caller holds the workspace row lock); returns seqs.
        Change rows already past the workspace's sequence number were not written by a store (a
        writer bumps both in one transaction): they are deleted first, with one log line."""
        if not ops:
            return []
        last = int(conn.execute("UPDATE chorus_workspaces SET seq = seq + %s WHERE name=%s RETURNING seq",
                                (len(ops), self.workspace)).fetchone()[0])
        seqs = list(range(last - len(ops) + 1, last + 1))
        stale = conn.execute("DELETE FROM chorus_changes WHERE workspace=%s AND seq >= %s RETURNING seq",
                             (self.workspace, seqs[0])).fetchall()
        if stale:
            LOG.warning("fleet workspace %s: deleted %d change rows past its sequence number %d (not written by a "
                        "store)", self.workspace, len(stale), seqs[0] - 1)
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO chorus_changes(workspace, seq, op, entry_id, time) VALUES(%s, %s, %s, %s, %s)",
                            [(self.workspace, s, op, i, time.time()) for s, (op, i) in zip(seqs, ops)])
        return seqs

    def _delete(self, conn, ids, *, reason: str | None = None) -> list:
        """Delete rows (caller holds the row lock), quarantining them with ``reason`` if given;
        returns the ``r`` changes to apply after the commit."""
        ids = [int(i) for i in ids]
        if not ids:
            return []
        if reason is not None:  # the row's text and bytes are kept when of sizes the store writes
            conn.execute("INSERT INTO chorus_quarantine(workspace, entry_id, reason, time, sig_key, meta_json, data) "
                         "SELECT workspace, id, %s, %s, left(sig_key, 64), "
                         f"CASE WHEN octet_length(meta_json) <= {MAX_META_BYTES} THEN meta_json END, "
                         f"CASE WHEN octet_length(data) = nbytes AND nbytes <= {MAX_ENTRY_FILE_BYTES} THEN data END "
                         "FROM chorus_entries WHERE workspace=%s AND id = ANY(%s)",
                         (reason, time.time(), self.workspace, ids))
        rows = conn.execute("DELETE FROM chorus_entries WHERE workspace=%s AND id = ANY(%s) RETURNING id, nbytes",
                            (self.workspace, ids)).fetchall()
        if not rows:
            return []
        conn.execute("UPDATE chorus_workspaces SET n_entries = n_entries - %s, n_bytes = n_bytes - %s WHERE name=%s",
                     (len(rows), sum(int(r[1]) for r in rows), self.workspace))
        removed = sorted(int(r[0]) for r in rows)
        seqs = self._log(conn, [("r", i) for i in removed])
        return [(s, "r", i, None) for s, i in zip(seqs, removed)]

    def _evict(self, conn, protect=None, max_bytes=None, max_entries=None, *, strict: bool = False) -> list:
        """Evict down to the caps (:func:`limits.eviction_caps`: the prune targets given, else the
        stored limits). Limits that are not valid evict nothing: ``ValueError`` when ``strict``
        (``prune``), else logged (the eviction after a write)."""
        row = conn.execute("SELECT n_entries, n_bytes, max_bytes, max_entries, eviction FROM chorus_workspaces "
                           "WHERE name=%s", (self.workspace,)).fetchone()
        count, total = int(row[0]), int(row[1])
        try:
            cap_bytes, cap_entries, policy = eviction_caps(
                {"max_bytes": row[2], "max_entries": row[3], "eviction": row[4]}, max_bytes, max_entries)
        except ValueError as exc:
            if strict:
                raise
            LOG.error("fleet workspace %s: %s", self.workspace, exc)
            return []
        if not over_caps(count, total, cap_bytes, cap_entries):
            return []
        order = "last_used, id" if policy != "lfu" else "hits, last_used, id"
        candidates = conn.execute(
            "SELECT id, nbytes FROM chorus_entries WHERE workspace=%s AND id <> %s ORDER BY " + order + " LIMIT %s",
            (self.workspace, -1 if protect is None else int(protect), count)).fetchall()
        victims = []
        for entry_id, nbytes in candidates:
            if not over_caps(count, total, cap_bytes, cap_entries):
                break
            victims.append(int(entry_id))
            total -= int(nbytes)
            count -= 1
        if victims:
            LOG.info("evicting %d entries (%s) from fleet workspace %s", len(victims), policy, self.workspace)
        return self._delete(conn, victims)

    def _locked_tx(self, conn, body):
        """Run ``body(conn) -> changes`` in a transaction holding the workspace row lock, notify,
        commit, apply the changes locally; returns the changes."""
        with conn.transaction():
            conn.execute("SELECT 1 FROM chorus_workspaces WHERE name=%s FOR UPDATE", (self.workspace,))
            self._catch_up(conn)
            changes = body(conn)
            if changes:
                conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, self.workspace))
        self._apply(changes, self._dim)
        return changes

    def remove(self, entry_id: int) -> bool:
        """Delete an entry fleet-wide; returns whether it existed."""
        changes = self._call(self._locked_tx, lambda conn: self._delete(conn, [entry_id]))
        return bool(changes)

    def _quarantine(self, entry_id: int, reason: str) -> None:
        """Move a damaged row to ``chorus_quarantine`` (one log line). On a read-only handle, or
        when the store cannot be written within the time bound, the entry is only set aside in this
        handle (left out of its index) and logged; the next writable handle that reads it
        quarantines it."""
        if self.readonly:
            LOG.error("fleet entry %d of %s is damaged (%s); read-only: not quarantined", entry_id, self.workspace,
                      reason)
            self._set_aside_entry(entry_id)
            return
        LOG.error("quarantining fleet entry %d of %s: %s", entry_id, self.workspace, reason)
        try:
            self._call(self._locked_tx, lambda conn: self._delete(conn, [entry_id], reason=reason))
        except StoreError as exc:
            LOG.error("fleet entry %d of %s: quarantine deferred (%s)", entry_id, self.workspace, exc)
            self._set_aside_entry(entry_id)
            return
        self._tier_drop(entry_id)

    def _set_aside_entry(self, entry_id: int) -> None:
        with self._mutex:
            self._set_aside.add(int(entry_id))
            if self._known.pop(int(entry_id), None) is not None and self._index is not None:
                self._index.remove([int(entry_id)])

    def prune(self, *, max_bytes: int | None = None, max_entries: int | None = None) -> list[int]:
        """Evict (by the workspace policy) until at most ``max_bytes`` bytes and ``max_entries``
        entries are left (each ``None``: the stored limit; 0 keeps nothing); trims the change log
        of changes older than a week; returns removed ids. Raises ``ValueError`` (having deleted
        nothing) for a negative, NaN, infinite, non-integral or absurd target (``limits.py``)."""
        prune_targets(max_bytes, max_entries)

        def body(conn):
            changes = self._evict(conn, max_bytes=max_bytes, max_entries=max_entries, strict=True)
            cutoff = time.time() - CHANGE_LOG_KEEP_S
            row = conn.execute("SELECT max(seq) FROM chorus_changes WHERE workspace=%s AND time < %s",
                               (self.workspace, cutoff)).fetchone()
            if row[0] is not None:
                conn.execute("DELETE FROM chorus_changes WHERE workspace=%s AND seq <= %s", (self.workspace, row[0]))
                conn.execute("UPDATE chorus_workspaces SET trimmed_seq = GREATEST(trimmed_seq, %s) WHERE name=%s",
                             (row[0], self.workspace))
            return changes

        return [c[2] for c in self._call(self._locked_tx, body)]

    def limits(self) -> dict:
        """The stored limits (``max_entries`` None: no entry cap); ``ValueError`` when the
        workspace row holds limits that are not valid."""
        row = self._call(lambda conn: conn.execute(
            "SELECT max_bytes, max_entries, eviction FROM chorus_workspaces WHERE name=%s",
            (self.workspace,)).fetchone(), read=True)
        valid = check_limits(row[0], row[1], row[2])
        return {"max_bytes": valid["max_bytes"], "max_entries": valid["max_entries"] or None,
                "eviction": valid["eviction"]}

    def set_limits(self, *, max_bytes: int | None = None, max_entries: int | None = None,
                   eviction: str | None = None) -> None:
        """Store the fleet-wide cap (``max_entries=0``: no entry cap) and the eviction policy; every
        worker applies it at its next write. ``ValueError`` for limits ``limits.check_limits``
        refuses."""
        valid = check_limits(max_bytes, max_entries, eviction)

        def tx(conn):
            with conn.transaction():
                conn.execute("UPDATE chorus_workspaces SET max_bytes = COALESCE(%s, max_bytes), "
                             "max_entries = COALESCE(%s, max_entries), eviction = COALESCE(%s, eviction) "
                             "WHERE name=%s", (valid["max_bytes"], valid["max_entries"], valid["eviction"],
                                               self.workspace))

        self._call(tx)

    # -- reading ----------------------------------------------------------------------------
    def search(self, embedding, k: int = 1, signature=None) -> list[tuple[int, float]]:
        """Top ``k`` ``(entry_id, cosine similarity)`` from this worker's index (no network)."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        key = None if signature is None else (signature if isinstance(signature, str) else signature_key(signature))
        with self._mutex:
            if self._index is None:
                normalise(np.asarray(embedding, dtype=np.float32).reshape(1, -1))
                return []
            return self._index.search(embedding, int(k), key)

    def load(self, entry_id: int, *, packed: bool = False, touch: bool = True):
        """``(masks, meta)`` of an entry: from the local tier when it holds the entry with the
        right sha256, else fetched from PostgreSQL over the read connection (and kept in the tier).
        Never waits for a write of another thread of this handle: the hit (``touch``) is counted
        at once when the write connection is free, else with the next write, touch or close.
        Raises ``KeyError`` (unknown id), :class:`CorruptEntryError` (damaged row, now
        quarantined) or :class:`StoreUnavailableError` (not in the tier and PostgreSQL
        unreachable)."""
        entry_id = int(entry_id)
        with self._mutex:
            known = self._known.get(entry_id)
            set_aside = entry_id in self._set_aside
        if set_aside:
            raise CorruptEntryError(f"entry {entry_id} was found damaged earlier (quarantine pending)")
        data = self._tier_get(entry_id, known[1]) if known is not None else None
        if data is None:
            row, dim = self._call(self._fetch, entry_id, read=True)
            if row is None:
                raise KeyError(f"no entry {entry_id} in fleet workspace {self.workspace}")
            masks, meta = self._checked_entry(row, dim, packed, announced=known[1] if known else None)
            self._tier_put(entry_id, row.sha256, row.data)
        else:
            masks, meta = self._checked_entry(None, None, packed, tier=(entry_id, data, known[0]))
        if touch:
            self._count_hit(entry_id)
        return masks, meta

    def _fetch(self, conn, entry_id) -> tuple[_Row | None, int | None]:
        """The row of ``entry_id`` (sizes guarded) and the workspace's embedding dimension."""
        with conn.cursor(binary=True) as cur:
            cur.execute(f"SELECT {_row_columns(embedding=True, data=True)}, w.dim FROM chorus_entries e "
                        "JOIN chorus_workspaces w ON w.name = e.workspace WHERE e.id = %(id)s AND e.workspace = %(ws)s",
                        {"id": entry_id, "ws": self.workspace, **_emb_params(None)})
            values = cur.fetchone()
        if values is None:
            return None, None
        return _Row(*values[:-1]), self._workspace_dim(values[-1])

    def _entry_problem(self, row: _Row, dim: int | None, packed: bool, announced: str | None = None):
        """The checks of a fetched row and its entry bytes, shared by :meth:`load` and
        :meth:`verify`: ``(masks, meta)``, or a ``str`` saying why the row is damaged."""
        if announced is not None and announced != row.sha256:
            return "row sha256 differs from the one its change announced"
        try:
            _check_row(row, dim, embedding=True)
        except ValueError as exc:
            return str(exc)
        if hashlib.sha256(row.data).hexdigest() != row.sha256:
            return "sha256 mismatch"
        return self._decoded(row.data, packed, row.sig_key, row.embedding)

    @staticmethod
    def _decoded(data: bytes, packed: bool, sig_key: str, row_embedding: bytes | None):
        """``(masks, meta)`` of entry bytes whose signature (and embedding) match the row's, or why not."""
        try:
            masks, emb, meta = decode_entry(data, packed=packed)
            check_entry_matches_row(emb, meta, sig_key, row_embedding)
        except (EntryFormatError, ValueError, TypeError, MemoryError, RecursionError) as exc:
            return f"undecodable: {exc}"
        return masks, meta

    def _checked_entry(self, row, dim, packed, *, announced=None, tier=None):
        """Check a fetched row (or ``tier=(entry_id, bytes, sig_key)`` read from the local tier,
        already matched to the row's sha256): ``(masks, meta)``, else quarantine and raise
        :class:`CorruptEntryError`."""
        if tier is not None:
            entry_id, data, sig_key = tier
            result = self._decoded(data, packed, sig_key, None)
        else:
            entry_id = int(row.id)
            result = self._entry_problem(row, dim, packed, announced)
        if isinstance(result, str):
            self._quarantine(entry_id, result)
            raise CorruptEntryError(f"entry {entry_id}: {result} " +
                                    ("(read-only: not quarantined)" if self.readonly else "(quarantined)"))
        return result

    def _count_hit(self, entry_id: int) -> None:
        """Count a hit of ``load`` without waiting (see :meth:`load`)."""
        if self.readonly:
            return
        with self._mutex:
            self._pending_hits[entry_id] = self._pending_hits.get(entry_id, 0) + 1
        self._count_pending_hits()

    def _count_pending_hits(self) -> None:
        try:
            self._flush_hits(wait=False)
        except StoreBusyError:
            LOG.debug("fleet workspace %s: hits kept pending (the write connection is busy)", self.workspace)
        except StoreError as exc:  # the entry is good; only its hit waits (store contract)
            LOG.warning("fleet workspace %s: hits not counted yet (%s)", self.workspace, exc)

    def _flush_hits(self, wait: bool = True) -> None:
        with self._mutex:
            hits, self._pending_hits = self._pending_hits, {}
        if not hits:
            return

        def tx(conn):
            now = time.time()
            with conn.transaction():
                with conn.cursor() as cur:
                    cur.executemany("UPDATE chorus_entries SET hits = hits + %s, last_used = %s WHERE id = %s "
                                    "AND workspace = %s", [(n, now, i, self.workspace) for i, n in sorted(hits.items())])

        try:
            self._call(tx, wait=wait)
        except BaseException:
            with self._mutex:  # kept for the next try
                for entry_id, n in hits.items():
                    self._pending_hits[entry_id] = self._pending_hits.get(entry_id, 0) + n
            raise

    def touch(self, entry_id: int) -> None:
        """Count a hit fleet-wide (``hits += 1``, ``last_used = now``), with any hits :meth:`load`
        kept pending; raises ``StoreBusyError`` past the time bound (the hits stay pending)."""
        self._check_writable()
        with self._mutex:
            self._pending_hits[int(entry_id)] = self._pending_hits.get(int(entry_id), 0) + 1
        self._flush_hits()

    def entries(self) -> list[dict]:
        """One dict per entry (id, sig_key, nbytes, hits, created, last_used, meta), in id order.
        A row that fails :func:`_check_row` is left out (one log line each); metadata that cannot
        be read (too large, too deep, not JSON) shows as ``{"unreadable": reason}``."""
        def q(conn):
            with conn.cursor(binary=True) as cur:
                cur.execute(f"SELECT {_row_columns(meta=True)} FROM chorus_entries e WHERE e.workspace = %(ws)s "
                            "ORDER BY e.id", {"ws": self.workspace})
                return [_Row(*values) for values in cur.fetchall()]

        out = []
        for row in self._call(q, deadline=60, read=True):
            try:
                _check_row(row, None)
            except ValueError as exc:
                LOG.warning("fleet entry %s of %s left out of the listing: %s", row.id, self.workspace, exc)
                continue
            out.append({"id": row.id, "sig_key": row.sig_key, "nbytes": row.nbytes, "hits": row.hits,
                        "created": row.created, "last_used": row.last_used, "meta": row_meta(row.meta_json, row.meta_len)})
        return out

    def quarantined(self) -> list[dict]:
        rows = self._call(lambda conn: conn.execute(
            "SELECT entry_id, left(reason, 1000), time FROM chorus_quarantine WHERE workspace=%s ORDER BY time",
            (self.workspace,)).fetchall(), read=True)
        return [{"id": r[0], "file": None, "reason": r[1], "time": r[2]} for r in rows]

    def stats(self) -> dict:
        """Counts, bytes, hits, limits, index kinds, change-feed position, local tier, quarantine."""
        def q(conn):
            ws = conn.execute("SELECT seq, dim, n_entries, n_bytes, max_bytes, max_entries, eviction "
                              "FROM chorus_workspaces WHERE name=%s", (self.workspace,)).fetchone()
            hits, sigs = conn.execute("SELECT COALESCE(SUM(hits), 0), COUNT(DISTINCT sig_key) FROM chorus_entries "
                                      "WHERE workspace=%s", (self.workspace,)).fetchone()
            return ws, int(hits), int(sigs)

        ws, hits, sigs = self._call(q, deadline=60, read=True)
        with self._mutex:
            kinds = self._index.kinds() if self._index is not None else {}
            indexed, applied = len(self._known), self._seq
        building = self._building is not None and self._building.is_alive()
        tier_files, tier_bytes = self._tier_usage()
        try:
            valid = check_limits(ws[4], ws[5], ws[6])
            limits = {"max_bytes": valid["max_bytes"], "max_entries": valid["max_entries"] or None,
                      "eviction": valid["eviction"]}
        except ValueError as exc:  # stats still answer for a workspace row edited badly
            limits = {"invalid": str(exc)}
        return {
            "path": f"{self.url} workspace {self.workspace}", "store": "fleet", "workspace": self.workspace,
            "entries": int(ws[2]), "bytes": int(ws[3]), "hits": hits, "signatures": sigs,
            "dim": ws[1], "generation": int(ws[0]), "feed_seq": applied, "readonly": self.readonly,
            "limits": limits, "index": kinds, "index_building": building, "indexed": indexed,
            "quarantined": self.quarantined(),
            "local_tier": {"path": str(self.tier_dir), "files": tier_files, "bytes": tier_bytes,
                           "max_bytes": self.tier_bytes},
        }

    # -- maintenance ------------------------------------------------------------------------
    def rebuild_index(self, progress: bool = False) -> dict:
        """Reload this worker's index from PostgreSQL (waiting for the approximate partitions);
        returns its kinds per signature."""
        self._call(self._full_load, deadline=FEED_DEADLINE_S, read=True)
        self.wait_index()
        with self._mutex:
            return self._index.kinds() if self._index is not None else {}

    def verify(self, progress: bool = False) -> dict:
        """Check every row (:func:`_check_row`, sha256, decodes, embedding and signature match the
        row) on a connection of its own, quarantine the damaged ones, clean the local tier
        (temporary files, files of removed entries, files whose bytes differ from their row) and
        check that the index holds exactly the live entries. Read-only handles report damage
        without quarantining and clean nothing (``cleanup_skipped`` says so)."""
        self.sync()

        def scan(conn):
            bad, checked, live = [], 0, {}
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                dim = conn.execute("SELECT dim FROM chorus_workspaces WHERE name=%s", (self.workspace,)).fetchone()
                dim = self._workspace_dim(dim[0]) if dim else None
                with conn.cursor(name=f"chorus_verify_{uuid.uuid4().hex[:8]}", binary=True) as cur:
                    cur.itersize = 16
                    cur.execute(f"SELECT {_row_columns(embedding=True, data=True)} FROM chorus_entries e "
                                "WHERE e.workspace = %(ws)s ORDER BY e.id", {"ws": self.workspace, **_emb_params(dim)})
                    for values in cur:
                        row = _Row(*values)
                        checked += 1
                        live[int(row.id)] = row.sha256
                        problem = self._entry_problem(row, dim, packed=True)
                        if isinstance(problem, str):
                            bad.append((int(row.id), problem))
            return bad, checked, live

        scanner = _Slot("verify", read_only=True)
        try:
            bad, checked, live = self._call(scan, deadline=3600, slot=scanner)
        finally:
            scanner.close()
        damaged = []
        for entry_id, reason in bad:
            self._quarantine(entry_id, reason)
            damaged.append({"id": entry_id, "file": None, "reason": reason})
            live.pop(entry_id, None)
        report = {"checked": checked, "damaged": damaged, "ok": not damaged, "temp_files_removed": 0,
                  "orphans_removed": 0}
        if self.readonly:
            report["cleanup_skipped"] = "read-only: damaged rows are not quarantined, the local tier is not cleaned"
        else:
            report.update(self._tier_clean(live))
            self.sync()
        with self._mutex:
            indexed = set(self._known)
            index_ids = set(self._index.where) if self._index is not None else set()
        report["index_consistent"] = indexed == set(live) and index_ids == set(live)
        return report

    # -- local tier -------------------------------------------------------------------------
    def _tier_path(self, entry_id: int, digest: str) -> Path:
        if not is_digest(digest):  # names are made from checked rows only; never a path of another shape
            raise ValueError(f"not a sha256 digest: {digest[:80]!r}")
        return self.tier_dir / f"{int(entry_id)}-{digest}.safetensors"

    def _tier_get(self, entry_id: int, digest: str) -> bytes | None:
        path = self._tier_path(entry_id, digest)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != digest:
            LOG.warning("local tier file %s is damaged; fetching entry %d again", path.name, entry_id)
            if not self.readonly:
                path.unlink(missing_ok=True)
            return None
        if not self.readonly:
            try:
                os.utime(path)  # LRU order of the tier
            except OSError:
                pass
        return data

    def _tier_put(self, entry_id: int, digest: str, data: bytes) -> None:
        if self.readonly or len(data) > self.tier_bytes:
            return
        path = self._tier_path(entry_id, digest)
        tmp = self.tier_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            self.tier_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)  # a cache: checked by sha256 on read, so no fsync
            self._tier_evict()
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            LOG.warning("could not keep entry %d in the local tier: %s", entry_id, exc)

    def _tier_files(self):
        out = []
        for p in self.tier_dir.glob("*.safetensors"):
            try:
                st = p.stat()
            except OSError:
                continue
            out.append((st.st_mtime, p, st.st_size))
        return out

    def _tier_usage(self) -> tuple[int, int]:
        files = self._tier_files() if self.tier_dir.exists() else []
        return len(files), sum(f[2] for f in files)

    def _tier_evict(self) -> None:
        with self._tier_lock:
            files = sorted(self._tier_files(), key=lambda f: (f[0], f[1].name))
            total = sum(f[2] for f in files)
            for _, p, size in files:
                if total <= self.tier_bytes:
                    break
                p.unlink(missing_ok=True)
                total -= size

    def _tier_drop(self, entry_id: int) -> None:
        if self.readonly:
            return
        for p in self.tier_dir.glob(f"{int(entry_id)}-*.safetensors"):
            p.unlink(missing_ok=True)

    def _tier_clean(self, live: dict) -> dict:
        """Delete the tier's temporary files and the files of entries not live with that sha256."""
        temps = orphans = 0
        with self._tier_lock:
            for p in list(self.tier_dir.iterdir()) if self.tier_dir.exists() else []:
                if p.name.startswith(".tmp-"):
                    p.unlink(missing_ok=True)
                    temps += 1
                    continue
                entry_id, digest = _tier_name(p.name)
                if entry_id is None or live.get(entry_id) != digest:
                    p.unlink(missing_ok=True)
                    orphans += 1
        return {"temp_files_removed": temps, "orphans_removed": orphans}


def _batch_rows(dim: int | None) -> int:
    """Rows per fetch of the feed and the full load: at most CATCH_UP_BATCH_BYTES of embeddings."""
    return max(1, min(CATCH_UP_BATCH, CATCH_UP_BATCH_BYTES // (4 * (dim or MAX_EMBEDDING_DIM))))


def _tier_name(name: str):
    m = re.fullmatch(r"(\d+)-([0-9a-f]{64})\.safetensors", name)
    return (int(m.group(1)), m.group(2)) if m else (None, None)


def _crash_hook(phase: str) -> None:
    """Test seam: called at ``before_commit`` (inside the write transaction) and ``committed``."""
