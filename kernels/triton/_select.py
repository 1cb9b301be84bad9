"""Triton top-p block selection for the miss path (one program per row of block mass).

Contract: ``mass`` float32 ``[R, Kb]`` contiguous (the rows of ``[..., Qb, Kb]``, row ``r`` is query block
``r % Qb``), ``1 <= Kb <= SELECT_MAX_KEYS``; returns the map of
:func:`chorus.kernels.masks.select_blocks_torch` for the same arguments: bool ``[R, Kb]``, or with
``packed=True`` uint8 ``[R, ceil(Kb / 8)]`` in :func:`chorus.kernels.codec.pack_bits`' layout (MSB first,
padding bits zero). Per row: the fewest highest-mass blocks whose mass reaches ``top_p`` of the row
(equal masses: lower key block first), at least ``max(min(k_min, Kb), 1)`` of them, plus the diagonal
block ``(r % Qb, r % Qb)`` when ``keep_diagonal``, key blocks ``0 .. keep_first_frame_blocks - 1`` and the last
``keep_last_frame_blocks`` key blocks.

How: the row's float32 bit patterns (a non-negative float orders like its bits) are sorted in one
bitonic sort (``tl.sort``, values only: no index travels with them). The float64 cumulative sum of the
sorted values gives, as in the torch code, the number ``n`` of blocks needed, hence the mass ``cut`` of the
last one; the row keeps every block above ``cut`` and, of the blocks equal to ``cut``, the lowest-index
ones up to ``n`` (a cumulative count in key order), so the map is written in key order with no scatter.
The target ``top_p * total - SELECTION_TOLERANCE * total`` is formed in float64, ``top_p`` and the
tolerance passed as their float64 bit patterns (a float kernel argument would be rounded to float32). The sums run in
another order than torch's (a tree scan / reduction against torch's): a block whose preceding mass lies
within float64 rounding (~1e-16 of the row) of the target may be decided the other way; nothing else
differs. NaN, inf or negative mass gives an undefined map (never an out-of-bounds write); the caller
checks values (``select_blocks(check_values=...)``).

Measured on the H200 (docs/BENCHMARK_LOG.md, "The miss's block selection in one kernel";
``bench_block_sparse.py --selection``): 40 heads of peaked softmax mass, packed map, 720p (591 key blocks)
0.561 ms against 1.431 ms for torch's sort, gather, scatter and packing; 480p (256) 0.044 against 0.562
ms. One warp per row: the fastest of 1 / 2 / 4 / 8 at 720p, 8 us behind 2 warps at 480p.
"""

from __future__ import annotations

import contextlib
import struct

import torch
import triton
import triton.language as tl

from ..masks import SELECTION_TOLERANCE

SELECT_MAX_KEYS = 4096  # widest row one program sorts (a 4096-entry register sort); wider rows: torch
SELECT_WARPS = 1  # per row; the fastest of 1 / 2 / 4 / 8 at 256 and 591 key blocks (bench --selection)


