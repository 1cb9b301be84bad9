"""The triton_fp8_ws backend (the warp-specialised Gluon FP8 kernel) on the CPU: where auto takes it,
which calls it sends on, what an explicit choice says, and that the kernel compiles for sm_90 with the
installed Triton (every variant a call can select, head dims 64 / 128, FP8 wgmmas, P handed to ``P @ V``
without a shuffle; the kernel itself asserts that conversion is trivial), and its configuration. Its numerics: test_kernels_ws_gpu.py."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch


def test_auto_takes_it_first_on_hopper_and_never_for_block_mass():
    from chorus.kernels import api

    assert api._AUTO_CHAIN[:2] == (api.Backend.TRITON_FP8_WS, api.Backend.TRITON_FP8)
    assert api.Backend.TRITON_FP8_WS in api._SM90_ONLY
    q = torch.zeros(1, 1, 8, 128)
    assert api.Backend.TRITON_FP8_WS not in api._candidates(q, "block_mass")
    assert "no block_mass" in api.why_unavailable(api.Backend.TRITON_FP8_WS, q, "block_mass")


def test_calls_it_cannot_take_go_down_the_chain_or_raise_when_explicit():
    from chorus.kernels import api

    q = torch.zeros(1, 1, 8, 128)
    ws = api.Backend.TRITON_FP8_WS
    assert api._for_call_options(ws, False, q, 128, 0) == ws
    assert api._for_call_options(ws, False, q, 128, 16) == ws  # a guidance prefix bias: in the kernel
    assert api._for_call_options(ws, False, q, 64, 0) != ws  # another block size
    with pytest.raises(api.BackendUnavailableError, match="block size 256"):
        api._for_call_options(ws, True, q, 256, 0)
    from chorus.kernels.triton import ws_call_unsupported

    assert "head dim 96" in ws_call_unsupported(96, 128)
    assert ws_call_unsupported(128, 128) is None
    # a suffix key bias (feature reuse's compact attention) runs in the kernel too
    assert api._for_call_options(ws, False, q, 128, 0, 2000) == ws
    assert api._for_call_options(ws, True, q, 128, 300, 2000) == ws


def test_the_engine_and_the_node_offer_it():
    from chorus.engine import BACKENDS, SparseConfig

    assert "triton_fp8_ws" in BACKENDS
    assert SparseConfig(backend="triton_fp8_ws").backend == "triton_fp8_ws"


def test_the_int8_variant_is_an_explicit_backend_auto_never_takes():
    """``triton_int8_ws`` (the accurate numerics in this kernel): not in auto's chain, attention only, sm_90
    only; where it cannot run an explicit choice raises with the reason (here: no CUDA), calls of another block
    size or head dim raise, the pooled tail is its own."""
    from chorus.engine import BACKENDS
    from chorus.kernels import api, block_sparse_attention

    int8_ws = api.Backend.TRITON_INT8_WS
    assert int8_ws.value in BACKENDS and int8_ws not in api._AUTO_CHAIN and api.has_pooled_tail(int8_ws)
    q = torch.zeros(1, 1, 8, 128)
    assert "no block_mass" in api.why_unavailable(int8_ws, q, "block_mass")
    assert "triton_int8_ws needs a CUDA tensor" in api.why_unavailable(int8_ws, q)
    assert api._for_call_options(int8_ws, False, q, 128, 16, 2000, True) == int8_ws
    with pytest.raises(api.BackendUnavailableError, match="block size 64"):
        api._for_call_options(int8_ws, True, q, 64, 0)
    x = torch.zeros(1, 1, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(api.BackendUnavailableError, match="triton_int8_ws"):
        block_sparse_attention(x, x, x, torch.ones(1, 1, 1, 1, dtype=torch.bool), backend="triton_int8_ws")


@pytest.mark.parametrize("head_dim,has_bias,has_perm,has_suffix", [
    (128, False, False, False), (64, False, False, False), (128, True, True, False), (64, True, False, False),
    (128, True, False, True), (64, True, True, True)])
def test_kernel_compiles_for_sm90_with_fp8_wgmma_and_no_shuffles(head_dim, has_bias, has_perm, has_suffix):
    from chorus.kernels.triton import _attention_ws

    if _attention_ws.available():
        pytest.fail(f"this Triton has no Gluon Hopper API: {_attention_ws.available()}")
    from aot_check import compile_ws

    kernel = compile_ws(head_dim, tail=True, has_bias=has_bias, has_perm=has_perm, has_suffix=has_suffix)
    ptx = kernel.asm["ptx"]
    mmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", ptx))
    # QK^T: N = 128 keys; PV: N = D; the row sums of P's e4m3 bits: N = 8 (P8 @ ones)
    assert mmas == {"128", str(head_dim), "8"}, mmas
    exp2 = len(re.findall(r"ex2\.approx", ptx))
    assert exp2 <= 8, exp2  # P without the MUFU: exp2 only for each row's rescale
    # P's bits clamped at 0 by the FFMA's saturation: one saturating FMA per element of S
    saturating = len(re.findall(r"fma\.rn\.sat\.f32", ptx))
    assert saturating >= 64, saturating
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240", ptx)  # the consumer warpgroups
    # P reaches P @ V in its registers: the only cross-lane index shuffles left broadcast lane 0's warp id
    # (for the partitions, the TMA output stores' and Q stores' issuing lanes), none moves data
    sources = re.findall(r"shfl\.sync\.idx\.b32\s+%r\d+, (%r\d+), 0, 31, -1;", ptx)
    assert len(sources) == ptx.count("shfl.sync.idx") <= 4, sources
    assert kernel.metadata.shared <= 228 * 1024


def test_the_key_block_loop_runs_three_gemms_and_no_exp2_per_element():
    """The loop every kept key block takes (``aot_check.key_block_loop_ops`` on the SASS): per k-step of 32
    the three wgmmas (Q @ K^T, P @ V and the row sums P8 @ ones), and the MUFU only for the rows' rescale
    (2 per thread). Built for a length with a partial last key block, as Wan's are."""
    from chorus.kernels.triton import _attention_ws

    if _attention_ws.available():
        pytest.fail(f"this Triton has no Gluon Hopper API: {_attention_ws.available()}")
    from aot_check import compile_ws, key_block_loop_ops, sass_of

    ops = key_block_loop_ops(sass_of(compile_ws(128, tail=True)))
    assert ops.get("QGMMA", 0) == 12, ops
    assert ops.get("MUFU", 0) <= 2, ops


