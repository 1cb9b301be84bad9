"""Public kernel API: one function per operation, each with an explicit ``backend=``.

Backends (:class:`Backend`): ``auto`` | ``triton_fp8_ws`` | ``triton_fp8`` | ``triton_int8_ws`` | ``triton_int8`` |
``triton_bf16`` | ``fa4_bf16`` | ``flex`` | ``reference``. ``triton_int8`` is the accurate 8-bit path (INT8 Q.K^T
after a Hadamard rotation, INT8 P.V with P on each key tile's own row maximum; block size 128; the portable
Triton kernel, :mod:`chorus.kernels.triton._quant_int8`): ~0.016 relative error against exact attention
on a full map of Gaussian q/k/v, where the FP8 paths have ~0.055; ``triton_int8_ws`` is the same numerics in
the warp-specialised kernel (sm_90). ``auto`` never picks either (they are the engine's choice by a stated
rule: :func:`chorus.engine.config.SparseConfig`). ``triton_fp8_ws`` is the warp-specialised Gluon FP8 kernel
(:mod:`chorus.kernels.triton._attention_ws`; sm_90, attention only, block size 128, head dim 64/128);
``fa4_bf16`` is FlashAttention-4's CuTe DSL kernel (optional dependency, see
:mod:`chorus.kernels.fa4`; attention only, no prefix bias, block size 64 or 128).

- ``auto`` resolves once per (device, dtype, head dim) along the chain
  triton_fp8_ws (sm_90) -> triton_fp8 (sm_90) -> fa4_bf16 (sm_90, where installed) -> triton_bf16
  (other CUDA GPUs) -> flex -> reference and logs its choice once. It walks the chain only while
  resolving: the first backend that can run on this device, dtype and head dim (and, per call, the
  first whose options cover the call: triton_fp8_ws with another block size or head dim, fa4_bf16
  with a prefix bias or another block size, flex and fa4_bf16 with ``pooled_tail`` go to the next
  backend of the chain, that call only). An error raised while a backend runs (an out-of-memory
  included) propagates to the caller and changes no later choice; the engine runs that call dense.
- An explicit backend never falls back: if it cannot run on these inputs it raises
  :class:`BackendUnavailableError` naming the reason.

Shapes: q ``[B, H, Lq, D]``, k/v ``[B, H, Lk, D]`` (same B, H, D); block maps bool
``[B or 1, H or 1, ceil(Lq/bs), ceil(Lk/bs)]``. Validation errors are ``ValueError``.

Token order: ``token_perm=`` (a :class:`~chorus.kernels.tile_order.TileOrder` or an int64
permutation ``[L]``, self-attention only: ``Lq == Lk == L``) runs an operation on the tokens in
that order: q/k/v are given in raster order, blocks (of the map, of the mass, ``prefix_len``) count
positions of the permuted sequence, the output comes back in raster order. Every backend gathers
and scatters through :func:`~chorus.kernels.tile_order.to_tile_order` /
:func:`~chorus.kernels.tile_order.to_raster_order` (``index_select``), except the Triton kernels
(``triton_fp8_ws``, ``triton_fp8``, ``triton_int8_ws``, ``triton_int8``, ``triton_bf16``), which take the
order fused into their loads and output store.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import math

import torch

from . import reference
from .reference import softmax_scale
from .masks import validate_block_map
from .probe import attention_error, build_probe
from .tile_order import resolve_token_perm, to_raster_order, to_tile_order

LOG = logging.getLogger(__name__)


class Backend(str, enum.Enum):
    AUTO = "auto"
    TRITON_FP8_WS = "triton_fp8_ws"
    TRITON_FP8 = "triton_fp8"
    TRITON_INT8_WS = "triton_int8_ws"
    TRITON_INT8 = "triton_int8"
    TRITON_BF16 = "triton_bf16"
    FA4_BF16 = "fa4_bf16"
    FLEX = "flex"
    REFERENCE = "reference"


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run on these inputs (no silent fallback)."""


MAX_PREFIX_BIAS = 20.0  # exp(20) ~ 5e8: beyond any useful guidance, still far from overflow in log2 units

