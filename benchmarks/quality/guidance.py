"""Guidance study: latent deviation from dense and first-frame consistency, with and without guidance.

``python -m benchmarks.quality.guidance --out DIR [--quick] [--grid T H W] [--heads N] [--layers N]``

End to end through the real engine on :mod:`.tiny_e2e`'s structured diffusers Wan 2.2 A14B-shaped
pair (random weights with RoPE-aligned q/k biases; 4 flow-matching Euler steps, 2 per expert). For
every similar request of the workload (:mod:`.families`, all families but ``unrelated``) its source
entry is first run as a miss with feature reuse recording (sparse masks + region scores, committed
to a workspace); then the query runs dense (no patch) and through the engine on that entry in these
variants, side by side:

- ``reuse``: sparsity reuse alone; ``reuse+fr``: plus feature reuse (downsampled regions);
- ``reuse+fr+text`` / ``+image`` / ``+text+image``: plus ChorusGuidanceBoost's text gain and/or
  first-frame self-attention bias (``patch_diffusers_guidance``; strengths 0.5, the node defaults).

Per variant: ``latent_rel_l2`` (sampled latent vs dense), ``first_frame_rel_l2`` (latent frame 0, the
image frame, vs dense: first-frame consistency), ``first_frame_to_image`` (latent frame 0 vs the encoded
start image, relative L2; the dense run's value beside it), ``frames_psnr`` / ``first_frame_psnr``
(decoded by the tiny VAE, dB vs dense). Random weights: how much each approximation moves the result, not how a
trained model's video looks. Writes ``guidance.json`` and ``guidance.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from chorus.cache_store import Workspace
from chorus.cache_store.embedders import ComfyGraphEmbedder
from chorus.engine.feature_reuse import FeatureReuseConfig

from . import families as fam
from . import tiny_e2e
from .harness import psnr

VARIANTS = {  # name: (feature reuse?, (text strength, image strength) or None)
    "reuse": (False, None),
    "reuse+fr": (True, None),
    "reuse+fr+text": (True, (0.5, 0.0)),
    "reuse+fr+image": (True, (0.0, 0.5)),
    "reuse+fr+text+image": (True, (0.5, 0.5)),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def study_pairs(quick: bool):
    """``[(family, entry, query)]``: every similar query with the entry it was derived from."""
    entries, queries = fam.build_workload(quick=quick)
    by_name = {e.name: e for e in entries}
    return [(q.family, by_name[q.base], q) for q in queries if q.base in by_name]


def run_study(pairs, cfg: tiny_e2e.TinyConfig, experts, vae, fr_config: FeatureReuseConfig, label: str,
              log=print, on_row=None) -> dict:
    """Run the variants on ``pairs``; ``on_row(partial_result)`` is called after every request (so a
    run stopped by a time limit keeps what it measured)."""
    runner = tiny_e2e.TinyRunner(cfg, experts, vae, label)
    embedder = ComfyGraphEmbedder(text_weight=0.5)
    rows = []
    with tempfile.TemporaryDirectory(prefix="chorus-guidance-ws-") as wdir:
        ws = Workspace.open(wdir)
        written = set()
        for family, entry, query in pairs:
            if entry.name not in written:
                runner.run_engine(ws, entry, embedder.embed(image=entry.image, text=entry.prompt), 1.0,
                                  feature_reuse=fr_config)
                written.add(entry.name)
            emb = embedder.embed(image=query.image, text=query.prompt)
            dense = runner.sample(query)
            frames_dense = runner.decode(dense)
            image_latent = runner._condition(query)[1][:, 4:, :1].float()  # y = [mask (4), image latent (16)]
            row = {"family": family, "entry": entry.name, "query": query.name, "variants": {},
                   "dense_first_frame_to_image": _rel(dense[:, :, :1], image_latent)}
            for name, (use_fr, guidance) in VARIANTS.items():
                out, plan, _ = runner.run_engine(ws, query, emb, 0.0, feature_reuse=fr_config if use_fr else None,
                                                 guidance=guidance)
                v = {"latent_rel_l2": _rel(out, dense), "first_frame_rel_l2": _rel(out[:, :, :1], dense[:, :, :1]),
                     "first_frame_to_image": _rel(out[:, :, :1], image_latent),
                     "similarity": plan.similarity, "density": plan.stats.density,
                     "fallback_calls": plan.stats.fallback_calls, "hit": plan.is_hit}
                frames = runner.decode(out)
                if frames is not None and frames_dense is not None:
                    v["frames_psnr"] = psnr(frames, frames_dense, data_range=2.0)
                    v["first_frame_psnr"] = psnr(frames[:, :, :1], frames_dense[:, :, :1], data_range=2.0)
                row["variants"][name] = v
            rows.append(row)
            if on_row is not None:
                on_row(_result(rows, label, cfg, fr_config))
            log(f"{family:16s} {query.name:22s} " + "  ".join(
                f"{n} {v['latent_rel_l2']:.4f}/{v['first_frame_rel_l2']:.4f}" for n, v in row["variants"].items()))
    return _result(rows, label, cfg, fr_config)


def _result(rows, label, cfg, fr_config) -> dict:
    means = {}
    for name in VARIANTS:
        vals = [r["variants"][name] for r in rows]
        means[name] = {k: sum(v[k] for v in vals) / len(vals) for k in vals[0]
                       if isinstance(vals[0][k], float) and k not in ("similarity",)} if vals else {}
    dense_to_image = sum(r["dense_first_frame_to_image"] for r in rows) / max(len(rows), 1)
    return {"label": label, "config": {**cfg.__dict__}, "feature_reuse": {**fr_config.__dict__}, "rows": rows,
            "means": means, "dense_first_frame_to_image": dense_to_image}


def summary_markdown(res: dict) -> str:
    lines = [f"Model: {res['label']}; latent grid {tuple(res['config']['latent_grid'])}, "
             f"{res['config']['layers']} layers x {res['config']['heads']} heads, block {res['config']['block_size']}; "
             f"feature reuse share {res['feature_reuse']['downsample_share']} region "
             f"{tuple(res['feature_reuse']['region'])}; {len(res['rows'])} similar requests.", "",
             "| variant | latent rel L2 vs dense | first frame rel L2 vs dense | first frame vs start image "
             "| frames PSNR (dB) | first frame PSNR (dB) |", "|---|---|---|---|---|---|",
             f"| dense | 0 | 0 | {res['dense_first_frame_to_image']:.4f} | - | - |"]
    def cell(m, key, spec):
        return format(m[key], spec) if key in m else "-"

    for name, m in res["means"].items():
        lines.append(f"| {name} | {cell(m, 'latent_rel_l2', '.4f')} | {cell(m, 'first_frame_rel_l2', '.4f')} "
                     f"| {cell(m, 'first_frame_to_image', '.4f')} | {cell(m, 'frames_psnr', '.2f')} "
                     f"| {cell(m, 'first_frame_psnr', '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="3 similar requests on a small grid (CPU, about a minute)")
    ap.add_argument("--grid", type=int, nargs=3, default=None, metavar=("T", "H", "W"), help="latent grid")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--share", type=float, default=0.25, help="feature reuse downsample_share")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--max-requests", type=int, default=None, help="stop after this many similar requests")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    grid = tuple(args.grid) if args.grid else ((4, 16, 16) if args.quick else (5, 16, 24))
    tokens_hw = (grid[1] // 2) * (grid[2] // 2)
    block = args.block_size or (16 if tokens_hw <= 64 else 32 if tokens_hw <= 256 else 128)
    region = (2, 4, 4) if min(grid[1], grid[2]) // 2 < 16 else (2, 8, 8)
    cfg = tiny_e2e.TinyConfig(latent_grid=grid, heads=args.heads, head_dim=args.head_dim, layers=args.layers,
                              block_size=block, decode=not args.no_decode)
    fr_config = FeatureReuseConfig(downsample_share=args.share, region=region, full_layers=1 if args.layers > 1 else 0)
    experts, vae = tiny_e2e.tiny_models(cfg)
    if torch.cuda.is_available():
        experts = [m.cuda() for m in experts]
        vae = vae.cuda() if vae is not None else None
    started = time.perf_counter()
    info = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                command="python -m benchmarks.quality.guidance " + " ".join(argv if argv is not None else sys.argv[1:]))

    def write(res):
        res.update(info, seconds=time.perf_counter() - started)
        (args.out / "guidance.json").write_text(json.dumps(res, indent=1, default=str))
        (args.out / "guidance.md").write_text(summary_markdown(res))

    pairs = study_pairs(args.quick)[:args.max_requests]
    res = run_study(pairs, cfg, experts, vae, fr_config, tiny_e2e.TINY_LABEL, on_row=write)
    write(res)
    print(summary_markdown(res))
    print(f"wrote {args.out}/guidance.json and guidance.md in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
