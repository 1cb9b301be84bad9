"""Self-verifying hits on the quality harness: ``python -m benchmarks.quality.verify --out DIR [--quick]``.

The engine's verification (``chorus.engine.verify``) estimates, at the first step of each expert of a
hit, the share of attention mass the reused map keeps (its recall) and the share the best map with the
same number of kept blocks per row keeps (``recall_terms`` on ``verify_heads`` evenly spaced heads of
the ``verify_layers`` layers with sampled rows per block), and demotes the hit when the *fit ratio*
(mean recall / mean best over the checked (layer, head)) falls below ``verify_threshold``. Here, on the
synthetic structured source (:mod:`.source`; random weights), with entries recorded as the miss path
records them (:func:`.harness.record_entry`; ``--record-rows`` sets the rows per block of that
recording, default the harness's, exact at quick sizes; the recorder's verification anchors -- exact
mass at the first step of each expert on the checked layers and heads -- unless ``--no-anchors``):

* **estimate error**: the estimated fit ratio and recall against the true ones of the same map on the
  same (layer, head) (exact block mass, every query row), per expert and per checked layer; the
  sampled rows per block are ``verify_rows`` scaled to the harness's block (:func:`scaled_rows`);
* **genuine hits**: every query of every family with its retrieved (top-1) entry; the demotion rate
  of near-duplicates is the number that must stay low;
* **wrong entries, forced as hits**: (a) ``permuted`` -- the maps of another request (an entry that is
  not the query's own base), shuffled across heads and across (step, layer) keys; (b) ``other_family``
  -- on the content-heavy source, every entry of another base request (another image family) than the
  query's; a wrong entry is caught when the verdict of any expert fails (the engine demotes at the
  first failing expert).

Threshold sweep on the fit ratio (and, for comparison, on the absolute recall, the former verdict):
catch rate and demotion rate per threshold. Writes ``verify.json`` and prints the markdown summary.
The q of the source has the softmax scale folded in (attention at scale 1), so q is multiplied by
``sqrt(D)`` before the engine's estimator (which uses Wan's ``1/sqrt(D)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from chorus.cache_store.embedders import ComfyGraphEmbedder
from chorus.engine import SparseConfig
from chorus.engine.runtime import floor_k_min
from chorus.engine.verify import fit_ratio, recall_estimate, recall_terms, verify_head_index

from . import families as fam
from .harness import record_entry
from .run import source_config
from .source import SOURCE_LABEL, RequestAttention, SourceConfig, build_model

THRESHOLDS = (0.9, 0.92, 0.93, 0.94, 0.945, 0.95, 0.955, 0.96, 0.97)  # on the fit ratio
RECALL_THRESHOLDS = (0.8, 0.85, 0.88, 0.9)  # the former absolute verdict, for comparison


def first_steps(cfg) -> dict[int, int]:
    """Expert -> its first step (where the engine checks)."""
    out = {}
    for step in range(len(cfg.step_sigmas)):
        out.setdefault(cfg.expert_of_step(step), step)
    return out


class Checker:
    """The engine's estimate and the true recall for one request's attention against given maps."""

    def __init__(self, model, vc: SparseConfig, block_size: int, k_min: int, rows: int):
        self.model, self.vc, self.bs, self.k_min, self.rows = model, vc, block_size, k_min, rows
        cfg = model.cfg
        self.layers = [l for l in vc.verify_layers if l < cfg.layers]
        self.heads = verify_head_index(cfg.heads, vc.verify_heads)
        self.steps = first_steps(cfg)
        self._qk: dict = {}

    def qk(self, name: str, attention: RequestAttention, expert: int, step: int, layer: int):
        key = (name, expert, step, layer)
        if key not in self._qk:
            q, k, _ = attention.qkv(expert, step, layer)
            self._qk[key] = (q * math.sqrt(q.shape[-1]), k)
        return self._qk[key]

    def check(self, name: str, attention: RequestAttention, maps: dict) -> dict:
        """Per expert: per checked layer and head, the engine's sampled-row ``recall_terms`` (recall and
        best recall at the same density) and the exact ones; the fit ratio the engine decides on (mean
        recall / mean best, :class:`ExpertCheck`), estimated and true; the true recall over all heads."""
        out = {}
        for expert, step in self.steps.items():
            est, true, true_all = [], [], []
            for layer in self.layers:
                q, k = self.qk(name, attention, expert, step, layer)
                used = floor_k_min(maps[(expert, step, layer, 0)].bool(), self.k_min)[None]
                est.append(recall_terms(q, k, used, heads=self.heads, sample_rows=self.rows,
                                        block_size=self.bs).tolist())
                true.append(recall_terms(q, k, used, heads=self.heads, sample_rows=None, block_size=self.bs).tolist())
                true_all.append(float(recall_estimate(q, k, used, heads=None, sample_rows=None, block_size=self.bs)))
            e, t = np.array(est), np.array(true)  # [layers, 2, heads]
            out[expert] = {"est_terms": est, "true_terms": true, "true_all": true_all,
                           "est": e[:, 0].mean(-1).tolist(), "true": t[:, 0].mean(-1).tolist(),
                           "est_mean": float(e[:, 0].mean()), "true_mean": float(t[:, 0].mean()),
                           "true_all_mean": float(np.mean(true_all)),
                           "est_best_mean": float(e[:, 1].mean()), "true_best_mean": float(t[:, 1].mean()),
                           "est_ratio": fit_ratio(float(e[:, 0].mean()), float(e[:, 1].mean())),
                           "true_ratio": fit_ratio(float(t[:, 0].mean()), float(t[:, 1].mean()))}
        return out


def permuted(maps: dict, seed: int) -> dict:
    """Another request's maps shuffled across (step, layer) keys of an expert and across heads."""
    gen = torch.Generator().manual_seed(seed)
    keys = sorted(maps)
    out = {}
    for key in keys:
        same_expert = [k2 for k2 in keys if k2[0] == key[0]]
        src = maps[same_expert[int(torch.randint(len(same_expert), (1,), generator=gen))]]
        out[key] = src[torch.randperm(src.shape[0], generator=gen)]
    return out