@triton.jit(do_not_specialize=["top_p_bits", "tol_bits", "k_min", "n_first", "n_last"])
def _select_kernel(mass_ptr, out_ptr, num_q, num_kv, top_p_bits, tol_bits, k_min, n_first, n_last,
                   KEEP_DIAG: tl.constexpr, PACKED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < num_kv
    mass = tl.load(mass_ptr + row.to(tl.int64) * num_kv + cols, mask=valid, other=0.0)
    # -0.0 and negative mass to +0.0's bits, so valid entries sort above the padding's -1
    bits = tl.where(valid, tl.maximum(mass.to(tl.int32, bitcast=True), 0), -1)
    sorted_bits = tl.sort(bits, descending=True)
    values = tl.maximum(sorted_bits, 0).to(tl.float32, bitcast=True).to(tl.float64)
    total = tl.sum(values, 0)
    before = tl.cumsum(values, 0) - values  # mass of the better blocks
    top_p = top_p_bits.to(tl.int64).to(tl.float64, bitcast=True)
    tol = tol_bits.to(tl.int64).to(tl.float64, bitcast=True)
    needed = (before < top_p * total - tol * total) & (sorted_bits >= 0)
    n = tl.sum(needed.to(tl.int32), 0)
    n = tl.minimum(tl.maximum(n, tl.maximum(k_min, 1)), num_kv)
    cut = tl.max(tl.where(cols == n - 1, sorted_bits, -1), 0)
    above = bits > cut
    tie = (bits == cut).to(tl.int32)
    ties_kept = n - tl.sum(above.to(tl.int32), 0)
    keep = above | ((tie != 0) & (tl.cumsum(tie, 0) - tie < ties_kept)) | (cols < n_first) | (cols >= num_kv - n_last)
    if KEEP_DIAG:
        keep = keep | (cols == row % num_q)
    keep = keep & valid
    if PACKED:
        num_bytes = (num_kv + 7) // 8
        weights = tl.reshape(128 >> (cols % 8), [BLOCK // 8, 8])
        packed = tl.sum(tl.reshape(keep.to(tl.int32), [BLOCK // 8, 8]) * weights, 1).to(tl.uint8)
        byte_cols = tl.arange(0, BLOCK // 8)
        tl.store(out_ptr + row.to(tl.int64) * num_bytes + byte_cols, packed, mask=byte_cols < num_bytes)
    else:
        tl.store(out_ptr + row.to(tl.int64) * num_kv + cols, keep.to(tl.int8), mask=valid)


def _float64_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def select_blocks_triton(mass: torch.Tensor, *, top_p: float, k_min: int, keep_diagonal: bool = True,
                         keep_first_frame_blocks: int = 0, keep_last_frame_blocks: int = 0, packed: bool = False,
                         num_warps: int = SELECT_WARPS) -> torch.Tensor:
    """Launch the selection kernel on ``mass`` ``[..., Qb, Kb]`` (see the module docstring).

    ``mass``: float32, float16 or bfloat16 (the narrow types widened to float32, exactly), on a CUDA
    device or on the CPU under ``TRITON_INTERPRET=1``. Returns bool ``[..., Qb, Kb]`` or, with ``packed``,
    uint8 ``[..., Qb, ceil(Kb / 8)]``. ``num_warps``: per row (the benchmark times the alternatives).
    Arguments are checked by the caller
    (:func:`chorus.kernels.masks.select_blocks`); raises ``ValueError`` for a dtype or a row width this
    kernel does not take.
    """
    if mass.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the Triton selection takes float32/float16/bfloat16 mass, got {mass.dtype}")
    if mass.dim() < 2 or mass.shape[-1] < 1 or mass.shape[-2] < 1:
        raise ValueError(f"mass must be [..., Qb, Kb] with Qb, Kb >= 1, got shape {tuple(mass.shape)}")
    num_q, num_kv = mass.shape[-2:]
    if num_kv > SELECT_MAX_KEYS:
        raise ValueError(f"the Triton selection takes rows of at most {SELECT_MAX_KEYS} key blocks, got {num_kv}")
    rows = mass.float().contiguous().view(-1, num_kv)
    width = (num_kv + 7) // 8 if packed else num_kv
    out = torch.empty(*mass.shape[:-1], width, dtype=torch.uint8, device=mass.device)
    if rows.shape[0]:
        # Triton launches on the current device: make it the mass's (a no-op for the interpreter's CPU tensors)
        with torch.cuda.device(mass.device) if mass.is_cuda else contextlib.nullcontext():
            _select_kernel[(rows.shape[0],)](
                rows, out, num_q, num_kv, _float64_bits(top_p), _float64_bits(SELECTION_TOLERANCE),
                min(int(k_min), num_kv), min(int(keep_first_frame_blocks), num_kv),
                min(int(keep_last_frame_blocks), num_kv), KEEP_DIAG=bool(keep_diagonal),
                PACKED=bool(packed), BLOCK=max(16, triton.next_power_of_2(num_kv)), num_warps=num_warps)
    return out if packed else out.view(torch.bool)
