"""The fleet store (``cache_store/fleet.py``) against a real PostgreSQL server (``tests/fleet_pg.py``:
a throwaway cluster started once per session; skipped with the reason where it cannot start).

Each test gets a fresh database (the ``pg`` and ``url`` fixtures of ``conftest.py``). "Workers" here are :class:`FleetStore` handles with their own
local roots (two hosts); ``tests/test_fleet_serving.py`` does the same through ComfyUI servers.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fleet_pg
import serving_helpers as sh

pytest.importorskip("psycopg", reason="psycopg 3 is not installed (pip install 'psycopg[binary]')")

from chorus.cache_store import CacheStore, CorruptEntryError, StoreUnavailableError, Workspace  # noqa: E402
from chorus.cache_store import fleet_conn, fleet_feed, seams  # noqa: E402
from chorus.cache_store.fleet import FleetStore  # noqa: E402
from chorus.cache_store.errors import StoreError  # noqa: E402
from chorus.cache_store.protocol import open_store  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "OPERATIONS.md"


def _open(url, tmp_path, host="a", workspace="w", **kw):
    return FleetStore.open(url, workspace, local_path=tmp_path / host / workspace, **kw)


def _meta(i=0, **extra):
    return {"signature": sh.signature(), "prompt": f"request {i}", **extra}


def _big_meta(i=0):
    """Metadata for :func:`_big_masks` (a signature without a token geometry: no size cap from it)."""
    return {"signature": {"test": "big maps"}, "prompt": f"request {i}"}


def _big_masks(seed, n=8, blocks=64):
    """Random (incompressible) maps: ~n x 8 x blocks x blocks / 8 bytes, so a commit takes a while."""
    gen = torch.Generator().manual_seed(seed)
    return {(0, 0, layer, 0): torch.rand(8, blocks, blocks, generator=gen) < 0.5 for layer in range(n)}


def _wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.005)
    return True


# -- the protocol ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["workspace", "fleet"])
def test_protocol_both_stores(kind, tmp_path, request, monkeypatch):
    """Both stores satisfy the protocol and answer the same calls the same way, through the engine too."""
    from chorus.engine import commit_plan, retrieve_plan

    if kind == "fleet":
        url = request.getfixturevalue("url")
        monkeypatch.setenv("CHORUS_CACHE_URL", url)
    else:
        monkeypatch.delenv("CHORUS_CACHE_URL", raising=False)
    store = open_store("proto", root=tmp_path)
    try:
        assert isinstance(store, CacheStore)
        assert isinstance(store, FleetStore if kind == "fleet" else Workspace)
        assert len(store) == 0 and store.search(sh.embedding(0)) == []
        ids = [store.add(sh.embedding(i), sh.entry_masks(i), _meta(i)) for i in range(5)]
        assert len(store) == 5 and ids == sorted(ids)
        rng = np.random.default_rng(0)
        vecs = np.stack([sh.embedding(i) for i in range(5)])
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        for _ in range(10):  # exact against numpy
            q = rng.normal(size=sh.EMB_DIM).astype(np.float32)
            sims = vecs @ (q / np.linalg.norm(q))
            got = store.search(q, k=3)
            assert [i for i, _ in got] == [ids[j] for j in np.argsort(-sims)[:3]]
            assert np.allclose([s for _, s in got], np.sort(sims)[::-1][:3], atol=1e-5)
        assert store.search(sh.embedding(1), signature=sh.signature(block_size=64)) == []
        masks, meta = store.load(ids[2], packed=False)
        assert meta["prompt"] == "request 2" and all(torch.equal(masks[k], v) for k, v in sh.entry_masks(2).items())
        assert store.add_unique(sh.embedding(2), sh.entry_masks(2), _meta(2), min_similarity=0.9) == (ids[2], False)
        new_id, created = store.add_unique(sh.embedding(7), sh.entry_masks(7), _meta(7), min_similarity=0.9)
        assert created and new_id > ids[-1]
        store.touch(ids[0])
        hits = {e["id"]: e["hits"] for e in store.entries()}
        assert hits[ids[0]] == 1 and hits[ids[2]] == 1  # load touched too
        assert store.remove(ids[4]) and not store.remove(ids[4]) and len(store) == 5
        with pytest.raises(KeyError):
            store.load(ids[4])
        with pytest.raises(ValueError):
            store.search(np.zeros(sh.EMB_DIM, np.float32))
        with pytest.raises(ValueError):
            store.add(np.ones(3, np.float32), sh.entry_masks(0), _meta())
        deep = _meta(8)
        node = deep
        for _ in range(100):
            node["next"] = {}
            node = node["next"]
        with pytest.raises(ValueError, match="nested deeper"):  # both stores refuse what they could not read
            store.add(sh.embedding(8), sh.entry_masks(8), deep)
        assert len(store) == 5
        store.set_limits(max_entries=3)
        removed = store.prune()
        assert len(removed) == 2 and len(store) == 3 and ids[0] not in removed  # LRU: ids[0] was touched
        stats = store.stats()
        assert stats["entries"] == 3 and stats["limits"]["max_entries"] == 3
        report = store.verify()
        assert report["ok"] and report["index_consistent"] and report["checked"] == 3, report
        assert store.rebuild_index() and len(store) == 3
        # the engine through the store: a recorded miss is written, then found as a hit
        plan = retrieve_plan(store, sh.embedding(40), sh.LATENT, similarity_threshold=0.9)
        assert not plan.is_hit
        assert commit_plan(store, sh.record_miss(plan)).startswith("wrote entry")
        hit = retrieve_plan(store, sh.embedding(40), sh.LATENT, similarity_threshold=0.9)
        assert hit.is_hit and commit_plan(store, hit).startswith("hit: updated stats")
        assert not store.closed
    finally:
        store.close()
    assert store.closed


def test_without_url_nothing_changes(tmp_path, monkeypatch):
    monkeypatch.delenv("CHORUS_CACHE_URL", raising=False)
    with open_store("plain", root=tmp_path) as store:
        assert isinstance(store, Workspace) and store.path == tmp_path / "plain"
    monkeypatch.setenv("CHORUS_CACHE_URL", "mysql://u:secret@h/db")
    with pytest.raises(ValueError) as err:
        open_store("plain", root=tmp_path)
    assert "secret" not in str(err.value)


# -- the change feed ------------------------------------------------------------------------

def test_two_workers_see_each_others_commits_within_1s(url, tmp_path):
    """A commit on one worker is in the other's index within 1 s, both ways; removals too; a
    worker opened later loads everything; a listener whose connection is killed reconnects and
    catches up by sequence number."""
    a, b = _open(url, tmp_path, "a"), _open(url, tmp_path, "b")
    try:
        for writer, reader, seed in [(a, b, 1), (b, a, 2), (a, b, 3)]:
            entry_id = writer.add(sh.embedding(seed), sh.entry_masks(seed), _meta(seed))
            _wait_until(lambda: reader.search(sh.embedding(seed))[:1] == [(entry_id, pytest.approx(1.0, abs=1e-5))],
                        1.0, f"entry {entry_id} visible on the other worker")
        assert a.remove(entry_id)
        _wait_until(lambda: entry_id not in {i for i, _ in b.search(sh.embedding(3), k=5)}, 1.0, "removal seen")
        # the listener's connection dies (as in a server-side disconnect); writes meanwhile are caught up
        before = b.feed_seq
        fleet_pg.cluster().sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = "
                               "'chorus-fleet-feed'")
        later = [a.add(sh.embedding(s), sh.entry_masks(s), _meta(s)) for s in range(10, 15)]
        _wait_until(lambda: all(b.search(sh.embedding(s))[0][0] == i for s, i in zip(range(10, 15), later)),
                    10.0, "catch-up after the listener reconnected")
        assert b.feed_seq == before + 5
        c = _open(url, tmp_path, "c")  # started later
        try:
            assert len(c) == len(a) == len(b) == 7
            assert all(c.search(sh.embedding(s))[0][0] == i for s, i in zip(range(10, 15), later))
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_a_hit_moves_to_the_entry_another_worker_wrote_for_its_model(url, tmp_path):
    """Two workers write entries of one prompt for two models (without and with a LoRA: another
    weights fingerprint); the embeddings are equal, so retrieval on a third worker ranks the older
    entry first. A hit for the second model moves to the entry written for it (``Plan.serve_run``
    over the fleet store), before any sparse call; a third model finds none and is demoted."""
    import dataclasses

    from chorus.engine import retrieve_plan

    a, b, c = (_open(url, tmp_path, host) for host in "abc")
    try:
        emb = sh.embedding(7)
        base_model = sh.model_info()
        lora_model = dataclasses.replace(base_model, fingerprint="fp-with-lora")
        base = a.add(emb, sh.entry_masks(7), _meta(7))
        lora = b.add(emb, sh.entry_masks(7), {**_meta(7), "signature": sh.signature(experts=["fp-with-lora"])})
        _wait_until(lambda: len(c) == 2, 5.0, "both entries on the third worker")
        plan = retrieve_plan(c, emb, sh.LATENT)
        assert plan.is_hit and plan.entry_id == base and [e for e, _ in plan.retrieval.candidates] == [lora]
        assert plan.serve_run(lora_model) == 0 and plan.is_hit and plan.entry_id == lora
        plan.serve_run(base_model)
        assert plan.demoted_reason is not None and not plan.is_hit  # no entry serves both
        other = retrieve_plan(c, emb, sh.LATENT)
        other.serve_run(dataclasses.replace(base_model, fingerprint="fp-other"))
        assert not other.is_hit and "no other candidate serves it" in other.message
    finally:
        for store in (a, b, c):
            store.close()


def test_concurrent_misses_written_once_fleet_wide(url, tmp_path):
    """4 processes add the same 8 requests behind a barrier (add_unique): each written once."""
    import multiprocessing

    FleetStore.open(url, "race", local_path=tmp_path / "setup" / "race", listen=False).close()
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=fleet_pg.unique_writer, args=(url, str(tmp_path / f"host{i}" / "race"), barrier, results))
             for i in range(4)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    by_round: dict[int, list] = {}
    for created in got:
        for round_, entry_id, new in created:
            by_round.setdefault(round_, []).append((entry_id, new))
    for round_, rows in by_round.items():
        assert sorted(new for _, new in rows) == [False, False, False, True], (round_, rows)
        assert len({entry_id for entry_id, _ in rows}) == 1, (round_, rows)
    with _open(url, tmp_path, "check", "race") as store:
        assert len(store) == 8 and sorted(e["meta"]["round"] for e in store.entries()) == list(range(8))


# -- eviction -------------------------------------------------------------------------------

def test_fleet_wide_cap_and_lru_across_workers(url, tmp_path):
    a, b = _open(url, tmp_path, "a"), _open(url, tmp_path, "b")
    try:
        a.set_limits(max_entries=3, eviction="lru")
        ids = []
        for i in range(3):
            ids.append((a if i % 2 else b).add(sh.embedding(i), sh.entry_masks(i), _meta(i)))
        a.touch(ids[0])  # a hit counted on worker a keeps entry 0 alive at worker b's next write
        live_after = []
        for i in range(3, 6):
            ids.append((b if i % 2 else a).add(sh.embedding(i), sh.entry_masks(i), _meta(i)))
            live_after.append(sorted(e["id"] for e in a.entries()))
        assert live_after == [[ids[0], ids[2], ids[3]], [ids[0], ids[3], ids[4]], [ids[3], ids[4], ids[5]]], (live_after, ids)
        live = live_after[-1]
        _wait_until(lambda: b.known_ids() == live and a.known_ids() == live, 1.0, "evictions fed")
        assert b.search(sh.embedding(1))[0][0] != ids[1]
        assert not list(a.tier_dir.glob(f"{ids[1]}-*"))  # the writer's tier file went with the entry
    finally:
        a.close()
        b.close()


def test_local_tier_is_bounded_lru_and_serves_hits_without_postgres(url, tmp_path, pg, monkeypatch):
    """A load keeps the entry in the local tier; the next load reads the tier (it works with the
    server down); the tier stays under its byte cap (LRU); a damaged tier file is fetched again."""
    writer = _open(url, tmp_path, "a")
    ids = [writer.add(sh.embedding(i), _big_masks(i, n=2), _big_meta(i)) for i in range(4)]
    size = max(e["nbytes"] for e in writer.entries())
    writer.close()
    monkeypatch.setenv("CHORUS_FLEET_TIER_BYTES", str(int(size * 2.5)))  # the operator's setting
    reader = _open(url, tmp_path, "b")
    assert reader.tier_bytes == int(size * 2.5)
    try:
        for i in ids[:3]:
            reader.load(i, touch=False)
        files = sorted(p.name.split("-")[0] for p in reader.tier_dir.glob("*.safetensors"))
        assert files == sorted(str(i) for i in ids[1:3]), files  # at most 2 fit: entry 1 evicted first
        damaged = next(reader.tier_dir.glob(f"{ids[2]}-*"))
        nbytes = damaged.stat().st_size
        damaged.write_bytes(b"x" * 100)
        assert reader.load(ids[2], touch=False)[1]["prompt"] == "request 2"  # fetched again
        assert next(reader.tier_dir.glob(f"{ids[2]}-*")).stat().st_size == nbytes
        pg.kill()
        try:
            t = time.monotonic()
            masks, meta = reader.load(ids[2], touch=False)  # local tier, no server
            assert meta["prompt"] == "request 2" and len(masks) == 2
            assert reader.search(sh.embedding(3))[0][0] == ids[3]  # the index is local
            with pytest.raises(StoreUnavailableError):
                reader.load(ids[3], touch=False)  # not in the tier
            with pytest.raises(StoreUnavailableError):
                reader.add(sh.embedding(9), sh.entry_masks(9), _meta(9))
            assert time.monotonic() - t < 10
        finally:
            pg.start()
        assert reader.load(ids[3], touch=False)[1]["prompt"] == "request 3"  # reconnected by itself
    finally:
        reader.close()


# -- damage and hostile rows ----------------------------------------------------------------

def test_local_tier_refuses_links(url, tmp_path):
    """A link in the local tier under an entry's file name, pointing at a file outside with the
    entry's very bytes, is never read (as the workspace refuses links): the load fetches the entry
    from PostgreSQL, the link is removed (its target untouched) and the tier keeps a regular file
    again; a link in place of the tier folder is not used either."""
    store = _open(url, tmp_path, "a", listen=False)
    try:
        entry_id = store.add(sh.embedding(0), sh.entry_masks(0), _meta(0))
        tier_file = next(store.tier_dir.glob(f"{entry_id}-*"))
        outside = tmp_path / "outside.safetensors"
        outside.write_bytes(tier_file.read_bytes())
        os.utime(outside, (1000, 1000))
        tier_file.unlink()
        tier_file.symlink_to(outside)
        assert store.load(entry_id, touch=False)[1]["prompt"] == "request 0"
        assert not tier_file.is_symlink() and tier_file.read_bytes() == outside.read_bytes()
        assert outside.stat().st_mtime == 1000  # never opened nor refreshed through the link
        elsewhere = tmp_path / "elsewhere"
        store.tier_dir.rename(elsewhere)
        store.tier_dir.symlink_to(elsewhere, target_is_directory=True)
        os.utime(elsewhere / tier_file.name, (1000, 1000))
        assert store.load(entry_id, touch=False)[1]["prompt"] == "request 0"
        assert (elsewhere / tier_file.name).stat().st_mtime == 1000 and store.stats()["local_tier"]["files"] == 0
    finally:
        store.close()

def test_damaged_and_hostile_rows_are_quarantined(url, tmp_path, pg, caplog):
    a, b = _open(url, tmp_path, "a"), _open(url, tmp_path, "b")
    db = url.rsplit("/", 1)[1]
    try:
        ids = [a.add(sh.embedding(i), sh.entry_masks(i), _meta(i)) for i in range(6)]
        good = a.load(ids[5], touch=False)
        _wait_until(lambda: len(b) == 6, 1.0, "fed")
        other = sh.entry_masks(0)
        from chorus.cache_store.entry_format import encode_entry
        import hashlib

        forged = encode_entry(sh.embedding(99), other, _meta(0))  # a valid entry, another embedding
        garbage = b"\x08\x00\x00\x00\x00\x00\x00\x00{}" + os.urandom(64)
        wrong_sig = encode_entry(sh.embedding(3), other, {"signature": sh.signature(block_size=64)})
        # data cut short (its nbytes and sha256 stale: refused by the size guard before a byte is
        # fetched), and garbage with its own sha256 and size (the sha256 the change announced differs)
        pg.sql("UPDATE chorus_entries SET data = substring(data from 1 for 100) WHERE id=%s", db, (ids[0],))
        pg.sql("UPDATE chorus_entries SET data = %s, sha256 = %s, nbytes = %s WHERE id=%s", db,
               (garbage, hashlib.sha256(garbage).hexdigest(), len(garbage), ids[1]))
        for entry_id in ids[:2]:
            with pytest.raises(CorruptEntryError):
                b.load(entry_id)
        # valid entries with consistent sha256 and size, but another embedding or signature than their row
        for entry_id, data in ((ids[2], forged), (ids[3], wrong_sig)):
            pg.sql("UPDATE chorus_entries SET data = %s, sha256 = %s, nbytes = %s WHERE id=%s", db,
                   (data, hashlib.sha256(data).hexdigest(), len(data), entry_id))
        c = _open(url, tmp_path, "c")  # loaded after the tampering: knows the forged sha256s
        for entry_id in ids[2:4]:
            with pytest.raises(CorruptEntryError):
                c.load(entry_id)
        # a hostile row appended with its change: an embedding of the wrong size never reaches an index
        with fleet_pg.connect(url) as conn:
            bad_id = conn.execute(
                "INSERT INTO chorus_entries(workspace, sig_key, sha256, nbytes, embedding, meta_json, data, created, "
                "last_used) VALUES('w', %s, %s, 1, %s, '{}', 'z', 0, 0) RETURNING id", ("a" * 32, "b" * 64, b"\x00" * 7)
            ).fetchone()[0]
            seq = conn.execute("UPDATE chorus_workspaces SET seq = seq + 1 WHERE name='w' RETURNING seq").fetchone()[0]
            conn.execute("INSERT INTO chorus_changes VALUES('w', %s, 'a', %s, 0)", (seq, bad_id))
            conn.execute("SELECT pg_notify('chorus_changes', 'w')")
        _wait_until(lambda: {e["id"] for e in a.quarantined()} >= {*ids[:4], bad_id}, 5.0, "hostile row quarantined")
        for store in (a, b, c):
            _wait_until(lambda: store.known_ids() == ids[4:], 2.0, "quarantined rows left every index")
            assert all(store.search(sh.embedding(i))[0][0] in ids[4:] for i in range(4))
        assert b.load(ids[5], touch=False)[1] == good[1]  # the others are untouched
        pg.sql("UPDATE chorus_entries SET data = substring(data from 1 for 50) WHERE id=%s", db, (ids[4],))
        report = a.verify()
        assert not report["ok"] and [d["id"] for d in report["damaged"]] == [ids[4]] and report["index_consistent"]
        reasons = {q["id"]: q["reason"] for q in b.quarantined()}
        assert "row data has 100 bytes" in reasons[ids[0]] and "differs from the one its change announced" in reasons[ids[1]]
        assert "embedding does not match" in reasons[ids[2]] and "signature does not match" in reasons[ids[3]]
        assert "embedding" in reasons[bad_id], reasons
        c.close()
    finally:
        a.close()
        b.close()


# -- crashes and bounded waits --------------------------------------------------------------

def test_server_sigkilled_mid_commit(url, tmp_path, pg, monkeypatch):
    """PostgreSQL SIGKILLed while a write transaction is open (the row inserted, not committed),
    then at random moments under a steady writer: no partial entry is ever visible, every entry
    reported committed survives, and both workers reconnect by themselves."""
    a, b = _open(url, tmp_path, "a"), _open(url, tmp_path, "b")
    try:
        first = a.add(sh.embedding(0), _big_masks(0), _big_meta(0))
        in_commit, release = threading.Event(), threading.Event()

        def hook(phase):
            if phase == "before_commit" and not in_commit.is_set():
                in_commit.set()
                release.wait(20)

        monkeypatch.setattr(seams, "fleet_phase", hook)
        outcome = {}

        def write():
            try:
                outcome["id"] = a.add(sh.embedding(1), _big_masks(1), _big_meta(1))
            except Exception as exc:  # noqa: BLE001 - expected: the server died mid-commit
                outcome["error"] = exc

        t = threading.Thread(target=write)
        t.start()
        assert in_commit.wait(20)
        pg.kill()
        release.set()
        t.join(30)
        assert isinstance(outcome.get("error"), StoreUnavailableError), outcome
        pg.start()
        monkeypatch.setattr(seams, "fleet_phase", lambda phase: None)
        # the steady writer: entries of ~32 KB, the server killed at random moments 3 times
        committed, stop = {0: first}, threading.Event()

        def steady():
            seed = 10
            while not stop.is_set():
                try:
                    committed[seed] = a.add(sh.embedding(seed), _big_masks(seed), _big_meta(seed))
                except StoreUnavailableError:
                    time.sleep(0.05)  # the server is down: the store reconnects on the next call
                seed += 1

        w = threading.Thread(target=steady)
        w.start()
        rng = random.Random(3)
        for _ in range(3):
            time.sleep(rng.uniform(0.3, 1.0))
            pg.kill()
            time.sleep(rng.uniform(0.1, 0.5))
            pg.start()
        time.sleep(0.5)
        stop.set()
        w.join(30)
        assert len(committed) > 5, committed
        rows = {e["id"]: e["meta"]["prompt"] for e in a.entries()}
        for seed, entry_id in committed.items():
            assert rows.get(entry_id) == f"request {seed}", (seed, entry_id)  # reported committed: never lost
        assert "request 1" not in rows.values()  # the transaction killed mid-commit left nothing
        _wait_until(lambda: set(b.known_ids()) == set(rows), 10.0, "the other worker reconnected and caught up")
        report = b.verify()
        assert report["ok"] and report["index_consistent"] and report["checked"] == len(rows), report
        for entry_id in rows:
            b.load(entry_id, touch=False)
    finally:
        a.close()
        b.close()


def test_bounded_wait_when_the_server_stops_answering(url, tmp_path, pg):
    """The server freezes (SIGSTOP of the worker's backend and of the postmaster): the call returns
    within its deadlines (the ping's, then connect_timeout) with StoreUnavailableError instead of
    hanging, and the next call (server answering again) reconnects and works."""
    store = _open(url, tmp_path, "a", listen=False)
    try:
        entry_id = store.add(sh.embedding(0), sh.entry_masks(0), _meta(0))
        store.tier.drop(entry_id)
        backends = [store.with_connection(lambda conn: conn.execute("SELECT pg_backend_pid()").fetchone()[0], read=read)
                    for read in (False, True)]  # its write and read connections
        frozen = [*backends, pg.postmaster_pid()]  # its backends and the postmaster (no new connection either)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            with pytest.raises(StoreUnavailableError) as err:
                store.load(entry_id, touch=False)
            elapsed = time.monotonic() - t
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        assert elapsed < fleet_conn.CONNECT_TIMEOUT_S * 2 + 4, elapsed
        assert str(err.value).startswith("PostgreSQL"), err.value
        assert store.load(entry_id, touch=False)[1]["prompt"] == "request 0"
    finally:
        store.close()


# -- security -------------------------------------------------------------------------------

def test_credentials_never_shown_and_sources(url, tmp_path, pg, monkeypatch, caplog):
    """Password from the URL, PGPASSWORD or a pgpass file; never in messages, logs, stats or repr;
    sslmode passes through to libpq; statements are parameterised (hostile metadata is data)."""
    db = url.rsplit("/", 1)[1]
    secret = "s3cr3t-Pa55"
    pg.sql(f"CREATE ROLE chorus_pw LOGIN PASSWORD '{secret}'")
    try:
        pg.sql("GRANT ALL ON SCHEMA public TO chorus_pw", db)
        caplog.set_level(logging.DEBUG, logger="chorus")
        base = f"127.0.0.1:{pg.port}/{db}"
        store = FleetStore.open(f"postgresql://chorus_pw:{secret}@{base}", "w", local_path=tmp_path / "a" / "w")
        hostile = {"signature": sh.signature(), "prompt": "x'); DROP TABLE chorus_entries; --"}
        entry_id = store.add(sh.embedding(0), sh.entry_masks(0), hostile)
        assert store.load(entry_id)[1]["prompt"] == hostile["prompt"]
        shown = repr(store) + json.dumps(store.stats(), default=str)
        pg.kill()
        pg.start()
        try:
            store.load(entry_id + 1)
        except (KeyError, StoreUnavailableError) as exc:
            shown += str(exc)
        store.close()
        for bad in (f"postgresql://chorus_pw:wrong-{secret}@{base}", f"postgresql://chorus_pw:{secret}@{base}?sslmode=require"):
            with pytest.raises(StoreUnavailableError) as err:
                FleetStore.open(bad, "w", local_path=tmp_path / "b" / "w")
            shown += str(err.value)
        assert "password authentication failed" in shown and "SSL" in shown  # sslmode reached libpq
        pgpass = tmp_path / "pgpass"
        pgpass.write_text(f"127.0.0.1:{pg.port}:{db}:chorus_pw:{secret}\n")
        pgpass.chmod(0o600)
        monkeypatch.setenv("PGPASSFILE", str(pgpass))
        with FleetStore.open(f"postgresql://chorus_pw@{base}", "w", local_path=tmp_path / "c" / "w") as store:
            assert len(store) == 1
        monkeypatch.delenv("PGPASSFILE")
        monkeypatch.setenv("PGPASSWORD", secret)
        with FleetStore.open(f"postgresql://chorus_pw@{base}", "w", local_path=tmp_path / "d" / "w") as store:
            assert len(store) == 1
            shown += repr(store) + json.dumps(store.stats(), default=str)
        done = sh.chorus_cli("cache", "stats", "--url", f"postgresql://chorus_pw:x{secret}@{base}", "--root",
                             str(tmp_path / "cli"))
        assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr
        shown += done.stdout + done.stderr
        logs = "\n".join(r.getMessage() for r in caplog.records)
        assert secret not in shown and secret not in logs, [line for line in (shown + logs).splitlines() if secret in line]
        assert pg.sql("SELECT to_regclass('chorus_entries') IS NOT NULL", db) == [(True,)]
    finally:
        pg.sql('DROP OWNED BY chorus_pw CASCADE', url.rsplit("/", 1)[1])
        pg.sql("DROP ROLE chorus_pw")


def _doc_blocks(lang: str) -> list[str]:
    text = DOCS.read_text()
    section = text[text.index("## Fleet"):]
    blocks, pos = [], 0
    while True:
        start = section.find(f"```{lang}\n", pos)
        if start < 0:
            return blocks
        end = section.index("```", start + len(lang) + 4)
        blocks.append(section[start + len(lang) + 4:end])
        pos = end + 3


def test_least_privilege_sql_of_operations_md(pg, tmp_path):
    """docs/OPERATIONS.md (Fleet) as written: roles and schema, the tables created by the owner
    (the CLI), the grants; the worker role then runs the whole store and can do nothing more."""
    import psycopg

    sql = [b for b in _doc_blocks("sql") if "chorus_worker" in b]
    assert len(sql) == 2, "expected the roles block and the grants block in docs/OPERATIONS.md"
    for role in ("chorus_owner", "chorus_worker"):
        pg.sql("DROP DATABASE IF EXISTS chorus")
        pg.sql(f"DROP ROLE IF EXISTS {role}")
    try:
        with psycopg.connect(pg.url("postgres"), autocommit=True) as conn:
            for statement in _statements(sql[0]):
                conn.execute(statement)
        setup = [b for b in _doc_blocks("bash") if "CREATE SCHEMA" in b]
        assert len(setup) == 1, "the schema and tables step in docs/OPERATIONS.md"
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{pg.bin}:{os.environ['PATH']}",
                   CHORUS_CACHE_DIR=str(tmp_path / "owner_tier"))
        env.pop("CHORUS_CACHE_URL", None)
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", setup[0].replace("db.internal", f"127.0.0.1:{pg.port}")],
                              env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
        assert done.returncode == 0, done.stdout + done.stderr
        with psycopg.connect(pg.url("chorus"), autocommit=True) as conn:
            for statement in _statements(sql[1]):
                conn.execute(statement)
        worker = pg.url("chorus", user="chorus_worker")
        a = FleetStore.open(worker, "default", local_path=tmp_path / "a" / "default")
        b = FleetStore.open(worker, "other", local_path=tmp_path / "b" / "other")  # registers a workspace
        try:
            ids = [a.add_unique(sh.embedding(i), sh.entry_masks(i), _meta(i), min_similarity=0.9)[0] for i in range(4)]
            a.load(ids[0])
            a.set_limits(max_entries=3)
            assert a.prune() == [ids[1]] and a.remove(ids[3])
            assert a.verify()["ok"] and a.stats()["entries"] == 2 and b.stats()["entries"] == 0
            pg.sql("UPDATE chorus.chorus_entries SET data = 'x' WHERE id=%s", "chorus", (ids[2],))
            a.tier.drop(ids[2])  # else the intact local copy serves it
            with pytest.raises(CorruptEntryError):
                a.load(ids[2])  # the worker may quarantine
        finally:
            a.close()
            b.close()
        with psycopg.connect(worker, autocommit=True) as conn:
            for statement in ("CREATE TABLE chorus.evil(x int)", "DROP TABLE chorus.chorus_entries",
                              "TRUNCATE chorus.chorus_changes", "CREATE TABLE public.evil(x int)",
                              "DELETE FROM chorus.chorus_quarantine"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(statement)
    finally:
        pg.sql("DROP DATABASE IF EXISTS chorus")
        for role in ("chorus_worker", "chorus_owner"):
            pg.sql(f"DROP ROLE IF EXISTS {role}")


def _statements(block: str) -> list[str]:
    lines = [line.split("--", 1)[0] for line in block.splitlines()]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def test_backup_and_restore_of_operations_md(url, pg, tmp_path):
    """docs/OPERATIONS.md (Fleet) backup with pg_dump while a worker writes, restore with
    pg_restore into a new database: every entry of the dump loads and verifies there."""
    db = url.rsplit("/", 1)[1]
    store = _open(url, tmp_path, "a")
    try:
        ids = [store.add(sh.embedding(i), sh.entry_masks(i), _meta(i)) for i in range(3)]
        blocks = [b for b in _doc_blocks("bash") if "pg_dump" in b]
        assert blocks, "the backup commands in docs/OPERATIONS.md"
        env = dict(os.environ, PGHOST="127.0.0.1", PGPORT=str(pg.port), PGUSER="postgres",
                   PATH=f"{Path(sys.executable).parent}:{pg.bin}:{os.environ['PATH']}",
                   CHORUS_CACHE_DIR=str(tmp_path / "restored_tier"), BACKUP_DIR=str(tmp_path))
        script = blocks[0].replace("chorus-$(date +%F).dump", "$BACKUP_DIR/chorus.dump")
        script = script.replace("-d chorus ", f"-d {db} ").replace("chorus_restored", f"{db}_restored")
        script = script.replace("--workspace default", "--workspace w")
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True, text=True,
                              timeout=300, cwd=str(tmp_path))
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        store.close()
    with FleetStore.open(f"postgresql://postgres@127.0.0.1:{pg.port}/{db}_restored", "w",
                         local_path=tmp_path / "r" / "w") as restored:
        assert restored.known_ids() == ids and restored.verify()["ok"]
        assert all(restored.load(i, touch=False)[1]["prompt"] == f"request {n}" for n, i in enumerate(ids))
        new = restored.add(sh.embedding(9), sh.entry_masks(9), _meta(9))  # the id sequence was restored too
        assert new > ids[-1]


def test_cli_on_the_fleet_store(url, tmp_path):
    """``python -m chorus cache {stats,list,verify,prune,rebuild-index} --url`` on the fleet store."""
    with _open(url, tmp_path, "a", workspace="cli") as store:
        ids = [store.add(sh.embedding(i), sh.entry_masks(i), _meta(i)) for i in range(4)]
    root = str(tmp_path / "cli_root")
    common = ["--url", url, "--workspace", "cli", "--root", root, "--json"]
    stats = json.loads(sh.chorus_cli("cache", "stats", *common).stdout)
    assert stats["entries"] == 4 and stats["store"] == "fleet" and stats["indexed"] == 4
    listing = json.loads(sh.chorus_cli("cache", "list", *common).stdout)
    assert [e["id"] for e in listing] == ids and listing[0]["meta"]["prompt"] == "request 0"
    done = sh.chorus_cli("cache", "verify", *common)
    assert done.returncode == 0 and json.loads(done.stdout)["ok"], done.stdout + done.stderr
    pruned = json.loads(sh.chorus_cli("cache", "prune", *common, "--max-entries", "2").stdout)
    assert pruned == {"removed": ids[:2], "entries": 2}
    rebuilt = json.loads(sh.chorus_cli("cache", "rebuild-index", *common).stdout)
    assert rebuilt["entries"] == 2
    text = sh.chorus_cli("cache", "stats", "--url", url, "--workspace", "cli", "--root", root).stdout
    assert "entries: 2" in text
    bad = sh.chorus_cli("cache", "stats", "--url", url, "--path", root)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")


def test_standby_failover_of_operations_md(tmp_path):
    """docs/OPERATIONS.md (Fleet): a synchronous streaming standby (``pg_basebackup -R``), workers
    on a two-host URL with ``target_session_attrs=read-write``; the primary is SIGKILLed and the
    standby promoted (``pg_ctl promote``): every entry reported committed is there, the worker
    reconnects by itself and writes again, a worker started later sees everything."""
    fleet_pg.require()
    primary, standby, stores = fleet_pg.Cluster(), None, []
    try:
        primary.sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
        primary.sql("SELECT pg_reload_conf()")
        standby = fleet_pg.Cluster(primary=primary)
        _wait_until(lambda: primary.sql("SELECT sync_state FROM pg_stat_replication") == [("sync",)], 30,
                    "the standby streams synchronously")
        url = (f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"
               "?target_session_attrs=read-write")
        a = FleetStore.open(url, "w", local_path=tmp_path / "a" / "w")
        stores.append(a)
        ids = [a.add(sh.embedding(i), sh.entry_masks(i), _meta(i)) for i in range(5)]
        primary.kill()
        standby.promote()
        # as docs/OPERATIONS.md says: the promoted standby has no standby of its own yet, so its
        # commits must stop waiting for one (else every write hangs until the client's deadline)
        standby.sql("ALTER SYSTEM SET synchronous_standby_names = ''")
        standby.sql("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 30
        while True:
            try:
                new = a.add(sh.embedding(9), sh.entry_masks(9), _meta(9))
                break
            except StoreError:
                assert time.monotonic() < deadline, "the worker did not reach the promoted standby"
                time.sleep(0.2)
        assert standby.sql("SELECT pg_is_in_recovery()") == [(False,)]
        assert sorted(e["id"] for e in a.entries()) == ids + [new]  # nothing reported committed was lost
        late = FleetStore.open(url, "w", local_path=tmp_path / "b" / "w")
        stores.append(late)
        assert late.known_ids() == ids + [new] and late.verify()["ok"]
        _wait_until(lambda: a.known_ids() == ids + [new], 10, "the first worker's feed reconnected")
    finally:
        for store in stores:
            store.close()
        for cluster in (standby, primary):
            if cluster is not None:
                cluster.stop()


def test_large_workspace_serves_exact_then_swaps_in_hnsw(url, tmp_path, monkeypatch):
    """A worker opening a workspace past the approximate threshold serves from an exact index at
    once and swaps in HNSW partitions built in the background, with the feed's changes made
    during the build (held open here until the changes are in)."""
    writer = _open(url, tmp_path, "a", listen=False)
    ids = [writer.add(sh.embedding(i), sh.entry_masks(i), _meta(i)) for i in range(60)]
    release, real = threading.Event(), fleet_feed.PartitionedIndex

    def held(dim, threshold, *args, **kwargs):  # the background build waits after its snapshot
        if threshold == 20:
            release.wait(30)
        return real(dim, threshold, *args, **kwargs)

    monkeypatch.setattr(fleet_feed, "PartitionedIndex", held)
    reader = _open(url, tmp_path, "b", approx_threshold=20)
    try:
        assert [v["kind"] for v in reader.index_kinds().values()] == ["flat"] and reader.stats()["index_building"]
        assert reader.search(sh.embedding(7))[0][0] == ids[7]
        ids += [writer.add(sh.embedding(i), sh.entry_masks(i), _meta(i)) for i in range(60, 65)]
        assert writer.remove(ids[3]) and writer.remove(ids[61])
        live = sorted(set(ids) - {ids[3], ids[61]})
        _wait_until(lambda: reader.known_ids() == live, 5.0, "feed applied to the exact index")
        release.set()
        assert reader.wait_index(60)
        assert [v["kind"] for v in reader.index_kinds().values()] == ["hnsw"]
        assert reader.index_ids() == live
        for n, entry_id in enumerate(ids):
            if entry_id in live:
                assert reader.search(sh.embedding(n))[0][0] == entry_id
        assert reader.verify()["index_consistent"]
    finally:
        reader.close()
        writer.close()


def test_touch_sums_run_stats_fleet_wide_and_older_tables_get_the_columns(url, pg, tmp_path):
    """``touch(entry_id, run=)`` adds a hit's run stats to the entry's row, seen by every worker's
    ``entries()``; a bad one is refused before anything is counted. Tables made before the run stats
    get the columns when a handle that may alter them opens (read-only handles list zeros meanwhile)."""
    a, b = _open(url, tmp_path, "a"), _open(url, tmp_path, "b")
    try:
        ids = [a.add(sh.embedding(i), sh.entry_masks(i), _meta(i)) for i in range(2)]
        a.touch(ids[0], run={"sparse_calls": 160, "tail_calls": 160})
        b.touch(ids[0], run={"sparse_calls": 150, "fallback_calls": 10})
        with pytest.raises(ValueError):
            a.touch(ids[1], run={"tail": 1})
        got = {e["id"]: (e["hits"], e["runs"]) for e in b.entries()}
        assert got[ids[0]] == (2, {"sparse_calls": 310, "tail_calls": 160, "fallback_calls": 10})
        assert got[ids[1]] == (0, {"sparse_calls": 0, "tail_calls": 0, "fallback_calls": 0})
    finally:
        a.close()
        b.close()
    database = url.rsplit("/", 1)[1].split("?")[0]
    for name in ("sparse_calls", "tail_calls", "fallback_calls"):  # the table as made before run stats
        pg.sql(f"ALTER TABLE chorus_entries DROP COLUMN {name}", database)
    ro = _open(url, tmp_path, "r", readonly=True)
    try:
        assert [e["runs"]["tail_calls"] for e in ro.entries()] == [0, 0]
    finally:
        ro.close()
    c = _open(url, tmp_path, "c")
    try:
        c.touch(ids[1], run={"tail_calls": 3})
        got = {e["id"]: (e["hits"], e["runs"]["tail_calls"]) for e in c.entries()}
        assert got == {ids[0]: (2, 0), ids[1]: (1, 3)} and c.verify()["ok"]
    finally:
        c.close()


def test_hits_and_run_stats_of_a_flush_cut_mid_way_stay_pending_and_count_once(url, pg, tmp_path):
    """A flush of pending hits and run stats cut mid-way (its transaction has updated the first row
    and waits for another session's lock on the next): its connection terminated, then PostgreSQL
    SIGKILLed. Nothing is half-counted; the hits (a ``load``'s from the local tier meanwhile too) and
    run stats stay pending together and are counted exactly once when the server answers again."""
    import psycopg

    db = url.rsplit("/", 1)[1].split("?")[0]
    flush_waits = ("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = 'chorus-fleet' "
                   "AND wait_event_type = 'Lock'")
    zeros = {"sparse_calls": 0, "tail_calls": 0, "fallback_calls": 0}
    store = _open(url, tmp_path, "a", listen=False, timeout=30)  # the flush waits for the row lock until cut
    counted = lambda: {e["id"]: (e["hits"], e["runs"]) for e in store.entries()}  # noqa: E731

    def cut_mid_flush(entry_id, run, cut):
        """Another session locks ``entry_id``'s row; ``touch(entry_id, run=run)`` flushes everything
        pending (in id order) and waits on that row; ``cut()`` ends the flush. Returns touch's error."""
        holder = fleet_pg.connect(url)
        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM chorus_entries WHERE id = %s FOR UPDATE", (entry_id,))
        outcome = {}
        flush = threading.Thread(target=lambda: outcome.update(error=fleet_pg.raised(lambda: store.touch(entry_id, run=run))))
        flush.start()
        try:
            _wait_until(lambda: pg.sql(flush_waits, db, (db,))[0][0] == 1, 10.0, "the flush waits for the row lock")
            if entry_id != ids[0]:  # the flush holds ids[0]'s row: updated before it waited
                with pytest.raises(psycopg.errors.LockNotAvailable):
                    pg.sql("SELECT 1 FROM chorus_entries WHERE id = %s FOR UPDATE NOWAIT", db, (ids[0],))
            cut()
            flush.join(30)
        finally:
            holder.close()
        assert not flush.is_alive()
        return outcome["error"]

    try:
        ids = [store.add(sh.embedding(i), sh.entry_masks(i), _meta(i)) for i in range(2)]

        def terminate():  # the flush's connection: the handle's write connection
            pg.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                   "AND application_name = 'chorus-fleet'", db, (db,))

        error = cut_mid_flush(ids[0], {"sparse_calls": 40, "tail_calls": 30}, terminate)
        assert isinstance(error, StoreUnavailableError), error
        assert counted() == {ids[0]: (0, zeros), ids[1]: (0, zeros)}

        error = cut_mid_flush(ids[1], {"sparse_calls": 20, "fallback_calls": 4}, pg.kill)
        try:
            assert isinstance(error, StoreUnavailableError), error
            assert store.load(ids[0])[1]["prompt"] == "request 0"  # from the local tier; its hit stays pending
        finally:
            pg.start()
        assert counted() == {ids[0]: (0, zeros), ids[1]: (0, zeros)}  # the killed transaction counted nothing

        store.touch(ids[1], run={"tail_calls": 1})  # the server answers again: everything pending, once
        want = {ids[0]: (2, {"sparse_calls": 40, "tail_calls": 30, "fallback_calls": 0}),
                ids[1]: (2, {"sparse_calls": 20, "tail_calls": 1, "fallback_calls": 4})}
        assert counted() == want
    finally:
        store.close()
    rows = pg.sql("SELECT id, hits, sparse_calls, tail_calls, fallback_calls FROM chorus_entries ORDER BY id", db)
    assert [tuple(r) for r in rows] == [(ids[0], 2, 40, 30, 0), (ids[1], 2, 20, 1, 4)]  # close counted nothing again
