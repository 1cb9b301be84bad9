"""Quality harness CLI: ``python -m benchmarks.quality.run --out DIR [--quick]``.

1. Attention level (synthetic structured source, :mod:`.source`): entries are recorded as the
   engine's miss path records them and written to a real workspace; every query of every family
   (:mod:`.families`) retrieves its most similar entry and is scored (:mod:`.harness`): hit rate at
   the threshold, attention-mass recall, output error against dense, density, against the request's
   own oracle map and a static prompt-agnostic map. A sweep over thresholds recommends the lowest
   threshold at which no hit is unsafe, and plots recall and error against similarity.
2. End to end (:mod:`.tiny_e2e`): one query per family through the real engine on a tiny diffusers
   Wan 2.2 A14B-shaped pair (or real weights with ``--wan-transformer``), PSNR (and SSIM) of the
   decoded frames of reuse against dense.

Writes ``results.json``, ``summary.md`` and ``recall_vs_similarity.png`` / ``error_vs_similarity.png``
into ``--out``. Every table names its attention source and whether the weights were random.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from chorus.cache_store import Workspace
from chorus.cache_store.embedders import ComfyGraphEmbedder, HashEmbedder

from . import families as fam
from .harness import ReuseConfig, evaluate_query, record_entry, static_masks_from, threshold_table
from .source import SOURCE_LABEL, RequestAttention, SourceConfig, build_model

DEFAULT_THRESHOLD = 0.9  # ChorusMaskRetrieve's default


def make_embedder(kind: str, workdir: Path):
    """``comfy`` (ComfyGraphEmbedder: hashed prompt + start-image pixels, the no-extra-model path of
    the nodes), ``hash`` (HashEmbedder), ``openclip-random`` (open_clip ViT-B-32, random weights saved
    to a local file and loaded through OpenClipEmbedder), ``openclip:ARCH:CHECKPOINT`` (real weights)."""
    if kind == "comfy":
        return ComfyGraphEmbedder(text_weight=0.5), "ComfyGraphEmbedder (hashed prompt + start-image pixel thumbnail, fixed projections)"
    if kind == "hash":
        return HashEmbedder(text_weight=0.5), "HashEmbedder (hashed prompt + 8x8 pixel thumbnail)"
    from chorus.cache_store.embedders import OpenClipEmbedder

    if kind == "openclip-random":
        import open_clip

        torch.manual_seed(0)
        model = open_clip.create_model("ViT-B-32", pretrained=None)
        path = workdir / "openclip_random_vitb32.pt"
        torch.save(model.state_dict(), path)
        return OpenClipEmbedder("ViT-B-32", path, text_weight=0.5), "open_clip ViT-B-32 with RANDOM weights"
    if kind.startswith("openclip:"):
        _, arch, ckpt = kind.split(":", 2)
        return OpenClipEmbedder(arch, ckpt, text_weight=0.5), f"open_clip {arch} from {ckpt}"
    raise ValueError(f"unknown embedder {kind!r}")


def source_config(quick: bool, content_heavy: bool = False) -> tuple[SourceConfig, ReuseConfig]:
    if quick:
        return (SourceConfig(grid=(6, 8, 12), heads=4, layers=1, step_sigmas=(0.9, 0.45), high_steps=1, patch=4,
                             content_heavy=content_heavy), ReuseConfig(block_size=16))
    return SourceConfig(content_heavy=content_heavy), ReuseConfig(block_size=32)


def run_attention_level(out: Path, quick: bool, embedder, threshold: float, refresh_steps: int, log,
                        content_heavy: bool = False) -> dict:
    cfg, rc = source_config(quick, content_heavy)
    rc = ReuseConfig(**{**rc.__dict__, "refresh_steps": refresh_steps})
    model = build_model(cfg)
    entries, queries = fam.build_workload(quick=quick)
    results, entry_masses = [], []
    with tempfile.TemporaryDirectory(prefix="chorus-quality-ws-") as tmp:
        ws = Workspace.open(tmp)
        signature = {"source": "synthetic-structured", "grid": list(cfg.grid), "heads": cfg.heads,
                     "block_size": rc.block_size, "seed": cfg.seed}
        names = {}
        t0 = time.perf_counter()
        for req in entries:
            masks, masses = record_entry(model, RequestAttention(model, req), rc)
            entry_masses.append(masses)
            eid = ws.add(embedder.embed(image=req.image, text=req.prompt), masks,
                         {"signature": signature, "prompt": req.prompt, "name": req.name})
            names[eid] = req.name
        log(f"recorded {len(entries)} entries in {time.perf_counter() - t0:.1f} s")
        static = static_masks_from(entry_masses, cfg, rc)
        for req in queries:
            t1 = time.perf_counter()
            emb = embedder.embed(image=req.image, text=req.prompt)
            (eid, sim), = ws.search(emb, k=1)
            masks, _ = ws.load(eid, touch=False)
            metrics = evaluate_query(model, RequestAttention(model, req), masks, static, rc)
            row = {"query": req.name, "family": req.family, "expected_entry": req.base, "entry": names[eid],
                   "similarity": float(sim), "hit": bool(sim >= threshold), **metrics}
            results.append(row)
            log(f"  {req.family:16s} {req.name:28s} -> {names[eid]:18s} sim {sim:.3f} recall {metrics['recall']:.3f} "
                f"(own {metrics['own_recall']:.3f}) rel_l2 {metrics['rel_l2']:.3f} density {metrics['density']:.2f} "
                f"[{time.perf_counter() - t1:.1f} s]")
    table, recommended = threshold_table(results)
    per_family = {}
    for family in fam.FAMILIES:
        rows = [r for r in results if r["family"] == family]
        if not rows:
            continue
        agg = {k: float(np.mean([r[k] for r in rows])) for k in rows[0] if isinstance(rows[0][k], float)}
        agg["hit_rate"] = float(np.mean([r["hit"] for r in rows]))
        agg["queries"] = len(rows)
        agg["retrieved_expected"] = float(np.mean([r["entry"] == r["expected_entry"] for r in rows])) \
            if rows[0]["expected_entry"] else None
        per_family[family] = agg
    label = SOURCE_LABEL + (" [content-heavy head mix]" if content_heavy else "")
    return {"source": label, "source_config": {**cfg.__dict__}, "reuse_config": {**rc.__dict__},
            "tokens": cfg.tokens, "per_query": results, "per_family": per_family, "threshold_table": table,
            "recommended_threshold": recommended}


def plot(results: list[dict], threshold: float, recommended, out: Path, source: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"near_duplicate": "tab:green", "layout": "tab:blue", "template_subject": "tab:orange",
              "unrelated": "tab:red"}
    files = []
    for metric, own, ylabel, name in (("recall", "own_recall", "attention-mass recall of the reused map", "recall_vs_similarity.png"),
                                      ("rel_l2", "own_rel_l2", "attention output rel. L2 error vs dense", "error_vs_similarity.png")):
        fig, ax = plt.subplots(figsize=(5.2, 3.4), dpi=110)
        for family, color in colors.items():
            rows = [r for r in results if r["family"] == family]
            if rows:
                ax.scatter([r["similarity"] for r in rows], [r[metric] for r in rows], s=22, c=color, label=family)
        ax.scatter([r["similarity"] for r in results], [r[own] for r in results], s=10, marker="_", c="k",
                   label="own oracle map")
        ax.axvline(threshold, color="gray", ls="--", lw=1, label=f"default threshold {threshold}")
        if recommended is not None and abs(recommended - threshold) > 1e-9:
            ax.axvline(recommended, color="purple", ls=":", lw=1, label=f"lowest safe threshold {recommended} (error)")
        ax.set_xlabel("embedding similarity to the reused entry")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(source.replace(" (", "\n("), fontsize=7)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        files.append(name)
    return files


def e2e_pairs(attn: dict, quick: bool):
    """One query per family (the first) with its retrieved entry (quick: near-duplicate and unrelated)."""
    entries, queries = fam.build_workload(quick=quick)
    by_name = {r.name: r for r in entries}
    pairs, seen = [], set()
    for row, req in zip(attn["per_query"], queries):
        if req.family in seen or (quick and req.family not in ("near_duplicate", "unrelated")):
            continue
        seen.add(req.family)
        pairs.append((req.family, by_name[row["entry"]], req))
    return pairs


def fmt(x, spec=".3f"):
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def summary_markdown(res: dict) -> str:
    a = res["attention"]
    lines = [f"Attention source: **{a['source']}**; embedder: {res['embedder']}; "
             f"{a['tokens']} tokens (grid {tuple(a['source_config']['grid'])}), block {a['reuse_config']['block_size']}, "
             f"top_p {a['reuse_config']['top_p']}, k_min {a['reuse_config']['k_min']}, refresh_steps "
             f"{a['reuse_config']['refresh_steps']}; threshold {res['threshold']}.", "",
             "| family | queries | hit rate | similarity | recall (reused) | recall (own) | recall (static) | rel L2 (reused) "
             "| rel L2 (own) | cosine (reused) | density (reused) | density (own) | density (static) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for family, f in a["per_family"].items():
        lines.append(f"| {family} | {f['queries']} | {f['hit_rate']:.0%} | {f['similarity']:.3f} | {f['recall']:.3f} | "
                     f"{f['own_recall']:.3f} | {f['static_recall']:.3f} | {f['rel_l2']:.3f} | {f['own_rel_l2']:.3f} | "
                     f"{f['cosine']:.4f} | {f['density']:.2f} | {f['own_density']:.2f} | {f['static_density']:.2f} |")
    rec = a["recommended_threshold"]
    lines += ["", f"Lowest threshold at which no hit is unsafe: **{rec['unsafe_recall']}** by mass recall (reused "
              f"recall more than {rec['criteria']['recall_margin']} below the request's own oracle recall), "
              f"**{rec['unsafe_error']}** by output error (reused error more than {rec['criteria']['error_ratio']}x "
              f"the own oracle map's).", "",
              "| threshold | hit rate | hits | unsafe (recall) | unsafe (error) | recall mean | recall worst call | "
              "rel L2 mean | rel L2 worst |",
              "|---|---|---|---|---|---|---|---|---|"]
    marks = {rec["unsafe_recall"], rec["unsafe_error"]}
    for row in a["threshold_table"]:
        if round(row["threshold"] * 100) % 10 == 0 or row["threshold"] in marks or row["threshold"] in (0.85, 0.95):
            lines.append(f"| {row['threshold']:.2f} | {row['hit_rate']:.0%} | {row['hits']} | {row['unsafe_recall']} | "
                         f"{row['unsafe_error']} | "
                         f"{fmt(row.get('recall_mean'))} | {fmt(row.get('recall_worst'))} | {fmt(row.get('rel_l2_mean'))} | "
                         f"{fmt(row.get('rel_l2_worst'))} |")
    e = res.get("e2e")
    if e:
        lines += ["", f"End to end: **{e['label']}**, latent grid {tuple(e['config']['latent_grid'])}, "
                  f"{e['config']['steps']} steps ({e['config']['high_steps']} high + "
                  f"{e['config']['steps'] - e['config']['high_steps']} low), reuse forced (threshold 0) to measure its cost.", "",
                  "| family | query -> entry | similarity | hit at threshold | density | latent PSNR dB | frames PSNR dB | frames SSIM |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in e["rows"]:
            lines.append(f"| {r['family']} | {r['query']} -> {r['entry']} | {fmt(r['similarity'])} | {r['hit_at_threshold']} | "
                         f"{fmt(r['density'], '.2f')} | {fmt(r['latent_psnr'], '.1f')} | {fmt(r.get('frames_psnr'), '.1f')} | "
                         f"{fmt(r.get('frames_ssim'), '.4f')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="output folder (created)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CI): 3 entries, 9 queries")
    ap.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="similarity threshold for a hit")
    ap.add_argument("--refresh-steps", type=int, default=0, help="visit refresh R (0 = off, the engine default)")
    ap.add_argument("--embedder", default="comfy", help="comfy | hash | openclip-random | openclip:ARCH:CHECKPOINT")
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end tiny-model part")
    ap.add_argument("--content-heavy", action="store_true",
                    help="sensitivity check: a source whose heads are mostly content-driven")
    ap.add_argument("--no-decode", action="store_true", help="end to end: compare latents only (no VAE decode)")
    ap.add_argument("--wan-transformer", nargs="+", default=None,
                    help="real weights: diffusers Wan transformer folder(s), high-noise expert first")
    ap.add_argument("--wan-vae", default=None, help="real weights: diffusers Wan VAE folder")
    ap.add_argument("--clip", default=None, help="ARCH:CHECKPOINT of a local open_clip model for CLIP text-video "
                                                 "score and first-frame identity similarity")
    ap.add_argument("--lpips", action="store_true", help="also LPIPS (needs the lpips package and its weights "
                                                         "available locally; nothing is downloaded on purpose)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    def log(msg):
        print(msg, flush=True)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="chorus-quality-") as tmp:
        embedder, embedder_label = make_embedder(args.embedder, Path(tmp))
        res = {"threshold": args.threshold, "embedder": embedder_label, "quick": args.quick,
               "command": "python -m benchmarks.quality.run " + " ".join(argv if argv is not None else sys.argv[1:]),
               "torch": torch.__version__}
        res["attention"] = run_attention_level(args.out, args.quick, embedder, args.threshold, args.refresh_steps, log,
                                               args.content_heavy)
        res["plots"] = plot(res["attention"]["per_query"], args.threshold,
                        res["attention"]["recommended_threshold"]["unsafe_error"], args.out, res["attention"]["source"])
        if not args.no_e2e:
            from . import tiny_e2e

            if args.wan_transformer:
                cfg = tiny_e2e.TinyConfig(latent_grid=(21, 60, 104), block_size=128, decode=not args.no_decode)
                experts, vae = tiny_e2e.load_real_models(args.wan_transformer, args.wan_vae)
                label = f"REAL weights from {', '.join(args.wan_transformer)}"
            else:
                cfg = tiny_e2e.TinyConfig(latent_grid=(4, 16, 16) if args.quick else (5, 16, 24),
                                          block_size=16 if args.quick else 32, decode=not args.no_decode)
                experts, vae = tiny_e2e.tiny_models(cfg)
                label = tiny_e2e.TINY_LABEL
            clip = None
            if args.clip:
                from chorus.cache_store.embedders import OpenClipEmbedder

                arch, ckpt = args.clip.split(":", 1)
                clip = OpenClipEmbedder(arch, ckpt)
            lpips_model = None
            if args.lpips:
                try:
                    import lpips

                    lpips_model = lpips.LPIPS(net="alex", verbose=False)
                except Exception as exc:  # noqa: BLE001 - optional metric
                    log(f"LPIPS not computed: {type(exc).__name__}: {exc}")
            with tempfile.TemporaryDirectory(prefix="chorus-quality-e2e-ws-") as wdir:
                rows = tiny_e2e.run_pairs(e2e_pairs(res["attention"], args.quick), embedder, Workspace.open(wdir), cfg,
                                          experts, vae, args.threshold, label, clip=clip, lpips_model=lpips_model)
            res["e2e"] = {"label": label, "config": {**cfg.__dict__}, "rows": rows}
            for r in rows:
                log(f"  e2e {r['family']:16s} {r['query']:24s} psnr latent {fmt(r['latent_psnr'], '.1f')} dB, frames "
                    f"{fmt(r.get('frames_psnr'), '.1f')} dB, density {fmt(r['density'], '.2f')}")
    res["seconds"] = time.perf_counter() - started
    (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    (args.out / "summary.md").write_text(summary_markdown(res))
    log(summary_markdown(res))
    log(f"wrote {args.out}/results.json, summary.md, {', '.join(res['plots'])} in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
