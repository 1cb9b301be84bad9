"""Tile token order vs raster order: blocks kept at equal recall (issue 17, part 2).

``python -m benchmarks.quality.tile_order --out OUT [--quick] [--no-wan]``

For every self-attention call, the exact block mass ``[H, Qb, Kb]`` is computed in raster order
and in tile order (:class:`chorus.kernels.tile_order.TileOrder`: the same probabilities with q and
k permuted). For recall targets 0.90 and 0.95, each query-block row keeps the fewest blocks whose
mass reaches the target (``select_blocks(top_p=p, k_min=1)``, no keep-sets: the lever alone, the
oracle map of the call itself); the table reports the kept share of block pairs (density), the
recall actually kept, and the tile / raster ratio of kept blocks. Both orders have the same
number of blocks, so equal recall at lower density = fewer blocks computed.

Sources:

(a) the quality harness's synthetic structured source (:mod:`.source`; RoPE-aligned positional +
    image-content heads, random weights) at the harness's non-quick size (grid 12x10x14, 8 heads,
    2 layers x 4 steps, block 32, the entries of :func:`.families.build_workload`) and at a Wan-like
    grid with 128-token blocks (``--large-grid``, default 5x30x52: 480p geometry, 5 latent frames,
    one request; 5x32x48 is a grid the 2x8x8 tiles divide exactly); ``--sharpen`` scales q (more
    peaked attention, as trained models show);
(b) ComfyUI's tiny ``WanModel`` (random weights, 2 heads x 128, 2 layers; as in
    ``tests/test_engine_wan.py``), q/k captured from its self-attention at one sigma: random
    weights give near-uniform attention, so (b) is a sanity number only (every order needs about
    p of the blocks).

Writes ``OUT/tile_order.json`` and ``OUT/tile_order.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from chorus import kernels
from chorus.kernels.tile_order import TileOrder

from .harness import block_mass_from_probs, exact_probs
from .source import SOURCE_LABEL, Request, RequestAttention, SourceConfig, build_model

TARGETS = (0.9, 0.95)


def kept_at_recall(mass: torch.Tensor, target: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head ``(density [H], recall [H])`` of the per-row minimal top-p map of ``mass`` ``[H, Qb, Kb]``."""
    keep = kernels.select_blocks(mass.float(), top_p=target, k_min=1, keep_diagonal=False)
    return keep.float().mean((-1, -2)), (mass * keep).sum(-1).mean(-1)


def mass_by_head(q: torch.Tensor, k: torch.Tensor, block_size: int, perms: dict) -> dict:
    """Exact block mass ``[H, Qb, Kb]`` per order name (``perms``: name -> perm or None), one head at
    a time (``q, k`` ``[1, H, L, D]``, scale folded into q)."""
    out = {name: [] for name in perms}
    for h in range(q.shape[1]):
        probs = exact_probs(q[:, h:h + 1], k[:, h:h + 1])  # [1, L, L]
        for name, perm in perms.items():
            p = probs if perm is None else probs[:, perm][:, :, perm]
            out[name].append(block_mass_from_probs(p, block_size)[0, 0])
    return {name: torch.stack(ms) for name, ms in out.items()}


def orders_for(grid, block_size: int) -> dict:
    """The orders compared: raster, the default tile order (2-frame tiles after frame 0), and
    one-frame tiles everywhere (frame 0's tile shape in every frame: spatial tiles only)."""
    default = TileOrder(grid, block_size)
    spatial = TileOrder(grid, block_size, tile=default.first_tile)
    return {"raster": None, default.name: default, spatial.name: spatial}


