"""Workspace API, retrieval exactness/recall, persistence, eviction and entry size (cache_store.workspace/index)."""

import numpy as np
import pytest
import torch

from cache_helpers import DIM, SIGNATURE, clustered, embedding, small_masks
from chorus.cache_store import Workspace, signature_key
from chorus.cache_store.index import PartitionedIndex
from chorus.cache_store.synthetic import structured_masks

SIG_B = {**SIGNATURE, "variant": "other"}


def _brute_force(x: np.ndarray, q: np.ndarray, k: int) -> list[int]:
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    qn = q / np.linalg.norm(q)
    sims = xn.astype(np.float64) @ qn.astype(np.float64)
    return list(np.argsort(-sims, kind="stable")[:k])


def _fill(ws, n, sig_of=lambda i: SIGNATURE, seed0=0):
    ids, vecs = [], []
    for i in range(n):
        v = embedding(seed0 + i)
        ids.append(ws.add(v, small_masks(seed0 + i, layers=1), {"signature": sig_of(i), "seed": seed0 + i}))
        vecs.append(v)
    return ids, np.stack(vecs)


def test_api_roundtrip(tmp_path):
    with Workspace.open(tmp_path / "ws") as ws:
        assert len(ws) == 0 and ws.search(embedding(0), k=3) == []
        masks = small_masks(7)
        entry_id = ws.add(embedding(7), masks, {"signature": SIGNATURE, "prompt": "a red fox"})
        assert len(ws) == 1
        [(found, sim)] = ws.search(embedding(7), k=5)
        assert found == entry_id and sim == pytest.approx(1.0, abs=1e-5)
        loaded, meta = ws.load(entry_id)
        assert meta["signature"] == SIGNATURE and meta["prompt"] == "a red fox"
        assert set(loaded) == set(masks) and all(torch.equal(loaded[k], masks[k]) for k in masks)
        packed, _ = ws.load(entry_id, packed=True)
        assert all(torch.equal(packed[k].unpack(), masks[k]) for k in masks)
        st = ws.stats()
        assert st["entries"] == 1 and st["hits"] == 2 and st["dim"] == DIM and st["indexed"] == 1
        assert ws.remove(entry_id) and not ws.remove(entry_id)
        assert len(ws) == 0 and ws.search(embedding(7)) == []
        with pytest.raises(KeyError):
            ws.load(entry_id)


def test_bad_input_raises_value_error(tmp_path, monkeypatch):
    with Workspace.open(tmp_path / "ws") as ws:
        good = small_masks(0)
        ws.add(embedding(0), good, {"signature": SIGNATURE})
        for emb, masks, meta, match in [
            (embedding(1), good, {"prompt": "x"}, "signature"),
            (embedding(1), good, {"signature": "wan"}, "signature"),
            (np.full(DIM, np.nan), good, {"signature": SIGNATURE}, "NaN"),
            (np.zeros(DIM), good, {"signature": SIGNATURE}, "zero"),
            (np.ones(DIM + 1), good, {"signature": SIGNATURE}, "dim"),
            (embedding(1), {}, {"signature": SIGNATURE}, "non-empty"),
        ]:
            with pytest.raises(ValueError, match=match):
                ws.add(emb, masks, meta)
        synced = []
        with monkeypatch.context() as patch:
            patch.setattr(ws, "_sync_index", lambda: synced.append(1))
            for bad_k in (0, -1, 1.5, True):
                with pytest.raises(ValueError, match="k must be an int >= 1"):
                    ws.search(embedding(0), k=bad_k)
        assert not synced  # refused before reading the database
        with pytest.raises(ValueError, match="dim"):
            ws.search(np.ones(DIM + 3))
        assert len(ws) == 1 and ws.verify()["ok"]
    with pytest.raises(ValueError):
        Workspace.open(tmp_path / "ws", eviction="random")


