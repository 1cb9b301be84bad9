"""Reuse with the pooled tail: how much of the error a *reused* block map adds (a cache entry's map, taken
from another, similar request) over the request's *own* map, with and without the pooled tail.

The claim under test (issue 30, item 5 "Reuse gets safer"): the pooled tail shrinks the reuse gap
``err(reused) - err(own)`` by at least half, i.e. ``gap_tail / gap_no_tail <= 0.5``. This script measures
the ratio and reports it as it comes out, whether or not the claim holds.

Requests: the quality harness's workload (``benchmarks/quality/families.py``: entries = requests a cache has
recorded; queries = new requests, each with a controlled change, in the families ``near_duplicate`` (same
picture and prompt, noise / JPEG / brightness), ``layout`` (same subject, crop / shift / mirror),
``template_subject`` (same template, another subject) and ``unrelated`` (another picture and prompt)). Per
family the first ``--per-family`` queries (the workload's order) are taken as request B; its entry A is the
entry it was derived from (``Request.base``), or, for ``unrelated`` queries (which have none), the entry the
harness's default embedder (``ComfyGraphEmbedder``, text weight 0.5, as ``benchmarks/quality/run.py
--embedder comfy``) ranks first: what a cache would hand over if the threshold let it through. The cosine
similarity of that embedder is recorded for every pair. Every request has its own seed (own noise).

Attention: one self-attention call (``--call``, expert / step / layer, ``(0, 0, 0)`` by default) of each
request in the structured synthetic source (``benchmarks/quality/source.py``, random weights; q/k/v rounded
to bf16 like ``tail_quality.py``'s inputs, softmax scale folded into q, ``scale=1.0``), the same model for A
and B. Two head sets, as in ``tail_quality.py``: "spread" (q as the source gives it) and "sharp" (q x
``--sharpen``, 3 by default; applied to A and B alike).

Per pair, head set and nominal density ``d`` (5 / 10 / 15 / 25%):

- B's exact block mass and A's exact block mass (``chorus.kernels.block_mass``, all rows, 128-token blocks);
- the per-row count: ``tail_quality.matching_count`` on B's mass with the target density ``d`` itself
  (``tail_quality`` targets sol_attn's actual density, which at its 480p grid is ``d`` within 0.001; there is
  no sol_attn here);
- B's own map: ``tail_quality.oracle_map`` (per query block the ``count`` key blocks of most exact mass, plus
  the diagonal block) of B's mass; the reused map: the same rule, the same count, on A's mass (what a cache
  entry recorded from A holds). Both actual densities and the share of B's exact mass each keeps (recall)
  are recorded;
- the relative L2 error (``||out - exact|| / ||exact||`` over all heads and evaluated rows) against B's fp64
  exact attention of: own map no tail, own map + tail, reused map no tail, reused map + tail, each computed by
  the fp64 oracle ``chorus.kernels.reference.dense_attention_oracle`` (``pooled_tail`` off / on). These are
  oracle numerics: the numbers are the sparsity (and reuse) error only, no kernel rounding;
- ``gap_no_tail = err(reused, no tail) - err(own, no tail)``, ``gap_tail`` likewise with the tail, and
  ``gap_ratio = gap_tail / gap_no_tail`` (null when ``gap_no_tail < 0.001``: no gap to shrink).

Evaluated rows: the maps and masses cover every query block; the errors are computed on ``--eval-blocks``
query blocks (evenly spaced, first and last included; every row of each) of B against all keys, which is
what bounds the run time on a CPU (all blocks when ``--eval-blocks 0`` or more than there are).

Per family the summary is the pooled ratio ``sum gap_tail / sum gap_no_tail`` over its pairs, head sets and
densities, the range of the per-row ratios and how many rows meet ``<= 0.5``.

Writes ``tail_reuse.json`` into ``--out`` (every number, the command, the grid, the evaluated rows) and
prints a markdown table and one summary line per family. ``--quick``: toy grid for the CPU test
(``tests/test_kernels_tail_reuse.py``; the quick workload of ``families.build_workload``). From the pack
root: ``python -m benchmarks.kernels.tail_reuse --out /tmp/tailreuse`` (CPU, default grid 8 x 24 x 40 =
7680 tokens, 8 heads, 8 of 60 query blocks evaluated: 490 s on 2 CPU cores shared with other jobs; result
``benchmarks/kernels/results/cpu_2026-12-03_tail_reuse.{json,log}``). Needs scikit-image (the families'
pictures); ``--image-npy`` swaps scikit-image's astronaut picture for a saved copy (as in ``tail_quality.py``).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time

import numpy as np
import torch

import chorus.kernels as K
from .tail_quality import (BLOCK, actual_density, astronaut, exact_attention, log, mass_shares,
                                             matching_count, oracle_map, rel_l2, write_results)

VARIANTS = (("own", False), ("own", True), ("reused", False), ("reused", True))
CLAIM_RATIO = 0.5  # the claim: the tail at least halves the reuse gap
MIN_GAP = 1e-3  # a row's ratio is reported only where the gap without the tail is at least this (rel. L2)


def variant_key(which: str, tail: bool) -> str:
    return f"{which}:{'tail' if tail else 'no_tail'}"


def workload(quick: bool, image_npy: str | None = None):
    """``(entries, queries)`` of ``families.build_workload``; with ``image_npy`` the astronaut picture is read
    from that file (uint8 or float ``[h, w, 3]``) wherever the workload loads it."""
    from ..quality import families

    if image_npy is None:
        return families.build_workload(quick=quick)
    picture = np.asarray(astronaut(image_npy), dtype=np.float64)
    picture = np.clip((picture / 255.0 if picture.max() > 1.0 else picture)[..., :3], 0.0, 1.0)
    load_image = families.load_image
    families.load_image = lambda name: picture.copy() if name == "astronaut" else load_image(name)
    try:
        return families.build_workload(quick=quick)
    finally:
        families.load_image = load_image


def pick_pairs(entries, queries, per_family: int) -> list[dict]:
    """Per family the first ``per_family`` queries, each with its entry (module docstring) and the embedding
    similarity of the two."""
    from ..quality.families import FAMILIES
    from chorus.cache_store.embedders import ComfyGraphEmbedder

    embedder = ComfyGraphEmbedder(text_weight=0.5)

    def unit(request):
        e = np.asarray(embedder.embed(image=request.image, text=request.prompt), dtype=np.float64)
        return e / max(np.linalg.norm(e), 1e-30)

    entry_vecs = {e.name: unit(e) for e in entries}
    by_name = {e.name: e for e in entries}
    pairs = []
    for family in FAMILIES:
        for query in [q for q in queries if q.family == family][:per_family]:
            vec = unit(query)
            sims = {name: float(vec @ ev) for name, ev in entry_vecs.items()}
            if query.base is not None:
                entry, how = by_name[query.base], "the entry it was derived from"
            else:
                entry = by_name[max(sims, key=sims.get)]
                how = "the entry ComfyGraphEmbedder ranks first (no derived entry)"
            pairs.append({"family": family, "query": query, "entry": entry, "pairing": how,
                          "similarity": sims[entry.name]})
    return pairs


def request_qkv(model, request, call, sharpen: float):
    """``{"spread": (q, k, v), "sharp": (q x sharpen, k, v)}``, bf16 ``[1, H, L, D]``, of one call of a request."""
    from ..quality.source import RequestAttention

    q, k, v = (t.to(torch.bfloat16).contiguous() for t in RequestAttention(model, request).qkv(*call))
    return {"spread": (q, k, v), "sharp": ((q.float() * sharpen).to(q.dtype), k, v)}


def evaluated_blocks(num_blocks: int, wanted: int) -> torch.Tensor:
    """``wanted`` evenly spaced query blocks (first and last included), or all of them."""
    if wanted <= 0 or wanted >= num_blocks:
        return torch.arange(num_blocks)
    return torch.linspace(0, num_blocks - 1, wanted).round().long().unique()


def block_rows(blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The token rows of ``blocks`` (ascending; a partial last block, if evaluated, comes last)."""
    return torch.cat([torch.arange(b * BLOCK, min((b + 1) * BLOCK, length)) for b in blocks.tolist()])