def scaled_rows(verify_rows: int, block_size: int) -> int:
    """Rows per block for a harness block: the share of a block's rows ``verify_rows`` is of the engine's
    128-token block (64 of 128 -> 8 of 16), so the harness's small blocks are not read exactly."""
    return max(1, round(verify_rows * block_size / 128))


def caught(result: dict, threshold: float, key: str = "est_ratio") -> bool:
    """The engine's verdict: demoted when any expert's estimated fit ratio is below the threshold
    (``key="est_mean"``: the former absolute verdict on the estimated recall, for comparison)."""
    return any(e[key] < threshold for e in result.values())


def run_source(content_heavy: bool, quick: bool, vc: SparseConfig, log, grid=None, small_workload=None,
               record_rows: int | None = None, anchors: bool = True, anchor_rows: int | None = None) -> dict:
    cfg, rc = source_config(quick, content_heavy)
    if record_rows is not None:  # the entries' recording precision (rows per block of the recorder's mass)
        rc = dataclasses.replace(rc, sample_rows=record_rows)
    # the recorder's verification anchors (exact mass where a hit checks), on the checker's layers and heads
    rc = dataclasses.replace(rc, anchors=anchors, anchor_rows=anchor_rows, verify_layers=vc.verify_layers,
                             verify_heads=vc.verify_heads)
    if grid is not None:
        cfg = SourceConfig(**{**cfg.__dict__, "grid": tuple(grid)})
    model = build_model(cfg)
    entries, queries = fam.build_workload(quick=quick if small_workload is None else small_workload)
    embedder = ComfyGraphEmbedder(text_weight=0.5)
    checker = Checker(model, vc, rc.block_size, rc.k_min, scaled_rows(vc.verify_rows, rc.block_size))
    t0 = time.perf_counter()
    entry_maps, entry_emb = {}, {}
    for req in entries:
        entry_maps[req.name], _ = record_entry(model, RequestAttention(model, req), rc)
        entry_emb[req.name] = embedder.embed(image=req.image, text=req.prompt)
    names = list(entry_maps)
    mat = np.stack([entry_emb[n] for n in names])
    cases = []
    for qi, req in enumerate(queries):
        att = RequestAttention(model, req)
        emb = embedder.embed(image=req.image, text=req.prompt)
        sims = mat @ emb / (np.linalg.norm(mat, axis=1) * np.linalg.norm(emb) + 1e-12)
        best = names[int(np.argmax(sims))]
        cases.append({"kind": "genuine", "family": req.family, "query": req.name, "entry": best,
                      "similarity": float(sims.max()), "result": checker.check(req.name, att, entry_maps[best])})
        others = [n for n in names if n != (req.base or "") and n != best]
        other = others[qi % len(others)]
        cases.append({"kind": "permuted", "family": req.family, "query": req.name, "entry": other,
                      "result": checker.check(req.name, att, permuted(entry_maps[other], 1000 + qi))})
        if content_heavy:
            base_of = {n: n.split("+")[-1] if "+" in n else n for n in names}
            mine = base_of.get(req.base, req.base) if req.base else None
            for n in names:
                if req.base is not None and (n == req.base or base_of[n] == mine):
                    continue
                cases.append({"kind": "other_family", "family": req.family, "query": req.name, "entry": n,
                              "result": checker.check(req.name, att, entry_maps[n])})
        mine_cases = [c for c in cases if c["query"] == req.name]
        log(f"  {'content-heavy' if content_heavy else 'default'} {req.family:16s} {req.name:24s} -> {best:16s} "
            + " | ".join(f"{c['kind']} {[round(v['est_ratio'], 3) for v in c['result'].values()]}" for c in mine_cases[:3]))
    label = SOURCE_LABEL + (" [content-heavy head mix]" if content_heavy else "")
    return {"source": label, "grid": list(cfg.grid), "heads": cfg.heads, "layers": cfg.layers,
            "block_size": rc.block_size, "top_p": rc.top_p, "k_min": rc.k_min, "checked_layers": checker.layers,
            "rows": checker.rows, "record_rows": rc.sample_rows, "anchors": rc.anchors,
            "checked_heads": checker.heads, "cases": cases, "seconds": time.perf_counter() - t0}


