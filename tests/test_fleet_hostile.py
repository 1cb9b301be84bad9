"""The fleet store against what a buggy or compromised worker, a careless operator or a struggling
server does (issue 32), on a real PostgreSQL cluster (``tests/fleet_pg.py``; the ``pg`` and ``url``
fixtures of ``conftest.py``):

* rows written straight into the tables never stop an open, the change feed or a listing, and
  their bytes are not fetched before their sizes are checked (in SQL);
* the feed's position never moves past the workspace's own sequence number;
* bad limits are errors that delete nothing, in the store, the command line and the node;
* PostgreSQL's errors map onto the store's by SQLSTATE (read-only, lock timeout, serialization
  failure, statement timeout provoked on the server; disk full through its real error class);
* a load never queues behind a write of another thread on the same handle (both stores);
* read-only commands create no folder, file or row anywhere, and fail cleanly on a workspace (or
  database) that does not exist; ``init`` is the command that creates.
"""

from __future__ import annotations

import hashlib
import json
import math
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

import fleet_pg
import serving_helpers as sh
from cache_helpers import tree_snapshot

psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is not installed (pip install 'psycopg[binary]')")

from chorus.cache_store import (StoreBusyError, StoreError, StoreFullError, StoreReadOnlyError,  # noqa: E402
                                StoreUnavailableError, Workspace)
from chorus.cache_store import fleet_conn, fleet_feed, seams  # noqa: E402
from chorus.cache_store.entry_format import encode_entry  # noqa: E402
from chorus.cache_store.fleet import FleetStore  # noqa: E402
from chorus.cache_store.pg_errors import translate  # noqa: E402
from chorus.cache_store.signature import signature_key  # noqa: E402

MiB = 1 << 20


def _worker(url, tmp_path, host, workspace="w", **kw):
    return FleetStore.open(url, workspace, local_path=tmp_path / host / workspace, **kw)


def _add(store, seed):
    return store.add(sh.embedding(seed), sh.entry_masks(seed), {"signature": sh.signature(), "prompt": f"request {seed}"})


