"""Context windows of two lengths on the synthetic structured source: ``python -m benchmarks.quality.windows
--out DIR [--first T H W] [--frames-added N] [--images NAME ...]``.

Later ComfyUI's causal window fix runs every window but the first one anchor frame longer; a miss records the first
window's grid and a hit carries its maps to the longer one (``kernels.resample_block_map``). Here, per request
(a scikit-image sample image on :mod:`.source`, random weights) and per self-attention call (experts x steps x
layers), with exact block mass: the first window's map selected at top-p 0.9 (k_min 2), carried to the grid
``--frames-added`` frames longer (negative: shorter, a ``batched`` schedule's last window), and the share of the
longer window's attention mass it keeps (recall: per query block, averaged) at its density; beside it the longer
window's own maps at top-p 0.9 and 0.95. In raster order and in feature reuse's region order (2x8x8, one
128-token block each). Two other carries, measured and not the library's: ``nearest_block`` (each destination
block read from the one source block holding most of its tokens) and ``offset_in_time`` (frame t of the longer grid
from frame t of the first, the last ones clamped; space as the library's). Writes ``windows.json`` and prints the
table. The q of the source has the softmax scale folded in (attention at scale 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from chorus import kernels
from chorus.kernels.resample import nearest_source_tokens, source_block_assignment
from chorus.kernels.tile_order import cached_region_order

from . import source
from .families import load_image

TOP_P, K_MIN, BLOCK = 0.9, 2, 128
CARRIES = ("library", "nearest_block", "offset_in_time")


def _counts(src, dst, src_order, dst_order, offset_in_time: bool) -> torch.Tensor:
    """``[Qb_dst, Qb_src]``: how many tokens of each destination block map into each source block
    (:func:`~chorus.kernels.resample.source_block_assignment`: space by the library's nearest token; time too, or
    with ``offset_in_time`` frame t from frame t, clamped)."""
    src_token = None
    if offset_in_time:
        t_src = torch.arange(dst[0]).clamp(max=src[0] - 1).repeat_interleave(dst[1] * dst[2])
        src_token = t_src * src[1] * src[2] + nearest_source_tokens(src, dst) % (src[1] * src[2])
    return source_block_assignment(src, dst, BLOCK, src_order, dst_order, src_token=src_token)


def carried(block_map, src, dst, src_order, dst_order, carry: str) -> torch.Tensor:
    """``block_map`` (bool ``[..., Qb, Qb]`` of ``src``) at ``dst`` by ``carry`` (:data:`CARRIES`)."""
    if carry == "library":
        return kernels.resample_block_map(block_map, src, dst, block_size=BLOCK, src_order=src_order,
                                          dst_order=dst_order)
    if carry == "nearest_block":
        main = _counts(src, dst, src_order, dst_order, offset_in_time=False).argmax(1)
        return block_map[..., main, :][..., main]
    touch = (_counts(src, dst, src_order, dst_order, offset_in_time=True) > 0).float()
    keep = (touch @ block_map.float() @ touch.T) > 0
    keep[..., 0] |= ~keep.any(-1)
    return keep


def measure(first, added: int, images) -> dict:
    longer = (first[0] + added,) + tuple(first[1:])
    rows = {}
    for name in images:
        request = source.Request(name, load_image(name), "a request", seed=1)
        windows = [source.RequestAttention(source.build_model(source.SourceConfig(grid=g)), request)
                   for g in (first, longer)]
        for key in source.SourceConfig(grid=first).keys():
            (q1, k1, _), (q2, k2, _) = (w.qkv(*key) for w in windows)
            for order_name in ("raster", "regions2x8x8"):
                orders = [None if order_name == "raster" else cached_region_order(g, (2, 8, 8), BLOCK)
                          for g in (first, longer)]
                recorded = kernels.select_blocks(kernels.block_mass(q1, k1, block_size=BLOCK, scale=1.0,
                                                                    token_perm=orders[0]), top_p=TOP_P, k_min=K_MIN)
                mass = kernels.block_mass(q2, k2, block_size=BLOCK, scale=1.0, token_perm=orders[1])

                def add(label, block_map):
                    recall = float(((mass * block_map).sum(-1) / mass.sum(-1)).mean())
                    rows.setdefault((order_name, label), []).append((recall, float(block_map.float().mean())))

                for carry in CARRIES:
                    add(carry, carried(recorded, first, longer, orders[0], orders[1], carry))
                for p in (0.9, 0.95):
                    add(f"own top-p {p}", kernels.select_blocks(mass, top_p=p, k_min=K_MIN))
    return {"first": list(first), "longer": list(longer), "images": list(images),
            "rows": [{"order": o, "map": m, "recall": float(np.mean([r for r, _ in v])),
                      "density": float(np.mean([d for _, d in v])), "calls": len(v)} for (o, m), v in rows.items()]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--first", nargs=3, type=int, default=[9, 24, 32], help="the first window's token grid T H W")
    ap.add_argument("--frames-added", type=int, default=1, help="frames the other window has more (1: the anchor)")
    ap.add_argument("--images", nargs="+", default=["astronaut", "coffee", "chelsea"])
    args = ap.parse_args(argv)
    if args.first[0] + args.frames_added < 1:
        ap.error("--frames-added leaves the other window without frames")
    res = measure(tuple(args.first), args.frames_added, args.images)
    res["command"] = "python -m benchmarks.quality.windows " + " ".join(argv if argv is not None else sys.argv[1:])
    res["source"] = source.SOURCE_LABEL
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "windows.json").write_text(json.dumps(res, indent=1))
    print(f"{tuple(res['first'])} -> {tuple(res['longer'])}, {len(args.images)} requests ({source.SOURCE_LABEL})")
    print("| order | map | recall | density |\n|---|---|---|---|")
    for row in res["rows"]:
        print(f"| {row['order']} | {row['map']} | {row['recall']:.3f} | {row['density']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