def measure_calls(calls, grid, block_size: int, log, label: str) -> dict:
    """``calls``: iterable of ``(q, k, kinds)``, q/k ``[1, H, L, D]``, ``kinds`` a head-type name per
    head (or None). Returns per order and target the mean density / recall over calls and heads,
    and the density per head type."""
    orders = orders_for(grid, block_size)
    perms = {name: (None if o is None else o.perm) for name, o in orders.items()}
    acc = {name: {p: [] for p in TARGETS} for name in orders}
    kinds_seen: list[str] = []
    t0 = time.perf_counter()
    n = 0
    for q, k, kinds in calls:
        masses = mass_by_head(q, k, block_size, perms)
        kinds_seen += list(kinds) if kinds is not None else ["-"] * q.shape[1]
        for name, mass in masses.items():
            for p in TARGETS:
                acc[name][p].append(kept_at_recall(mass, p))
        n += 1
    log(f"  {label}: {n} calls in {time.perf_counter() - t0:.1f} s")
    res = {"grid": list(grid), "block_size": block_size, "calls": n, "orders": {}, "by_head_type": {}}
    kinds_arr = np.array(kinds_seen)
    for name, per_target in acc.items():
        res["orders"][name] = {}
        for p, v in per_target.items():
            dens = torch.cat([d for d, _ in v]).numpy()
            rec = torch.cat([r for _, r in v]).numpy()
            res["orders"][name][str(p)] = {"density": float(dens.mean()), "recall": float(rec.mean())}
            for kind in sorted(set(kinds_seen)):
                sel = kinds_arr == kind
                res["by_head_type"].setdefault(kind, {"heads": int(sel.sum())}).setdefault(name, {})[str(p)] = \
                    float(dens[sel].mean())
    return res


def synthetic_calls(cfg: SourceConfig, requests, sharpen: float = 1.0):
    model = build_model(cfg)
    for req in requests:
        attention = RequestAttention(model, req)
        for expert, step, layer in cfg.keys():
            q, k, _ = attention.qkv(expert, step, layer)
            yield q * sharpen, k, [spec.kind for spec in model.heads[(expert, layer)]]


