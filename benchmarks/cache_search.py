"""Cache store benchmark (CPU): retrieval latency/recall, Wan 14B entry size and load time.

Usage::

    python benchmarks/cache_search.py [--sizes 1000,5000,10000,20000,50000,100000] [--dim 1024]
                                      [--queries 2000] [--out results.json] [--quick]

What it measures, each in this one process:

1. Search latency of one query (k=1), p50/p99 over ``--queries`` queries, for the exact partition
   (``IndexIDMap2(IndexFlatIP)``) at each size, and for the HNSW partition at each size >= the
   switch threshold; recall@1 of HNSW against the exact index on the same queries. Data: unit
   vectors around 2 000 random "template" centres (requests that share a template), queries are
   stored vectors moved by noise (a similar new request). ``faiss`` uses all cores (2 here).
2. ``Workspace.search`` at the largest size, end to end (SQLite generation check + index), on a
   workspace whose rows are bulk-inserted with SQL (search never reads entry files), plus the time
   to build its index from SQLite, save it, and load it on reopen.
3. A Wan 14B 480p 81-frame 4-step entry (40 layers x 40 heads x 4 steps of 256x256 blocks) with
   masks from ``chorus.cache_store.synthetic.structured_masks`` (a stated attention-mass model, not
   a trained model): size on disk, write time, and load time (read + sha256 + decode) to packed
   tensors (what the engine moves to the GPU) and to bool tensors on the CPU; page cache warm, and
   evicted with ``posix_fadvise(DONTNEED)``. For scale: the same entry with uniformly random maps
   of the same density (incompressible worst case), and with uint8-quantised block mass instead of
   bool maps (2 layers encoded, scaled by 20).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from chorus.cache_store import Workspace, signature_key
from chorus.cache_store.entry_format import encode_entry
from chorus.cache_store.index import HNSW_EF_SEARCH, HNSW_M, PartitionedIndex
from chorus.cache_store.synthetic import structured_masks

SIG = {"family": "wan", "variant": "benchmark"}


def clustered(n, dim, clusters, spread, rng):
    centres = rng.normal(size=(clusters, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres[rng.integers(0, clusters, n)] + spread * rng.normal(size=(n, dim)).astype(np.float32) / np.sqrt(dim)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def perturbed_queries(x, count, noise, rng):
    picks = rng.integers(0, len(x), count)
    q = x[picks] + noise * rng.normal(size=(count, x.shape[1])).astype(np.float32) / np.sqrt(x.shape[1])
    return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def time_queries(fn, queries):
    """Wall time and this thread's CPU time per query (CPU time excludes waiting for a core that
    other processes hold: the machine is shared, so both are reported)."""
    wall, cpu = [], []
    results = []
    for q in queries:
        c0, t0 = time.thread_time(), time.perf_counter()
        results.append(fn(q))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    wall, cpu = np.array(wall) * 1e3, np.array(cpu) * 1e3
    return {"p50_ms": float(np.percentile(wall, 50)), "p99_ms": float(np.percentile(wall, 99)),
            "max_ms": float(wall.max()), "cpu_p50_ms": float(np.percentile(cpu, 50)),
            "cpu_p99_ms": float(np.percentile(cpu, 99))}, results


def bench_retrieval(sizes, dim, n_queries, threshold, rng):
    rows = []
    n_max = max(sizes)
    x = clustered(n_max, dim, clusters=2000, spread=0.6, rng=rng)
    for n in sizes:
        xs = x[:n]
        queries = perturbed_queries(xs, n_queries, 0.3, rng)
        exact = PartitionedIndex(dim, approx_threshold=10**12)
        exact.add("s", np.arange(n), xs)
        lat, res = time_queries(lambda q: exact.search(q, 1), queries)
        truth = [r[0][0] for r in res]
        rows.append({"n": n, "index": "flat (exact)", **lat, "recall@1": 1.0})
        print(json.dumps(rows[-1]), flush=True)
        if n >= threshold:
            approx = PartitionedIndex(dim, approx_threshold=1)
            t0 = time.perf_counter()
            approx.add("s", np.arange(n), xs)
            build = time.perf_counter() - t0
            lat, res = time_queries(lambda q: approx.search(q, 1), queries)
            recall = float(np.mean([r[0][0] == t for r, t in zip(res, truth)]))
            hard = perturbed_queries(xs, n_queries, 0.6, rng)
            truth_hard = [exact.search(q, 1)[0][0] for q in hard]
            recall_hard = float(np.mean([approx.search(q, 1)[0][0] == t for q, t in zip(hard, truth_hard)]))
            rows.append({"n": n, "index": f"hnsw (M={HNSW_M}, efSearch={HNSW_EF_SEARCH})",
                         **lat, "recall@1": recall, "recall@1_hard": recall_hard, "build_s": build})
            print(json.dumps(rows[-1]), flush=True)
    return rows, x


def bench_workspace(x, n_queries, rng, tmp):
    n, dim = x.shape
    path = Path(tmp) / "ws_search"
    Workspace.open(path).close()
    db = sqlite3.connect(str(path / "chorus.sqlite3"))
    key = signature_key(SIG)
    now = time.time()
    with db:
        db.executemany(
            "INSERT INTO entries(file, sig_key, sha256, nbytes, embedding, meta_json, created, last_used, hits)"
            " VALUES(?, ?, '', 0, ?, '{}', ?, ?, 0)",
            ((f"bulk{i}.safetensors", key, x[i].tobytes(), now, now) for i in range(n)))
        db.execute("INSERT OR REPLACE INTO settings VALUES('dim', ?)", (str(dim),))
        db.execute("INSERT OR REPLACE INTO settings VALUES('generation', ?)", (str(n),))
    db.close()
    t0 = time.perf_counter()
    ws = Workspace.open(path)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    index_file = ws.save_index()
    save = time.perf_counter() - t0
    ws.close()
    t0 = time.perf_counter()
    ws = Workspace.open(path)
    reopen = time.perf_counter() - t0
    queries = perturbed_queries(x, n_queries, 0.3, rng)
    lat, _ = time_queries(lambda q: ws.search(q, k=1, signature=SIG), queries)
    lat_any, _ = time_queries(lambda q: ws.search(q, k=5), queries[: n_queries // 2])
    out = {"n": n, "dim": dim, "index": ws.stats()["index"][key]["kind"], "build_from_sqlite_s": build,
           "save_s": save, "index_file_MB": index_file.stat().st_size / 1e6, "reopen_s": reopen,
           "search_k1_signature": lat, "search_k5_any": lat_any}
    ws.close()
    print(json.dumps(out), flush=True)
    return out


def _evict_from_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_entry(tmp, repeats, layers=40):
    masks = structured_masks(layers=layers, heads=40, steps=4, seed=0)
    density = float(torch.stack([m.float().mean() for m in masks.values()]).mean())
    raw_bits = sum(m.numel() for m in masks.values()) // 8
    ws = Workspace.open(Path(tmp) / "ws_entry")
    t0 = time.perf_counter()
    entry_id = ws.add(np.ones(1024, np.float32), masks, {"signature": SIG})
    write = time.perf_counter() - t0
    file = ws.entry_path(entry_id)
    size = file.stat().st_size

    def load_packed():
        return ws.load(entry_id, packed=True, touch=False)

    warm, cold, warm_cpu = [], [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        load_packed()
        warm.append(time.perf_counter() - t0)
        warm_cpu.append(time.process_time() - c0)  # CPU time of all threads (sha256, zstd in 2 threads)
        _evict_from_page_cache(file)
        t0 = time.perf_counter()
        load_packed()
        cold.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    full, _ = ws.load(entry_id, touch=False)
    unpack_bool = time.perf_counter() - t0
    assert all(torch.equal(full[k], masks[k]) for k in list(masks)[::17])
    del full

    zlib_size = len(encode_entry(np.ones(1024, np.float32), masks, {"signature": SIG}, codec="zlib"))
    gen = torch.Generator().manual_seed(1)
    random_masks = {k: torch.rand(m.shape, generator=gen) < density for k, m in masks.items()}
    random_size = len(encode_entry([1.0], random_masks, {}))
    del random_masks
    # uint8-quantised block mass (what would let the density be chosen at retrieval time)
    sub = structured_masks(layers=2, heads=40, steps=4, seed=0)  # maps only used for keys/shapes
    gen = torch.Generator().manual_seed(2)
    mass = {}
    for k, m in sub.items():
        logits = torch.randn(m.shape, generator=gen) + 6.0 * m.float()  # mass concentrated on the kept blocks
        p = torch.softmax(logits, -1)
        mass[k] = torch.round(p / p.amax(-1, keepdim=True) * 255).to(torch.uint8)
    mass_size = len(encode_entry([1.0], mass, {})) * (layers / 2)
    ws.close()
    out = {"maps": len(masks), "map_shape": list(next(iter(masks.values())).shape), "density": density,
           "packed_bits_MB": raw_bits / 1e6, "file_MB": size / 1e6, "write_s": write,
           "load_packed_warm_ms": {"p50": 1e3 * float(np.median(warm)), "max": 1e3 * max(warm)},
           "load_packed_warm_cpu_ms": {"p50": 1e3 * float(np.median(warm_cpu))},
           "load_packed_cold_ms": {"p50": 1e3 * float(np.median(cold)), "max": 1e3 * max(cold)},
           "load_bool_cpu_ms": 1e3 * unpack_bool, "random_maps_same_density_MB": random_size / 1e6, "zlib_fallback_file_MB": zlib_size / 1e6,
           "uint8_mass_MB_estimate": mass_size / 1e6}
    print(json.dumps(out), flush=True)
    return out


def to_markdown(results) -> str:
    """Tables for docs/BENCHMARK_LOG.md from a results dict (as written by ``--out``)."""
    m = results["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, faiss {m['faiss']}, torch {m['torch']}; "
             f"load average {m['load_average_at_start'][0]:.1f} at start, {m.get('load_average_at_end', [float('nan')])[0]:.1f} at end.",
             "", "| entries | index | wall p50 ms | wall p99 ms | CPU p50 ms | CPU p99 ms | recall@1 (hard) | build s |",
             "|---:|---|---:|---:|---:|---:|---|---:|"]
    for r in results["retrieval"]:
        recall = f"{r['recall@1']:.4f}" + (f" ({r['recall@1_hard']:.4f})" if "recall@1_hard" in r else "")
        build = f"{r['build_s']:.1f}" if "build_s" in r else ""
        lines.append(f"| {r['n']:,} | {r['index']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['cpu_p50_ms']:.2f} | "
                     f"{r['cpu_p99_ms']:.2f} | {recall} | {build} |")
    w = results["workspace"]
    lines += ["", f"`Workspace.search` at {w['n']:,} entries (dim {w['dim']}, {w['index']}): k=1 with a signature: "
              f"wall p50 {w['search_k1_signature']['p50_ms']:.2f} / p99 {w['search_k1_signature']['p99_ms']:.2f} ms, "
              f"CPU p50 {w['search_k1_signature']['cpu_p50_ms']:.2f} / p99 {w['search_k1_signature']['cpu_p99_ms']:.2f} ms; "
              f"k=5 over all signatures: wall p99 {w['search_k5_any']['p99_ms']:.2f} ms, CPU p99 "
              f"{w['search_k5_any']['cpu_p99_ms']:.2f} ms. Index built from SQLite in {w['build_from_sqlite_s']:.0f} s, "
              f"saved in {w['save_s']:.1f} s ({w['index_file_MB']:.0f} MB), reopened (load + sha256 + deserialise) in "
              f"{w['reopen_s']:.1f} s."]
    e = results["entry"]
    lines += ["", "| Wan 14B 480p 81f 4-step entry | value |", "|---|---:|",
              f"| maps x shape | {e['maps']} x {e['map_shape']} |",
              f"| mean density (synthetic structured masks) | {e['density']:.3f} |",
              f"| bit-packed payload | {e['packed_bits_MB']:.1f} MB |",
              f"| file on disk (zstd) | **{e['file_MB']:.2f} MB** |"]
    if "zlib_fallback_file_MB" in e:
        lines.append(f"| file on disk with the zlib fallback | {e['zlib_fallback_file_MB']:.2f} MB |")
    lines += [f"| write (encode + fsync + commit) | {e['write_s'] * 1e3:.0f} ms |",
              f"| load to packed tensors, page cache warm: p50 / max | {e['load_packed_warm_ms']['p50']:.1f} / {e['load_packed_warm_ms']['max']:.1f} ms |"]
    if "load_packed_warm_cpu_ms" in e:
        lines.append(f"| same, CPU time of all threads, p50 | {e['load_packed_warm_cpu_ms']['p50']:.1f} ms |")
    lines += [f"| load to packed tensors, file evicted from page cache: p50 / max | {e['load_packed_cold_ms']['p50']:.1f} / {e['load_packed_cold_ms']['max']:.1f} ms |",
              f"| load and unpack to bool tensors on the CPU (420 MB) | {e['load_bool_cpu_ms']:.0f} ms |",
              f"| same density, uniformly random maps (worst case) | {e['random_maps_same_density_MB']:.1f} MB |",
              f"| uint8-quantised block mass instead of maps (2 layers x 20) | {e['uint8_mass_MB_estimate']:.0f} MB |"]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,5000,10000,20000,50000,100000")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--threshold", type=int, default=None, help="smallest size also run with HNSW (default: the store's switch size)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--markdown", default=None, metavar="JSON",
                        help="only print the docs/BENCHMARK_LOG.md tables of an earlier --out file")
    parser.add_argument("--nice", type=int, default=None,
                        help="run at this nice value (negative needs root): on a machine shared with other jobs, "
                             "latency percentiles then reflect this CPU rather than the other jobs")
    args = parser.parse_args(argv)
    if args.markdown:
        print(to_markdown(json.loads(Path(args.markdown).read_text())))
        return None
    from chorus.cache_store.index import DEFAULT_APPROX_THRESHOLD

    if args.nice is not None:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    sizes = [int(s) for s in args.sizes.split(",")]
    threshold = args.threshold or DEFAULT_APPROX_THRESHOLD
    if args.quick:
        sizes, threshold, args.queries, args.repeats = [1000, 5000], 5000, 300, 3
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "python": sys.version.split()[0], "faiss": faiss.__version__, "torch": torch.__version__,
               "faiss_omp_threads": faiss.omp_get_max_threads(), "nice": os.getpriority(os.PRIO_PROCESS, 0)}
    try:
        machine["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    machine["load_average_at_start"] = os.getloadavg()
    print(json.dumps(machine), flush=True)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        retrieval, x = bench_retrieval(sizes, args.dim, args.queries, threshold, rng)
        workspace = bench_workspace(x[: max(sizes)], args.queries, rng, tmp)
        entry = bench_entry(tmp, args.repeats, layers=4 if args.quick else 40)
    machine["load_average_at_end"] = os.getloadavg()
    results = {"machine": machine, "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
               "retrieval": retrieval, "workspace": workspace, "entry": entry}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(to_markdown(results))
    return results


if __name__ == "__main__":
    main()