def _wait(predicate, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


def _insert(url, *, workspace="w", change=True, data=None, embedding=None, data_sql=None, emb_sql=None,
            sig_key=None, sha256=None, nbytes=None, meta_json="{}", created=0.0):
    """A row written straight into ``chorus_entries`` (as a compromised worker would), with its
    change row and a NOTIFY when ``change``; the data and embedding as bytes or SQL expressions.
    Defaults: a valid entry of this test's signature whose sha256 and size match its data."""
    if data is None and data_sql is None:
        emb = sh.embedding(99) if embedding is None else embedding
        data = encode_entry(emb, sh.entry_masks(99), {"signature": sh.signature()})
    if embedding is None and emb_sql is None:
        embedding = sh.embedding(99).tobytes()
    elif isinstance(embedding, np.ndarray):
        embedding = embedding.astype(np.float32).tobytes()
    params = {"ws": workspace, "key": sig_key or signature_key(sh.signature()), "data": data, "emb": embedding,
              "sha": sha256 or (hashlib.sha256(data).hexdigest() if data is not None else "0" * 64),
              "nbytes": nbytes if nbytes is not None else (len(data) if data is not None else 1024),
              "meta": meta_json, "created": created}
    with fleet_pg.connect(url) as conn, conn.transaction():  # one transaction, as the store writes
        entry_id = conn.execute(
            "INSERT INTO chorus_entries(workspace, sig_key, sha256, nbytes, embedding, meta_json, data, created, "
            f"last_used) VALUES(%(ws)s, %(key)s, %(sha)s, %(nbytes)s, {emb_sql or '%(emb)s'}, %(meta)s, "
            f"{data_sql or '%(data)s'}, %(created)s, 0) RETURNING id", params).fetchone()[0]
        if change:
            seq = conn.execute("UPDATE chorus_workspaces SET seq = seq + 1 WHERE name=%s RETURNING seq",
                               (workspace,)).fetchone()[0]
            conn.execute("INSERT INTO chorus_changes VALUES(%s, %s, 'a', %s, 0)", (workspace, seq, entry_id))
            conn.execute("SELECT pg_notify('chorus_changes', %s)", (workspace,))
    return entry_id


def _quarantined(store) -> dict:
    return {q["id"]: q["reason"] for q in store.quarantined()}


# -- rows written straight into the tables ----------------------------------------------------

def test_hostile_rows_never_stop_an_open_a_feed_or_a_listing(url, tmp_path, caplog):
    a = _worker(url, tmp_path, "a")
    ids = [_add(a, i) for i in range(3)]
    tiny = np.full(sh.EMB_DIM, 1e-45, np.float32)  # finite; its float32 norm underflows to 0
    with Workspace.open(tmp_path / "local") as local:  # the same embedding is a valid local entry
        local.add(tiny, sh.entry_masks(1), {"signature": sh.signature()})
    # rows without a change row: only a worker opened now meets them, in its initial load
    at_open = {
        _insert(url, change=False, embedding=tiny, data=encode_entry(tiny, sh.entry_masks(1), {"signature": sh.signature()})): None,
        _insert(url, change=False, data_sql="convert_to(repeat('x', 160 * 1048576), 'UTF8')", nbytes=1024,
                sha256="1" * 64): "row data has 167772160 bytes, its nbytes says 1024",
        _insert(url, change=False, emb_sql="decode(repeat('00', 64 * 1048576), 'hex')"): "row embedding has 67108864 bytes",
        _insert(url, change=False, embedding=np.full(sh.EMB_DIM, np.nan)): "NaN",
        _insert(url, change=False, embedding=np.ones(2)): f"row embedding has 8 bytes, expected {4 * sh.EMB_DIM}",
        _insert(url, change=False, sha256="../../../../../../escaped" + "0" * 39): "row sha256 is not 64 hex digits",
        _insert(url, change=False, sig_key="k" * (8 * MiB)): "row signature key is not 32 hex digits",
        _insert(url, change=False, created=math.nan): "timestamps",
    }
    tracemalloc.start()
    try:
        b = _worker(url, tmp_path, "b")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"opening beside hostile rows of 160 MiB and 64 MiB: peak {peak / MiB:.1f} MiB of Python allocations")
    assert peak < 24 * MiB, f"opening fetched hostile bytes: peak {peak / MiB:.0f} MiB of Python allocations"
    good = sorted(ids + [i for i, reason in at_open.items() if reason is None])
    assert b.known_ids() == good
    reasons = _quarantined(b)
    for entry_id, reason in at_open.items():
        if reason is not None:
            assert reason in reasons.get(entry_id, ""), (entry_id, reasons.get(entry_id))
    assert b.load(good[-1], touch=False)[1]["signature"] == sh.signature()  # the tiny embedding's entry loads
    assert b.search(tiny)[0][0] == good[-1] and list((tmp_path / "b").rglob("*escaped*")) == []
    # the same rows through the change feed of two running workers: each quarantines, both go on
    fed = {
        _insert(url, data_sql="convert_to(repeat('x', 160 * 1048576), 'UTF8')", nbytes=1024, sha256="2" * 64),
        _insert(url, embedding=np.ones(2)),
        _insert(url, embedding=np.full(sh.EMB_DIM, np.inf)),
    }
    _wait(lambda: fed <= set(_quarantined(a)), "fed hostile rows quarantined")
    fresh = _add(a, 7)
    _wait(lambda: b.search(sh.embedding(7))[0][0] == fresh, "the feed still carries a legitimate entry")
    assert b.known_ids() == good + [fresh]  # a may or may not have reloaded and met the change-less valid row
    assert set(ids + [fresh]) <= set(a.known_ids()) <= set(good + [fresh])
    # a listing: metadata nested 100 000 deep reads as unreadable, non-finite timestamps leave the row out
    deep = _insert(url, meta_json="[" * 100_000 + "]" * 100_000)
    _insert(url, created=math.inf)
    _wait(lambda: deep in b, "the deep-metadata row (valid otherwise) indexed")
    listing = {e["id"]: e for e in b.entries()}
    assert set(listing) == set(good + [fresh, deep]), sorted(listing)
    assert "nested too deeply" in listing[deep]["meta"]["unreadable"]
    done = sh.chorus_cli("cache", "list", "--url", url, "--workspace", "w", "--root", str(tmp_path / "cli"))
    assert done.returncode == 0 and f"{deep:>8}" in done.stdout, done.stdout + done.stderr
    assert json.loads(sh.chorus_cli("cache", "stats", "--url", url, "--workspace", "w", "--root",
                                    str(tmp_path / "cli"), "--json").stdout)["indexed"] == len(good) + 2
    for store in (a, b):
        store.close()