def oracle_error(q_rows, k, v, keep_rows, exact, tail: bool) -> float:
    """Relative L2 against ``exact`` of the fp64 oracle with ``keep_rows`` (the map's rows of the evaluated
    query blocks), one head at a time (memory: rows x keys fp64 per head)."""
    from chorus.kernels.reference import dense_attention_oracle

    out = torch.cat([dense_attention_oracle(q_rows[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1],
                                            keep_rows[:, h:h + 1], BLOCK, scale=1.0, pooled_tail=tail)
                     for h in range(q_rows.shape[1])], dim=1)
    return rel_l2(out, exact)


def gap_ratio(gap_tail: float, gap_no_tail: float, min_gap: float = MIN_GAP):
    """``gap_tail / gap_no_tail``, or None where there is no gap to shrink (``gap_no_tail < min_gap``)."""
    return gap_tail / gap_no_tail if gap_no_tail >= min_gap else None


def head_set_rows(query_qkv, entry_mass, densities, blocks) -> dict:
    """Every density of one head set of one pair: maps, densities, recalls, the four errors and the gaps."""
    q, k, v = query_qkv
    length = q.shape[2]
    mass = K.block_mass(q, k, block_size=BLOCK, scale=1.0)
    rows = block_rows(blocks, length)
    q_rows = q[:, :, rows]
    exact = exact_attention(q_rows, k, v, 1.0)
    entry = {"mass_shares": mass_shares(mass), "entry_mass_shares": mass_shares(entry_mass), "rows": []}
    for d in densities:
        count = matching_count(mass, length, d)
        maps = {"own": oracle_map(mass, count), "reused": oracle_map(entry_mass, count)}
        row = {"nominal_density": d, "blocks_per_row": count, "errors": {}}
        for which, keep in maps.items():
            row[f"{which}_density"] = actual_density(keep, length, BLOCK)
            row[f"{which}_recall"] = float((mass * keep).sum(-1).mean())
        row["maps_identical_share"] = float((maps["own"] == maps["reused"]).all(-1).double().mean())
        for which, tail in VARIANTS:
            row["errors"][variant_key(which, tail)] = oracle_error(q_rows, k, v, maps[which][:, :, blocks], exact,
                                                                   tail)
        e = row["errors"]
        row["gap_no_tail"] = e["reused:no_tail"] - e["own:no_tail"]
        row["gap_tail"] = e["reused:tail"] - e["own:tail"]
        row["gap_ratio"] = gap_ratio(row["gap_tail"], row["gap_no_tail"])
        entry["rows"].append(row)
    return entry


