"""Block-sparse forward attention in Triton (FP8 e4m3 or bf16/fp16 tensor-core paths).

Contract (checked by :func:`block_sparse_attention_triton_impl`):
    q ``[B, H, Lq, D]``, k/v ``[B, H, Lk, D]``: fp16 or bf16, same dtype and device, unit stride on
    D (other strides free: transposed ``[B, L, H, D]`` views work), D in {64, 128}.
    block_map: bool ``[B or 1, H or 1, ceil(Lq/bs), ceil(Lk/bs)]``; query block ``i`` attends to key
    blocks ``j`` with ``block_map[..., i, j]``. bs must be a power of two in [16, 256]. Partial last
    blocks are handled: keys past ``Lk`` get logit -inf, query rows past ``Lq`` are never stored.
    A row that keeps no block yields zeros (the public API rejects such maps before calling here).
    Returns ``[B, H, Lq, D]`` in q's dtype.

How it runs:
1. ``_compress_map_kernel`` turns the bool map into FlexAttention-style ``kv_num [Bm, Hm, Qb]`` and
   ascending ``kv_idx [Bm, Hm, Qb, Kb]`` lists on the device (no host sync), so masked blocks are never
   loaded. Broadcast map dims (size 1) stay broadcast (stride 0).
2. Query blocks are visited longest-row-first within each (b, h) (LPT order from a device argsort of
   ``kv_num``); all q blocks of one head run together so its K/V stay in L2. Config ``persistent``
   (off by default; a benchmark lever): a fixed grid of ``persistent_ctas`` programs per SM walks the
   tiles in that same order instead of one program per tile.
3. FP8 path: the fused pre-pass of :mod:`._quant` (K smoothing, per-128-token Q/K scales, per-channel
   V scale, token axis padded to a multiple of 128, V stored transposed for the FP8 wgmma). Per tile:
   ``S = (Q8 @ K8^T) * (sq * sk)`` in fp32 (log2 units, softmax scale folded into sq), online softmax
   with ``exp2``; ``P`` is computed as ``exp2(S - m + 8)``, i.e. scaled by 2^8 so that its row maximum
   is 256 (<= 448, the e4m3 limit, with margin for rounding) and small probabilities keep 2^8 more
   range before e4m3 underflow; the same factor is in the fp32 row sum ``l`` so it cancels in
   ``acc / l``. ``P`` is cast to e4m3 for ``P @ V8`` (fp32 accumulation); the epilogue multiplies by
   the per-channel V scale.
4. bf16 path: the same loop on the input tensors (no copy), ``S = Q @ K^T * scale * log2(e)``.
5. Prefix bias (``HAS_BIAS``, a compile-time switch: without a bias the kernel is unchanged): the
   bias in log2 units is added to the scaled ``S`` of keys ``< prefix_len`` before the row maximum,
   so the FP8 ``P`` keeps its 2^8 headroom; K smoothing is still exact (it shifts each row by a
   constant, the bias does not depend on the query).
6. Pooled tail (``HAS_TAIL``, a compile-time switch; ``pooled_tail=True``): every key block a row's map
   skips enters its softmax as one term, the block's mean key with weight ``w_j`` = log of its key count
   (plus the key biases' log-sum-exp) and its mean value (semantics: :func:`chorus.kernels.block_sparse_attention`).
   The pooled keys are extra key blocks: FP8, the pre-pass writes each block's mean of smoothed K / of V
   (quantised like the keys, one K scale per 128 pooled keys) as rows after ``Lpad_k`` of its copies
   (:func:`._quant.quantize_qkv_fp8`, ``pool_block``), from sums taken while it has K and V in registers;
   16-bit, :func:`._quant.pooled_kv_16bit` writes them (one extra read of K and V). The block lists
   (:func:`lpt_block_lists` with ``tail``) append to each row the pooled tiles (128 pooled keys each) that
   hold a block it skips, and a bias table ``[Bm, Hm, Qb, ceil(Kb / 128) * 128]`` (fp32, log2 units) holds
   each pooled key's ``w_j * log2(e)`` where the row skips block ``j``, ``-inf`` where it keeps it or past
   the last block -- built by the same device kernel from the map, no host sync. The kernel walks the
   listed pooled tiles after the kept blocks (the row maximum is then finite) with the table's row added
   to the scaled logits, the rest of the loop unchanged; the LPT order counts them. Each row scores the
   pooled keys with its own ``q_i`` (ComfyUI's sol_attn scores them with the query block's mean query).
7. INT8 path (``int8=True``, block size 128; backend ``triton_int8``, the accurate one): the pre-pass of
   :mod:`._quant_int8` (Q and K times a Hadamard matrix, Q int8 per row, K int8 per 128 keys, V int8 per
   channel, V's int32 channel sums per 128 keys). Per tile ``S = (Q8 @ K8^T) * sq_row * sk`` from an int32
   dot; ``P`` relative to the tile's own row maximum as uint8 levels ``round(255 * 2^(S - m_tile))``, fed
   to the signed int8 dot as ``levels - 128`` and corrected by ``128 *`` the tile's V sums (exact in int32);
   the tile's ``P @ V`` and level sum enter ``acc`` and ``l`` weighted by ``2^(m_tile - m)`` in fp32. The
   pooled values carry their own per-channel scale (``pool_ratio`` = it over V's, applied to their tiles).
   Error against exact attention ~0.016 on Gaussian q/k/v at a full map, against the FP8 path's ~0.055.
   The int32 results become fp32 by an integer add of 1.5 * 2^23's bits and a float subtract, and P's int8
   operand is the low byte of one FFMA's result near 1.5 * 2^23 (no conversion instructions in the loop).
The last key block (when partial) is processed after the unmasked main loop with a key mask.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ._quant import (LOG2E, QUANT_TILE, interpreter_upcast, padded_len, pooled_kv_16bit, quantize_q_tile,
                     quantize_qkv_fp8, round_e4m3, source_rows, tail_rows)
from ._quant_int8 import quantize_qkv_int8

P_SHIFT_LOG2 = 8.0  # P is scaled by 2**8 before the e4m3 cast (see module docstring)

@dataclasses.dataclass(frozen=True)
class TileConfig:
    """How the portable kernel is tiled and launched (``config=``; :data:`DEFAULT_TILES` per path).

    ``block_m`` / ``block_n``: query rows / keys per tile (each capped at the block size); ``num_warps``,
    ``num_stages``: Triton's; ``use_tma``: host TMA descriptors where Triton has them (pointer loads
    otherwise). Options the defaults leave off, for the benchmark and the tests: ``q_in_kernel`` (FP8: Q
    quantised per tile inside the kernel instead of by the pre-pass), ``persistent`` (a fixed grid of
    ``persistent_ctas`` programs per SM walking the LPT-ordered tiles; the peers table's persistent row)
    and ``maxnreg`` (a register cap per thread, 0 = none)."""

    block_m: int
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    use_tma: bool = True
    q_in_kernel: bool = False
    persistent: bool = False
    persistent_ctas: int = 2
    maxnreg: int = 0

    def name(self) -> str:
        """A short label (``BM64-BN128-w4-s3-tma``, ``-r168`` with a register cap)."""
        label = (f"BM{self.block_m}-BN{self.block_n}-w{self.num_warps}-s{self.num_stages}-"
                 f"{'tma' if self.use_tma else 'ptr'}")
        return label + (f"-r{self.maxnreg}" if self.maxnreg else "")


DEFAULT_TILES = {
    # 64-row tiles with one warpgroup: 2+ CTAs per SM overlap one CTA's softmax with another's MMAs
    # (measured best on the H200 at 32 760 and 75 600 tokens, full and sparse maps; see BENCHMARK_LOG.md)
    "fp8": TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=True),
    "bf16": TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=2, use_tma=True),
    # the INT8 path: the FP8 path's tiling (64-row tiles, one warpgroup); BLOCK_N must be 128
    "int8": TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=True),
}

_TMA_AVAILABLE = None


def tma_available() -> bool:
    """Whether host-side TMA tensor descriptors can be imported (Triton >= 3.4)."""
    global _TMA_AVAILABLE
    if _TMA_AVAILABLE is None:
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
            _TMA_AVAILABLE = True
        except Exception:  # noqa: BLE001
            _TMA_AVAILABLE = False
    return _TMA_AVAILABLE


@triton.jit
def pooled_log2_weight(blocks, Lk, BS, prefix_len, prefix_bias, suffix_start, suffix_bias):
    """The pooled tail's weight of key blocks ``blocks`` in log2 units: ``log2(sum over the block's real keys
    t of exp(bias_t))`` with ``prefix_bias`` on keys ``< prefix_len`` and ``suffix_bias`` on keys ``>=
    suffix_start`` (natural-log units; both on the keys of both), from the four key counts; ``-inf`` for
    blocks past the last."""
    lo = blocks * BS
    hi = lo + tl.minimum(tl.maximum(Lk - lo, 0), BS)
    pre_end = tl.minimum(hi, prefix_len)
    suf_start = tl.maximum(lo, suffix_start)
    n_pre = tl.maximum(pre_end - lo, 0).to(tl.float32)
    n_suf = tl.maximum(hi - suf_start, 0).to(tl.float32)
    n_both = tl.maximum(pre_end - suf_start, 0).to(tl.float32)
    n_none = (hi - lo).to(tl.float32) - n_pre - n_suf + n_both
    total = (n_none + (n_pre - n_both) * tl.exp(prefix_bias) + (n_suf - n_both) * tl.exp(suffix_bias)
             + n_both * tl.exp(prefix_bias + suffix_bias))
    return tl.where(total > 0, tl.math.log2(tl.maximum(total, 1e-30)), float("-inf"))


@triton.jit
def _compress_map_kernel(block_map, kv_num, kv_idx, Kb, row_width, tail_num, tail_bias, tail_tiles, pool_first,
                         Lk, BS, prefix_len, prefix_bias, suffix_start, suffix_bias,
                         CHUNK: tl.constexpr, TAIL: tl.constexpr, TAIL_TILE: tl.constexpr):
    """One program per map row: kv_idx[row, :n] = ascending kept block ids, kv_num[row] = n (rows
    ``row_width`` apart). TAIL (the pooled tail): then ``kv_idx[row, n:n + m]`` = ``pool_first + p`` for the
    ``m`` = tail_num[row] tiles ``p`` of ``TAIL_TILE`` key blocks that hold a block the row skips, and the
    row's bias table ``tail_bias[row, :tail_tiles * TAIL_TILE]`` (fp32, log2 units) = the block's
    :func:`pooled_log2_weight` where the row skips it, ``-inf`` where it keeps it and past the last block."""
    row = tl.program_id(0)
    count = 0
    for start in range(0, Kb, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        keep = tl.load(block_map + row * Kb + cols, mask=cols < Kb, other=0) != 0
        pos = count + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(kv_idx + row * row_width + pos, cols, mask=keep)
        count += tl.sum(keep.to(tl.int32), axis=0)
    tl.store(kv_num + row, count)
    if TAIL:
        n_tail = 0
        for p in range(0, tail_tiles):
            cols = p * TAIL_TILE + tl.arange(0, TAIL_TILE)
            skipped = (tl.load(block_map + row * Kb + cols, mask=cols < Kb, other=1) == 0) & (cols < Kb)
            weight = pooled_log2_weight(cols, Lk, BS, prefix_len, prefix_bias, suffix_start, suffix_bias)
            tl.store(tail_bias + row * tail_tiles * TAIL_TILE + cols, tl.where(skipped, weight, float("-inf")))
            listed = tl.max(skipped.to(tl.int32), axis=0)
            tl.store(kv_idx + row * row_width + count + n_tail, pool_first + p, mask=listed > 0)
            n_tail += listed
        tl.store(tail_num + row, n_tail)


ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: a float in [2^23, 2^24) has unit spacing


@triton.jit
def int_as_float(x):
    """int32 ``x`` with ``|x| < 2^22`` as fp32, exactly: an integer add of the bits of 1.5 * 2^23 and a float
    subtract (two full-rate ALU ops instead of the quarter-rate I2F conversion)."""
    return (x + 0x4B400000).to(tl.float32, bitcast=True) - ROUND_MAGIC


@triton.jit
def _attn_tiles(acc, l_i, m_i, q, sq, qk_scale, K, V, k_scale_row, idx_row, b, h, it_lo, it_hi, Lk,
                prefix_len, prefix_bias, suffix_start, suffix_bias, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, KV_SUB: tl.constexpr,
                FP8: tl.constexpr, USE_TMA: tl.constexpr, MASK_KEYS: tl.constexpr, MASK_LOADS: tl.constexpr,
                P_SHIFT: tl.constexpr, SCALE_TILE: tl.constexpr, INTERPRET: tl.constexpr, HAS_BIAS: tl.constexpr,
                bias_row=None, pool_row0=0, POOLED: tl.constexpr = False, INT8: tl.constexpr = False,
                vsum_row=None, pool_ratio=None):
    # POOLED: the listed entries are pooled tiles p of BS (= TAIL_TILE) pooled keys, at rows pool_row0 + p * BS of
    # K / V; each key's logit term (log2 units, -inf where the row keeps its block) is bias_row[p * BS + n].
    # INT8 (BLOCK_N = BS = 128): sq is the tile's per-row Q scales, vsum_row the int32 channel sums of each 128
    # rows of V^T, pool_ratio (POOLED) the pooled values' per-channel scale over V's
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for it in tl.range(it_lo, it_hi):
        kb = tl.load(idx_row + it // KV_SUB)
        start_n = kb * BS + (it % KV_SUB) * BLOCK_N
        if POOLED:
            pooled_bias = tl.load(bias_row + start_n + offs_n0)
            start_n += pool_row0
        offs_n = start_n + offs_n0
        if USE_TMA:
            k = K.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            k_ptrs = K + b * s_kb + h * s_kh + offs_n[:, None] * s_kl + offs_d[None, :]
            if MASK_LOADS:
                k = tl.load(k_ptrs, mask=(offs_n < Lk)[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs)
        if INTERPRET:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            qk = tl.dot(q, tl.trans(k))
        if FP8:
            s = sq * tl.load(k_scale_row + start_n // SCALE_TILE)
        elif INT8:  # int32 products (the interpreter's: fp32, exact) times the row and key-tile scales
            if not INTERPRET:
                qk = int_as_float(qk)
            qk = qk * (sq[:, None] * tl.load(k_scale_row + start_n // SCALE_TILE))
            s = 1.0
        else:
            s = qk_scale
        if MASK_KEYS:
            qk = tl.where((offs_n < Lk)[None, :], qk, float("-inf"))
        if HAS_BIAS:  # prefix / suffix biases (log2 units): scale first, then the row's logits are final
            qk = qk * s + (tl.where(offs_n < prefix_len, prefix_bias, 0.0)
                           + tl.where(offs_n >= suffix_start, suffix_bias, 0.0))[None, :]
            s = 1.0
        if POOLED:  # the pooled keys' weights (and -inf for the blocks the row keeps)
            qk = qk * s + pooled_bias[None, :]
            s = 1.0
        if INT8:
            # P relative to this tile's own row maximum as uint8 levels (few binades inside one tile, so 8 bits
            # keep its small values), fed to the signed dot as levels - 128 and corrected by 128 x the tile's
            # V channel sums; the tile's sum enters O and the row sum weighted by 2^(m_tile - m)
            m_tile = tl.maximum(tl.max(qk, 1), -1.0e30)
            m_new = tl.maximum(m_i, m_tile)
            # one FFMA rounds 255 p - 128 to an integer (to nearest) in the low bits of a float near 1.5 * 2^23:
            # its low byte is the int8 operand, and the float minus the constant is the level
            rounded = tl.math.exp2(qk - m_tile[:, None]) * 255.0 + (ROUND_MAGIC - 128.0)
            levels = rounded - (ROUND_MAGIC - 128.0)
            alpha = tl.math.exp2(m_i - m_new)
            beta = tl.math.exp2(m_tile - m_new)
            l_i = l_i * alpha + tl.sum(levels, 1) * beta
            if USE_TMA:
                vt = V.load([b, h, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
            else:
                vt = tl.load(V + b * s_vb + h * s_vh + offs_d[:, None] * s_vl + offs_n[None, :])
            if INTERPRET:
                pv = tl.dot(levels - 128.0, tl.trans(vt.to(tl.float32)))
            else:
                pv = int_as_float(tl.dot(rounded.to(tl.int32, bitcast=True).to(tl.int8), tl.trans(vt)))
            vsum = tl.load(vsum_row + (start_n // SCALE_TILE) * HEAD_DIM + offs_d).to(tl.float32)
            tile_pv = (pv + 128.0 * vsum[None, :]) * beta[:, None]  # exact integers below 2^23 before beta
            if POOLED:
                tile_pv = tile_pv * pool_ratio[None, :]
            acc = acc * alpha[:, None] + tile_pv
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * s)
            if FP8:
                p = tl.math.exp2(qk * s - (m_new - P_SHIFT)[:, None])
            else:
                p = tl.math.exp2(qk * s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            l_i = l_i + tl.sum(p, 1)
            if FP8:
                if USE_TMA:
                    vt = V.load([b, h, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
                else:
                    vt = tl.load(V + b * s_vb + h * s_vh + offs_d[:, None] * s_vl + offs_n[None, :])
                if INTERPRET:
                    p = round_e4m3(p)  # the interpreter's fp32->e4m3 cast mis-rounds; pre-round exactly
                # two-level accumulation: the key block's P @ V in a fresh wgmma accumulator, added to acc in fp32
                # (an FP8 wgmma accumulates in fewer, truncated mantissa bits; chained across blocks, O shrank: ~2%
                # on attention-like inputs, up to 57% where V has a large common part;
                # tests/test_fp8_accumulation_gpu.py)
                acc = acc + tl.dot(p.to(vt.dtype), tl.trans(vt))
            else:
                if USE_TMA:
                    v = V.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
                else:
                    v_ptrs = V + b * s_vb + h * s_vh + offs_n[:, None] * s_vl + offs_d[None, :]
                    if MASK_LOADS:
                        v = tl.load(v_ptrs, mask=(offs_n < Lk)[:, None], other=0.0)
                    else:
                        v = tl.load(v_ptrs)
                if INTERPRET:
                    acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
                else:
                    acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _bsa_tile(pid, bh, Q, K, V, O, q_scale, k_scale, v_scale, kv_num, kv_idx, sched, token_perm,
              H, Lq, Lk, num_kv_blocks, n_q_scale, n_k_scale, qk_scale, q_mult, prefix_len, prefix_bias, suffix_start,
              suffix_bias,
              s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_ob, s_oh, s_ol,
              s_nb, s_nh, s_ib, s_ih, s_iq,
              Kp, Vp, tail_num, tail_bias, tail_width, pool_row0, s_pkb, s_pkh, s_pkl, s_pvb, s_pvh, s_pvl,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
              FP8: tl.constexpr, USE_TMA: tl.constexpr, TAIL_K: tl.constexpr, EVEN_Q: tl.constexpr,
              P_SHIFT: tl.constexpr, SCALE_TILE: tl.constexpr, INTERPRET: tl.constexpr, HAS_BIAS: tl.constexpr,
              Q_RAW: tl.constexpr, HAS_PERM: tl.constexpr, HAS_TAIL: tl.constexpr, POOL_TMA: tl.constexpr,
              POOL_TILE: tl.constexpr, v_sums, pool_ratio, n_v_tiles, INT8: tl.constexpr):
    """One query tile: row tile ``pid`` (in the LPT order of ``sched``) of (batch, head) ``bh``."""
    TPB: tl.constexpr = BS // BLOCK_M
    KV_SUB: tl.constexpr = BS // BLOCK_N
    # Loads need masks only on the bf16 pointer path (FP8 buffers are padded, TMA zero-fills).
    MASK_LOADS: tl.constexpr = (not (FP8 or INT8)) and (not USE_TMA)
    b = bh // H
    h = bh % H
    row_base = b * s_nb + h * s_nh
    qblk = tl.load(sched + row_base + pid // TPB)
    start_m = qblk * BS + (pid % TPB) * BLOCK_M
    n_kv = tl.load(kv_num + row_base + qblk)
    idx_row = kv_idx + b * s_ib + h * s_ih + qblk * s_iq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)

    # HAS_PERM: sequence position i is input row token_perm[i] (K/V copies are already in that order)
    src_m = source_rows(token_perm, offs_m, Lq, HAS_PERM)
    if Q_RAW:  # 16-bit Q in the caller's memory, quantised here (FP8 only): the pre-pass skips Q
        if USE_TMA and not HAS_PERM:
            q = Q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        else:
            q = tl.load(Q + b * s_qb + h * s_qh + src_m[:, None] * s_ql + offs_d[None, :],
                        mask=(offs_m < Lq)[:, None], other=0.0)
        q, sq = quantize_q_tile(q, q_mult, INTERPRET)
    else:
        if USE_TMA:
            q = Q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        else:
            q_ptrs = Q + b * s_qb + h * s_qh + offs_m[:, None] * s_ql + offs_d[None, :]
            if MASK_LOADS and not EVEN_Q:
                q = tl.load(q_ptrs, mask=(offs_m < Lq)[:, None], other=0.0)
            else:
                q = tl.load(q_ptrs)
        if FP8:
            sq = tl.load(q_scale + bh * n_q_scale + start_m // SCALE_TILE)
        elif INT8:  # one scale per query row
            sq = tl.load(q_scale + bh * n_q_scale + offs_m)
        else:
            sq = 1.0
    k_scale_row = k_scale + bh * n_k_scale
    vsum_row = v_sums + bh * n_v_tiles * HEAD_DIM

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile cannot make NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    n_main = n_kv
    if TAIL_K:
        last = tl.load(idx_row + tl.maximum(n_kv - 1, 0))
        n_main = n_kv - ((n_kv > 0) & (last == num_kv_blocks - 1)).to(tl.int32)
    acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, sq, qk_scale, K, V, k_scale_row, idx_row, b, h,
                                0, n_main * KV_SUB, Lk, prefix_len, prefix_bias, suffix_start, suffix_bias, s_kb,
                                s_kh, s_kl, s_vb, s_vh, s_vl,
                                HEAD_DIM, BLOCK_N, BS, KV_SUB, FP8, USE_TMA, False, False, P_SHIFT, SCALE_TILE,
                                INTERPRET, HAS_BIAS, INT8=INT8, vsum_row=vsum_row)
    if TAIL_K:
        it_last = n_kv * KV_SUB
        if KV_SUB > 1:  # the last block's sub-tiles that hold keys (past them: no K rows, no K scale to read)
            it_last = n_main * KV_SUB + (n_kv - n_main) * tl.cdiv(Lk - (num_kv_blocks - 1) * BS, BLOCK_N)
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, sq, qk_scale, K, V, k_scale_row, idx_row, b, h,
                                    n_main * KV_SUB, it_last, Lk, prefix_len, prefix_bias, suffix_start,
                                    suffix_bias,
                                    s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
                                    HEAD_DIM, BLOCK_N, BS, KV_SUB, FP8, USE_TMA, True, MASK_LOADS, P_SHIFT,
                                    SCALE_TILE, INTERPRET, HAS_BIAS, INT8=INT8, vsum_row=vsum_row)
    if HAS_TAIL:  # the pooled tiles listed after the kept blocks (their K / V rows: Kp / Vp from pool_row0 on)
        n_tail = tl.load(tail_num + row_base + qblk)
        bias_row = tail_bias + (row_base + qblk) * tail_width
        ratio = 1.0
        if INT8:
            ratio = tl.load(pool_ratio + bh * HEAD_DIM + offs_d)
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, sq, qk_scale, Kp, Vp, k_scale_row, idx_row + n_kv, b, h,
                                    0, n_tail * (POOL_TILE // BLOCK_N), Lk, prefix_len, prefix_bias, suffix_start,
                                    suffix_bias, s_pkb, s_pkh, s_pkl, s_pvb, s_pvh, s_pvl,
                                    HEAD_DIM, BLOCK_N, POOL_TILE, POOL_TILE // BLOCK_N, FP8, POOL_TMA, False,
                                    False, P_SHIFT, SCALE_TILE, INTERPRET, False, bias_row, pool_row0,
                                    True, INT8, vsum_row, ratio)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if FP8 or INT8:
        out = out * tl.load(v_scale + bh * HEAD_DIM + offs_d)[None, :]
    o_ptrs = O + b * s_ob + h * s_oh + src_m[:, None] * s_ol + offs_d[None, :]  # HAS_PERM: back to input order
    if EVEN_Q and not HAS_PERM:
        tl.store(o_ptrs, out.to(O.dtype.element_ty))
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(offs_m < Lq)[:, None])


@triton.jit
def _bsa_fwd_kernel(Q, K, V, O, q_scale, k_scale, v_scale, kv_num, kv_idx, sched, token_perm,
                    H, Lq, Lk, num_kv_blocks, n_q_scale, n_k_scale, qk_scale, q_mult, prefix_len, prefix_bias,
                    suffix_start, suffix_bias,
                    s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_ob, s_oh, s_ol,
                    s_nb, s_nh, s_ib, s_ih, s_iq, tiles_per_bh, num_tiles,
                    Kp, Vp, tail_num, tail_bias, tail_width, pool_row0, s_pkb, s_pkh, s_pkl, s_pvb, s_pvh, s_pvl,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                    FP8: tl.constexpr, USE_TMA: tl.constexpr, TAIL_K: tl.constexpr, EVEN_Q: tl.constexpr,
                    P_SHIFT: tl.constexpr, SCALE_TILE: tl.constexpr, INTERPRET: tl.constexpr, HAS_BIAS: tl.constexpr,
                    Q_RAW: tl.constexpr, HAS_PERM: tl.constexpr, PERSISTENT: tl.constexpr,
                    HAS_TAIL: tl.constexpr = False, POOL_TMA: tl.constexpr = False, POOL_TILE: tl.constexpr = 128,
                    v_sums=None, pool_ratio=None, n_v_tiles=0, INT8: tl.constexpr = False):
    # PERSISTENT: a fixed grid of programs walks the tiles in (batch, head)-major, LPT-within-head
    # order, so the tiles in flight at any time share a head's K/V in L2; else one program per tile.
    if PERSISTENT:
        for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            _bsa_tile(tile % tiles_per_bh, tile // tiles_per_bh, Q, K, V, O, q_scale, k_scale, v_scale, kv_num,
                      kv_idx, sched, token_perm, H, Lq, Lk, num_kv_blocks, n_q_scale, n_k_scale, qk_scale, q_mult,
                      prefix_len, prefix_bias, suffix_start, suffix_bias, s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb,
                      s_vh, s_vl, s_ob, s_oh,
                      s_ol, s_nb, s_nh, s_ib, s_ih, s_iq, Kp, Vp, tail_num, tail_bias, tail_width, pool_row0, s_pkb,
                      s_pkh, s_pkl, s_pvb, s_pvh, s_pvl, HEAD_DIM, BLOCK_M, BLOCK_N, BS, FP8, USE_TMA, TAIL_K,
                      EVEN_Q, P_SHIFT, SCALE_TILE, INTERPRET, HAS_BIAS, Q_RAW, HAS_PERM, HAS_TAIL,
                      POOL_TMA, POOL_TILE, v_sums, pool_ratio, n_v_tiles, INT8)
    else:
        _bsa_tile(tl.program_id(0), tl.program_id(1), Q, K, V, O, q_scale, k_scale, v_scale, kv_num, kv_idx,
                  sched, token_perm, H, Lq, Lk, num_kv_blocks, n_q_scale, n_k_scale, qk_scale, q_mult, prefix_len,
                  prefix_bias, suffix_start, suffix_bias, s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_ob,
                  s_oh, s_ol, s_nb, s_nh,
                  s_ib, s_ih, s_iq, Kp, Vp, tail_num, tail_bias, tail_width, pool_row0, s_pkb, s_pkh, s_pkl, s_pvb,
                  s_pvh, s_pvl, HEAD_DIM, BLOCK_M, BLOCK_N, BS, FP8, USE_TMA, TAIL_K, EVEN_Q, P_SHIFT,
                  SCALE_TILE, INTERPRET, HAS_BIAS, Q_RAW, HAS_PERM, HAS_TAIL, POOL_TMA, POOL_TILE, v_sums, pool_ratio,
                  n_v_tiles, INT8)


def output_like(q: torch.Tensor) -> torch.Tensor:
    """An empty ``[B, H, L, D]`` output for ``q``: in ``[B, L, H, D]`` memory (a head-transposed view)
    when q itself is such a view -- the layout ComfyUI and diffusers pass (``[B, L, H * D]`` viewed as
    ``[B, H, L, D]``) -- so the host's ``out.transpose(1, 2).reshape(B, L, H * D)`` is a free view, not
    a copy; else contiguous ``[B, H, L, D]``."""
    batch, heads, length, head_dim = q.shape
    if heads > 1 and length > 1 and q.stride(3) == 1 and q.stride(1) == head_dim and q.stride(2) == heads * head_dim:
        return torch.empty(batch, length, heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


TAIL_TILE = 128  # pooled keys per tile of the pooled tail (the kernels' key-block size)


@dataclasses.dataclass(frozen=True)
class TailLists:
    """The pooled tail's share of the block lists (:func:`lpt_block_lists`): ``tail_num`` int32 ``[Bm, Hm,
    Qb]`` = pooled tiles listed after the row's kept blocks, ``bias`` fp32 ``[Bm, Hm, Qb, tiles * 128]`` =
    each pooled key's logit term in log2 units (``-inf`` where the row keeps the block or past the last
    one), ``tiles`` = ``ceil(Kb / 128)``."""

    tail_num: torch.Tensor
    bias: torch.Tensor
    tiles: int


def tail_tiles(num_kv_blocks: int) -> int:
    """Tiles of ``TAIL_TILE`` pooled keys the pooled tail adds for ``num_kv_blocks`` key blocks."""
    return -(-num_kv_blocks // TAIL_TILE)


def compress_block_map(block_map: torch.Tensor, tail: dict | None = None):
    """bool ``[Bm, Hm, Qb, Kb]`` -> ``(kv_num int32 [Bm, Hm, Qb], kv_idx int32 [Bm, Hm, Qb, Kb])`` on the
    map's device; ``kv_idx[..., :kv_num]`` lists the kept key blocks in ascending order (the rest of
    each row is unspecified). ``tail`` (the pooled tail; keys ``pool_first``, ``kv_len``, ``block_size``,
    ``prefix_len``, ``prefix_bias``, ``suffix_start``, ``suffix_bias``, biases in natural-log units):
    ``kv_idx`` is ``Kb + ceil(Kb / 128)`` wide, each row lists after its kept blocks ``pool_first + p``
    for the pooled tiles ``p`` it needs, and a :class:`TailLists` comes third."""
    bm = block_map.contiguous()
    rows = bm.shape[0] * bm.shape[1] * bm.shape[2]
    kb = bm.shape[3]
    tiles = tail_tiles(kb) if tail else 0
    kv_num = torch.empty(bm.shape[:3], dtype=torch.int32, device=bm.device)
    # entries past kv_num (+ tail_num) are never read
    kv_idx = torch.empty(*bm.shape[:3], kb + tiles, dtype=torch.int32, device=bm.device)
    chunk = min(1024, triton.next_power_of_2(kb))
    if tail:
        tail_num = torch.empty_like(kv_num)
        bias = torch.empty(*bm.shape[:3], tiles * TAIL_TILE, dtype=torch.float32, device=bm.device)
        _compress_map_kernel[(rows,)](
            bm.view(torch.uint8), kv_num, kv_idx, kb, kb + tiles, tail_num, bias, tiles, int(tail["pool_first"]),
            int(tail["kv_len"]), int(tail["block_size"]), int(tail["prefix_len"]), float(tail["prefix_bias"]),
            int(tail["suffix_start"]), float(tail["suffix_bias"]), CHUNK=chunk, TAIL=True, TAIL_TILE=TAIL_TILE,
            num_warps=4)
        return kv_num, kv_idx, TailLists(tail_num, bias, tiles)
    _compress_map_kernel[(rows,)](bm.view(torch.uint8), kv_num, kv_idx, kb, kb, kv_num, kv_num, 0, 0, 0, 0, 0, 0.0,
                                  0, 0.0, CHUNK=chunk, TAIL=False, TAIL_TILE=TAIL_TILE, num_warps=4)
    return kv_num, kv_idx


def lpt_block_lists(block_map: torch.Tensor, tail: dict | None = None):
    """What the attention kernels walk: ``(kv_num, kv_idx, sched, strides)`` -- the block lists of
    :func:`compress_block_map`, ``sched`` int32 ``[Bm, Hm, Qb]`` = query blocks longest row first (a
    stable device argsort of ``kv_num``, plus ``tail_num`` with the tail: pooled tiles cost what key
    blocks cost), and the element strides ``(s_nb, s_nh, s_ib, s_ih, s_iq)`` of ``kv_num`` / ``sched`` and
    ``kv_idx``, 0 on broadcast (size-1) map dims. With ``tail`` (see :func:`compress_block_map`) a fifth
    item, the :class:`TailLists`; ``(b * s_nb + h * s_nh + q_block)`` is also the row of its bias table."""
    lists = compress_block_map(block_map, tail)
    kv_num, kv_idx = lists[:2]
    cost = kv_num if tail is None else kv_num + lists[2].tail_num
    sched = torch.argsort(cost, dim=-1, descending=True, stable=True).to(torch.int32)
    bm_b, bm_h, num_q_blocks, _ = block_map.shape
    width = kv_idx.shape[-1]
    strides = (bm_h * num_q_blocks if bm_b > 1 else 0, num_q_blocks if bm_h > 1 else 0,
               bm_h * num_q_blocks * width if bm_b > 1 else 0, num_q_blocks * width if bm_h > 1 else 0, width)
    return (kv_num, kv_idx, sched, strides) if tail is None else (kv_num, kv_idx, sched, strides, lists[2])


def portable_block_size(block_size) -> bool:
    """Whether the portable kernels (``triton_fp8``, ``triton_bf16``, the block mass) run blocks of this size: an int,
    a power of two in [16, 256]."""
    return isinstance(block_size, int) and 16 <= block_size <= 256 and block_size & (block_size - 1) == 0


def _validate(q, k, v, block_map, block_size):
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v, block_map)):
        raise ValueError("q, k, v and block_map must be torch tensors")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, L, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"triton kernels need fp16/bf16 q, k, v of one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on one device")
    batch, heads, q_len, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[1] != heads or k.shape[3] != head_dim:
        raise ValueError(f"k/v shape {tuple(k.shape)}/{tuple(v.shape)} does not match q {tuple(q.shape)}")
    if head_dim not in (64, 128):
        raise ValueError(f"triton kernels support head dims 64 and 128, got {head_dim}")
    if q_len < 1 or k.shape[2] < 1:
        raise ValueError("empty sequence")
    if not portable_block_size(block_size):
        raise ValueError(f"triton kernels need a power-of-two block_size in [16, 256], got {block_size!r}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v need unit stride on the head dim")
    qb, kb = -(-q_len // block_size), -(-k.shape[2] // block_size)
    if block_map.dtype != torch.bool or block_map.dim() != 4:
        raise ValueError(f"block_map must be a 4-D bool tensor, got {block_map.dtype} {tuple(block_map.shape)}")
    bm_b, bm_h = block_map.shape[:2]
    if bm_b not in (1, batch) or bm_h not in (1, heads) or tuple(block_map.shape[2:]) != (qb, kb):
        raise ValueError(f"block_map shape {tuple(block_map.shape)} does not fit [B|1, H|1, {qb}, {kb}] "
                         f"for Lq={q_len}, Lk={k.shape[2]}, block_size={block_size}")
    if block_map.device != q.device:
        raise ValueError(f"block_map is on {block_map.device}, q on {q.device}")


def check_perm(token_perm, q, k):
    """``token_perm`` as int32 ``[L]`` on q's device (None stays None); ``ValueError`` unless it is a
    1-D integer tensor of length ``Lq == Lk``. Its values are not read here (no host sync): the kernels
    clamp them into ``[0, L)``, so a tensor that is not a permutation gives wrong output, never an
    out-of-bounds access."""
    if token_perm is None:
        return None
    if not isinstance(token_perm, torch.Tensor) or token_perm.dim() != 1 or token_perm.dtype not in (torch.int32,
    torch.int64):
        raise ValueError("token_perm must be a 1-D int32/int64 tensor")
    if q.shape[2] != k.shape[2] or token_perm.shape[0] != q.shape[2]:
        raise ValueError(f"token_perm of length {token_perm.shape[0]} needs Lq == Lk == it; got Lq={q.shape[2]}, "
                         f"Lk={k.shape[2]}")
    return token_perm.to(device=q.device, dtype=torch.int32).contiguous()


def tail_spec(kv_len: int, block_size: int, pool_first: int, prefix_len: int, prefix_bias: float,
              suffix_start: int, suffix_bias: float) -> dict:
    """The pooled tail's arguments of :func:`lpt_block_lists` (biases in natural-log units; a zero bias or
    length is no bias; ``suffix_start`` = ``kv_len`` when there is no suffix bias)."""
    prefix_on = prefix_len > 0 and prefix_bias != 0.0
    return dict(pool_first=pool_first, kv_len=kv_len, block_size=block_size, prefix_len=prefix_len if prefix_on else 0,
                prefix_bias=prefix_bias if prefix_on else 0.0, suffix_start=suffix_start,
                suffix_bias=suffix_bias if suffix_start < kv_len else 0.0)


def prepare_attention(q, k, v, block_map, block_size: int, scale: float, fp8: bool, config: TileConfig | None = None,
                      prefix_len: int = 0, prefix_bias: float = 0.0, token_perm: torch.Tensor | None = None,
                      suffix_len: int = 0, suffix_bias: float = 0.0, pooled_tail: bool = False, int8: bool = False):
    """Validate, build the block index and (FP8) quantise; returns the launch arguments as a dict.
    Split from :func:`launch_attention` so the benchmark can time the stages separately.
    ``prefix_bias`` (natural-log units) is added to the scaled logits of keys ``[0, prefix_len)``
    (positions of the permuted order when ``token_perm`` is given: see
    :func:`block_sparse_attention_triton_impl`), ``suffix_bias`` to those of keys ``[Lk - suffix_len, Lk)``.
    ``pooled_tail``: the pooled keys and values (FP8: rows of the pre-pass's copies after ``Lpad_k``; 16-bit:
    their own buffers) and the tail's block lists and bias table. ``int8`` (with ``fp8=False``): the accurate
    path's numerics (:mod:`._quant_int8`; block size 128 only)."""
    _validate(q, k, v, block_map, block_size)
    if int8 and (fp8 or block_size != 128):
        raise ValueError(f"the INT8 path runs 128-token blocks without fp8; got block_size={block_size}, fp8={fp8}")
    token_perm = check_perm(token_perm, q, k)
    suffix_start = check_key_biases(prefix_len, prefix_bias, suffix_len, suffix_bias, k.shape[2])
    has_bias = (prefix_len > 0 and prefix_bias != 0.0) or suffix_start < k.shape[2]
    if config is None:
        config = DEFAULT_TILES["int8" if int8 else "fp8" if fp8 else "bf16"]
    elif not isinstance(config, TileConfig):
        raise ValueError(f"config must be a TileConfig, got {type(config).__name__}")
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    block_m = min(block_size, config.block_m)
    block_n = min(block_size, config.block_n)
    use_tma = config.use_tma and tma_available() and not interpreter_upcast(q)
    num_q_blocks, num_kv_blocks = block_map.shape[2], block_map.shape[3]

    tail = None
    if pooled_tail:
        tail = tail_spec(kv_len, block_size, 0, prefix_len, prefix_bias, suffix_start, suffix_bias)
        kv_num, kv_idx, sched, map_strides, tail = lpt_block_lists(block_map, tail)
    else:
        kv_num, kv_idx, sched, map_strides = lpt_block_lists(block_map)
    q_raw = fp8 and config.q_in_kernel
    v_sums = pool_ratio = kv_num  # (INT8 only; placeholders never read otherwise)
    if int8:
        if block_n != 128:
            raise ValueError(f"the INT8 path needs 128-key tiles, got block_n={block_n}")
        q_in, k_in, v_in, q_scale, k_scale, v_scale, v_sums, ratio = quantize_qkv_int8(
            q, k, v, scale, token_perm=token_perm, pool_block=block_size if pooled_tail else None)
        n_q_scale, n_k_scale = q_scale.shape[-1], k_scale.shape[-1]
        qk_scale = 1.0
        k_pool, v_pool, pool_row0 = k_in, v_in, padded_len(kv_len)
        if pooled_tail:
            pool_ratio = ratio
    elif fp8:
        q_in, k_in, v_in, q_scale, k_scale, v_scale = quantize_qkv_fp8(
            q, k, v, scale, quantize_q=not q_raw, token_perm=token_perm, pool_block=block_size if pooled_tail else None)
        if q_raw:
            q_in, q_scale = q, k_scale  # Q quantised by the attention kernel (q_scale unused)
        n_q_scale, n_k_scale = (0 if q_raw else q_scale.shape[-1]), k_scale.shape[-1]
        qk_scale = 1.0
        k_pool, v_pool, pool_row0 = k_in, v_in, padded_len(kv_len)  # the pooled rows follow the padded keys
    else:
        q_in, k_in, v_in = q, k, v
        if token_perm is not None:  # the 16-bit path has no pre-pass to fuse the reorder into: one gather each
            idx = token_perm.long()
            q_in, k_in, v_in = (t.index_select(2, idx) for t in (q, k, v))
        q_scale = k_scale = v_scale = kv_num  # unused placeholders
        n_q_scale = n_k_scale = 0
        qk_scale = float(scale * LOG2E)
        k_pool, v_pool = pooled_kv_16bit(k_in, v_in, block_size) if pooled_tail else (k_in, v_in)
        pool_row0 = 0
    # TMA needs 16-byte aligned base addresses and strides; odd views fall back to pointer loads
    use_tma = use_tma and all(t.data_ptr() % 16 == 0 and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1])
                              for t in (q_in, k_in, v_in))
    return dict(q=q, q_in=q_in, k_in=k_in, v_in=v_in, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                kv_num=kv_num, kv_idx=kv_idx, sched=sched, map_strides=map_strides, fp8=bool(fp8),
                block_size=block_size, block_m=block_m, block_n=block_n, use_tma=use_tma, kv_len=kv_len,
                num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks, n_q_scale=n_q_scale,
                n_k_scale=n_k_scale, qk_scale=qk_scale, config=config, has_bias=has_bias, q_raw=q_raw,
                q_mult=float(scale * LOG2E), token_perm=token_perm,
                prefix_len=int(prefix_len) if has_bias else 0,
                prefix_bias_log2=float(prefix_bias) * LOG2E if has_bias else 0.0, suffix_start=suffix_start,
                suffix_bias_log2=float(suffix_bias) * LOG2E if suffix_start < kv_len else 0.0,
                tail=tail, k_pool=k_pool, v_pool=v_pool, pool_row0=pool_row0, int8=bool(int8), v_sums=v_sums,
                pool_ratio=pool_ratio, n_v_tiles=v_sums.shape[2] if int8 else 0)


