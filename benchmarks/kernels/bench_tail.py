"""What the pooled tail costs: ``block_sparse_attention(..., backend="auto")`` (``triton_fp8_ws`` on an H200)
with and without ``pooled_tail`` at Wan 14B shapes (1 x 40 heads x L x 128 bf16, L = 75 600 (720p) and
32 760 (480p)), on the structured maps of ``masks.py`` at 5 / 10 / 15 / 25% density.

Whole calls as the engine makes them (``rows_checked=True``: pre-pass, block lists, kernel), timed with
``triton.testing.do_bench`` (L2 flushed; median) ``--rounds`` times, every variant in turn within a round and
the order reversed every other round (long runs reach the power cap, and a fixed order made the variant timed
second, the tail, pay for the first's heat), the median over rounds reported with each round's ms and
the SM clock / power while it ran (``gpu_state.py``). The tail's cost in % per density is
``(tail - plain) / plain``; beside it, the share of key blocks the tail adds (pooled tiles listed / kept
blocks, from the block lists) -- what the cost would be if a pooled tile cost what a kept block costs --
and the two fixed stages alone: the pre-pass with and without the pooled rows, the block lists with and
without the tail's entries and bias table.

Inputs as a hit sees them: ``--order tile`` runs every call (and the pre-pass stages) in the token order a cache
entry of that grid runs in (``kernels.tile_order.cached_tile_order`` of ``masks.grid_for(L)``, fused into the
pre-pass's loads and the output store; default ``raster``); ``--layout blhd`` gives q/k/v ComfyUI's ``[B, L, H, D]``
memory viewed per head (default ``bhld``, contiguous); ``--q-unaligned`` pads Q's rows to 132 channels (264 bytes
apart), so no TMA descriptor takes them and the pre-pass quantises Q, as it does under a token order: raster order
with it tells the token order's cost from that of Q's quantisation moving to the pre-pass.

Usage (from the pack root, on the GPU): ``python -m benchmarks.kernels.bench_tail --out /tmp/tail``
(about 1.5 minutes on an H200); ``--backends auto,triton_fp8`` adds backends. Writes ``bench_tail.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch
import triton
from triton.testing import do_bench

import chorus.kernels as K
from .gpu_state import GpuSampler
from .masks import grid_for, structured_block_map
from chorus.kernels import api
from chorus.kernels.tile_order import cached_tile_order
from chorus.kernels.triton import _ptxas
from chorus.kernels.triton._attention import lpt_block_lists, tail_spec
from chorus.kernels.triton._attention_ws import prepass_quantizes_q
from chorus.kernels.triton._quant import padded_len, quantize_qkv_fp8


def log(msg: str) -> None:
    print(msg, flush=True)


def timed(fn, est_ms: float) -> float:
    return float(do_bench(fn, warmup=max(5, int(2 * est_ms)), rep=max(100, int(10 * est_ms)), return_mode="median"))


def call_inputs(length: int, heads: int, order: str = "raster", layout: str = "bhld", q_unaligned: bool = False,
                device="cuda", dim: int = 128, block_size: int = 128):
    """``(q, k, v, token_perm, quantize_q)`` of one timed call: bf16 ``[1, heads, length, dim]`` (seeded by
    ``length``) in ``layout`` (``"blhd"``: ComfyUI's ``[B, L, H, D]`` memory viewed per head), Q's rows padded to
    ``dim + 4`` channels with ``q_unaligned``; ``token_perm`` int32 of the tile order of ``masks.grid_for(length)``
    (``order="tile"``; ``ValueError`` for a padded length, whose grid holds fewer tokens) or None; ``quantize_q``:
    whether the warp-specialised call's pre-pass quantises Q (``_attention_ws.prepass_quantizes_q``)."""
    gen = torch.Generator(device=device).manual_seed(length)
    q, k, v = (torch.randn(1, heads, length, dim, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    if layout == "blhd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    if q_unaligned:  # rows (dim + 4) * 2 bytes apart: not a multiple of 16
        q = torch.nn.functional.pad(q, (0, 4))[..., :dim]
    perm = None
    if order == "tile":
        grid = grid_for(length)
        if grid[0] * grid[1] * grid[2] != length:
            raise ValueError(f"the tile order needs the token count of its grid {grid}, got {length}")
        perm = cached_tile_order(grid, block_size).perm.to(device=device, dtype=torch.int32)
    return q, k, v, perm, prepass_quantizes_q(q, perm)


def run_size(length: int, args, results: dict) -> None:
    heads, dim, bs = args.heads, 128, 128
    q, k, v, perm, quantize_q = call_inputs(length, heads, args.order, args.layout, args.q_unaligned)
    scale = dim ** -0.5
    chosen = api.resolve_backend("auto", q).value
    variants = []  # (entry, fn)
    for density in args.densities:
        bm = structured_block_map(length, heads, density, bs, device="cuda")
        kv_num, _, _, _, lists = lpt_block_lists(bm, tail_spec(length, bs, padded_len(length) // bs, 0, 0.0, length,
                                                               0.0))
        added = lists.tail_num.double().sum().item() / kv_num.double().sum().item()
        for backend in args.backends:
            for tail in (False, True):
                entry = {"tokens": length, "density": density, "measured_density": bm.double().mean().item(),
                         "backend": backend, "ran_on": chosen if backend == "auto" else backend, "pooled_tail": tail,
                         "added_blocks_share": added, "order": args.order, "layout": args.layout,
                         "q_unaligned": args.q_unaligned}
                fn = (lambda bm=bm, backend=backend, tail=tail: K.block_sparse_attention(
                    q, k, v, bm, block_size=bs, scale=scale, backend=backend, rows_checked=True, pooled_tail=tail,
                    token_perm=perm))
                variants.append((entry, fn))
        last_map = bm
    # the fixed stages alone (at the last density's map): pre-pass with / without the pooled rows, block lists
    stages = {
        "prepass": lambda: quantize_qkv_fp8(q, k, v, scale, quantize_q=quantize_q, v_key_order="wgmma",
                                            token_perm=perm),
        "prepass_with_pooled_rows": lambda: quantize_qkv_fp8(q, k, v, scale, quantize_q=quantize_q, v_key_order="wgmma",
                                                             pool_block=bs, token_perm=perm),
        "block_lists": lambda: lpt_block_lists(last_map),
        "block_lists_with_tail": lambda: lpt_block_lists(last_map, tail_spec(length, bs, padded_len(length) // bs, 0,
                                                                             0.0, length, 0.0)),
    }
    for name, fn in stages.items():
        variants.append(({"tokens": length, "stage": name, "density": args.densities[-1]}, fn))
    for entry, fn in variants:  # first call: compile, and an estimate for the timing budget
        fn()
        torch.cuda.synchronize()
        entry["est_ms"] = timed(fn, 1.0) if "stage" in entry else float(do_bench(fn, warmup=1, rep=20))
    sampler = GpuSampler()
    for r in range(args.rounds):
        for entry, fn in (variants if r % 2 == 0 else variants[::-1]):
            with sampler.window() as window:
                entry.setdefault("rounds_ms", []).append(timed(fn, entry["est_ms"]))
            entry.setdefault("gpu_states", []).append(window.summary())
    for entry, _ in variants:
        entry["ms"] = statistics.median(entry["rounds_ms"])
        clocks = [g["sm_mhz"] for g in entry["gpu_states"] if g.get("available")]
        entry["sm_mhz"] = statistics.median(clocks) if clocks else None
    rows = [e for e, _ in variants]
    results["runs"].extend(rows)
    for backend in args.backends:
        for density in args.densities:
            plain = next(e for e in rows if e.get("backend") == backend and e["density"] == density
                         and not e["pooled_tail"])
            tail = next(e for e in rows if e.get("backend") == backend and e["density"] == density and e["pooled_tail"])
            cost = 100.0 * (tail["ms"] - plain["ms"]) / plain["ms"]
            results["cost"].append({"tokens": length, "backend": backend, "ran_on": plain["ran_on"],
                                    "density": density, "plain_ms": plain["ms"], "tail_ms": tail["ms"],
                                    "tail_cost_pct": cost, "added_blocks_pct": 100.0 * plain["added_blocks_share"]})
            log(f"[{length}] {backend} ({plain['ran_on']}) density {density:.2f}: plain {plain['ms']:.3f} ms, tail "
                f"{tail['ms']:.3f} ms: {cost:+.1f}% (pooled tiles add {100 * plain['added_blocks_share']:.1f}% blocks; "
                f"rounds plain {min(plain['rounds_ms']):.3f}-{max(plain['rounds_ms']):.3f}, tail "
                f"{min(tail['rounds_ms']):.3f}-{max(tail['rounds_ms']):.3f})")
    for entry in rows:
        if "stage" in entry:
            log(f"[{length}] stage {entry['stage']}: {entry['ms']:.3f} ms")
    del q, k, v
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--sizes", default="75600,32760")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--densities", default="0.05,0.10,0.15,0.25")
    ap.add_argument("--backends", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--order", choices=("raster", "tile"), default="raster",
                    help="token order of the calls: raster, or the tile order a cache entry of the grid runs in")
    ap.add_argument("--layout", choices=("bhld", "blhd"), default="bhld",
                    help="q/k/v memory: contiguous [B, H, L, D], or ComfyUI's [B, L, H, D] viewed per head")
    ap.add_argument("--q-unaligned", action="store_true",
                    help="Q rows 264 bytes apart: no TMA on Q, so the pre-pass quantises it (as under a token order)")
    args = ap.parse_args(argv)
    args.densities = [float(x) for x in args.densities.split(",") if x]
    args.backends = [x for x in args.backends.split(",") if x]
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "python": platform.python_version(), "argv": sys.argv, "ws_assembler": _ptxas.describe(), "runs": [],
               "cost": []}
    log(f"GPU {results['gpu']}, torch {torch.__version__}, triton {triton.__version__} ({results['ws_assembler']})")
    log(f"order {args.order}, layout "
        f"{args.layout}{', Q rows unaligned' if args.q_unaligned else ''}")
    for length in [int(x) for x in args.sizes.split(",") if x]:
        run_size(length, args, results)
    log("\n| tokens | backend (ran on) | density | plain ms | tail ms | tail cost | pooled tiles / kept blocks |")
    log("|---|---|---|---|---|---|---|")
    for c in results["cost"]:
        log(f"| {c['tokens']} | {c['backend']} ({c['ran_on']}) | {c['density']:.2f} | {c['plain_ms']:.3f} | "
            f"{c['tail_ms']:.3f} | {c['tail_cost_pct']:+.1f}% | {c['added_blocks_pct']:.1f}% |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_tail.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