def family_summary(pairs: list[dict]) -> dict:
    """Per family: pooled ratio ``sum gap_tail / sum gap_no_tail``, the per-row ratios' range, the rows
    meeting the claim."""
    out = {}
    for pair in pairs:
        fam = out.setdefault(pair["family"], {"pairs": [], "gap_no_tail_sum": 0.0, "gap_tail_sum": 0.0,
                                              "ratios": [], "rows": 0, "rows_meeting_claim": 0,
                                              "rows_without_ratio": 0})
        fam["pairs"].append(f"{pair['query']} <- {pair['entry']}")
        for head_set in pair["head_sets"].values():
            for row in head_set["rows"]:
                fam["rows"] += 1
                fam["gap_no_tail_sum"] += row["gap_no_tail"]
                fam["gap_tail_sum"] += row["gap_tail"]
                if row["gap_ratio"] is None:
                    fam["rows_without_ratio"] += 1
                    continue
                fam["ratios"].append(row["gap_ratio"])
                fam["rows_meeting_claim"] += row["gap_ratio"] <= CLAIM_RATIO
    for fam in out.values():
        fam["pooled_ratio"] = gap_ratio(fam["gap_tail_sum"], fam["gap_no_tail_sum"], min_gap=1e-12)
        fam["gap_no_tail_mean"] = fam["gap_no_tail_sum"] / max(fam["rows"], 1)
        fam["gap_tail_mean"] = fam["gap_tail_sum"] / max(fam["rows"], 1)
        fam["ratio_min"] = min(fam["ratios"]) if fam["ratios"] else None
        fam["ratio_max"] = max(fam["ratios"]) if fam["ratios"] else None
        fam["claim_holds_pooled"] = fam["pooled_ratio"] is not None and fam["pooled_ratio"] <= CLAIM_RATIO
    return out


