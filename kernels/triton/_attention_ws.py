"""Warp-specialised FP8 block-sparse attention for Hopper, in Gluon (Triton's tile-level language):
the ``triton_fp8_ws`` backend.

The numerics of the FP8 path of :mod:`._attention` (the same pre-pass of :mod:`._quant`, the same
block lists, the same K / V scales; with ``q_quant="prepass"`` and ``p_bits`` 0 the two agree to fp32
rounding, the defaults round P and Q's scale their own way, within the same FP8 bounds), laid out the
way FlashAttention-3 runs on sm_90:

- persistent: one CTA per SM walks the 128-row query tiles in (batch, head)-major, longest-row-first
  order, so the tiles in flight share a head's K/V in L2 and the long rows start first;
- three partitions: a producer (4 warps at 24 registers) issuing the TMA loads of Q (double-buffered
  across tiles; the input's own bf16 / fp16 rows by default, see ``Q_KERNEL``) and of each kept key
  block's K and V^T into a ring of ``STAGES`` shared-memory
  stages, and two consumer warpgroups (240 registers) that each own 64 query rows and share every
  stage; mbarriers hand stages over (``ready``: the TMA bytes landed; ``empty``: both consumers'
  wgmmas that read the stage retired);
- per consumer and key block: ``S = Q8 @ K8^T`` (FP8 wgmma, fp32 accumulation) scaled by
  ``sq * sk``, online softmax in log2 units with ``P = 2^(S - m + 8)`` (row maximum 256, inside
  e4m3) and ``O += P8 @ V8`` (FP8 wgmma, V^T stage K-major); P goes from the accumulator to the
  A-operand layout without moving data (:func:`_p_operand`: the pre-pass stores V^T's keys in the
  matching order).
- ``P_BITS`` (compile time; config ``p_bits``, 1 by default): P's e4m3 bytes come straight from the
  softmax's FFMA, no exp2 and no fp32 -> e4m3 conversion: ``k = round(8 x + 56)`` is the byte of
  ``2^(k // 8 - 7) * (1 + (k % 8) / 8)``, exp2 with the mantissa linear between powers of two
  (:func:`_softmax_block`); the row sums, which must be those of exactly these P, come from a second
  wgmma ``P8 @ ones`` (N = 8) per block, accumulated in fp32 registers. Measured +17% over the exp2
  path (``p_bits`` 0) on a full map and at 15% density (943-951 / 871-886 TFLOP/s at 720p), error
  within the FP8 bounds of the oracle (``docs/BENCHMARKS.md``, "2026-12-02"). ``p_bits`` 2 keeps the
  row term's fraction (one FADD more, slower, closer to the exp2 path); 0 is the exp2 path.
- ``P_SAT`` (config ``p_clamp``, ``"sat"`` by default; with ``p_bits`` 1 / 2): the clamp of ``k`` at 0
  is the FFMA's own saturation (``fma.rn.sat`` of ``k / 128``, then ``128 u + 1.5 * 2^23``: two FMA-pipe
  ops per element) instead of a max on the ALU pipe, which the row maximum and the byte packing keep
  busy; the row term keeps its fraction, as under ``p_bits`` 2. Measured +1-2% over ``"max"`` and
  closer to the exp2 path (``docs/BENCHMARKS.md``, "2026-12-02, second session").
- ``O_TMA`` (config ``o_store``, ``"tma"`` by default): each consumer writes its 64 output rows into its
  own shared buffer and issues one TMA store (a 4-D descriptor of the output, so ComfyUI's
  ``[B, L, H, D]`` memory works and rows past ``Lq`` are clipped by the descriptor), which runs on while
  the next tile starts; the buffer is rewritten only after ``store_wait``. ``O_VEC`` (``"vec"``; also what
  a token order uses, whose rows scatter): one layout conversion to 8 consecutive channels per thread,
  stored 16 bytes at a time; ``"regs"``: the accumulator layout's 4-byte stores. Measured: the stores
  cost 4% of a 5%-density call at 720p (ablation), ``"vec"`` +2% there, ``"tma"`` level to +4% more.
- ``Q_KERNEL`` (config ``q_quant``, ``"kernel"`` by default; ``"prepass"`` and any token order take Q from
  the pre-pass): the producer loads Q's input rows (a 4-D descriptor: any strides, rows past ``Lq``
  zero-filled) and each consumer converts its 64 rows to e4m3 once per tile, with one scale
  ``absmax * softmax_scale * log2(e) / 448`` for them (the pre-pass's Q tiles have one per 128 rows), into
  a shared buffer of its own; the Q stage is released as soon as the rows are in registers. The
  pre-pass then reads only K and V (0.92 instead of 1.18 ms at 720p). Measured: +1-6% at 5% density, -2
  to +2% at 15%, -0.3 to -1.6% on a full map (the in-kernel conversion costs up to ~1% of the kernel's
  time, cause not isolated).
- ``V_BLOCK`` (config ``v_scaling="block"``, off): per-tile power-of-two V scales ``2^e`` from the
  single-read pre-pass (V read once: 0.92 -> 0.66 ms at 720p). The accumulator is kept in the units of
  the V tile it last accumulated: before block j's ``P @ V8`` it is rescaled by ``alpha * 2^(e_{j-1} -
  e_j)`` (:func:`_acc_rescale`, the softmax's own per-row rescale times one scalar), and the epilogue
  multiplies by ``2^e_last``; P, the row maximum and the row sums never see V's scale. Measured
  against the default: -4 to -5% on a full map, -2 to -3% at 15%, level at 5% (720p; +5-6% at 480p,
  5%), so off.
  (A first form folded ``e`` into P's row terms and divided it out of the row sums: with P's e4m3 bits
  the row sums then lost the probability of the blocks whose V tile is far smaller than the row's
  largest, whose P underflowed; wrong on tiles of very unequal range.)

- ``HAS_TAIL`` (compile time; ``pooled_tail=True``): the pooled tail as extra key blocks (semantics:
  :func:`chorus.kernels.block_sparse_attention`; layout: :mod:`._attention`, "Pooled tail"). The pre-pass
  appends each 128-key block's mean of smoothed K and of V (V in the wgmma key order, its scaling) as rows
  ``Lpad_k + j`` of its copies; each tile's block list ends with the pooled tiles ``Lpad_k / 128 + p`` that
  hold a block its map row skips, and the producer loads them like any key block; on a pooled tile the
  consumer adds the bias table's row (``w_j * log2(e)``, ``-inf`` where the row keeps block ``j``) as
  ``bias / sc`` to ``S`` before the row maximum (``-inf``: P's saturating byte is 0) and leaves the prefix /
  suffix biases off it (they are in the table's weights). The load and add sit in a branch only pooled tiles
  take (a kept block runs the loop it runs without the tail: ``tests/test_kernels_ws.py`` reads the
  SASS), and each tile's table row is prefetched into L1 once (``prefetch.global.L1``) so that branch does
  not wait on memory. Without ``HAS_TAIL`` the kernel is compiled as before (its sm_90 SASS unchanged).

``SCHEDULE`` (compile time): ``"serial"`` (the default, measured fastest) runs each block's two
GEMMs and softmax in order and lets the two warpgroups overlap each other through the warp
schedulers; ``"overlap"`` issues block j's ``Q @ K^T`` before waiting for block j-1's ``P @ V``
(FlashAttention-3's intra-warpgroup pipelining); ``"pingpong"`` makes the warpgroups take turns
issuing their GEMMs (FlashAttention-3's ping-pong: each consumer waits on its own named hardware
barrier, ``bar.sync`` over both warpgroups' 256 threads, and hands the turn over with ``bar.arrive``
on the other's; ids ``TURN_BARRIERS``, clear of the ids Triton gives its partitions). ``FMA_QUARTERS``
(0 by default; 1 or 2): that share of each row's exp2 runs on the FMA pipes instead of the MUFU
(FlashAttention-4's split, :func:`_exp2_split`; with ``p_bits`` 0 only). All but the defaults are the
benchmark's levers
(``docs/BENCHMARKS.md``, "third run": overlap and ping-pong slower here, a quarter split +3% on a
full map and level where hits run; ping-pong on named barriers: +1% on a full map, -2% / level at
15% / 5%, "fourth run"). A key block wholly inside the prefix / suffix takes its bias in the
softmax's per-row terms, computed from the block index before its ``Q @ K^T`` is waited for
(:func:`_key_block_bias`; "fifth run": the suffix bias costs nothing measurable).

Contract (checked by :func:`block_sparse_attention_ws`): q ``[B, H, Lq, D]``, k/v ``[B, H, Lk, D]``
fp16/bf16 on one sm_90 device, unit stride on D (ComfyUI's ``[B, L, H, D]`` views work), D in
{64, 128}; block size 128 (the quantisation tile); block_map bool ``[B or 1, H or 1, ceil(Lq/128),
ceil(Lk/128)]``. Partial last blocks are handled (keys past ``Lk`` get logit -inf, rows past ``Lq``
are not stored); a row that keeps no block yields zeros (with the pooled tail: its pooled terms'
average). Optional prefix bias (``HAS_BIAS``, compile time): ``prefix_bias`` added to the scaled logits
of keys ``[0, prefix_len)`` (ChorusGuidanceBoost's first-frame weight), applied only on the key blocks
that hold such keys. Optional pooled tail (``HAS_TAIL``, above). Returns ``[B, H, Lq, D]`` in q's dtype.

Gluon is an experimental Triton API (built and tested with Triton 3.6 and 3.8): :func:`available`
says whether this Triton has it; the tests compile the kernel for sm_90 on the CPU, so an API change
shows up in CI, and a Triton that imports Gluon but cannot build the kernel fails its first call,
which ``auto`` logs once before moving to ``triton_fp8``.
"""

