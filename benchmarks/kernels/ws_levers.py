"""Lever sweep of the warp-specialised FP8 kernel (``triton_fp8_ws``) against the Triton FP8 kernel.

Usage (on an sm_90 GPU)::

    python benchmarks/kernels/ws_levers.py --sizes 75600,32760 --densities 1.0,0.15,0.05 \\
        --configs '{"serial": {}, "overlap": {"schedule": "overlap"}, "noexp": {"p_bits": 0, "ablate": 1}}'

Each config is a dict of ``chorus.kernels.triton._attention_ws.DEFAULT_CONFIG`` overrides (``schedule``,
``stages``, ``q_stages``, ``p_bits``, ``v_scaling``, ``p_clamp``, ``o_store``, ``q_quant``; ``ablate`` 1 / 2 leaves the exp2
(with ``p_bits`` 0: the default has none) / the whole softmax out, 3 the output stores, 4 the epilogue's
per-channel V scales; benchmark only: the output is meaningless and its cosine says so; on the first
density only). Inputs: 1 x 40 heads x L x 128, unit Gaussians in
bf16, the benchmark's structured maps (``masks.structured_block_map``); times are
``triton.testing.do_bench`` medians of whole calls (pre-pass included), with ``--rounds R`` the median of R
such timings taken with the configs in turn; TFLOP/s count kept blocks.
Prints one line per (size, density, config), the pre-pass alone per size (both V scalings, with and
without Q) and the
block lists' build alone per map. ``--prefix-frames F``
adds ChorusGuidanceBoost's first-frame bias (``--prefix-bias``, natural log) to every call of both
kernels, over the first F frames' tokens of the Wan grid. ``--baseline FILE`` adds another version of
``_attention_ws.py`` (e.g. ``git show HEAD:kernels/triton/_attention_ws.py > FILE``), loaded beside the
current one (same pre-pass and block lists), as the config ``baseline`` (its default config), timed in
turn with the others.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from masks import grid_for, structured_block_map  # noqa: E402  (as bench_block_sparse.py imports it)

from chorus.kernels.triton import block_sparse_attention_triton  # noqa: E402
from chorus.kernels.triton._attention import compress_block_map, lpt_block_lists  # noqa: E402
from chorus.kernels.triton._attention_ws import block_sparse_attention_ws  # noqa: E402
from chorus.kernels.triton._quant import quantize_qkv_fp8  # noqa: E402


def load_baseline(path: str):
    """Another version of ``_attention_ws.py`` as a module of ``chorus.kernels.triton`` (its relative
    imports resolve to the current pre-pass and block lists)."""
    spec = importlib.util.spec_from_file_location("chorus.kernels.triton._attention_ws_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.block_sparse_attention_ws


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="75600,32760")
    ap.add_argument("--densities", default="1.0,0.15,0.05")
    ap.add_argument("--configs", default='{"serial": {}}', help="JSON: name -> DEFAULT_CONFIG overrides")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1, help="times each config is timed, in turn with the others (median)")
    ap.add_argument("--prefix-frames", type=int, default=0, help="first-frame bias over this many frames (0: none)")
    ap.add_argument("--prefix-bias", type=float, default=0.0953, help="natural log; default log(1.1), the node's")
    ap.add_argument("--baseline", help="another _attention_ws.py, timed as config 'baseline' (its defaults)")
    args = ap.parse_args()
    configs = json.loads(args.configs)
    kernels = {name: block_sparse_attention_ws for name in configs}
    if args.baseline:
        configs = {"baseline": {}, **configs}
        kernels["baseline"] = load_baseline(args.baseline)
    densities = [float(x) for x in args.densities.split(",")]
    heads, dim = args.heads, 128
    scale = dim ** -0.5
    for length in (int(x) for x in args.sizes.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, heads, length, dim, device="cuda", generator=gen).bfloat16() for _ in range(3))
        full = torch.ones(1, heads, 1, 1, dtype=torch.bool, device="cuda")
        _, grid_h, grid_w = grid_for(length)
        bias = dict(prefix_len=args.prefix_frames * grid_h * grid_w, prefix_bias=args.prefix_bias) \
            if args.prefix_frames else {}
        for v_scaling in ("channel", "block"):  # V read twice (per-channel scales) / once (per-tile)
            for quantize_q in (True, False):  # Q in the pass (q_quant "prepass") / left to the kernel ("kernel")
                t_pre = do_bench(lambda: (quantize_qkv_fp8(q, k, v, scale, v_key_order="wgmma", v_scaling=v_scaling,
                                                           quantize_q=quantize_q),
                                          compress_block_map(full)), return_mode="median")
                print(f"[{length}] pre-pass, v_scaling={v_scaling}, quantize_q={quantize_q}: {t_pre:.3f} ms",
                      flush=True)
        for density in densities:
            bm = structured_block_map(length, heads, density, 128, device="cuda")
            flops = 4 * bm.sum().item() * 128 * 128 * dim
            t_idx = do_bench(lambda: lpt_block_lists(bm), return_mode="median")
            print(f"[{length}] d={density} block lists (lpt_block_lists): {t_idx:.3f} ms", flush=True)
            ref = block_sparse_attention_triton(q, k, v, bm, block_size=128, fp8=True, **bias)
            t = do_bench(lambda: block_sparse_attention_triton(q, k, v, bm, block_size=128, fp8=True, **bias),
                         return_mode="median")
            print(f"[{length}] d={density} triton_fp8 {t:.2f} ms {flops / t / 1e9:.0f} TFLOP/s", flush=True)
            runs = {}
            for name, cfg in configs.items():
                if cfg.get("ablate") and density != densities[0]:
                    continue  # ablations on the first map only
                try:
                    out = kernels[name](q, k, v, bm, scale, cfg, **bias)
                    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(),
                                                                dim=0).item()
                    runs[name] = (cfg, cos, [])
                except Exception as exc:  # noqa: BLE001 - a config that does not build is a result too
                    print(f"[{length}] d={density} {name} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            for _ in range(args.rounds):  # configs in turn, so a clock drift hits them all alike
                for name, (cfg, _cos, times) in runs.items():
                    times.append(do_bench(lambda: kernels[name](q, k, v, bm, scale, cfg, **bias),
                                          return_mode="median"))
            for name, (cfg, cos, times) in runs.items():
                t = statistics.median(times)
                spread = f" (rounds {min(times):.2f}-{max(times):.2f} ms)" if len(times) > 1 else ""
                print(f"[{length}] d={density} {name:12s} {t:.2f} ms {flops / t / 1e9:.0f} TFLOP/s "
                      f"cos_vs_triton {cos:.6f}{spread}", flush=True)


if __name__ == "__main__":
    main()