_AUTO_CHAIN = (Backend.TRITON_FP8_WS, Backend.TRITON_FP8, Backend.FA4_BF16, Backend.TRITON_BF16, Backend.FLEX,
               Backend.REFERENCE)
_SM90_ONLY = (Backend.TRITON_FP8_WS, Backend.TRITON_FP8, Backend.FA4_BF16)  # auto: Hopper only (measured there)
_ATTENTION_ONLY = (Backend.TRITON_FP8_WS, Backend.TRITON_INT8_WS, Backend.TRITON_INT8, Backend.FA4_BF16, Backend.FLEX)
_WARP_SPECIALISED = (Backend.TRITON_FP8_WS, Backend.TRITON_INT8_WS)  # the Gluon kernel: sm_90, block size 128
_NO_POOLED_TAIL = (Backend.FA4_BF16, Backend.FLEX)  # auto sends a pooled_tail call past these
_PORTABLE_TRITON = (Backend.TRITON_FP8, Backend.TRITON_BF16)  # power-of-two blocks in [16, 256]
# the accurate 8-bit numerics, in order of preference: what the engine asks for instead of auto's choice where
# the maps keep nearly all the mass (chorus.engine.config.SparseConfig.attention_backends)
ACCURATE_CHAIN = (Backend.TRITON_INT8_WS, Backend.TRITON_INT8)


def numerics_of(backend) -> str:
    """The numerics family of ``backend`` (a :class:`Backend` or its name), as
    :data:`~chorus.kernels.reference.NUMERICS_CEILINGS` keys it: ``"fp8"`` (``triton_fp8_ws``, ``triton_fp8``),
    ``"int8"`` (``triton_int8_ws``, ``triton_int8``) or ``"16-bit"`` (the rest; the fp32 ``reference`` included).
    ``ValueError`` for ``auto`` (resolve it first: :func:`resolve_backend`) and unknown names."""
    backend = _parse_backend(backend)
    if backend == Backend.AUTO:
        raise ValueError("auto is no kernel: resolve it first (resolve_backend)")
    if backend in (Backend.TRITON_FP8_WS, Backend.TRITON_FP8):
        return "fp8"
    return "int8" if backend in ACCURATE_CHAIN else "16-bit"


def has_pooled_tail(backend) -> bool:
    """Whether ``backend`` (a :class:`Backend` or its name) runs ``pooled_tail=True`` calls itself: every
    backend but ``flex`` and ``fa4_bf16``; ``auto`` does (it takes the next backend of its chain that has
    one). A bad name raises ``ValueError``."""
    return _parse_backend(backend) not in _NO_POOLED_TAIL


_auto_choice: dict[tuple, Backend] = {}


def _parse_backend(backend) -> Backend:
    try:
        return Backend(backend)
    except ValueError:
        names = ", ".join(b.value for b in Backend)
        raise ValueError(f"unknown backend {backend!r}; choose one of: {names}") from None


def _triton_module():
    from . import triton as triton_kernels  # noqa: PLC0415 (optional, heavy import)

    return triton_kernels


