"""Self-verifying hits on the quality harness: ``python -m benchmarks.quality.verify --out DIR [--quick]``.

The engine's verification (``chorus.engine.verify``) estimates, at the first step of each expert of a
hit, the share of attention mass the reused map keeps (``recall_estimate`` on ``verify_heads``
evenly spaced heads of the ``verify_layers`` layers with ``verify_rows`` sampled rows per block) and
demotes the hit when the mean over the checked layers falls below ``verify_threshold``. Here, on the
synthetic structured source (:mod:`.source`; random weights), with entries recorded as the miss path
records them (:func:`.harness.record_entry`):

* **estimate error**: the estimate against the true recall of the same map on the same (layer, head)
  (exact block mass, every query row), per checked layer and per expert mean;
* **genuine hits**: every query of every family with its retrieved (top-1) entry; the demotion rate
  of near-duplicates is the number that must stay low;
* **wrong entries, forced as hits**: (a) ``permuted`` -- the maps of another request (an entry that is
  not the query's own base), shuffled across heads and across (step, layer) keys; (b) ``other_family``
  -- on the content-heavy source, every entry of another base request (another image family) than the
  query's; a wrong entry is caught when the verdict of any expert fails (the engine demotes at the
  first failing expert).

Threshold sweep: catch rate and demotion rate per threshold. Writes ``verify.json`` and prints the
markdown summary. The q of the source has the softmax scale folded in (attention at scale 1), so q is
multiplied by ``sqrt(D)`` before the engine's estimator (which uses Wan's ``1/sqrt(D)``).
"""

from __future__ import annotations

import argparse
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
from chorus.engine.verify import recall_estimate, verify_head_index

from . import families as fam
from .harness import record_entry
from .run import source_config
from .source import SOURCE_LABEL, RequestAttention, SourceConfig, build_model

THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)


def first_steps(cfg) -> dict[int, int]:
    """Expert -> its first step (where the engine checks)."""
    out = {}
    for step in range(len(cfg.step_sigmas)):
        out.setdefault(cfg.expert_of_step(step), step)
    return out


class Checker:
    """The engine's estimate and the true recall for one request's attention against given maps."""

    def __init__(self, model, vc: SparseConfig, block_size: int, k_min: int):
        self.model, self.vc, self.bs, self.k_min = model, vc, block_size, k_min
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
        """Per expert: per-layer estimate / true recall (checked heads) / true recall (all heads)."""
        out = {}
        for expert, step in self.steps.items():
            rows = []
            for layer in self.layers:
                q, k = self.qk(name, attention, expert, step, layer)
                used = floor_k_min(maps[(expert, step, layer, 0)].bool(), self.k_min)[None]
                est, est_best = recall_estimate(q, k, used, heads=self.heads, sample_rows=self.vc.verify_rows,
                                                block_size=self.bs, with_best=True).tolist()
                true, true_best = recall_estimate(q, k, used, heads=self.heads, sample_rows=None, block_size=self.bs,
                                                  with_best=True).tolist()
                true_all = float(recall_estimate(q, k, used, heads=None, sample_rows=None, block_size=self.bs))
                rows.append((est, true, true_all, est_best, true_best))
            arr = np.array(rows)
            out[expert] = {"est": arr[:, 0].tolist(), "true": arr[:, 1].tolist(), "true_all": arr[:, 2].tolist(),
                           "est_mean": float(arr[:, 0].mean()), "true_mean": float(arr[:, 1].mean()),
                           "true_all_mean": float(arr[:, 2].mean()), "est_best_mean": float(arr[:, 3].mean()),
                           "true_best_mean": float(arr[:, 4].mean())}
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


def caught(result: dict, threshold: float) -> bool:
    """The engine's verdict: demoted when any expert's mean estimate is below the threshold."""
    return any(e["est_mean"] < threshold for e in result.values())


def run_source(content_heavy: bool, quick: bool, vc: SparseConfig, log, grid=None, small_workload=None) -> dict:
    cfg, rc = source_config(quick, content_heavy)
    if grid is not None:
        cfg = SourceConfig(**{**cfg.__dict__, "grid": tuple(grid)})
    model = build_model(cfg)
    entries, queries = fam.build_workload(quick=quick if small_workload is None else small_workload)
    embedder = ComfyGraphEmbedder(text_weight=0.5)
    checker = Checker(model, vc, rc.block_size, rc.k_min)
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
            + " | ".join(f"{c['kind']} {[round(v['est_mean'], 3) for v in c['result'].values()]}" for c in mine_cases[:3]))
    label = SOURCE_LABEL + (" [content-heavy head mix]" if content_heavy else "")
    return {"source": label, "grid": list(cfg.grid), "heads": cfg.heads, "layers": cfg.layers,
            "block_size": rc.block_size, "top_p": rc.top_p, "k_min": rc.k_min, "checked_layers": checker.layers,
            "checked_heads": checker.heads, "cases": cases, "seconds": time.perf_counter() - t0}


def errors(cases: list[dict]) -> dict:
    per_layer, per_expert, vs_all = [], [], []
    for c in cases:
        for e in c["result"].values():
            per_layer += [abs(a - b) for a, b in zip(e["est"], e["true"])]
            per_expert.append(abs(e["est_mean"] - e["true_mean"]))
            vs_all.append(abs(e["est_mean"] - e["true_all_mean"]))
    return {"per_layer_max": max(per_layer), "per_layer_mean": float(np.mean(per_layer)),
            "per_expert_max": max(per_expert), "per_expert_mean": float(np.mean(per_expert)),
            "vs_all_heads_max": max(vs_all), "vs_all_heads_mean": float(np.mean(vs_all)), "n_layers": len(per_layer)}


