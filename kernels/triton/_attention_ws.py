"""Warp-specialised FP8 block-sparse attention for Hopper, in Gluon (Triton's tile-level language):
the ``triton_fp8_ws`` backend; its ``INT8`` variant runs the accurate path's numerics (backend
``triton_int8_ws``, last item below).

Contract (checked by :func:`block_sparse_attention_ws`): q ``[B, H, Lq, D]``, k/v ``[B, H, Lk, D]``
fp16/bf16 on one sm_90 device, unit stride on D (ComfyUI's ``[B, L, H, D]`` views work), D in {64, 128};
block size 128 (the quantisation tile); block_map bool ``[B or 1, H or 1, ceil(Lq/128), ceil(Lk/128)]``.
Options, each a compile-time switch of its own kernel variant (a call without one runs the kernel
built without it): a prefix bias ``prefix_bias`` added to the scaled logits of keys ``[0, prefix_len)``
(ChorusGuidanceBoost's first-frame weight) and a suffix bias on the last ``suffix_len`` keys (feature
reuse's compact attention), both in natural-log units; a token order ``token_perm`` (``Lq == Lk``:
attention of the sequence in that order, output in the input order); the pooled tail (every key block a
row's map skips enters its softmax as one pooled term; semantics:
:func:`chorus.kernels.block_sparse_attention`). Partial last blocks are handled (keys past ``Lk`` get
logit -inf, rows past ``Lq`` are not stored); a row that keeps no block yields zeros (with the pooled
tail: its pooled terms' average). Returns ``[B, H, Lq, D]`` in q's dtype (:func:`._attention.output_like`'s
layout). ``ValueError`` for inputs outside the contract; inputs whose offsets overflow int32 run in
(batch, head) chunks. The numerics are those of the FP8 path of :mod:`._attention` (the pre-pass of
:mod:`._quant`: SageAttention's K smoothing, per-128-token K scales, per-channel V scales), within the same FP8 bounds
of the fp64 oracle; P and Q's scales are rounded their own way (below).

How it runs (:func:`launch_ws`: the pre-pass, the block lists of :func:`._attention.lpt_block_lists`,
then one persistent launch of ``_bsa_ws_kernel``):

- one CTA per SM walks the 128-row query tiles in (batch, head)-major, longest-row-first order, so the
  tiles in flight share a head's K/V in L2 and the long rows start first;
- three partitions (FlashAttention-3's warp specialisation: Shah et al., 2024): a producer warpgroup
  issuing the TMA loads of Q (double-buffered across tiles) and of each listed key block's K and V^T
  into a ring of :attr:`WsConfig.stages` shared-memory stages, and two consumer warpgroups (240
  registers each through ``setmaxnreg``) that own 64 query rows each and share every stage; mbarriers
  hand the stages over (``ready``: the TMA bytes landed; ``empty``: both consumers' wgmmas that read
  the stage retired);
- per consumer and key block: ``S = Q8 @ K8^T`` (FP8 wgmma, fp32 accumulation) scaled by ``sq * sk``,
  online softmax in log2 units with ``P = 2^(S - m + 8)`` (row maximum 256, inside e4m3) and
  ``O += P8 @ V8`` (FP8 wgmma, V^T K-major, as FlashAttention-3's FP8 path needs);
- P's e4m3 bytes come straight from one saturating FFMA per element (PTX ``fma.rn.sat``, then
  ``128 u + 1.5 * 2^23``): ``k = round(8 x + 56)`` clamped to ``[0, 128]`` is the byte of
  ``2^(k // 8 - 7) * (1 + (k % 8) / 8)``, i.e. exp2 with the mantissa linear between powers of two
  (Schraudolph's exponential, Neural Computation 11(4), 1999, read off e4m3's bit pattern) -- no
  exp2 on the MUFU (FlashAttention-4 moves exp2 off it by a polynomial instead) and no fp32 -> e4m3
  conversion. The row sums, which must be those of exactly these P, come from a second wgmma
  ``P8 @ ones`` (N = 8) per block, summed in fp32 registers;
- P reaches ``P @ V`` in its registers (:func:`_p_operand`: relabelling the key axis makes the
  accumulator layout the 8-bit A-operand layout; the pre-pass stores V^T's keys in the matching order,
  ``v_key_order="wgmma"``);
- Q: the producer loads the input's own bf16 / fp16 rows (a 4-D descriptor: any 16-byte aligned
  strides, rows past ``Lq`` zero-filled) and each consumer converts its 64 rows to e4m3 once per tile,
  with one scale ``absmax * softmax_scale * log2(e) / 448`` for them, into a shared buffer of its own;
  the pre-pass then reads only K and V. A token order (whose rows the pre-pass gathers) and a q no TMA
  descriptor can address take the pre-pass's e4m3 Q tiles instead;
- the output: each consumer writes its 64 rows into its own shared buffer and issues one TMA store
  (a 4-D descriptor: ComfyUI's ``[B, L, H, D]`` memory works, rows past ``Lq`` are clipped), which runs
  on while the next tile starts; a token order scatters its rows instead, 16 bytes per store after one
  layout conversion;
- key biases: a key block wholly inside the prefix / suffix takes its bias in the softmax's per-row
  terms, computed from the block index before its ``Q @ K^T`` is waited for (:func:`_key_block_bias`);
  the one block an edge crosses also as ``bias / sc`` added to those elements of ``S``;
- the pooled tail (``HAS_TAIL``): the pre-pass appends each 128-key block's mean of smoothed K and of V
  as rows ``Lpad_k + j`` of its copies; each tile's block list ends with the pooled tiles
  ``Lpad_k / 128 + p`` that hold a block its map row skips, loaded like any key block; on a pooled tile
  the consumer adds the bias table's row (``w_j * log2(e)``, ``-inf`` where the row keeps block ``j``)
  as ``bias / sc`` to ``S`` before the row maximum, in a branch only pooled tiles take (a kept block
  runs the loop it runs without the tail: ``tests/test_kernels_ws.py`` reads the SASS), the tile's table
  row prefetched into L1 once (``prefetch.global.L1``). Where the FP8 kernel's ptxas is 13.0 or newer
  (:func:`._ptxas.fixed_ptxas`; ``POOLED_LOOP``), the pooled tiles run in a loop of their own after the kept
  blocks instead (no branch, no key-bias terms; each block's loads issued after its ``Q @ K^T``): 1.1-1.3 ms
  faster at 720p, 15%, with the tail (H200). Older ptxas miscompile that form on a query block that keeps
  nothing. Every variant is built by the ptxas :func:`._ptxas.kernel_ptxas` pins for it (:mod:`._ptxas`).

- ``INT8`` (``int8=True``): the numerics of :mod:`._attention`'s item 7 (the portable ``triton_int8``) in the same
  partitions, ring and walk. The INT8 pre-pass (:mod:`._quant_int8`, V^T in the wgmma key order) gives Q
  (Hadamard-rotated, one scale per row; always the pre-pass's tiles), K and V^T; ``Q @ K^T``, ``P @ V`` and the
  row sums are signed 8-bit wgmmas with int32 accumulators; P is each key block's uint8 levels
  ``round(255 * 2^(S - m_block))`` from the MUFU's exp2, fed as ``level - 128`` (:func:`_softmax_block_int8`); the
  int32 S and row sums become fp32 by one integer add of 1.5 * 2^23's bits, and ``P @ V``'s accumulator starts
  at those bits plus the block's ``128 * V sums`` (no add after the product); each block enters O and l with its
  weight ``2^(m_block - m)``. With the pooled tail the pooled
  tiles run in a loop of their own after the kept blocks (:func:`_key_block` is the step of both loops), and O
  moves to the pooled values' own per-channel scale once between the two.

The alternatives measured against these choices (schedules, the exp2 path and its split onto the FMA
pipes, other P clamps and stores, per-tile V scales) and their numbers: ``docs/BENCHMARK_LOG.md``.

Gluon is an experimental Triton API (built and tested with Triton 3.6 and 3.8): :func:`available`
says whether this Triton has it; :func:`compile_sm90` builds any variant ahead of time for sm_90 without
a GPU, which the tests do, so an API change shows up in CI.
"""

from __future__ import annotations

import dataclasses

