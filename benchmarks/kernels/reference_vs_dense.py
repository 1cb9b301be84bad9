"""What the plain-torch reference kernels cost on a GPU beside PyTorch's dense attention: the question behind the
engine's rule that where ``auto`` finds only the reference on a GPU (no Triton), a hit runs dense and a miss
records nothing (``engine/runtime.py``, ``ExpertRun._decide_backend``).

At Wan 14B's 480p shape (1 x 40 heads x 32 760 tokens x 128, bf16, Gaussian q/k/v): one
``scaled_dot_product_attention`` call, the reference's block-sparse attention with the pooled tail on a random
~15% map (every key scored in fp32, whatever the map keeps), and the reference's block mass with 8 sampled rows
per block (what a miss records), each timed by CUDA events after one warm-up call. Prints and writes
``OUT/reference_vs_dense.json``.

    python -m benchmarks.kernels.reference_vs_dense --out /tmp/ref

Measured 2026-12-05 on an H100 (``docs/BENCHMARK_LOG.md``, "Wan 2.2 TI2V 5B under `TorchCompileModel` ...").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from chorus import kernels


def _ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=32760)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--density", type=float, default=0.15)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = [torch.randn(1, args.heads, args.tokens, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
               for _ in range(3)]
    blocks = -(-args.tokens // 128)
    block_map = torch.rand(1, args.heads, blocks, blocks, generator=gen, device="cuda") < args.density
    block_map |= torch.eye(blocks, dtype=torch.bool, device="cuda")
    result = {
        "device": torch.cuda.get_device_name(), "tokens": args.tokens, "heads": args.heads,
        "density": block_map.float().mean().item(), "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "sdpa_ms": _ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 10),
        "reference_tail_ms": _ms(lambda: kernels.block_sparse_attention(
            q, k, v, block_map, block_size=128, backend="reference", pooled_tail=True), 2),
        "block_mass_reference_ms": _ms(lambda: kernels.block_mass(
            q, k, block_size=128, sample_rows=8, backend="reference"), 3),
    }
    print(json.dumps(result))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reference_vs_dense.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
