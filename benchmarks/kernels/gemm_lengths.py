"""The Wan block's GEMMs at the token counts a request runs: full, feature reuse's compact lengths, and
those lengths padded to a multiple.

Usage (on a CUDA GPU)::

    python -m benchmarks.kernels.gemm_lengths --lengths 75600 61600 --pad 128 256 1024

For each token count ``M`` (each given length, and each rounded up to each ``--pad`` multiple):
``torch.nn.functional.linear`` in bf16 with a bias on the shapes of one Wan 14B block (dim 5120,
FFN 13 824: the q/k/v/o and cross-attention q/o projections ``5120 -> 5120``, the FFN's
``5120 -> 13824`` and ``13824 -> 5120``), ``triton.testing.do_bench`` medians, TFLOP/s, and the GEMM
kernel the library picked (from ``torch.profiler``). Per length, the block's GEMM time
(6 x ``5120 -> 5120`` + both FFN GEMMs) and the time per token against the first length's. This is
what says whether a compact sequence pays for its length in GEMM efficiency.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

SHAPES = {"proj 5120->5120": (5120, 5120), "ffn 5120->13824": (5120, 13824), "ffn 13824->5120": (13824, 5120)}
PER_BLOCK = {"proj 5120->5120": 6, "ffn 5120->13824": 1, "ffn 13824->5120": 1}


def kernel_name(fn) -> str:
    """The name of the longest GPU kernel ``fn`` launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    return max(events, key=lambda e: e.device_time_total).key[:90] if events else "?"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[75600, 61600])
    ap.add_argument("--pad", nargs="*", type=int, default=[128, 256, 1024])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA GPU")
    lengths = []
    for length in args.lengths:
        for m in [length] + [-(-length // p) * p for p in args.pad]:
            if m not in lengths:
                lengths.append(m)
    weights = {name: (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5,
                      torch.randn(n, device="cuda", dtype=torch.bfloat16)) for name, (k, n) in SHAPES.items()}
    rows, base = [], None
    for m in lengths:
        block_ms = 0.0
        for name, (k, n) in SHAPES.items():
            x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
            w, b = weights[name]
            fn = lambda: torch.nn.functional.linear(x, w, b)  # noqa: E731
            ms = do_bench(fn, return_mode="median")
            rows.append({"tokens": m, "gemm": name, "ms": ms, "tflops": 2 * m * k * n / ms / 1e9,
                         "kernel": kernel_name(fn)})
            block_ms += PER_BLOCK[name] * ms
            r = rows[-1]
            print(f"M={m:6d} {name:16s} {ms:7.3f} ms {r['tflops']:6.0f} TFLOP/s  {r['kernel']}", flush=True)
        per_token = block_ms / m
        base = base or per_token
        rows.append({"tokens": m, "gemm": "block", "ms": block_ms, "per_token_vs_first": per_token / base})
        print(f"M={m:6d} one block's GEMMs {block_ms:.3f} ms; per token {per_token / base:.4f} x the first length's",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.kernels.gemm_lengths", "device": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