def why_unavailable(backend: Backend, q: torch.Tensor, op: str = "attention") -> str | None:
    """Reason ``backend`` cannot run ``op`` on tensors like ``q``, or ``None`` when it can."""
    if backend == Backend.REFERENCE:
        return None
    if backend == Backend.FLEX:
        if op != "attention":
            return "flex has no block_mass implementation"
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError as exc:  # pragma: no cover - depends on torch build
            return f"FlexAttention is not available in this torch ({exc})"
        from .codec import flex_masks_unavailable  # noqa: PLC0415

        reason = flex_masks_unavailable()
        if reason is not None:
            return reason
        if q.device.type == "cuda":
            if importlib.util.find_spec("triton") is None:
                return "flex runs compiled on a CUDA GPU (torch.compile), which needs Triton: triton is not installed"
            return build_probe(("flex", str(q.device), q.dtype, q.shape[-1]), "compiled FlexAttention",
                               lambda: check_flex(q))
        return None
    if backend in _ATTENTION_ONLY and op != "attention":
        return f"{backend.value} has no block_mass implementation"
    if backend == Backend.FA4_BF16:
        from .fa4 import fa4_unavailable  # noqa: PLC0415

        return fa4_unavailable(q)
    # Triton backends.
    if q.device.type != "cuda":
        return f"{backend.value} needs a CUDA tensor, got device {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{backend.value} needs fp16/bf16 inputs, got {q.dtype}"
    if q.shape[-1] not in (64, 128):
        return f"{backend.value} supports head dims 64 and 128, got {q.shape[-1]}"
    try:
        triton_kernels = _triton_module()
    except Exception as exc:  # noqa: BLE001 - report any import failure as the reason
        return f"Triton kernels failed to import: {exc}"
    ok, reason = triton_kernels.triton_available()
    if not ok:
        return reason
    if backend == Backend.TRITON_FP8:
        major, minor = torch.cuda.get_device_capability(q.device)
        if (major, minor) < (8, 9):
            return f"triton_fp8 needs FP8 tensor cores (sm_89+), this GPU is sm_{major}{minor}"
    if backend in _WARP_SPECIALISED:
        return triton_kernels.ws_unavailable(q, int8=backend == Backend.TRITON_INT8_WS)
    if backend == Backend.TRITON_INT8:
        major, minor = torch.cuda.get_device_capability(q.device)
        if (major, minor) < (8, 0):
            return f"triton_int8 needs INT8 tensor cores with Triton's integer dot (sm_80+), this GPU is sm_{major}{minor}"
    if op == "block_mass":
        return triton_kernels.block_mass_unavailable(q)
    return triton_kernels.portable_unavailable(q, numerics_of(backend))


def check_flex(q: torch.Tensor) -> float:
    """Run flex (compiled on a CUDA GPU, as its calls run) on unit Gaussian q / k / v like ``q`` (2 heads x
    :data:`~chorus.kernels.probe.PROBE_TOKENS`, full map) and return its relative L2 against the fp64 oracle;
    ``RuntimeError`` past the 16-bit numerics' ceiling (:data:`~chorus.kernels.reference.NUMERICS_CEILINGS`).
    Whatever the compile or the kernel raises propagates: on CUDA, :func:`why_unavailable` asks this once per
    (device, dtype, head dim) (:func:`~chorus.kernels.probe.build_probe`), so where Triton imports but cannot
    build (a Triton of another torch release) flex is a reason found while resolving, not a failed compile at
    every call (:func:`~chorus.kernels.probe.attention_error`)."""
    scale = softmax_scale(q.shape[-1])
    return attention_error(q, "16-bit", lambda q_, k, v, full: _flex_attention(q_, k, v, full, 128, scale))


def _candidates(q: torch.Tensor, op: str) -> list[Backend]:
    if q.device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(q.device)
        chain = list(_AUTO_CHAIN) if major == 9 else [b for b in _AUTO_CHAIN if b not in _SM90_ONLY]
    else:
        chain = [Backend.REFERENCE]
    if op != "attention":
        chain = [b for b in chain if b not in _ATTENTION_ONLY]
    return chain


def auto_chain(q: torch.Tensor, op: str = "attention") -> list[tuple[Backend, str | None]]:
    """``auto``'s chain for ``op`` on tensors like ``q``, in order: each backend with the reason it cannot run
    here (:func:`why_unavailable`), or None for one that can (auto takes the first such). For reports
    (``python -m chorus check``); resolving (:func:`resolve_backend`) walks the same chain."""
    return [(candidate, why_unavailable(candidate, q, op)) for candidate in _candidates(q, op)]


def resolve_backend(backend, q: torch.Tensor, op: str = "attention", block_size: int | None = None,
                    pooled_tail: bool = False) -> Backend:
    """Resolve ``backend`` for inputs like ``q``: auto picks the first runnable backend of its chain
    (cached, logged once); an explicit backend is checked and raises :class:`BackendUnavailableError` if it
    cannot run. ``block_size`` (attention): the backend must also run blocks of that many tokens, and with
    ``pooled_tail`` have a pooled tail (an explicit one raises otherwise; auto moves on along its chain, as a
    call with those options does)."""
    requested = _parse_backend(backend)
    if requested != Backend.AUTO:
        reason = why_unavailable(requested, q, op)
        if reason is not None:
            raise BackendUnavailableError(f"backend={requested.value!r} cannot run here: {reason}")
        if block_size is not None and op == "attention":
            return _for_call_options(requested, True, q, block_size, 0, pooled_tail=pooled_tail)
        return requested
    key = (op, q.device.type, q.device.index, q.dtype, q.shape[-1])
    if key not in _auto_choice:
        for candidate in _candidates(q, op):
            reason = why_unavailable(candidate, q, op)
            if reason is None:
                _auto_choice[key] = candidate
                break
            LOG.debug("chorus auto backend: skipping %s (%s)", candidate.value, reason)
        LOG.info("chorus: %s backend auto -> %s (device %s, %s, head dim %d)", op, _auto_choice[key].value,
                 q.device, str(q.dtype).replace("torch.", ""), q.shape[-1])
    if block_size is not None and op == "attention":
        return _for_call_options(_auto_choice[key], False, q, block_size, 0, pooled_tail=pooled_tail)
    return _auto_choice[key]