def errors(cases: list[dict]) -> dict:
    per_layer, per_expert, vs_all, ratio, ratio_signed = [], [], [], [], []
    for c in cases:
        for e in c["result"].values():
            per_layer += [abs(a - b) for a, b in zip(e["est"], e["true"])]
            per_expert.append(abs(e["est_mean"] - e["true_mean"]))
            vs_all.append(abs(e["est_mean"] - e["true_all_mean"]))
            ratio.append(abs(e["est_ratio"] - e["true_ratio"]))
            ratio_signed.append(e["est_ratio"] - e["true_ratio"])
    return {"per_layer_max": max(per_layer), "per_layer_mean": float(np.mean(per_layer)),
            "per_expert_max": max(per_expert), "per_expert_mean": float(np.mean(per_expert)),
            "vs_all_heads_max": max(vs_all), "vs_all_heads_mean": float(np.mean(vs_all)), "n_layers": len(per_layer),
            "ratio_max": max(ratio), "ratio_mean": float(np.mean(ratio)), "ratio_bias": float(np.mean(ratio_signed)),
            "n_experts": len(ratio)}


def sweep(sources: list[dict], thresholds=THRESHOLDS, key: str = "est_ratio") -> list[dict]:
    rows = []
    for tau in thresholds:
        row = {"threshold": tau}
        for src in sources:
            tag = "ch" if "content-heavy" in src["source"] else "def"
            for kind in ("permuted", "other_family"):
                cs = [c for c in src["cases"] if c["kind"] == kind]
                if cs:
                    row[f"{tag}_{kind}_caught"] = float(np.mean([caught(c["result"], tau, key) for c in cs]))
                    row[f"{tag}_{kind}_n"] = len(cs)
            for family in fam.FAMILIES:
                cs = [c for c in src["cases"] if c["kind"] == "genuine" and c["family"] == family]
                if cs:
                    row[f"{tag}_{family}_demoted"] = float(np.mean([caught(c["result"], tau, key) for c in cs]))
                    row[f"{tag}_{family}_n"] = len(cs)
        rows.append(row)
    return rows


