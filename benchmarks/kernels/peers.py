"""Peer attention implementations for the kernel benchmark, one registry, same inputs and block maps.

Each peer is ``make(q, k, v, block_map, block_size) -> (fn, reason)``: ``fn`` is a zero-argument
callable returning the attention output ``[B, H, L, D]`` (a dense peer ignores the map and computes
dense attention; the benchmark then counts dense FLOPs), or ``fn is None`` and ``reason`` says exactly
why the peer cannot run here (the ImportError text, the GPU, a shape limit, a failed build). ``make``
never raises: anything unexpected becomes the reason. Calling ``fn`` may still raise (a kernel that
fails to compile on first call); the benchmark records that message as the reason.

q, k, v: ``[B, H, L, D]`` bf16 (the benchmark's inputs); block maps bool
``[B or 1, H or 1, ceil(L/bs), ceil(L/bs)]`` as everywhere in ``chorus.kernels``.

Peers (``PEERS``, in table order):

- ``ours_fp8`` / ``ours_bf16``: ``chorus.kernels.block_sparse_attention`` (Triton), for the side-by-side rows.
- ``ours_fp8_persistent``: our FP8 kernel with the persistent launch (the persistent-kernel lever).
- ``ours_fp8_ws``: the ``triton_fp8_ws`` backend (the warp-specialised Gluon FP8 kernel,
  ``chorus.kernels.triton._attention_ws``); ``ours_fp8_ws_tail``: the same with ``pooled_tail=True``.
- ``ours_int8`` / ``ours_int8_tail``: the ``triton_int8`` backend (the accurate INT8 path of the portable
  kernel), without / with the pooled tail; ``ours_int8_ws`` / ``ours_int8_ws_tail``: the same numerics in the
  warp-specialised kernel (``triton_int8_ws``).
- ``sol_attn_topk``: ComfyUI's own sparse attention, ``comfy_kitchen.sol_attn`` (package
  ``comfy-kitchen``, optional extra ``peers``; CUDA kernels, INT8 MMA, 64-token blocks), top-k routing at the map's kept fraction
  (``topk_ratio``; its own routing picks the blocks, plus its diagonal), its pooled tail on (its default);
  a full map runs every block (``tau=-1e9``). Inputs in its ``[B, L, H, D]`` layout, made once outside
  the timed call. FLOPs are counted from our map's kept blocks, as for every sparse peer. The benchmark's
  cosine against the map's masked reference would be no accuracy figure for these two tail peers (their
  skipped blocks enter as pooled terms; sol routes by itself), so they have none (``Peer.no_reference``):
  ``tail_quality.py`` measures their error.
- ``api_fa4_bf16``: the same API with ``backend="fa4_bf16"`` (FlashAttention-4's kernel, the block lists
  built from the map inside each call, as a hit runs it).
- ``flex_compiled``: ``torch.compile(flex_attention)`` with a ``BlockMask`` from the same map (sparse).
- ``cudnn_sdpa_bf16``: torch SDPA restricted to the cuDNN backend (dense).
- ``cudnn_fp8_sdpa``: cuDNN frontend graph ``sdpa_fp8`` (``nvidia-cudnn-frontend``), q/k/v quantised to
  e4m3 with one power-of-two scale per tensor inside the call, bf16 output (dense);
  ``cudnn_fp8_sdpa_kernel``: the same graph on inputs quantised once outside the timed call.
- ``cudnn_bf16_block_mask``: cuDNN frontend graph ``sdpa`` with a bit-packed 128 x 128 tile ``block_mask``
  (needs cuDNN >= 9.14 and the "unified" SDPA engine; sparse).
- ``cudnn_bsa``: ``cudnn.block_sparse_attention`` (CuTe DSL kernels shipped in the frontend wheel; needs
  ``nvidia-cutlass-dsl``; sparse).
- ``cudnn_bsa_fp8``: ``cudnn.block_sparse_attention_fp8_forward`` (SageAttention-style FP8, native
  128 x 128 blocks on sm_90; bf16 inputs quantised inside the call; on sm_90 it takes one fixed count of
  key blocks per query block and lengths that are multiples of 128, so it runs on the benchmark's
  ``--uniform-rows`` maps at padded lengths only; sparse).
- ``sageattention``: ``sageattn`` 1.0.6 (Triton, INT8 QK, dense).
- ``flashinfer_block_sparse``: FlashInfer ``VariableBlockSparseAttentionWrapper`` (sparse).
- ``fa4_block_sparse``: FlashAttention-4 (``flash_attn.cute.flash_attn_func``) with
  ``BlockSparseTensorsTorch`` (sparse).

Also :func:`reference_subset`, the fp32 reference (masked by the map or dense) on a few heads, chunked
over queries so that it fits at L = 75 600.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

FLASHINFER_NOT_INSTALLED = ("flashinfer-python is not installed on the benchmark machine: its 62 MB wheel plus "
                            "dependencies exceed what one call can carry next to the rest, and it JIT-compiles "
                            "its kernels with nvcc for minutes")
FA4_NOT_INSTALLED = ("flash-attn-4 (4.0.0b36, CuTe DSL) is not installed on the benchmark machine: its dependency "
                     "nvidia-cutlass-dsl-libs-cu13 is a 92 MB wheel, over the 64 MiB one call can carry")
CUTLASS_DSL_NOT_INSTALLED = ("nvidia-cutlass-dsl (CuTe DSL, required by cudnn.block_sparse_attention) is not "
                             "installed: nvidia-cutlass-dsl-libs-cu13 is a 92 MB wheel, over the 64 MiB one call "
                             "can carry")

MakeResult = tuple  # (Callable[[], torch.Tensor] | None, str)


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    sparse: bool  # True: honours the block map (kept-block FLOPs); False: dense attention (dense FLOPs)
    make: Callable[..., MakeResult]
    what: str
    # the benchmark's cosine against the fp32 reference masked by the map (dense peers: unmasked); None for a
    # peer that computes something else (a pooled tail, its own routing): no cosine, this says why
    no_reference: str | None = None


def _err(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    return f"{type(exc).__name__}: {text[:600]}" if text else type(exc).__name__


def _needs_cuda(q: torch.Tensor, name: str) -> str | None:
    if q.device.type != "cuda":
        return f"{name} needs a CUDA tensor, got device {q.device}"
    return None


def expand_map(block_map: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """bool ``[B, H, Qb, Kb]`` (contiguous) from a map with broadcast batch / head dims."""
    return block_map.expand(batch, heads, *block_map.shape[-2:]).contiguous()


def block_index_lists(block_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block: (count int32 ``[B, H, Qb]``, kept key-block ids first in increasing order int32
    ``[B, H, Qb, Kb]``; entries past the count are the dropped ids, all in range)."""
    counts = block_map.sum(-1, dtype=torch.int32)
    order = torch.argsort((~block_map).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts, order


def pack_tile_mask_lsb(block_map: torch.Tensor) -> torch.Tensor:
    """bool ``[B, H, Qb, Kb]`` -> uint8 ``[B, H, Qb, ceil(Kb/8)]``, bit ``j`` (least significant first) of
    byte ``n`` = key tile ``8n + j``: the layout of cuDNN's SDPA ``block_mask`` (128 x 128 tiles)."""
    kb = block_map.shape[-1]
    pad = (-kb) % 8
    bits = torch.nn.functional.pad(block_map.to(torch.uint8), (0, pad))
    bits = bits.reshape(*block_map.shape[:-1], (kb + pad) // 8, 8)
    weights = (1 << torch.arange(8, device=block_map.device, dtype=torch.int32)).to(torch.int32)
    return (bits.to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack_tile_mask_lsb(packed: torch.Tensor, num_kv_blocks: int) -> torch.Tensor:
    """Inverse of :func:`pack_tile_mask_lsb` (the expansion cuDNN's own test reference uses)."""
    bits = (packed[..., None].to(torch.int32) & (1 << torch.arange(8, device=packed.device, dtype=torch.int32))) != 0
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8)[..., :num_kv_blocks]


# --------------------------------------------------------------------------------------------- ours


def _make_api(backend: str, pooled_tail: bool = False):
    def make(q, k, v, block_map, block_size):
        try:
            from chorus.kernels import api
        except Exception as exc:  # noqa: BLE001
            return None, f"chorus.kernels failed to import: {_err(exc)}"
        try:
            reason = api.why_unavailable(api.Backend(backend), q)
        except Exception as exc:  # noqa: BLE001
            return None, _err(exc)
        if reason is not None:
            return None, reason
        bm = block_map.to(q.device)

        def run():
            return api.block_sparse_attention(q, k, v, bm, block_size=block_size, backend=backend, rows_checked=True,
                                              pooled_tail=pooled_tail)

        return run, ""

    return make


def make_ours_fp8_persistent(q, k, v, block_map, block_size):
    """Our FP8 kernel with the persistent launch (config ``persistent``: a fixed grid of 2 programs per
    SM walking the (batch, head)-major, LPT-within-head tiles): the issue's persistent-kernel lever."""
    fn, reason = _make_api("triton_fp8")(q, k, v, block_map, block_size)
    if fn is None:
        return None, reason
    from chorus.kernels.triton import _attention as attn

    config = dataclasses.replace(attn.DEFAULT_TILES["fp8"], persistent=True)
    bm = block_map.to(q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return (lambda: attn.block_sparse_attention_triton_impl(q, k, v, bm, block_size, scale, True, config)), ""


# --------------------------------------------------------------------------------------------- flex

_COMPILED_FLEX = None


def make_flex(q, k, v, block_map, block_size):
    global _COMPILED_FLEX
    try:
        from torch.nn.attention.flex_attention import flex_attention

        from chorus.kernels.codec import to_flex_block_mask
    except Exception as exc:  # noqa: BLE001
        return None, f"FlexAttention unavailable: {_err(exc)}"
    try:
        bm = expand_map(block_map.to(q.device), q.shape[0], q.shape[1])
        block_mask = to_flex_block_mask(bm, block_size=block_size, q_len=q.shape[2], kv_len=k.shape[2])
        if q.device.type == "cuda":
            if _COMPILED_FLEX is None:
                _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
            fn = _COMPILED_FLEX
        else:
            fn = flex_attention  # eager (unfused) path: applies the mask_mod, fine at test sizes
    except Exception as exc:  # noqa: BLE001
        return None, f"BlockMask build failed: {_err(exc)}"
    return (lambda: fn(q, k, v, block_mask=block_mask)), ""


# --------------------------------------------------------------------------------------------- cuDNN SDPA (torch)


def make_cudnn_sdpa_bf16(q, k, v, block_map, block_size):
    reason = _needs_cuda(q, "torch SDPA (cuDNN backend)")
    if reason:
        return None, reason
    try:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as exc:  # noqa: BLE001
        return None, _err(exc)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    return run, ""


# --------------------------------------------------------------------------------------------- cuDNN frontend graphs

_CUDNN_HANDLES: dict = {}
_CUDNN_GRAPHS: dict = {}
E4M3_MAX = 448.0


def _cudnn_frontend():
    """(cudnn module, None) or (None, reason)."""
    try:
        import cudnn
    except Exception as exc:  # noqa: BLE001
        return None, f"nvidia-cudnn-frontend not importable: {_err(exc)}"
    return cudnn, None


def _cudnn_handle(cudnn, device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CUDNN_HANDLES:
        with torch.cuda.device(index):
            _CUDNN_HANDLES[index] = cudnn.create_handle()
    handle = _CUDNN_HANDLES[index]
    cudnn.set_stream(handle, torch.cuda.current_stream(index).cuda_stream)
    return handle


def _bhsd_stride(shape) -> list[int]:
    b, h, s, d = shape
    return [h * s * d, s * d, d, 1]


class _Uid:
    Q, K, V, O, STATS = 1, 2, 3, 4, 5
    DESCALE_Q, DESCALE_K, DESCALE_V, DESCALE_S, SCALE_S, SCALE_O = 10, 11, 12, 13, 14, 15
    AMAX_S, AMAX_O = 20, 21
    BLOCK_MASK = 30


def _finish_build(cudnn, graph) -> None:
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()


def _build_fp8_graph(cudnn, handle, shape, attn_scale: float, fp8_output: bool, stats: bool):
    """cuDNN ``sdpa_fp8`` forward: e4m3 q/k/v with per-tensor descales; O bf16 (or e4m3 with scale_o)."""
    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    stride = _bhsd_stride(shape)
    tq = graph.tensor(name="q", uid=_Uid.Q, dim=list(shape), stride=stride, data_type=fp8)
    tk = graph.tensor(name="k", uid=_Uid.K, dim=list(shape), stride=stride, data_type=fp8)
    tv = graph.tensor(name="v", uid=_Uid.V, dim=list(shape), stride=stride, data_type=fp8)

    def scalar(name, uid):
        return graph.tensor(name=name, uid=uid, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)

    o, st, amax_s, amax_o = graph.sdpa_fp8(
        q=tq, k=tk, v=tv,
        descale_q=scalar("descale_q", _Uid.DESCALE_Q), descale_k=scalar("descale_k", _Uid.DESCALE_K),
        descale_v=scalar("descale_v", _Uid.DESCALE_V), descale_s=scalar("descale_s", _Uid.DESCALE_S),
        scale_s=scalar("scale_s", _Uid.SCALE_S), scale_o=scalar("scale_o", _Uid.SCALE_O),
        generate_stats=stats, attn_scale=attn_scale, use_causal_mask=False, name="sdpa_fp8")
    o.set_uid(_Uid.O).set_output(True).set_dim(list(shape)).set_stride(stride).set_data_type(
        fp8 if fp8_output else cudnn.data_type.BFLOAT16)
    if stats and st is not None:
        b, h, s, _ = shape
        st.set_uid(_Uid.STATS).set_output(True).set_dim([b, h, s, 1]).set_stride([h * s, s, 1, 1]).set_data_type(f32)
    for t, uid in ((amax_s, _Uid.AMAX_S), (amax_o, _Uid.AMAX_O)):
        t.set_uid(uid).set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    _finish_build(cudnn, graph)
    return graph


def _po2_scale(t: torch.Tensor) -> torch.Tensor:
    """Per-tensor power-of-two scale (fp32 [1] on t's device) so that |t| * scale <= 448 (e4m3 max);
    a power of two makes the bf16 multiply exact."""
    amax = t.abs().amax().float().clamp_min(1e-12)
    return torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax))).reshape(1)


def quantize_e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor, fp32 descale [1]) with one power-of-two scale per tensor."""
    scale = _po2_scale(t)
    return (t * scale.to(t.dtype)).to(torch.float8_e4m3fn), (1.0 / scale)


def _make_cudnn_fp8(prequantized: bool):
    def make(q, k, v, block_map, block_size):
        reason = _needs_cuda(q, "cuDNN FP8 SDPA")
        if reason:
            return None, reason
        if not hasattr(torch, "float8_e4m3fn"):
            return None, "this torch has no float8_e4m3fn"
        major, minor = torch.cuda.get_device_capability(q.device)
        if major < 9:
            return None, f"cuDNN FP8 SDPA needs Hopper or newer (sm_90+), this GPU is sm_{major}{minor}"
        cudnn, reason = _cudnn_frontend()
        if reason:
            return None, reason
        shape = tuple(q.shape)
        if k.shape != q.shape:
            return None, f"this wrapper builds self-attention graphs (q {tuple(q.shape)} != k {tuple(k.shape)})"
        attn_scale = 1.0 / math.sqrt(shape[-1])
        try:
            handle = _cudnn_handle(cudnn, q.device)
        except Exception as exc:  # noqa: BLE001
            return None, f"cudnn.create_handle failed: {_err(exc)}"
        key = ("fp8", q.device.index, shape)
        failures = []
        if key not in _CUDNN_GRAPHS:
            # bf16 O (scale_o = 1) first; e4m3 O dequantised afterwards as a fallback; inference (no stats) first
            for fp8_output, stats in ((False, False), (False, True), (True, False), (True, True)):
                try:
                    _CUDNN_GRAPHS[key] = (_build_fp8_graph(cudnn, handle, shape, attn_scale, fp8_output, stats),
                                          fp8_output, stats)
                    break
                except Exception as exc:  # noqa: BLE001
                    failures.append(f"[O {'e4m3' if fp8_output else 'bf16'}, stats={stats}] {_err(exc)}")
            else:
                return None, "cuDNN sdpa_fp8 graph build failed: " + " | ".join(failures)
        graph, fp8_output, stats = _CUDNN_GRAPHS[key]
        try:
            workspace = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8, device=q.device)
        except Exception as exc:  # noqa: BLE001
            return None, f"cuDNN get_workspace_size failed: {_err(exc)}"
        dev = q.device
        one = torch.ones(1, dtype=torch.float32, device=dev)
        scale_s = torch.full((1,), 256.0, dtype=torch.float32, device=dev)  # P in [0, 1] -> e4m3, power of two
        descale_s = 1.0 / scale_s
        out_dtype = torch.float8_e4m3fn if fp8_output else q.dtype
        o = torch.empty(shape, dtype=out_dtype, device=dev)
        st = torch.empty(shape[0], shape[1], shape[2], 1, dtype=torch.float32, device=dev) if stats else None
        amax_s = torch.zeros(1, dtype=torch.float32, device=dev)
        amax_o = torch.zeros(1, dtype=torch.float32, device=dev)

        def pack(q8, dq, k8, dk, v8, dv):
            scale_o = _o_scale_from_descale_v(dv) if fp8_output else one
            pack_ = {_Uid.Q: q8, _Uid.K: k8, _Uid.V: v8, _Uid.DESCALE_Q: dq, _Uid.DESCALE_K: dk, _Uid.DESCALE_V: dv,
                     _Uid.DESCALE_S: descale_s, _Uid.SCALE_S: scale_s, _Uid.SCALE_O: scale_o, _Uid.O: o,
                     _Uid.AMAX_S: amax_s, _Uid.AMAX_O: amax_o}
            if st is not None:
                pack_[_Uid.STATS] = st
            return pack_, scale_o

        def execute(q8, dq, k8, dk, v8, dv):
            variant_pack, scale_o = pack(q8, dq, k8, dk, v8, dv)
            graph.execute(variant_pack, workspace, handle=_cudnn_handle(cudnn, dev))
            if fp8_output:
                return o.to(q.dtype) * (1.0 / scale_o).to(q.dtype)
            return o

        if prequantized:
            q8, dq = quantize_e4m3(q)
            k8, dk = quantize_e4m3(k)
            v8, dv = quantize_e4m3(v)
            return (lambda: execute(q8, dq, k8, dk, v8, dv)), ""

        def run():
            q8, dq = quantize_e4m3(q)
            k8, dk = quantize_e4m3(k)
            v8, dv = quantize_e4m3(v)
            return execute(q8, dq, k8, dk, v8, dv)

        return run, ""

    return make


def _o_scale_from_descale_v(descale_v: torch.Tensor) -> torch.Tensor:
    """Scale for an e4m3 O (fallback graph): each O row is a convex combination of V rows, so
    |O| <= max|V| <= 448 * descale_v; scale_o = 0.5 / descale_v (a power of two, one binade of headroom)."""
    return 0.5 / descale_v


def _build_block_mask_graph(cudnn, handle, shape, num_q_tiles: int, mask_bytes: int, attn_scale: float):
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    stride = _bhsd_stride(shape)
    b, h = shape[0], shape[1]
    tq = graph.tensor(name="q", uid=_Uid.Q, dim=list(shape), stride=stride, data_type=bf16)
    tk = graph.tensor(name="k", uid=_Uid.K, dim=list(shape), stride=stride, data_type=bf16)
    tv = graph.tensor(name="v", uid=_Uid.V, dim=list(shape), stride=stride, data_type=bf16)
    mask_dim = [b, h, num_q_tiles, mask_bytes]
    tm = graph.tensor(name="block_mask", uid=_Uid.BLOCK_MASK, dim=mask_dim,
                      stride=[h * num_q_tiles * mask_bytes, num_q_tiles * mask_bytes, mask_bytes, 1],
                      data_type=cudnn.data_type.UINT8)
    o, _ = graph.sdpa(q=tq, k=tk, v=tv, generate_stats=False, attn_scale=attn_scale, block_mask=tm,
                      name="sdpa_block_mask")
    o.set_uid(_Uid.O).set_output(True).set_dim(list(shape)).set_stride(stride).set_data_type(bf16)
    _finish_build(cudnn, graph)
    return graph


def make_cudnn_block_mask(q, k, v, block_map, block_size):
    reason = _needs_cuda(q, "cuDNN SDPA block_mask")
    if reason:
        return None, reason
    if block_size != 128:
        return None, f"cuDNN SDPA block_mask tiles are 128 x 128, the map's blocks are {block_size}"
    if q.dtype != torch.bfloat16:
        return None, f"this wrapper builds a bf16 graph, inputs are {q.dtype}"
    if k.shape != q.shape:
        return None, f"this wrapper builds self-attention graphs (q {tuple(q.shape)} != k {tuple(k.shape)})"
    cudnn, reason = _cudnn_frontend()
    if reason:
        return None, reason
    try:
        version = cudnn.backend_version()
    except Exception:  # noqa: BLE001
        version = None
    if version is not None and version < 91400:
        return None, f"cuDNN SDPA block_mask needs cuDNN backend >= 9.14.0, found {cudnn.backend_version_string()}"
    shape = tuple(q.shape)
    try:
        handle = _cudnn_handle(cudnn, q.device)
        bm = expand_map(block_map.to(q.device), shape[0], shape[1])
        packed = pack_tile_mask_lsb(bm).contiguous()
    except Exception as exc:  # noqa: BLE001
        return None, f"block_mask preparation failed: {_err(exc)}"
    key = ("block_mask", q.device.index, shape)
    if key not in _CUDNN_GRAPHS:
        try:
            _CUDNN_GRAPHS[key] = _build_block_mask_graph(cudnn, handle, shape, packed.shape[2], packed.shape[3],
                                                         1.0 / math.sqrt(shape[-1]))
        except Exception as exc:  # noqa: BLE001
            return None, f"cuDNN sdpa(block_mask=...) graph build failed (backend {cudnn.backend_version_string()}): {_err(exc)}"
    graph = _CUDNN_GRAPHS[key]
    try:
        workspace = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8, device=q.device)
    except Exception as exc:  # noqa: BLE001
        return None, f"cuDNN get_workspace_size failed: {_err(exc)}"
    o = torch.empty(shape, dtype=q.dtype, device=q.device)

    def run():
        graph.execute({_Uid.Q: q, _Uid.K: k, _Uid.V: v, _Uid.BLOCK_MASK: packed, _Uid.O: o}, workspace,
                      handle=_cudnn_handle(cudnn, q.device))
        return o

    return run, ""


def _cudnn_bsa_function(q, name: str):
    """(``cudnn.block_sparse_attention.<name>``, "") or (None, why not): CUDA, the frontend, CuTe DSL."""
    reason = _needs_cuda(q, f"cudnn.block_sparse_attention.{name}")
    if reason:
        return None, reason
    _, reason = _cudnn_frontend()
    if reason:
        return None, reason
    try:
        import cutlass  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return None, f"{CUTLASS_DSL_NOT_INSTALLED} ({_err(exc)})"
    try:
        from cudnn import block_sparse_attention

        return getattr(block_sparse_attention, name), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"cudnn.block_sparse_attention.{name} not importable: {_err(exc)}"


def make_cudnn_bsa(q, k, v, block_map, block_size):
    block_sparse_attention_forward, reason = _cudnn_bsa_function(q, "block_sparse_attention_forward")
    if reason:
        return None, reason
    try:
        bm = expand_map(block_map.to(q.device), q.shape[0], q.shape[1])
        counts, order = block_index_lists(bm)
    except Exception as exc:  # noqa: BLE001
        return None, f"block index preparation failed: {_err(exc)}"
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        res = block_sparse_attention_forward(q, k, v, order, block_sparse_num=int(order.shape[-1]),
                                             q2k_block_nums=counts, sparse_block_size=block_size,
                                             softmax_scale=scale, layout="bhsd", kv_splits=1)
        return res["o_tensor"]

    return run, ""


def make_cudnn_bsa_fp8(q, k, v, block_map, block_size):
    block_sparse_attention_fp8_forward, reason = _cudnn_bsa_function(q, "block_sparse_attention_fp8_forward")
    if reason:
        return None, reason
    if block_size != 128:
        return None, f"this wrapper runs the native 128 x 128 blocks, the map's blocks are {block_size}"
    if q.shape[2] % block_size or k.shape[2] % block_size:
        return None, (f"on sm_90 the kernel needs lengths that are multiples of {block_size} "
                      f"(q {q.shape[2]}, k {k.shape[2]}): run it on --uniform-rows maps at padded lengths")
    try:
        bm = expand_map(block_map.to(q.device), q.shape[0], q.shape[1])
        counts, order = block_index_lists(bm)
        count = int(counts.max().item())
        if int(counts.min().item()) != count:
            return None, ("on sm_90 the kernel takes one fixed count of key blocks per query block; this map's "
                          f"rows keep {int(counts.min().item())}..{count} (use --uniform-rows maps)")
        index = order[..., :count].contiguous()
        qc, kc, vc = (t.contiguous() for t in (q, k, v))
    except Exception as exc:  # noqa: BLE001
        return None, f"block index preparation failed: {_err(exc)}"
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        return block_sparse_attention_fp8_forward(qc, kc, vc, index, block_sparse_num=count, softmax_scale=scale,
                                                  sparse_block_size=block_size)["o_tensor"]

    return run, ""


# --------------------------------------------------------------------------------------------- SageAttention


def make_sageattention(q, k, v, block_map, block_size):
    try:
        from sageattention import sageattn
    except Exception as exc:  # noqa: BLE001
        return None, f"sageattention not importable: {_err(exc)}"
    reason = _needs_cuda(q, "sageattention")
    if reason:
        return None, reason
    if q.shape[-1] not in (64, 96, 128):
        return None, f"sageattention 1.0.6 supports head dims 64, 96, 128, got {q.shape[-1]}"
    # sageattn(smooth_k=True) subtracts the key mean IN PLACE (k -= km): give it a private copy
    # (subtracting a per-head constant key vector shifts each row's logits by a constant: softmax unchanged).
    k_private = k.clone()

    def run():
        return sageattn(q, k_private, v, tensor_layout="HND", is_causal=False)

    return run, ""


# --------------------------------------------------------------------------------------------- FlashInfer


def make_flashinfer(q, k, v, block_map, block_size):
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001
        return None, f"{FLASHINFER_NOT_INSTALLED} ({_err(exc)})"
    reason = _needs_cuda(q, "FlashInfer")
    if reason:
        return None, reason
    if q.shape[0] != 1:
        return None, "this wrapper runs batch 1 (the benchmark's shape)"
    try:  # API as in flashinfer/sparse.py (VariableBlockSparseAttentionWrapper): unverified on a GPU here
        heads, length, dim = q.shape[1], q.shape[2], q.shape[3]
        bm = expand_map(block_map.to(q.device), 1, heads)[0]  # [H, Qb, Kb]
        qb, kb = bm.shape[-2:]
        rows = torch.full((heads, qb), block_size, dtype=torch.int32, device=q.device)
        rows[:, -1] = length - (qb - 1) * block_size
        cols = torch.full((heads, kb), block_size, dtype=torch.int32, device=q.device)
        cols[:, -1] = k.shape[2] - (kb - 1) * block_size
        workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.sparse.VariableBlockSparseAttentionWrapper(workspace)
        wrapper.plan(block_mask_map=bm, block_row_sz=rows, block_col_sz=cols, num_qo_heads=heads,
                     num_kv_heads=heads, head_dim=dim, q_data_type=q.dtype, kv_data_type=k.dtype,
                     sm_scale=1.0 / math.sqrt(dim))
    except Exception as exc:  # noqa: BLE001
        return None, f"FlashInfer plan failed (flashinfer {getattr(flashinfer, '__version__', '?')}): {_err(exc)}"
    q3, k3, v3 = q[0], k[0], v[0]  # [H, L, D]

    return (lambda: wrapper.run(q3, k3, v3).unsqueeze(0)), ""


# --------------------------------------------------------------------------------------------- FlashAttention-4


def make_fa4(q, k, v, block_map, block_size):
    try:
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except Exception as exc:  # noqa: BLE001
        return None, f"{FA4_NOT_INSTALLED} ({_err(exc)})"
    reason = _needs_cuda(q, "FlashAttention-4")
    if reason:
        return None, reason
    try:
        bm = expand_map(block_map.to(q.device), q.shape[0], q.shape[1])
        counts, order = block_index_lists(bm)
        # every kept block is a "full" block (no mask_mod inside it); no partially masked blocks
        sparse = BlockSparseTensorsTorch(mask_block_cnt=torch.zeros_like(counts), mask_block_idx=torch.zeros_like(order),
                                         full_block_cnt=counts, full_block_idx=order,
                                         block_size=(block_size, block_size))
        qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # FA4 takes [B, L, H, D]
    except Exception as exc:  # noqa: BLE001
        return None, f"FA4 block-sparse preparation failed: {_err(exc)}"
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        res = flash_attn_func(qs, ks, vs, softmax_scale=scale, causal=False, block_sparse_tensors=sparse)
        out = res[0] if isinstance(res, tuple) else res
        return out.transpose(1, 2)

    return run, ""


# --------------------------------------------------------------------------------------------- sol_attn


def comfy_kitchen_with_sol_attn():
    """``(comfy_kitchen, None)`` when it has ``sol_attn`` (ComfyUI's core sparse attention; on a CPU its eager
    reference), else ``(None, why)``: not importable, or a release before ``sol_attn`` (ComfyUI's requirements
    pin such releases up to at least ComfyUI 0.33.0: 0.2.20 in 0.28.2, 0.2.31 in 0.33.0). The one place the
    benchmarks load this peer."""
    try:
        import comfy_kitchen
    except Exception as exc:  # noqa: BLE001
        return None, f"comfy_kitchen is not importable ({_err(exc)}); pip install 'chorus-ii[peers]'"
    if not callable(getattr(comfy_kitchen, "sol_attn", None)):
        from importlib import metadata

        try:
            release = metadata.version("comfy-kitchen")
        except metadata.PackageNotFoundError:
            release = "of unknown release"
        return None, (f"comfy_kitchen {release} has no sol_attn (ComfyUI's core sparse attention, from "
                      "comfy-kitchen 0.2.40); pip install 'chorus-ii[peers]' in an environment whose ComfyUI "
                      "does not pin an older comfy-kitchen (0.28.2 and 0.33.0 do)")
    return comfy_kitchen, None


def make_sol_attn_topk(q, k, v, block_map, block_size):
    comfy_kitchen, why = comfy_kitchen_with_sol_attn()
    if comfy_kitchen is None:
        return None, why
    reason = _needs_cuda(q, "sol_attn")
    if reason:
        return None, reason
    if not comfy_kitchen.sol_attn_is_available(q.device):
        return None, "comfy_kitchen's CUDA sol_attn kernels are not available on this GPU / build"
    kept = block_map.float().mean().item()
    routing = dict(topk_ratio=kept) if kept < 1.0 else dict(tau=-1e9)
    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # sol_attn takes [B, L, H, D]
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        return comfy_kitchen.sol_attn(qs, ks, vs, scale=scale, tail=True, **routing).transpose(1, 2)

    return run, ""


# --------------------------------------------------------------------------------------------- registry

PEERS: tuple[Peer, ...] = (
    Peer("ours_fp8", True, _make_api("triton_fp8"), "chorus Triton block-sparse, FP8 (default tile config)"),
    Peer("ours_bf16", True, _make_api("triton_bf16"), "chorus Triton block-sparse, bf16 (default tile config)"),
    Peer("ours_fp8_persistent", True, make_ours_fp8_persistent,
         "chorus Triton FP8, persistent launch (2 programs per SM over LPT-ordered tiles): a lever"),
    Peer("ours_fp8_ws", True, _make_api("triton_fp8_ws"),
         "chorus backend triton_fp8_ws: Gluon FP8, warp-specialised (TMA producer + 2 consumer warpgroups)"),
    Peer("ours_fp8_ws_tail", True, _make_api("triton_fp8_ws", pooled_tail=True),
         "triton_fp8_ws with the pooled tail (every skipped block one pooled term per row)",
         no_reference="the pooled tail adds the skipped blocks: its error is tail_quality.py's"),
    Peer("ours_int8", True, _make_api("triton_int8"),
         "chorus backend triton_int8: the accurate path (INT8 QK^T with a Hadamard rotation, INT8 P.V, portable kernel)"),
    Peer("ours_int8_tail", True, _make_api("triton_int8", pooled_tail=True),
         "triton_int8 with the pooled tail",
         no_reference="the pooled tail adds the skipped blocks: its error is tail_quality.py's"),
    Peer("ours_int8_ws", True, _make_api("triton_int8_ws"),
         "chorus backend triton_int8_ws: the accurate path's numerics in the warp-specialised Gluon kernel"),
    Peer("ours_int8_ws_tail", True, _make_api("triton_int8_ws", pooled_tail=True),
         "triton_int8_ws with the pooled tail",
         no_reference="the pooled tail adds the skipped blocks: its error is tail_quality.py's"),
    Peer("sol_attn_topk", True, make_sol_attn_topk,
         "comfy_kitchen.sol_attn (ComfyUI's core sparse attention), top-k at the map's density, its tail on",
         no_reference="its own routing and pooled tail: its error is tail_quality.py's"),
    Peer("api_fa4_bf16", True, _make_api("fa4_bf16"),
         "chorus.kernels backend fa4_bf16: FlashAttention-4 through our API (map -> block lists per call)"),
    Peer("flex_compiled", True, make_flex, "torch.compile(flex_attention), BlockMask from the map"),
    Peer("cudnn_sdpa_bf16", False, make_cudnn_sdpa_bf16, "torch SDPA, cuDNN backend, dense bf16"),
    Peer("cudnn_fp8_sdpa", False, _make_cudnn_fp8(False),
         "cuDNN frontend sdpa_fp8, dense; per-tensor e4m3 quantisation of q/k/v inside the call"),
    Peer("cudnn_fp8_sdpa_kernel", False, _make_cudnn_fp8(True),
         "cuDNN frontend sdpa_fp8, dense; inputs quantised once outside the timed call"),
    Peer("cudnn_bf16_block_mask", True, make_cudnn_block_mask, "cuDNN frontend sdpa with a 128x128 tile block_mask"),
    Peer("cudnn_bsa", True, make_cudnn_bsa, "cudnn.block_sparse_attention (CuTe DSL, in the frontend wheel)"),
    Peer("cudnn_bsa_fp8", True, make_cudnn_bsa_fp8,
         "cudnn.block_sparse_attention_fp8_forward (CuTe DSL, Sage-style FP8, fixed count per row)"),
    Peer("sageattention", False, make_sageattention, "sageattn 1.0.6 (Triton, INT8 QK, fp16 PV), dense"),
    Peer("flashinfer_block_sparse", True, make_flashinfer, "FlashInfer VariableBlockSparseAttentionWrapper"),
    Peer("fa4_block_sparse", True, make_fa4, "FlashAttention-4 (CuTe DSL) with BlockSparseTensorsTorch"),
)


def get_peer(name: str) -> Peer:
    for peer in PEERS:
        if peer.name == name:
            return peer
    raise KeyError(f"no peer {name!r}; peers: {', '.join(p.name for p in PEERS)}")


def make_peer(peer: Peer, q, k, v, block_map, block_size):
    """``peer.make`` with a last guard: never raises, always (callable, "") or (None, non-empty reason)."""
    try:
        fn, reason = peer.make(q, k, v, block_map, block_size)
    except Exception as exc:  # noqa: BLE001
        return None, f"make raised {_err(exc)}"
    if fn is None and not reason:
        reason = "unavailable (no reason given)"
    return fn, reason


# --------------------------------------------------------------------------------------------- reference


@torch.no_grad()
def reference_subset(q, k, v, block_map, block_size, heads, *, chunk: int = 2048) -> torch.Tensor:
    """fp32 attention for ``heads`` only: ``[B, len(heads), Lq, D]``, masked by ``block_map`` (None:
    dense), computed over query chunks (scores ``[chunk, Lk]`` at a time)."""
    heads = list(heads)
    b, _, lq, d = q.shape
    lk = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    chunk = max(block_size, chunk // block_size * block_size)
    out = torch.empty(b, len(heads), lq, d, dtype=torch.float32, device=q.device)
    bm = None if block_map is None else expand_map(block_map.to(q.device), b, q.shape[1])
    key_block = torch.arange(lk, device=q.device) // block_size
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a true fp32 reference
    try:
        _reference_loop(q, k, v, bm, block_size, heads, chunk, scale, key_block, out)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def _reference_loop(q, k, v, bm, block_size, heads, chunk, scale, key_block, out) -> None:
    b, lq = q.shape[0], q.shape[2]
    for bi in range(b):
        for hi, h in enumerate(heads):
            kf, vf = k[bi, h].float(), v[bi, h].float()
            for r0 in range(0, lq, chunk):
                r1 = min(lq, r0 + chunk)
                s = (q[bi, h, r0:r1].float() @ kf.T) * scale
                if bm is not None:
                    rows = bm[bi, h][torch.arange(r0, r1, device=q.device) // block_size]  # [rows, Kb]
                    s.masked_fill_(~rows[:, key_block], float("-inf"))
                out[bi, hi, r0:r1] = torch.softmax(s, dim=-1) @ vf


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()
