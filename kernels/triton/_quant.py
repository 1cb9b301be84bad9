"""Fused FP8 (e4m3) quantisation pre-pass for the block-sparse attention kernel.

Inputs q ``[B, H, Lq, D]``, k/v ``[B, H, Lk, D]`` (fp16/bf16, any strides with unit stride on D).
Outputs (all contiguous, token axis padded to ``Lpad = ceil(L / 128) * 128`` so that the attention
kernel only ever sees 16-byte aligned strides and never needs a load mask):

- ``q8``  e4m3 ``[B, H, Lpad_q, D]``: ``q * softmax_scale * log2(e)`` divided by its per-(b, h,
  128-token tile) scale ``q_scale`` fp32 ``[B, H, Lpad_q / 128]`` (the softmax scale and the base-2
  exponent are folded in here, so the kernel's logits are already in log2 units);
- ``k8``  e4m3 ``[B, H, Lpad_k, D]``: ``k - c`` (K smoothing: subtracting any per-(b, h) channel
  vector ``c`` from K adds the same constant to every logit of a query row, which softmax ignores;
  with ``c`` the channel mean it removes the shared offset that would otherwise eat the e4m3 range)
  divided by its per-tile scale ``k_scale`` fp32 ``[B, H, Lpad_k / 128]``. ``c`` is the mean of
  ``SMOOTH_ROWS`` (128) evenly strided rows of K (:func:`smoothing_rows`), not of all rows: the
  result is exact either way, and K is then read from memory once (by the quantise kernel) instead
  of twice;
- ``v8t`` e4m3 ``[B, H, D, Lpad_k]``: ``v / v_scale`` with a per-(b, h, channel) scale ``v_scale``
  fp32 ``[B, H, D]``, stored *transposed* because Hopper's FP8 wgmma needs both operands K-major: in
  ``P @ V`` the reduction axis is the token axis, so V must be token-contiguous.

With ``pool_block`` (the pooled tail) the K and V copies get one more row (V^T column) per key block after
``Lpad_k``: the block's mean of smoothed K / of V, quantised like the keys (see :func:`quantize_qkv_fp8`).

Options: Q may be left to the attention kernel (``quantize_q=False``: it quantises each query tile
on load with :func:`quantize_q_tile`, so this pass reads only K and V), and a token permutation may be
fused into the loads (``token_perm``: the copies are written in that order; 3D-tile token order).

Scales are ``absmax / 448`` (448 = largest finite e4m3) with 1.0 where a tile is all zero; values
are clamped to +-448 before the cast. Padded rows/columns are written as exact zeros.
Launches: the smoothing vector (a gather of the sampled K rows and their mean), a stats kernel (per
2048-token chunk: channel absmax of V, written as partials), their fixed-order reduction (a small
torch reduction: no atomics, so the result is bitwise reproducible), and the quantise kernel (one
program per 128-token tile and (b, h)). Memory traffic: Q and K read once, V twice (its per-channel
scale needs the whole sequence first), the three FP8 copies written once. The pooled tail adds one
small launch (the block means from per-chunk sums the quantise kernel writes: ``2 * Kb * D`` fp32 per
(b, h)).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

QUANT_TILE = 128  # tokens per Q/K scale (the attention kernel's tiles divide this)
STATS_CHUNK = 2048  # tokens per program of the stats kernel
SMOOTH_ROWS = 128  # K rows whose channel mean is the smoothing vector
FP8_MAX = 448.0
LOG2E = 1.4426950408889634


@triton.jit
def round_e4m3(x):
    """Round fp32 ``x`` (|x| <= 448) to the nearest e4m3 value, ties to even, in fp32 arithmetic.
    Only used under the CPU interpreter, whose own fp32 -> e4m3 cast mis-rounds."""
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(x), 1e-30))), -6.0)
    quantum = tl.math.exp2(e - 3.0)
    r = x / quantum
    rr = tl.floor(r + 0.5)
    odd = (rr - 2.0 * tl.floor(rr * 0.5)) != 0
    rr = tl.where((rr - r == 0.5) & odd, rr - 1.0, rr)
    return rr * quantum


@triton.jit
def _v_stats_kernel(V, v_part, H, Lk, n_chunks, s_vb, s_vh, s_vl,
                    HEAD_DIM: tl.constexpr, TILE: tl.constexpr, CHUNK: tl.constexpr):
    pid_c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, HEAD_DIM)
    acc_max = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for t in range(0, CHUNK, TILE):
        rows = pid_c * CHUNK + t + tl.arange(0, TILE)
        valid = (rows < Lk)[:, None]
        vt = tl.load(V + b * s_vb + h * s_vh + rows[:, None] * s_vl + offs_d[None, :], mask=valid, other=0.0)
        acc_max = tl.maximum(acc_max, tl.max(tl.abs(vt.to(tl.float32)), axis=0))
    # per-chunk partials, reduced in a fixed order afterwards (no atomics: bitwise reproducible)
    tl.store(v_part + (bh * n_chunks + pid_c) * HEAD_DIM + offs_d, acc_max)


@triton.jit
def quantize_q_tile(q, q_mult, INTERPRET: tl.constexpr):
    """One Q tile to e4m3: returns ``(q * q_mult / scale as e4m3, scale)`` with ``scale = absmax / 448``
    (1.0 for an all-zero tile) in fp32; ``q_mult`` folds the softmax scale and log2(e) in. Used by the
    pre-pass (128-token tiles) and by the attention kernel when it quantises its own Q tile."""
    x = q.to(tl.float32) * q_mult
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    x = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    if INTERPRET:
        x = round_e4m3(x)
    return x.to(tl.float8e4nv), scale


def wgmma_key_order_torch(rows):
    """Column of V^T that holds key ``rows`` in the wgmma key order: within each 16 keys, key
    ``8a + 2t + b`` goes to ``4t + 2a + b`` (a, b in {0, 1}, t in 0..3). It is the order in which an
    FP8 wgmma's A-operand registers hold the keys of P computed in the accumulator layout, so the
    warp-specialised kernel feeds P to ``P @ V`` without moving data between threads (integer bit
    operations; the pre-pass applies the inverse, :func:`wgmma_key_of_column`, to its loads)."""
    return (rows & ~15) | (((rows >> 1) & 3) << 2) | (((rows >> 3) & 1) << 1) | (rows & 1)


@triton.jit
def wgmma_key_of_column(cols):
    """The inverse of :func:`wgmma_key_order_torch`: the key that column ``cols`` of V^T holds (column
    ``4t + 2a + b`` holds key ``8a + 2t + b``)."""
    return (cols & ~15) | (((cols >> 1) & 1) << 3) | (((cols >> 2) & 3) << 1) | (cols & 1)


@triton.jit
def source_rows(token_perm, rows, length, HAS_PERM: tl.constexpr):
    """The input row read for each output position ``rows``: ``token_perm[rows]`` clamped into
    ``[0, length)`` (a bad permutation gives wrong values, never an out-of-bounds read), or ``rows``."""
    if HAS_PERM:
        src = tl.load(token_perm + rows, mask=rows < length, other=0)
        return tl.minimum(tl.maximum(src, 0), length - 1)
    return rows


@triton.jit
def block_sums(x, sums, chunk0, HEAD_DIM: tl.constexpr, TILE: tl.constexpr, CHUNK: tl.constexpr):
    """Store the sums of each ``CHUNK`` consecutive rows of ``x`` (fp32 ``[TILE, D]``) as rows ``chunk0 ..
    chunk0 + TILE / CHUNK - 1`` of ``sums`` (fp32, ``D`` per row): the pooled tail's block sums."""
    part = tl.sum(tl.reshape(x, [TILE // CHUNK, CHUNK, HEAD_DIM]), axis=1)
    idx = chunk0 + tl.arange(0, TILE // CHUNK)
    tl.store(sums + idx[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], part)


@triton.jit
def _program_tile(H, HEAD_DIM: tl.constexpr, TILE: tl.constexpr):
    """A program of a ``(tiles, B * H)`` grid: ``(tile, bh, b, h, channel offsets, the tile's token rows)``."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    return tile, bh, bh // H, bh % H, tl.arange(0, HEAD_DIM), tile * TILE + tl.arange(0, TILE)


@triton.jit
def _quant_kernel(Q, K, V, q8, k8, v8t, q_scale, k_scale, k_smooth, v_stats, token_perm, pool_sums,
                  H, Lq, Lk, Lpad_q, Lpad_k, Lrow_k, q_mult,
                  s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
                  HEAD_DIM: tl.constexpr, TILE: tl.constexpr, INTERPRET: tl.constexpr, QUANT_Q: tl.constexpr,
                  HAS_PERM: tl.constexpr, V_WGMMA_ORDER: tl.constexpr, POOL_CHUNK: tl.constexpr):
    # v_stats: V's per-channel absmax [B*H, D]
    # Lrow_k: rows of k8 / v8t per (b, h) (Lpad_k, plus the pooled tail's rows); POOL_CHUNK > 0: the sums of
    # each POOL_CHUNK keys of smoothed K and of V into pool_sums [B*H, 2, Lpad_k / POOL_CHUNK, D]
    tile, bh, b, h, offs_d, rows = _program_tile(H, HEAD_DIM, TILE)
    n_qt = Lpad_q // TILE
    n_kt = Lpad_k // TILE
    n_kt_row = Lrow_k // TILE
    n_chunks = Lpad_k // tl.maximum(POOL_CHUNK, 1)
    if QUANT_Q and tile < n_qt:
        valid = (rows < Lq)[:, None]
        src = source_rows(token_perm, rows, Lq, HAS_PERM)
        x = tl.load(Q + b * s_qb + h * s_qh + src[:, None] * s_ql + offs_d[None, :], mask=valid, other=0.0)
        x8, scale = quantize_q_tile(x, q_mult, INTERPRET)
        tl.store(q8 + bh * Lpad_q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :], x8)
        tl.store(q_scale + bh * n_qt + tile, scale)
    if tile < n_kt:
        valid = (rows < Lk)[:, None]
        mean = tl.load(k_smooth + bh * HEAD_DIM + offs_d)
        src = source_rows(token_perm, rows, Lk, HAS_PERM)
        x = tl.load(K + b * s_kb + h * s_kh + src[:, None] * s_kl + offs_d[None, :], mask=valid, other=0.0)
        x = tl.where(valid, x.to(tl.float32) - mean[None, :], 0.0)
        if POOL_CHUNK > 0:
            block_sums(x, pool_sums + bh * 2 * n_chunks * HEAD_DIM, tile * (TILE // POOL_CHUNK), HEAD_DIM, TILE,
                       POOL_CHUNK)
        x, scale = quantize_k_tile(x, INTERPRET)
        tl.store(k8 + bh * Lrow_k * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :], x.to(k8.dtype.element_ty))
        tl.store(k_scale + bh * n_kt_row + tile, scale)
        if V_WGMMA_ORDER:
            # gather the keys in the wgmma order on load, so the transposed store stays contiguous
            # (scattering the store's columns instead makes it byte-wise: +0.2 ms at 720p)
            v_rows = wgmma_key_of_column(rows)
            v_valid = (v_rows < Lk)[:, None]
            v_src = source_rows(token_perm, v_rows, Lk, HAS_PERM)
        else:
            v_valid = valid
            v_src = src
        y = tl.load(V + b * s_vb + h * s_vh + v_src[:, None] * s_vl + offs_d[None, :], mask=v_valid, other=0.0)
        if POOL_CHUNK > 0:  # (the wgmma order permutes keys within 16: each chunk's set of keys is the same)
            block_sums(y.to(tl.float32), pool_sums + (bh * 2 + 1) * n_chunks * HEAD_DIM, tile * (TILE // POOL_CHUNK),
                       HEAD_DIM, TILE, POOL_CHUNK)
        y = scale_v_tile(y.to(tl.float32), v_stats + bh * HEAD_DIM)
        if INTERPRET:
            y = round_e4m3(y)
        # transposed store: v8t[bh, d, col]; column col holds key col, or in the wgmma key order the key
        # wgmma_key_of_column(col) (see quantize_qkv_fp8)
        tl.store(v8t + bh * HEAD_DIM * Lrow_k + offs_d[None, :] * Lrow_k + rows[:, None], y.to(v8t.dtype.element_ty))


@triton.jit
def scale_v_tile(y, v_absmax):
    """A V tile (fp32 ``[TILE, D]``) in e4m3 units: ``y`` divided by the per-channel scale ``absmax_d / 448``
    from ``v_absmax`` (``[D]``; 1 for an all-zero channel), clamped to +-448."""
    vmax = tl.load(v_absmax + tl.arange(0, y.shape[1]))
    vscale = tl.where(vmax > 0, vmax / 448.0, 1.0)
    return tl.minimum(tl.maximum(y / vscale[None, :], -448.0), 448.0)


@triton.jit
def quantize_k_tile(x, INTERPRET: tl.constexpr):
    """A K tile (fp32 ``[TILE, D]``, smoothed) to e4m3 with one absmax scale: ``(x / scale, scale)``."""
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    x = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    if INTERPRET:
        x = round_e4m3(x)
    return x, scale


@triton.jit
def _kv_block_sums_kernel(K, V, pool_sums, H, Lk, n_chunks, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
                          HEAD_DIM: tl.constexpr, TILE: tl.constexpr, POOL_CHUNK: tl.constexpr):
    """The 16-bit path's pooled-tail sums (the FP8 pre-pass fuses them): per ``TILE`` keys of one (b, h),
    the sums of each ``POOL_CHUNK`` keys of K and V into ``pool_sums [B*H, 2, n_chunks, D]`` (K and V in the
    order given: a token order is applied by the caller's gather)."""
    tile, bh, b, h, offs_d, rows = _program_tile(H, HEAD_DIM, TILE)
    valid = (rows < Lk)[:, None]
    x = tl.load(K + b * s_kb + h * s_kh + rows[:, None] * s_kl + offs_d[None, :], mask=valid, other=0.0)
    block_sums(x.to(tl.float32), pool_sums + bh * 2 * n_chunks * HEAD_DIM, tile * (TILE // POOL_CHUNK), HEAD_DIM,
               TILE, POOL_CHUNK)
    y = tl.load(V + b * s_vb + h * s_vh + rows[:, None] * s_vl + offs_d[None, :], mask=valid, other=0.0)
    block_sums(y.to(tl.float32), pool_sums + (bh * 2 + 1) * n_chunks * HEAD_DIM, tile * (TILE // POOL_CHUNK),
               HEAD_DIM, TILE, POOL_CHUNK)


@triton.jit
def _pooled_means(pool_sums, bh, which, blocks, n_chunks, Lk, BS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  POOL_CHUNK: tl.constexpr):
    """Means over the real keys of key blocks ``blocks`` (``[N]``; blocks past the last give 0) from the
    chunk sums (``which`` 0: K, 1: V): fp32 ``[N, D]``."""
    offs_d = tl.arange(0, HEAD_DIM)
    base = pool_sums + (bh * 2 + which) * n_chunks * HEAD_DIM
    total = tl.zeros([blocks.shape[0], HEAD_DIM], dtype=tl.float32)
    for c in tl.static_range(BS // POOL_CHUNK):
        idx = blocks * (BS // POOL_CHUNK) + c
        total += tl.load(base + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=(idx < n_chunks)[:, None], other=0.0)
    count = tl.minimum(tl.maximum(Lk - blocks * BS, 0), BS)
    return total / tl.maximum(count, 1).to(tl.float32)[:, None]


@triton.jit
def _pooled_finalize_kernel(pool_sums, k_out, v_out, k_scale, v_stats, H, Lk, n_chunks, Lrow_k, row0,
                            HEAD_DIM: tl.constexpr, TILE: tl.constexpr, BS: tl.constexpr, POOL_CHUNK: tl.constexpr,
                            FP8: tl.constexpr, INTERPRET: tl.constexpr, V_WGMMA_ORDER: tl.constexpr):
    """One ``TILE`` of pooled keys of one (b, h): key block ``tile * TILE + r``'s means of K and V as row
    ``row0 + tile * TILE + r`` of ``k_out`` / ``v_out`` (FP8: ``k8`` rows with the tile's K scale at
    ``k_scale[bh, row0 / TILE + tile]``, ``v8t`` columns in the pre-pass's per-channel V scales and key order; else
    ``[B*H, Lrow_k, D]`` buffers in their dtype). Blocks past the last are zeros."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    r = tl.arange(0, TILE)
    rows = row0 + tile * TILE + r
    kbar = _pooled_means(pool_sums, bh, 0, tile * TILE + r, n_chunks, Lk, BS, HEAD_DIM, POOL_CHUNK)
    v_keys = r
    if V_WGMMA_ORDER:  # column r holds pooled key wgmma_key_of_column(r), as in the pre-pass
        v_keys = wgmma_key_of_column(r)
    vbar = _pooled_means(pool_sums, bh, 1, tile * TILE + v_keys, n_chunks, Lk, BS, HEAD_DIM, POOL_CHUNK)
    if FP8:
        kbar, scale = quantize_k_tile(kbar, INTERPRET)
        tl.store(k_scale + bh * (Lrow_k // TILE) + row0 // TILE + tile, scale)
        vbar = scale_v_tile(vbar, v_stats + bh * HEAD_DIM)
        if INTERPRET:
            vbar = round_e4m3(vbar)
        tl.store(v_out + bh * HEAD_DIM * Lrow_k + offs_d[None, :] * Lrow_k + rows[:, None],
                 vbar.to(v_out.dtype.element_ty))
    else:
        tl.store(v_out + bh * Lrow_k * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :],
                 vbar.to(v_out.dtype.element_ty))
    tl.store(k_out + bh * Lrow_k * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :],
             kbar.to(k_out.dtype.element_ty))


def smoothing_rows(length: int, device=None) -> torch.Tensor:
    """int64 indices of the ``SMOOTH_ROWS`` evenly strided K rows (all rows of a shorter sequence)
    whose channel mean is the smoothing vector."""
    if length <= SMOOTH_ROWS:
        return torch.arange(length, device=device)
    return torch.linspace(0, length - 1, SMOOTH_ROWS, device=device).round().long()


def smoothing_vector(k: torch.Tensor, token_perm: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[B, H, D]``: the channel mean of K's :func:`smoothing_rows` -- of the sequence in the
    order ``token_perm`` (position -> input row) when given, so a call with a fused token order is
    exactly the call on the reordered sequence."""
    rows = smoothing_rows(k.shape[2], k.device)
    if token_perm is not None:
        rows = token_perm.index_select(0, rows).long().clamp_(0, k.shape[2] - 1)
    return k.index_select(2, rows).float().mean(dim=2)


def padded_len(length: int) -> int:
    return -(-length // QUANT_TILE) * QUANT_TILE


def tail_rows(kv_len: int, block_size: int) -> int:
    """Rows of pooled keys the pooled tail appends: one per key block, padded to whole 128-row tiles
    (``ceil(Kb / 128) * 128``, ``Kb = ceil(kv_len / block_size)``)."""
    blocks = -(-kv_len // block_size)
    return -(-blocks // QUANT_TILE) * QUANT_TILE


def _pool_chunk(block_size: int) -> int:
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the pooled tail needs a power-of-two block size >= 16, got {block_size}")
    return min(block_size, QUANT_TILE)


def pooled_kv_16bit(k: torch.Tensor, v: torch.Tensor, block_size: int):
    """The pooled tail's keys and values for the 16-bit path: ``(kp, vp)``, k's dtype ``[B, H, R, D]``
    with ``R = tail_rows(Lk, block_size)``: row ``j`` = the means of K / V over key block ``j``'s real
    keys (zeros past the last block). Two launches (sums, means); K and V are read once, any strides."""
    batch, heads, kv_len, head_dim = k.shape
    chunk = _pool_chunk(block_size)
    rows = tail_rows(kv_len, block_size)
    lpad = padded_len(kv_len)
    sums = torch.empty(batch * heads, 2, lpad // chunk, head_dim, device=k.device, dtype=torch.float32)
    _kv_block_sums_kernel[(lpad // QUANT_TILE, batch * heads)](
        k, v, sums, heads, kv_len, lpad // chunk, k.stride(0), k.stride(1), k.stride(2), v.stride(0),
        v.stride(1), v.stride(2), HEAD_DIM=head_dim, TILE=QUANT_TILE, POOL_CHUNK=chunk, num_warps=8)
    kp = torch.empty(batch, heads, rows, head_dim, device=k.device, dtype=k.dtype)
    vp = torch.empty_like(kp)
    _pooled_finalize_kernel[(rows // QUANT_TILE, batch * heads)](
        sums, kp, vp, sums, sums, heads, kv_len, lpad // chunk, rows, 0, HEAD_DIM=head_dim, TILE=QUANT_TILE,
        BS=block_size, POOL_CHUNK=chunk, FP8=False, INTERPRET=interpreter_upcast(k), V_WGMMA_ORDER=False, num_warps=8)
    return kp, vp


def interpreter_upcast(t: torch.Tensor) -> bool:
    """True under ``TRITON_INTERPRET=1`` on CPU tensors. Two interpreter defects are worked around
    then (Triton 3.8): its 16-bit ``tl.dot`` misreads bf16 bits, so 16-bit operands are upcast to fp32
    first (products of 16-bit floats are exact in fp32, as on tensor cores); its fp32 -> e4m3 cast
    mis-rounds values that carry into the next binade, so values are pre-rounded to the e4m3 grid
    (round to nearest even) with exact fp32 arithmetic, making the cast exact."""
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def check_prepass_perm(token_perm, q_len: int, kv_len: int, device) -> None:
    """``ValueError`` unless ``token_perm`` is None or int32 ``[q_len]`` on ``device`` with ``q_len == kv_len``
    (what the pre-passes take; its values are clamped by the kernels, never read here)."""
    if token_perm is not None and (q_len != kv_len or token_perm.shape != (q_len,) or token_perm.dtype != torch.int32
                                   or token_perm.device != device):
        raise ValueError(f"token_perm must be int32 [{q_len}] on {device} with Lq == Lk; got "
                         f"{token_perm.dtype} {tuple(token_perm.shape)} on {token_perm.device}, Lk={kv_len}")


def v_channel_absmax(v: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B * H, D]``: V's per-channel absmax over its tokens (``v`` ``[B, H, L, D]``, any strides with unit
    stride on D): the stats kernel's per-chunk partials, reduced in a fixed order (bitwise reproducible)."""
    batch, heads, kv_len, head_dim = v.shape
    n_chunks = triton.cdiv(kv_len, STATS_CHUNK)
    v_part = torch.empty(batch * heads, n_chunks, head_dim, device=v.device, dtype=torch.float32)
    _v_stats_kernel[(n_chunks, batch * heads)](
        v, v_part, heads, kv_len, n_chunks, v.stride(0), v.stride(1), v.stride(2),
        HEAD_DIM=head_dim, TILE=QUANT_TILE, CHUNK=STATS_CHUNK, num_warps=8)
    return v_part.amax(1).contiguous()


def quantize_qkv_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, quantize_q: bool = True,
                     token_perm: torch.Tensor | None = None, v_key_order: str = "natural",
                     pool_block: int | None = None):
    """Run the fused pre-pass; returns ``(q8, k8, v8t, q_scale, k_scale, v_scale)`` (see module doc).

    ``scale`` is the softmax scale; ``q_scale`` already includes ``scale * log2(e)``.
    ``quantize_q=False``: Q is left to the attention kernel (it quantises its own Q tile on load);
    ``q8`` and ``q_scale`` are then None and the pass reads only K and V.
    ``token_perm``: int32 ``[L]`` on q's device (``Lq == Lk == L``), output position -> input row: the
    copies are written in that token order (row ``i`` of ``q8``/``k8``/``v8t`` is input row
    ``token_perm[i]``), fused into the loads, so a reordered sequence costs no extra pass. Entries
    are clamped into ``[0, L)``; the caller passes a permutation.
    ``v_key_order``: ``"natural"`` (column ``j`` of ``v8t`` is key ``j``) or ``"wgmma"`` (key ``j`` sits at
    column :func:`wgmma_key_order_torch` ``(j)``, a permutation within each 16 keys, for the warp-specialised
    kernel). ``v_scale`` is fp32 ``[B, H, D]``, one scale per channel over the whole sequence (V is read
    twice, by the stats kernel first).
    ``pool_block`` (the pooled tail's key block size, a power of two >= 16, or None): ``k8`` / ``v8t`` get
    :func:`tail_rows` more rows / columns after ``Lpad_k``: position ``Lpad_k + j`` holds the mean over key
    block ``j``'s real keys (in this call's token order) of smoothed K / of V, zeros past the last block,
    quantised like the real keys (one K scale per 128 pooled keys appended to ``k_scale``; V with the
    per-channel scales, in the call's key order). The means come from
    per-chunk sums the quantise kernel writes while it has K and V in registers (no extra read), then one
    small launch averages and quantises them.
    """
    if v_key_order not in ("natural", "wgmma"):
        raise ValueError(f"v_key_order must be 'natural' or 'wgmma', got {v_key_order!r}")
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    lpad_q, lpad_k = padded_len(q_len), padded_len(kv_len)
    chunk = 0 if pool_block is None else _pool_chunk(pool_block)
    lrow_k = lpad_k + (0 if pool_block is None else tail_rows(kv_len, pool_block))  # rows of k8 / v8t per (b, h)
    dev = q.device
    fp8 = torch.float8_e4m3fn
    check_prepass_perm(token_perm, q_len, kv_len, dev)
    q8 = torch.empty(batch, heads, lpad_q, head_dim, device=dev, dtype=fp8) if quantize_q else None
    k8 = torch.empty(batch, heads, lrow_k, head_dim, device=dev, dtype=fp8)
    v8t = torch.empty(batch, heads, head_dim, lrow_k, device=dev, dtype=fp8)
    q_scale = (torch.empty(batch, heads, lpad_q // QUANT_TILE, device=dev, dtype=torch.float32) if quantize_q
               else None)
    k_scale = torch.empty(batch, heads, lrow_k // QUANT_TILE, device=dev, dtype=torch.float32)
    pool_sums = (k_scale if not chunk else
                 torch.empty(batch * heads, 2, lpad_k // chunk, head_dim, device=dev, dtype=torch.float32))
    v_stats = v_channel_absmax(v).view(batch, heads, head_dim)
    k_mean = smoothing_vector(k, token_perm).contiguous()
    tiles = max(lpad_q, lpad_k) if quantize_q else lpad_k
    _quant_kernel[(tiles // QUANT_TILE, batch * heads)](
        q, k, v, k8 if q8 is None else q8, k8, v8t, k_scale if q_scale is None else q_scale, k_scale, k_mean,
        v_stats, k_scale if token_perm is None else token_perm, pool_sums,
        heads, q_len, kv_len, lpad_q, lpad_k, lrow_k, float(scale * LOG2E),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        HEAD_DIM=head_dim, TILE=QUANT_TILE, INTERPRET=interpreter_upcast(q),
        QUANT_Q=bool(quantize_q), HAS_PERM=token_perm is not None, V_WGMMA_ORDER=v_key_order == "wgmma",
        POOL_CHUNK=chunk, num_warps=4)  # the fastest of 2 / 4 / 8 / 16 warps on the H200 (docs/BENCHMARK_LOG.md)
    if chunk:
        _pooled_finalize_kernel[((lrow_k - lpad_k) // QUANT_TILE, batch * heads)](
            pool_sums, k8, v8t, k_scale, v_stats, heads, kv_len, lpad_k // chunk, lrow_k, lpad_k, HEAD_DIM=head_dim,
            TILE=QUANT_TILE, BS=pool_block, POOL_CHUNK=chunk, FP8=True, INTERPRET=interpreter_upcast(q),
            V_WGMMA_ORDER=v_key_order == "wgmma", num_warps=8)
    v_scale = torch.where(v_stats > 0, v_stats / FP8_MAX, torch.ones_like(v_stats))
    return q8, k8, v8t, q_scale, k_scale, v_scale


def quantize_reference(q, k, v, scale: float, v_key_order: str = "natural", pool_block: int | None = None):
    """Plain-torch twin of :func:`quantize_qkv_fp8` (fp32 math, same scales and layout) for tests."""
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    lpad_q, lpad_k = padded_len(q_len), padded_len(kv_len)

    def pad_rows(x, rows):
        return torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[2]))

    def tiles(x, lpad):
        x = pad_rows(x, lpad)
        xt = x.view(batch, heads, lpad // QUANT_TILE, QUANT_TILE, head_dim)
        amax = xt.abs().amax(dim=(-1, -2))
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return (xt / s[..., None, None]).clamp(-FP8_MAX, FP8_MAX).view_as(x), s

    qf = q.float() * (scale * LOG2E)
    kf = k.float() - smoothing_vector(k)[:, :, None, :]
    vf = v.float()
    lrow_k = lpad_k
    if pool_block is not None:  # the pooled tail's rows after the padded keys: block means, zeros past the last
        from ..reference import pooled_key_blocks  # noqa: PLC0415

        rows = tail_rows(kv_len, pool_block)
        kbar, vbar = pooled_key_blocks(kf, vf, pool_block)
        kf = torch.cat([pad_rows(kf, lpad_k), pad_rows(kbar, rows)], dim=2)
        vf = torch.cat([pad_rows(vf, lpad_k), pad_rows(vbar, rows)], dim=2)
        lrow_k += rows
    q8, qs = tiles(qf, lpad_q)
    k8, ks = tiles(kf, lrow_k)
    vmax = v.float().abs().amax(dim=2)
    vs = torch.where(vmax > 0, vmax / FP8_MAX, torch.ones_like(vmax))
    v8 = pad_rows((vf / vs[:, :, None, :]).clamp(-FP8_MAX, FP8_MAX), lrow_k)
    fp8 = torch.float8_e4m3fn
    v8t = v8.transpose(-1, -2).contiguous()
    if v_key_order == "wgmma":
        cols = wgmma_key_order_torch(torch.arange(lrow_k, device=v8t.device))
        v8t = torch.empty_like(v8t).index_copy_(-1, cols, v8t)
    return q8.to(fp8), k8.to(fp8), v8t.to(fp8), qs, ks, vs


__all__ = ["quantize_qkv_fp8", "quantize_q_tile", "wgmma_key_order_torch", "quantize_reference", "padded_len",
           "tail_rows", "pooled_kv_16bit", "smoothing_rows", "smoothing_vector", "QUANT_TILE", "FP8_MAX", "LOG2E",
           "SMOOTH_ROWS"]
