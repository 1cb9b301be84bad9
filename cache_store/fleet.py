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
  and swapped in, so a new worker serves while the slow build runs), then the change log after each ``NOTIFY chorus_changes`` (a listener thread
  with its own connection) and every ``POLL_S`` seconds; after a reconnect it catches up from the
  last sequence number it applied (a full reload when the log was trimmed past it). Searches never
  touch the network.
* **A local disk tier** under the cache root (``<CHORUS_CACHE_DIR>/<workspace>/fleet_tier/``): the
  entry files of this worker's recent loads and writes, ``<id>-<sha256>.safetensors``, an LRU cache
  bounded by ``tier_bytes`` (``CHORUS_FLEET_TIER_BYTES``, 20 GiB by default), so that a hit fetches an entry from PostgreSQL at most once per host.

Writes (:meth:`FleetStore.add_unique`): encode the entry, then one transaction: lock the workspace
row (``SELECT ... FOR UPDATE``, waiting at most ``lock_timeout``), catch up with the change log
(every earlier writer has committed), search for an entry that already serves the request (then
nothing is written), insert the row, append the change, evict down to the fleet-wide cap (more
changes), ``pg_notify``, commit. An entry is therefore visible whole or not at all, on every
worker, and the sequence numbers of a workspace are committed in order (the row lock serialises
its writers), so catching up by sequence number never skips a change.

Trust: rows are checked like files. A load checks the bytes' sha256 against the row (and against
the sha256 the change feed announced), decodes them with the shared codec, and checks that the
embedding and signature inside the entry match the row's; an embedding from the feed that is not
a finite vector of the workspace's dim is refused. Anything else is quarantined: the row moves to
``chorus_quarantine`` with the reason, is dropped from every worker's index (a ``r`` change) and
:class:`~chorus.cache_store.CorruptEntryError` is raised. Local tier files are checked against the
row's sha256 and replaced when they differ.

