"""Crash safety, concurrent writers and corruption handling of cache_store.workspace.

Writers run in child processes forked from a forkserver that has imported the store once
(``cache_helpers.forkserver_context``: a fresh interpreter per trial would spend ~2 s importing torch
and faiss), and are SIGKILLed.
"""

import os
import random
import signal
import time

import pytest
import torch

import cache_helpers
from cache_helpers import SIGNATURE, embedding, small_masks
from chorus.cache_store import CorruptEntryError, Workspace

MASK_KW = {"layers": 6, "heads": 8, "qb": 64, "kb": 200}  # ~0.5 MB raw per entry: writes take a few ms


@pytest.fixture(scope="module")
def ctx():
    return cache_helpers.forkserver_context()


def _check_consistent(path, reported, checked=None):
    """Every reported id is present and loads exactly; every present entry is whole; verify is clean.
    Entries in ``checked`` (ids loaded by an earlier call) are not loaded again (verify still reads them)."""
    checked = set() if checked is None else checked
    with Workspace.open(path) as ws:
        present = {e["id"]: e["meta"]["seed"] for e in ws.entries()}
        for entry_id, seed in reported:
            assert present.get(entry_id) == seed, (entry_id, seed)
        for entry_id, seed in present.items():
            if entry_id in checked:
                continue
            checked.add(entry_id)
            masks, meta = ws.load(entry_id, touch=False)
            expected = small_masks(seed, **MASK_KW)
            assert set(masks) == set(expected) and all(torch.equal(masks[k], expected[k]) for k in expected)
            assert ws.search(embedding(seed), k=1)[0][0] == entry_id
        report = ws.verify()
        assert report["ok"] and report["index_consistent"], report
        assert not [p for p in (path / "entries").iterdir() if p.name.startswith(".tmp-")]
        assert len(list((path / "entries").iterdir())) == len(present)
        return present


@pytest.mark.parametrize("phase", ["temp_written", "renamed", "file_durable", "before_commit", "committed"])
def test_kill_at_each_write_phase(tmp_path, ctx, phase):
    """SIGKILL exactly between two steps of the write protocol: the entry is whole or absent."""
    path = tmp_path / "ws"
    Workspace.open(path).close()
    proc = ctx.Process(target=cache_helpers.writer, args=(str(path), [1, 2]),
                       kwargs={"crash_phase": phase, "mask_kwargs": MASK_KW})
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    present = _check_consistent(path, [])
    assert len(present) == (1 if phase == "committed" else 0)


def test_sigkill_writer_at_random_moments(tmp_path, ctx):
    """>= 20 trials: a writer adding entries in a loop is SIGKILLed at a random moment."""
    rng = random.Random(1234)
    path = tmp_path / "ws"
    Workspace.open(path).close()
    seed = 0
    all_reported = []
    checked = set()
    for trial in range(24):
        seeds = list(range(seed, seed + 200))
        seed += 200
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=cache_helpers.writer, args=(str(path), seeds, child),
                           kwargs={"mask_kwargs": MASK_KW})
        proc.start()
        child.close()
        assert parent.recv()[0] == "ready"
        pending = []
        if trial % 3 == 2:  # every third trial kills after at least one commit, so kills also land mid-stream
            while True:
                kind, value = parent.recv()
                if kind == "committed":
                    pending.append(value)
                    break
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        all_reported.extend(pending)
        while parent.poll():
            try:
                kind, value = parent.recv()
            except EOFError:
                break
            if kind == "committed":
                all_reported.append(value)
        parent.close()
        _check_consistent(path, all_reported, checked)  # every reported commit present, nothing torn