def test_a_first_change_row_of_another_size_does_not_set_the_dimension(url, tmp_path):
    """In a workspace with no entry yet, a hostile first change row with an 8-byte embedding is
    quarantined; the workers' own adds are indexed and searched as usual."""
    a, b = _worker(url, tmp_path, "a"), _worker(url, tmp_path, "b")
    try:
        hostile = _insert(url, embedding=np.ones(2, np.float32))
        _wait(lambda: hostile in _quarantined(a), "the hostile first row quarantined")
        assert "no embedding dimension" in _quarantined(a)[hostile] and a.dim is None is b.dim
        entry = _add(a, 1)
        _wait(lambda: b.search(sh.embedding(1))[:1] == [(entry, pytest.approx(1.0, abs=1e-5))], "b indexes a's add")
        assert a.dim == b.dim == sh.EMB_DIM and a.search(sh.embedding(1))[0][0] == entry
        assert b.load(entry, touch=False)[1]["prompt"] == "request 1"
    finally:
        a.close()
        b.close()


def test_the_feed_never_moves_past_the_workspace_sequence_number(url, tmp_path, pg, caplog):
    a, b = _worker(url, tmp_path, "a"), _worker(url, tmp_path, "b")
    db = url.rsplit("/", 1)[1]
    try:
        ids = [_add(a, i) for i in range(2)]
        with fleet_pg.connect(url) as conn:  # a change row 10^9 ahead of the workspace's number
            conn.execute("INSERT INTO chorus_changes VALUES('w', 1000000000, 'a', %s, 0)", (ids[0],))
            conn.execute("SELECT pg_notify('chorus_changes', 'w')")
        ids += [_add(a, i) for i in range(2, 5)]
        workspace_seq = pg.sql("SELECT seq FROM chorus_workspaces WHERE name='w'", db)[0][0]
        _wait(lambda: b.known_ids() == ids, "b applies every later change")
        assert a.feed_seq == b.feed_seq == workspace_seq < 1000, (a.feed_seq, b.feed_seq, workspace_seq)
        assert pg.sql("SELECT count(*) FROM chorus_changes WHERE seq > %s", db, (workspace_seq,)) == [(0,)]
        assert "change rows past its sequence number" in caplog.text  # the next writer deleted it
        # a change deleted from the log: a worker behind it reloads instead of skipping it
        c = _worker(url, tmp_path, "c", listen=False)
        ids += [_add(a, i) for i in range(5, 8)]
        pg.sql("DELETE FROM chorus_changes WHERE workspace='w' AND seq = %s", db, (workspace_seq + 2,))
        c.sync()
        assert c.known_ids() == ids and "has a gap" in caplog.text
        c.close()
    finally:
        a.close()
        b.close()


