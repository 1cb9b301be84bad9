"""Which operand sets the FP8 kernel's error floor: full-map attention in fp64 with one operand at a time at
the FP8 kernel's precision (and at the INT8 kernel's), against exact attention.

Operands and their forms (each as our kernels quantise it; everything else exact, softmax exact up to the form
of P):

- ``qk``: ``exact``; ``e4m3``: Q (softmax scale folded in) and smoothed K to e4m3 with one absmax scale per 128
  tokens (the FP8 pre-pass); ``int8``: Q with one scale per row, smoothed K one per 128 keys (the INT8 pre-pass
  without its Hadamard rotation, which leaves Gaussian inputs' statistics as they are);
- ``p``: ``exact``; ``e4m3``: ``2^(s - m + 8)`` rounded to e4m3 (row maximum 256); ``ffma``: the FP8 kernel's
  byte from one FFMA (``k = round(8 y + 56)`` clamped to ``[0, 128]`` is the e4m3 byte of ``2^(k // 8 - 7) *
  (1 + (k % 8) / 8)``: exp2 linear between powers of two); ``u8``: the INT8 kernel's ``round(255 * exp(s -
  m_tile))`` per 128-key tile, tiles weighted by ``exp(m_tile - m_row)``;
- ``v``: ``exact``; ``e4m3`` / ``int8``: one absmax scale per (b, h, channel).

The row sum is taken over P in the same form (the kernels sum P as they multiply it). Inputs: Gaussian q/k/v,
and the same with q scaled by ``--sharpen`` (peaked rows). ``python -m benchmarks.kernels.fp8_budget --out OUT
[--length 4096] [--heads 4]`` (CPU, fp64, memory O(heads * length^2): ~2 min at 4 096 x 4 heads); the CPU test
runs a toy size (``tests/test_fp8_budget.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from chorus.kernels.triton.emulation import e4m3_fake, e4m3_token_blocks, int8_fake, int8_key_tiles

E4M3 = torch.float8_e4m3fn
TILE = 128

ROWS = (  # label -> operand forms
    ("Q.K in e4m3 only", dict(qk="e4m3")),
    ("P in e4m3 (rounded) only", dict(p="e4m3")),
    ("P as the FP8 kernel's FFMA byte only", dict(p="ffma")),
    ("V in e4m3 only", dict(v="e4m3")),
    ("P and V as the FP8 kernel, Q.K exact", dict(p="ffma", v="e4m3")),
    ("the FP8 kernel's numerics (all three)", dict(qk="e4m3", p="ffma", v="e4m3")),
    ("the same with P rounded to e4m3", dict(qk="e4m3", p="e4m3", v="e4m3")),
    ("Q.K in int8, P and V as the FP8 kernel", dict(qk="int8", p="ffma", v="e4m3")),
    ("Q.K in int8 only", dict(qk="int8")),
    ("P as the INT8 kernel's levels only", dict(p="u8")),
    ("V in int8 only", dict(v="int8")),
    ("the INT8 kernel's numerics (all three)", dict(qk="int8", p="u8", v="int8")),
)


def _p_weights(s: torch.Tensor, form: str) -> torch.Tensor:
    """Unnormalised P of logits ``s [..., Lk]`` (natural-log units) in ``form`` (module docstring)."""
    if form == "u8":
        pad = (-s.shape[-1]) % TILE
        st = torch.nn.functional.pad(s, (0, pad), value=float("-inf")).reshape(*s.shape[:-1], -1, TILE)
        m_tile = st.amax(dim=-1, keepdim=True)
        levels = torch.round(torch.exp(st - m_tile) * 255.0) * torch.exp(m_tile - m_tile.amax(dim=-2, keepdim=True))
        return levels.reshape(*s.shape[:-1], -1)[..., :s.shape[-1]]
    y = (s - s.amax(dim=-1, keepdim=True)) * math.log2(math.e) + 8.0
    if form == "exact":
        return torch.exp2(y)
    if form == "e4m3":
        return torch.exp2(y).float().to(E4M3).double()
    if form == "ffma":
        k = torch.round(8.0 * y + 56.0).clamp(0.0, 128.0)
        octave = torch.div(k, 8, rounding_mode="floor") - 7.0
        return torch.exp2(octave) * (1.0 + torch.remainder(k, 8.0) / 8.0) * (k > 0)
    raise ValueError(f"unknown form of P: {form!r}")


def attention(q, k, v, qk: str = "exact", p: str = "exact", v_form: str = "exact") -> torch.Tensor:
    """Full-map attention of ``q/k/v [B, H, L, D]`` (fp64) with the operands in the given forms."""
    q, k, v = q.double() / math.sqrt(q.shape[-1]), k.double(), v.double()
    k = k - k.mean(dim=2, keepdim=True)  # K smoothing: softmax-invariant, as both pre-passes do
    if qk == "e4m3":
        q, k = e4m3_token_blocks(q, TILE), e4m3_token_blocks(k, TILE)
    elif qk == "int8":
        q, k = int8_fake(q, q.abs().amax(dim=-1, keepdim=True)), int8_key_tiles(k, TILE)
    elif qk != "exact":
        raise ValueError(f"unknown form of Q.K: {qk!r}")
    weights = _p_weights(q @ k.transpose(-1, -2), p)
    if v_form != "exact":
        v = (e4m3_fake if v_form == "e4m3" else int8_fake)(v, v.abs().amax(dim=2, keepdim=True))  # per channel
    return (weights @ v) / weights.sum(dim=-1, keepdim=True)


def budget(length: int, heads: int, sharpen: float, seed: int = 0, dim: int = 128) -> dict:
    """Relative L2 against exact attention of every row of :data:`ROWS`, on Gaussian q/k/v and on the same with
    q scaled by ``sharpen``: ``{source: {label: error}}``."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, length, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    results = {}
    for source, qs in (("gaussian", q), (f"q x {sharpen:g}", q * sharpen)):
        exact = attention(qs, k, v)
        results[source] = {label: ((attention(qs, k, v, forms.get("qk", "exact"), forms.get("p", "exact"),
                                              forms.get("v", "exact")) - exact).norm() / exact.norm()).item()
                           for label, forms in ROWS}
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--sharpen", type=float, default=3.0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = budget(args.length, args.heads, args.sharpen)
    sources = list(results)
    lines = [f"relative L2 vs exact attention (fp64), full map, {args.length} tokens, {args.heads} heads x 128",
             "", "| operands | " + " | ".join(sources) + " |", "|---|" + "---|" * len(sources)]
    lines += [f"| {label} | " + " | ".join(f"{results[s][label]:.4f}" for s in sources) + " |" for label, _ in ROWS]
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_budget.json"), "w") as f:
        json.dump({"argv": vars(args), "torch": torch.__version__, "seconds": time.perf_counter() - t0,
                   "errors": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