def launch_attention(prep: dict) -> torch.Tensor:
    """Run the attention kernel on prepared arguments (:func:`prepare_attention`)."""
    q, q_in, k_in, v_in = prep["q"], prep["q_in"], prep["k_in"], prep["v_in"]
    batch, heads, q_len, head_dim = q.shape
    block_m, block_n, fp8, config = prep["block_m"], prep["block_n"], prep["fp8"], prep["config"]
    int8 = prep["int8"]
    quantized = fp8 or int8  # padded 8-bit copies, V stored transposed
    block_size = prep["block_size"]
    out = output_like(q)
    strides = (q_in.stride(0), q_in.stride(1), q_in.stride(2), k_in.stride(0), k_in.stride(1), k_in.stride(2),
               v_in.stride(0), v_in.stride(1), v_in.stride(2))
    if prep["use_tma"]:
        from triton.tools.tensor_descriptor import TensorDescriptor

        q_pointer = prep["q_raw"] and prep["token_perm"] is not None
        q_arg = q_in if q_pointer else TensorDescriptor.from_tensor(q_in, [1, 1, block_m, head_dim])
        k_arg = TensorDescriptor.from_tensor(k_in, [1, 1, block_n, head_dim])
        v_block = [1, 1, head_dim, block_n] if quantized else [1, 1, block_n, head_dim]
        v_arg = TensorDescriptor.from_tensor(v_in, v_block)
    else:
        q_arg, k_arg, v_arg = q_in, k_in, v_in
    tiles_per_bh = prep["num_q_blocks"] * (block_size // block_m)
    num_tiles = tiles_per_bh * batch * heads
    persistent = config.persistent
    if persistent:  # programs per SM from the config (2: what the 64-row tiles overlap at)
        sms = 2 if interpreter_upcast(q) else torch.cuda.get_device_properties(q.device).multi_processor_count
        grid = (min(num_tiles, sms * config.persistent_ctas), 1)
    else:
        grid = (tiles_per_bh, batch * heads)
    # optional register cap (e.g. 168 lets three 128-thread CTAs share an SM's 64K registers)
    extra = {"maxnreg": config.maxnreg} if config.maxnreg and not interpreter_upcast(q) else {}
    tail = prep["tail"]
    if tail is None:  # (placeholders: never read)
        pool_args = (k_arg, v_arg, prep["kv_num"], prep["k_scale"], 0, 0) + strides[3:]
    elif quantized:  # the pooled rows of the pre-pass's copies: the same tensors (descriptors)
        pool_args = (k_arg, v_arg, tail.tail_num, tail.bias, tail.bias.shape[-1], prep["pool_row0"]) + strides[3:]
    else:
        k_pool, v_pool = prep["k_pool"], prep["v_pool"]
        pool_args = (k_pool, v_pool, tail.tail_num, tail.bias, tail.bias.shape[-1], 0, *k_pool.stride()[:3],
                     *v_pool.stride()[:3])
    _bsa_fwd_kernel[grid](
        q_arg, k_arg, v_arg, out, prep["q_scale"], prep["k_scale"], prep["v_scale"], prep["kv_num"],
        prep["kv_idx"], prep["sched"], prep["kv_num"] if prep["token_perm"] is None else prep["token_perm"],
        heads, q_len, prep["kv_len"], prep["num_kv_blocks"], prep["n_q_scale"],
        prep["n_k_scale"], prep["qk_scale"], prep["q_mult"], prep["prefix_len"], prep["prefix_bias_log2"],
        prep["suffix_start"], prep["suffix_bias_log2"], *strides,
        out.stride(0), out.stride(1), out.stride(2),
        *prep["map_strides"], tiles_per_bh, num_tiles, *pool_args,
        HAS_TAIL=tail is not None, POOL_TMA=tail is not None and quantized and prep["use_tma"], POOL_TILE=TAIL_TILE,
        v_sums=prep["v_sums"], pool_ratio=prep["pool_ratio"], n_v_tiles=prep["n_v_tiles"], INT8=int8,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BS=block_size, FP8=fp8, USE_TMA=prep["use_tma"],
        TAIL_K=prep["kv_len"] % block_size != 0, EVEN_Q=q_len % block_m == 0, P_SHIFT=P_SHIFT_LOG2,
        SCALE_TILE=QUANT_TILE, INTERPRET=interpreter_upcast(q), HAS_BIAS=prep["has_bias"],
        Q_RAW=prep["q_raw"], HAS_PERM=prep["token_perm"] is not None, PERSISTENT=persistent,
        num_warps=config.num_warps, num_stages=config.num_stages, **extra)
    return out


INT32_LIMIT = 2**31 - 1


def _max_offset(t: torch.Tensor, nb: int, nh: int) -> int:
    """Largest element offset from the data pointer of ``t[b0:b0+nb, h0:h0+nh]`` (``t`` 4-D)."""
    sizes = (nb, nh, t.shape[2], t.shape[3])
    return sum((size - 1) * stride for size, stride in zip(sizes, t.stride()) if size > 0)


def int32_chunks(tensors, per_bh_elements: int) -> list[tuple[int, int, int, int]]:
    """Split the ``(batch, heads)`` of ``[B, H, L, D]`` tensors into ``(b0, b1, h0, h1)`` chunks in which
    every element offset the kernels form fits in int32 (Triton computes pointer offsets from 32-bit
    program ids and strides): the views of ``tensors`` and ``per_bh_elements`` elements per (b, h) of
    the buffers the launch allocates (padded FP8 copies, the output). One chunk when everything fits,
    which is every Wan shape with fewer than ~5 batch rows at 720p. ``ValueError`` when one head alone
    does not fit."""
    batch, heads = tensors[0].shape[:2]

    def fits(nb, nh):
        return (nb * nh * per_bh_elements <= INT32_LIMIT
                and all(_max_offset(t, nb, nh) <= INT32_LIMIT for t in tensors))

    if fits(batch, heads):
        return [(0, batch, 0, heads)]
    if fits(1, heads):
        nb = max(n for n in range(1, batch + 1) if fits(n, heads))
        return [(b, min(b + nb, batch), 0, heads) for b in range(0, batch, nb)]
    if not fits(1, 1):
        raise ValueError(f"one head of {tuple(tensors[0].shape)} is too large for 32-bit offsets")
    nh = max(n for n in range(1, heads + 1) if fits(1, n))
    return [(b, b + 1, h, min(h + nh, heads)) for b in range(batch) for h in range(0, heads, nh)]


def _map_view(block_map: torch.Tensor, b0: int, b1: int, h0: int, h1: int) -> torch.Tensor:
    """The block map of a (batch, head) chunk; broadcast dims (size 1) stay whole."""
    rows = slice(b0, b1) if block_map.shape[0] > 1 else slice(0, 1)
    cols = slice(h0, h1) if block_map.shape[1] > 1 else slice(0, 1)
    return block_map[rows, cols]


def block_sparse_attention_triton_impl(q, k, v, block_map, block_size: int, scale: float, fp8: bool,
                                       config: TileConfig | None = None, prefix_len: int = 0,
                                       prefix_bias: float = 0.0, token_perm: torch.Tensor | None = None,
                                       suffix_len: int = 0, suffix_bias: float = 0.0,
                                       pooled_tail: bool = False, int8: bool = False) -> torch.Tensor:
    """Validate, prepare and launch (no torch.library wrapping); ``config`` overrides tile settings.
    Inputs whose offsets would overflow int32 run in (batch, head) chunks (:func:`int32_chunks`).

    ``token_perm`` (self-attention only, ``Lq == Lk == L``): int32/int64 ``[L]``, a permutation of
    ``range(L)``; the attention runs on the sequence reordered so that position ``i`` is input row
    ``token_perm[i]`` -- ``block_map`` is read in that order (e.g. 3D tiles) -- and the output comes
    back in the input order. FP8: the reorder is fused into the pre-pass loads and the kernel's
    output store (no extra pass); bf16: q, k, v are gathered once each, the store is fused.
    ``block_map`` and ``prefix_len`` refer to positions of the reordered sequence. ``suffix_bias`` is
    added to the scaled logits of the last ``suffix_len`` keys. ``pooled_tail``: every key block a row's
    map skips enters its softmax as one pooled term (:func:`chorus.kernels.block_sparse_attention`); a row
    that keeps no block then attends to the pooled terms only. ``int8`` (``fp8=False``, block size 128): the
    accurate path (module docstring, item 7)."""
    args = (q, k, v, block_map, block_size, scale, fp8, config, prefix_len, prefix_bias, token_perm, suffix_len,
            suffix_bias, pooled_tail, int8)
    if q.device.type == "cuda":
        with torch.cuda.device(q.device):  # Triton launches on the current device
            return _run_chunks(*args)
    return _run_chunks(*args)


def run_in_int32_chunks(q, k, v, block_map, launch, extra_rows: int = 0) -> torch.Tensor:
    """``launch(q, k, v, block_map)`` once, or once per (batch, head) chunk of :func:`int32_chunks` (the
    FP8 copies and the output take ``L`` padded to 128 per (b, h), plus ``extra_rows``: the pooled tail's)
    written into one output."""
    padded = -(-max(q.shape[2], k.shape[2]) // 128) * 128 + extra_rows
    chunks = int32_chunks((q, k, v), padded * q.shape[3])
    if len(chunks) == 1:
        return launch(q, k, v, block_map)
    out = output_like(q)
    for b0, b1, h0, h1 in chunks:
        out[b0:b1, h0:h1] = launch(q[b0:b1, h0:h1], k[b0:b1, h0:h1], v[b0:b1, h0:h1],
                                   _map_view(block_map, b0, b1, h0, h1))
    return out


def _run_chunks(q, k, v, block_map, block_size, scale, fp8, config, prefix_len, prefix_bias, token_perm=None,
                suffix_len=0, suffix_bias=0.0, pooled_tail=False, int8=False):
    _validate(q, k, v, block_map, block_size)
    token_perm = check_perm(token_perm, q, k)
    return run_in_int32_chunks(q, k, v, block_map, lambda q, k, v, bm: launch_attention(prepare_attention(
        q, k, v, bm, block_size, scale, fp8, config, prefix_len, prefix_bias, token_perm, suffix_len, suffix_bias,
        pooled_tail, int8)), tail_rows(k.shape[2], block_size) if pooled_tail else 0)


def check_key_biases(prefix_len, prefix_bias, suffix_len, suffix_bias, kv_len: int) -> int:
    """Validate the key biases of a call; returns the first key of the suffix (``kv_len`` when there is
    none). ``ValueError`` for lengths outside ``[0, kv_len]`` or non-finite biases."""
    for name, length, bias in (("prefix", prefix_len, prefix_bias), ("suffix", suffix_len, suffix_bias)):
        if not (isinstance(length, int) and 0 <= length <= kv_len and math.isfinite(bias)):
            raise ValueError(f"{name}_len must be in [0, {kv_len}] and {name}_bias finite, got {length!r}, {bias!r}")
    return kv_len - suffix_len if suffix_len > 0 and suffix_bias != 0.0 else kv_len