def test_a_writer_that_meets_a_damaged_row_and_then_fails_keeps_its_feed_position(url, tmp_path, pg, monkeypatch):
    """A writer catches up under the workspace row lock and meets a damaged row: its quarantine waits until the
    writer's transaction has ended. The write then fails before its commit and rolls back: the writer's feed
    position stays the workspace's (the quarantine, made after the rollback, is a committed change), so the
    change another worker commits next is applied (before, the quarantine ran inside the failed transaction,
    the writer applied its change, and the next change committed at that number was never applied)."""
    db = url.rsplit("/", 1)[1]
    a = _worker(url, tmp_path, "a", listen=False)
    b = _worker(url, tmp_path, "b", listen=False)
    try:
        _add(a, 1)
        damaged = _insert(url, embedding=np.ones(2))  # fails the row checks, with its change row

        def fail_before_commit(phase):
            if phase == "before_commit":
                raise RuntimeError("test: the write fails before its commit")

        monkeypatch.setattr(seams, "fleet_phase", fail_before_commit)
        with pytest.raises(RuntimeError, match="before its commit"):
            _add(a, 2)
        monkeypatch.setattr(seams, "fleet_phase", lambda phase: None)
        workspace_seq = pg.sql("SELECT seq FROM chorus_workspaces WHERE name='w'", db)[0][0]
        assert a.feed_seq == workspace_seq and damaged in _quarantined(a), (a.feed_seq, workspace_seq)
        later = _add(b, 3)
        a.sync()
        assert later in a.known_ids() and a.search(sh.embedding(3))[0][0] == later
    finally:
        a.close()
        b.close()


def test_verify_beside_a_writing_worker_finds_the_index_consistent(url, tmp_path):
    """Verify compares its index with the live rows at one sequence number (read in one snapshot, compared once
    the index has applied the log up to it), so a worker adding entries all the while never makes a healthy
    store read as inconsistent (``cache verify --url`` would exit 1)."""
    writer, checker = _worker(url, tmp_path, "a"), _worker(url, tmp_path, "b")
    stop, added = threading.Event(), []

    def keep_writing():
        seed = 100
        while not stop.is_set():
            added.append(_add(writer, seed))
            seed += 1

    for seed in range(5):
        _add(writer, seed)
    thread = threading.Thread(target=keep_writing, daemon=True)
    thread.start()
    try:
        reports = [checker.verify() for _ in range(6)]
    finally:
        stop.set()
        thread.join(30)
        writer.close()
    assert len(added) >= 3, "the worker wrote while verify ran"
    assert all(r["ok"] and r["index_consistent"] for r in reports), [r for r in reports if not r["index_consistent"]]
    checker.close()


def test_an_invalid_workspace_dimension_hides_entries_without_quarantining_them(url, tmp_path, pg, caplog):
    """The workspace row's dimension set out of range (by hand or by a compromised worker): the
    workers index nothing (one log line each, not one per poll), quarantine nothing and refuse
    writes; set back, every entry returns."""
    db = url.rsplit("/", 1)[1]
    a, b = _worker(url, tmp_path, "a"), _worker(url, tmp_path, "b")
    try:
        ids = [_add(a, i) for i in range(3)]
        pg.sql("UPDATE chorus_workspaces SET dim = 70000 WHERE name = 'w'", db)
        _wait(lambda: len(a) == len(b) == 0, "both workers reloaded")
        time.sleep(2 * fleet_feed.POLL_S)  # a few polls of the feed
        assert caplog.text.count("states embedding dimension must be an int") == 2 and a.quarantined() == []
        with pytest.raises(StoreError, match="no valid embedding dimension"):  # hidden, not damage
            b.load(ids[0])
        report = a.verify()
        assert report["damaged"] == [] and sorted(u["id"] for u in report["unchecked"]) == ids
        assert a.quarantined() == []
        with pytest.raises(ValueError, match="this workspace holds dim 70000"):
            _add(a, 5)
        pg.sql("UPDATE chorus_workspaces SET dim = %s WHERE name = 'w'", db, (sh.EMB_DIM,))
        _wait(lambda: a.known_ids() == b.known_ids() == ids, "every entry back")
    finally:
        a.close()
        b.close()


# -- limits ----------------------------------------------------------------------------------

BAD_LIMITS = [-1, math.nan, math.inf, 1.5, 2**70, "3", True]