from __future__ import annotations

import torch

from ._attention import (P_SHIFT_LOG2, _validate, check_key_biases, check_perm, lpt_block_lists, output_like,
                         run_in_int32_chunks, tail_spec)
from ._quant import LOG2E, padded_len, quantize_qkv_fp8, tail_rows

try:  # Gluon ships inside recent Tritons; without it this backend reports itself unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.8 / 3.6 spelling
    _IMPORT_ERROR = None
except Exception as exc:  # noqa: BLE001
    gluon = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

BLOCK = 128  # query rows per CTA, keys per block, tokens per Q/K scale
CONSUMER_ROWS = 64  # query rows per consumer warpgroup (one wgmma M tile of 4 warps)
CONSUMER_REGS = 240  # registers per consumer thread (setmaxnreg); the producer keeps the rest
SCHEDULES = ("serial", "overlap", "pingpong")
TURN_BARRIERS = (8, 9)  # ping-pong: the consumers' named hardware barriers (Triton's partitions use ids 0-3)
DEFAULT_CONFIG = dict(stages=3, q_stages=2, schedule="serial", fma_quarters=0, p_bits=1, v_scaling="channel",
                      p_clamp="sat", o_store="tma", q_quant="kernel")


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
    _TURN0 = gl.constexpr(TURN_BARRIERS[0])
    P_BITS_OFFSET = gl.constexpr(-0.5)  # k's rounding offset: centres the linear mantissa's error (CPU model)
    _ONES = gl.constexpr(8)  # columns of the row-sum GEMM (P8 @ ones): wgmma's smallest N

    @gluon.jit
    def _tile_of(t, sched, kv_num, kv_idx, H, q_blocks, s_nb, s_nh, s_ib, s_ih, s_iq, tail_num,
                 HAS_TAIL: gl.constexpr):
        """Tile ``t`` of the persistent walk -> (b, h, bh, query block, listed count, block list row, map row):
        with ``HAS_TAIL`` the count includes the pooled tiles listed after the kept blocks."""
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
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                  sched, kv_num, kv_idx, H, q_blocks, num_tiles, lpad_q, lpad_k,
                  s_nb, s_nh, s_ib, s_ih, s_iq, tail_num,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, Q_STAGES: gl.constexpr, Q_KERNEL: gl.constexpr,
                  HAS_TAIL: gl.constexpr):
        # Waits on "empty" barriers start at parity 1: a fresh barrier counts as having completed
        # the phase before its first, so the first STAGES (Q_STAGES) loads do not wait.
        kctr = 0
        qt = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            b, h, bh, qblk, n_kv, idx_row, _ = _tile_of(t, sched, kv_num, kv_idx, H, q_blocks, s_nb, s_nh, s_ib,
                                                        s_ih, s_iq, tail_num, HAS_TAIL)
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
    def _turn_wait(consumer):
        """Wait for this consumer warpgroup's turn: ``bar.sync`` on its named barrier, which completes
        when the other warpgroup has arrived on it (256 threads: both consumers)."""
        gl.inline_asm_elementwise("bar.sync $1, 256;\n mov.u32 $0, 0;", "=r,r", [consumer + _TURN0], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _turn_pass(consumer):
        """Hand the turn to the other consumer warpgroup (``bar.arrive`` on its named barrier)."""
        gl.inline_asm_elementwise("bar.arrive $1, 256;\n mov.u32 $0, 0;", "=r,r", [_TURN0 + 1 - consumer],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _exp2_fma(x):
        """exp2 on the FMA pipes for x <= P_SHIFT: x = j + f with j = round(x) (the 1.5 * 2^23 trick),
        ``2^f`` by a degree-2 polynomial on [-0.5, 0.5] (relative error 1.7e-3, far below e4m3's 2^-4
        step), ``j`` added to the exponent bits. ``x`` is clamped at -100 (``-inf`` keys give 2^-100,
        which is 0 in e4m3 and nothing in the row sum)."""
        x = gl.maximum(x, -100.0)
        t = x + 12582912.0
        f = x - (t - 12582912.0)
        p = (0.23842119 * f + 0.70343381) * f + 1.00044262
        j = t.to(gl.int32, bitcast=True) - 0x4B400000
        return (p.to(gl.int32, bitcast=True) + (j << 23)).to(gl.float32, bitcast=True)

    @gluon.jit
    def _exp2_split(x, FMA_QUARTERS: gl.constexpr):
        """exp2 of ``x`` (``[ROWS, N]``, wgmma accumulator layout) with ``FMA_QUARTERS`` (0, 1 or 2) quarters
        of the columns on the FMA pipes (:func:`_exp2_fma`) and the rest on the MUFU: FlashAttention-4's
        balance of the two pipes. The columns are split along register bits of each thread (free)."""
        layout: gl.constexpr = x.type.layout
        R: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        if FMA_QUARTERS == 0:
            y = gl.exp2(x)
        else:
            lo, hi = gl.split(gl.permute(gl.reshape(x, [R, N // 16, 2, 8]), [0, 1, 3, 2]))
            lo = gl.exp2(lo)
            if FMA_QUARTERS == 2:
                hi = gl.convert_layout(_exp2_fma(hi), lo.type.layout, assert_trivial=True)
            else:
                a, b = gl.split(gl.permute(gl.reshape(hi, [R, N // 32, 2, 8]), [0, 1, 3, 2]))
                a = gl.exp2(a)
                b = gl.convert_layout(_exp2_fma(b), a.type.layout, assert_trivial=True)
                hi = gl.convert_layout(gl.reshape(gl.permute(gl.join(a, b), [0, 1, 3, 2]), [R, N // 16, 8]),
                                       lo.type.layout, assert_trivial=True)
            y = gl.reshape(gl.permute(gl.join(lo, hi), [0, 1, 3, 2]), [R, N])
        return gl.convert_layout(y, layout, assert_trivial=True)

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
    def _key_block_bias(kb, prefix_len, prefix_bias, suffix_start, suffix_bias, HAS_SUFFIX: gl.constexpr):
        """Key block ``kb``'s share of the prefix / suffix biases (log2 units), from its index alone (so it
        is computed while the block's ``Q @ K^T`` runs): ``(whole, pre_keys, tail_from, edge)`` with
        ``whole`` = the bias of every key of the block (blocks wholly inside the prefix and / or the
        suffix), the block's prefix keys ``[0, pre_keys)`` and suffix keys ``[tail_from, BLOCK)``, and
        ``edge`` = whether the prefix or suffix ends inside the block (then per-key biases apply)."""
        pre_keys = prefix_len - kb * _BLOCK
        whole = gl.where(pre_keys >= _BLOCK, prefix_bias, 0.0)
        edge = (pre_keys > 0) & (pre_keys < _BLOCK)
        tail_from = suffix_start - kb * _BLOCK
        if HAS_SUFFIX:
            whole = whole + gl.where(tail_from <= 0, suffix_bias, 0.0)
            edge = edge | ((tail_from > 0) & (tail_from < _BLOCK))
        return whole, pre_keys, tail_from, edge

    @gluon.jit
    def _block_terms(idx_row, j, sq, k_scale_row, v_scale, bh, n_k_scale, prefix_len, prefix_bias, suffix_start,
                     suffix_bias, pool_first, HAS_SUFFIX: gl.constexpr, V_BLOCK: gl.constexpr,
                     HAS_TAIL: gl.constexpr):
        """What the softmax of the tile's ``j``-th listed key block needs besides its ``S``, loaded / computed
        before ``S`` is waited for: ``(kb, sc, v_exp, whole, pre_keys, tail_from, edge, pooled)`` = the block's
        index, ``sq * sk``, its V exponent (its V scale is ``2^v_exp`` under the pre-pass's
        ``v_scaling="block"``, else 0), its share of the key biases (:func:`_key_block_bias`) and, with
        ``HAS_TAIL``, whether it is a tile of pooled keys (``kb >= pool_first``: its weights, key biases
        included, come from the tail's bias table instead)."""
        kb = gl.load(idx_row + j)
        sc = sq * gl.load(k_scale_row + kb)
        v_exp = 0.0
        if V_BLOCK:
            v_exp = gl.load(v_scale + bh * n_k_scale + kb)
        whole, pre_keys, tail_from, edge = _key_block_bias(kb, prefix_len, prefix_bias, suffix_start, suffix_bias,
                                                           HAS_SUFFIX)
        pooled = False
        if HAS_TAIL:
            pooled = kb >= pool_first
            whole = gl.where(pooled, 0.0, whole)  # (past the keys a suffix would cover every pooled tile)
        return kb, sc, v_exp, whole, pre_keys, tail_from, edge, pooled

    @gluon.jit
    def _row_sums_issue(p8, ones_smem, l_zero, pl_layout: gl.constexpr):
        """Issue the block's row sums ``P8 @ ones`` (N = 8, every column the sum; async, fresh
        accumulator: the running sum stays in fp32 registers)."""
        return warpgroup_mma(gl.convert_layout(p8, pl_layout, assert_trivial=True), ones_smem.permute((1, 0)),
                             l_zero, use_acc=False, is_async=True)

    @gluon.jit
    def _acc_rescale(alpha, v_exp_acc, v_exp, V_BLOCK: gl.constexpr):
        """The accumulator's per-row factor before block ``P @ V8`` accumulates: the softmax's ``alpha``,
        and under ``V_BLOCK`` the move from the units of the V tile last accumulated (``2^v_exp_acc``) to
        this block's (``2^v_exp``), so P and its row sums never carry V's scale (the pre-pass keeps the
        exponents within +-47: the factor stays finite, 0 * factor is 0)."""
        if V_BLOCK:
            alpha = alpha * gl.exp2(v_exp_acc - v_exp)
        return alpha

    @gluon.jit
    def _softmax_block(s, m_i, l_i, sc, kb, offs_n, Lk, num_kv_blocks, whole, pre_keys, tail_from, edge,
                       prefix_bias, suffix_bias, pooled, tail_row, pool_first, TAIL_K: gl.constexpr,
                       HAS_BIAS: gl.constexpr, HAS_SUFFIX: gl.constexpr,
                       P_SHIFT: gl.constexpr, ABLATE: gl.constexpr, FMA_QUARTERS: gl.constexpr,
                       P_BITS: gl.constexpr, P_SAT: gl.constexpr, HAS_TAIL: gl.constexpr):
        """Online softmax over key block ``kb``'s wgmma output ``s`` (``sc`` = sq * sk > 0, folded in after
        the row max): returns ``(P, m, l, alpha)`` with ``P = exp2(s * sc - m + P_SHIFT)`` (row maximum
        2^P_SHIFT, inside e4m3), the new row max / sum and ``alpha`` = the old accumulator's rescale
        factor. ``P_BITS`` 0: P in fp32 from the exp2, ``l`` updated here; 1 / 2: P as e4m3 straight from
        the FFMA's bits (see the comment below) and ``l`` returned as given (the consumer sums P on the
        tensor cores). Keys past ``Lk`` in the partial last block get -inf. ``HAS_BIAS`` (``HAS_SUFFIX``): keys
        ``< prefix_len`` get ``prefix_bias`` (log2 units) added to their scaled logit, and keys
        ``>= suffix_start`` ``suffix_bias`` (:func:`_key_block_bias` gives this block's share): a block
        wholly inside the prefix / suffix takes it as one per-row term in the row maximum and the shift,
        the one block an edge crosses also as ``bias / sc`` added to those elements of ``s``. ABLATE
        (benchmark only, results meaningless): 1 leaves the exp2 out, 2 the whole softmax (3: the consumer
        stores no output, 4: its epilogue loads no per-channel V scales; both in :func:`_consumer`).
        ``HAS_TAIL``: on a tile of pooled keys (``pooled``), each key's term from the tile's row of the bias
        table (``tail_row``: log2 units, ``-inf`` where the row keeps the block or past the last) enters as
        ``bias / sc`` added to ``s`` before the row maximum (``-inf``: P's byte saturates to 0, the row
        maximum ignores it)."""
        if TAIL_K:
            if kb == num_kv_blocks - 1:
                s = gl.where((kb * _BLOCK + offs_n < Lk)[None, :], s, float("-inf"))
        if HAS_TAIL:
            if pooled:
                weights = gl.load(tail_row + (kb - pool_first) * _BLOCK + offs_n)
                s = s + (weights * (1.0 / sc))[None, :]
        if HAS_BIAS:
            if edge:  # per key: the prefix's last (partial) block, the suffix's first
                keys = gl.where((offs_n < pre_keys) & (pre_keys < _BLOCK), prefix_bias, 0.0)
                if HAS_SUFFIX:
                    keys = keys + gl.where((offs_n >= tail_from) & (tail_from > 0), suffix_bias, 0.0)
                s = s + (keys / sc)[None, :]
        if ABLATE == 2:
            p = s * sc
            if P_BITS != 0:  # P as the FFMA path returns it: e4m3
                p = p.to(gl.float8e4nv)
            return p, m_i, l_i, gl.full_like(m_i, 1.0)
        if HAS_BIAS:  # exp2(s * sc + b - m + shift), the block's uniform bias b in the row terms
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * sc + whole)
            shift = P_SHIFT + whole - m_new
        else:
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * sc)
            shift = P_SHIFT - m_new
        alpha = gl.exp2(m_i - m_new)
        if P_BITS == 0:
            p = s * sc + shift[:, None]
            if ABLATE == 0:
                p = _exp2_split(p, FMA_QUARTERS)
            l_new = l_i * alpha + gl.sum(p, axis=1)
        else:
            # P's e4m3 byte read off an fp32 bit pattern: k = round(8 x + 56 + P_BITS_OFFSET) is the byte of
            # 2^(k // 8 - 7) * (1 + (k % 8) / 8), i.e. exp2(x) with the mantissa linear between powers of
            # two; x <= P_SHIFT = 8 keeps k <= 120 (256), k < 0 is clamped to 0. Adding 1.5 * 2^23 leaves k
            # in the low bits (P_BITS 1: inside the FFMA, which rounds the row term to an integer too; 2:
            # a separate add after it; P_SAT: after the saturating FFMA, both alike). The row sum is left
            # to the tensor cores (P8 @ ones in the consumer), so it is exactly the sum of the P that
            # multiplies V.
            if not P_SAT:
                if P_BITS == 1:
                    y = s * (sc * 8.0) + (shift * 8.0 + (56.0 + P_BITS_OFFSET + 12582912.0))[:, None]
                else:
                    y = (s * (sc * 8.0) + (shift * 8.0 + (56.0 + P_BITS_OFFSET))[:, None]) + 12582912.0
                y = gl.maximum(y, 12582912.0)
            else:  # k / 128 saturated to [0, 1] by the FFMA (the clamp on the FMA pipe, not the ALU's max)
                u = _fma_sat(s, sc * (8.0 / 128.0), shift * (8.0 / 128.0) + (56.0 + P_BITS_OFFSET) / 128.0)
                y = u * 128.0 + 12582912.0
            p = y.to(gl.int32, bitcast=True).to(gl.int8).to(gl.float8e4nv, bitcast=True)
            l_new = l_i
        return p, m_new, l_new, alpha

    @gluon.jit
    def _p_operand(p, p_layout: gl.constexpr):
        """P (fp32, wgmma accumulator layout) as the e4m3 A operand of ``P @ V`` with no data movement.

        In the accumulator layout a thread holds, of each 16 key columns, ``8a + 2t + b`` (a, b in {0, 1},
        t = lane % 4); the 8-bit A operand wants ``4t + 2a + b`` in the same registers. Relabelling the key
        axis by that permutation (a reshape / permute, free in registers) makes the two layouts one, and
        the pre-pass stores V^T with its keys in the same order (``v_key_order="wgmma"``), so the product
        is unchanged (measured: +3% on a full map against Triton's shuffle-based conversion)."""
        ROWS: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        p8 = gl.reshape(p.to(gl.float8e4nv) if p.dtype != gl.float8e4nv else p, [ROWS, N // 16, 2, 4, 2])
        p8 = gl.permute(p8, [0, 1, 3, 2, 4])
        p8 = gl.reshape(p8, [ROWS, N])
        return gl.convert_layout(p8, p_layout, assert_trivial=True)

    @gluon.jit
    def _consumer(o_ptr, o_desc, o_smem, q_smem, q8_smem, q_mult, k_smem, v_smem, ones_smem, q_ready, q_empty,
                  k_ready, v_ready, kv_empty, q_scale, k_scale, v_scale, sched, kv_num, kv_idx, H, Lq, Lk,
                  num_kv_blocks, q_blocks, num_tiles,
                  n_q_scale, n_k_scale, prefix_len, prefix_bias, suffix_start, suffix_bias, token_perm, s_ob, s_oh,
                  s_ol, s_nb, s_nh, s_ib, s_ih,
                  s_iq, tail_num, tail_bias, tail_width, pool_first,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, Q_STAGES: gl.constexpr, CONSUMER: gl.constexpr,
                  TAIL_K: gl.constexpr, HAS_BIAS: gl.constexpr, P_SHIFT: gl.constexpr, SCHEDULE: gl.constexpr,
                  ABLATE: gl.constexpr, FMA_QUARTERS: gl.constexpr, HAS_PERM: gl.constexpr,
                  HAS_SUFFIX: gl.constexpr, P_BITS: gl.constexpr, V_BLOCK: gl.constexpr, P_SAT: gl.constexpr,
                  O_VEC: gl.constexpr, O_TMA: gl.constexpr, Q_KERNEL: gl.constexpr, HAS_TAIL: gl.constexpr):
        ROWS: gl.constexpr = _ROWS
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
        # the output tile's store layout: O_VEC 8 consecutive 16-bit channels per thread, a warp over whole
        # rows; else the accumulator's own
        vec_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
        out_layout: gl.constexpr = vec_layout if O_VEC else o_layout
        row_l: gl.constexpr = gl.SliceLayout(1, l_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        offs_n = gl.arange(0, _BLOCK, layout=gl.SliceLayout(0, s_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
        s_zero = gl.zeros([ROWS, _BLOCK], gl.float32, layout=s_layout)
        l_zero = gl.zeros([ROWS, _ONES], gl.float32, layout=l_layout)

        kctr = 0  # key blocks consumed so far (all tiles): stage = kctr % STAGES, parity = (kctr // STAGES) & 1
        qt = 0
        if SCHEDULE == "pingpong":
            if CONSUMER == 1:
                _turn_pass(CONSUMER)  # consumer 0 takes the first turn
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            b, h, bh, qblk, n_kv, idx_row, map_row = _tile_of(t, sched, kv_num, kv_idx, H, q_blocks, s_nb, s_nh,
                                                              s_ib, s_ih, s_iq, tail_num, HAS_TAIL)
            k_scale_row = k_scale + bh * n_k_scale
            tail_row = tail_bias + map_row * tail_width  # (HAS_TAIL: this query block's row of the bias table)
            if HAS_TAIL:
                _prefetch_row(tail_row, tail_width)
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
                sq = gl.load(q_scale + bh * n_q_scale + qblk)
                mbarrier.wait(q_ready.index(qs), (qt // Q_STAGES) & 1)
                q = q_smem.index(qs).slice(CONSUMER * ROWS, ROWS, dim=0)

            m_i = gl.full([ROWS], -1.0e30, gl.float32, layout=row_s)  # finite: no NaN from a masked row
            l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            l_acc = gl.zeros([ROWS, _ONES], gl.float32, layout=l_layout)  # P_BITS: the row sums, every column
            v_exp_acc = 0.0  # V_BLOCK: acc is in units of the V tile 2^v_exp_acc (the last one accumulated)
            j0 = 0  # first block of the one-block loop below (the overlap schedule consumes them all)
            if SCHEDULE == "overlap":
                # block j's Q @ K^T is issued before block j-1's P @ V is waited for, so a warpgroup's
                # softmax runs under its own P @ V (FlashAttention-3's intra-warpgroup pipelining); P of
                # block j-1 is carried in registers across the step
                p8 = gl.zeros([ROWS, _BLOCK], gl.float8e4nv, layout=p_layout)
                prev = 0
                if n_kv > 0:  # block 0: no P @ V in flight yet
                    kb, sc, v_exp, whole, pre_keys, tail_from, edge, pooled = _block_terms(
                        idx_row, 0, sq, k_scale_row, v_scale, bh, n_k_scale, prefix_len, prefix_bias, suffix_start,
                        suffix_bias, pool_first, HAS_SUFFIX, V_BLOCK, HAS_TAIL)
                    st = kctr % STAGES
                    mbarrier.wait(k_ready.index(st), (kctr // STAGES) & 1)
                    s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
                    p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, sc, kb, offs_n, Lk, num_kv_blocks, whole, pre_keys,
                                                        tail_from, edge, prefix_bias, suffix_bias, pooled, tail_row,
                                                        pool_first, TAIL_K, HAS_BIAS, HAS_SUFFIX, P_SHIFT, ABLATE,
                                                        FMA_QUARTERS, P_BITS, P_SAT, HAS_TAIL)
                    p8 = _p_operand(p, p_layout)
                    mbarrier.wait(v_ready.index(st), (kctr // STAGES) & 1)
                    prev = st
                    v_exp_acc = v_exp
                    kctr += 1
                for j in range(1, n_kv):
                    kb, sc, v_exp, whole, pre_keys, tail_from, edge, pooled = _block_terms(
                        idx_row, j, sq, k_scale_row, v_scale, bh, n_k_scale, prefix_len, prefix_bias, suffix_start,
                        suffix_bias, pool_first, HAS_SUFFIX, V_BLOCK, HAS_TAIL)
                    st = kctr % STAGES
                    mbarrier.wait(k_ready.index(st), (kctr // STAGES) & 1)
                    s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    acc = warpgroup_mma(p8, v_smem.index(prev).permute((1, 0)), acc, is_async=True)
                    if P_BITS != 0:
                        l_blk = _row_sums_issue(p8, ones_smem, l_zero, pl_layout)
                        s = warpgroup_mma_wait(num_outstanding=2, deps=[s])
                    else:
                        s = warpgroup_mma_wait(num_outstanding=1, deps=[s])  # Q @ K^T done; P @ V may run on
                    p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, sc, kb, offs_n, Lk, num_kv_blocks, whole, pre_keys,
                                                        tail_from, edge, prefix_bias, suffix_bias, pooled, tail_row,
                                                        pool_first, TAIL_K, HAS_BIAS, HAS_SUFFIX, P_SHIFT, ABLATE,
                                                        FMA_QUARTERS, P_BITS, P_SAT, HAS_TAIL)
                    if P_BITS != 0:
                        acc, l_blk = warpgroup_mma_wait(num_outstanding=0, deps=[acc, l_blk])
                        l_acc = (l_acc + l_blk) * gl.convert_layout(alpha, row_l)[:, None]
                    else:
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                    mbarrier.arrive(kv_empty.index(prev), count=1)
                    acc = acc * gl.convert_layout(_acc_rescale(alpha, v_exp_acc, v_exp, V_BLOCK), row_o)[:, None]
                    p8 = _p_operand(p, p_layout)
                    mbarrier.wait(v_ready.index(st), (kctr // STAGES) & 1)
                    prev = st
                    v_exp_acc = v_exp
                    kctr += 1
                if n_kv > 0:
                    acc = warpgroup_mma(p8, v_smem.index(prev).permute((1, 0)), acc, is_async=True)
                    if P_BITS != 0:
                        l_blk = _row_sums_issue(p8, ones_smem, l_zero, pl_layout)
                        acc, l_blk = warpgroup_mma_wait(num_outstanding=0, deps=[acc, l_blk])
                        l_acc = l_acc + l_blk
                    else:
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                    mbarrier.arrive(kv_empty.index(prev), count=1)
                j0 = n_kv
            for j in range(j0, n_kv):
                # one key block per step: Q @ K^T, softmax, P @ V; with SCHEDULE "pingpong" the two
                # warpgroups take turns issuing each GEMM (named barriers), FlashAttention-3's ping-pong
                kb, sc, v_exp, whole, pre_keys, tail_from, edge, pooled = _block_terms(
                    idx_row, j, sq, k_scale_row, v_scale, bh, n_k_scale, prefix_len, prefix_bias, suffix_start,
                    suffix_bias, pool_first, HAS_SUFFIX, V_BLOCK, HAS_TAIL)
                st = kctr % STAGES
                ph = (kctr // STAGES) & 1
                mbarrier.wait(k_ready.index(st), ph)
                if SCHEDULE == "pingpong":
                    _turn_wait(CONSUMER)
                s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                if SCHEDULE == "pingpong":
                    _turn_pass(CONSUMER)
                s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
                p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, sc, kb, offs_n, Lk, num_kv_blocks, whole, pre_keys,
                                                    tail_from, edge, prefix_bias, suffix_bias, pooled, tail_row,
                                                    pool_first, TAIL_K, HAS_BIAS, HAS_SUFFIX, P_SHIFT, ABLATE,
                                                    FMA_QUARTERS, P_BITS, P_SAT, HAS_TAIL)
                acc = acc * gl.convert_layout(_acc_rescale(alpha, v_exp_acc, v_exp, V_BLOCK), row_o)[:, None]
                v_exp_acc = v_exp
                p8 = _p_operand(p, p_layout)
                mbarrier.wait(v_ready.index(st), ph)
                if SCHEDULE == "pingpong":
                    _turn_wait(CONSUMER)
                acc = warpgroup_mma(p8, v_smem.index(st).permute((1, 0)), acc, is_async=True)
                if P_BITS != 0:
                    l_blk = _row_sums_issue(p8, ones_smem, l_zero, pl_layout)
                if SCHEDULE == "pingpong":
                    _turn_pass(CONSUMER)
                if P_BITS != 0:
                    acc, l_blk = warpgroup_mma_wait(num_outstanding=0, deps=[acc, l_blk])
                    # the running sum in fp32 registers: an FP8 wgmma's accumulator keeps fewer mantissa
                    # bits, too few for a sum of positive terms over thousands of keys
                    l_acc = l_acc * gl.convert_layout(alpha, row_l)[:, None] + l_blk
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                mbarrier.arrive(kv_empty.index(st), count=1)
                kctr += 1
            if not Q_KERNEL:
                mbarrier.arrive(q_empty.index(qs), count=1)  # this consumer's Q rows are no longer read
            qt += 1

            if P_BITS != 0:
                l_i = gl.convert_layout(gl.max(l_acc, axis=1), row_s)
            l_safe = gl.where(l_i > 0, l_i, 1.0)
            if V_BLOCK:  # back from the last V tile's units
                out = acc * gl.convert_layout(gl.exp2(v_exp_acc) / l_safe, row_o)[:, None]
            else:
                out = acc * gl.convert_layout(1.0 / l_safe, row_o)[:, None]
                if ABLATE != 4:  # per-channel V scales
                    out = out * gl.load(v_scale + bh * HEAD_DIM + offs_d)[None, :]
            if O_TMA:
                # the tile through this consumer's shared buffer and one TMA store, which runs on while
                # the next tile starts (rows past Lq fall outside the descriptor and are not written);
                # the buffer is rewritten only once the previous tile's store has read it
                tma.store_wait(0)
                o_smem.reshape([ROWS, HEAD_DIM]).store(out.to(o_ptr.dtype.element_ty))
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [b, h, qblk * _BLOCK + CONSUMER * ROWS, 0], o_smem)
            else:
                # O_VEC: 16 bytes per thread and store (whole rows per warp) instead of the accumulator's 4
                out = gl.convert_layout(out.to(o_ptr.dtype.element_ty), out_layout)
                rows = qblk * _BLOCK + CONSUMER * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_layout))
                cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_layout))
                dst = rows
                if HAS_PERM:  # sequence position -> the input row it came from (the pre-pass gathered by it)
                    dst = gl.minimum(gl.maximum(gl.load(token_perm + rows, mask=rows < Lq, other=0), 0), Lq - 1)
                o_ptrs = o_ptr + b * s_ob + h * s_oh + dst[:, None] * s_ol + cols[None, :]
                o_mask = rows < Lq
                if ABLATE == 3:  # benchmark only: no output stored (a mask the compiler cannot fold)
                    o_mask = o_mask & (Lq < 0)
                gl.store(o_ptrs, out, mask=o_mask[:, None])
        if O_TMA:
            tma.store_wait(0)  # the last tile's store has left shared memory before the CTA exits
        if SCHEDULE == "pingpong":
            if CONSUMER == 0:
                _turn_wait(CONSUMER)  # consumer 1's last hand-over: no arrival left pending at exit

    @gluon.jit
    def _bsa_ws_kernel(q_desc, k_desc, v_desc, O, o_desc, q_mult, q_scale, k_scale, v_scale, kv_num, kv_idx, sched,
                       H, Lq, Lk, lpad_q, lpad_k, num_kv_blocks, q_blocks, num_tiles, n_q_scale, n_k_scale,
                       prefix_len, prefix_bias, suffix_start, suffix_bias, token_perm, s_ob, s_oh, s_ol, s_nb, s_nh,
                       s_ib, s_ih, s_iq, tail_num, tail_bias, tail_width, pool_first,
                       HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, Q_STAGES: gl.constexpr,
                       TAIL_K: gl.constexpr, HAS_BIAS: gl.constexpr, P_SHIFT: gl.constexpr, SCHEDULE: gl.constexpr,
                       ABLATE: gl.constexpr, FMA_QUARTERS: gl.constexpr, HAS_PERM: gl.constexpr,
                       HAS_SUFFIX: gl.constexpr, P_BITS: gl.constexpr, V_BLOCK: gl.constexpr, P_SAT: gl.constexpr,
                       O_VEC: gl.constexpr, O_TMA: gl.constexpr, Q_KERNEL: gl.constexpr, HAS_TAIL: gl.constexpr):
        # the B operand of the row-sum GEMM (P_BITS): e4m3 ones (byte 0x38), any swizzle holds them
        ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ONES, _BLOCK], gl.float8e4nv)
        ones_regs: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        ones = gl.full([_ONES, _BLOCK], 0x38, gl.int8, layout=ones_regs).to(gl.float8e4nv, bitcast=True)
        ones_smem = gl.allocate_shared_memory(gl.float8e4nv, [_ONES, _BLOCK], ones_layout, ones)
        fence_async_shared()
        if Q_KERNEL:  # Q's input rows [1, 1, 128, D] per stage, and each consumer's e4m3 copy of its 64
            q_smem = gl.allocate_shared_memory(q_desc.block_type.element_ty, [Q_STAGES] + q_desc.block_type.shape,
                                               q_desc.layout)
            q8_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, HEAD_DIM], gl.float8e4nv)
            q8_smem0 = gl.allocate_shared_memory(gl.float8e4nv, [_ROWS, HEAD_DIM], q8_layout)
            q8_smem1 = gl.allocate_shared_memory(gl.float8e4nv, [_ROWS, HEAD_DIM], q8_layout)
        else:  # the pre-pass's e4m3 tiles (q8_smem*: never used)
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [Q_STAGES, _BLOCK, HEAD_DIM], q_desc.layout)
            q8_smem0 = gl.allocate_shared_memory(gl.float8e4nv, [1, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            q8_smem1 = q8_smem0
        k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, _BLOCK, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_DIM, _BLOCK], v_desc.layout)
        if O_TMA:  # each consumer's staging buffer of its output rows, [1, 1, 64, D]
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
        gl.warp_specialize([
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                         sched, kv_num, kv_idx, H, q_blocks, num_tiles, lpad_q, lpad_k, s_nb, s_nh, s_ib, s_ih, s_iq,
                         tail_num, HEAD_DIM, STAGES, Q_STAGES, Q_KERNEL, HAS_TAIL)),
            (_consumer, (O, o_desc, o_smem0, q_smem, q8_smem0, q_mult, k_smem, v_smem, ones_smem, q_ready,
                         q_empty, k_ready, v_ready, kv_empty, q_scale, k_scale, v_scale, sched, kv_num, kv_idx, H,
                         Lq, Lk, num_kv_blocks, q_blocks, num_tiles, n_q_scale, n_k_scale, prefix_len, prefix_bias,
                         suffix_start, suffix_bias,
                         token_perm, s_ob, s_oh, s_ol, s_nb,
                         s_nh, s_ib, s_ih, s_iq, tail_num, tail_bias, tail_width, pool_first, HEAD_DIM, STAGES,
                         Q_STAGES, 0, TAIL_K, HAS_BIAS, P_SHIFT, SCHEDULE, ABLATE, FMA_QUARTERS, HAS_PERM,
                         HAS_SUFFIX, P_BITS, V_BLOCK, P_SAT, O_VEC, O_TMA, Q_KERNEL, HAS_TAIL)),
            (_consumer, (O, o_desc, o_smem1, q_smem, q8_smem1, q_mult, k_smem, v_smem, ones_smem, q_ready,
                         q_empty, k_ready, v_ready, kv_empty, q_scale, k_scale, v_scale, sched, kv_num, kv_idx, H,
                         Lq, Lk, num_kv_blocks, q_blocks, num_tiles, n_q_scale, n_k_scale, prefix_len, prefix_bias,
                         suffix_start, suffix_bias,
                         token_perm, s_ob, s_oh, s_ol, s_nb,
                         s_nh, s_ib, s_ih, s_iq, tail_num, tail_bias, tail_width, pool_first, HEAD_DIM, STAGES,
                         Q_STAGES, 1, TAIL_K, HAS_BIAS, P_SHIFT, SCHEDULE, ABLATE, FMA_QUARTERS, HAS_PERM,
                         HAS_SUFFIX, P_BITS, V_BLOCK, P_SAT, O_VEC, O_TMA, Q_KERNEL, HAS_TAIL)),
        ], [4, 4], [_REGS, _REGS])


def shared_layouts(head_dim: int):
    """NVMMA shared layouts of the Q/K tile ``[128, D]`` and the V^T tile ``[D, 128]`` (e4m3)."""
    qk = gl.NVMMASharedLayout.get_default_for([BLOCK, head_dim], gl.float8e4nv)
    vt = gl.NVMMASharedLayout.get_default_for([head_dim, BLOCK], gl.float8e4nv)
    return qk, vt


def tma_compatible(x: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address ``x`` as it is: 16-byte aligned base and strides, unit last stride."""
    size = x.element_size()
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in x.stride()[:-1])


def rows_block(rows: int, head_dim: int, dtype: torch.dtype):
    """Block shape ``[1, 1, rows, D]`` and NVMMA shared layout of a TMA descriptor over a bf16 / fp16
    ``[B, H, L, D]`` tensor: Q's input rows (``rows`` 128, ``q_quant="kernel"``) and the output (64, one
    consumer's rows, ``o_store="tma"``)."""
    block = [1, 1, rows, head_dim]
    return block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def rows_descriptor(x: torch.Tensor, rows: int):
    """TMA descriptor of ``x`` ``[B, H, L, D]`` as it is (any 16-byte aligned strides with unit stride on D:
    ComfyUI's ``[B, L, H, D]`` memory too; see :func:`tma_compatible`) in :func:`rows_block` blocks; rows
    past ``L`` are zeros on load and dropped on store."""
    block, layout = rows_block(rows, x.shape[3], x.dtype)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


def launch_ws(q, k, v, block_map, scale: float, config: dict | None = None, prefix_len: int = 0,
              prefix_bias: float = 0.0, token_perm: torch.Tensor | None = None, suffix_len: int = 0,
              suffix_bias: float = 0.0, pooled_tail: bool = False) -> torch.Tensor:
    """Pre-pass + block lists + the warp-specialised kernel, for one int32-safe chunk
    (``prefix_bias`` in natural-log units; a zero bias or length compiles the unbiased kernel;
    ``token_perm`` int32 ``[L]`` on q's device or None; ``pooled_tail``: the pre-pass appends the pooled
    keys, the block lists their tiles, and the kernel is compiled with ``HAS_TAIL``)."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    if cfg["schedule"] not in SCHEDULES or int(cfg["stages"]) < 2 or int(cfg["q_stages"]) < 1 \
            or int(cfg["fma_quarters"]) not in (0, 1, 2) or int(cfg["p_bits"]) not in (0, 1, 2) \
            or (int(cfg["p_bits"]) and (int(cfg["fma_quarters"]) or int(cfg.get("ablate", 0)) == 1)) \
            or cfg["v_scaling"] not in ("channel", "block") or cfg["p_clamp"] not in ("max", "sat") \
            or cfg["o_store"] not in ("regs", "vec", "tma") or cfg["q_quant"] not in ("prepass", "kernel"):
        raise ValueError(f"bad warp-specialised kernel config {cfg}: schedule one of {SCHEDULES}, stages >= 2, "
                         "q_stages >= 1, p_bits 0 / 1 / 2, fma_quarters 0 / 1 / 2 and ablate 1 (the exp2's: p_bits 0 only), "
                         "v_scaling channel / block, p_clamp max / sat, o_store regs / vec / tma, "
                         "q_quant prepass / kernel")
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    suffix_start = check_key_biases(prefix_len, prefix_bias, suffix_len, suffix_bias, kv_len)
    has_bias = (prefix_len > 0 and prefix_bias != 0.0) or suffix_start < kv_len
    # a token order gathers Q's rows, and a TMA descriptor needs 16-byte aligned strides: else the pre-pass's Q
    q_kernel = cfg["q_quant"] == "kernel" and token_perm is None and tma_compatible(q)
    q8, k8, v8t, q_scale, k_scale, v_scale = quantize_qkv_fp8(q, k, v, scale, quantize_q=not q_kernel,
                                                              v_key_order="wgmma", token_perm=token_perm,
                                                              v_scaling=cfg["v_scaling"],
                                                              pool_block=BLOCK if pooled_tail else None)
    lpad_q, lpad_k = padded_len(q_len), k8.shape[2]  # (lpad_k: rows per (b, h) of k8, the pooled ones included)
    num_q_blocks, num_kv_blocks = block_map.shape[2:]
    if pooled_tail:  # pooled tile p is key block padded_len(Lk) / 128 + p of k8 / v8t
        kv_num, kv_idx, sched, map_strides, tail = lpt_block_lists(block_map, tail_spec(
            kv_len, BLOCK, padded_len(kv_len) // BLOCK, prefix_len, prefix_bias, suffix_start, suffix_bias))
        tail_args = (tail.tail_num, tail.bias, tail.bias.shape[-1], padded_len(kv_len) // BLOCK)
    else:
        kv_num, kv_idx, sched, map_strides = lpt_block_lists(block_map)
        tail_args = (kv_num, k_scale, 0, 0)  # (never read)
    qk_layout, vt_layout = shared_layouts(head_dim)
    if q_kernel:  # the input's own rows
        q_desc = rows_descriptor(q, BLOCK)
        q_scale = k_scale  # not read
    else:
        q_desc = TensorDescriptor.from_tensor(q8.view(-1, head_dim), [BLOCK, head_dim], qk_layout)
    k_desc = TensorDescriptor.from_tensor(k8.view(-1, head_dim), [BLOCK, head_dim], qk_layout)
    v_desc = TensorDescriptor.from_tensor(v8t.view(-1, lpad_k), [head_dim, BLOCK], vt_layout)
    out = output_like(q)
    o_tma = cfg["o_store"] == "tma" and token_perm is None  # a token order scatters rows: 16-byte stores
    o_desc = rows_descriptor(out, CONSUMER_ROWS)
    num_tiles = batch * heads * num_q_blocks
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    _bsa_ws_kernel[(min(num_tiles, sms),)](
        q_desc, k_desc, v_desc, out, o_desc, float(scale * LOG2E), q_scale, k_scale, v_scale, kv_num, kv_idx, sched,
        heads, q_len, kv_len, lpad_q, lpad_k, num_kv_blocks, num_q_blocks, num_tiles,
        q_scale.shape[-1], k_scale.shape[-1], int(prefix_len) if has_bias else 0,
        float(prefix_bias) * LOG2E if has_bias else 0.0, suffix_start,
        float(suffix_bias) * LOG2E if suffix_start < kv_len else 0.0, k_scale if token_perm is None else token_perm,
        out.stride(0), out.stride(1), out.stride(2), *map_strides, *tail_args,
        HEAD_DIM=head_dim, STAGES=int(cfg["stages"]), Q_STAGES=int(cfg["q_stages"]),
        TAIL_K=kv_len % BLOCK != 0, HAS_BIAS=has_bias, P_SHIFT=P_SHIFT_LOG2, SCHEDULE=cfg["schedule"],
        ABLATE=int(cfg.get("ablate", 0)), FMA_QUARTERS=int(cfg["fma_quarters"]), HAS_PERM=token_perm is not None,
        HAS_SUFFIX=suffix_start < kv_len, P_BITS=int(cfg["p_bits"]), V_BLOCK=cfg["v_scaling"] == "block",
        P_SAT=cfg["p_clamp"] == "sat", O_VEC=cfg["o_store"] != "regs", O_TMA=o_tma, Q_KERNEL=q_kernel,
        HAS_TAIL=bool(pooled_tail), num_warps=4)
    return out


def block_sparse_attention_ws(q, k, v, block_map, scale: float, config: dict | None = None, prefix_len: int = 0,
                              prefix_bias: float = 0.0, token_perm: torch.Tensor | None = None, suffix_len: int = 0,
                              suffix_bias: float = 0.0, pooled_tail: bool = False) -> torch.Tensor:
    """The warp-specialised FP8 kernel on a CUDA sm_90 device (module docstring: the contract).
    ``prefix_bias`` (natural-log units) is added to the scaled logits of keys ``[0, prefix_len)``,
    ``suffix_bias`` to those of the last ``suffix_len`` keys. ``token_perm`` (``Lq == Lk == L``; int32/int64 ``[L]``,
    a permutation): attention runs on the
    tokens in that order (position ``i`` = input row ``token_perm[i]``; ``block_map`` and
    ``prefix_len`` in that order), fused into the pre-pass's loads and the output store; the output
    is in the input order. ``pooled_tail``: every key block a row's map skips enters its softmax as one
    pooled term (module docstring, "Pooled tail").
    ``ValueError`` for inputs outside the contract (the caller's auto chain then takes the next
    backend); inputs whose offsets overflow int32 run in (batch, head) chunks."""
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
                                                              token_perm, suffix_len, suffix_bias, pooled_tail),
            tail_rows(k.shape[2], BLOCK) if pooled_tail else 0)


__all__ = ["block_sparse_attention_ws", "available", "supports", "DEFAULT_CONFIG", "BLOCK"]
