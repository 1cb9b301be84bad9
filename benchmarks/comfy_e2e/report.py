"""What a run writes: ``OUT/comfy_e2e.json`` as it goes (every number), and the table it prints at the end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def save(results: dict, out_dir) -> None:
    """Write what is measured so far (a run stopped at its time limit still leaves its numbers)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comfy_e2e.json").write_text(json.dumps(results, indent=1, default=str))


def attention_call_fields(per_call_ms: list) -> dict:
    """A row's per-call attention times (milliseconds, in call order; empty where none were timed): mean, median,
    the first call's and how many calls."""
    return {"attn_ms_per_layer": float(np.mean(per_call_ms)) if per_call_ms else None,
            "attn_ms_median": float(np.median(per_call_ms)) if per_call_ms else None,
            "attn_ms_first_call": per_call_ms[0] if per_call_ms else None,
            "attn_calls_timed": len(per_call_ms)}


def plan_fields(plan) -> dict:
    """What a Chorus row's request plan counted (a ``chorus.engine`` request plan after its request): the plan's
    kind, density, sparse / fallback / tail calls, blocks computed of all, its first five messages, feature reuse's
    blocks and the image frames it kept dense."""
    stats, state = plan.stats, plan.state
    return {"plan_kind": plan.kind, "density": stats.density, "sparse_calls": stats.sparse_calls,
            "blocks_computed": stats.blocks_computed, "blocks_total": stats.blocks_total,
            "fallback_calls": stats.fallback_calls, "tail_calls": stats.tail_calls, "messages": stats.messages[:5],
            "fr_blocks_reduced": state.feature_reuse.blocks_reduced, "fr_blocks_full": state.feature_reuse.blocks_full,
            "image_frames": None if state.image_frames is None else list(state.image_frames)}


def table(results: dict) -> str:
    """The run's rows as a Markdown table: request seconds, the ratio to dense of the same weights and resolution
    (a compiled row's to compiled dense; none where either request still compiled), the first request of a
    compiled row with its compile time, the per-call attention time (with its kernels from ``--profile`` and the
    kernel alone, idle and between GEMMs, where the row has them), density, peak memory and the SM clock; a
    skipped or failed row says why, and a row's variant names a partial load, recompiles or unsteady requests."""
    rows = results["runs"]
    lines = ["| weights | res | variant | request s | vs dense | first request s | attention ms/layer | density | peak GiB "
             "| SM MHz (median) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "seconds" not in r:  # skipped, or failed
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED: {r['failed']}"
            lines.append(f"| {r['weights']} | {r['res']} | {r['variant']} | {why} | | | | | | |")
            continue
        base = next((x for x in rows if x["weights"] == r["weights"] and x["res"] == r["res"] and "seconds" in x
                     and x["variant"] == ("dense+compile" if "compile" in r["variant"] else "dense")), None)
        # a request that still compiled (every try recompiled) times the compiler: no ratio from it or to it
        steady = base is not None and not base.get("timed_request_frames_compiled") \
            and not r.get("timed_request_frames_compiled")
        ratio = f"{base['seconds'] / r['seconds']:.2f}x" if steady else "-"
        attn = f"{r['attn_ms_per_layer']:.2f}" if r.get("attn_ms_per_layer") is not None else "-"
        if r.get("attn_kernels_ms_per_call") is not None and r.get("attn_ms_median") is not None:
            attn += f" (median {r['attn_ms_median']:.2f}, its kernels {r['attn_kernels_ms_per_call']:.2f})"
        alone_ms = r.get("kernel_alone_ms") or {}
        alone = alone_ms.get(r.get("backend", "auto"))
        if alone is not None:
            loaded = alone_ms.get(f"{r.get('backend', 'auto')}_under_load")
            attn += f" (alone {alone:.2f}" + (f", between GEMMs {loaded:.2f})" if loaded is not None else ")")
        dens = f"{r['density']:.1%}" if r.get("density") is not None else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        first = f"{r['first_request_s']:.1f}" if r.get("first_request_s") is not None else "-"
        spent = r.get("first_request_compile")
        if spent:
            first += f" (compile {spent['dynamo_s']:.1f}"
            first += f", Triton builds {spent['triton_build_s']:.1f})" if spent["triton_build_s"] is not None else ")"
        gpu = r.get("gpu") or {}
        clock = f"{gpu['sm_mhz']:.0f}" if gpu.get("available") else "-"
        variant = r["variant"]
        if any(e["partial"] for e in r.get("comfy_loading") or ()):
            variant += " (experts loaded partially)"
        recompiles = (r.get("dynamo") or {}).get("recompiles")
        if recompiles:
            variant += f" ({recompiles} recompiles)"
        unsteady = r.get("unsteady_requests") or ()
        if unsteady:
            variant += (f" (timed: request {len(unsteady) + 2}, the first that compiled nothing; before it "
                        + " / ".join(f"{u['seconds']:.2f} s" for u in unsteady) + ")")
        if r.get("timed_request_frames_compiled"):
            variant += f" (the timed request compiled {r['timed_request_frames_compiled']} frames)"
        lines.append(f"| {r['weights']} | {r['res']} | {variant} | {r['seconds']:.2f} | {ratio} | {first} | "
                     f"{attn} | {dens} | {peak} | {clock} |")
    return "\n".join(lines)
