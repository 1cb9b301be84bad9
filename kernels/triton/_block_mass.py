"""Triton block attention mass for the miss path (recording masks from a dense run).

Contract: q ``[B, H, Lq, D]``, k ``[B, H, Lk, D]`` fp16/bf16 (unit stride on D, D in {64, 128});
returns float32 ``[B, H, ceil(Lq/bs), ceil(Lk/bs)]``: for each query block, the mean over its
(sampled) query rows of the softmax probability (over *all* keys, scale ``scale``) that falls in each
key block. Rows of the result sum to 1 (up to fp32 rounding). ``sample_rows=None`` uses every row;
otherwise the rows are exactly those of :func:`chorus.kernels.reference.sample_row_offsets`
(evenly strided, deterministic), so the result matches ``block_mass_reference`` row for row.

One pass over the keys per tile of sampled rows (several query blocks share one 128-row tile when
few rows are sampled, so the tensor cores still see M = 128): for each key block, each row's
log2-sum-exp over the block's keys goes to a scratch buffer (fp32 ``[Kb, rows]`` per program) and into
the row's running total (online, as the softmax denominator); then, with the row's final log2-sum-exp
``lse``, each key block's probability is ``exp2(block lse - lse)``, summed over the rows of each query
block and divided by its sampled-row count. ``S`` is computed once (an earlier version recomputed it
in a second pass: twice the FLOPs). Keys past ``Lk`` are masked in the last (partial) key block only.
QK^T runs in the inputs' dtype with fp32 accumulation; maxima are taken on the unscaled logits, so the
scale (positive and finite, else ``ValueError``) enters each element once, in the FMA of the exponent's
argument. Cost ~ ``2 * rows * Lk * D`` FLOPs (no P @ V), i.e. with ``s`` sampled rows of ``bs`` about
``s / (2 bs)`` of one dense attention call, plus the scratch (``4 * rows * Kb`` bytes per head, e.g. 11 MB
per head at 720p with 8 rows: written and read once).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._attention import check_perm, int32_chunks, portable_block_size
from ._quant import interpreter_upcast
from ._quant import LOG2E, source_rows

MASS_ROWS = 128  # sampled rows per program by default (tensor-core M)


@triton.jit
def _qk(q, k, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        return tl.dot(q, tl.trans(k))


@triton.jit
def _block_lse(q, k_base, s_kl, start_kb, Lk, qk_scale, offs_n0, offs_d, token_perm, BLOCK_N: tl.constexpr,
               KV_SUB: tl.constexpr, MASK: tl.constexpr, INTERPRET: tl.constexpr, R: tl.constexpr,
               HAS_PERM: tl.constexpr):
    """log2 of each row's sum of exp2(S) over one key block (online over its BLOCK_N sub-tiles)."""
    m_b = tl.full([R], -1.0e30, dtype=tl.float32)
    l_b = tl.zeros([R], dtype=tl.float32)
    for sub in tl.static_range(KV_SUB):
        offs_n = start_kb + sub * BLOCK_N + offs_n0
        src_n = source_rows(token_perm, offs_n, Lk, HAS_PERM)  # HAS_PERM: position -> the input row
        if MASK:
            k = tl.load(k_base + src_n[:, None] * s_kl + offs_d[None, :], mask=(offs_n < Lk)[:, None], other=0.0)
            qk = tl.where((offs_n < Lk)[None, :], _qk(q, k, INTERPRET), float("-inf"))
        else:
            k = tl.load(k_base + src_n[:, None] * s_kl + offs_d[None, :])
            qk = _qk(q, k, INTERPRET)
        # the maximum of the unscaled logits (qk_scale > 0), so the scale enters once per element, in the FMA
        # of the exponent's argument
        m_new = tl.maximum(m_b, tl.max(qk, 1) * qk_scale)
        l_b = l_b * tl.math.exp2(m_b - m_new) + tl.sum(tl.math.exp2(qk * qk_scale - m_new[:, None]), 1)
        m_b = m_new
    return m_b + tl.math.log2(l_b)