import torch

from ._attention import (P_SHIFT_LOG2, _validate, check_key_biases, check_perm, lpt_block_lists, output_like,
                         run_in_int32_chunks, tail_spec)
from ._quant import LOG2E, padded_len, quantize_qkv_fp8, tail_rows
from ._ptxas import Assembler, assembling, kernel_ptxas, pooled_loop_right, run_assembled
from ._quant_int8 import quantize_qkv_int8

try:  # Gluon ships inside recent Tritons; without it this backend reports itself unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.8 / 3.6 spelling
    _IMPORT_ERROR = None
except Exception as exc:  # noqa: BLE001 - any failure to import the experimental API: unavailable, with the reason
    gluon = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

BLOCK = 128  # query rows per CTA, keys per block, tokens per Q/K scale
CONSUMER_ROWS = 64  # query rows per consumer warpgroup (one wgmma M tile of 4 warps)
CONSUMER_REGS = 240  # registers per consumer thread (setmaxnreg); the producer keeps the rest


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """The kernel's tuning: ``stages`` >= 2 shared-memory stages of K / V^T in the ring (3 fits the shared
    memory at D = 128 with everything else), ``q_stages`` >= 1 buffers of Q across tiles. ``ValueError``
    on anything else."""

    stages: int = 3
    q_stages: int = 2

    def __post_init__(self):
        for name, low in (("stages", 2), ("q_stages", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"WsConfig.{name} must be an int >= {low}, got {value!r}")


def available() -> str | None:
    """None when this Triton has the Gluon Hopper API the kernel needs, else the reason."""
    return _IMPORT_ERROR


def supports(head_dim: int, block_size: int) -> str | None:
    """None when a call of this geometry can run here (any prefix / suffix key bias and token order
    do), else why not (for auto's routing)."""
    if _IMPORT_ERROR:
        return f"Gluon is not importable ({_IMPORT_ERROR})"
    if block_size != BLOCK:
        return f"block size {block_size} (the warp-specialised kernel runs 128-token blocks)"
    if head_dim not in (64, 128):
        return f"head dim {head_dim} (64 or 128)"
    return None


if gluon is not None:
    _BLOCK = gl.constexpr(BLOCK)
    _ROWS = gl.constexpr(CONSUMER_ROWS)
    _REGS = gl.constexpr(CONSUMER_REGS)
    _P_SHIFT = gl.constexpr(P_SHIFT_LOG2)  # P = 2^(S - m + P_SHIFT): row maximum 256, inside e4m3
    P_BITS_OFFSET = gl.constexpr(-0.5)  # k's rounding offset: centres the linear mantissa's error (CPU model)
    _ONES = gl.constexpr(8)  # columns of the row-sum GEMM (P8 @ ones): wgmma's smallest N
    _MAGIC = gl.constexpr(12582912.0)  # 1.5 * 2^23: a float in [2^23, 2^24) has unit spacing
    _MAGIC_BITS = gl.constexpr(0x4B400000)  # its bit pattern: int32 x + these bits is the float x + 1.5 * 2^23

    @gluon.jit
    def _tile_of(t, walk, HAS_TAIL: gl.constexpr):
        """Tile ``t`` of the persistent walk -> (b, h, bh, query block, listed count, block list row, map row):
        with ``HAS_TAIL`` the count includes the pooled tiles listed after the kept blocks. ``walk``: the
        block lists (:func:`._attention.lpt_block_lists`), ``(sched, kv_num, kv_idx, tail_num, H, q_blocks,
        num_tiles, s_nb, s_nh, s_ib, s_ih, s_iq)``."""
        sched, kv_num, kv_idx, tail_num, H, q_blocks, num_tiles, s_nb, s_nh, s_ib, s_ih, s_iq = walk
        bh = t // q_blocks
        b = bh // H
        h = bh % H
        row_base = b * s_nb + h * s_nh
        qblk = gl.load(sched + row_base + t % q_blocks)
        n_kv = gl.load(kv_num + row_base + qblk)
        if HAS_TAIL:
            n_kv += gl.load(tail_num + row_base + qblk)
        idx_row = kv_idx + b * s_ib + h * s_ih + qblk * s_iq
        return b, h, bh, qblk, n_kv, idx_row, row_base + qblk

    @gluon.jit
    def _producer(descs, smem, bars, walk, lpad_q, lpad_k, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                  Q_STAGES: gl.constexpr, Q_KERNEL: gl.constexpr, HAS_TAIL: gl.constexpr):
        """The TMA loads: each tile's Q (``descs`` = (q, k, v^T) descriptors; ``smem`` = their stages) and
        its listed key blocks' K and V^T, each stage once both consumers released it (``bars``)."""
        q_desc, k_desc, v_desc = descs
        q_smem, k_smem, v_smem = smem
        q_ready, q_empty, k_ready, v_ready, kv_empty = bars
        num_tiles = walk[6]
        # Waits on "empty" barriers start at parity 1: a fresh barrier counts as having completed
        # the phase before its first, so the first STAGES (Q_STAGES) loads do not wait.
        kctr = 0
        qt = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            b, h, bh, qblk, n_kv, idx_row, _ = _tile_of(t, walk, HAS_TAIL)
            qs = qt % Q_STAGES
            mbarrier.wait(q_empty.index(qs), ((qt // Q_STAGES) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qs), q_desc.block_type.nbytes)
            if Q_KERNEL:  # the input's own bf16 / fp16 rows (past Lq: zeros)
                tma.async_copy_global_to_shared(q_desc, [b, h, qblk * _BLOCK, 0], q_ready.index(qs), q_smem.index(qs))
            else:
                tma.async_copy_global_to_shared(q_desc, [bh * lpad_q + qblk * _BLOCK, 0], q_ready.index(qs),
                                                q_smem.index(qs))
            qt += 1
            for j in range(n_kv):
                kb = gl.load(idx_row + j)  # issued before the wait: its latency hides behind it
                st = kctr % STAGES
                mbarrier.wait(kv_empty.index(st), ((kctr // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [bh * lpad_k + kb * _BLOCK, 0], k_ready.index(st),
                                                k_smem.index(st))
                mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [bh * HEAD_DIM, kb * _BLOCK], v_ready.index(st),
                                                v_smem.index(st))
                kctr += 1

    @gluon.jit
    def _prefetch_row(row, width):
        """Bring ``row[:width]`` (fp32; the pooled tail's bias-table row of the tile) into L1 with PTX
        ``prefetch.global.L1``, one 128-byte line per address (offsets clamped into the row), so the pooled
        tiles' loads of it later in the tile hit L1 instead of waiting for L2 / memory after ``Q @ K^T``."""
        lines: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ptrs = row + gl.minimum(gl.arange(0, 32, layout=lines) * 32, width - 1)
        gl.inline_asm_elementwise("prefetch.global.L1 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _fma_sat(x, a, b_rows):
        """``min(max(x * a + b_rows[:, None], 0), 1)`` in one FFMA per element (PTX ``fma.rn.sat``; NaN
        gives 0): ``x`` ``[R, N]``, ``a`` a scalar, ``b_rows`` ``[R]`` in ``x``'s row layout."""
        zero = gl.full_like(x, 0.0)
        return gl.inline_asm_elementwise("fma.rn.sat.f32 $0, $1, $2, $3;", "=f,f,f,f",
                                         [x, zero + a, zero + b_rows[:, None]], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _key_block_bias(kb, key_bias, HAS_SUFFIX: gl.constexpr):
        """Key block ``kb``'s share of the prefix / suffix biases (``key_bias`` = (prefix_len, prefix_bias,
        suffix_start, suffix_bias), biases in log2 units), from its index alone (so it is computed while the
        block's ``Q @ K^T`` runs): ``(whole, pre_keys, tail_from, edge)`` with ``whole`` = the bias of every
        key of the block (blocks wholly inside the prefix and / or the suffix), the block's prefix keys
        ``[0, pre_keys)`` and suffix keys ``[tail_from, BLOCK)``, and ``edge`` = whether the prefix or suffix
        ends inside the block (then per-key biases apply)."""
        prefix_len, prefix_bias, suffix_start, suffix_bias = key_bias
        pre_keys = prefix_len - kb * _BLOCK
        whole = gl.where(pre_keys >= _BLOCK, prefix_bias, 0.0)
        edge = (pre_keys > 0) & (pre_keys < _BLOCK)
        tail_from = suffix_start - kb * _BLOCK
        if HAS_SUFFIX:
            whole = whole + gl.where(tail_from <= 0, suffix_bias, 0.0)
            edge = edge | ((tail_from > 0) & (tail_from < _BLOCK))
        return whole, pre_keys, tail_from, edge

    @gluon.jit
    def _block_terms(idx_row, j, sq, k_scale_row, key_bias, pool_first, tail_row, HAS_SUFFIX: gl.constexpr,
                     HAS_TAIL: gl.constexpr, POOLED: gl.constexpr, SQ_LOAD: gl.constexpr):
        """What the softmax of the tile's ``j``-th listed key block needs besides its ``S``, loaded / computed
        before ``S`` is waited for: ``(kb, sc, (whole, pre_keys, tail_from, edge, pooled))`` = the block's
        index, ``sq * sk`` (``SQ_LOAD``: ``sq`` is the address of Q's scale), its share of the key biases
        (:func:`_key_block_bias`) and, with ``HAS_TAIL``, whether it is a tile of pooled keys (``kb >=
        pool_first``: its weights, key biases included, come from the tail's bias table instead). ``POOLED``:
        the block is a tile of pooled keys (a loop of them alone); ``pooled`` is then the address of its
        weights in the bias-table row ``tail_row``, and the key-bias terms are zeros."""
        kb = gl.load(idx_row + j)
        if SQ_LOAD:
            sq = gl.load(sq)
        sc = sq * gl.load(k_scale_row + kb)
        if POOLED:
            return kb, sc, (0.0, 0, 0, False, tail_row + (kb - pool_first) * _BLOCK)
        else:
            whole, pre_keys, tail_from, edge = _key_block_bias(kb, key_bias, HAS_SUFFIX)
            pooled = False
            if HAS_TAIL:
                pooled = kb >= pool_first
                whole = gl.where(pooled, 0.0, whole)  # (past the keys a suffix would cover every pooled tile)
            return kb, sc, (whole, pre_keys, tail_from, edge, pooled)

    @gluon.jit
    def _row_sums_issue(p8, ones_smem, l_zero, pl_layout: gl.constexpr):
        """Issue the block's row sums ``P8 @ ones`` (N = 8, every column the sum; async, fresh
        accumulator: the running sum stays in fp32 registers)."""
        return warpgroup_mma(gl.convert_layout(p8, pl_layout, assert_trivial=True), ones_smem.permute((1, 0)),
                             l_zero, use_acc=False, is_async=True)

    @gluon.jit
    def _plus_key_weights(s, weights, sc, SC_ROWS: gl.constexpr):
        """``s + weights / sc`` for logits ``s`` (``[R, 128]`` in units of ``1 / sc``) and per-key ``weights``
        (``[128]``); ``sc`` a scalar, or with ``SC_ROWS`` one per row."""
        if SC_ROWS:
            s = s + weights[None, :] * (1.0 / sc)[:, None]
        else:
            s = s + (weights * (1.0 / sc))[None, :]
        return s

    @gluon.jit
    def _key_terms(s, sc, kb, terms, offs_n, Lk, num_kv_blocks, key_bias, tail_row, pool_first, TAIL_K: gl.constexpr,
                   HAS_BIAS: gl.constexpr, HAS_SUFFIX: gl.constexpr, HAS_TAIL: gl.constexpr, POOLED: gl.constexpr,
                   SC_ROWS: gl.constexpr):
        """Key block ``kb``'s per-key terms added to its logits ``s`` (``[R, 128]`` in units of ``1 / sc``; ``sc``
        a scalar, or with ``SC_ROWS`` one per row): ``-inf`` for keys past ``Lk`` in the partial last block; on
        a tile of pooled keys (``HAS_TAIL``) the tile's row of the bias table; on the one block a prefix or
        suffix edge crosses (``HAS_BIAS`` / ``HAS_SUFFIX``), the bias of its keys inside. Each ``bias / sc``, in a
        branch only such blocks take (``terms`` from :func:`_block_terms`). ``POOLED`` (a tile of pooled keys,
        known when compiled): its weights alone, from the address in ``terms``, no branch."""
        whole, pre_keys, tail_from, edge, pooled = terms
        if POOLED:
            s = _plus_key_weights(s, gl.load(pooled + offs_n), sc, SC_ROWS)
        else:
            prefix_bias = key_bias[1]
            suffix_bias = key_bias[3]
            if TAIL_K:
                if kb == num_kv_blocks - 1:
                    s = gl.where((kb * _BLOCK + offs_n < Lk)[None, :], s, float("-inf"))
            if HAS_TAIL:
                if pooled:
                    s = _plus_key_weights(s, gl.load(tail_row + (kb - pool_first) * _BLOCK + offs_n), sc, SC_ROWS)
            if HAS_BIAS:
                if edge:  # per key: the prefix's last (partial) block, the suffix's first
                    keys = gl.where((offs_n < pre_keys) & (pre_keys < _BLOCK), prefix_bias, 0.0)
                    if HAS_SUFFIX:
                        keys = keys + gl.where((offs_n >= tail_from) & (tail_from > 0), suffix_bias, 0.0)
                    if SC_ROWS:
                        s = s + keys[None, :] * (1.0 / sc)[:, None]
                    else:
                        s = s + (keys / sc)[None, :]
        return s

    @gluon.jit
    def _softmax_block(s, m_i, sc, kb, terms, offs_n, Lk, num_kv_blocks, key_bias, tail_row, pool_first,
                       TAIL_K: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_SUFFIX: gl.constexpr,
                       HAS_TAIL: gl.constexpr, POOLED: gl.constexpr):
        """Online softmax over key block ``kb``'s wgmma output ``s`` (``sc`` = sq * sk > 0, folded in after
        the row max; ``terms`` from :func:`_block_terms`): returns ``(P, m, alpha)`` with ``P`` =
        ``exp2(s * sc - m + P_SHIFT)`` as e4m3 (row maximum 2^P_SHIFT) straight from the FFMA's bits (see the
        comment below), the new row max and ``alpha`` = the old accumulator's and row sums' rescale factor.
        Keys past ``Lk`` in the partial last block get -inf. ``HAS_BIAS`` (``HAS_SUFFIX``): keys
        ``< prefix_len`` get ``prefix_bias`` (log2 units) added to their scaled logit, and keys
        ``>= suffix_start`` ``suffix_bias``: a block wholly inside the prefix / suffix takes it as one
        per-row term in the row maximum and the shift, the one block an edge crosses also as ``bias / sc``
        added to those elements of ``s``. ``HAS_TAIL``: on a tile of pooled keys (``pooled``), each key's
        term from the tile's row of the bias table (``tail_row``: log2 units, ``-inf`` where the row keeps
        the block or past the last) enters as ``bias / sc`` added to ``s`` before the row maximum
        (``-inf``: P's saturating byte is 0, the row maximum ignores it); ``POOLED``: the block is such a tile.
        """
        whole = terms[0]
        s = _key_terms(s, sc, kb, terms, offs_n, Lk, num_kv_blocks, key_bias, tail_row, pool_first, TAIL_K,
                       HAS_BIAS, HAS_SUFFIX, HAS_TAIL, POOLED, False)
        if HAS_BIAS:  # exp2(s * sc + b - m + shift), the block's uniform bias b in the row terms
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * sc + whole)
            shift = _P_SHIFT + whole - m_new
        else:
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * sc)
            shift = _P_SHIFT - m_new
        alpha = gl.exp2(m_i - m_new)
        # P's e4m3 byte read off an fp32 bit pattern: k = round(8 x + 56 + P_BITS_OFFSET) is the byte of
        # 2^(k // 8 - 7) * (1 + (k % 8) / 8), i.e. exp2(x) with the mantissa linear between powers of two;
        # x <= P_SHIFT = 8 keeps k <= 120 (256). k / 128 is saturated to [0, 1] by the FFMA (the clamp at 0
        # on the FMA pipe, not the ALU's max), then adding 1.5 * 2^23 to 128 u leaves k in the low bits.
        # The row sum is left to the tensor cores (P8 @ ones in the consumer), so it is exactly the sum of
        # the P that multiplies V.
        u = _fma_sat(s, sc * (8.0 / 128.0), shift * (8.0 / 128.0) + (56.0 + P_BITS_OFFSET) / 128.0)
        y = u * 128.0 + 12582912.0
        p = y.to(gl.int32, bitcast=True).to(gl.int8).to(gl.float8e4nv, bitcast=True)
        return p, m_new, alpha

    @gluon.jit
    def _softmax_block_int8(s, m_i, sc, kb, terms, offs_n, Lk, num_kv_blocks, key_bias, tail_row, pool_first,
                            TAIL_K: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_SUFFIX: gl.constexpr,
                            HAS_TAIL: gl.constexpr, POOLED: gl.constexpr):
        """The INT8 path's softmax over key block ``kb`` (``s``: the int32 ``Q8 @ K8^T``; ``sc`` = the rows' ``sq *
        sk`` > 0, ``[R]``; masks, biases and ``terms`` as in :func:`_softmax_block`): returns ``(P, m, alpha,
        beta)`` with ``P`` = the int8 operand ``level - 128`` of the uint8 levels ``round(255 * 2^(S - m_tile))``
        relative to the block's own row maximum ``m_tile`` (8 bits keep P's small values: one block spans few
        binades), the new row maximum ``m``, ``alpha = 2^(m_old - m)`` (the accumulator's and row sums' rescale)
        and ``beta = 2^(m_tile - m)`` (the block's weight). ``S`` stays in the dot's units offset by 1.5 * 2^23
        (the int32 becomes that float by one integer add: no conversion instruction), biases enter as
        ``bias / sc``, and the exponent is one FFMA ``x * sc - x_max * sc``."""
        whole = terms[0]
        x = (s + _MAGIC_BITS).to(gl.float32, bitcast=True)  # the dot + 1.5 * 2^23, exact (|dot| < 2^22)
        x = _key_terms(x, sc, kb, terms, offs_n, Lk, num_kv_blocks, key_bias, tail_row, pool_first, TAIL_K,
                       HAS_BIAS, HAS_SUFFIX, HAS_TAIL, POOLED, True)
        x_max = gl.max(x, axis=1)
        m_tile = (x_max - _MAGIC) * sc
        if HAS_BIAS:
            m_tile = m_tile + whole
        m_tile = gl.maximum(m_tile, -1.0e30)  # a row with no key in this block: finite, weight 0 below
        m_new = gl.maximum(m_i, m_tile)
        alpha = gl.exp2(m_i - m_new)
        beta = gl.exp2(m_tile - m_new)
        # -inf (a row with no key here) -> 0, so the FFMA's -inf * sc - 0 stays -inf (no inf - inf); a finite x_max
        # is kept as it is, negative too (a strongly negative key bias on tiny logits can take x below 0)
        x_ref = gl.where(x_max > float("-inf"), x_max, 0.0) * sc
        # one FFMA rounds 255 p - 128 to an integer (to nearest) in the low bits of a float near 1.5 * 2^23:
        # its low byte is the int8 operand (level 0, a masked key, is -128)
        rounded = gl.exp2(x * sc[:, None] - x_ref[:, None]) * 255.0 + (_MAGIC - 128.0)
        p = rounded.to(gl.int32, bitcast=True).to(gl.int8)
        return p, m_new, alpha, beta

    @gluon.jit
    def _p_operand(p, p_layout: gl.constexpr):
        """P (e4m3, wgmma accumulator layout) as the A operand of ``P @ V`` with no data movement.

        In the accumulator layout a thread holds, of each 16 key columns, ``8a + 2t + b`` (a, b in {0, 1},
        t = lane % 4); the 8-bit A operand wants ``4t + 2a + b`` in the same registers. Relabelling the key
        axis by that permutation (a reshape / permute, free in registers) makes the two layouts one, and
        the pre-pass stores V^T with its keys in the same order (``v_key_order="wgmma"``), so the product
        is unchanged."""
        ROWS: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        p8 = gl.reshape(p, [ROWS, N // 16, 2, 4, 2])
        p8 = gl.permute(p8, [0, 1, 3, 2, 4])
        p8 = gl.reshape(p8, [ROWS, N])
        return gl.convert_layout(p8, p_layout, assert_trivial=True)

    @gluon.jit
    def _key_block(j, carry, blocks, ring, key_bias, pool_first, lengths, offsets, zeros, STAGES: gl.constexpr,
                   TAIL_K: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_SUFFIX: gl.constexpr, TAIL: gl.constexpr,
                   POOLED: gl.constexpr, LATE_LOADS: gl.constexpr, SQ_LOAD: gl.constexpr, INT8: gl.constexpr,
                   HEAD_DIM: gl.constexpr, P_LAYOUT: gl.constexpr, PL_LAYOUT: gl.constexpr, ROW_O: gl.constexpr,
                   ROW_L: gl.constexpr):
        """One consumer's step over the tile's ``j``-th listed key block: ``Q @ K^T``, the softmax, ``P @ V`` and
        the row sums, added to ``carry`` = (O, l, m, key blocks consumed so far), which it returns. ``blocks`` =
        the tile's (block list row, Q scale(s) or with ``SQ_LOAD`` its address, K scale row, Q operand, bias-table
        row, INT8: V sums row); ``ring`` = (K stages, V^T stages, the row-sum GEMM's ones, k_ready, v_ready,
        kv_empty); ``zeros`` = the wgmmas' (S, O, l) accumulators. ``TAIL``: the
        block may be a tile of pooled keys (their weights' branch is compiled in); ``POOLED``: it is one (the
        pooled tiles' own loop). ``LATE_LOADS`` (FP8 only): the block's loads (index, K scale, with ``SQ_LOAD``
        Q's scale) are issued after ``Q @ K^T`` is, not before."""
        acc, l_acc, m_i, kctr = carry
        idx_row, sq, k_scale_row, q, tail_row, vsum_row = blocks
        k_smem, v_smem, ones_smem, k_ready, v_ready, kv_empty = ring
        s_zero, o_zero, l_zero = zeros
        offs_n, offs_d = offsets
        Lk, num_kv_blocks = lengths[1], lengths[2]
        if not LATE_LOADS:
            kb, sc, terms = _block_terms(idx_row, j, sq, k_scale_row, key_bias, pool_first, tail_row, HAS_SUFFIX,
                                         TAIL, POOLED, False)
            if INT8:  # 128 x the block's V sums, plus 1.5 * 2^23's bits: the int32 P @ V's starting value below
                v_bits = gl.load(vsum_row + kb * HEAD_DIM + offs_d) * 128 + _MAGIC_BITS
        st = kctr % STAGES
        ph = (kctr // STAGES) & 1
        mbarrier.wait(k_ready.index(st), ph)
        s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if LATE_LOADS:
            kb, sc, terms = _block_terms(idx_row, j, sq, k_scale_row, key_bias, pool_first, tail_row, HAS_SUFFIX,
                                         TAIL, POOLED, SQ_LOAD)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        if INT8:
            p, m_i, alpha, beta = _softmax_block_int8(s, m_i, sc, kb, terms, offs_n, Lk, num_kv_blocks, key_bias,
                                                      tail_row, pool_first, TAIL_K, HAS_BIAS, HAS_SUFFIX, TAIL,
                                                      POOLED)
        else:
            p, m_i, alpha = _softmax_block(s, m_i, sc, kb, terms, offs_n, Lk, num_kv_blocks, key_bias, tail_row,
                                           pool_first, TAIL_K, HAS_BIAS, HAS_SUFFIX, TAIL, POOLED)
        p8 = _p_operand(p, P_LAYOUT)
        mbarrier.wait(v_ready.index(st), ph)
        # two-level accumulation (SageAttention 2's form): each block's P @ V and row sums into a fresh wgmma
        # accumulator, added to O and l in fp32 registers. An FP8 wgmma accumulates in fewer mantissa bits
        # (truncating); chained through it across key blocks, O shrank (~2% on attention-like inputs, up to 57%
        # where V has a large common part)
        if INT8:  # the int32 accumulator starts at v_bits, so the product arrives with both added (an integer add
            # after it, 64 per thread and block, made the kernel 19% slower on a 720p full map: 190 against 160 ms)
            pv = warpgroup_mma(p8, v_smem.index(st).permute((1, 0)), o_zero + v_bits[None, :], use_acc=True,
                               is_async=True)
        else:
            pv = warpgroup_mma(p8, v_smem.index(st).permute((1, 0)), o_zero, use_acc=False, is_async=True)
        l_blk = _row_sums_issue(p8, ones_smem, l_zero, PL_LAYOUT)
        if INT8:
            # the block's P @ V arrives as a float offset by 1.5 * 2^23 (below): its weight times the offset leaves
            # O here, in the FFMA that rescales it (overlapping the MMAs), so the float needs no subtraction; the
            # rounding this adds, ~beta in the product's integer units, is far below the ~1e2 units of P's own
            beta_o = gl.convert_layout(beta, ROW_O)
            acc = acc * gl.convert_layout(alpha, ROW_O)[:, None] - (beta_o * _MAGIC)[:, None]
        else:
            acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]  # overlaps the MMAs
        pv, l_blk = warpgroup_mma_wait(num_outstanding=0, deps=[pv, l_blk])
        if INT8:
            # sum_k level_k v_k = sum_k (level_k - 128) v_k + 128 * sum_k v_k, exact in int32 (< 2^22), is, with
            # 1.5 * 2^23's bits added (the accumulator's start), the fp32 value plus 1.5 * 2^23; the level sums
            # likewise (+ 128 per key)
            acc = acc + pv.to(gl.float32, bitcast=True) * beta_o[:, None]
            levels = (l_blk + _MAGIC_BITS).to(gl.float32, bitcast=True) - (_MAGIC - 128.0 * _BLOCK)
            l_acc = (l_acc * gl.convert_layout(alpha, ROW_L)[:, None]
                     + levels * gl.convert_layout(beta, ROW_L)[:, None])
        else:
            acc = acc + pv
            l_acc = l_acc * gl.convert_layout(alpha, ROW_L)[:, None] + l_blk
        mbarrier.arrive(kv_empty.index(st), count=1)
        return acc, l_acc, m_i, kctr + 1

    @gluon.jit
    def _consumer(out_args, q_args, kv_args, bars, walk, lengths, key_bias, tail,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, Q_STAGES: gl.constexpr, CONSUMER: gl.constexpr,
                  TAIL_K: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_SUFFIX: gl.constexpr, HAS_PERM: gl.constexpr,
                  Q_KERNEL: gl.constexpr, HAS_TAIL: gl.constexpr, INT8: gl.constexpr, POOLED_LOOP: gl.constexpr):
        """Consumer warpgroup ``CONSUMER`` (0 / 1): query rows ``[64 * CONSUMER, 64 * CONSUMER + 64)`` of
        every tile of the walk. ``out_args`` = (output pointer, its TMA descriptor, this consumer's store
        buffer, token_perm, the output's strides b / h / l); ``q_args`` = (Q's stages, this consumer's e4m3 Q
        buffer, softmax scale * log2(e), the pre-pass's Q scales and their count per (b, h)); ``kv_args`` =
        (K stages, V^T stages, the 8-bit ones of the row-sum GEMM, K scales, V's per-channel scales, K scales
        per (b, h), and for ``INT8`` V's int32 channel sums per key block, the pooled values' scale over V's and
        the sums' blocks per (b, h)); ``bars`` = (q_ready, q_empty, k_ready, v_ready, kv_empty); ``walk`` as in
        :func:`_tile_of`; ``lengths`` = (Lq, Lk, key blocks); ``key_bias`` as in :func:`_key_block_bias`;
        ``tail`` = (the pooled tail's bias table, its row width, the first pooled tile's block index).
        ``INT8``: the accurate path's numerics (:func:`_softmax_block_int8`; Q from the INT8 pre-pass with one
        scale per row; int32 products, each block's ``P @ V`` and level sums corrected by ``128 *`` the block's
        V sums and added to O and l with the block's weight ``beta``). ``POOLED_LOOP`` (with ``HAS_TAIL``; always
        with ``INT8``): the pooled tiles in a loop of their own after the kept blocks, which then run the loop
        they run without the tail; FP8 there also issues each block's loads after its ``Q @ K^T``. Only an
        assembler of :mod:`._ptxas`'s choice gets FP8's form right (see :func:`launch_ws`)."""
        o_ptr, o_desc, o_smem, token_perm, s_ob, s_oh, s_ol = out_args
        q_smem, q8_smem, q_mult, q_scale, n_q_scale = q_args
        k_smem, v_smem, ones_smem, k_scale, v_scale, n_k_scale, v_sums, pool_ratio, n_v_tiles = kv_args
        q_ready, q_empty, k_ready, v_ready, kv_empty = bars
        num_tiles = walk[6]
        Lq, Lk, num_kv_blocks = lengths
        tail_bias, tail_width, pool_first = tail
        ROWS: gl.constexpr = _ROWS
        late_loads: gl.constexpr = POOLED_LOOP and not INT8
        sq_load: gl.constexpr = POOLED_LOOP and not INT8 and not Q_KERNEL
        # wgmma accumulator layouts (M = 64 rows over 4 warps; K = 32 for 8-bit operands) and the
        # register layout of P as the A operand of P @ V
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _BLOCK, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _ONES, 32])
        pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=4)
        # a token order's output stores: 8 consecutive 16-bit channels per thread, a warp over whole rows
        vec_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
        row_l: gl.constexpr = gl.SliceLayout(1, l_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        offs_n = gl.arange(0, _BLOCK, layout=gl.SliceLayout(0, s_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
        if INT8:  # the wgmma accumulators: int32 products of int8 operands
            s_zero = gl.zeros([ROWS, _BLOCK], gl.int32, layout=s_layout)
            l_zero = gl.zeros([ROWS, _ONES], gl.int32, layout=l_layout)
            o_zero = gl.zeros([ROWS, HEAD_DIM], gl.int32, layout=o_layout)
        else:
            s_zero = gl.zeros([ROWS, _BLOCK], gl.float32, layout=s_layout)
            l_zero = gl.zeros([ROWS, _ONES], gl.float32, layout=l_layout)
            o_zero = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        zeros = (s_zero, o_zero, l_zero)
        ring = (k_smem, v_smem, ones_smem, k_ready, v_ready, kv_empty)

        kctr = 0  # key blocks consumed so far (all tiles): stage = kctr % STAGES, parity = (kctr // STAGES) & 1
        qt = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            b, h, bh, qblk, n_kv, idx_row, map_row = _tile_of(t, walk, HAS_TAIL)
            k_scale_row = k_scale + bh * n_k_scale
            tail_row = tail_bias + map_row * tail_width  # (HAS_TAIL: this query block's row of the bias table)
            if HAS_TAIL:
                _prefetch_row(tail_row, tail_width)
            vsum_row = v_sums + bh * n_v_tiles * HEAD_DIM  # (INT8 only)
            if POOLED_LOOP:  # the listed key blocks before the first pooled tile
                n_kept = n_kv - gl.load(walk[3] + map_row)
            qs = qt % Q_STAGES
            if Q_KERNEL:
                mbarrier.wait(q_ready.index(qs), (qt // Q_STAGES) & 1)
                # this consumer's 64 rows to e4m3 with one scale: q * q_mult / sq, sq = absmax * q_mult / 448
                # (1 if all zero); the stage is free once the rows are in registers
                xq = q_smem.index(qs).reshape([_BLOCK, HEAD_DIM]).slice(CONSUMER * ROWS, ROWS, dim=0).load(o_layout)
                mbarrier.arrive(q_empty.index(qs), count=1)
                xq = xq.to(gl.float32)
                amax = gl.max(gl.max(gl.abs(xq), axis=1), axis=0)
                q8_smem.store((xq * gl.where(amax > 0, 448.0 / amax, 1.0)).to(gl.float8e4nv))
                fence_async_shared()
                _cta_barrier()  # every warp's rows are written before the warpgroup's wgmma reads them
                sq = gl.where(amax > 0, amax * (q_mult / 448.0), 1.0)
                q = q8_smem
            else:
                if INT8:  # one scale per query row
                    sq = gl.load(q_scale + bh * n_q_scale + qblk * _BLOCK + CONSUMER * ROWS
                                 + gl.arange(0, ROWS, layout=row_s))
                elif late_loads:  # its address: each key block's step loads it after its Q @ K^T is issued
                    sq = q_scale + bh * n_q_scale + qblk
                else:
                    sq = gl.load(q_scale + bh * n_q_scale + qblk)
                mbarrier.wait(q_ready.index(qs), (qt // Q_STAGES) & 1)
                q = q_smem.index(qs).slice(CONSUMER * ROWS, ROWS, dim=0)

            m_i = gl.full([ROWS], -1.0e30, gl.float32, layout=row_s)  # finite: no NaN from a masked row
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            l_acc = gl.zeros([ROWS, _ONES], gl.float32, layout=l_layout)  # the row sums, every column
            blocks = (idx_row, sq, k_scale_row, q, tail_row, vsum_row)
            n_first = n_kv
            if POOLED_LOOP:  # the kept blocks first, in a loop without the pooled tiles' code (below)
                n_first = n_kept
            for j in range(0, n_first):
                acc, l_acc, m_i, kctr = _key_block(j, (acc, l_acc, m_i, kctr), blocks, ring, key_bias, pool_first,
                                                   lengths, (offs_n, offs_d), zeros, STAGES, TAIL_K, HAS_BIAS,
                                                   HAS_SUFFIX, HAS_TAIL and not POOLED_LOOP, False, late_loads,
                                                   sq_load, INT8, HEAD_DIM, p_layout, pl_layout, row_o, row_l)
            if POOLED_LOOP:
                # the pooled tiles in a loop of their own: in the kept blocks' loop their weights' branch, even
                # never taken, cost INT8 15% (a full map at 720p: 220 against 192 ms) and FP8 its tail 1.0-1.4 ms
                # more at 720p, 15% (with the loads issued after Q @ K^T). INT8's pooled values are in units of
                # their own per-channel scale (the ratio of it over V's): O moves to those units once here and
                # back after the last (a multiply per block would cost the kept blocks too)
                if INT8:
                    if n_first < n_kv:
                        acc = acc * (1.0 / gl.load(pool_ratio + bh * HEAD_DIM + offs_d))[None, :]
                for j in range(n_first, n_kv):
                    acc, l_acc, m_i, kctr = _key_block(j, (acc, l_acc, m_i, kctr), blocks, ring, key_bias, pool_first,
                                                       lengths, (offs_n, offs_d), zeros, STAGES, TAIL_K, HAS_BIAS,
                                                       HAS_SUFFIX, INT8, not INT8, late_loads, sq_load, INT8,
                                                       HEAD_DIM, p_layout, pl_layout, row_o, row_l)
            if not Q_KERNEL:
                mbarrier.arrive(q_empty.index(qs), count=1)  # this consumer's Q rows are no longer read
            qt += 1

            l_i = gl.convert_layout(gl.max(l_acc, axis=1), row_s)
            l_safe = gl.where(l_i > 0, l_i, 1.0)
            out = acc * gl.convert_layout(1.0 / l_safe, row_o)[:, None]
            out = out * gl.load(v_scale + bh * HEAD_DIM + offs_d)[None, :]  # per-channel V scales
            if INT8:
                if HAS_TAIL:
                    if n_kept < n_kv:  # O is in the pooled values' units (above)
                        out = out * gl.load(pool_ratio + bh * HEAD_DIM + offs_d)[None, :]
            if not HAS_PERM:
                # the tile through this consumer's shared buffer and one TMA store, which runs on while
                # the next tile starts (rows past Lq fall outside the descriptor and are not written);
                # the buffer is rewritten only once the previous tile's store has read it
                tma.store_wait(0)
                o_smem.reshape([ROWS, HEAD_DIM]).store(out.to(o_ptr.dtype.element_ty))
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [b, h, qblk * _BLOCK + CONSUMER * ROWS, 0], o_smem)
            else:
                # a token order: each row back to the input row it came from (the pre-pass gathered by it),
                # 16 bytes per thread and store (whole rows per warp) instead of the accumulator's 4
                out = gl.convert_layout(out.to(o_ptr.dtype.element_ty), vec_layout)
                rows = qblk * _BLOCK + CONSUMER * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, vec_layout))
                cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, vec_layout))
                dst = gl.minimum(gl.maximum(gl.load(token_perm + rows, mask=rows < Lq, other=0), 0), Lq - 1)
                o_ptrs = o_ptr + b * s_ob + h * s_oh + dst[:, None] * s_ol + cols[None, :]
                gl.store(o_ptrs, out, mask=(rows < Lq)[:, None])
        if not HAS_PERM:
            tma.store_wait(0)  # the last tile's store has left shared memory before the CTA exits

    @gluon.jit
    def _bsa_ws_kernel(q_desc, k_desc, v_desc, O, o_desc, q_mult, q_scale, k_scale, v_scale, kv_num, kv_idx, sched,
                       H, Lq, Lk, lpad_q, lpad_k, num_kv_blocks, q_blocks, num_tiles, n_q_scale, n_k_scale,
                       prefix_len, prefix_bias, suffix_start, suffix_bias, token_perm, s_ob, s_oh, s_ol, s_nb, s_nh,
                       s_ib, s_ih, s_iq, tail_num, tail_bias, tail_width, pool_first, v_sums, pool_ratio, n_v_tiles,
                       HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, Q_STAGES: gl.constexpr,
                       TAIL_K: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_SUFFIX: gl.constexpr,
                       HAS_PERM: gl.constexpr, Q_KERNEL: gl.constexpr, HAS_TAIL: gl.constexpr, INT8: gl.constexpr,
                       POOLED_LOOP: gl.constexpr):
        # the B operand of the row-sum GEMM: 8-bit ones (e4m3's byte 0x38; int8 1), any swizzle holds them
        ones_regs: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        if INT8:
            ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ONES, _BLOCK], gl.int8)
            ones = gl.full([_ONES, _BLOCK], 1, gl.int8, layout=ones_regs)
            ones_smem = gl.allocate_shared_memory(gl.int8, [_ONES, _BLOCK], ones_layout, ones)
        else:
            ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ONES, _BLOCK], gl.float8e4nv)
            ones = gl.full([_ONES, _BLOCK], 0x38, gl.int8, layout=ones_regs).to(gl.float8e4nv, bitcast=True)
            ones_smem = gl.allocate_shared_memory(gl.float8e4nv, [_ONES, _BLOCK], ones_layout, ones)
        fence_async_shared()
        if Q_KERNEL:  # Q's input rows [1, 1, 128, D] per stage, and each consumer's e4m3 copy of its 64
            q_smem = gl.allocate_shared_memory(q_desc.block_type.element_ty, [Q_STAGES] + q_desc.block_type.shape,
                                               q_desc.layout)
            q8_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, HEAD_DIM], gl.float8e4nv)
            q8_smem0 = gl.allocate_shared_memory(gl.float8e4nv, [_ROWS, HEAD_DIM], q8_layout)
            q8_smem1 = gl.allocate_shared_memory(gl.float8e4nv, [_ROWS, HEAD_DIM], q8_layout)
        else:  # the pre-pass's 8-bit tiles (q8_smem*: never used)
            q_smem = gl.allocate_shared_memory(q_desc.block_type.element_ty, [Q_STAGES, _BLOCK, HEAD_DIM],
                                               q_desc.layout)
            q8_smem0 = gl.allocate_shared_memory(gl.float8e4nv, [1, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            q8_smem1 = q8_smem0
        k_smem = gl.allocate_shared_memory(k_desc.block_type.element_ty, [STAGES, _BLOCK, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.block_type.element_ty, [STAGES, HEAD_DIM, _BLOCK], v_desc.layout)
        if not HAS_PERM:  # each consumer's staging buffer of its output rows, [1, 1, 64, D]
            o_smem0 = gl.allocate_shared_memory(O.dtype.element_ty, o_desc.block_type.shape, o_desc.layout)
            o_smem1 = gl.allocate_shared_memory(O.dtype.element_ty, o_desc.block_type.shape, o_desc.layout)
        else:  # never used
            o_smem0 = gl.allocate_shared_memory(O.dtype.element_ty, [1, 1, 1, 8],
                                                gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
            o_smem1 = o_smem0
        q_ready = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(Q_STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # one arrive per consumer
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
        bars = (q_ready, q_empty, k_ready, v_ready, kv_empty)
        walk = (sched, kv_num, kv_idx, tail_num, H, q_blocks, num_tiles, s_nb, s_nh, s_ib, s_ih, s_iq)
        kv_args = (k_smem, v_smem, ones_smem, k_scale, v_scale, n_k_scale, v_sums, pool_ratio, n_v_tiles)
        lengths = (Lq, Lk, num_kv_blocks)
        key_bias = (prefix_len, prefix_bias, suffix_start, suffix_bias)
        tail = (tail_bias, tail_width, pool_first)
        gl.warp_specialize([
            (_producer, ((q_desc, k_desc, v_desc), (q_smem, k_smem, v_smem), bars, walk, lpad_q, lpad_k, HEAD_DIM,
                         STAGES, Q_STAGES, Q_KERNEL, HAS_TAIL)),
            (_consumer, ((O, o_desc, o_smem0, token_perm, s_ob, s_oh, s_ol), (q_smem, q8_smem0, q_mult, q_scale,
                         n_q_scale), kv_args, bars, walk, lengths, key_bias, tail, HEAD_DIM, STAGES, Q_STAGES, 0, TAIL_K, HAS_BIAS,
                         HAS_SUFFIX, HAS_PERM, Q_KERNEL, HAS_TAIL, INT8, POOLED_LOOP)),
            (_consumer, ((O, o_desc, o_smem1, token_perm, s_ob, s_oh, s_ol), (q_smem, q8_smem1, q_mult, q_scale,
                         n_q_scale), kv_args, bars, walk, lengths, key_bias, tail, HEAD_DIM, STAGES, Q_STAGES, 1, TAIL_K, HAS_BIAS,
                         HAS_SUFFIX, HAS_PERM, Q_KERNEL, HAS_TAIL, INT8, POOLED_LOOP)),
        ], [4, 4], [_REGS, _REGS])


def kernel_form(pooled_tail: bool, int8: bool, assembler: Assembler | None | str = "auto"):
    """``(POOLED_LOOP, ptxas)`` of the kernel a call builds: whether it runs the pooled tiles in a loop of their
    own (always with the tail under ``int8``; for FP8 only when its ptxas assembles that form right, since an
    older one gets it wrong on a query block that keeps nothing: :func:`._ptxas.pooled_loop_right`) and the
    ptxas that builds it. ``assembler``: an :class:`._ptxas.Assembler`, None (Triton's knob as it stands), or
    ``"auto"``: the one :func:`._ptxas.kernel_ptxas` pins for the variant."""
    if assembler == "auto":
        assembler = kernel_ptxas(bool(int8))
    own_loop = bool(pooled_tail) and (bool(int8) or pooled_loop_right(assembler))
    return own_loop, assembler


def shared_layouts(head_dim: int, int8: bool = False):
    """NVMMA shared layouts of the Q/K tile ``[128, D]`` and the V^T tile ``[D, 128]`` (e4m3, or int8)."""
    dtype = gl.int8 if int8 else gl.float8e4nv
    return (gl.NVMMASharedLayout.get_default_for([BLOCK, head_dim], dtype),
            gl.NVMMASharedLayout.get_default_for([head_dim, BLOCK], dtype))


def tma_compatible(x: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address ``x`` as it is: 16-byte aligned base and strides, unit last stride."""
    size = x.element_size()
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in x.stride()[:-1])


def prepass_quantizes_q(q: torch.Tensor, token_perm) -> bool:
    """Whether the FP8 call's pre-pass quantises Q rather than the kernel reading its input rows: a token order
    gathers Q's rows, and a TMA descriptor needs 16-byte aligned strides (:func:`tma_compatible`)."""
    return token_perm is not None or not tma_compatible(q)


def rows_block(rows: int, head_dim: int, dtype: torch.dtype):
    """Block shape ``[1, 1, rows, D]`` and NVMMA shared layout of a TMA descriptor over a bf16 / fp16
    ``[B, H, L, D]`` tensor: Q's input rows (``rows`` 128) and the output (64, one consumer's rows)."""
    block = [1, 1, rows, head_dim]
    return block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def rows_descriptor(x: torch.Tensor, rows: int):
    """TMA descriptor of ``x`` ``[B, H, L, D]`` as it is (any 16-byte aligned strides with unit stride on D:
    ComfyUI's ``[B, L, H, D]`` memory too; see :func:`tma_compatible`) in :func:`rows_block` blocks; rows
    past ``L`` are zeros on load and dropped on store."""
    block, layout = rows_block(rows, x.shape[3], x.dtype)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


def launch_ws(q, k, v, block_map, scale: float, config: WsConfig | None = None, prefix_len: int = 0,
              prefix_bias: float = 0.0, token_perm: torch.Tensor | None = None, suffix_len: int = 0,
              suffix_bias: float = 0.0, pooled_tail: bool = False, int8: bool = False,
              assembler: Assembler | None | str = "auto") -> torch.Tensor:
    """Pre-pass + block lists + the warp-specialised kernel, for one int32-safe chunk
    (``prefix_bias`` in natural-log units; a zero bias or length compiles the unbiased kernel;
    ``token_perm`` int32 ``[L]`` on q's device or None; ``pooled_tail``: the pre-pass appends the pooled
    keys, the block lists their tiles, and the kernel is compiled with ``HAS_TAIL``; ``int8``: the INT8
    pre-pass (:mod:`._quant_int8`, V^T in the wgmma key order) and the kernel compiled with ``INT8``;
    ``assembler``: the ptxas that builds the kernel, as :func:`kernel_form` takes it; ``"auto"``, the variant's
    pinned one, everywhere but benchmarks: Triton keeps one build of a variant per process, whichever built it
    first)."""
    cfg = config or WsConfig()
    if not isinstance(cfg, WsConfig):
        raise ValueError(f"config must be a WsConfig, got {type(cfg).__name__}")
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    suffix_start = check_key_biases(prefix_len, prefix_bias, suffix_len, suffix_bias, kv_len)
    has_bias = (prefix_len > 0 and prefix_bias != 0.0) or suffix_start < kv_len
    pool_block = BLOCK if pooled_tail else None
    if int8:  # Q rotated and quantised per row by the pre-pass
        q_kernel = False
        q8, k8, v8t, q_scale, k_scale, v_scale, v_sums, pool_ratio = quantize_qkv_int8(
            q, k, v, scale, token_perm=token_perm, pool_block=pool_block, v_key_order="wgmma")
        if pool_ratio is None:
            pool_ratio = v_scale  # (never read without the tail)
    else:
        q_kernel = not prepass_quantizes_q(q, token_perm)
        q8, k8, v8t, q_scale, k_scale, v_scale = quantize_qkv_fp8(q, k, v, scale, quantize_q=not q_kernel,
                                                                  v_key_order="wgmma", token_perm=token_perm,
                                                                  pool_block=pool_block)
        v_sums, pool_ratio = k_scale, v_scale  # (INT8 only: never read)
    lpad_q, lpad_k = padded_len(q_len), k8.shape[2]  # (lpad_k: rows per (b, h) of k8, the pooled ones included)
    num_q_blocks, num_kv_blocks = block_map.shape[2:]
    if pooled_tail:  # pooled tile p is key block padded_len(Lk) / 128 + p of k8 / v8t
        kv_num, kv_idx, sched, map_strides, tail = lpt_block_lists(block_map, tail_spec(
            kv_len, BLOCK, padded_len(kv_len) // BLOCK, prefix_len, prefix_bias, suffix_start, suffix_bias))
        tail_args = (tail.tail_num, tail.bias, tail.bias.shape[-1], padded_len(kv_len) // BLOCK)
    else:
        kv_num, kv_idx, sched, map_strides = lpt_block_lists(block_map)
        tail_args = (kv_num, k_scale, 0, 0)  # (never read)
    qk_layout, vt_layout = shared_layouts(head_dim, int8)
    if q_kernel:  # the input's own rows
        q_desc = rows_descriptor(q, BLOCK)
        q_scale = k_scale  # not read
    else:
        q_desc = TensorDescriptor.from_tensor(q8.view(-1, head_dim), [BLOCK, head_dim], qk_layout)
    k_desc = TensorDescriptor.from_tensor(k8.view(-1, head_dim), [BLOCK, head_dim], qk_layout)
    v_desc = TensorDescriptor.from_tensor(v8t.view(-1, lpad_k), [head_dim, BLOCK], vt_layout)
    out = output_like(q)
    o_desc = rows_descriptor(out, CONSUMER_ROWS)
    num_tiles = batch * heads * num_q_blocks
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    grid = (min(num_tiles, sms),)
    args = (q_desc, k_desc, v_desc, out, o_desc, float(scale * LOG2E), q_scale, k_scale, v_scale, kv_num, kv_idx,
            sched, heads, q_len, kv_len, lpad_q, lpad_k, num_kv_blocks, num_q_blocks, num_tiles,
            q_scale.shape[-1], k_scale.shape[-1], int(prefix_len) if has_bias else 0,
            float(prefix_bias) * LOG2E if has_bias else 0.0, suffix_start,
            float(suffix_bias) * LOG2E if suffix_start < kv_len else 0.0,
            k_scale if token_perm is None else token_perm, out.stride(0), out.stride(1), out.stride(2), *map_strides,
            *tail_args, v_sums, pool_ratio, v_sums.shape[2] if int8 else 0)
    consts = dict(HEAD_DIM=head_dim, STAGES=cfg.stages, Q_STAGES=cfg.q_stages, TAIL_K=kv_len % BLOCK != 0,
                  HAS_BIAS=has_bias, HAS_SUFFIX=suffix_start < kv_len, HAS_PERM=token_perm is not None,
                  Q_KERNEL=q_kernel, HAS_TAIL=bool(pooled_tail), INT8=bool(int8), num_warps=4)

    def launch(own_loop: bool):
        _bsa_ws_kernel[grid](*args, **consts, POOLED_LOOP=own_loop)

    # the variant's pinned ptxas builds it (a fixed one that fails is dropped for the process, and Triton's own
    # builds the form that suits it)
    run_assembled(kernel_form(pooled_tail, int8, assembler)[1],
                  lambda asm: launch(kernel_form(pooled_tail, int8, asm)[0]))
    return out


def block_sparse_attention_ws(q, k, v, block_map, scale: float, config: WsConfig | None = None, prefix_len: int = 0,
                              prefix_bias: float = 0.0, token_perm: torch.Tensor | None = None, suffix_len: int = 0,
                              suffix_bias: float = 0.0, pooled_tail: bool = False, int8: bool = False) -> torch.Tensor:
    """The warp-specialised kernel on a CUDA sm_90 device (module docstring: the contract); FP8, or with
    ``int8`` the accurate path's INT8 numerics.
    ``prefix_bias`` (natural-log units) is added to the scaled logits of keys ``[0, prefix_len)``,
    ``suffix_bias`` to those of the last ``suffix_len`` keys. ``token_perm`` (``Lq == Lk == L``; int32/int64
    ``[L]``, a permutation): attention runs on the tokens in that order (position ``i`` = input row
    ``token_perm[i]``; ``block_map`` and ``prefix_len`` in that order), fused into the pre-pass's loads and
    the output store; the output is in the input order. ``pooled_tail``: every key block a row's map skips
    enters its softmax as one pooled term. ``config``: a :class:`WsConfig` (None: the defaults).
    ``ValueError`` for inputs outside the contract; inputs whose offsets overflow int32 run in
    (batch, head) chunks."""
    _validate(q, k, v, block_map, BLOCK)
    why = supports(q.shape[3], BLOCK)
    if why:
        raise ValueError(why)
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        raise ValueError("the warp-specialised FP8 kernel needs a CUDA sm_90 (Hopper) device")
    check_key_biases(prefix_len, prefix_bias, suffix_len, suffix_bias, k.shape[2])
    token_perm = check_perm(token_perm, q, k)
    with torch.cuda.device(q.device):
        return run_in_int32_chunks(
            q, k, v, block_map, lambda q, k, v, bm: launch_ws(q, k, v, bm, scale, config, prefix_len, prefix_bias,
                                                              token_perm, suffix_len, suffix_bias, pooled_tail,
                                                              int8),
            tail_rows(k.shape[2], BLOCK) if pooled_tail else 0)


def compile_sm90(head_dim: int = 128, config: WsConfig | None = None, *, tail_k: bool = True, has_bias: bool = False,
                 has_suffix: bool = False, has_perm: bool = False, q_kernel: bool | None = None,
                 has_tail: bool = False, int8: bool = False, assembler: Assembler | None | str = "auto"):
    """The kernel variant :func:`launch_ws` builds for such a call, compiled ahead of time for sm_90 by this
    Triton (no GPU needed; bf16 inputs): ``tail_k`` a partial last key block, ``has_bias`` a prefix bias,
    ``has_suffix`` a suffix bias, ``has_perm`` a token order, ``q_kernel`` Q from its input rows (default:
    unless ``has_perm``; never with ``int8``), ``has_tail`` the pooled tail, ``int8`` the INT8 numerics;
    ``assembler``: an :class:`._ptxas.Assembler`, None (Triton's knob as it stands) or ``"auto"`` (the variant's
    pinned one, as :func:`launch_ws`): it picks the form and the ptxas that builds it (:func:`kernel_form`). Returns
    Triton's compiled kernel (``asm["ptx"]``, ``asm["cubin"]``, ``metadata``); raises whatever Triton raises when
    it cannot build it."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.experimental.gluon._runtime import GluonASTSource  # noqa: PLC0415

    cfg = config or WsConfig()
    q_kernel = not (has_perm or int8) if q_kernel is None else q_kernel
    qk_layout, vt_layout = shared_layouts(head_dim, int8)
    elem = "i8" if int8 else "fp8e4nv"

    def rows_desc_type(rows):  # rows_descriptor of a bf16 [B, H, L, D] tensor
        block, layout = rows_block(rows, head_dim, torch.bfloat16)
        return f"tensordesc<bf16[{', '.join(map(str, block))}],{layout!r}>"

    types = {"q_desc": rows_desc_type(BLOCK) if q_kernel else f"tensordesc<{elem}[{BLOCK}, {head_dim}],{qk_layout!r}>",
             "k_desc": f"tensordesc<{elem}[{BLOCK}, {head_dim}],{qk_layout!r}>",
             "v_desc": f"tensordesc<{elem}[{head_dim}, {BLOCK}],{vt_layout!r}>", "O": "*bf16",
             "o_desc": rows_desc_type(CONSUMER_ROWS), "prefix_bias": "fp32", "suffix_bias": "fp32", "q_mult": "fp32"}
    types.update({name: "*fp32" for name in ("q_scale", "k_scale", "v_scale", "tail_bias", "pool_ratio")})
    types.update({name: "*i32" for name in ("kv_num", "kv_idx", "sched", "token_perm", "tail_num", "v_sums")})
    consts = dict(HEAD_DIM=head_dim, STAGES=cfg.stages, Q_STAGES=cfg.q_stages, TAIL_K=tail_k,
                  HAS_BIAS=has_bias or has_suffix, HAS_SUFFIX=has_suffix, HAS_PERM=has_perm, Q_KERNEL=q_kernel,
                  HAS_TAIL=has_tail, INT8=int8)
    consts["POOLED_LOOP"], assembler = kernel_form(has_tail, int8, assembler)
    kernel = _bsa_ws_kernel
    sig = {name: "constexpr" if param.is_constexpr else types.get(name, "i32")
           for name, param in zip(kernel.arg_names, kernel.params)}
    # 16-byte divisibility of the output pointer and strides, of the pooled tail's bias table and its row
    # width (a multiple of 128) and of the INT8 path's V sums and pooled-value ratios, as the launcher's
    # specialisation gives them
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if n in ("O", "s_ob", "s_oh", "s_ol", "tail_bias", "tail_width", "v_sums", "pool_ratio")}
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    with assembling(assembler):
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


__all__ = ["block_sparse_attention_ws", "available", "supports", "compile_sm90", "kernel_form", "WsConfig", "BLOCK"]