def _next_in_chain(key_op: str, q: torch.Tensor, after: Backend) -> Backend | None:
    """The first runnable backend of auto's chain after ``after`` (None when there is none)."""
    chain = _candidates(q, key_op)
    rest = chain[chain.index(after) + 1:] if after in chain else [Backend.REFERENCE]
    return next((b for b in rest if why_unavailable(b, q, key_op) is None), None)


def _for_call_options(chosen: Backend, explicit: bool, q, block_size: int, prefix_len: int,
                      suffix_len: int = 0, pooled_tail: bool = False) -> Backend:
    """``chosen``, or (auto) the next backend of the chain when this call's options are outside it;
    an explicit backend raises :class:`BackendUnavailableError` instead."""
    if pooled_tail and chosen in _NO_POOLED_TAIL:
        reason = f"{chosen.value} has no pooled tail (pooled_tail=True)"
        if explicit:
            raise BackendUnavailableError(f"backend={chosen.value!r} cannot run this call: {reason}")
        return _for_call_options(_next_in_chain("attention", q, chosen) or Backend.REFERENCE, explicit, q,
                                 block_size, prefix_len, suffix_len, pooled_tail)
    if chosen == Backend.FA4_BF16:
        from .fa4 import check_call  # noqa: PLC0415

        reason = check_call(block_size, prefix_len or suffix_len)
    elif chosen in _WARP_SPECIALISED:
        reason = _triton_module().ws_call_unsupported(q.shape[-1], block_size)
    elif chosen == Backend.TRITON_INT8:
        reason = None if block_size == 128 else f"triton_int8 runs 128-token blocks, got block_size={block_size}"
    elif chosen in _PORTABLE_TRITON:
        reason = None if _triton_module().portable_block_size(block_size) else \
            f"{chosen.value} runs power-of-two blocks in [16, 256], got block_size={block_size}"
    else:
        return chosen
    if reason is None:
        return chosen
    if explicit:
        raise BackendUnavailableError(f"backend={chosen.value!r} cannot run this call: {reason}")
    # the next backend must meet this call's options too (a pooled tail, a key bias, the block size)
    return _for_call_options(_next_in_chain("attention", q, chosen) or Backend.REFERENCE, explicit, q, block_size,
                             prefix_len, suffix_len, pooled_tail)


def _check_qkv(q, k, v=None) -> None:
    tensors = (q, k) if v is None else (q, k, v)
    for name, t in zip("qkv", tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4 or t.shape[-1] < 1:
            raise ValueError(f"{name} must be [B, H, L, D] with D >= 1, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B, H and D")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError("q and k need at least one token")
    if len({t.dtype for t in tensors}) != 1 or len({t.device for t in tensors}) != 1:
        raise ValueError("q, k and v must share dtype and device")


def _check_block_size(block_size) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _check_scale(scale: float) -> float:
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"the softmax needs a positive finite scale, got {scale!r}")
    return scale


def _check_key_bias(length, bias, kv_len: int, what: str) -> tuple[int, float]:
    """A key bias (``what``: "prefix" or "suffix") validated; ``(0, 0.0)`` when it does nothing."""
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= kv_len:
        raise ValueError(f"{what}_len must be an int in [0, {kv_len}] (the key count), got {length!r}")
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
            or abs(bias) > MAX_PREFIX_BIAS:
        raise ValueError(f"{what}_bias must be a finite number in [-{MAX_PREFIX_BIAS:g}, {MAX_PREFIX_BIAS:g}], "
                         f"got {bias!r}")
    if length == 0 or bias == 0:
        return 0, 0.0
    return length, float(bias)


