"""Fused token pooling / unpooling for feature reuse (one pass each over the tokens).

Contract (see :mod:`chorus.kernels.pooling` for the geometry): ``x`` ``[B, L, C]`` with unit stride
on ``C`` (fp16, bf16 or fp32, one CUDA device; or CPU under ``TRITON_INTERPRET=1``), a
:class:`~chorus.kernels.pooling.RegionLayout` with index tensors on ``x``'s device.

- :func:`pool_tokens_triton` ``-> [B, L', C]``: compact row ``j < Lk`` is ``x[:, keep_index[j]]``
  (a copy), row ``Lk + c`` the mean of cell ``c``'s ``P`` members, accumulated in fp32 in member order.
- :func:`unpool_residual_triton` ``(x, x_c, y_c) -> [B, L, C]``: output row ``i`` with ``j =
  expand_index[i]`` is ``y_c[j]`` for a kept token (a copy) and ``x[i] + (y_c[j] - x_c[j])`` in fp32
  for a cell member.

The torch implementations in :mod:`chorus.kernels.pooling` are the reference (the tests compare); they
take several gathers, casts and scatters each, which is what these kernels fuse (memory-bound: one read
of the inputs, one write of the output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 1024  # channels per program (bf16: 2 KiB per row load)


@triton.jit
def _pool_kernel(X, OUT, keep_index, cell_index, n_keep, C, s_xb, s_xl, s_ob, s_ol,
                 P: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)  # 64-bit offsets: [B, L, C] activations pass 2**31 elements
    b = tl.program_id(2).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    x_row = X + b * s_xb
    out_ptr = OUT + b * s_ob + j * s_ol + offs
    if j < n_keep:
        src = tl.load(keep_index + j)
        tl.store(out_ptr, tl.load(x_row + src * s_xl + offs, mask=mask), mask=mask)
    else:
        cell = j - n_keep
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(P):
            src = tl.load(cell_index + cell * P + p)
            acc += tl.load(x_row + src * s_xl + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr, (acc / P).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _unpool_kernel(X, XC, YC, OUT, expand_index, n_keep, C, s_xb, s_xl, s_cb, s_cl, s_yb, s_yl, s_ob, s_ol,
                   BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # 64-bit offsets: [B, L, C] activations pass 2**31 elements
    b = tl.program_id(2).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    j = tl.load(expand_index + i)
    y = tl.load(YC + b * s_yb + j * s_yl + offs, mask=mask, other=0.0)
    out_ptr = OUT + b * s_ob + i * s_ol + offs
    if j < n_keep:
        tl.store(out_ptr, y, mask=mask)
    else:
        x = tl.load(X + b * s_xb + i * s_xl + offs, mask=mask, other=0.0).to(tl.float32)
        xc = tl.load(XC + b * s_cb + j * s_cl + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr, (x + (y.to(tl.float32) - xc)).to(OUT.dtype.element_ty), mask=mask)


def _grid(rows: int, channels: int, batch: int):
    return (rows, triton.cdiv(channels, BLOCK_C), batch)


def pool_tokens_triton(x: torch.Tensor, layout) -> torch.Tensor:
    batch, _, channels = x.shape
    out = torch.empty((batch, layout.compact_length, channels), dtype=x.dtype, device=x.device)
    cells = layout.cell_index
    _pool_kernel[_grid(layout.compact_length, channels, batch)](
        x, out, layout.keep_index, cells, layout.keep_index.numel(), channels, x.stride(0), x.stride(1),
        out.stride(0), out.stride(1), P=max(int(cells.shape[1]), 1),
        BLOCK=min(BLOCK_C, triton.next_power_of_2(channels)), num_warps=4)
    return out


def unpool_residual_triton(x: torch.Tensor, x_compact: torch.Tensor, y_compact: torch.Tensor, layout) -> torch.Tensor:
    batch, length, channels = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    y_compact = y_compact.to(x.dtype)
    x_compact = x_compact.to(x.dtype)
    _unpool_kernel[_grid(length, channels, batch)](
        x, x_compact, y_compact, out, layout.expand_index, layout.keep_index.numel(), channels,
        x.stride(0), x.stride(1), x_compact.stride(0), x_compact.stride(1), y_compact.stride(0), y_compact.stride(1),
        out.stride(0), out.stride(1), BLOCK=min(BLOCK_C, triton.next_power_of_2(channels)), num_warps=4)
    return out
