"""Fleet store benchmark (CPU, PostgreSQL on loopback) -> docs/BENCHMARK_LOG.md "Fleet store".

    python benchmarks/fleet_bench.py [--url postgresql://...] [--sizes 10000 100000] [--json OUT]

Without ``--url`` it starts a throwaway PostgreSQL cluster (``tests/fleet_pg.py``: initdb in a
temp dir, fsync on, 127.0.0.1) and removes it at the end. Measures, on this machine:

1. **entries of realistic size** (``cache_store/synthetic.py``: Wan 2.2 A14B, 81 frames, 4 steps,
   40 layers x 40 heads; 480p and 720p; the encoded bytes are cached in ``--cache-dir``):
   commit latency of the write transaction (insert + change log + notify + commit, the entry
   already encoded), the fetch of the bytes from PostgreSQL, a full ``load`` through
   PostgreSQL (fetch + sha256 + decode + local tier write) against a ``load`` from the local tier
   (read + sha256 + decode); the same commit and fetch with large objects instead of ``bytea``;
2. **a new worker's catch-up** at each size: ``FleetStore.open`` returns once the snapshot of
   every embedding is in an exact index (the worker serves from then on), and the approximate
   (HNSW) partitions are built in the background (``wait_index``), of ``--sizes`` (512-d embeddings, one signature: the worst case,
   one partition; rows bulk-loaded with COPY, each with the same small valid entry);
3. **search** p50/p99 at the largest size (k=4 as retrieval asks, 2000 queries) and the change
   feed's delay (commit returned on one worker -> in the other worker's index).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # fleet_pg: the throwaway cluster of the tests

GRIDS = {"480p": (21, 30, 52), "720p": (21, 45, 80)}
DIM = 512


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def ms(values):
    return {"p50_ms": round(pct(values, 50) * 1e3, 2), "p99_ms": round(pct(values, 99) * 1e3, 2),
            "max_ms": round(max(values) * 1e3, 2), "n": len(values)}


def entry_bytes(res: str, cache_dir: Path) -> bytes:
    """The encoded entry of one synthetic request (cached: 720p takes minutes to build)."""
    path = cache_dir / f"fleet_bench_{res}.safetensors"
    if path.exists():
        return path.read_bytes()
    import torch

    from chorus.cache_store.entry_format import encode_entry
    from chorus.cache_store.synthetic import structured_masks

    t = time.perf_counter()
    masks = structured_masks(layers=40, heads=40, steps=4, grid=GRIDS[res], seed=0)
    built = time.perf_counter() - t
    t = time.perf_counter()
    data = encode_entry(np.ones(DIM, np.float32), masks, {"signature": {"bench": res, "grid": list(GRIDS[res])}})
    print(f"  {res}: masks built in {built:.1f} s, encoded in {time.perf_counter() - t:.2f} s -> {len(data)} bytes",
          flush=True)
    del masks, torch
    cache_dir.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def bench_entries(url, tmp: Path, cache_dir: Path, n: int) -> dict:
    from chorus.cache_store.fleet import FleetStore
    from chorus.cache_store.entry_format import read_meta
    from chorus.cache_store.signature import signature_key
    from chorus.cache_store.entries import NewEntry

    out = {}
    store = FleetStore.open(url, "entries", local_path=tmp / "w1" / "entries")
    try:
        for res in ("480p", "720p"):
            data = entry_bytes(res, cache_dir)
            meta = read_meta(data)
            sig, digest = signature_key(meta["signature"]), hashlib.sha256(data).hexdigest()
            rng = np.random.default_rng(1)
            commits, ids = [], []
            for _ in range(n):
                emb = rng.normal(size=DIM).astype(np.float32)
                t = time.perf_counter()
                new = NewEntry(sig, emb, data, digest, json.dumps(meta), time.time())
                entry_id, _ = store.add_entry(new, keep_local=False)
                commits.append(time.perf_counter() - t)
                ids.append(entry_id)
            # the entry bytes inside the rows do not embed these random embeddings: fetch/ sha only here,
            # decode below on rows whose embedding matches (the first add through the public API)
            fetches = []
            for entry_id in ids:
                t = time.perf_counter()
                row, _ = store.fetch_row(entry_id)
                fetches.append(time.perf_counter() - t)
                assert row.sha256 == digest
            from chorus.cache_store.entry_format import decode_entry

            masks, emb, meta2 = decode_entry(data, packed=True)
            real = store.add_entry(NewEntry(sig, emb.numpy(), data, digest, json.dumps(meta), time.time()),
                                   keep_local=False)[0]
            via_pg, via_tier = [], []
            for _ in range(n):
                store.tier.drop(real)
                t = time.perf_counter()
                store.load(real, packed=True, touch=False)
                via_pg.append(time.perf_counter() - t)
                t = time.perf_counter()
                store.load(real, packed=True, touch=False)
                via_tier.append(time.perf_counter() - t)
            lo_commit, lo_fetch = bench_large_objects(store, data, n)
            out[res] = {"entry_bytes": len(data), "commit": ms(commits), "fetch_bytea": ms(fetches),
                        "load_via_postgres": ms(via_pg), "load_from_local_tier": ms(via_tier),
                        "commit_large_object": ms(lo_commit), "fetch_large_object": ms(lo_fetch)}
            print(f"  {res}: {json.dumps(out[res])}", flush=True)
            for entry_id in ids + [real]:
                store.remove(entry_id)
    finally:
        store.close()
    return out


def bench_large_objects(store, data: bytes, n: int):
    """The same commit and fetch with a large object (``lo_from_bytea`` / ``lo_get``) holding the bytes."""
    def setup(conn):
        conn.execute("CREATE TABLE IF NOT EXISTS bench_lo(id BIGSERIAL PRIMARY KEY, blob OID NOT NULL)")

    store.with_connection(setup)
    commits, fetches, ids = [], [], []
    for _ in range(n):
        def tx(conn):
            with conn.transaction():
                return conn.execute("INSERT INTO bench_lo(blob) VALUES(lo_from_bytea(0, %s)) RETURNING id",
                                    (data,)).fetchone()[0]

        t = time.perf_counter()
        ids.append(store.with_connection(tx))
        commits.append(time.perf_counter() - t)
    for i in ids:
        def get(conn):
            with conn.cursor(binary=True) as cur:
                cur.execute("SELECT lo_get(blob) FROM bench_lo WHERE id=%s", (i,))
                return bytes(cur.fetchone()[0])

        t = time.perf_counter()
        got = store.with_connection(get)
        fetches.append(time.perf_counter() - t)
        assert len(got) == len(data)
    store.with_connection(lambda conn: conn.execute("SELECT lo_unlink(blob) FROM bench_lo; DROP TABLE bench_lo"))
    return commits, fetches


def populate(url, workspace: str, count: int, start: int, data: bytes, sig: str, rng) -> None:
    """Bulk-load ``count`` rows (COPY) continuing at id ``start``, then the workspace row."""
    import psycopg

    digest = hashlib.sha256(data).hexdigest()
    with psycopg.connect(url, autocommit=True) as conn:
        with conn.cursor() as cur:
            with cur.copy("COPY chorus_entries(id, workspace, sig_key, sha256, nbytes, embedding, meta_json, data, "
                          "created, last_used, hits) FROM STDIN") as copy:
                now = time.time()
                for i in range(start, start + count):
                    emb = rng.normal(size=DIM).astype(np.float32)
                    copy.write_row((i, workspace, sig, digest, len(data), emb.tobytes(), "{}", data, now, now, 0))
        conn.execute("SELECT setval('chorus_entries_id_seq', %s)", (start + count,))
        conn.execute("UPDATE chorus_workspaces SET seq = seq + %s, dim = %s, n_entries = n_entries + %s, "
                     "n_bytes = n_bytes + %s WHERE name = %s", (count, DIM, count, count * len(data), workspace))
        conn.execute("ANALYZE chorus_entries")


def bench_catch_up(url, tmp: Path, sizes, searches: int) -> dict:
    import torch

    from chorus.cache_store.entry_format import encode_entry
    from chorus.cache_store.fleet import FleetStore
    from chorus.cache_store.signature import signature_key

    meta = {"signature": {"bench": "catch-up"}}
    sig = signature_key(meta["signature"])
    data = encode_entry(np.ones(DIM, np.float32), {(0, 0, 0, 0): torch.ones(1, 4, 4, dtype=torch.bool)}, meta)
    FleetStore.open(url, "scale", local_path=tmp / "setup" / "scale", listen=False).close()
    rng = np.random.default_rng(2)
    out, have = {}, 0
    for size in sorted(sizes):
        t = time.perf_counter()
        populate(url, "scale", size - have, have + 1, data, sig, rng)
        print(f"  populated {size} rows in {time.perf_counter() - t:.1f} s", flush=True)
        have = size
        t = time.perf_counter()
        worker = FleetStore.open(url, "scale", local_path=tmp / f"w{size}" / "scale")
        opened = time.perf_counter() - t
        assert len(worker) == size
        worker.wait_index()
        built = time.perf_counter() - t
        kinds = worker.index_kinds()
        result = {"serving_exact_after_s": round(opened, 2), "approximate_index_after_s": round(built, 2),
                  "index": {k[:8]: v["kind"] for k, v in kinds.items()}}
        if size == max(sizes):
            stored = np.random.default_rng(2).normal(size=(1000, DIM)).astype(np.float32)  # rows 1..1000
            times, cpu, correct = [], [], 0
            for i in range(searches):
                q = stored[i % 1000] + 0.05 * rng.normal(size=DIM).astype(np.float32) if i % 2 else \
                    rng.normal(size=DIM).astype(np.float32)
                t, c = time.perf_counter(), time.thread_time()
                found = worker.search(q, k=4)
                cpu.append(time.thread_time() - c)
                times.append(time.perf_counter() - t)
                if i % 2:
                    correct += found[0][0] == i % 1000 + 1
            result["search_k4"] = ms(times)
            result["search_k4_cpu"] = ms(cpu)  # this thread's CPU time: without the waits for a core
            result["near_duplicate_recall_at_1"] = round(correct / (searches // 2), 4)
            result["feed_delay"] = bench_feed(url, tmp, worker, data, meta)
        worker.close()
        out[str(size)] = result
        print(f"  {size}: {json.dumps(result)}", flush=True)
    return out


def bench_feed(url, tmp: Path, reader, data, meta) -> dict:
    """Commit returned on a second worker -> the entry in ``reader``'s index (100 commits)."""
    import torch

    from chorus.cache_store.fleet import FleetStore

    writer = FleetStore.open(url, "scale", local_path=tmp / "writer" / "scale", listen=False)
    delays, rng = [], np.random.default_rng(5)
    masks = {(0, 0, 0, 0): torch.ones(1, 4, 4, dtype=torch.bool)}
    try:
        for _ in range(100):
            entry_id = writer.add(rng.normal(size=DIM).astype(np.float32), masks, meta)
            t = time.perf_counter()
            while entry_id not in reader:
                time.sleep(0.0002)
            delays.append(time.perf_counter() - t)
    finally:
        writer.close()
    return ms(delays)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="an existing PostgreSQL (default: a throwaway cluster)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--searches", type=int, default=2000)
    parser.add_argument("--entry-runs", type=int, default=20, help="commits / fetches per entry size")
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "chorus_fleet_bench"))
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    cluster = None
    url = args.url
    if url is None:
        import fleet_pg

        cluster = fleet_pg.cluster()
        url = cluster.url(cluster.new_database("bench"))
    import psycopg

    with psycopg.connect(url) as conn:
        server = conn.execute("SELECT version()").fetchone()[0]
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                           "server": server, "cores": __import__("os").cpu_count()}}
    print(json.dumps(results["machine"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("entries:", flush=True)
        results["entries"] = bench_entries(url, tmp, Path(args.cache_dir), args.entry_runs)
        print("catch-up and search:", flush=True)
        results["scale"] = bench_catch_up(url, tmp, args.sizes, args.searches)
    if cluster is not None:
        import fleet_pg

        fleet_pg.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