def _flex_attention(q, k, v, block_map, block_size, scale, prefix_len=0, prefix_bias=0.0, suffix_len=0,
                    suffix_bias=0.0):
    from torch.nn.attention.flex_attention import flex_attention

    from .codec import to_flex_block_mask

    if block_map.shape[0] != q.shape[0] or block_map.shape[1] != q.shape[1]:
        block_map = block_map.expand(q.shape[0], q.shape[1], *block_map.shape[-2:])
    block_mask = to_flex_block_mask(block_map.to(q.device), block_size=block_size, q_len=q.shape[-2],
                                    kv_len=k.shape[-2])
    fn = flex_attention
    if q.device.type == "cuda":
        fn = _compiled_flex()
    score_mod = None
    if prefix_len or suffix_len:
        # captured tensors (not Python numbers): a new bias value does not recompile the kernel
        limit = torch.tensor(prefix_len, device=q.device, dtype=torch.int32)
        bias = torch.tensor(prefix_bias, device=q.device, dtype=torch.float32)
        start = torch.tensor(k.shape[-2] - suffix_len, device=q.device, dtype=torch.int32)
        tail_bias = torch.tensor(suffix_bias, device=q.device, dtype=torch.float32)

        def score_mod(score, b, h, q_idx, kv_idx):
            score = torch.where(kv_idx < limit, score + bias, score)
            return torch.where(kv_idx >= start, score + tail_bias, score)
    return fn(q, k, v, block_mask=block_mask, scale=scale, score_mod=score_mod)


_COMPILED_FLEX = None


def _compiled_flex():
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def _run_attention(chosen: Backend, q, k, v, block_map, block_size, scale, prefix_len, prefix_bias, perm=None,
                   suffix_len=0, suffix_bias=0.0, pooled_tail=False):
    """One backend's call; ``perm`` = ``(perm, inverse)`` or None: the Triton kernels take the order
    fused into their loads and output store, the others gather into it and scatter back."""
    if perm is not None and chosen not in (Backend.TRITON_FP8, Backend.TRITON_BF16, Backend.TRITON_FP8_WS,
                                           Backend.TRITON_INT8_WS, Backend.TRITON_INT8):
        q, k, v = to_tile_order(perm[0], q, k, v)
        return to_raster_order(perm[1], _run_attention(chosen, q, k, v, block_map, block_size, scale, prefix_len,
                                                       prefix_bias, None, suffix_len, suffix_bias, pooled_tail))
    if chosen == Backend.REFERENCE:
        return reference.block_sparse_attention_reference(q, k, v, block_map, block_size, scale, prefix_len,
                                                          prefix_bias, suffix_len, suffix_bias, pooled_tail)
    if chosen == Backend.FLEX:
        return _flex_attention(q, k, v, block_map, block_size, scale, prefix_len, prefix_bias, suffix_len, suffix_bias)
    if chosen == Backend.FA4_BF16:
        from .fa4 import block_sparse_attention_fa4  # noqa: PLC0415

        return block_sparse_attention_fa4(q, k, v, block_map, block_size=block_size, scale=scale)
    block_map = block_map if block_map.device == q.device else block_map.to(q.device)
    if chosen in (*_WARP_SPECIALISED, Backend.TRITON_INT8):  # block size 128 only: no block_size argument
        triton_kernels = _triton_module()
        options = dict(scale=scale, prefix_len=prefix_len, prefix_bias=prefix_bias,
                       token_perm=None if perm is None else perm[0], suffix_len=suffix_len, suffix_bias=suffix_bias,
                       pooled_tail=pooled_tail)
        if chosen == Backend.TRITON_INT8:
            return triton_kernels.block_sparse_attention_int8(q, k, v, block_map, **options)
        return triton_kernels.block_sparse_attention_ws(q, k, v, block_map, int8=chosen == Backend.TRITON_INT8_WS,
                                                        **options)
    return _triton_module().block_sparse_attention_triton(
        q, k, v, block_map, block_size=block_size, scale=scale, fp8=chosen == Backend.TRITON_FP8,
        prefix_len=prefix_len, prefix_bias=prefix_bias, token_perm=None if perm is None else perm[0],
        suffix_len=suffix_len, suffix_bias=suffix_bias, pooled_tail=pooled_tail)