@pytest.mark.parametrize("head_dim,has_perm,q_kernel", [
    (128, False, True), (128, False, False), (64, False, True), (128, True, False)])
def test_tma_store_and_q_quantised_in_the_kernel_compile_for_sm90(head_dim, has_perm, q_kernel):
    """Without a token order each consumer stores its output rows with one TMA store (4-D: any output
    strides) through its shared buffer, waited for before the buffer is rewritten; a token order scatters
    its rows with plain stores. Q from its input rows (``q_kernel``): the producer loads Q's bf16 rows by
    TMA and each consumer converts its 64 rows to e4m3 itself (saturating conversion), so the pre-pass
    reads only K and V; else the pre-pass's e4m3 Q. Every variant fits the shared memory and spills
    nothing."""
    from chorus.kernels.triton import _attention_ws

    if _attention_ws.available():
        pytest.fail(f"this Triton has no Gluon Hopper API: {_attention_ws.available()}")
    from aot_check import compile_ws, summarize

    kernel = compile_ws(head_dim, tail=True, has_perm=has_perm, q_kernel=q_kernel)
    ptx = kernel.asm["ptx"]
    o_tma = not has_perm
    stores = len(re.findall(r"cp\.async\.bulk\.tensor\.4d\.global\.shared::cta", ptx))
    assert stores == (2 if o_tma else 0), stores  # one per consumer
    assert ("cp.async.bulk.wait_group.read" in ptx) == o_tma
    q_loads = len(re.findall(r"cp\.async\.bulk\.tensor\.4d\.shared::(?:cta|cluster)\.global", ptx))
    assert q_loads == (1 if q_kernel else 0), q_loads  # the producer's Q load
    if q_kernel:  # the consumer's e4m3 rows: every warp's stores fenced and joined before its first wgmma
        before = ptx[:ptx.index("wgmma.mma_async")]
        assert "bar.sync" in before[before.rindex("fence.proxy.async.shared::cta"):]
    converts = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx))
    assert converts >= (2 * head_dim // 4 if q_kernel else 0), converts  # 64 rows x D / 128 threads / 2 per cvt
    assert kernel.metadata.shared <= 227 * 1024
    assert " stack=0" in summarize(kernel, sass=False)  # no spills (cuobjdump's resource usage)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240", ptx)


def test_q_goes_to_the_kernel_only_where_a_tma_descriptor_can_address_it():
    """``q_quant="kernel"`` loads Q's input rows by TMA: 16-byte aligned base and strides. Any other q
    (a view with a 264-byte row stride, an odd start) takes the pre-pass's Q, which reads any strides."""
    from chorus.kernels.triton._attention_ws import tma_compatible

    x = torch.zeros(1, 64, 4, 132, dtype=torch.bfloat16)
    assert tma_compatible(x[..., :128].transpose(1, 2).contiguous())
    assert tma_compatible(torch.zeros(1, 64, 4, 128, dtype=torch.bfloat16).transpose(1, 2))  # ComfyUI's layout
    assert not tma_compatible(x[..., :128])  # rows 264 bytes apart
    assert not tma_compatible(x.view(-1)[1:1 + 4 * 64 * 128].view(1, 4, 64, 128))  # base off by 2 bytes
    assert not tma_compatible(x[..., :128].transpose(2, 3))  # D not the contiguous axis


@pytest.mark.parametrize("fields", [{"stages": 1}, {"q_stages": 0}, {"stages": 2.5}, {"stages": True}])
def test_a_config_outside_the_kernel_s_range_is_a_clear_error(fields):
    """:class:`WsConfig` checks its fields when it is made; the launcher takes nothing else (a dict of
    options is an error before anything is launched)."""
    from chorus.kernels.triton._attention_ws import WsConfig, launch_ws

    with pytest.raises(ValueError, match="WsConfig"):
        WsConfig(**fields)
    assert WsConfig() == WsConfig(stages=3, q_stages=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        WsConfig().stages = 2
    x = torch.zeros(1, 1, 128, 128)
    with pytest.raises(ValueError, match="config must be a WsConfig"):
        launch_ws(x, x, x, torch.ones(1, 1, 1, 1, dtype=torch.bool), 0.1, {"stages": 2})


@pytest.mark.parametrize("own_loop", [False, True], ids=["one_loop", "pooled_loop"])
@pytest.mark.parametrize("head_dim,options", [
    (128, {}), (64, {}), (128, dict(has_perm=True, has_bias=True)), (64, dict(has_bias=True, has_suffix=True)),
    (128, dict(q_kernel=False))])
def test_kernel_with_the_pooled_tail_compiles_for_sm90(head_dim, options, own_loop):
    """``HAS_TAIL`` (the pooled tail), in both of the FP8 kernel's forms: every option builds, spills nothing,
    fits the shared memory, prefetches each tile's row of the bias table into L1 once per consumer, and a kept
    key block runs the same loop as without the tail (both by the same ptxas). One loop (Triton's own
    ptxas): the pooled tiles' weights load and add sit in a branch only pooled tiles take. ``POOLED_LOOP``
    (assembled by the fixed ptxas of :mod:`chorus.kernels.triton._ptxas`): each consumer runs a second loop
    for the pooled tiles, with their weights' loads and no key-bias terms, and the kept blocks' loop is the
    plain one (Q's scale loaded per block when it comes from the pre-pass)."""
    from chorus.kernels.triton import _attention_ws, _ptxas

    if _attention_ws.available():
        pytest.fail(f"this Triton has no Gluon Hopper API: {_attention_ws.available()}")
    from aot_check import compile_ws, key_block_loop_ops, sass_of, summarize, wgmma_loops

    assembler = _ptxas.fixed_ptxas() if own_loop else None
    if own_loop and assembler is None:
        pytest.skip(f"no ptxas here assembles the pooled tiles' own loop: {_ptxas.describe()}")
    kernel = compile_ws(head_dim, tail=True, has_tail=True, assembler=assembler, **options)
    ptx = kernel.asm["ptx"]
    assert ptx.count("prefetch.global.L1") == 2, ptx.count("prefetch.global.L1")  # one per consumer
    assert " stack=0" in summarize(kernel, sass=False)
    assert kernel.metadata.shared <= 227 * 1024
    plain_kernel = compile_ws(head_dim, tail=True, assembler=assembler, **options)  # (the same ptxas)
    sass = sass_of(kernel)
    kept = key_block_loop_ops(sass, kept_blocks_only=True)
    plain = key_block_loop_ops(sass_of(plain_kernel))
    q_scale_loads = int(own_loop and (options.get("has_perm", False) or options.get("q_kernel") is False))
    for op in ("QGMMA", "FFMA", "FMUL", "FMNMX", "PRMT", "MUFU", "LDG"):  # nothing per element
        assert kept.get(op, 0) == plain.get(op, 0) + (q_scale_loads if op == "LDG" else 0), (op, kept, plain)
    if own_loop:
        # the kept blocks' loop is the plain one (give or take the assembler's scheduling), and the pooled tiles'
        # loop follows it: their 128 weights per row loaded (16 per thread), no branch per key block
        assert kept["total"] <= plain["total"] + 8 and kept.get("FSEL", 0) == plain.get("FSEL", 0), (kept, plain)
        pooled = key_block_loop_ops(sass, loop=wgmma_loops(sass)[1])
        assert pooled.get("QGMMA", 0) == plain["QGMMA"] and pooled.get("LDG", 0) >= 16, pooled
        assert pooled["total"] <= plain["total"] + 8, (pooled, plain)
    else:
        # a few scalar ops per block: is it pooled, and (with key biases) no whole-block bias if so
        assert kept.get("FSEL", 0) <= plain.get("FSEL", 0) + 2 and kept["total"] <= plain["total"] + 16, (kept, plain)
    assert "prefetch" not in plain_kernel.asm["ptx"]


def test_pooled_tail_calls_stay_on_it_and_its_op_has_a_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from chorus.kernels import api

    q = torch.zeros(1, 1, 8, 128)
    ws = api.Backend.TRITON_FP8_WS
    assert api._for_call_options(ws, True, q, 128, 0, 0, True) == ws
    assert api._for_call_options(ws, False, q, 64, 0, 0, True) != ws  # (another block size goes down the chain)
    import chorus.kernels.triton  # noqa: F401 (registers the ops)

    with FakeTensorMode() as mode:
        qf = mode.from_tensor(torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16))
        bm = mode.from_tensor(torch.ones(1, 1, 3, 3, dtype=torch.bool))
        out = torch.ops.chorus.block_sparse_attention_ws(qf, qf, qf, bm, 0.1, 0, 0.0, None, 0, 0.0, True)
        assert out.shape == qf.shape and out.dtype == qf.dtype


@pytest.mark.parametrize("fp8,use_tma", [(True, True), (True, False), (False, True), (False, False)])
def test_the_triton_kernel_and_the_tail_s_own_kernels_compile_for_sm90(fp8, use_tma):
    """The interpreter runs the pooled tail's Triton code on the CPU; this compiles it for sm_90 as the GPU
    does: the attention kernel with ``HAS_TAIL`` (FP8: the pooled rows through K / V's own descriptors;
    16-bit: pointer loads from their own buffers), the pre-pass with the pooled sums, the 16-bit sums, the
    means' finalisation (FP8, 16-bit), the block lists with the tail."""
    from aot_check import compile_attn, compile_jit, summarize
    from chorus.kernels.triton import _attention as A
    from chorus.kernels.triton import _quant as Q

    kernel = compile_attn(fp8=fp8, use_tma=use_tma, block_m=64 if fp8 else 128, num_warps=4 if fp8 else 8,
                          num_stages=3 if fp8 else 2, tail=True, has_tail=True)
    # the TMA configs (every call whose tensors a descriptor can address: FP8 always) spill nothing; the
    # pointer fallback spills with the tail's loop (16-24 bytes under Triton 3.8, 112 under 3.6 for FP8)
    if use_tma:
        assert " stack=0" in summarize(kernel, sass=False)
    if not (fp8 and use_tma):
        return
    fp32 = "*fp32"
    compile_jit(Q._quant_kernel, dict(Q="*bf16", K="*bf16", V="*bf16", q8="*fp8e4nv", k8="*fp8e4nv", v8t="*fp8e4nv",
                                      q_scale=fp32, k_scale=fp32, k_smooth=fp32, v_stats=fp32, token_perm="*i32",
                                      pool_sums=fp32, q_mult="fp32"),
                dict(HEAD_DIM=128, TILE=128, INTERPRET=False, QUANT_Q=False, HAS_PERM=True, V_WGMMA_ORDER=True,
                     POOL_CHUNK=64), num_warps=8)
    compile_jit(Q._kv_block_sums_kernel, dict(K="*bf16", V="*bf16", pool_sums=fp32),
                dict(HEAD_DIM=128, TILE=128, POOL_CHUNK=128), num_warps=8)
    for out_type, is_fp8 in (("*fp8e4nv", True), ("*bf16", False)):
        compile_jit(Q._pooled_finalize_kernel, dict(pool_sums=fp32, k_out=out_type, v_out=out_type, k_scale=fp32,
                                                    v_stats=fp32),
                    dict(HEAD_DIM=128, TILE=128, BS=256, POOL_CHUNK=128, FP8=is_fp8, INTERPRET=False,
                         V_WGMMA_ORDER=is_fp8), num_warps=8)
    compile_jit(A._compress_map_kernel, dict(block_map="*u8", kv_num="*i32", kv_idx="*i32", tail_num="*i32",
                                             tail_bias=fp32, prefix_bias="fp32", suffix_bias="fp32"),
                dict(CHUNK=1024, TAIL=True, TAIL_TILE=128))


@pytest.mark.parametrize("block,packed", [(16, True), (256, False), (1024, True), (4096, True)])
def test_the_block_selection_kernel_compiles_for_sm90(block, packed):
    """The miss's selection kernel as the GPU builds it at the row widths it takes (16 up to
    SELECT_MAX_KEYS = 4096 key blocks), one warp per row: ``top_p`` / the tolerance as 64-bit integers
    (their float64 bits); it builds, and spills nothing up to the 720p width (1 024)."""
    from aot_check import compile_jit, summarize
    from chorus.kernels.triton import _select as S

    kernel = compile_jit(S._select_kernel, dict(mass_ptr="*fp32", out_ptr="*u8", top_p_bits="i64", tol_bits="i64"),
                         dict(KEEP_DIAG=True, PACKED=packed, BLOCK=block), num_warps=S.SELECT_WARPS)
    if block <= 1024:
        assert " stack=0" in summarize(kernel, sass=False)


@pytest.mark.parametrize("bits", [16, 256, 512, 1024, 2048, 8192])
@pytest.mark.parametrize("has_floor", [False, True])
def test_the_map_floor_kernel_compiles_for_sm90(bits, has_floor):
    """A hit's map from its entry's packed map (:mod:`chorus.kernels.triton._floor_map`) as the GPU builds it,
    from the narrowest row to FLOOR_MAP_MAX_KEYS (720p's 591 key blocks: 1 024), at the launcher's rows per
    program: it builds and spills nothing."""
    from aot_check import compile_jit, summarize
    from chorus.kernels.triton import _floor_map as F

    kernel = compile_jit(F._floor_map_kernel, dict(packed_ptr="*u8", near_ptr="*u8", map_ptr="*u8",
                                                   out_packed_ptr="*u8", count_ptr="*i32"),
                         dict(HAS_FLOOR=has_floor, BITS=bits, ROWS=F.rows_per_program_for(bits)))
    assert " stack=0" in summarize(kernel, sass=False)


@pytest.mark.parametrize("has_tail", [False, True])
def test_the_int8_kernel_and_its_prepass_compile_for_sm90(has_tail):
    """The accurate INT8 path as the GPU builds it (the interpreter runs its Triton code on the CPU): the
    attention kernel takes the signed 8-bit wgmma (s32 accumulator) for both products and spills nothing at
    its tiling; the INT8 pre-pass (Hadamard rotation by a 16-bit dot) and the pooled values' finalisation build."""
    from aot_check import compile_attn, compile_jit, summarize
    from chorus.kernels.triton import _quant_int8 as Q8

    kernel = compile_attn(fp8=False, int8=True, use_tma=True, block_m=64, block_n=128, num_warps=4, num_stages=3,
                          tail=True, has_tail=has_tail)
    line = summarize(kernel, sass=False)
    assert "m64n128k32.s32.s8.s8" in line and " stack=0" in line, line
    if not has_tail:
        return
    fp32 = "*fp32"
    compile_jit(Q8._quant_int8_kernel, dict(Q="*bf16", K="*bf16", V="*bf16", q8="*i8", k8="*i8", v8t="*i8",
                                            q_scale=fp32, k_scale=fp32, v_sums="*i32", k_smooth_rot=fp32,
                                            v_absmax=fp32, hmat="*bf16", token_perm="*i32", pool_sums=fp32,
                                            q_mult="fp32"),
                dict(HEAD_DIM=128, TILE=128, INTERPRET=False, HAS_PERM=True, POOL_CHUNK=128, V_WGMMA_ORDER=True),
                num_warps=4)
    compile_jit(Q8._pooled_finalize_int8_kernel, dict(pool_sums=fp32, k8="*i8", v8t="*i8", k_scale=fp32,
                                                      v_sums="*i32", v_pool_absmax=fp32),
                dict(HEAD_DIM=128, TILE=128, BS=128, POOL_CHUNK=128, V_WGMMA_ORDER=True), num_warps=8)


@pytest.mark.parametrize("head_dim,has_tail,has_bias,has_perm,has_suffix", [
    (128, False, False, False, False), (128, True, False, False, False), (64, True, True, False, False),
    (64, False, True, True, True), (128, True, True, True, True)])
def test_the_int8_variant_compiles_for_sm90_with_signed_8bit_wgmma(head_dim, has_tail, has_bias, has_perm,
                                                                   has_suffix):
    """The accurate numerics in the warp-specialised kernel (backend ``triton_int8_ws``), as the GPU builds it: the
    three products are signed 8-bit wgmmas with int32 accumulators (no FP8 one), P's levels come from the MUFU's
    exp2 (one per element of S: 64 per thread and block, 4 more for the rows' weights), P reaches ``P @ V`` in
    its registers (no data shuffles), and a kept key block's loop carries no per-channel multiply for the pooled
    values (their scale enters O once per tile: at most the rows' 12-18 FMULs per block)."""
    from chorus.kernels.triton import _attention_ws

    if _attention_ws.available():
        pytest.fail(f"this Triton has no Gluon Hopper API: {_attention_ws.available()}")
    from aot_check import compile_ws, key_block_loop, key_block_loop_ops, sass_of, summarize

    kernel = compile_ws(head_dim, tail=True, has_tail=has_tail, has_bias=has_bias, has_perm=has_perm,
                        has_suffix=has_suffix, int8=True)
    ptx = kernel.asm["ptx"]
    mmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.s32\.s8\.s8", ptx))
    assert mmas == {"128", str(head_dim), "8"}, mmas
    assert not re.search(r"wgmma[^\n]*e4m3", ptx)
    sources = re.findall(r"shfl\.sync\.idx\.b32\s+%r\d+, (%r\d+), 0, 31, -1;", ptx)
    assert len(sources) == ptx.count("shfl.sync.idx") <= 4, sources
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240", ptx)
    sass = sass_of(kernel)
    ops = key_block_loop_ops(sass, kept_blocks_only=True)
    # per k-step of 32: Q @ K^T over D, P @ V and P @ ones over the 128 keys
    assert ops.get("IGMMA", 0) == head_dim // 32 + 8, ops
    assert 64 <= ops.get("MUFU", 0) <= 72 and ops.get("FMUL", 0) <= 24, ops
    # P @ V's accumulator starts at 128 x the V sums plus the float offset's bits: after the loop's last wgmma wait
    # no integer add per output element (adding them there was 64 more per thread and block and 19% of the time),
    # only the row sums' four
    loop = [text for _, text in key_block_loop(sass)]
    after_last_wait = loop[max(i for i, text in enumerate(loop) if "WARPGROUP.DEPBAR" in text):]
    int_adds = [text for text in after_last_wait if re.match(r"(@!?P\d+ )?(IADD3|VIADD|IMAD\.IADD)\b", text)]
    assert len(int_adds) <= 4, int_adds
    # spills: none, but 8 bytes with the tail and a key bias at head dim 128 (measured on the H200 with them)
    line = summarize(kernel, sass=False)
    assert kernel.metadata.shared <= 228 * 1024 and re.search(r" stack=(0|8)\b", line), line
