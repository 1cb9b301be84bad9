"""Fused INT8 pre-pass of the accurate path (backend ``triton_int8``).

Inputs q ``[B, H, Lq, D]``, k/v ``[B, H, Lk, D]`` (fp16/bf16, any strides with unit stride on D), D 64
or 128. Outputs (contiguous, token axis padded to ``Lpad = ceil(L / 128) * 128``; padded rows are exact
zeros):

- ``q8`` int8 ``[B, H, Lpad_q, D]``: ``(q @ Hd) * softmax_scale * log2(e) / D`` divided by a per-row scale
  ``q_scale`` fp32 ``[B, H, Lpad_q]`` (``absmax / 127`` of the row, 1.0 for a zero row);
- ``k8`` int8 ``[B, H, Lrow_k, D]``: ``(k - c) @ Hd`` divided by a per-128-key scale ``k_scale`` fp32 ``[B, H,
  Lrow_k / 128]``, with ``c`` the smoothing vector of :func:`._quant.smoothing_vector` (K smoothing adds
  a constant to each query row's logits, which softmax ignores);
- ``v8t`` int8 ``[B, H, D, Lrow_k]``: ``v / v_scale``, ``v_scale`` fp32 ``[B, H, D]`` = the channel's absmax
  over the sequence / 127, stored transposed (an 8-bit wgmma takes both operands K-major);
- ``v_sums`` int32 ``[B, H, Lrow_k / 128, D]``: per 128 keys, the channel sums of ``v8t``'s integers. The
  kernel feeds P as ``u8 - 128`` (Triton's integer dot is signed): ``sum_j u_j v_j = sum_j (u_j - 128) v_j
  + 128 * sum_j v_j``, exact in int32.

``Hd`` is the ``D x D`` Sylvester-Hadamard matrix of +-1 entries (``Hd @ Hd^T = D * I``), so ``(q Hd) .
(k Hd) / D = q . k``: the rotation spreads a few large channels over all of them before the 8-bit
rounding (the incoherent processing of FlashAttention-3's FP8 path); it is exact on bf16/fp16 inputs
(products of +-1, sums in fp32). Rounding is to nearest, ties to even (:func:`round_int8` says why), values
clamped to +-127.

``pool_block`` (the pooled tail): ``Lrow_k = Lpad_k + tail_rows``; rows ``Lpad_k + j`` hold key block ``j``'s
mean of rotated smoothed K (one scale per 128 pooled keys, appended to ``k_scale``) and of V (in units of
their own per-channel scale, returned as its ratio over V's, ``pool_ratio``: a block mean is far smaller than V's
extremes, and on V's scale it would keep only a few levels), with their ``v_sums``; zeros past the last block.

Launches: V's per-channel absmax (the FP8 pre-pass's stats kernel and its fixed-order reduction), the
smoothing vector, the quantise kernel (one program per 128-token tile and (b, h); Q and K read once, V
twice in all) and, with the pooled tail, one small finalising launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._quant import (LOG2E, QUANT_TILE, _pool_chunk, _pooled_means, _program_tile, block_sums, check_prepass_perm,
                     interpreter_upcast, padded_len, smoothing_vector, source_rows, tail_rows, v_channel_absmax,
                     wgmma_key_of_column, wgmma_key_order_torch)
from ..process_tensors import outside_inference_mode

INT8_MAX = 127.0

_HADAMARD: dict = {}


def hadamard(dim: int, device=None, dtype=torch.bfloat16) -> torch.Tensor:
    """The ``dim x dim`` Sylvester-Hadamard matrix (+-1 entries; ``dim`` a power of two), cached per device
    and dtype."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power-of-two size, got {dim}")
    key = (dim, str(device), dtype)
    if key not in _HADAMARD:
        _HADAMARD[key] = _sylvester_hadamard(dim, device, dtype)
    return _HADAMARD[key]


@outside_inference_mode  # kept for the process: an ordinary tensor, whatever mode first asks
def _sylvester_hadamard(dim: int, device, dtype) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device=device, dtype=dtype).contiguous()