def _token_perm(token_perm, q, k):
    """``(perm, inverse)`` on q's device, or None; self-attention lengths only."""
    if token_perm is None:
        return None
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"token_perm needs self-attention (Lq == Lk), got Lq={q.shape[2]}, Lk={k.shape[2]}")
    return resolve_token_perm(token_perm, q.shape[2], q.device)


def block_sparse_attention(q, k, v, block_map, *, block_size: int = 128, scale: float | None = None,
                           backend: str = "auto", prefix_len: int = 0, prefix_bias: float = 0.0,
                           rows_checked: bool = False, token_perm=None, suffix_len: int = 0,
                           suffix_bias: float = 0.0, pooled_tail: bool = False) -> torch.Tensor:
    """Block-sparse attention: query block ``i`` attends only to key blocks ``j`` with
    ``block_map[..., i, j]``.

    Args:
        q: ``[B, H, Lq, D]``; k, v: ``[B, H, Lk, D]``; same dtype and device.
        block_map: bool ``[B or 1, H or 1, ceil(Lq/bs), ceil(Lk/bs)]``; every row keeps >= 1 block.
            A partial last block (``L % bs != 0``) is handled: only real tokens take part.
        block_size: ``bs``, tokens per block along both q and kv (default 128).
        scale: softmax scale, default ``1/sqrt(D)``.
        backend: see module docstring.
        prefix_len, prefix_bias: ``prefix_bias`` (natural-log units, |bias| <= MAX_PREFIX_BIAS) is added
            to the scaled logits of keys ``[0, prefix_len)`` for every query (Wan's first latent frame:
            the image of an I2V request; guidance). Only keys the map keeps take part, as always.
            ``prefix_len == 0`` or ``prefix_bias == 0`` runs exactly the unbiased computation.
        suffix_len, suffix_bias: the same for the last ``suffix_len`` keys ``[Lk - suffix_len, Lk)``: with
            ``log(n)`` a key counts as ``n`` copies of itself (feature reuse's pooled cells at the end
            of the compact sequence; a first-last-frame request's end image, guidance). With ``token_perm``
            the last keys of the permuted order.
        rows_checked: the caller guarantees that every row of the map keeps at least one block (e.g.
            a ``k_min >= 1`` floor was applied): the empty-row check, the only validation that reads the
            map's values (one host-device sync), is skipped. A map with an empty row then gives
            zeros in that row's output (Triton) or NaN (reference, flex) instead of a ``ValueError``.
        token_perm: None (raster), or a ``TileOrder`` / int64 permutation ``[L]`` (``Lq == Lk == L``;
            ``perm[p]`` = raster index of position ``p``): q/k/v stay in raster order, ``block_map``,
            ``prefix_len`` and ``suffix_len`` refer to the permuted order (a ``TileOrder`` keeps frame 0 as the
            prefix; whether the last frame is its suffix, ``last_frame_is_suffix``), the output is returned
            in raster order. Exact: attention is permutation-equivariant.
        pooled_tail: keep what the map skips. For every query row ``i`` (query block ``I``) and every key
            block ``j`` that ``block_map`` does not keep for ``(I, head)``, one extra term enters row ``i``'s
            softmax: logit ``scale * q_i . kbar_j + w_j``, value ``vbar_j``, where ``kbar_j`` / ``vbar_j`` are
            the means of this call's K / V over block ``j``'s real tokens (a partial last block: its real
            tokens only) and ``w_j = log(sum over block j's tokens t of exp(bias_t))`` with ``bias_t`` the
            key bias of token ``t`` (``prefix_bias`` / ``suffix_bias`` where they apply, else 0), i.e.
            ``log(n_j)`` without biases: the block counts as its ``n_j`` tokens, each at the block's mean key.
            Each row uses its own ``q_i``. Kept blocks are attended exactly as without the tail; a row that
            keeps every block has no tail term. With ``token_perm`` the blocks are those of the permuted
            order. Backends: reference, triton_fp8_ws, triton_fp8, triton_int8, triton_bf16 (not flex, fa4_bf16:
            ``auto`` sends such a call to the next backend of its chain, an explicit one raises).

    Returns:
        ``[B, H, Lq, D]`` in q's dtype (raster order).

    Raises:
        ValueError: mismatched shapes, a map of the wrong block grid, an empty row, bad backend name,
            a prefix or suffix outside ``[0, Lk]`` or a non-finite / too large bias, a bad ``token_perm``,
            a ``pooled_tail`` that is not a bool.
        BackendUnavailableError: an explicit backend that cannot run on these inputs (or this call's
            options: e.g. ``pooled_tail`` on flex).
        Whatever the chosen backend raises while it runs (``torch.OutOfMemoryError``, a compile error)
        propagates unchanged, with ``auto`` as with an explicit backend; no later call is affected.
    """
    _check_qkv(q, k, v)
    if not isinstance(pooled_tail, bool):
        raise ValueError(f"pooled_tail must be a bool, got {pooled_tail!r}")
    _check_block_size(block_size)
    validate_block_map(block_map, q.shape[0], q.shape[1], q.shape[2], k.shape[2], block_size,
                       check_rows=not rows_checked)
    prefix_len, prefix_bias = _check_key_bias(prefix_len, prefix_bias, k.shape[2], "prefix")
    suffix_len, suffix_bias = _check_key_bias(suffix_len, suffix_bias, k.shape[2], "suffix")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale must be a number or None, got {scale!r}")
    scale = _check_scale(softmax_scale(q.shape[-1], scale))
    perm = _token_perm(token_perm, q, k)
    explicit = _parse_backend(backend) != Backend.AUTO
    chosen = _for_call_options(resolve_backend(backend, q, "attention"), explicit, q, block_size, prefix_len,
                               suffix_len, pooled_tail)
    return _run_attention(chosen, q, k, v, block_map, block_size, scale, prefix_len, prefix_bias,
                          perm, suffix_len, suffix_bias, pooled_tail)