Bounded waits (the store contract of ``errors.py``): ``lock_timeout`` is the time bound
(``CHORUS_CACHE_TIMEOUT``, 2 s by default; past it
:class:`~chorus.cache_store.errors.StoreBusyError`, nothing changed); ``connect_timeout`` (3 s)
and ``statement_timeout`` (5 s) on every connection, TCP keepalives and ``tcp_user_timeout``, and
a client-side deadline (7 s) that shuts the socket down when a call overruns (a server that
stopped answering). Past those the call raises
:class:`~chorus.cache_store.protocol.StoreUnavailableError` (a ``StoreError``); other server
errors (a missing privilege, the server's disk full) raise ``StoreError``. The engine turns each
into a miss (dense attention) or a write not made, with a message. The next call reconnects.

Security: credentials come from the URL, the environment (``PGPASSWORD``, ``PGUSER``...) or a
pgpass file, as libpq reads them; they are never logged or put in a message (:func:`redact`);
every statement is parameterised (table names are constants); URL options such as ``sslmode``
pass through to libpq unchanged.

Tests: ``tests/test_fleet_store.py`` (protocol, feed, dedupe, quarantine, credentials, bounded
waits, SIGKILLed server), ``tests/test_fleet_serving.py`` (real ComfyUI servers).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from .entry_format import EntryFormatError, decode_entry
from .index import DEFAULT_APPROX_THRESHOLD, PartitionedIndex, normalise
from .errors import StoreBusyError, StoreError, store_timeout
from .protocol import MissingDriverError, StoreUnavailableError
from .signature import signature_key
from .workspace import DEFAULT_MAX_BYTES, CorruptEntryError, check_limits, encode_new_entry

LOG = logging.getLogger(__name__)

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

_URL_USERINFO = re.compile(r"(postgres(?:ql)?://)([^@/?#\s]*)@")


def _psycopg():
    try:
        import psycopg
    except ImportError:
        raise MissingDriverError("the fleet store (CHORUS_CACHE_URL=postgresql://...) needs psycopg 3: "
                          "pip install 'chorus-ii[fleet]' (or pip install 'psycopg[binary]')") from None
    return psycopg


def redact(text: str, secrets=()) -> str:
    """``text`` with URL user info reduced to the user name and every secret replaced by ``***``."""
    text = _URL_USERINFO.sub(lambda m: m.group(1) + m.group(2).split(":", 1)[0] + ("@"), str(text))
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    text = re.sub(r"(password\s*=\s*)(\S+)", r"\1***", text, flags=re.IGNORECASE)
    return text


class _Conn:
    """One psycopg connection with the store's session settings and a client-side deadline."""

    def __init__(self, params: dict, secrets, lock_timeout_ms: int = LOCK_TIMEOUT_MS):
        psycopg = _psycopg()
        self.secrets = secrets
        try:
            self.conn = psycopg.connect(**params, autocommit=True)
        except psycopg.Error as exc:
            raise StoreUnavailableError(f"PostgreSQL unreachable: {redact(_first_line(exc), secrets)}") from None
        try:
            self.conn.execute("SELECT set_config('statement_timeout', %s, false), set_config('lock_timeout', %s, false)",
                              (str(STATEMENT_TIMEOUT_MS), str(int(lock_timeout_ms))))
        except psycopg.Error as exc:
            self.close()
            raise StoreUnavailableError(f"PostgreSQL session setup failed: {redact(_first_line(exc), secrets)}") from None

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


def _first_line(exc) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class FleetStore:
    """The fleet store of one workspace (see the module docstring). Use :meth:`open`.

    Thread-safe within a process. ``len(store)`` and :meth:`search` answer from this worker's
    index (as fresh as its change feed); everything else asks PostgreSQL.
    """

    def __init__(self, url: str, workspace: str, local_path: Path, *, tier_bytes: int | None = None,
                 approx_threshold: int = DEFAULT_APPROX_THRESHOLD, listen: bool = True, timeout=None):
        psycopg = _psycopg()
        self.timeout = store_timeout(timeout)  # the longest wait for another worker (the row lock)
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
        self._approx_threshold = int(approx_threshold)
        self._mutex = threading.RLock()  # index, known rows, seq
        self._conn_lock = threading.RLock()  # the command connection
        self._conn: _Conn | None = None
        self._index: PartitionedIndex | None = None
        self._known: dict[int, tuple[str, str, int]] = {}  # id -> (sig_key, sha256, nbytes)
        self._dim: int | None = None
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
             **options) -> "FleetStore":
        """Connect, create the tables if missing (needs CREATE on the schema the first time only),
        register the workspace, load its index and start the change-feed listener (``listen``).
        ``local_path``: this host's directory of the workspace (the local tier goes under it).
        Raises :class:`StoreUnavailableError` when PostgreSQL cannot be reached."""
        store = cls(url, workspace, local_path, listen=listen, **options)
        store.tier_dir.mkdir(parents=True, exist_ok=True)
        for tmp in store.tier_dir.glob(".tmp-*"):
            tmp.unlink(missing_ok=True)
        store._call(store._setup)
        if max_bytes is not None or max_entries is not None or eviction is not None:
            store.set_limits(max_bytes=max_bytes, max_entries=max_entries, eviction=eviction)
        store._call(store._full_load, deadline=FEED_DEADLINE_S)
        if listen:
            store._listener = threading.Thread(target=store._listen_loop, name=f"chorus-fleet-{workspace}",
                                               daemon=True)
            store._listener.start()
        LOG.info("fleet store %s workspace %s: %d entries, seq %d", store.url, workspace, len(store), store._seq)
        return store

    def _setup(self, conn) -> None:
        psycopg = _psycopg()
        with conn.transaction():
            exists = conn.execute("SELECT to_regclass('chorus_changes') IS NOT NULL").fetchone()[0]
            if not exists:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                if not conn.execute("SELECT to_regclass('chorus_changes') IS NOT NULL").fetchone()[0]:
                    try:
                        for statement in SCHEMA:
                            conn.execute(statement)
                    except psycopg.errors.InsufficientPrivilege:
                        raise ValueError("the chorus tables do not exist and this role may not create them: "
                                         "run the schema SQL of docs/OPERATIONS.md (Fleet) as the owner role") from None
        with conn.transaction():
            conn.execute("INSERT INTO chorus_workspaces(name) VALUES(%s) ON CONFLICT (name) DO NOTHING",
                         (self.workspace,))

    def close(self) -> None:
        """Stop the listener and close the connections (the local tier stays)."""
        if self._closed:
            return
        self._closed = True
        self._build_token = None  # a background index build stops at its swap
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=POLL_S + CALL_DEADLINE_S)
        with self._conn_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

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
    def _connect(self, feed: bool = False) -> _Conn:
        params = dict(self._params)
        if feed:  # the listener's connection, told apart in pg_stat_activity
            params["application_name"] = f"{params['application_name']}-feed"
        return _Conn(params, self._secrets, lock_timeout_ms=int(self.timeout * 1000))

    def _call(self, fn, *args, deadline: float = CALL_DEADLINE_S):
        """Run ``fn(conn, *args)`` on the command connection (reconnecting as needed) within
        ``deadline`` seconds; a connection-level failure raises :class:`StoreUnavailableError`."""
        psycopg = _psycopg()
        if self._closed:
            raise StoreUnavailableError("the fleet store is closed")
        with self._conn_lock:
            fresh = False
            if self._conn is None or self._conn.broken:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                try:
                    self._conn = self._connect()
                except StoreUnavailableError as exc:
                    self._down(str(exc))
                    raise
                fresh = True
            conn = self._conn
            try:
                if not fresh:  # a reused connection may have died with a server restart: ping first
                    with conn.deadline(CONNECT_TIMEOUT_S):
                        conn.conn.execute("SELECT 1")
            except psycopg.Error:
                conn.close()
                self._conn = None
                return self._call(fn, *args, deadline=deadline)
            guard = conn.deadline(deadline)
            try:
                with guard:
                    result = fn(conn.conn, *args)
                self.connected, self.last_error = True, None
                return result
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if isinstance(exc, psycopg.errors.LockNotAvailable):
                    raise StoreBusyError(f"fleet workspace {self.workspace}: another worker held the write lock past "
                                         f"the time bound ({self.timeout:g} s); nothing was changed") from None
                if isinstance(exc, psycopg.errors.QueryCanceled):
                    reason = f"PostgreSQL did not answer in time ({redact(_first_line(exc), self._secrets)})"
                    raise StoreUnavailableError(reason) from None
                conn.close()
                self._conn = None
                reason = ("PostgreSQL did not answer within %.0f s" % deadline) if guard.fired else \
                    f"PostgreSQL connection lost ({redact(_first_line(exc), self._secrets)})"
                self._down(reason)
                raise StoreUnavailableError(reason) from None
            except psycopg.Error as exc:  # e.g. a permission the role lacks, a full disk on the server
                raise StoreError(f"PostgreSQL error: {redact(_first_line(exc), self._secrets)}") from None

    def _down(self, reason: str) -> None:
        if self.connected:  # logged once per outage (a failed open is reported by its exception)
            LOG.warning("Chorus fleet store %s: %s", self.url, reason)
        self.connected, self.last_error = False, reason

    # -- the change feed --------------------------------------------------------------------
    def _full_load(self, conn) -> None:
        """Load every entry's embedding and the sequence number they match, from one snapshot
        (a REPEATABLE READ transaction; inside a writer's transaction, which holds the workspace
        row lock, nothing can change between the statements)."""
        psycopg = _psycopg()
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                conn.execute("SELECT set_config('statement_timeout', %s, true)", (str(FULL_LOAD_TIMEOUT_MS),))
                self._load_rows(conn)
        else:
            self._load_rows(conn)

    def _load_rows(self, conn) -> None:
        row = conn.execute("SELECT seq, dim FROM chorus_workspaces WHERE name=%s", (self.workspace,)).fetchone()
        seq, dim = (int(row[0]), row[1]) if row else (0, None)
        rows = []
        with conn.cursor(binary=True) as cur:
            cur.execute("SELECT id, sig_key, sha256, nbytes, embedding FROM chorus_entries WHERE workspace=%s "
                        "ORDER BY id", (self.workspace,))
            while True:
                batch = cur.fetchmany(CATCH_UP_BATCH)
                if not batch:
                    break
                rows.extend(batch)
        # exact (flat) partitions first, so that the worker serves at once; partitions past the
        # approximate threshold are built as HNSW in a background thread and swapped in
        index = PartitionedIndex(int(dim), FLAT_ONLY) if dim else None
        known: dict[int, tuple[str, str, int]] = {}
        bad = []
        if index is not None:
            good = self._check_rows(rows, int(dim), bad)
            self._index_add(index, good)
            known = {r[0]: (r[1], r[2], r[3]) for r in good}
        with self._mutex:
            self._index, self._known, self._dim, self._seq = index, known, (int(dim) if dim else None), seq
            token = self._build_token = object()
            large = index is not None and any(p.live_count() >= self._approx_threshold for p in index.parts.values())
        if large:
            self._building = threading.Thread(target=self._build_approx, args=(token,), daemon=True,
                                              name=f"chorus-fleet-index-{self.workspace}")
            self._building.start()
        self._quarantine_later(bad)

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

    def _check_rows(self, rows, dim: int, bad: list) -> list:
        """Rows whose embedding is a finite float32 vector of ``dim`` (others go to ``bad``)."""
        good = []
        for entry_id, sig_key, sha, nbytes, emb in rows:
            vec = np.frombuffer(bytes(emb), dtype=np.uint8)
            if vec.size != 4 * dim or not isinstance(sig_key, str) or not isinstance(sha, str):
                bad.append((int(entry_id), f"row embedding has {vec.size} bytes, expected {4 * dim}"))
                continue
            vec = vec.view(np.float32)
            if not np.isfinite(vec).all() or not np.any(vec):
                bad.append((int(entry_id), "row embedding is not a finite non-zero vector"))
                continue
            good.append((int(entry_id), sig_key, sha, int(nbytes), vec))
        return good

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
        """Apply the change log after the last applied sequence number; returns changes applied."""
        with self._mutex:
            seq, dim = self._seq, self._dim
        row = conn.execute("SELECT seq, trimmed_seq, dim FROM chorus_workspaces WHERE name=%s",
                           (self.workspace,)).fetchone()
        if row is None:
            return 0
        if seq < 0 or int(row[1]) > seq or (dim is None and row[2] is not None):
            self._full_load(conn)  # never loaded, or the log was trimmed past this worker's position
            return 1
        if int(row[0]) <= seq:
            return 0
        applied = 0
        while True:
            with conn.cursor(binary=True) as cur:
                cur.execute(
                    "SELECT c.seq, c.op, c.entry_id, e.sig_key, e.sha256, e.nbytes, e.embedding "
                    "FROM chorus_changes c LEFT JOIN chorus_entries e ON c.op = 'a' AND e.id = c.entry_id "
                    "AND e.workspace = c.workspace WHERE c.workspace = %s AND c.seq > %s ORDER BY c.seq LIMIT %s",
                    (self.workspace, seq, CATCH_UP_BATCH))
                changes = cur.fetchall()
            if not changes:
                break
            self._apply(changes)
            applied += len(changes)
            seq = int(changes[-1][0])
            if len(changes) < CATCH_UP_BATCH:
                break
        return applied

    def _apply(self, changes) -> None:
        """Apply ``(seq, op, entry_id, sig_key, sha256, nbytes, embedding)`` rows in order (rows
        at or below the applied sequence number are skipped: the feed and writers both apply)."""
        bad = []
        gone = []
        with self._mutex:
            for seq, op, entry_id, sig_key, sha, nbytes, emb in changes:
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
                if emb is None or entry_id in self._known:
                    continue  # removed since (its 'r' follows), or already applied by this writer
                if self._dim is None:
                    self._dim = len(bytes(emb)) // 4
                good = self._check_rows([(entry_id, sig_key, sha, nbytes, emb)], self._dim, bad)
                if not good:
                    continue
                if self._index is None:
                    self._index = PartitionedIndex(self._dim, self._approx_threshold)
                self._index_add(self._index, good)
                self._known[entry_id] = (sig_key, sha, int(nbytes))
        for entry_id in gone:
            self._tier_drop(entry_id)
        self._quarantine_later(bad)

    def _quarantine_later(self, bad) -> None:
        for entry_id, reason in bad:
            try:
                self._quarantine(entry_id, reason)
            except Exception as exc:  # noqa: BLE001 - it is not indexed either way
                LOG.warning("could not quarantine entry %d: %s", entry_id, exc)

    def _listen_loop(self) -> None:
        """LISTEN on the change channel; catch up on each notification and every POLL_S seconds;
        on a lost connection, reconnect with backoff and catch up from the last sequence number."""
        psycopg = _psycopg()
        backoff = 0.2
        while not self._stop.is_set():
            conn = None
            try:
                conn = self._connect(feed=True)
                conn.conn.execute(f"LISTEN {CHANNEL}")
                with conn.deadline(FEED_DEADLINE_S):
                    self._catch_up(conn.conn)
                backoff = 0.2
                while not self._stop.is_set():
                    with conn.deadline(POLL_S + FEED_DEADLINE_S):
                        for _ in conn.conn.notifies(timeout=POLL_S, stop_after=1):
                            pass
                        self._catch_up(conn.conn)
            except (StoreUnavailableError, psycopg.Error) as exc:
                if not self._stop.is_set():
                    LOG.debug("fleet change feed of %s: %s", self.workspace, redact(_first_line(exc), self._secrets))
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
        return self._call(self._catch_up)

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
        new = encode_new_entry(embedding, masks, meta)  # the same checks and bytes as a one-host workspace
        emb, sig_key, digest, data = new.embedding, new.sig_key, new.digest, new.data
        result = self._call(self._add_tx, emb, sig_key, digest, data, new.meta_json, new.created, min_similarity)
        entry_id, created = result
        _crash_hook("committed")
        if created:
            self._tier_put(entry_id, digest, data)
        return entry_id, created

    def _add_tx(self, conn, emb, sig_key, digest, data, meta_json, now, min_similarity):
        with conn.transaction():
            row = conn.execute("SELECT dim FROM chorus_workspaces WHERE name=%s FOR UPDATE",
                               (self.workspace,)).fetchone()
            if row is None:
                raise ValueError(f"workspace {self.workspace} is not registered")
            dim = row[0]
            if dim is not None and int(dim) != emb.size:
                raise ValueError(f"embedding has dim {emb.size}, this workspace holds dim {dim}")
            self._catch_up(conn)
            if min_similarity is not None:
                with self._mutex:
                    found = self._index.search(emb, 1, sig_key) if self._index is not None else []
                if found and found[0][1] >= min_similarity:
                    return int(found[0][0]), False
            if dim is None:
                conn.execute("UPDATE chorus_workspaces SET dim=%s WHERE name=%s", (emb.size, self.workspace))
            entry_id = conn.execute(
                "INSERT INTO chorus_entries(workspace, sig_key, sha256, nbytes, embedding, meta_json, data, created,"
                " last_used, hits) VALUES(%s, %s, %s, %s, %s, %s, %s, %s, %s, 0) RETURNING id",
                (self.workspace, sig_key, digest, len(data), emb.tobytes(), meta_json, data, now, now)).fetchone()[0]
            entry_id = int(entry_id)
            conn.execute("UPDATE chorus_workspaces SET n_entries = n_entries + 1, n_bytes = n_bytes + %s "
                         "WHERE name=%s", (len(data), self.workspace))
            seq = self._log(conn, [("a", entry_id)])[0]
            changes = [(seq, "a", entry_id, sig_key, digest, len(data), emb.tobytes())]
            changes += self._evict(conn, protect=entry_id)
            _crash_hook("before_commit")
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, self.workspace))
        self._apply(changes)
        return entry_id, True

    def _log(self, conn, ops) -> list[int]:
        """Append changes ``[(op, entry_id)]`` (caller holds the workspace row lock); returns seqs."""
        if not ops:
            return []
        last = int(conn.execute("UPDATE chorus_workspaces SET seq = seq + %s WHERE name=%s RETURNING seq",
                                (len(ops), self.workspace)).fetchone()[0])
        seqs = list(range(last - len(ops) + 1, last + 1))
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
        if reason is not None:
            conn.execute("INSERT INTO chorus_quarantine(workspace, entry_id, reason, time, sig_key, meta_json, data) "
                         "SELECT workspace, id, %s, %s, sig_key, meta_json, data FROM chorus_entries "
                         "WHERE workspace=%s AND id = ANY(%s)", (reason, time.time(), self.workspace, ids))
        rows = conn.execute("DELETE FROM chorus_entries WHERE workspace=%s AND id = ANY(%s) RETURNING id, nbytes",
                            (self.workspace, ids)).fetchall()
        if not rows:
            return []
        conn.execute("UPDATE chorus_workspaces SET n_entries = n_entries - %s, n_bytes = n_bytes - %s WHERE name=%s",
                     (len(rows), sum(int(r[1]) for r in rows), self.workspace))
        removed = sorted(int(r[0]) for r in rows)
        seqs = self._log(conn, [("r", i) for i in removed])
        return [(s, "r", i, None, None, None, None) for s, i in zip(seqs, removed)]

    def _evict(self, conn, protect=None, max_bytes=None, max_entries=None) -> list:
        row = conn.execute("SELECT n_entries, n_bytes, max_bytes, max_entries, eviction FROM chorus_workspaces "
                           "WHERE name=%s", (self.workspace,)).fetchone()
        count, total, cap_bytes, cap_entries, policy = int(row[0]), int(row[1]), int(row[2]), int(row[3]), row[4]
        cap_bytes = cap_bytes if max_bytes is None else int(max_bytes)
        cap_entries = cap_entries if max_entries is None else int(max_entries)
        if total <= cap_bytes and (not cap_entries or count <= cap_entries):
            return []
        order = "last_used, id" if policy != "lfu" else "hits, last_used, id"
        candidates = conn.execute(
            "SELECT id, nbytes FROM chorus_entries WHERE workspace=%s AND id <> %s ORDER BY " + order + " LIMIT %s",
            (self.workspace, -1 if protect is None else int(protect), count)).fetchall()
        victims = []
        for entry_id, nbytes in candidates:
            if total <= cap_bytes and (not cap_entries or count <= cap_entries):
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
        self._apply(changes)
        return changes

    def remove(self, entry_id: int) -> bool:
        """Delete an entry fleet-wide; returns whether it existed."""
        changes = self._call(self._locked_tx, lambda conn: self._delete(conn, [entry_id]))
        return bool(changes)

    def _quarantine(self, entry_id: int, reason: str) -> None:
        LOG.error("quarantining fleet entry %d of %s: %s", entry_id, self.workspace, reason)
        self._call(self._locked_tx, lambda conn: self._delete(conn, [entry_id], reason=reason))
        self._tier_drop(entry_id)

    def prune(self, *, max_bytes: int | None = None, max_entries: int | None = None) -> list[int]:
        """Evict (by the workspace policy) down to the given or stored limits; trims the change log
        of changes older than a week; returns removed ids."""
        def body(conn):
            changes = self._evict(conn, max_bytes=max_bytes, max_entries=max_entries)
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
        row = self._call(lambda conn: conn.execute(
            "SELECT max_bytes, max_entries, eviction FROM chorus_workspaces WHERE name=%s",
            (self.workspace,)).fetchone())
        return {"max_bytes": int(row[0]), "max_entries": int(row[1]) or None, "eviction": row[2]}

    def set_limits(self, *, max_bytes: int | None = None, max_entries: int | None = None,
                   eviction: str | None = None) -> None:
        """Store the fleet-wide cap (``max_entries=0``: no entry cap) and the eviction policy; every
        worker applies it at its next write."""
        check_limits(max_bytes, max_entries, eviction)

        def tx(conn):
            with conn.transaction():
                conn.execute("UPDATE chorus_workspaces SET max_bytes = COALESCE(%s, max_bytes), "
                             "max_entries = COALESCE(%s, max_entries), eviction = COALESCE(%s, eviction) "
                             "WHERE name=%s", (max_bytes, max_entries, eviction, self.workspace))

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
        right sha256, else fetched from PostgreSQL (and kept in the tier). Raises ``KeyError``
        (unknown id), :class:`CorruptEntryError` (damaged row, now quarantined) or
        :class:`StoreUnavailableError` (not in the tier and PostgreSQL unreachable)."""
        entry_id = int(entry_id)
        with self._mutex:
            known = self._known.get(entry_id)
        data = None
        if known is not None:
            data = self._tier_get(entry_id, known[1])
        if data is None:
            row = self._call(self._fetch, entry_id)
            if row is None:
                raise KeyError(f"no entry {entry_id} in fleet workspace {self.workspace}")
            sig_key, digest, emb, data = row
            if known is not None and known[1] != digest:
                self._quarantine(entry_id, "row sha256 differs from the one its change announced")
                raise CorruptEntryError(f"entry {entry_id}: row changed after it was written (quarantined)")
            if hashlib.sha256(data).hexdigest() != digest:
                self._quarantine(entry_id, "sha256 mismatch")
                raise CorruptEntryError(f"entry {entry_id}: checksum mismatch (quarantined)")
            masks, meta = self._decode(entry_id, data, packed, sig_key, emb)
            self._tier_put(entry_id, digest, data)
        else:
            masks, meta = self._decode(entry_id, data, packed, known[0], None)
        if touch:
            try:
                self.touch(entry_id)
            except StoreError as exc:  # the entry is good; only its hit was not counted (store contract)
                LOG.warning("fleet entry %d: hit not counted (%s)", entry_id, exc)
        return masks, meta

    def _fetch(self, conn, entry_id):
        with conn.cursor(binary=True) as cur:
            cur.execute("SELECT sig_key, sha256, embedding, data FROM chorus_entries WHERE id=%s AND workspace=%s",
                        (entry_id, self.workspace))
            row = cur.fetchone()
        if row is None:
            return None
        return row[0], row[1], bytes(row[2]), bytes(row[3])

    def _decode(self, entry_id, data, packed, sig_key, row_emb):
        try:
            masks, emb, meta = decode_entry(data, packed=packed)
            if not isinstance(meta.get("signature"), dict) or signature_key(meta["signature"]) != sig_key:
                raise EntryFormatError("the entry's signature does not match its row")
            if row_emb is not None and emb.numpy().tobytes() != row_emb:
                raise EntryFormatError("the entry's embedding does not match its row")
        except (EntryFormatError, ValueError, TypeError) as exc:
            self._quarantine(entry_id, f"undecodable: {exc}")
            raise CorruptEntryError(f"entry {entry_id}: {exc} (quarantined)") from exc
        return masks, meta

    def touch(self, entry_id: int) -> None:
        """Count a hit fleet-wide (``hits += 1``, ``last_used = now``)."""
        self._call(lambda conn: conn.execute(
            "UPDATE chorus_entries SET hits = hits + 1, last_used = %s WHERE id = %s AND workspace = %s",
            (time.time(), int(entry_id), self.workspace)))

    def entries(self) -> list[dict]:
        """One dict per entry (id, sig_key, nbytes, hits, created, last_used, meta), in id order."""
        rows = self._call(lambda conn: conn.execute(
            "SELECT id, sig_key, nbytes, hits, created, last_used, meta_json FROM chorus_entries "
            "WHERE workspace=%s ORDER BY id", (self.workspace,)).fetchall(), deadline=60)
        out = []
        for r in rows:
            try:
                meta = json.loads(r[6])
                meta = meta if isinstance(meta, dict) else {"unreadable": "not a JSON object"}
            except ValueError:
                meta = {"unreadable": "not JSON"}
            out.append({"id": r[0], "sig_key": r[1], "nbytes": r[2], "hits": r[3], "created": r[4],
                        "last_used": r[5], "meta": meta})
        return out

    def quarantined(self) -> list[dict]:
        rows = self._call(lambda conn: conn.execute(
            "SELECT entry_id, reason, time FROM chorus_quarantine WHERE workspace=%s ORDER BY time",
            (self.workspace,)).fetchall())
        return [{"id": r[0], "file": None, "reason": r[1], "time": r[2]} for r in rows]

    def stats(self) -> dict:
        """Counts, bytes, hits, limits, index kinds, change-feed position, local tier, quarantine."""
        def q(conn):
            ws = conn.execute("SELECT seq, dim, n_entries, n_bytes, max_bytes, max_entries, eviction "
                              "FROM chorus_workspaces WHERE name=%s", (self.workspace,)).fetchone()
            hits, sigs = conn.execute("SELECT COALESCE(SUM(hits), 0), COUNT(DISTINCT sig_key) FROM chorus_entries "
                                      "WHERE workspace=%s", (self.workspace,)).fetchone()
            return ws, int(hits), int(sigs)

        ws, hits, sigs = self._call(q, deadline=60)
        with self._mutex:
            kinds = self._index.kinds() if self._index is not None else {}
            indexed, applied = len(self._known), self._seq
        building = self._building is not None and self._building.is_alive()
        tier_files, tier_bytes = self._tier_usage()
        return {
            "path": f"{self.url} workspace {self.workspace}", "store": "fleet", "workspace": self.workspace,
            "entries": int(ws[2]), "bytes": int(ws[3]), "hits": hits, "signatures": sigs,
            "dim": ws[1], "generation": int(ws[0]), "feed_seq": applied,
            "limits": {"max_bytes": int(ws[4]), "max_entries": int(ws[5]) or None, "eviction": ws[6]},
            "index": kinds, "index_building": building, "indexed": indexed, "quarantined": self.quarantined(),
            "local_tier": {"path": str(self.tier_dir), "files": tier_files, "bytes": tier_bytes,
                           "max_bytes": self.tier_bytes},
        }

    # -- maintenance ------------------------------------------------------------------------
    def rebuild_index(self, progress: bool = False) -> dict:
        """Reload this worker's index from PostgreSQL (waiting for the approximate partitions);
        returns its kinds per signature."""
        self._call(self._full_load, deadline=FEED_DEADLINE_S)
        self.wait_index()
        with self._mutex:
            return self._index.kinds() if self._index is not None else {}

    def verify(self, progress: bool = False) -> dict:
        """Check every row (sha256, decodes, embedding and signature match the row), quarantine
        the damaged ones, clean the local tier (temporary files, files of removed entries, files
        whose bytes differ from their row) and check that the index holds exactly the live
        entries."""
        def scan(conn):
            bad, checked, live = [], 0, {}
            with conn.transaction():
                with conn.cursor(name=f"chorus_verify_{uuid.uuid4().hex[:8]}", binary=True) as cur:
                    cur.itersize = 16
                    cur.execute("SELECT id, sig_key, sha256, embedding, data FROM chorus_entries WHERE workspace=%s "
                                "ORDER BY id", (self.workspace,))
                    for entry_id, sig_key, digest, emb, data in cur:
                        checked += 1
                        data, emb = bytes(data), bytes(emb)
                        live[int(entry_id)] = digest
                        if hashlib.sha256(data).hexdigest() != digest:
                            bad.append((int(entry_id), "sha256 mismatch"))
                            continue
                        try:
                            _, e, meta = decode_entry(data, packed=True)
                            if not isinstance(meta.get("signature"), dict) or signature_key(meta["signature"]) != sig_key:
                                raise EntryFormatError("the entry's signature does not match its row")
                            if e.numpy().tobytes() != emb:
                                raise EntryFormatError("the entry's embedding does not match its row")
                        except (EntryFormatError, ValueError, TypeError) as exc:
                            bad.append((int(entry_id), f"undecodable: {exc}"))
            return bad, checked, live

        bad, checked, live = self._call(scan, deadline=3600)
        damaged = []
        for entry_id, reason in bad:
            self._quarantine(entry_id, reason)
            damaged.append({"id": entry_id, "file": None, "reason": reason})
            live.pop(entry_id, None)
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
        self.sync()
        with self._mutex:
            indexed = set(self._known)
            index_ids = set(self._index.where) if self._index is not None else set()
        return {"checked": checked, "damaged": damaged, "ok": not damaged,
                "index_consistent": indexed == set(live) and index_ids == set(live),
                "temp_files_removed": temps, "orphans_removed": orphans}

    # -- local tier -------------------------------------------------------------------------
    def _tier_path(self, entry_id: int, digest: str) -> Path:
        return self.tier_dir / f"{int(entry_id)}-{digest}.safetensors"

    def _tier_get(self, entry_id: int, digest: str) -> bytes | None:
        path = self._tier_path(entry_id, digest)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != digest:
            LOG.warning("local tier file %s is damaged; fetching entry %d again", path.name, entry_id)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # LRU order of the tier
        except OSError:
            pass
        return data

    def _tier_put(self, entry_id: int, digest: str, data: bytes) -> None:
        if len(data) > self.tier_bytes:
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
        for p in self.tier_dir.glob(f"{int(entry_id)}-*.safetensors"):
            p.unlink(missing_ok=True)


def _tier_name(name: str):
    m = re.fullmatch(r"(\d+)-([0-9a-f]{64})\.safetensors", name)
    return (int(m.group(1)), m.group(2)) if m else (None, None)


def _crash_hook(phase: str) -> None:
    """Test seam: called at ``before_commit`` (inside the write transaction) and ``committed``."""