@triton.jit
def round_int8(x):
    """fp32 ``x`` to the nearest integer, ties to even, clamped to +-127, still fp32 (exact in the cast to int8):
    the fp32 add of 1.5 * 2^23 rounds to an integer. Ties must not all go one way: a scale of ``absmax / 127``
    on bf16 inputs puts up to ~1% of the values exactly on a tie, and ties rounded up shift every channel's
    mean, an error that does not average away (0.040 instead of 0.0095 relative on 16 384 Gaussian values)."""
    r = (x + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(r, -127.0), 127.0)


@triton.jit
def rotate(x, hmat, INTERPRET: tl.constexpr):
    """``x @ hmat`` in fp32 (``x`` 16-bit ``[M, D]``, ``hmat`` the +-1 Hadamard matrix): exact products,
    fp32 sums. Under the CPU interpreter the operands are upcast first (its 16-bit dot misreads bits)."""
    if INTERPRET:
        return tl.dot(x.to(tl.float32), hmat.to(tl.float32), input_precision="ieee")
    return tl.dot(x, hmat)


@triton.jit
def _quant_int8_kernel(Q, K, V, q8, k8, v8t, q_scale, k_scale, v_sums, k_smooth_rot, v_absmax, hmat, token_perm,
                       pool_sums, H, Lq, Lk, Lpad_q, Lpad_k, Lrow_k, q_mult,
                       s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
                       HEAD_DIM: tl.constexpr, TILE: tl.constexpr, INTERPRET: tl.constexpr,
                       HAS_PERM: tl.constexpr, POOL_CHUNK: tl.constexpr, V_WGMMA_ORDER: tl.constexpr):
    # k_smooth_rot: the smoothing vector times Hd [B*H, D]; v_absmax: V's per-channel absmax [B*H, D];
    # POOL_CHUNK > 0: sums of each POOL_CHUNK keys of rotated smoothed K and of V into pool_sums [B*H, 2, n, D];
    # V_WGMMA_ORDER: column c of v8t holds key wgmma_key_of_column(c) (a permutation within each 16 keys)
    tile, bh, b, h, offs_d, rows = _program_tile(H, HEAD_DIM, TILE)
    n_kt_row = Lrow_k // TILE
    n_chunks = Lpad_k // tl.maximum(POOL_CHUNK, 1)
    h_rows = tl.arange(0, HEAD_DIM)
    hm = tl.load(hmat + h_rows[:, None] * HEAD_DIM + h_rows[None, :])
    if tile < Lpad_q // TILE:
        valid = (rows < Lq)[:, None]
        src = source_rows(token_perm, rows, Lq, HAS_PERM)
        x = tl.load(Q + b * s_qb + h * s_qh + src[:, None] * s_ql + offs_d[None, :], mask=valid, other=0.0)
        x = rotate(x, hm, INTERPRET) * q_mult
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, amax / 127.0, 1.0)
        x = round_int8(x / scale[:, None])
        tl.store(q8 + bh * Lpad_q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :], x.to(tl.int8))
        tl.store(q_scale + bh * Lpad_q + rows, scale)
    if tile < Lpad_k // TILE:
        valid = (rows < Lk)[:, None]
        src = source_rows(token_perm, rows, Lk, HAS_PERM)
        x = tl.load(K + b * s_kb + h * s_kh + src[:, None] * s_kl + offs_d[None, :], mask=valid, other=0.0)
        mean = tl.load(k_smooth_rot + bh * HEAD_DIM + offs_d)
        x = tl.where(valid, rotate(x, hm, INTERPRET) - mean[None, :], 0.0)
        if POOL_CHUNK > 0:
            block_sums(x, pool_sums + bh * 2 * n_chunks * HEAD_DIM, tile * (TILE // POOL_CHUNK), HEAD_DIM, TILE,
                       POOL_CHUNK)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = tl.where(amax > 0, amax / 127.0, 1.0)
        tl.store(k8 + bh * Lrow_k * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :],
                 round_int8(x / scale).to(tl.int8))
        tl.store(k_scale + bh * n_kt_row + tile, scale)
        if V_WGMMA_ORDER:  # gathered in the wgmma key order on load, so the transposed store stays contiguous
            v_rows = wgmma_key_of_column(rows)
            y = tl.load(V + b * s_vb + h * s_vh + source_rows(token_perm, v_rows, Lk, HAS_PERM)[:, None] * s_vl
                        + offs_d[None, :], mask=(v_rows < Lk)[:, None], other=0.0)
        else:
            y = tl.load(V + b * s_vb + h * s_vh + src[:, None] * s_vl + offs_d[None, :], mask=valid, other=0.0)
        y = y.to(tl.float32)
        if POOL_CHUNK > 0:  # (the wgmma order permutes keys within 16: each chunk's set of keys is the same)
            block_sums(y, pool_sums + (bh * 2 + 1) * n_chunks * HEAD_DIM, tile * (TILE // POOL_CHUNK), HEAD_DIM,
                       TILE, POOL_CHUNK)
        _store_v_tile(y, v8t, v_sums, v_absmax, bh, rows, tile, Lrow_k, HEAD_DIM, TILE)


@triton.jit
def _store_v_tile(y, v8t, v_sums, v_absmax, bh, rows, tile, Lrow_k, HEAD_DIM: tl.constexpr, TILE: tl.constexpr):
    """A V tile (fp32 ``[TILE, D]``) in int8 units of the per-channel scale, stored transposed at columns
    ``rows`` of ``v8t[bh]``, and its channel sums (int32) as row ``tile`` of ``v_sums[bh]``."""
    offs_d = tl.arange(0, HEAD_DIM)
    vmax = tl.load(v_absmax + bh * HEAD_DIM + offs_d)
    y = round_int8(y / tl.where(vmax > 0, vmax / 127.0, 1.0)[None, :])
    tl.store(v8t + bh * HEAD_DIM * Lrow_k + offs_d[None, :] * Lrow_k + rows[:, None], y.to(tl.int8))
    tl.store(v_sums + (bh * (Lrow_k // TILE) + tile) * HEAD_DIM + offs_d, tl.sum(y, axis=0).to(tl.int32))


@triton.jit
def _pooled_finalize_int8_kernel(pool_sums, k8, v8t, k_scale, v_sums, v_pool_absmax, H, Lk, n_chunks, Lrow_k, row0,
                                 n_tiles, HEAD_DIM: tl.constexpr, TILE: tl.constexpr, BS: tl.constexpr,
                                 POOL_CHUNK: tl.constexpr, V_WGMMA_ORDER: tl.constexpr):
    """The pooled keys of one (b, h), ``n_tiles`` tiles of ``TILE``: key block ``j``'s means as row ``row0 + j``
    of ``k8`` (one scale per tile, at ``k_scale[bh, row0 / TILE + tile]``) and column of ``v8t`` in units of
    the pooled values' own per-channel scale (``v_pool_absmax[bh] / 127``, written here: a block mean is far
    smaller than V's extremes), with their ``v_sums``, in the pre-pass's key order. Blocks past the last are
    zeros."""
    bh = tl.program_id(0)
    offs_d = tl.arange(0, HEAD_DIM)
    r = tl.arange(0, TILE)
    vmax = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for tile in range(0, n_tiles):
        vbar = _pooled_means(pool_sums, bh, 1, tile * TILE + r, n_chunks, Lk, BS, HEAD_DIM, POOL_CHUNK)
        vmax = tl.maximum(vmax, tl.max(tl.abs(vbar), axis=0))
    tl.store(v_pool_absmax + bh * HEAD_DIM + offs_d, vmax)
    for tile in range(0, n_tiles):
        rows = row0 + tile * TILE + r
        kbar = _pooled_means(pool_sums, bh, 0, tile * TILE + r, n_chunks, Lk, BS, HEAD_DIM, POOL_CHUNK)
        amax = tl.max(tl.max(tl.abs(kbar), axis=1), axis=0)
        scale = tl.where(amax > 0, amax / 127.0, 1.0)
        tl.store(k8 + bh * Lrow_k * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :],
                 round_int8(kbar / scale).to(tl.int8))
        tl.store(k_scale + bh * (Lrow_k // TILE) + row0 // TILE + tile, scale)
        v_keys = r
        if V_WGMMA_ORDER:  # column r holds pooled key wgmma_key_of_column(r), as in the pre-pass
            v_keys = wgmma_key_of_column(r)
        vbar = _pooled_means(pool_sums, bh, 1, tile * TILE + v_keys, n_chunks, Lk, BS, HEAD_DIM, POOL_CHUNK)
        _store_v_tile(vbar, v8t, v_sums, v_pool_absmax, bh, rows, row0 // TILE + tile, Lrow_k, HEAD_DIM, TILE)


def quantize_qkv_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                      token_perm: torch.Tensor | None = None, pool_block: int | None = None,
                      v_key_order: str = "natural"):
    """Run the INT8 pre-pass; returns ``(q8, k8, v8t, q_scale, k_scale, v_scale, v_sums, pool_ratio)`` (module
    docstring; ``pool_ratio`` fp32 ``[B, H, D]``: the pooled values' per-channel scale over ``v_scale``, what the
    kernels apply to their tiles; None without a tail).

    ``scale`` is the softmax scale (``q_scale`` includes ``scale * log2(e) / D``, so ``q_scale[i] * k_scale[t]
    * (q8[i] . k8[j])`` is row ``i``'s logit of key ``j`` in log2 units, up to the smoothing constant).
    ``token_perm``: int32 ``[L]`` on q's device (``Lq == Lk == L``), output position -> input row, fused into
    the loads (values clamped into ``[0, L)``). ``pool_block``: the pooled tail's key block size (a power of
    two >= 16) or None. ``v_key_order``: ``"natural"`` (column ``j`` of ``v8t`` is key ``j``) or ``"wgmma"``
    (key ``j`` at column :func:`._quant.wgmma_key_order_torch` ``(j)``, for the warp-specialised kernel; ``v_sums``
    are the same). ``ValueError`` for a head dim other than 64 / 128, a bad ``token_perm`` or key order."""
    if v_key_order not in ("natural", "wgmma"):
        raise ValueError(f"v_key_order must be 'natural' or 'wgmma', got {v_key_order!r}")
    batch, heads, q_len, head_dim = q.shape
    if head_dim not in (64, 128):
        raise ValueError(f"the INT8 pre-pass supports head dims 64 and 128, got {head_dim}")
    kv_len = k.shape[2]
    lpad_q, lpad_k = padded_len(q_len), padded_len(kv_len)
    chunk = 0 if pool_block is None else _pool_chunk(pool_block)
    lrow_k = lpad_k + (0 if pool_block is None else tail_rows(kv_len, pool_block))
    dev = q.device
    check_prepass_perm(token_perm, q_len, kv_len, dev)
    interpret = interpreter_upcast(q)
    hmat = hadamard(head_dim, dev, q.dtype)
    q8 = torch.empty(batch, heads, lpad_q, head_dim, device=dev, dtype=torch.int8)
    k8 = torch.empty(batch, heads, lrow_k, head_dim, device=dev, dtype=torch.int8)
    v8t = torch.empty(batch, heads, head_dim, lrow_k, device=dev, dtype=torch.int8)
    q_scale = torch.empty(batch, heads, lpad_q, device=dev, dtype=torch.float32)
    k_scale = torch.empty(batch, heads, lrow_k // QUANT_TILE, device=dev, dtype=torch.float32)
    v_sums = torch.empty(batch, heads, lrow_k // QUANT_TILE, head_dim, device=dev, dtype=torch.int32)
    pool_sums = (k_scale if not chunk else
                 torch.empty(batch * heads, 2, lpad_k // chunk, head_dim, device=dev, dtype=torch.float32))
    v_absmax = v_channel_absmax(v)
    k_smooth_rot = (smoothing_vector(k, token_perm) @ hmat.float()).contiguous()
    _quant_int8_kernel[(max(lpad_q, lpad_k) // QUANT_TILE, batch * heads)](
        q, k, v, q8, k8, v8t, q_scale, k_scale, v_sums, k_smooth_rot, v_absmax, hmat,
        k_scale if token_perm is None else token_perm, pool_sums,
        heads, q_len, kv_len, lpad_q, lpad_k, lrow_k, float(scale * LOG2E / head_dim),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        HEAD_DIM=head_dim, TILE=QUANT_TILE, INTERPRET=interpret, HAS_PERM=token_perm is not None,
        POOL_CHUNK=chunk, V_WGMMA_ORDER=v_key_order == "wgmma", num_warps=4)  # H200, 720p: 2.3 ms (8 warps 3.0, 2: 47)
    v_absmax = v_absmax.view(batch, heads, head_dim)
    v_scale = torch.where(v_absmax > 0, v_absmax / INT8_MAX, torch.ones_like(v_absmax))
    pool_ratio = None
    if chunk:
        pool_absmax = torch.empty(batch, heads, head_dim, device=dev, dtype=torch.float32)
        _pooled_finalize_int8_kernel[(batch * heads,)](
            pool_sums, k8, v8t, k_scale, v_sums, pool_absmax, heads, kv_len, lpad_k // chunk, lrow_k, lpad_k,
            (lrow_k - lpad_k) // QUANT_TILE, HEAD_DIM=head_dim, TILE=QUANT_TILE, BS=pool_block, POOL_CHUNK=chunk,
            V_WGMMA_ORDER=v_key_order == "wgmma", num_warps=8)
        pool_v_scale = torch.where(pool_absmax > 0, pool_absmax / INT8_MAX, torch.ones_like(pool_absmax))
        pool_ratio = (pool_v_scale / v_scale).contiguous()
    return q8, k8, v8t, q_scale, k_scale, v_scale, v_sums, pool_ratio


def quantize_int8_reference(q, k, v, scale: float, pool_block: int | None = None, v_key_order: str = "natural"):
    """Plain-torch twin of :func:`quantize_qkv_int8` (fp64 math, same scales, rounding, layout and key order) for
    tests; returns the same eight items (int8 codes as int8, scales fp32, sums int32)."""
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    lpad_q, lpad_k = padded_len(q_len), padded_len(kv_len)
    hmat = hadamard(head_dim, q.device, torch.float64)

    def pad_rows(x, rows):
        return torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[2]))

    def to_int(x, s):
        return torch.round(x / s).clamp(-INT8_MAX, INT8_MAX)  # ties to even, as the kernel

    qf = pad_rows(q.double() @ hmat * (scale * LOG2E / head_dim), lpad_q)
    q_amax = qf.abs().amax(-1)
    qs = torch.where(q_amax > 0, q_amax / INT8_MAX, torch.ones_like(q_amax))
    kf = (k.double() - smoothing_vector(k).double()[:, :, None, :]) @ hmat
    vf = v.double()
    lrow_k = lpad_k
    kf, vf = pad_rows(kf, lpad_k), pad_rows(vf, lpad_k)
    if pool_block is not None:
        from ..reference import pooled_key_blocks  # noqa: PLC0415

        rows = tail_rows(kv_len, pool_block)
        kbar, vbar = pooled_key_blocks(kf[:, :, :kv_len], vf[:, :, :kv_len], pool_block)
        kf = torch.cat([kf, pad_rows(kbar, rows)], dim=2)
        vbar = pad_rows(vbar, rows)
        lrow_k += rows
    kt = kf.view(batch, heads, lrow_k // QUANT_TILE, QUANT_TILE, head_dim)
    k_amax = kt.abs().amax(dim=(-1, -2))
    ks = torch.where(k_amax > 0, k_amax / INT8_MAX, torch.ones_like(k_amax))
    k8 = to_int(kt, ks[..., None, None]).view(batch, heads, lrow_k, head_dim)
    v_amax = v.double().abs().amax(dim=2)
    vs = torch.where(v_amax > 0, v_amax / INT8_MAX, torch.ones_like(v_amax))
    v8 = to_int(vf, vs[:, :, None, :])
    ratio = None
    if pool_block is not None:
        p_amax = vbar.abs().amax(dim=2)
        ps = torch.where(p_amax > 0, p_amax / INT8_MAX, torch.ones_like(p_amax))
        v8 = torch.cat([v8, to_int(vbar, ps[:, :, None, :])], dim=2)
        ratio = (ps / vs).float()
    v_sums = v8.view(batch, heads, lrow_k // QUANT_TILE, QUANT_TILE, head_dim).sum(3)
    if v_key_order == "wgmma":  # key j to column wgmma_key_order_torch(j)
        cols = wgmma_key_order_torch(torch.arange(lrow_k, device=v8.device))
        v8 = torch.empty_like(v8).index_copy_(2, cols, v8)
    return (to_int(qf, qs[..., None]).to(torch.int8), k8.to(torch.int8), v8.transpose(-1, -2).contiguous().to(torch.int8),
            qs.float(), ks.float(), vs.float(), v_sums.to(torch.int32), ratio)


__all__ = ["quantize_qkv_int8", "quantize_int8_reference", "hadamard", "INT8_MAX"]