def block_mass(q, k, *, block_size: int = 128, sample_rows: int | None = None, scale: float | None = None,
               backend: str = "auto", token_perm=None) -> torch.Tensor:
    """Block attention mass: float32 ``[B, H, Qb, Kb]``.

    For each query block, the mean over its query rows of the softmax probability (over all keys,
    scale ``1/sqrt(D)`` by default) that falls in each key block; every row sums to 1. Exact, or
    estimated from ``sample_rows`` evenly strided query rows per block (all rows of a smaller block).
    ``token_perm`` (see :func:`block_sparse_attention`): q/k in raster order, blocks of the permuted
    order (the mass a map recorded in that order is selected from).

    Raises:
        ValueError: bad shapes, ``sample_rows < 1``, a scale that is not a positive finite number, bad
            backend name, a bad ``token_perm``.
        BackendUnavailableError: an explicit backend that cannot run here (``flex`` has none).
        Whatever the chosen backend raises while it runs propagates unchanged (no later call is affected).
    """
    _check_qkv(q, k)
    _check_block_size(block_size)
    if sample_rows is not None and (isinstance(sample_rows, bool) or not isinstance(sample_rows, int)
                                    or sample_rows < 1):
        raise ValueError(f"sample_rows must be a positive int or None, got {sample_rows!r}")
    scale = _check_scale(softmax_scale(q.shape[-1], scale))
    perm = _token_perm(token_perm, q, k)
    chosen = resolve_backend(backend, q, "block_mass")
    if chosen != Backend.REFERENCE and not _triton_module().portable_block_size(block_size):
        if _parse_backend(backend) != Backend.AUTO:
            raise BackendUnavailableError(f"backend={chosen.value!r} cannot run this block mass: it runs power-of-two "
                                          f"blocks in [16, 256], got block_size={block_size}")
        chosen = Backend.REFERENCE
    if chosen == Backend.REFERENCE:
        qo, ko = (q, k) if perm is None else to_tile_order(perm[0], q, k)
        return reference.block_mass_reference(qo, ko, block_size, sample_rows, scale)
    return _triton_module().block_mass_triton(q, k, block_size=block_size, sample_rows=sample_rows,
                                              scale=scale, token_perm=None if perm is None else perm[0])
