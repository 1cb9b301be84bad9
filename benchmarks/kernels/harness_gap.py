"""One FP8 call timed the ways our two kernel harnesses time it, on the same tensors, in one process.

``bench_block_sparse.py``'s peers table read the warp-specialised kernel 3-8% slower than
``ws_levers.py`` did in other calls (2026-12-02). The two differ in their inputs, their full map and
their timing; this script crosses the three, times every variant in turn ``--rounds`` times (so a
drift of the GPU's clock hits all alike) and records the GPU's state per timing
(:mod:`gpu_state`), so a gap is either one of the three or the machine:

- inputs: ``peers`` (``torch.randn`` in bf16, generator seed = L: ``bench_block_sparse.py``) or
  ``levers`` (fp32 ``randn``, seed 0, cast to bf16: ``ws_levers.py``);
- full map: ``1x1`` (one map broadcast over heads: the peers table) or ``1xH`` (one per head: the
  lever sweep); the sparse maps are ``[1, H]`` in both harnesses;
- timing: ``peers`` (``bench_peer``: warm-up = one estimated call, 3 estimated calls of repetitions) or
  ``levers`` (``do_bench``'s defaults, 25 / 100 ms).

Usage (sm_90): ``python benchmarks/kernels/harness_gap.py --out OUT [--sizes 75600] [--densities
1.0,0.15,0.05] [--rounds 3] [--configs JSON]`` (configs: name -> ``triton_fp8_ws`` config overrides, as in
``ws_levers.py``; ``triton_fp8`` is timed too, as the control). Writes ``harness_gap.json`` and prints one
line per variant: median ms, TFLOP/s on kept blocks, and the median SM clock and power while it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_block_sparse import bench_peer  # noqa: E402
from gpu_state import GpuSampler  # noqa: E402
from masks import kept_flops, structured_block_map  # noqa: E402

from chorus.kernels.triton import block_sparse_attention_triton  # noqa: E402
from chorus.kernels.triton._attention_ws import block_sparse_attention_ws  # noqa: E402


def inputs(kind: str, length: int, heads: int, dim: int = 128):
    if kind == "peers":
        gen = torch.Generator(device="cuda").manual_seed(length)
        return tuple(torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for _ in range(3))
    gen = torch.Generator(device="cuda").manual_seed(0)
    return tuple(torch.randn(1, heads, length, dim, device="cuda", generator=gen).bfloat16() for _ in range(3))


def time_peers_way(fn) -> float:
    """The peers table's: one call's host-clock estimate sets ``bench_block_sparse.bench_peer``'s warm-up
    and repetitions."""
    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    fn()
    torch.cuda.synchronize()
    return bench_peer(fn, (time.time() - t0) * 1e3)


def time_levers_way(fn) -> float:
    """``ws_levers.py``: ``do_bench``'s defaults."""
    return float(do_bench(fn, return_mode="median"))


TIMINGS = {"peers": time_peers_way, "levers": time_levers_way}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--sizes", default="75600")
    ap.add_argument("--densities", default="1.0,0.15,0.05")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default='{"default": {}}', help="JSON: name -> triton_fp8_ws config overrides")
    args = ap.parse_args()
    configs = json.loads(args.configs)
    sampler = GpuSampler()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    heads, dim = args.heads, 128
    scale = dim ** -0.5
    for length in (int(x) for x in args.sizes.split(",")):
        tensors = {kind: inputs(kind, length, heads) for kind in ("peers", "levers")}
        nb = -(-length // 128)
        for density in (float(x) for x in args.densities.split(",")):
            maps = {"1xH": structured_block_map(length, heads, density, 128, device="cuda")}
            if density >= 1.0:
                maps["1x1"] = torch.ones(1, 1, nb, nb, dtype=torch.bool, device="cuda")
            flops = kept_flops(maps["1xH"], length, length, dim)
            variants = []
            for kind, (q, k, v) in tensors.items():
                for map_name, bm in maps.items():
                    for timing in TIMINGS:
                        for name, cfg in configs.items():
                            variants.append(dict(kernel=f"ws:{name}", inputs=kind, map=map_name, timing=timing,
                                                 fn=(lambda q=q, k=k, v=v, bm=bm, cfg=cfg:
                                                     block_sparse_attention_ws(q, k, v, bm, scale, cfg))))
                        variants.append(dict(kernel="triton_fp8", inputs=kind, map=map_name, timing=timing,
                                             fn=(lambda q=q, k=k, v=v, bm=bm:
                                                 block_sparse_attention_triton(q, k, v, bm, block_size=128, fp8=True))))
            for var in variants:
                var["fn"]()  # compile
                var["times"], var["states"] = [], []
            torch.cuda.synchronize()
            for _ in range(args.rounds):
                for var in variants:
                    with sampler.window() as w:
                        var["times"].append(TIMINGS[var["timing"]](var["fn"]))
                    var["states"].append(w.summary())
            for var in variants:
                ms = statistics.median(var["times"])
                clocks = [s["sm_mhz"] for s in var["states"] if s.get("available")]
                power = [s["power_w"] for s in var["states"] if s.get("available")]
                row = {"tokens": length, "density": density, "kernel": var["kernel"], "inputs": var["inputs"],
                       "map": var["map"], "timing": var["timing"], "ms": ms, "tflops": flops / ms / 1e9,
                       "rounds_ms": var["times"], "sm_mhz": statistics.median(clocks) if clocks else None,
                       "power_w": statistics.median(power) if power else None, "gpu_states": var["states"]}
                rows.append(row)
                state = (f"{row['sm_mhz']:.0f} MHz {row['power_w']:.0f} W" if clocks
                         else var["states"][0].get("error", "no GPU state"))
                print(f"[{length}] d={density} {var['kernel']:14s} inputs={var['inputs']:6s} map={var['map']:3s} "
                      f"timing={var['timing']:6s} {ms:8.2f} ms {row['tflops']:5.0f} TFLOP/s  ({state}; rounds "
                      f"{min(var['times']):.2f}-{max(var['times']):.2f} ms)", flush=True)
            with open(os.path.join(args.out, "harness_gap.json"), "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "argv": sys.argv, "rows": rows}, f, indent=1)
        del tensors
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