def test_bad_limits_delete_nothing_fleet_wide(url, tmp_path, pg, caplog):
    a = _worker(url, tmp_path, "a")
    db = url.rsplit("/", 1)[1]
    try:
        ids = [_add(a, i) for i in range(4)]
        for bad in BAD_LIMITS:
            for kwargs in ({"max_entries": bad}, {"max_bytes": bad}):
                with pytest.raises(ValueError):
                    a.prune(**kwargs)
                with pytest.raises(ValueError):
                    a.set_limits(**kwargs)
        assert sorted(e["id"] for e in a.entries()) == ids
        common = ["--url", url, "--workspace", "w", "--root", str(tmp_path / "cli")]
        for flag in ("--max-entries", "--max-bytes"):
            for value in ("-1", "0"):
                done = sh.chorus_cli("cache", "prune", *common, flag, value)
                assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr
        assert sorted(e["id"] for e in a.entries()) == ids
        # limits edited in the table by hand: the next write evicts nothing and logs why
        pg.sql("UPDATE chorus_workspaces SET max_entries = -1, max_bytes = -5 WHERE name = 'w'", db)
        ids.append(_add(a, 9))
        assert sorted(e["id"] for e in a.entries()) == ids and "stored limits are invalid" in caplog.text
        assert "invalid" in a.stats()["limits"]
        with pytest.raises(ValueError, match="stored limits are invalid"):
            a.prune()
        a.set_limits(max_bytes=1 << 30, max_entries=0)
        done = sh.chorus_cli("cache", "prune", *common, "--max-entries", "0", "--delete-all", "--json")
        assert done.returncode == 0 and sorted(json.loads(done.stdout)["removed"]) == ids, done.stderr
    finally:
        a.close()


def test_maintenance_node_with_bad_limits_deletes_nothing_fleet_wide(url, tmp_path, monkeypatch):
    from host import tiny_wan as tiny

    reason = tiny.import_comfy()
    if reason is not None:
        pytest.skip(f"ComfyUI not available: {reason}")
    from chorus.nodes.cache_maintenance import ChorusCacheMaintenance

    monkeypatch.setenv("CHORUS_CACHE_URL", url)
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "root"))
    with _worker(url, tmp_path, "a") as a:
        ids = [_add(a, i) for i in range(3)]
        for bad in BAD_LIMITS + [None, -(2**63)]:
            report = ChorusCacheMaintenance.execute(workspace="w", action="prune", max_entries=bad).result[0]
            assert "failed: ValueError" in report and url.rsplit("@", 1)[1] not in report.split("failed")[0], report
        assert sorted(e["id"] for e in a.entries()) == ids
        report = ChorusCacheMaintenance.execute(workspace="w", action="prune", max_entries=2).result[0]
        assert '"entries": 2' in report, report


# -- PostgreSQL's errors by SQLSTATE ------------------------------------------------------------

def _backend(store, read=False) -> int:
    return store.with_connection(lambda conn: conn.execute("SELECT pg_backend_pid()").fetchone()[0], read=read)


def _terminate(pg, db):
    pg.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
           db, (db,))


