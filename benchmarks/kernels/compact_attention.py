"""Feature reuse's compact self-attention at the kernel level, against the full grid it stands for.

Usage (on a CUDA GPU, from the pack root, ``chorus`` importable)::

    python -m benchmarks.kernels.compact_attention --res 720p 480p --shares 0.25 0.5 --density 0.15

For each Wan 14B grid (81 frames) and ``downsample_share``: a :class:`~chorus.kernels.tile_order.RegionTileOrder`,
the feature-reuse layout built in it (regions chosen by random redundancy scores, frame 0 never pooled),
a structured map of the given density cut in that order (``benchmarks.e2e.run.structured_map``), the
compact map (``kernels.pooling.compact_block_map``), and ``triton.testing.do_bench`` medians of whole
calls of ``chorus.kernels.block_sparse_attention`` on random bf16 q/k/v in ComfyUI's ``[B, L, H, D]``
memory (40 heads x 128): the full grid, the compact sequence with the cells' ``log P`` suffix bias, and
the same without it (what the bias costs); ``--ws-configs`` adds the warp-specialised kernel under
each named config. Prints one line per case and backend; ``--out FILE`` writes
JSON.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from triton.testing import do_bench

from benchmarks.e2e.run import structured_map
from benchmarks.kernels.masks import WAN_GRIDS
from chorus import kernels
from chorus.engine.feature_reuse import select_regions
from chorus.kernels import pooling
from chorus.kernels.tile_order import cached_region_order

RES = {"720p": 75600, "480p": 32760}
REGION, POOL = (2, 8, 8), (2, 2, 2)


def bhld(t):
    return t.transpose(1, 2)


def run_case(grid, share: float, density: float, heads: int, backends, ws_configs=None) -> list[dict]:
    order = cached_region_order(grid, REGION, 128)
    counts = pooling.region_counts(grid, REGION)
    scores = torch.rand(counts[0] * counts[1] * counts[2], generator=torch.Generator().manual_seed(0))
    regions = select_regions(scores, grid, REGION, share)
    layout = pooling.build_layout(grid, REGION, POOL, regions, device="cuda", order=order)
    full_map = structured_map(grid, heads, density, 128, "cuda", seed=100, order=order)[None]
    compact_map = pooling.compact_block_map(full_map, layout.block_sources)
    gen = torch.Generator(device="cuda").manual_seed(0)
    length, short = order.length, layout.compact_length
    q, k, v = (torch.randn(1, length, heads, 128, device="cuda", generator=gen).bfloat16() for _ in range(3))
    qc, kc, vc = (torch.randn(1, short, heads, 128, device="cuda", generator=gen).bfloat16() for _ in range(3))
    bias = dict(suffix_len=layout.num_cells, suffix_bias=math.log(layout.cell_size))
    rows = []
    ws_configs = ws_configs or {}
    for backend in list(backends) + [f"ws:{name}" for name in ws_configs]:
        def call(qq, kk, vv, bm, **extra):
            if backend.startswith("ws:"):  # the warp-specialised kernel itself, with one config
                from chorus.kernels.triton._attention_ws import block_sparse_attention_ws
                cfg = ws_configs[backend[3:]]
                return lambda: block_sparse_attention_ws(bhld(qq), bhld(kk), bhld(vv), bm, 128 ** -0.5, cfg, **extra)
            return lambda: kernels.block_sparse_attention(bhld(qq), bhld(kk), bhld(vv), bm, block_size=128,
                                                          backend=backend, rows_checked=True, **extra)
        try:
            t_full = do_bench(call(q, k, v, full_map), return_mode="median")
            t_compact = do_bench(call(qc, kc, vc, compact_map, **bias), return_mode="median")
            t_plain = do_bench(call(qc, kc, vc, compact_map), return_mode="median")
        except Exception as exc:  # noqa: BLE001 - a backend that cannot take the call is a result too
            rows.append({"grid": grid, "share": share, "backend": backend, "error": f"{type(exc).__name__}: {exc}"})
            print(f"{grid} share {share} {backend}: {rows[-1]['error'][:200]}", flush=True)
            continue
        rows.append({"grid": list(grid), "share": share, "density": density, "backend": backend,
                     "regions": int(regions.numel()), "tokens": length, "compact_tokens": short,
                     "blocks_full": int(full_map.sum()), "blocks_compact": int(compact_map.sum()),
                     "ms_full": t_full, "ms_compact": t_compact, "ms_compact_without_bias": t_plain})
        r = rows[-1]
        print(f"{grid} share {share} {backend}: blocks {r['blocks_compact'] / r['blocks_full']:.3f} of the full grid; "
              f"full {t_full:.2f} ms, compact {t_compact:.2f} ms ({t_compact / t_full:.3f}), without the bias "
              f"{t_plain:.2f} ms", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--res", nargs="+", default=["720p"], choices=sorted(RES))
    ap.add_argument("--shares", nargs="+", type=float, default=[0.25])
    ap.add_argument("--density", type=float, default=0.15)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--backends", nargs="+", default=["auto", "triton_fp8"])
    ap.add_argument("--ws-configs", default="{}",
                    help="JSON name -> triton_fp8_ws config overrides, each timed as backend ws:<name>")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA GPU")
    rows = []
    for res in args.res:
        for share in args.shares:
            rows += run_case(WAN_GRIDS[RES[res]], share, args.density, args.heads, args.backends,
                             json.loads(args.ws_configs))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.kernels.compact_attention", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
