"""A hit's map from its entry's bit-packed map in one Triton kernel (one program per ``ROWS`` map rows).

Contract: ``packed`` uint8 ``[Hs, Qb, ceil(Kb / 8)]`` (:func:`chorus.kernels.codec.pack_bits`' layout, MSB
first), ``heads`` a multiple of ``Hs`` (``Hs`` 1: the map is shared by every head), ``k_min`` the floor; returns
what :func:`chorus.kernels.masks.floor_packed_map_torch` returns for the same arguments: the bool map
``[heads, Qb, Kb]`` in which each row of the entry's map that keeps fewer than ``k = min(k_min, Kb)`` blocks also
keeps its ``k`` nearest blocks (:func:`chorus.kernels.masks.nearest_blocks`, read by the kernel as a ``[Qb, Kb]``
byte table), the same map bit-packed (padding bits zero), and int32 ``[heads, Qb]`` kept blocks per row. On the
CUDA tensors of a hit's call (or the CPU under ``TRITON_INTERPRET=1``); arguments are checked by the caller.

Why: the same steps in torch are a dozen elementwise and reduction launches over the unpacked map (unpack,
the row counts, the floor, the total, the packing for the step's second call): 0.54 ms of GPU time a call
at 720p (40 heads x 591 x 591 blocks; H200, 2026-12-04, a profiled 3-layer hit), ~90 ms of a 160-call
request. Here the entry's bytes are read once and the three outputs written once. Its own time on a GPU is
not measured yet (``benchmarks/kernels/bench_block_sparse.py --selection`` times it beside the torch steps).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

FLOOR_MAP_MAX_KEYS = 8192  # widest row one program holds; wider rows: torch
_ELEMENTS = 2048  # map entries per program (ROWS x the row width rounded up to a power of two; no spill at 4 warps)
_MAX_ROWS = 16


@triton.jit(do_not_specialize=["k_floor"])
def _floor_map_kernel(packed_ptr, near_ptr, map_ptr, out_packed_ptr, count_ptr, rows, src_rows, num_q, num_kv,
                      num_bytes, k_floor, HAS_FLOOR: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    cols = tl.arange(0, BITS)
    valid = row_ok[:, None] & (cols < num_kv)[None, :]
    src = (r % src_rows).to(tl.int64)  # a map shared by every head: row r of head h is its row r % Qb
    byte = tl.load(packed_ptr + src[:, None] * num_bytes + (cols // 8)[None, :], mask=valid, other=0)
    bit = (byte.to(tl.int32) >> (7 - cols % 8)[None, :]) & 1
    if HAS_FLOOR:
        short = tl.sum(bit, 1) < k_floor
        near = tl.load(near_ptr + (r % num_q).to(tl.int64)[:, None] * num_kv + cols[None, :],
                       mask=valid & short[:, None], other=0)
        bit = bit | near.to(tl.int32)
    rows64 = r.to(tl.int64)
    tl.store(map_ptr + rows64[:, None] * num_kv + cols[None, :], bit.to(tl.uint8), mask=valid)
    tl.store(count_ptr + r, tl.sum(bit, 1), mask=row_ok)
    weights = tl.reshape(128 >> (cols % 8), [BITS // 8, 8])
    packed = tl.sum(tl.reshape(bit, [ROWS, BITS // 8, 8]) * weights[None, :, :], 2)
    byte_cols = tl.arange(0, BITS // 8)
    tl.store(out_packed_ptr + rows64[:, None] * num_bytes + byte_cols[None, :], packed.to(tl.uint8),
             mask=row_ok[:, None] & (byte_cols < num_bytes)[None, :])


def rows_per_program_for(bits: int) -> int:
    """Map rows one program takes at a row width of ``bits`` (a power of two >= 16)."""
    return max(1, min(_MAX_ROWS, _ELEMENTS // bits))


def floor_packed_map_triton(packed: torch.Tensor, num_kv: int, heads: int, k_min: int):
    """Launch the kernel (see the module docstring) with the arguments of
    :func:`chorus.kernels.masks.floor_packed_map_torch`: ``packed`` uint8 ``[Hs, Qb, ceil(Kb / 8)]``, ``k_min``
    the floor (``<= 0``: none; ``near`` = :func:`chorus.kernels.masks.nearest_blocks` of ``min(k_min, Kb)``).
    Returns ``(map bool [heads, Qb, Kb], packed uint8 [heads, Qb, ceil(Kb / 8)], kept int32 [heads, Qb])``.
    ``ValueError`` for a row wider than ``FLOOR_MAP_MAX_KEYS``."""
    from ..masks import nearest_blocks

    src_heads, num_q, num_bytes = packed.shape
    if num_kv > FLOOR_MAP_MAX_KEYS:
        raise ValueError(f"the Triton map floor takes rows of at most {FLOOR_MAP_MAX_KEYS} key blocks, got {num_kv}")
    device = packed.device
    k = min(int(k_min), num_kv)
    has_floor = k > 0
    near = nearest_blocks(num_q, num_kv, k, device) if has_floor else None
    bits = max(16, triton.next_power_of_2(num_kv))
    rows_per_program = rows_per_program_for(bits)
    block_map = torch.empty(heads, num_q, num_kv, dtype=torch.uint8, device=device)
    out_packed = torch.empty(heads, num_q, num_bytes, dtype=torch.uint8, device=device)
    kept = torch.empty(heads, num_q, dtype=torch.int32, device=device)
    rows = heads * num_q
    near_rows = near.contiguous().view(torch.uint8) if has_floor else packed
    with torch.cuda.device(device) if packed.is_cuda else contextlib.nullcontext():
        _floor_map_kernel[(triton.cdiv(rows, rows_per_program),)](
            packed.contiguous(), near_rows, block_map, out_packed, kept, rows, src_heads * num_q, num_q, num_kv,
            num_bytes, int(k), HAS_FLOOR=has_floor, BITS=bits, ROWS=rows_per_program, num_warps=4)
    return block_map.view(torch.bool), out_packed, kept