def test_processes_creating_one_workspace_at_once(tmp_path, ctx):
    """Several workers opening a fresh workspace at the same moment all succeed (WAL switch and
    schema creation are serialised; this raised "database is locked" before)."""
    failures = []
    for trial in range(12):
        path = str(tmp_path / f"ws{trial}")
        barrier, results = ctx.Barrier(3), ctx.Queue()
        procs = [ctx.Process(target=cache_helpers.opener, args=(path, barrier, results)) for _ in range(3)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        failures += [o for o in outcomes if o != "ok"]
    assert not failures, failures[:3]


def test_two_writers_fifty_entries_each(tmp_path, ctx):
    path = tmp_path / "ws"
    Workspace.open(path).close()
    procs = [ctx.Process(target=cache_helpers.writer, args=(str(path), list(range(w * 1000, w * 1000 + 50))))
             for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with Workspace.open(path) as ws:
        entries = ws.entries()
        ids = [e["id"] for e in entries]
        assert len(ws) == 100 and len(set(ids)) == 100
        assert sorted(e["meta"]["seed"] for e in entries) == sorted(list(range(50)) + list(range(1000, 1050)))
        assert len({e["meta"]["writer"] for e in entries}) == 2
        st = ws.stats()
        assert st["indexed"] == 100 and st["generation"] == 100
        for e in entries[::7]:
            assert ws.search(embedding(e["meta"]["seed"]), k=1)[0][0] == e["id"]
        assert ws.verify()["index_consistent"]


def _corrupt(path, how):
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip_payload":
        b = bytearray(data)
        b[len(b) - 20] ^= 0x10
        path.write_bytes(bytes(b))
    elif how == "flip_header":
        b = bytearray(data)
        b[12] ^= 0x01
        path.write_bytes(bytes(b))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "delete":
        path.unlink()


@pytest.mark.parametrize("how", ["truncate", "flip_payload", "flip_header", "empty", "delete"])
def test_corrupt_entry_is_quarantined_and_search_goes_on(tmp_path, how, caplog):
    path = tmp_path / "ws"
    with Workspace.open(path) as ws:
        ids = [ws.add(embedding(s), small_masks(s), {"signature": SIGNATURE, "seed": s}) for s in range(6)]
        victim = ids[2]
        victim_file = ws.entry_path(victim)
        _corrupt(victim_file, how)
        assert ws.search(embedding(2), k=1)[0][0] == victim  # not detected until read
        with pytest.raises(CorruptEntryError):
            ws.load(victim)
        assert "quarantining entry" in caplog.text
        assert len(ws) == 5 and all(e != victim for e, _ in ws.search(embedding(2), k=10))
        assert ws.search(embedding(3), k=1)[0][0] == ids[3]
        q = ws.stats()["quarantined"]
        assert [d["id"] for d in q] == [victim]
        if how != "delete":
            assert (path / "quarantine" / victim_file.name).exists() and not victim_file.exists()
        masks, _ = ws.load(ids[3])
        assert all(torch.equal(masks[k], v) for k, v in small_masks(3).items())
    with Workspace.open(path) as ws:  # after a restart
        assert len(ws) == 5 and ws.verify()["ok"] and ws.stats()["quarantined"][0]["id"] == victim


def test_verify_finds_damage(tmp_path):
    path = tmp_path / "ws"
    with Workspace.open(path) as ws:
        ids = [ws.add(embedding(s), small_masks(s), {"signature": SIGNATURE}) for s in range(5)]
        for victim, how in ((ids[0], "flip_payload"), (ids[4], "truncate")):
            _corrupt(ws.entry_path(victim), how)
        (path / "entries" / f".tmp-123-{'ab' * 16}").write_bytes(b"partial")  # names the store makes
        (path / "entries" / f"{'cd' * 16}.safetensors").write_bytes(b"x")
        (path / "entries" / "orphan.safetensors").write_bytes(b"x")  # a name it never makes: left alone
        report = ws.verify()
        assert not report["ok"] and sorted(d["id"] for d in report["damaged"]) == [ids[0], ids[4]]
        assert report["temp_files_removed"] == 1 and report["orphans_removed"] == 1
        assert report["stray"] == ["entries/orphan.safetensors"]
        assert (path / "entries" / "orphan.safetensors").exists()
        assert report["index_consistent"] and len(ws) == 3
        assert ws.verify()["ok"]


def test_writer_lock_blocks_a_second_writer(tmp_path):
    """While one process holds the writer lock, another handle's add waits at most the time bound and
    raises StoreBusyError (an OSError) having written nothing (the lock is cross-process)."""
    from filelock import FileLock

    from chorus.cache_store.errors import StoreBusyError

    path = tmp_path / "ws"
    ws = Workspace.open(path, timeout=0.3)
    other = FileLock(str(path / "write.lock"), timeout=0.2)
    with other:  # a different FileLock object on the same file behaves as another process
        with pytest.raises(StoreBusyError, match="writers' lock"):
            ws.add(embedding(1), small_masks(1), {"signature": SIGNATURE})
        assert list((path / "entries").iterdir()) == []
    assert ws.add(embedding(1), small_masks(1), {"signature": SIGNATURE}) == 1
    assert len(list((path / "entries").iterdir())) == 1
    ws.close()
