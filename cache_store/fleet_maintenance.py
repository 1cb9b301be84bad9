"""The fleet store's maintenance: deletion and quarantine, eviction and prune, verify, index reload.

Every change of the entries is one transaction holding the workspace row lock
(:meth:`FleetMaintenance._locked_tx`): catch up with the change log, delete (quarantining with the
reason when asked: the row moves to ``chorus_quarantine``, its text and bytes kept when of sizes
the store writes), append the ``r`` changes, notify, commit, then apply them to this worker's
index. Eviction is fleet-wide, by ``"lru"`` or ``"lfu"``, down to the workspace row's limits after
each write and to the targets of :meth:`prune` (which also trims the change log of changes older
than a week); limits that are not valid evict nothing (``limits.py``). On a read-only handle, or
when the store cannot be written within the time bound, a damaged entry is only set aside in this
handle and logged; the next writable handle that reads it quarantines it.

:class:`FleetMaintenance` is a part of :class:`~chorus.cache_store.fleet.FleetStore` (a mixin): it
uses the handle's connections (``_conns``), change log and feed (``_log``, ``_catch_up``,
``_apply``, ``sync``, ``_full_load``, ``wait_index``), index
state (``_mutex``, ``_index``, ``_known``, ``_set_aside``, ``_dim``) and local tier (``tier``).
Tested in ``tests/test_fleet_store.py`` (fleet-wide LRU cap, quarantine, verify, SIGKILL at random
moments) and ``tests/test_fleet_hostile.py`` (bad limits delete nothing, hostile rows).
"""

from __future__ import annotations

import logging
import time
import uuid

from .entries import MAX_ENTRY_FILE_BYTES
from .entry_format import MAX_META_BYTES, decode_entry_arrays
from .errors import StoreError
from .fleet_conn import Slot
from .fleet_feed import CHANNEL, FEED_DEADLINE_S
from .fleet_schema import Row, emb_params, entry_problem, row_columns
from .limits import eviction_caps, eviction_order, over_caps, pick_victims, prune_targets
from .redaction import RedactingFilter

LOG = logging.getLogger(__name__)
LOG.addFilter(RedactingFilter())

CHANGE_LOG_KEEP_S = 7 * 86400