@triton.jit
def _key_block(q, k_base, s_kl, kb, scratch, r, m_i, l_i, Lk, qk_scale, offs_n0, offs_d, token_perm,
               BS: tl.constexpr, BLOCK_N: tl.constexpr, KV_SUB: tl.constexpr, MASK: tl.constexpr, INTERPRET: tl.constexpr,
               R: tl.constexpr, HAS_PERM: tl.constexpr):
    """One key block: its per-row log2-sum-exp to the scratch buffer, and into the rows' running total."""
    lse_b = _block_lse(q, k_base, s_kl, kb * BS, Lk, qk_scale, offs_n0, offs_d, token_perm, BLOCK_N, KV_SUB, MASK,
                       INTERPRET, R, HAS_PERM)
    tl.store(scratch + kb * R + r, lse_b)
    m_new = tl.maximum(m_i, lse_b)
    return m_new, l_i * tl.math.exp2(m_i - m_new) + tl.math.exp2(lse_b - m_new)


@triton.jit
def _block_mass_kernel(Q, K, Out, Scratch, row_off, token_perm, H, Lq, Lk, num_q_blocks, num_kv_blocks, n_tiles,
                       qk_scale, s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_ob, s_oh, s_oq,
                       HEAD_DIM: tl.constexpr, BS: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
                       BLOCK_N: tl.constexpr, TAIL_K: tl.constexpr, INTERPRET: tl.constexpr, HAS_PERM: tl.constexpr):
    R: tl.constexpr = G * S
    KV_SUB: tl.constexpr = BS // BLOCK_N
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    r = tl.arange(0, R)
    qblk = tile * G + r // S
    off = tl.load(row_off + qblk * S + r % S, mask=qblk < num_q_blocks, other=-1)
    valid = off >= 0
    rows = source_rows(token_perm, tl.where(valid, qblk * BS + off, 0), Lq, HAS_PERM)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n0 = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * s_qb + h * s_qh + rows[:, None] * s_ql + offs_d[None, :], mask=valid[:, None], other=0.0)
    k_base = K + b * s_kb + h * s_kh
    # per-row, per-key-block log2 partial sums: [Kb, R] of this program, written once, read once
    scratch = Scratch + (bh * n_tiles + tile).to(tl.int64) * num_kv_blocks * R
    n_main = num_kv_blocks
    if TAIL_K:
        n_main = num_kv_blocks - 1

    # one pass over the keys: each key block's log-sum-exp per row, and the row's total (online)
    m_i = tl.full([R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([R], dtype=tl.float32)
    for kb in range(0, n_main):
        m_i, l_i = _key_block(q, k_base, s_kl, kb, scratch, r, m_i, l_i, Lk, qk_scale, offs_n0, offs_d, token_perm,
                              BS, BLOCK_N, KV_SUB, False, INTERPRET, R, HAS_PERM)
    if TAIL_K:  # the partial last key block: keys past Lk masked
        m_i, l_i = _key_block(q, k_base, s_kl, num_kv_blocks - 1, scratch, r, m_i, l_i, Lk, qk_scale, offs_n0,
                              offs_d, token_perm, BS, BLOCK_N, KV_SUB, True, INTERPRET, R, HAS_PERM)
    lse = m_i + tl.math.log2(l_i)

    # probability mass per (query block, key block): mean over the block's sampled rows
    cnt = tl.sum(tl.reshape(valid.to(tl.float32), (G, S)), 1)
    inv_cnt = tl.where(cnt > 0, 1.0 / tl.maximum(cnt, 1.0), 0.0)
    qblk_g = tile * G + tl.arange(0, G)
    out_base = Out + b * s_ob + h * s_oh + qblk_g * s_oq
    g_ok = qblk_g < num_q_blocks
    for kb in range(0, num_kv_blocks):
        p = tl.math.exp2(tl.load(scratch + kb * R + r) - lse)
        p = tl.where(valid, p, 0.0)
        tl.store(out_base + kb, tl.sum(tl.reshape(p, (G, S)), 1) * inv_cnt, mask=g_ok)


_ROW_TABLES: dict = {}


def _row_offset_table(q_len: int, block_size: int, sample_rows, device) -> tuple[torch.Tensor, int]:
    """int32 ``[Qb, S]`` row offsets inside each query block (-1 = unused slot), S a power of two."""
    from ..reference import sample_row_offsets  # the reference's row choice, so both agree exactly

    key = (q_len, block_size, sample_rows, str(device))
    if key not in _ROW_TABLES:
        num_q_blocks = -(-q_len // block_size)
        last_rows = q_len - (num_q_blocks - 1) * block_size
        full = sample_row_offsets(block_size, sample_rows)
        last = sample_row_offsets(last_rows, sample_rows)
        width = triton.next_power_of_2(max(full.numel(), last.numel()))
        table = torch.full((num_q_blocks, width), -1, dtype=torch.int32)
        table[:, : full.numel()] = full.to(torch.int32)
        table[-1] = -1
        table[-1, : last.numel()] = last.to(torch.int32)
        _ROW_TABLES[key] = (table.to(device), width)
    return _ROW_TABLES[key]


def block_mass_triton_impl(q: torch.Tensor, k: torch.Tensor, block_size: int, sample_rows, scale: float,
                           block_n: int = 128, num_warps: int = 8, num_stages: int = 3,
                           token_perm: torch.Tensor | None = None, rows_per_program: int = MASS_ROWS) -> torch.Tensor:
    """Launch the block-mass kernel; see the module docstring for the contract. ``token_perm``
    (``Lq == Lk == L``; int32/int64 ``[L]``, a permutation): the mass of the sequence in that order
    (position ``i`` = input row ``token_perm[i]``), fused into the q / k loads. ``block_n``, ``num_warps``,
    ``num_stages``, ``rows_per_program`` (a power of two >= 16: sampled rows one program holds): the launch
    configuration (``benchmarks/kernels/bench_block_sparse.py --mass-sweep`` times the alternatives)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q/k must be [B, H, L, D] with matching B, H, D; got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype:
        raise ValueError(f"triton block_mass needs fp16/bf16 q and k of one dtype, got {q.dtype}, {k.dtype}")
    if q.shape[3] not in (64, 128):
        raise ValueError(f"triton block_mass supports head dims 64 and 128, got {q.shape[3]}")
    if not portable_block_size(block_size):
        raise ValueError(f"triton block_mass needs a power-of-two block_size in [16, 256], got {block_size!r}")
    if sample_rows is not None and (not isinstance(sample_rows, int) or sample_rows < 1):
        raise ValueError(f"sample_rows must be a positive int or None, got {sample_rows!r}")
    if not (math.isfinite(scale) and scale > 0):  # the kernel takes the row maximum of the unscaled logits
        raise ValueError(f"triton block_mass needs a positive finite scale, got {scale!r}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q, k need unit stride on the head dim")
    if rows_per_program < 16 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two >= 16, got {rows_per_program!r}")
    token_perm = check_perm(token_perm, q, k)
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    num_q_blocks, num_kv_blocks = -(-q_len // block_size), -(-kv_len // block_size)
    table, width = _row_offset_table(q_len, block_size, sample_rows, q.device)
    groups = max(1, rows_per_program // width)
    block_n = min(block_n, block_size)
    out = torch.empty(batch, heads, num_q_blocks, num_kv_blocks, dtype=torch.float32, device=q.device)
    n_tiles = triton.cdiv(num_q_blocks, groups)
    grid = (n_tiles, batch * heads)
    if q.device.type == "cuda" and q.device.index is not None and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):  # Triton launches on the current device
            return block_mass_triton_impl(q, k, block_size, sample_rows, scale, block_n, num_warps, num_stages,
                                          token_perm, rows_per_program)
    # per (b, h): the output block grid and the scratch of per-row key-block partial sums
    chunks = int32_chunks((q, k), max(num_q_blocks * num_kv_blocks, n_tiles * groups * width * num_kv_blocks))
    if len(chunks) > 1:  # offsets past int32: run (batch, head) chunks
        for b0, b1, h0, h1 in chunks:
            out[b0:b1, h0:h1] = block_mass_triton_impl(q[b0:b1, h0:h1], k[b0:b1, h0:h1], block_size, sample_rows,
                                                       scale, block_n, num_warps, num_stages, token_perm,
                                                       rows_per_program)
        return out
    scratch = torch.empty(batch * heads * n_tiles * groups * width * num_kv_blocks, dtype=torch.float32,
                          device=q.device)
    _block_mass_kernel[grid](
        q, k, out, scratch, table, table if token_perm is None else token_perm, heads, q_len, kv_len, num_q_blocks,
        num_kv_blocks, n_tiles, float(scale * LOG2E),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=head_dim, BS=block_size, S=width, G=groups, BLOCK_N=block_n, TAIL_K=kv_len % block_size != 0,
        INTERPRET=interpreter_upcast(q), HAS_PERM=token_perm is not None, num_warps=num_warps, num_stages=num_stages)
    return out