def test_exact_against_brute_force_and_signature_filter(tmp_path):
    with Workspace.open(tmp_path / "ws") as ws:
        ids, x = _fill(ws, 60, sig_of=lambda i: SIGNATURE if i % 3 else SIG_B)
        sig_b_rows = [i for i in range(60) if i % 3 == 0]
        for qseed in range(1000, 1020):
            q = embedding(qseed)
            got = ws.search(q, k=5)
            assert [e for e, _ in got] == [ids[i] for i in _brute_force(x, q, 5)]
            xn = x / np.linalg.norm(x, axis=1, keepdims=True)
            sims = [float(xn[ids.index(e)] @ (q / np.linalg.norm(q))) for e, _ in got]
            np.testing.assert_allclose([s for _, s in got], sims, atol=1e-5)
            got_b = ws.search(q, k=4, signature=SIG_B)
            assert [e for e, _ in got_b] == [ids[sig_b_rows[j]] for j in _brute_force(x[sig_b_rows], q, 4)]
            assert ws.search(q, k=4, signature=signature_key(SIG_B)) == got_b
        assert ws.search(embedding(1), signature={"family": "nothing"}) == []


def test_reopen_gives_same_results_and_index_is_rebuildable(tmp_path):
    path = tmp_path / "ws"
    queries = [embedding(5000 + i) for i in range(10)]
    with Workspace.open(path) as ws:
        _fill(ws, 40)
        for i in (3, 7, 11):
            ws.remove(i)
        before = [ws.search(q, k=4) for q in queries]
    assert list(path.glob("index.g*.safetensors")), "close() saves the index"
    with Workspace.open(path) as ws:
        assert [ws.search(q, k=4) for q in queries] == before
    for f in path.glob("index.g*.safetensors"):
        f.unlink()  # missing index -> rebuilt from SQLite
    with Workspace.open(path) as ws:
        assert [ws.search(q, k=4) for q in queries] == before
    for f in path.glob("index.g*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])  # corrupt index file -> ignored, rebuilt
    with Workspace.open(path) as ws:
        assert [ws.search(q, k=4) for q in queries] == before
        assert ws.verify()["index_consistent"]


def test_stale_index_and_second_process_view_catch_up(tmp_path):
    path = tmp_path / "ws"
    with Workspace.open(path) as ws:
        _fill(ws, 10)
        ws.save_index()
    stale = sorted(path.glob("index.g*.safetensors"))
    a, b = Workspace.open(path), Workspace.open(path)  # two independent handles, as two processes
    new_ids, _ = _fill(a, 5, seed0=100)
    a.remove(2)
    for i, entry_id in enumerate(new_ids):
        assert b.search(embedding(100 + i), k=1)[0][0] == entry_id  # b catches up through SQLite's generation
    assert all(e != 2 for e, _ in b.search(embedding(2), k=20))
    a.close()
    b.close()
    assert not any(f.exists() for f in stale), "older index files are dropped when a newer one is saved"
    with Workspace.open(path) as c:
        assert c.stats()["indexed"] == 14 and c.verify()["index_consistent"]


def test_stale_index_file_is_caught_up(tmp_path):
    path = tmp_path / "ws"
    with Workspace.open(path) as ws:
        _fill(ws, 10)
        old = ws.save_index().read_bytes()
        _fill(ws, 5, seed0=50)
        ws.remove(1)
    for f in path.glob("index.g*.safetensors"):
        f.unlink()
    (path / "index.g10.safetensors").write_bytes(old)  # only a stale file is left
    with Workspace.open(path) as ws:
        assert ws.stats()["indexed"] == 14
        assert ws.search(embedding(52), k=1)[0][0] == 13
        assert all(e != 1 for e, _ in ws.search(embedding(1), k=20))


def test_index_file_of_another_database_is_not_used(tmp_path):
    """Deleting chorus.sqlite3 restarts entry ids; a leftover index file must not map them to old vectors."""
    path = tmp_path / "ws"
    with Workspace.open(path) as ws:
        _fill(ws, 8)
    (path / "chorus.sqlite3").unlink()
    for extra in ("chorus.sqlite3-wal", "chorus.sqlite3-shm"):
        (path / extra).unlink(missing_ok=True)
    with Workspace.open(path) as ws:
        ids, x = _fill(ws, 3, seed0=500)
    with Workspace.open(path) as ws:  # the old index.g8 file is ignored; the new one is used
        for i, entry_id in enumerate(ids):
            [(found, sim)] = ws.search(x[i], k=1)
            assert found == entry_id and sim == pytest.approx(1.0, abs=1e-5)
        assert ws.verify()["orphans_removed"] == 8
    assert not (path / "index.g8.safetensors").exists()


def test_approximate_index_recall_and_switch():
    """Past approx_threshold a partition becomes HNSW; recall@1 against exact flat search >= 0.99."""
    dim, n = 64, 3000
    x = clustered(n, dim, clusters=150, spread=0.6, seed=1)
    rng = np.random.default_rng(2)
    picks = rng.integers(0, n, 400)
    queries = x[picks] + 0.15 * rng.normal(size=(400, dim)).astype(np.float32) / np.sqrt(dim)
    approx = PartitionedIndex(dim, approx_threshold=1000)
    exact = PartitionedIndex(dim, approx_threshold=10**9)
    for start in range(0, n, 500):
        ids = np.arange(start, start + 500)
        approx.add("s", ids, x[ids])
        exact.add("s", ids, x[ids])
    assert approx.kinds()["s"]["kind"] == "hnsw" and exact.kinds()["s"]["kind"] == "flat"
    truth = [exact.search(q, 1)[0][0] for q in queries]
    assert truth == [_brute_force(x, q, 1)[0] for q in queries]
    recall = np.mean([approx.search(q, 1)[0][0] == t for q, t in zip(queries, truth)])
    assert recall >= 0.99, recall
    # HNSW deletes by tombstones; removed ids never come back; many removals trigger a rebuild.
    removed = list(range(0, 1500, 2))
    approx.remove(removed)
    exact.remove(removed)
    assert approx.kinds()["s"]["kind"] == "hnsw" and approx.kinds()["s"]["tombstones"] == 0  # rebuilt
    res = [approx.search(q, 3) for q in queries[:100]]
    assert all(e not in set(removed) for r in res for e, _ in r)
    truth = [exact.search(q, 1)[0][0] for q in queries]
    recall = np.mean([approx.search(q, 1)[0][0] == t for q, t in zip(queries, truth)])
    assert recall >= 0.99, recall
    # Below half the threshold it switches back to exact search.
    approx.remove(list(range(1, 3000, 2)) + list(range(1500, 2100, 2)))  # 2250 -> 450 live < 1000 / 2
    assert approx.kinds()["s"] == {"kind": "flat", "entries": 450, "tombstones": 0}
    blob, gen = approx.to_bytes(7), 7
    again, g = PartitionedIndex.from_bytes(blob)
    assert g == gen and again.search(queries[0], 5) == approx.search(queries[0], 5)


def test_hnsw_tombstones_filter_results():
    dim = 16
    x = clustered(400, dim, clusters=20, spread=0.5, seed=4)
    idx = PartitionedIndex(dim, approx_threshold=100)
    idx.add("s", np.arange(400), x)
    idx.remove([5, 6, 7])
    assert idx.kinds()["s"]["tombstones"] == 3
    for i in (5, 6, 7):
        assert all(e not in (5, 6, 7) for e, _ in idx.search(x[i], 10))
    again, _ = PartitionedIndex.from_bytes(idx.to_bytes(1))  # tombstones are re-derived by the workspace
    assert 5 in again.where


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction(tmp_path, policy):
    with Workspace.open(tmp_path / "ws", max_entries=5, eviction=policy) as ws:
        ids, _ = _fill(ws, 5)
        ws.load(ids[0])  # a hit: most recently used, and most frequently used
        ws.load(ids[0])
        ws.touch(ids[2])
        new_id = ws.add(embedding(99), small_masks(99), {"signature": SIGNATURE})
        present = {e["id"] for e in ws.entries()}
        assert len(ws) == 5 and new_id in present and ids[0] in present
        assert ids[1] not in present  # least recently / least frequently used
        assert ws.stats()["indexed"] == 5
        entry_bytes = max(e["nbytes"] for e in ws.entries())
        removed = ws.prune(max_bytes=2 * entry_bytes + 1)
        kept = {e["id"] for e in ws.entries()}
        # lru keeps the two most recently used (touched id 2, new id); lfu the two most hit (ids 0, 2)
        assert len(removed) == 3 and kept == ({ids[2], new_id} if policy == "lru" else {ids[0], ids[2]})
        assert ws.verify()["ok"] and not list((tmp_path / "ws" / "entries").glob(".tmp-*"))
        assert len(list((tmp_path / "ws" / "entries").iterdir())) == 2


def test_limits_persist(tmp_path):
    Workspace.open(tmp_path / "ws", max_bytes=12345, max_entries=7, eviction="lfu").close()
    with Workspace.open(tmp_path / "ws") as ws:
        assert ws.limits() == {"max_bytes": 12345, "max_entries": 7, "eviction": "lfu"}


def test_wan14b_entry_fits_16mb(tmp_path):
    """40 layers x 40 heads x 4 steps of 256x256 blocks (Wan 14B, 480p, 81 frames) <= 16 MB on disk.

    Masks come from the structured attention-mass model of ``cache_store.synthetic`` (stated in
    docs/BENCHMARK_LOG.md); uniformly random maps of the same density would not compress this far.
    """
    masks = structured_masks(layers=40, heads=40, steps=4, seed=0)
    density = float(torch.stack([m.float().mean() for m in masks.values()]).mean())
    assert 0.05 < density < 0.4
    with Workspace.open(tmp_path / "ws") as ws:
        entry_id = ws.add(np.ones(512, dtype=np.float32), masks, {"signature": SIGNATURE})
        nbytes = ws.entry_path(entry_id).stat().st_size
        assert nbytes <= 16 * 10**6, nbytes
        loaded, _ = ws.load(entry_id, packed=True)
        sample = [("high", 0, 0, 0), ("low", 3, 39, 0), ("high", 1, 17, 0)]
        assert all(torch.equal(loaded[k].unpack(), masks[k]) for k in sample)
        assert len(loaded) == 160 and loaded[("low", 3, 39, 0)].shape == (1, 40, 256, 256)


def test_touch_sums_its_hits_run_stats_and_an_older_workspace_gets_the_columns(tmp_path):
    """``touch(entry_id, run=)`` adds the hit's run stats to the entry's (shown by ``entries()``); a bad
    one is refused before anything is counted; a workspace made before the run stats gets their columns
    (zeros) when opened writable, and a read-only handle of it lists zeros."""
    import sqlite3

    path = tmp_path / "ws"
    with Workspace.open(path) as ws:
        ids, _ = _fill(ws, 2)
        ws.touch(ids[0], run={"sparse_calls": 160, "tail_calls": 160})
        ws.touch(ids[0], run={"sparse_calls": 150, "tail_calls": 0, "fallback_calls": 10})
        ws.touch(ids[1])
        for bad in ({"tail": 1}, {"sparse_calls": -1}, {"sparse_calls": 1.5}, {"sparse_calls": True}, [1]):
            with pytest.raises(ValueError):
                ws.touch(ids[1], run=bad)
        got = {e["id"]: (e["hits"], e["runs"]) for e in ws.entries()}
    assert got[ids[0]] == (2, {"sparse_calls": 310, "tail_calls": 160, "fallback_calls": 10})
    assert got[ids[1]] == (1, {"sparse_calls": 0, "tail_calls": 0, "fallback_calls": 0})

    db = sqlite3.connect(str(path / "chorus.sqlite3"))  # the schema before run stats
    for name in ("sparse_calls", "tail_calls", "fallback_calls"):
        db.execute(f"ALTER TABLE entries DROP COLUMN {name}")
    db.commit()
    db.close()
    with Workspace.open(path, readonly=True) as ro:
        assert [e["runs"]["tail_calls"] for e in ro.entries()] == [0, 0] and [e["hits"] for e in ro.entries()] == [2, 1]
    with Workspace.open(path) as ws:
        ws.touch(ids[1], run={"tail_calls": 3})
        got = {e["id"]: (e["hits"], e["runs"]["tail_calls"]) for e in ws.entries()}
        assert got == {ids[0]: (2, 0), ids[1]: (2, 3)} and ws.verify()["ok"]


def test_hits_and_run_stats_of_a_failed_flush_stay_pending_and_count_once(tmp_path, caplog):
    """Hits (of ``load`` and ``touch``) and ``touch``'s run stats that cannot be written, because
    another connection holds SQLite's write lock or because the flush fails after its first row (a
    trigger refuses the second; the first row's update is rolled back), stay pending together and are
    counted exactly once by the next flush; ``close`` reports the hits it could not count."""
    import sqlite3

    from chorus.cache_store.errors import StoreBusyError, StoreError

    path = tmp_path / "ws"
    ws = Workspace.open(path, timeout=0.5)
    ids, _ = _fill(ws, 2)
    other = sqlite3.connect(str(path / "chorus.sqlite3"), isolation_level=None)
    zeros = {"sparse_calls": 0, "tail_calls": 0, "fallback_calls": 0}
    counted = lambda: {e["id"]: (e["hits"], e["runs"]) for e in ws.entries()}  # noqa: E731
    try:
        other.execute("BEGIN IMMEDIATE")  # another writer holds SQLite's write lock
        ws.load(ids[0])  # returns at once; its hit stays pending
        with pytest.raises(StoreBusyError):
            ws.touch(ids[1], run={"sparse_calls": 7, "tail_calls": 5})
        with pytest.raises(StoreBusyError):
            ws.touch(ids[0], run={"fallback_calls": 2})
        other.execute("ROLLBACK")
        assert counted() == {ids[0]: (0, zeros), ids[1]: (0, zeros)}

        other.execute(f"CREATE TRIGGER refuse BEFORE UPDATE OF hits ON entries WHEN NEW.id = {ids[1]} "
                      "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END")
        with pytest.raises(StoreError, match="refused by the test"):  # ids[0]'s row was updated first
            ws.touch(ids[0], run={"sparse_calls": 1})
        assert counted() == {ids[0]: (0, zeros), ids[1]: (0, zeros)}  # rolled back, nothing half-counted
        other.execute("DROP TRIGGER refuse")

        ws.load(ids[1])  # the lock is free: this hit's flush writes everything pending
        want = {ids[0]: (3, {"sparse_calls": 1, "tail_calls": 0, "fallback_calls": 2}),
                ids[1]: (2, {"sparse_calls": 7, "tail_calls": 5, "fallback_calls": 0})}
        assert counted() == want
        ws.close()  # nothing pending: counts nothing again
        with Workspace.open(path, readonly=True) as ro:
            assert {e["id"]: (e["hits"], e["runs"]) for e in ro.entries()} == want

        ws = Workspace.open(path, timeout=0.5)
        other.execute("BEGIN IMMEDIATE")
        ws.load(ids[0])
        ws.load(ids[1])
        ws.close()  # still locked: the two hits are reported, not counted
        assert f"2 hits of {path} not counted" in caplog.text
        other.execute("ROLLBACK")
    finally:
        ws.close()
        other.close()
