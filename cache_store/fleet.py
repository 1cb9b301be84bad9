"""The fleet store: one cache shared by many ComfyUI workers on many hosts, through PostgreSQL.

Chosen by ``CHORUS_CACHE_URL=postgresql://...`` (see :func:`chorus.cache_store.protocol.open_store`);
it implements the store protocol of ``protocol.py`` like :class:`~chorus.cache_store.Workspace`.

Where things live, and the module of each concern:

* **PostgreSQL**, the source of truth: the tables and the one check of the rows read back from
  them (``fleet_schema.py``), reached through a handle's connections (``fleet_conn.py``).
* **Each worker's memory**: a faiss index of the workspace, fed by the change log
  (``fleet_feed.py``: a snapshot at open, then ``LISTEN/NOTIFY`` and a 2 s poll, catching up by
  sequence number after a reconnect). Searches never touch the network.
* **A local disk tier** under the cache root (``<CHORUS_CACHE_DIR>/<workspace>/fleet_tier/``,
  ``fleet_tier.py``, no-follow I/O of ``safe_fs.py``): the entry files of this worker's recent
  loads and writes, so that a hit fetches an entry from PostgreSQL at most once per host.
* Deletion, quarantine, eviction, prune and verify: ``fleet_maintenance.py``.

Connections: a handle holds one connection for writes (entries, removals, limits, quarantine, hit
counts), one for reads (loads, listings, stats, catch-ups; a read-only session) and the
listener's; ``verify`` scans on a connection of its own. So a load never queues behind another
thread's write on the same handle, and a hit counted by ``load`` never waits for this handle's write
connection: when it is busy that instant the hit stays pending and is counted with the next write,
``touch`` or ``close``. The count's UPDATE can still wait on another session's lock of the same row
(a worker writing that entry's run stats), at most ``lock_timeout``; the hit then stays pending too.

Writes (:meth:`FleetStore.add_unique`): encode the entry (``entries.py``, as a one-host
workspace does), then one transaction: lock the workspace row (``SELECT ... FOR UPDATE``, waiting
at most ``lock_timeout``), catch up with the change log (every earlier writer has committed),
search for an entry that already serves the request (then nothing is written), insert the row,
append the change, evict down to the fleet-wide cap (more changes), ``pg_notify``, commit. An
entry is therefore visible whole or not at all, on every worker.

Loads check each row and its bytes (``fleet_schema.entry_problem``); a row that fails is
quarantined fleet-wide (``fleet_maintenance.py``) and a load raises
:class:`~chorus.cache_store.CorruptEntryError`; it never stops an open, the feed or a listing. What
a compromised worker can still do: docs/OPERATIONS.md, "What a compromised worker can do".

Bounded waits (the store contract of ``errors.py``): ``lock_timeout`` is the time bound
(``CHORUS_CACHE_TIMEOUT``, 2 s by default), also the longest a call waits for another thread of
this process using the same connection; the other timeouts and the client-side deadline are
``fleet_conn.py``'s. The engine turns each error into a miss (dense attention) or a write not
made, with a message. The next call reconnects.

Opening: a worker (``create=True``, the default) creates the tables if missing (needs CREATE on
the schema the first time only) and registers its workspace; ``create=False`` (the command line's
maintenance commands) refuses a database or workspace that does not exist, creating nothing;
``readonly=True`` (``cache stats``, ``cache list``, ``cache verify`` without ``--repair``) also
refuses, and then writes nothing at all: its sessions are read-only, damaged rows are reported but
not quarantined, hits are not counted and no local tier file or folder is made.

Security: credentials are never logged or put in a message (``redaction.py``); every statement is
parameterised (table names are constants); URL options such as ``sslmode`` pass through to libpq
unchanged.

Tests: ``tests/test_fleet_store.py`` (protocol, feed, dedupe, quarantine, local tier, credentials,
bounded waits, SIGKILLed server, read-only opening), ``tests/test_fleet_hostile.py`` (hostile rows,
SQLSTATE mapping, reads beside writes), ``tests/test_fleet_serving.py`` (real ComfyUI servers).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path

from . import seams
from .entries import (COUNTED, RUN_COUNTERS, CorruptEntryError, NewEntry, PendingHits, checked_entry_id,
                      counted_increments, encode_new_entry, run_counts, search_index, serving_entry,
                      similarity_bound)
from .entry_format import decode_entry
from .errors import StoreBusyError, StoreError, store_timeout
from .fleet_conn import CALL_DEADLINE_S, Connections
from .fleet_feed import CHANNEL, FEED_DEADLINE_S, POLL_S, FleetFeed
from .fleet_maintenance import FleetMaintenance
from .fleet_schema import Row, check_row, decoded_entry, emb_params, entry_problem, own_row, row_columns, run_columns, \
    setup
from .fleet_tier import TIER_DIR, LocalTier, tier_bytes_setting
from .index import DEFAULT_APPROX_THRESHOLD, PartitionedIndex
from .limits import check_limits, stored_limits_shown
from .redaction import RedactingFilter
from .rows import row_meta

LOG = logging.getLogger(__name__)
LOG.addFilter(RedactingFilter())


class FleetStore(FleetFeed, FleetMaintenance):
    """The fleet store of one workspace (see the module docstring). Use :meth:`open`.

    Thread-safe within a process. ``len(store)``, ``entry_id in store`` and :meth:`search` answer
    from this worker's index (as fresh as its change feed); everything else asks PostgreSQL.
    """

    def __init__(self, url: str, workspace: str, local_path: Path, *, tier_bytes: int | None = None,
                 approx_threshold: int = DEFAULT_APPROX_THRESHOLD, listen: bool = True, timeout=None,
                 readonly: bool = False):
        self.timeout = store_timeout(timeout)  # the longest wait for another worker (the row lock) or thread
        from .paths import check_not_in_pack, validate_workspace_name

        self.workspace = validate_workspace_name(workspace)
        self.readonly = bool(readonly)
        self._conns = Connections(url, self.workspace, timeout=self.timeout, readonly=self.readonly)
        self.url = self._conns.url  # safe to show
        self.path = check_not_in_pack(Path(local_path))
        self.tier = LocalTier(self.path / TIER_DIR, tier_bytes_setting(tier_bytes), readonly=self.readonly)
        self._approx_threshold = int(approx_threshold)
        self._mutex = threading.RLock()  # index, known rows, seq, set-aside ids
        self._index: PartitionedIndex | None = None
        self._known: dict[int, tuple[str, str, int]] = {}  # id -> (sig_key, sha256, nbytes)
        self._set_aside: set[int] = set()  # damaged rows this handle could not quarantine (read-only or busy)
        self._pending = PendingHits()  # hits (and their run stats) not written yet: connection busy or gone
        self._run_stats = False  # whether chorus_entries has the run stats columns (fleet_schema.run_columns)
        self._dim: int | None = None
        self._bad_dim_logged = None  # the invalid dimension last logged (_workspace_dim)
        self._seq = -1  # last change applied; -1: never loaded
        self._closed = False
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None
        self._listen = listen
        self._build_token = None
        self._building: threading.Thread | None = None
        self._writer_tx = threading.local()  # per thread: the depth of this handle's write transactions open

    @property
    def tier_dir(self) -> Path:
        """The local tier's folder (``<local_path>/fleet_tier``)."""
        return self.tier.path

    @property
    def tier_bytes(self) -> int:
        """The local tier's byte cap."""
        return self.tier.max_bytes

    # -- this worker's view -----------------------------------------------------------------
    @property
    def feed_seq(self) -> int:
        """The last change of the log this worker applied (-1 before the first load)."""
        with self._mutex:
            return self._seq

    @property
    def dim(self) -> int | None:
        """The workspace's embedding dimension as this worker last read it (None: unset or invalid)."""
        with self._mutex:
            return self._dim

    def known_ids(self) -> list[int]:
        """The ids this worker serves (its feed applied them; set-aside rows left out), sorted."""
        with self._mutex:
            return sorted(self._known)

    def index_ids(self) -> list[int]:
        """The ids in this worker's faiss index, sorted (equal to :meth:`known_ids` between changes)."""
        with self._mutex:
            return sorted(self._index.where) if self._index is not None else []

    def index_kinds(self) -> dict:
        """This worker's index kind per signature (``flat`` / ``hnsw``), without asking PostgreSQL."""
        with self._mutex:
            return self._index.kinds() if self._index is not None else {}

    def __contains__(self, entry_id) -> bool:
        with self._mutex:
            return int(entry_id) in self._known

    def with_connection(self, fn, *args, read: bool = False, deadline: float = CALL_DEADLINE_S):
        """``fn(conn, *args)`` on this handle's write connection (``read``: its read-only one), with
        the store's bounded waits and errors (``fleet_conn.Connections.call``): for tests and
        benchmarks that need SQL of their own; the store's tables are changed only by its methods."""
        return self._conns.call(fn, *args, read=read, deadline=deadline)

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
            store._conns.call(setup, store.workspace, store.url, creating, read=not creating)
            store._run_stats = store._conns.call(run_columns, not readonly, read=readonly)
            if not store._run_stats and not readonly:
                LOG.warning("fleet workspace %s: chorus_entries has no run stats columns and this role may not add "
                            "them; hits are counted without their run stats (docs/OPERATIONS.md, Fleet)", workspace)
            if max_bytes is not None or max_entries is not None or eviction is not None:
                store.set_limits(max_bytes=max_bytes, max_entries=max_entries, eviction=eviction)
            store._conns.call(store._full_load, deadline=FEED_DEADLINE_S, read=True)
        except BaseException:
            store.close()
            raise
        store.tier.remove_temps()
        if listen:
            store._listener = threading.Thread(target=store._listen_loop, name=f"chorus-fleet-{workspace}",
                                               daemon=True)
            store._listener.start()
        LOG.info("fleet store %s workspace %s: %d entries, seq %d%s", store.url, workspace, len(store), store._seq,
                 " (read-only)" if readonly else "")
        return store

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (a closed handle is opened anew, never reused)."""
        return self._closed

    def close(self) -> None:
        """Count pending hits (within the time bound), stop the listener and close the
        connections (the local tier stays)."""
        if self._closed:
            return
        if self._pending and not self.readonly:
            try:
                self._flush_hits()
            except StoreError as exc:  # hit counts steer eviction only
                LOG.warning("%d hits of fleet workspace %s not counted: %s", self._pending.hits, self.workspace, exc)
        self._closed = self._conns.closed = True
        self._build_token = None  # a background index build stops at its swap
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=POLL_S + CALL_DEADLINE_S)
        self._conns.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"FleetStore({self.url!r}, workspace={self.workspace!r})"

    def __len__(self) -> int:
        with self._mutex:
            return len(self._known)

    # -- writing ----------------------------------------------------------------------------
    def add(self, embedding, masks: dict, meta: dict) -> int:
        """Store one entry fleet-wide; returns its id. Same input rules as :meth:`Workspace.add`."""
        return self._add(embedding, masks, meta, None)[0]

    def add_unique(self, embedding, masks: dict, meta: dict, *, min_similarity: float,
                   replacing: int | None = None) -> tuple[int, bool]:
        """Like :meth:`add` unless an entry of the same signature with cosine >= ``min_similarity``
        exists fleet-wide (checked under the workspace row lock after catching up): then
        ``(that id, False)``. Each miss is thus written once across all workers. ``replacing``: an
        entry that does not count as serving the request (as :meth:`Workspace.add_unique`)."""
        return self._add(embedding, masks, meta, similarity_bound(min_similarity), replacing)

    def _add(self, embedding, masks, meta, min_similarity, replacing=None):
        self._conns.check_writable()
        new = encode_new_entry(embedding, masks, meta)  # the same checks and bytes as a one-host workspace
        return self.add_entry(new, min_similarity=min_similarity, replacing=replacing)

    def add_entry(self, new: NewEntry, *, min_similarity: float | None = None, replacing: int | None = None,
                  keep_local: bool = True) -> tuple[int, bool]:
        """Commit an entry already checked and encoded by :func:`~chorus.cache_store.entries.encode_new_entry`
        (what :meth:`add` and :meth:`add_unique` do after encoding; the fleet benchmark times it
        alone): ``(entry id, created)``, deduplicated as :meth:`add_unique` when
        ``min_similarity`` is given. ``keep_local``: also keep the bytes in the local tier."""
        entry_id, created = self._conns.call(self._add_tx, new, min_similarity, replacing)
        seams.fleet_phase("committed")
        if created and keep_local:
            self.tier.put(entry_id, new.digest, new.data)
        if self._pending:
            self._count_pending_hits()
        return entry_id, created

    def _add_tx(self, conn, new, min_similarity, replacing=None):
        emb = new.embedding
        with self._in_write_transaction(), conn.transaction():
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
                    served = serving_entry(self._index, emb, new.sig_key, min_similarity, replacing)
                if served is not None:
                    return served, False
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
            changes = [(seq, "a", entry_id, own_row(entry_id, new))]
            changes += self._evict(conn, protect=entry_id)
            seams.fleet_phase("before_commit")
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, self.workspace))
        self._apply(changes, emb.size)
        return entry_id, True

    def remove(self, entry_id: int) -> bool:
        """Delete an entry fleet-wide; returns whether it existed (``ValueError`` for an id that is not an int)."""
        try:
            entry_id = checked_entry_id(entry_id)
        except KeyError:
            return False
        self._conns.check_writable()
        changes = self._conns.call(self._locked_tx, lambda conn: self._delete(conn, [entry_id]))
        return bool(changes)

    def limits(self) -> dict:
        """The stored limits (``max_entries`` None: no entry cap); ``ValueError`` when the
        workspace row holds limits that are not valid."""
        row = self._conns.call(lambda conn: conn.execute(
            "SELECT max_bytes, max_entries, eviction FROM chorus_workspaces WHERE name=%s",
            (self.workspace,)).fetchone(), read=True)
        return stored_limits_shown(row[0], row[1], row[2])

    def set_limits(self, *, max_bytes: int | None = None, max_entries: int | None = None,
                   eviction: str | None = None) -> None:
        """Store the fleet-wide cap (``max_entries=0``: no entry cap) and the eviction policy; every
        worker applies it at its next write. ``ValueError`` for limits ``limits.check_limits``
        refuses."""
        self._conns.check_writable()
        valid = check_limits(max_bytes, max_entries, eviction)

        def tx(conn):
            with conn.transaction():
                conn.execute("UPDATE chorus_workspaces SET max_bytes = COALESCE(%s, max_bytes), "
                             "max_entries = COALESCE(%s, max_entries), eviction = COALESCE(%s, eviction) "
                             "WHERE name=%s", (valid["max_bytes"], valid["max_entries"], valid["eviction"],
                                               self.workspace))

        self._conns.call(tx)

    # -- reading ----------------------------------------------------------------------------
    def search(self, embedding, k: int = 1, signature=None) -> list[tuple[int, float]]:
        """Top ``k`` ``(entry_id, cosine similarity)`` from this worker's index (no network)."""
        with self._mutex:
            return search_index(self._index, embedding, k, signature)

    def load(self, entry_id: int, *, packed: bool = False, touch: bool = True):
        """``(masks, meta)`` of an entry: from the local tier when it holds the entry with the
        right sha256, else fetched from PostgreSQL over the read connection (and kept in the tier).
        Never waits for a write of another thread of this handle: the hit (``touch``) is counted
        at once when the write connection is free, else with the next write, touch or close.
        Raises ``KeyError`` (unknown id), :class:`CorruptEntryError` (damaged row, now
        quarantined) or :class:`StoreUnavailableError` (not in the tier and PostgreSQL
        unreachable); ``ValueError`` for an id that is not an int."""
        entry_id = checked_entry_id(entry_id)
        with self._mutex:
            known = self._known.get(entry_id)
            set_aside = entry_id in self._set_aside
        if set_aside:
            raise CorruptEntryError(f"entry {entry_id} was found damaged earlier (quarantine pending)")
        data = self.tier.get(entry_id, known[1], known[2]) if known is not None else None
        if data is None:
            row, dim = self.fetch_row(entry_id)
            if row is None:
                raise KeyError(f"no entry {entry_id} in fleet workspace {self.workspace}")
            masks, meta = self._checked_entry(row, dim, packed, announced=known[1] if known else None)
            self.tier.put(entry_id, row.sha256, row.data)
        else:
            masks, meta = self._checked_entry(None, None, packed, tier=(entry_id, data, known[0]))
        if touch:
            self._count_hit(entry_id)
        return masks, meta

    def fetch_row(self, entry_id: int) -> tuple[Row | None, int | None]:
        """The row of ``entry_id`` as fetched (sizes guarded in SQL, nothing else checked: see
        :func:`~chorus.cache_store.fleet_schema.check_row`) and the workspace's embedding
        dimension; ``(None, None)`` for an unknown id. Over the read connection."""
        return self._conns.call(self._fetch, int(entry_id), read=True)

    def _fetch(self, conn, entry_id) -> tuple[Row | None, int | None]:
        with conn.cursor(binary=True) as cur:
            cur.execute(f"SELECT {row_columns(embedding=True, data=True)}, w.dim FROM chorus_entries e "
                        "JOIN chorus_workspaces w ON w.name = e.workspace WHERE e.id = %(id)s AND e.workspace = %(ws)s",
                        {"id": entry_id, "ws": self.workspace, **emb_params(None)})
            values = cur.fetchone()
        if values is None:
            return None, None
        return Row(*values[:-1]), self._workspace_dim(values[-1])

    def _checked_entry(self, row, dim, packed, *, announced=None, tier=None):
        """Check a fetched row (or ``tier=(entry_id, bytes, sig_key)`` read from the local tier,
        already matched to the row's sha256): ``(masks, meta)``, else quarantine and raise
        :class:`CorruptEntryError`."""
        decode = functools.partial(decode_entry, packed=packed)
        if tier is not None:
            entry_id, data, sig_key = tier
            result = decoded_entry(data, decode, sig_key, None)
        else:
            entry_id = int(row.id)
            if dim is None:  # the workspace row states no valid dimension: its entries are hidden, not damaged
                raise StoreError(f"fleet workspace {self.workspace} states no valid embedding dimension; entry "
                                 f"{entry_id} is not served until it does (nothing quarantined)")
            result = entry_problem(row, dim, decode, announced)
        if isinstance(result, str):
            self._quarantine(entry_id, result)
            raise CorruptEntryError(f"entry {entry_id}: {result} " +
                                    ("(read-only: not quarantined)" if self.readonly else "(quarantined)"))
        return result

    def _count_hit(self, entry_id: int) -> None:
        """Count a hit of ``load`` without waiting (see :meth:`load`)."""
        if self.readonly:
            return
        self._pending.add(entry_id)
        self._count_pending_hits()

    def _count_pending_hits(self) -> None:
        try:
            self._flush_hits(wait=False)
        except StoreBusyError:
            LOG.debug("fleet workspace %s: hits kept pending (the write connection is busy)", self.workspace)
        except StoreError as exc:  # the entry is good; only its hit waits (store contract)
            LOG.warning("fleet workspace %s: hits not counted yet (%s)", self.workspace, exc)

    def _flush_hits(self, wait: bool = True) -> None:
        """Write every pending hit and its run stats (without them where the table has no run stats
        columns) in one transaction on the write connection (waiting for another thread's use of it
        only when ``wait``); on any error they stay pending (:class:`~chorus.cache_store.entries.PendingHits`)."""
        columns = COUNTED if self._run_stats else COUNTED[:1]  # hits only: a table without run stats columns
        sets = counted_increments(columns, "%s")

        def tx(conn, batch):
            now = time.time()
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(f"UPDATE chorus_entries SET {sets}, last_used = %s WHERE id = %s AND workspace = %s",
                                [(*counts[:len(columns)], now, entry_id, self.workspace)
                                 for entry_id, counts in sorted(batch.items())])

        with self._pending.flushing() as batch:
            if batch:
                self._conns.call(tx, batch, wait=wait)

    def touch(self, entry_id: int, run=None) -> None:
        """Count a hit fleet-wide (``hits += 1``, ``last_used = now``) and ``run``'s stats (a mapping
        of some :data:`~chorus.cache_store.entries.RUN_COUNTERS` to counts, added to the entry's;
        ``ValueError`` for a bad one, nothing counted), with any hits :meth:`load` kept pending;
        raises ``StoreBusyError`` past the time bound (the hits stay pending). An id that is not an int
        is a ``ValueError``, an int no entry can have a ``KeyError``; nothing is counted then."""
        self._conns.check_writable()
        self._pending.add(checked_entry_id(entry_id), run_counts(run))
        self._flush_hits()

    def entries(self) -> list[dict]:
        """One dict per entry (id, sig_key, nbytes, hits, created, last_used, meta, runs: the summed run
        stats of its hits, 0 where the table has no run stats columns), in id order, read in one
        query. A row that fails :func:`check_row` is left out (one log line each); metadata that cannot
        be read (too large, too deep, not JSON) shows as ``{"unreadable": reason}``."""
        columns = row_columns(meta=True, runs=True, runs_in_table=self._run_stats)

        def q(conn):
            with conn.cursor(binary=True) as cur:
                cur.execute(f"SELECT {columns} FROM chorus_entries e WHERE e.workspace = %(ws)s ORDER BY e.id",
                            {"ws": self.workspace})
                return [Row(*values) for values in cur.fetchall()]

        out = []
        for row in self._conns.call(q, deadline=60, read=True):
            try:
                check_row(row, None)
            except ValueError as exc:
                LOG.warning("fleet entry %s of %s left out of the listing: %s", row.id, self.workspace, exc)
                continue
            out.append({"id": row.id, "sig_key": row.sig_key, "nbytes": row.nbytes, "hits": row.hits,
                        "created": row.created, "last_used": row.last_used, "meta": row_meta(row.meta_json, row.meta_len),
                        "runs": dict(zip(RUN_COUNTERS, row.runs))})
        return out

    def quarantined(self) -> list[dict]:
        rows = self._conns.call(lambda conn: conn.execute(
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

        ws, hits, sigs = self._conns.call(q, deadline=60, read=True)
        with self._mutex:
            kinds = self._index.kinds() if self._index is not None else {}
            indexed, applied = len(self._known), self._seq
        building = self._building is not None and self._building.is_alive()
        tier_files, tier_bytes = self.tier.usage()
        try:
            limits = stored_limits_shown(ws[4], ws[5], ws[6])
        except ValueError as exc:  # stats still answer for a workspace row edited badly
            limits = {"invalid": str(exc)}
        return {
            "path": f"{self.url} workspace {self.workspace}", "store": "fleet", "workspace": self.workspace,
            "entries": int(ws[2]), "bytes": int(ws[3]), "hits": hits, "signatures": sigs,
            "dim": ws[1], "generation": int(ws[0]), "feed_seq": applied, "readonly": self.readonly,
            "limits": limits, "index": kinds, "index_building": building, "indexed": indexed,
            "quarantined": self.quarantined(),
            "local_tier": {"path": str(self.tier.path), "files": tier_files, "bytes": tier_bytes,
                           "max_bytes": self.tier.max_bytes},
        }
