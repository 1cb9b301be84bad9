"""How many sampled query rows per block the miss-path recorder needs.

For every self-attention call of one request of the synthetic structured source (RoPE-aligned
positional heads + content clusters of a real scikit-image picture; random weights), select a block
map with ``top_p=0.9, k_min=4`` (+ first-frame keep-set) from the block mass estimated on
``sample_rows`` rows per 128-token query block, and report its recall of the *exact* block mass
(the share of the true attention probability the map keeps) and its density.

Run from the repository root: ``python -m benchmarks.quality.sample_rows [--grid 9 30 52] [--sharpen 3]``.
"""

from __future__ import annotations

import argparse

import numpy as np

from chorus import kernels

from .source import Request, RequestAttention, SourceConfig, build_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", nargs=3, type=int, default=[9, 30, 52], help="token grid T H W")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--sharpen", type=float, default=3.0, help="q scale (>1: more peaked attention)")
    ap.add_argument("--rows", nargs="+", type=int, default=[16, 8, 4])
    args = ap.parse_args(argv)
    from skimage import data

    cfg = SourceConfig(grid=tuple(args.grid), heads=args.heads, layers=1)
    model = build_model(cfg)
    attention = RequestAttention(model, Request("astronaut", data.astronaut()[::2, ::2] / 255.0, "", seed=1))
    first = kernels.first_frame_blocks(cfg.grid[1] * cfg.grid[2], 128)
    results: dict = {}
    for expert, step, layer in cfg.keys():
        q, k, _ = attention.qkv(expert, step, layer)
        q = q * args.sharpen
        exact = kernels.block_mass(q, k, block_size=128)
        for rows in [None, *args.rows]:
            mass = exact if rows is None else kernels.block_mass(q, k, block_size=128, sample_rows=rows)
            keep = kernels.select_blocks(mass, top_p=0.9, k_min=4, keep_first_frame_blocks=first)
            results.setdefault(rows, []).append((float((exact * keep).sum(-1).mean()), float(keep.float().mean())))
    print(f"synthetic structured source, random weights; grid {tuple(args.grid)} ({cfg.tokens} tokens), "
          f"{args.heads} heads, q x {args.sharpen:g}, {len(cfg.keys())} calls")
    print("| sampled rows per block | exact-mass recall (mean / min) | density |\n|---|---|---|")
    for rows, values in results.items():
        arr = np.array(values)
        print(f"| {'all 128' if rows is None else rows} | {arr[:, 0].mean():.4f} / {arr[:, 0].min():.4f} | "
              f"{arr[:, 1].mean():.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