def _sweep_table(rows: list[dict], marked: float | None, label: str) -> list[str]:
    cols = [k for k in rows[0] if k.endswith("_caught") or k.endswith("_demoted")]
    lines = ["| " + label + " | " + " | ".join(c.replace("def_", "default: ").replace("ch_", "content-heavy: ")
                                              .replace("_", " ") for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for row in rows:
        mark = "**" if marked is not None and abs(row["threshold"] - marked) < 1e-9 else ""
        lines.append(f"| {mark}{row['threshold']:.3g}{mark} | " + " | ".join(f"{row[c]:.0%}" for c in cols) + " |")
    return lines


def markdown(res: dict) -> str:
    vc = res["verify_config"]
    src0 = res["sources"][0]
    described = "; ".join(f"{s['source']} (grid {tuple(s['grid'])}, {s['heads']} heads, {s['layers']} layers per "
                          f"expert, block {s['block_size']})" for s in res["sources"])
    lines = [f"Sources: {described}.",
             f"Check: layers {src0['checked_layers']} (of verify_layers {vc['verify_layers']}), heads "
             f"{src0['checked_heads']} (verify_heads {vc['verify_heads']}), {src0['rows']} sampled rows per block of "
             f"{src0['block_size']} (verify_rows {vc['verify_rows']} of a 128 block, the same share), entries recorded from "
             f"{src0['record_rows']} rows per block"
             f"{' (exact on the verification anchors)' if src0.get('anchors') else ' (no verification anchors)'}"
             ", at the first step "
             "of each expert; verdict on the fit ratio = mean recall / mean best recall at the same density over "
             "the checked (layer, head).", "",
             "| estimate vs truth (same heads, exact mass) | max abs error | mean abs error |", "|---|---|---|"]
    e = res["errors"]
    lines += [f"| fit ratio per expert (the verdict's number; {e['n_experts']} estimates; mean signed error "
              f"{e['ratio_bias']:+.4f}) | {e['ratio_max']:.4f} | {e['ratio_mean']:.4f} |",
              f"| recall per checked layer ({e['n_layers']} estimates) | {e['per_layer_max']:.4f} | {e['per_layer_mean']:.4f} |",
              f"| recall per expert (mean over checked layers) | {e['per_expert_max']:.4f} | {e['per_expert_mean']:.4f} |",
              f"| recall per expert, against the true recall over ALL heads | {e['vs_all_heads_max']:.4f} | {e['vs_all_heads_mean']:.4f} |", ""]
    rec = {}
    for src in res["sources"]:
        tag = "content-heavy" if "content-heavy" in src["source"] else "default"
        for kind in ("genuine", "permuted", "other_family"):
            cs = [c for c in src["cases"] if c["kind"] == kind]
            if not cs:
                continue
            by_fam = {}
            for c in cs:
                by_fam.setdefault(c["family"] if kind == "genuine" else "all", []).append(
                    (min(v["true_mean"] for v in c["result"].values()), min(v["est_ratio"] for v in c["result"].values())))
            for f, vals in by_fam.items():
                arr = np.array(vals)
                rec[(tag, kind, f)] = (len(vals), arr.mean(0), arr.min(0), arr.max(0))
    lines += ["| source | case | family | n | true recall of the worse expert: mean / min / max | estimated fit ratio "
              "of the worse expert: mean / min / max |", "|---|---|---|---|---|---|"]
    for (tag, kind, f), (n, mean, lo, hi) in rec.items():
        lines.append(f"| {tag} | {kind} | {f} | {n} | {mean[0]:.3f} / {lo[0]:.3f} / {hi[0]:.3f} | "
                     f"{mean[1]:.3f} / {lo[1]:.3f} / {hi[1]:.3f} |")
    lines += ["", "Fit-ratio verdict (the engine's):", ""] + _sweep_table(res["sweep"], vc["verify_threshold"],
                                                                           "fit ratio threshold")
    lines += ["", "For comparison, the former absolute verdict (estimated recall below the threshold):", ""]
    lines += _sweep_table(res["sweep_recall"], None, "recall threshold")
    first = res["sweep"][0]
    ns = {c[:-2]: first[c] for c in first if c.endswith("_n")}
    lines += ["", "Cases per column: " + ", ".join(f"{k.replace('def_', 'default ').replace('ch_', 'content-heavy ')} {v}"
                                                 for k, v in ns.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the test runs this)")
    ap.add_argument("--threshold", type=float, default=SparseConfig().verify_threshold)
    ap.add_argument("--verify-heads", type=int, default=SparseConfig().verify_heads)
    ap.add_argument("--verify-rows", type=int, default=SparseConfig().verify_rows)
    ap.add_argument("--grid", nargs=3, type=int, default=None, help="token grid T H W (default: the harness's)")
    ap.add_argument("--record-rows", type=int, default=None,
                    help="rows per block the entries are recorded from (default: the harness's; its block or more = "
                         "exact; 1 = the engine recorder's share, 8 of 128)")
    ap.add_argument("--no-anchors", action="store_true",
                    help="record without the recorder's verification anchors (every call at --record-rows)")
    ap.add_argument("--anchor-rows", type=int, default=None,
                    help="rows per block on the anchors (default: exact, as the engine records them)")
    ap.add_argument("--full-workload", action="store_true",
                    help="with --quick: the quick sizes but every query of the full workload")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    vc = SparseConfig(verify_threshold=args.threshold, verify_heads=args.verify_heads, verify_rows=args.verify_rows)
    started = time.perf_counter()
    def log(msg):
        print(msg, flush=True)

    small = False if args.full_workload else None
    sources = [run_source(ch, args.quick, vc, log, args.grid, small, args.record_rows, not args.no_anchors,
                          args.anchor_rows) for ch in (False, True)]
    all_cases = [c for s in sources for c in s["cases"]]
    res = {"command": "python -m benchmarks.quality.verify " + " ".join(argv if argv is not None else sys.argv[1:]),
           "torch": torch.__version__,
           "verify_config": {"verify_threshold": vc.verify_threshold, "verify_layers": list(vc.verify_layers),
                             "verify_heads": vc.verify_heads, "verify_rows": vc.verify_rows},
           "sources": sources, "errors": errors(all_cases), "sweep": sweep(sources),
           "sweep_recall": sweep(sources, RECALL_THRESHOLDS, key="est_mean")}
    res["seconds"] = time.perf_counter() - started
    (args.out / "verify.json").write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res)
    (args.out / "verify.md").write_text(md)
    print(md)
    print(f"wrote {args.out}/verify.json, verify.md in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