def wan_calls(latent_shape, seeds=(0, 1), sigma: float = 0.75):
    """q/k ``[1, H, L, D]`` (scaled by 1/sqrt(D): the softmax scale folded in) of every
    self-attention call of ComfyUI's tiny WanModel, for random inputs, one model per seed."""
    here = Path(__file__).resolve().parents[2] / "tests"
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    from host import tiny_wan as tiny  # noqa: PLC0415 - the tests' ComfyUI loader

    reason = tiny.import_comfy()
    if reason is not None:
        raise RuntimeError(f"ComfyUI not available: {reason}")
    for seed in seeds:
        patcher = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=seed))
        dm = patcher.model.diffusion_model
        captured = []
        length = latent_shape[2] * (latent_shape[3] // 2) * (latent_shape[4] // 2)

        def override(func, *args, **kwargs):
            q, k = args[0], args[1]
            heads = kwargs.get("heads", args[3] if len(args) > 3 else None)
            if q.shape[1] == k.shape[1] == length:
                b, l, width = q.shape
                d = width // heads
                to = lambda t: t.view(b, l, heads, d).transpose(1, 2)[:1].float() / d ** 0.25  # noqa: E731
                captured.append((to(q).contiguous(), to(k).contiguous(), None))
            return func(*args, **kwargs)

        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(1, 36, *latent_shape[2:], generator=gen)
        context = torch.randn(1, 512, 4096, generator=gen)
        with torch.no_grad():
            dm(x, torch.tensor([sigma * 1000.0]), context,
               transformer_options={"optimized_attention_override": override})
        yield from captured


def table(res: dict, title: str) -> list[str]:
    lines = [f"**{title}** — grid {tuple(res['grid'])} ({int(np.prod(res['grid']))} tokens), block {res['block_size']}, "
             f"{res['calls']} calls", "",
             "| order | density @0.90 | recall @0.90 | kept vs raster @0.90 | density @0.95 | recall @0.95 | kept vs raster @0.95 |",
             "|---|---|---|---|---|---|---|"]
    base = res["orders"]["raster"]
    for name, r in res["orders"].items():
        a, b = r["0.9"], r["0.95"]
        lines.append(f"| {name} | {a['density']:.3f} | {a['recall']:.3f} | {a['density'] / base['0.9']['density']:.2f}x | "
                     f"{b['density']:.3f} | {b['recall']:.3f} | {b['density'] / base['0.95']['density']:.2f}x |")
    kinds = {k: v for k, v in res["by_head_type"].items() if k != "-"}
    if kinds:
        tile = [n for n in res["orders"] if n != "raster"][0]
        lines += ["", f"By head type (density at 0.90, raster -> {tile}):", "",
                  "| head type | heads | raster | tile | kept vs raster |", "|---|---|---|---|---|"]
        for kind, v in kinds.items():
            r, t = v["raster"]["0.9"], v[tile]["0.9"]
            lines.append(f"| {kind} | {v['heads']} | {r:.3f} | {t:.3f} | {t / r:.2f}x |")
    return lines + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--no-wan", action="store_true", help="skip (b), ComfyUI's tiny WanModel")
    ap.add_argument("--no-large", action="store_true", help="skip the 5x30x52 grid of (a)")
    ap.add_argument("--no-harness", action="store_true", help="skip the harness-size part of (a)")
    ap.add_argument("--large-grid", nargs=3, type=int, default=[5, 30, 52],
                    help="token grid of the 128-block part of (a) (default: 480p geometry, 5 latent frames)")
    ap.add_argument("--sharpen", type=float, nargs="+", default=[1.0],
                    help="q scales for (a) (>1: more peaked attention, as sample_rows.py's --sharpen)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, flush=True)  # noqa: E731
    from . import families as fam
    from skimage import data

    started = time.perf_counter()
    res = {"command": "python -m benchmarks.quality.tile_order " + " ".join(argv if argv is not None else sys.argv[1:]),
           "torch": torch.__version__, "targets": list(TARGETS), "sections": {}}
    md = ["Blocks kept at equal recall (per-row minimal top-p map of the call's own exact block mass, "
          "no keep-sets); density = kept share of block pairs; the same number of blocks in every order.", ""]
    if args.quick:
        cfg = SourceConfig(grid=(5, 8, 12), heads=4, layers=1, step_sigmas=(0.9, 0.45), high_steps=1)
        entries, _ = fam.build_workload(quick=True)
        r = measure_calls(synthetic_calls(cfg, entries[:1]), cfg.grid, 16, log, "synthetic quick")
        res["sections"]["synthetic_quick"] = r
        md += table(r, f"(a) {SOURCE_LABEL}, quick size")
    else:
        for sharpen in args.sharpen:
            tag = "" if sharpen == 1.0 else f", q x {sharpen:g}"
            if not args.no_harness:
                cfg = SourceConfig()  # the harness's non-quick size
                entries, _ = fam.build_workload(quick=False)
                r = measure_calls(synthetic_calls(cfg, entries, sharpen), cfg.grid, 32, log, f"synthetic harness{tag}")
                res["sections"][f"synthetic_harness_q{sharpen:g}"] = r
                md += table(r, f"(a) {SOURCE_LABEL}, harness size, {len(entries)} entry requests{tag}")
            if not args.no_large:
                big = SourceConfig(grid=tuple(args.large_grid), heads=8, layers=1)
                req = Request("astronaut", data.astronaut()[::2, ::2] / 255.0, "", seed=1)
                r = measure_calls(synthetic_calls(big, [req], sharpen), big.grid, 128, log, f"synthetic 480p-like{tag}")
                res["sections"][f"synthetic_480p_like_q{sharpen:g}"] = r
                md += table(r, f"(a') {SOURCE_LABEL}, 128-token blocks, one request (astronaut){tag}")
    if not args.no_wan:
        latent = (1, 16, 3, 16, 16) if args.quick else (1, 16, 5, 32, 48)
        grid = (latent[2], latent[3] // 2, latent[4] // 2)
        r = measure_calls(wan_calls(latent, seeds=(0,) if args.quick else (0, 1)), grid, 32 if args.quick else 128,
                          log, "tiny WanModel")
        res["sections"]["tiny_wan"] = r
        md += table(r, "(b) ComfyUI's tiny WanModel, RANDOM weights (near-uniform attention: a sanity number only)")
    res["seconds"] = time.perf_counter() - started
    (args.out / "tile_order.json").write_text(json.dumps(res, indent=1))
    (args.out / "tile_order.md").write_text("\n".join(md))
    log("\n".join(md))
    log(f"wrote {args.out}/tile_order.json, tile_order.md in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