class FleetMaintenance:
    """The maintenance part of a fleet store handle (see the module docstring)."""

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
        candidates = conn.execute(
            "SELECT id, nbytes FROM chorus_entries WHERE workspace=%s AND id <> %s ORDER BY "
            + eviction_order(policy) + " LIMIT %s",
            (self.workspace, -1 if protect is None else int(protect), count)).fetchall()
        victims = pick_victims(candidates, count, total, cap_bytes, cap_entries)
        if victims:
            LOG.info("evicting %d entries (%s) from fleet workspace %s", len(victims), policy, self.workspace)
        return self._delete(conn, victims)

    def _locked_tx(self, conn, body):
        """Run ``body(conn) -> changes`` in a transaction holding the workspace row lock, notify,
        commit, apply the changes locally; returns the changes."""
        with self._in_write_transaction(), conn.transaction():
            conn.execute("SELECT 1 FROM chorus_workspaces WHERE name=%s FOR UPDATE", (self.workspace,))
            self._catch_up(conn)
            changes = body(conn)
            if changes:
                conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, self.workspace))
        self._apply(changes, self._dim)
        return changes

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
            self._conns.call(self._locked_tx, lambda conn: self._delete(conn, [entry_id], reason=reason))
        except StoreError as exc:
            LOG.error("fleet entry %d of %s: quarantine deferred (%s)", entry_id, self.workspace, exc)
            self._set_aside_entry(entry_id)
            return
        self.tier.drop(entry_id)

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
        self._conns.check_writable()
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

        return [c[2] for c in self._conns.call(self._locked_tx, body)]

    def rebuild_index(self, progress: bool = False) -> dict:
        """Reload this worker's index from PostgreSQL (waiting for the approximate partitions);
        returns its kinds per signature."""
        self._conns.call(self._full_load, deadline=FEED_DEADLINE_S, read=True)
        self.wait_index()
        with self._mutex:
            return self._index.kinds() if self._index is not None else {}

    def verify(self, progress: bool = False) -> dict:
        """Check every row (:func:`check_row`, sha256, decodes, embedding and signature match the
        row) on a connection of its own, quarantine the damaged ones, clean the local tier
        (temporary files, files of removed entries, files whose bytes differ from their row) and
        check that the index holds exactly the live entries. Read-only handles report damage
        without quarantining and clean nothing (``cleanup_skipped`` says so). Rows this machine had not
        the memory to decode are listed under ``unchecked`` (left as they are: not damage)."""
        self.sync()

        def scan(conn):
            bad, unchecked, checked, live = [], [], 0, {}
            dim = conn.execute("SELECT dim FROM chorus_workspaces WHERE name=%s", (self.workspace,)).fetchone()
            dim = self._workspace_dim(dim[0]) if dim else None
            with conn.cursor(name=f"chorus_verify_{uuid.uuid4().hex[:8]}", binary=True) as cur:
                cur.itersize = 16
                cur.execute(f"SELECT {row_columns(embedding=True, data=True)} FROM chorus_entries e "
                            "WHERE e.workspace = %(ws)s ORDER BY e.id", {"ws": self.workspace, **emb_params(dim)})
                for values in cur:
                    row = Row(*values)
                    checked += 1
                    live[int(row.id)] = row.sha256
                    if dim is None:  # no valid dimension stated: rows cannot be checked, none is damaged for it
                        unchecked.append({"id": int(row.id), "file": None,
                                          "reason": "the workspace states no valid embedding dimension"})
                        continue
                    try:
                        problem = entry_problem(row, dim, decode_entry_arrays)
                    except MemoryError:
                        unchecked.append({"id": int(row.id), "file": None, "reason": "not enough memory to decode it"})
                        continue
                    if isinstance(problem, str):
                        bad.append((int(row.id), problem))
            return bad, unchecked, checked, live

        scanner = Slot("verify", read_only=True)
        try:
            bad, unchecked, checked, live = self._conns.call(self._in_snapshot, scan, deadline=3600, slot=scanner)
        finally:
            scanner.close()
        damaged = []
        for entry_id, reason in bad:
            self._quarantine(entry_id, reason)
            damaged.append({"id": entry_id, "file": None, "reason": reason})
            live.pop(entry_id, None)
        report = {"checked": checked, "damaged": damaged, "unchecked": unchecked, "ok": not damaged,
                  "temp_files_removed": 0, "orphans_removed": 0}
        if self.readonly:
            report["cleanup_skipped"] = "read-only: damaged rows are not quarantined, the local tier is not cleaned"
        else:
            report.update(self.tier.clean(live))
        report["index_consistent"] = self._index_matches()
        return report

    def _index_matches(self, attempts: int = 50) -> bool:
        """Whether this handle's index holds exactly the workspace's live rows (less those it set aside),
        compared at one sequence number: the live ids and the sequence number are read in one snapshot, and
        the comparison is made once the handle has applied the change log up to that same number (retried
        while workers keep writing; False when it never catches the same number)."""
        def live_at(conn):
            seq = conn.execute("SELECT seq FROM chorus_workspaces WHERE name=%s", (self.workspace,)).fetchone()
            ids = conn.execute("SELECT id FROM chorus_entries WHERE workspace=%s", (self.workspace,)).fetchall()
            return (int(seq[0]) if seq else 0), {int(r[0]) for r in ids}

        for _ in range(attempts):
            self.sync()
            seq, live = self._conns.call(self._in_snapshot, live_at, read=True)
            with self._mutex:
                if self._seq != seq:
                    continue  # a writer committed between the catch-up and the snapshot: again
                expected = live - self._set_aside
                index_ids = set(self._index.where) if self._index is not None else set()
                return set(self._known) == expected and index_ids == expected
        return False