def sweep(sources: list[dict], thresholds=THRESHOLDS) -> list[dict]:
    rows = []
    for tau in thresholds:
        row = {"threshold": tau}
        for src in sources:
            tag = "ch" if "content-heavy" in src["source"] else "def"
            for kind in ("permuted", "other_family"):
                cs = [c for c in src["cases"] if c["kind"] == kind]
                if cs:
                    row[f"{tag}_{kind}_caught"] = float(np.mean([caught(c["result"], tau) for c in cs]))
                    row[f"{tag}_{kind}_n"] = len(cs)
            for family in fam.FAMILIES:
                cs = [c for c in src["cases"] if c["kind"] == "genuine" and c["family"] == family]
                if cs:
                    row[f"{tag}_{family}_demoted"] = float(np.mean([caught(c["result"], tau) for c in cs]))
                    row[f"{tag}_{family}_n"] = len(cs)
        rows.append(row)
    return rows


def markdown(res: dict) -> str:
    vc = res["verify_config"]
    described = "; ".join(f"{s['source']} (grid {tuple(s['grid'])}, {s['heads']} heads, {s['layers']} layers per "
                          f"expert, block {s['block_size']})" for s in res["sources"])
    lines = [f"Sources: {described}.",
             f"Check: layers {res['sources'][0]['checked_layers']} (of verify_layers {vc['verify_layers']}), heads "
             f"{res['sources'][0]['checked_heads']} (verify_heads {vc['verify_heads']}), verify_rows {vc['verify_rows']}, "
             "at the first step of each expert; verdict on the mean over the checked layers.", "",
             "| estimate vs true recall (same heads, exact mass) | max abs error | mean abs error |", "|---|---|---|"]
    e = res["errors"]
    lines += [f"| per checked layer ({e['n_layers']} estimates) | {e['per_layer_max']:.4f} | {e['per_layer_mean']:.4f} |",
              f"| per expert (mean over checked layers: the verdict's number) | {e['per_expert_max']:.4f} | {e['per_expert_mean']:.4f} |",
              f"| per expert, against the true recall over ALL heads | {e['vs_all_heads_max']:.4f} | {e['vs_all_heads_mean']:.4f} |", ""]
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
                    min(v["true_mean"] for v in c["result"].values()))
            for f, vals in by_fam.items():
                rec[(tag, kind, f)] = (len(vals), float(np.mean(vals)), float(np.min(vals)), float(np.max(vals)))
    lines += ["| source | case | family | n | true recall of the worse expert: mean / min / max |", "|---|---|---|---|---|"]
    for (tag, kind, f), (n, mean, lo, hi) in rec.items():
        lines.append(f"| {tag} | {kind} | {f} | {n} | {mean:.3f} / {lo:.3f} / {hi:.3f} |")
    cols = [k for k in res["sweep"][0] if k.endswith("_caught") or k.endswith("_demoted")]
    lines += ["", "| threshold | " + " | ".join(c.replace("def_", "default: ").replace("ch_", "content-heavy: ")
                                                .replace("_", " ") for c in cols) + " |",
              "|---|" + "---|" * len(cols)]
    for row in res["sweep"]:
        mark = "**" if abs(row["threshold"] - vc["verify_threshold"]) < 1e-9 else ""
        lines.append(f"| {mark}{row['threshold']:.2f}{mark} | " + " | ".join(f"{row[c]:.0%}" for c in cols) + " |")
    ns = {c.replace("_caught", "_n").replace("_demoted", "_n"): res["sweep"][0][c.replace("_caught", "_n").replace("_demoted", "_n")] for c in cols}
    lines += ["", "Cases per column: " + ", ".join(f"{k[:-2].replace('def_', 'default ').replace('ch_', 'content-heavy ')} {v}" for k, v in ns.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the test runs this)")
    ap.add_argument("--threshold", type=float, default=SparseConfig().verify_threshold)
    ap.add_argument("--verify-heads", type=int, default=SparseConfig().verify_heads)
    ap.add_argument("--verify-rows", type=int, default=SparseConfig().verify_rows)
    ap.add_argument("--grid", nargs=3, type=int, default=None, help="token grid T H W (default: the harness's)")
    ap.add_argument("--full-workload", action="store_true",
                    help="with --quick: the quick sizes but every query of the full workload")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    vc = SparseConfig(verify_threshold=args.threshold, verify_heads=args.verify_heads, verify_rows=args.verify_rows)
    started = time.perf_counter()
    def log(msg):
        print(msg, flush=True)

    small = False if args.full_workload else None
    sources = [run_source(ch, args.quick, vc, log, args.grid, small) for ch in (False, True)]
    all_cases = [c for s in sources for c in s["cases"]]
    res = {"command": "python -m benchmarks.quality.verify " + " ".join(argv if argv is not None else sys.argv[1:]),
           "torch": torch.__version__,
           "verify_config": {"verify_threshold": vc.verify_threshold, "verify_layers": list(vc.verify_layers),
                             "verify_heads": vc.verify_heads, "verify_rows": vc.verify_rows},
           "sources": sources, "errors": errors(all_cases), "sweep": sweep(sources)}
    res["seconds"] = time.perf_counter() - started
    (args.out / "verify.json").write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res)
    (args.out / "verify.md").write_text(md)
    print(md)
    print(f"wrote {args.out}/verify.json, verify.md in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