def fmt(x, spec=".4f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: dict) -> None:
    log(f"\nrelative L2 vs B's fp64 exact attention ({results['numerics']}); {results['eval_rows']['rows']} of "
        f"{results['tokens']} query rows ({len(results['eval_rows']['query_blocks'])} of "
        f"{results['eval_rows']['num_query_blocks']} query blocks); gap = err(reused) - err(own)")
    log("| family | B <- A (sim) | heads | d | blocks/row | density own / reused | recall own / reused | "
        "own no tail | own tail | reused no tail | reused tail | gap no tail | gap tail | ratio |")
    log("|---" * 14 + "|")
    for pair in results["pairs"]:
        for name, entry in pair["head_sets"].items():
            for row in entry["rows"]:
                e = row["errors"]
                log(f"| {pair['family']} | {pair['query']} <- {pair['entry']} ({pair['similarity']:.3f}) | {name} | "
                    f"{row['nominal_density']:.2f} | {row['blocks_per_row']} | {row['own_density']:.3f} / "
                    f"{row['reused_density']:.3f} | {row['own_recall']:.3f} / {row['reused_recall']:.3f} | "
                    f"{e['own:no_tail']:.4f} | {e['own:tail']:.4f} | {e['reused:no_tail']:.4f} | "
                    f"{e['reused:tail']:.4f} | {row['gap_no_tail']:+.4f} | {row['gap_tail']:+.4f} | "
                    f"{fmt(row['gap_ratio'], '.2f')} |")
    log(f"\nper family: gap ratio (tail / no tail), the claim is <= {CLAIM_RATIO}")
    for family, fam in results["summary"].items():
        log(f"{family}: pooled {fmt(fam['pooled_ratio'], '.2f')} (mean gap {fam['gap_no_tail_mean']:+.4f} without "
            f"the tail, {fam['gap_tail_mean']:+.4f} with) over {fam['rows']} rows, per-row range "
            f"{fmt(fam['ratio_min'], '.2f')} .. {fmt(fam['ratio_max'], '.2f')}, rows <= {CLAIM_RATIO}: "
            f"{fam['rows_meeting_claim']}/{fam['rows']}"
            + (f" ({fam['rows_without_ratio']} with a gap below {MIN_GAP} without the tail: no ratio)"
               if fam["rows_without_ratio"] else "")
            + f"; claim {'holds' if fam['claim_holds_pooled'] else 'does NOT hold'} (pooled); "
            f"pairs {', '.join(fam['pairs'])}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="toy grid, quick workload (the CPU test's mode)")
    ap.add_argument("--grid", nargs=3, type=int, default=[8, 24, 40], help="token grid T H W (480p: 21 30 52)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--call", nargs=3, type=int, default=[0, 0, 0], help="expert step layer of the source")
    ap.add_argument("--sharpen", type=float, default=3.0, help="q scale of the sharp head set")
    ap.add_argument("--densities", default="0.05,0.10,0.15,0.25")
    ap.add_argument("--per-family", type=int, default=1, help="queries per family (the workload's first ones)")
    ap.add_argument("--eval-blocks", type=int, default=8,
                    help="query blocks whose rows are evaluated (evenly spaced; 0 = all)")
    ap.add_argument("--image-npy", default=None,
                    help="the astronaut picture as a numpy .npy file (replaces scikit-image's astronaut)")
    args = ap.parse_args(argv)
    if args.quick:
        args.grid, args.heads, args.densities, args.eval_blocks = [4, 16, 32], 2, "0.10,0.25", 4
    densities = [float(x) for x in args.densities.split(",") if x]
    from ..quality.source import SOURCE_LABEL, SourceConfig, build_model

    t0 = time.time()
    call = tuple(args.call)
    model = build_model(SourceConfig(grid=tuple(args.grid), heads=args.heads, layers=call[2] + 1))
    entries, queries = workload(args.quick, args.image_npy)
    pairs = pick_pairs(entries, queries, args.per_family)
    length = math.prod(args.grid)
    blocks = evaluated_blocks(-(-length // BLOCK), args.eval_blocks)
    results = {
        "what": "reuse gap err(reused map) - err(own map) with and without the pooled tail",
        "claim": f"gap_tail / gap_no_tail <= {CLAIM_RATIO}", "min_gap_for_a_ratio": MIN_GAP,
        "numerics": "fp64 oracle (dense_attention_oracle) on bf16 inputs: sparsity / reuse error only, "
                    "no kernel rounding",
        "source": f"{SOURCE_LABEL}; call (expert, step, layer) {call}",
        "command": "python -m benchmarks.kernels.tail_reuse " + " ".join(argv),
        "grid": args.grid, "tokens": length, "heads": args.heads, "block_size": BLOCK, "sharpen": args.sharpen,
        "densities": densities, "density_target": "nominal density (matching_count on B's exact mass)",
        "eval_rows": {"query_blocks": blocks.tolist(), "num_query_blocks": -(-length // BLOCK),
                      "rows": int(block_rows(blocks, length).numel())},
        "quick": args.quick, "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "pairs": []}
    log(f"{results['source']}; grid {tuple(args.grid)} = {length} tokens, {args.heads} heads; evaluated rows: "
        f"{results['eval_rows']['rows']} ({len(blocks)} of {results['eval_rows']['num_query_blocks']} query blocks); "
        f"{len(pairs)} pairs; {torch.get_num_threads()} threads; workload ready in {time.time() - t0:.1f} s")
    entry_masses = {}
    for pair in pairs:
        t1 = time.time()
        entry = pair["entry"]
        if entry.name not in entry_masses:
            entry_masses[entry.name] = {name: K.block_mass(q, k, block_size=BLOCK, scale=1.0)
                                        for name, (q, k, _) in request_qkv(model, entry, call, args.sharpen).items()}
        query_sets = request_qkv(model, pair["query"], call, args.sharpen)
        record = {"family": pair["family"], "query": pair["query"].name, "entry": entry.name,
                  "pairing": pair["pairing"], "similarity": pair["similarity"], "query_seed": pair["query"].seed,
                  "entry_seed": entry.seed, "head_sets": {}}
        for name, qkv in query_sets.items():
            record["head_sets"][name] = head_set_rows(qkv, entry_masses[entry.name][name], densities, blocks)
        record["seconds"] = time.time() - t1
        results["pairs"].append(record)
        for name, entry_rows in record["head_sets"].items():
            log(f"[{record['family']} {record['query']} <- {record['entry']}, {name}] " + "; ".join(
                f"d={r['nominal_density']:.2f}: gap {r['gap_no_tail']:+.4f} -> {r['gap_tail']:+.4f} with tail"
                for r in entry_rows["rows"]))
        log(f"  pair done in {record['seconds']:.1f} s")
    results["summary"] = family_summary(results["pairs"])
    results["seconds"] = time.time() - t0
    print_table(results)
    write_results(results, args.out, "tail_reuse.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