def test_postgres_errors_map_to_store_errors_by_sqlstate(url, tmp_path, pg, monkeypatch):
    from chorus.engine import commit_plan, retrieve_plan

    db = url.rsplit("/", 1)[1]
    # disk full (53100) cannot be provoked safely: its real error class, raised inside a write
    # transaction on a real connection, at the translation function and through the engine
    error, drop = translate(psycopg.errors.DiskFull("could not extend file: No space left on device"),
                            workspace="w", timeout=2.0)
    assert isinstance(error, StoreFullError) and not drop and str(error).startswith("PostgreSQL's disk is full")
    store = _worker(url, tmp_path, "a", listen=False, timeout=0.5)
    try:
        first = _add(store, 0)
        backend = _backend(store)

        def disk_full(phase):
            if phase == "before_commit":
                raise psycopg.errors.DiskFull("could not extend file \"base/1/2\": No space left on device")

        monkeypatch.setattr(seams, "fleet_phase", disk_full)
        plan = sh.record_miss(retrieve_plan(store, sh.embedding(40), sh.LATENT))
        message = commit_plan(store, plan)
        assert message.startswith("not written: the store refused the entry (StoreFullError: PostgreSQL's disk is "
                                  "full (SQLSTATE 53100"), message
        monkeypatch.setattr(seams, "fleet_phase", lambda phase: None)
        assert [e["id"] for e in store.entries()] == [first] and _backend(store) == backend  # rolled back, kept

        # lock not available (55P03): another worker holds the workspace row past the time bound
        with fleet_pg.connect(url) as holder:
            with holder.transaction():
                holder.execute("SELECT 1 FROM chorus_workspaces WHERE name='w' FOR UPDATE")
                with pytest.raises(StoreBusyError, match=r"held the write lock past the time bound \(0.5 s\); "
                                                         "nothing was changed"):
                    _add(store, 1)
        assert len(store.entries()) == 1 and _backend(store) == backend

        # statement timeout (57014): a read waits on a table lock longer than statement_timeout
        store.tier.drop(first)
        monkeypatch.setattr(fleet_conn, "STATEMENT_TIMEOUT_MS", 300)
        slow = _worker(url, tmp_path, "s", listen=False, timeout=30)
        with fleet_pg.connect(url) as holder:
            with holder.transaction():
                holder.execute("LOCK TABLE chorus_entries IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(StoreUnavailableError, match="did not answer in time .SQLSTATE 57014"):
                    slow.load(first, touch=False)
        assert slow.load(first, touch=False)[1]["prompt"] == "request 0"
        slow.close()
        monkeypatch.setattr(fleet_conn, "STATEMENT_TIMEOUT_MS", 5000)

        # read-only (25006): the database turned read-only; the connection is dropped and reopened
        pg.sql(f'ALTER DATABASE "{db}" SET default_transaction_read_only = on')
        _terminate(pg, db)
        with pytest.raises(StoreReadOnlyError, match="PostgreSQL is read-only .SQLSTATE 25006"):
            _add(store, 2)
        plan = sh.record_miss(retrieve_plan(store, sh.embedding(41), sh.LATENT))
        assert "StoreReadOnlyError: PostgreSQL is read-only" in commit_plan(store, plan)
        assert store.load(first, touch=False)[1]["prompt"] == "request 0"  # reads go on
        pg.sql(f'ALTER DATABASE "{db}" RESET default_transaction_read_only')
        second = _add(store, 2)  # reconnected: a fresh session is writable again

        # serialization failure (40001): a repeatable-read writer meets a concurrent update of its row
        pg.sql(f'ALTER DATABASE "{db}" SET default_transaction_isolation = \'repeatable read\'')
        _terminate(pg, db)
        patient = _worker(url, tmp_path, "p", listen=False, timeout=30)
        outcome = {}
        with fleet_pg.connect(url) as holder:
            with holder.transaction():
                holder.execute("UPDATE chorus_workspaces SET n_entries = n_entries WHERE name='w'")
                writer = threading.Thread(target=lambda: outcome.update(error=fleet_pg.raised(lambda: _add(patient, 3))))
                writer.start()
                _wait(lambda: pg.sql("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND "
                                     "wait_event_type = 'Lock'", db, (db,))[0][0] == 1, "the writer waits for the row")
            writer.join(30)
        assert isinstance(outcome["error"], StoreBusyError), outcome
        assert "a concurrent transaction conflicted with this one (SQLSTATE 40001" in str(outcome["error"])
        assert sorted(e["id"] for e in store.entries()) == [first, second]  # nothing written
        patient.close()
        pg.sql(f'ALTER DATABASE "{db}" RESET default_transaction_isolation')
    finally:
        store.close()


# -- reads never queue behind writes on the same handle ------------------------------------------

@pytest.mark.parametrize("kind", ["workspace", "fleet"])
def test_a_load_never_queues_behind_a_write_on_the_same_handle(kind, tmp_path, request, monkeypatch):
    """Another thread's add holds the handle's writer (and, fleet-wide, the row lock) inside its
    transaction; a load (with its hit) and a search on the same handle return meanwhile, and the
    hit is counted once the writer is done."""
    if kind == "fleet":
        store, phase_seam = _worker(request.getfixturevalue("url"), tmp_path, "a"), "fleet_phase"
    else:
        store, phase_seam = Workspace.open(tmp_path / "ws"), "workspace_phase"
    try:
        ids = [_add(store, i) for i in range(2)]
        if kind == "fleet":
            store.tier.drop(ids[0])  # the load must fetch from PostgreSQL
        inside, release = threading.Event(), threading.Event()

        def hold(phase):
            if phase == "before_commit":
                inside.set()
                release.wait(60)

        monkeypatch.setattr(seams, phase_seam, hold)
        writer = threading.Thread(target=lambda: _add(store, 5))
        writer.start()
        assert inside.wait(30)
        got = {}
        reader = threading.Thread(target=lambda: got.update(masks=store.load(ids[0])[0], found=store.search(
            sh.embedding(1))[0][0], again=store.load(ids[1])[0]))
        reader.start()
        reader.join(30)
        finished = not reader.is_alive()
        release.set()
        writer.join(30)
        reader.join(30)
        assert finished, "the load queued behind the write of another thread"
        assert got["found"] == ids[1] and torch.equal(got["masks"][(0, 0, 0, 0)], sh.entry_masks(0)[(0, 0, 0, 0)])
        monkeypatch.setattr(seams, phase_seam, lambda phase: None)
        store.touch(ids[1])  # counts the hits kept pending meanwhile
        hits = {e["id"]: e["hits"] for e in store.entries()}
        assert hits[ids[0]] == 1 and hits[ids[1]] == 2, hits
    finally:
        store.close()


# -- read-only commands create nothing; init creates -------------------------------------------

def _tables(pg, db) -> list:
    """Everything the store keeps in PostgreSQL, as rows (the entries without their bytes)."""
    if pg.sql("SELECT to_regclass('chorus_workspaces') IS NULL", db)[0][0]:
        return [pg.sql("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1", db)]
    return [pg.sql(f"SELECT * FROM {table} ORDER BY 1, 2", db) for table in ("chorus_workspaces", "chorus_changes")] + [
        pg.sql("SELECT id, sha256, hits, last_used, md5(data) FROM chorus_entries ORDER BY id", db),
        pg.sql("SELECT entry_id, reason FROM chorus_quarantine ORDER BY 1", db)]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(capsys, *args) -> tuple[int, str, str]:
    """``python -m chorus cache ...`` in this process (the subprocess path is the same code: see
    ``tests/test_cache_cli.py``); returns (exit code, stdout, stderr)."""
    import chorus.__main__ as chorus_main

    code = chorus_main.main(["cache", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_read_only_commands_create_nothing_anywhere(url, pg, tmp_path, capsys):
    db = url.rsplit("/", 1)[1]
    root = tmp_path / "root"
    with _worker(url, tmp_path, "writer") as writer:
        ids = [_add(writer, i) for i in range(3)]
    pg.sql("UPDATE chorus_entries SET data = substring(data from 1 for 40), nbytes = 40 WHERE id = %s", db, (ids[1],))
    with Workspace.open(root / "local") as local:
        local_ids = [_add(local, i) for i in range(2)]
        victim = local.entry_path(local_ids[0])
    victim.write_bytes(victim.read_bytes()[:-10] + b"\0" * 10)
    empty_db = pg.new_database()
    tree, tables, bare = tree_snapshot(tmp_path), _tables(pg, db), _tables(pg, empty_db)
    fleet = ["--url", url, "--root", str(root)]
    runs = {
        ("stats", "fleet"): (["stats", *fleet, "--workspace", "w"], 0, ""),
        ("list", "fleet"): (["list", *fleet, "--workspace", "w"], 0, ""),
        ("verify", "fleet"): (["verify", *fleet, "--workspace", "w"], 1, ""),
        ("stats", "typo"): (["stats", *fleet, "--workspace", "typo"], 2, "fleet workspace 'typo' does not exist"),
        ("list", "typo"): (["list", *fleet, "--workspace", "typo"], 2, "does not exist"),
        ("verify", "typo"): (["verify", *fleet, "--workspace", "typo"], 2, "does not exist"),
        ("stats", "no tables"): (["stats", "--url", pg.url(empty_db), "--root", str(root), "--workspace", "w"], 2,
                                 "holds no Chorus fleet tables"),
        ("stats", "closed port"): (["stats", "--url", f"postgresql://postgres@127.0.0.1:{_closed_port()}/x",
                                    "--root", str(root), "--workspace", "w"], 2, "PostgreSQL unreachable"),
        ("stats", "local"): (["stats", "--root", str(root), "--workspace", "local"], 0, ""),
        ("verify", "local"): (["verify", "--root", str(root), "--workspace", "local"], 1, ""),
        ("verify", "local typo"): (["verify", "--root", str(root), "--workspace", "typo"], 2, "does not exist"),
        ("list", "local typo"): (["list", "--root", str(root), "--workspace", "typo"], 2, "does not exist"),
    }
    for name, (args, code, expect) in runs.items():
        got, out, err = _cli(capsys, *args)
        assert got == code, (name, out, err)
        if code == 2:
            errors = [line for line in err.splitlines() if line.strip() and "%|" not in line]
            assert len(errors) == 1 and expect in errors[0], (name, err)
        assert tree_snapshot(tmp_path) == tree, f"{name} changed files"
        assert _tables(pg, db) == tables and _tables(pg, empty_db) == bare, f"{name} changed rows or tables"
    # the same through the API: a read-only handle reports the damaged row, quarantines nothing
    with FleetStore.open(url, "w", local_path=root / "w", readonly=True) as ro:
        assert ro.known_ids() == ids and ro.load(ids[0])[1]["prompt"] == "request 0"  # its hit not counted
        report = ro.verify()
        assert [d["id"] for d in report["damaged"]] == [ids[1]] and "cleanup_skipped" in report
        assert ro.known_ids() == [ids[0], ids[2]] and report["index_consistent"]  # set aside in this handle only
        with pytest.raises(StoreReadOnlyError):
            _add(ro, 9)
        for write in (lambda: ro.remove(ids[0]), lambda: ro.set_limits(max_entries=1),
                      lambda: ro.prune(max_entries=0)):  # refused by the handle, not by PostgreSQL
            with pytest.raises(StoreReadOnlyError, match="opened read-only"):
                write()
    assert tree_snapshot(tmp_path) == tree and _tables(pg, db) == tables
    # --repair writes; init creates (and is the only command that does)
    assert _cli(capsys, "verify", "--repair", *fleet, "--workspace", "w")[0] == 1
    assert ids[1] in {q for q, in pg.sql("SELECT entry_id FROM chorus_quarantine", db)}
    for args in (["init", "--url", pg.url(empty_db), "--root", str(root), "--workspace", "fresh"],
                 ["init", "--root", str(root), "--workspace", "fresh_local"]):
        code, out, err = _cli(capsys, *args)
        assert code == 0 and "is ready: 0 entries" in out, err
    assert pg.sql("SELECT name FROM chorus_workspaces", empty_db) == [("fresh",)]
    assert (root / "fresh_local" / "chorus.sqlite3").is_file()
    done = sh.chorus_cli("cache", "stats", "--url", pg.url(empty_db), "--root", str(root), "--workspace", "fresh")
    assert done.returncode == 0 and "entries: 0" in done.stdout  # as users run it


def test_a_worker_that_cannot_connect_leaves_no_folder(tmp_path):
    with pytest.raises(StoreUnavailableError):
        FleetStore.open(f"postgresql://postgres@127.0.0.1:{_closed_port()}/x", "w", local_path=tmp_path / "w")
    assert list(tmp_path.iterdir()) == []
