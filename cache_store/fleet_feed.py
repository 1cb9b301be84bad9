"""The fleet store's change feed: how each worker's in-memory index follows PostgreSQL.

Each worker keeps a faiss :class:`~chorus.cache_store.index.PartitionedIndex` of the workspace:
an initial load (one consistent snapshot of the entries and the sequence number; exact partitions
at once, large ones rebuilt as HNSW in a background thread and swapped in, so a new worker serves
while the slow build runs), then the change log (``chorus_changes``) after each
``NOTIFY chorus_changes`` (a listener thread with its own connection) and every ``POLL_S``
seconds; after a reconnect it catches up from the last sequence number it applied (a full reload
when the log was trimmed past it). Writers append to the log under the workspace row lock
(:meth:`FleetFeed._log`), so the sequence numbers of a workspace are committed in order and
catching up by sequence number never skips a change. The feed applies only changes up to the
workspace's own sequence number, contiguously (a gap, a sequence number that went backwards or a
changed dimension is a full reload); change rows found past that number are deleted by the next
writer. Rows that fail :func:`~chorus.cache_store.fleet_schema.check_row` are quarantined (met by a
writer catching up inside its own transaction: after that transaction ends, never inside it); none
stops the feed. A reload during which another thread of the handle applied changes is not installed.

:class:`FleetFeed` is a part of :class:`~chorus.cache_store.fleet.FleetStore` (a mixin): it keeps
the handle's ``_index``, ``_known`` (id -> sig_key, sha256, nbytes), ``_dim`` and ``_seq`` under
``_mutex``, opens its connections through ``_conns`` and quarantines through ``_quarantine``
(``fleet_maintenance.py``). Tested in ``tests/test_fleet_store.py`` (feed within 1 s both ways, listener
reconnect and late worker, exact then HNSW) and ``tests/test_fleet_hostile.py`` (the feed's
position, gaps, hostile rows).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

import numpy as np

from .errors import StoreError
from .fleet_conn import psycopg_module
from .fleet_schema import Row, check_row, emb_params, row_columns
from .index import PartitionedIndex
from .pg_errors import first_line
from .redaction import RedactingFilter, redact
from .rows import MAX_EMBEDDING_DIM, QUIET_FLOATS, check_dim

LOG = logging.getLogger(__name__)
LOG.addFilter(RedactingFilter())

CHANNEL = "chorus_changes"
POLL_S = 2.0
FEED_DEADLINE_S = 300.0  # the listener's catch-ups (a background thread; a full load of 100k entries)
FULL_LOAD_TIMEOUT_MS = 300_000
CATCH_UP_BATCH = 5000
CATCH_UP_BATCH_BYTES = 64 << 20  # embeddings fetched per batch at most
FLAT_ONLY = 1 << 62  # approx_threshold of the exact index a worker serves from while it builds HNSW


class FleetFeed:
    """The change-feed part of a fleet store handle (see the module docstring)."""

    def _in_snapshot(self, conn, body, statement_timeout_ms: int | None = None):
        """Run ``body(conn)`` in one consistent read-only snapshot (a REPEATABLE READ transaction, with
        ``statement_timeout_ms`` for its statements when given) unless ``conn`` is inside a transaction
        already (a writer's, which holds the workspace row lock: nothing can change between its
        statements; its own statement timeout stays)."""
        psycopg = psycopg_module()
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            return body(conn)
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            if statement_timeout_ms is not None:
                conn.execute("SELECT set_config('statement_timeout', %s, true)", (str(statement_timeout_ms),))
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
        self._in_snapshot(conn, self._load_rows, FULL_LOAD_TIMEOUT_MS)

    def _load_rows(self, conn) -> None:
        row = conn.execute("SELECT seq, dim FROM chorus_workspaces WHERE name=%s", (self.workspace,)).fetchone()
        seq, dim = (int(row[0]), self._workspace_dim(row[1])) if row else (0, None)
        with self._mutex:
            set_aside, started_at = set(self._set_aside), self._seq
        good, bad = [], []
        if dim is not None:
            with conn.cursor(binary=True) as cur, np.errstate(**QUIET_FLOATS):
                cur.execute(f"SELECT {row_columns(embedding=True)} FROM chorus_entries e WHERE e.workspace = %(ws)s "
                            "ORDER BY e.id", {"ws": self.workspace, **emb_params(dim)})
                while True:
                    batch = cur.fetchmany(batch_rows(dim))
                    if not batch:
                        break
                    for values in batch:
                        candidate = Row(*values)
                        if candidate.id in set_aside:
                            continue
                        try:
                            vec = check_row(candidate, dim, embedding=True)
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
            if self._seq != started_at:  # another thread of this handle applied changes meanwhile, perhaps newer
                LOG.info("fleet workspace %s: a reload read at %d while changes up to %d were applied; not "
                         "installed (the next catch-up reloads if it still must)", self.workspace, seq, self._seq)
                return
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

    @staticmethod
    def _index_add(index: PartitionedIndex, rows) -> None:
        """Index ``(id, sig_key, sha256, nbytes, vector)`` rows not indexed yet."""
        index.add_rows((entry_id, sig_key, vec) for entry_id, sig_key, _, _, vec in rows
                       if entry_id not in index.where)

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
                    f"SELECT c.seq, c.op, c.entry_id, {row_columns(embedding=True)} FROM chorus_changes c "
                    "LEFT JOIN chorus_entries e ON c.op = 'a' AND e.id = c.entry_id AND e.workspace = c.workspace "
                    "WHERE c.workspace = %(ws)s AND c.seq > %(after)s AND c.seq <= %(upto)s ORDER BY c.seq "
                    "LIMIT %(batch)s",
                    {"ws": self.workspace, "after": position, "upto": workspace_seq, "batch": batch_rows(dim),
                     **emb_params(dim)})
                changes = [(v[0], v[1], v[2], Row(*v[3:]) if v[3] is not None else None) for v in cur.fetchall()]
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
        """Apply ``(seq, op, entry_id, Row or None)`` changes in order (those at or below the
        applied sequence number are skipped: the feed and writers both apply); ``dim``: the
        workspace row's embedding dimension. A row that fails :func:`check_row` is quarantined."""
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
                    vec = check_row(row, dim, embedding=True)
                except ValueError as exc:
                    bad.append((entry_id, str(exc)))
                    continue
                if self._index is None:
                    self._index = PartitionedIndex(dim, self._approx_threshold)
                self._dim = dim
                self._index_add(self._index, [(entry_id, row.sig_key, row.sha256, row.nbytes, vec)])
                self._known[entry_id] = (row.sig_key, row.sha256, int(row.nbytes))
        for entry_id in gone:
            self.tier.drop(entry_id)
        self._quarantine_all(bad)

    def _quarantine_all(self, bad) -> None:
        """Quarantine damaged rows the feed met. Met by a writer catching up inside its own transaction, they are
        set aside now and quarantined once that transaction has ended (:meth:`_in_write_transaction`): a
        quarantine inside it would be rolled back with it, after this handle had applied its change (its feed
        position past the workspace's, the change committed next at that number never applied)."""
        local = self._writer_tx
        if getattr(local, "depth", 0):
            for entry_id, _ in bad:
                self._set_aside_entry(entry_id)
            local.deferred.extend(bad)
            return
        for entry_id, reason in bad:
            self._quarantine(entry_id, reason)

    @contextmanager
    def _in_write_transaction(self):
        """Mark this thread's write transaction on this handle (entered around ``conn.transaction()``): the
        quarantines the feed meets inside it wait until the outermost one has ended (committed or rolled back)."""
        local = self._writer_tx
        local.depth = getattr(local, "depth", 0) + 1
        if local.depth == 1:
            local.deferred = []
        try:
            yield
        finally:
            local.depth -= 1
            if local.depth == 0 and local.deferred:
                deferred, local.deferred = local.deferred, []
                with self._mutex:
                    self._set_aside.difference_update(entry_id for entry_id, _ in deferred)
                self._quarantine_all(deferred)

    def _listen_loop(self) -> None:
        """LISTEN on the change channel; catch up on each notification and every POLL_S seconds;
        on a lost connection, reconnect with backoff and catch up from the last sequence number."""
        psycopg = psycopg_module()
        backoff = 0.2
        while not self._stop.is_set():
            conn = None
            try:
                conn = self._conns.connect("feed", read_only=True)
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
                    LOG.debug("fleet change feed of %s: %s", self.workspace, redact(first_line(exc), self._conns.secrets))
            except Exception as exc:  # noqa: BLE001 - the feed must keep running
                LOG.warning("fleet change feed of %s: %s", self.workspace, redact(repr(exc), self._conns.secrets))
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
        return self._conns.call(self._catch_up, read=True)

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


def batch_rows(dim: int | None) -> int:
    """Rows per fetch of the feed and the full load: at most CATCH_UP_BATCH_BYTES of embeddings."""
    return max(1, min(CATCH_UP_BATCH, CATCH_UP_BATCH_BYTES // (4 * (dim or MAX_EMBEDDING_DIM))))
