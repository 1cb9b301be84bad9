"""Triton kernels for Hopper: FP8/bf16 block-sparse attention and block attention mass.

Public entry points (called by :mod:`chorus.kernels.api` for backends ``triton_fp8``/``triton_bf16``):

- :func:`block_sparse_attention_triton` ``(q, k, v, block_map, *, block_size, scale, fp8, prefix_len,
  prefix_bias, token_perm, suffix_len, suffix_bias, pooled_tail) -> Tensor``
- :func:`block_sparse_attention_ws` ``(q, k, v, block_map, *, scale, prefix_len, prefix_bias, token_perm,
  suffix_len, suffix_bias, pooled_tail, int8) -> Tensor``:
  the warp-specialised Gluon kernel of :mod:`._attention_ws` (backend ``triton_fp8_ws``, with ``int8`` the
  accurate path's numerics: backend ``triton_int8_ws``; sm_90, block size 128), :func:`ws_unavailable`
  ``(q, int8) -> reason | None`` and :func:`ws_call_unsupported`
- :func:`block_sparse_attention_int8` ``(q, k, v, block_map, *, scale, prefix_len, prefix_bias, token_perm,
  suffix_len, suffix_bias, pooled_tail) -> Tensor``: the accurate INT8 path of the portable kernel
  (backend ``triton_int8``; block size 128; :mod:`._quant_int8`)
- :func:`block_mass_triton` ``(q, k, *, block_size, sample_rows, scale) -> float32 [B, H, Qb, Kb]``
- :func:`portable_block_size` ``(block_size) -> bool``: the block sizes the portable kernels and the block mass run
- :func:`triton_available` ``() -> (bool, reason)``
- :func:`build_probe` ``(key, kernel, run) -> reason | None``: one build-and-launch check per key (auto's
  resolution; :mod:`chorus.kernels.probe`, re-exported)

Feature reuse's fused pool / unpool kernels live in :mod:`._pooling` (called by
:mod:`chorus.kernels.pooling` on CUDA tensors), the miss's top-p block selection in :mod:`._select`
(called by :mod:`chorus.kernels.masks`).

The launchers are ``torch.library`` custom ops (``torch.ops.chorus.block_sparse_attention_triton``,
``torch.ops.chorus.block_sparse_attention_ws``, ``torch.ops.chorus.block_sparse_attention_int8``,
``torch.ops.chorus.block_mass_triton``) with fake
(shape-only) implementations, so a model calling them compiles with ``torch.compile`` (they are
opaque to the compiler). Importing this package imports ``triton``; it raises ImportError where
Triton is missing (the API reports that as the reason the backend cannot run). Contracts:
:mod:`._attention`, :mod:`._attention_ws`, :mod:`._quant`, :mod:`._quant_int8`, :mod:`._block_mass`.
"""

from __future__ import annotations

import os

import torch

from ..custom_ops import op_registered
from ..probe import attention_error, build_probe, probe_inputs
from ..reference import BLOCK_MASS_CEILING, block_mass_reference, softmax_scale
from . import _attention_ws
from ._attention import block_sparse_attention_triton_impl, compress_block_map, output_like, portable_block_size
from ._block_mass import block_mass_triton_impl

__all__ = ["block_sparse_attention_triton", "block_sparse_attention_ws", "block_sparse_attention_int8", "ws_unavailable", "ws_call_unsupported", "portable_block_size", "build_probe",
           "block_mass_triton", "triton_available", "compress_block_map"]


def triton_available() -> tuple[bool, str]:
    """``(True, "")`` when the Triton kernels can launch here (a CUDA device, or the CPU interpreter
    via ``TRITON_INTERPRET=1``), else ``(False, reason)``."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return False, f"triton is not importable: {exc}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    if not torch.cuda.is_available():
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
    return True, ""


# The pack may be imported twice in one process under different names (ComfyUI imports the folder
# under its clone name; tests import ``chorus``): register the ops only once.
if not op_registered("block_sparse_attention_triton"):
    @torch.library.custom_op("chorus::block_sparse_attention_triton", mutates_args=())
    def _bsa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor, block_size: int,
                scale: float, fp8: bool, prefix_len: int = 0, prefix_bias: float = 0.0,
                token_perm: torch.Tensor | None = None, suffix_len: int = 0, suffix_bias: float = 0.0,
                pooled_tail: bool = False) -> torch.Tensor:
        return block_sparse_attention_triton_impl(q, k, v, block_map, block_size, scale, fp8,
                                                  prefix_len=prefix_len, prefix_bias=prefix_bias, token_perm=token_perm,
                                                  suffix_len=suffix_len, suffix_bias=suffix_bias,
                                                  pooled_tail=pooled_tail)

    @_bsa_op.register_fake
    def _bsa_fake(q, k, v, block_map, block_size, scale, fp8, prefix_len=0, prefix_bias=0.0, token_perm=None,
                  suffix_len=0, suffix_bias=0.0, pooled_tail=False):
        return output_like(q)

if not op_registered("block_sparse_attention_ws"):
    @torch.library.custom_op("chorus::block_sparse_attention_ws", mutates_args=())
    def _bsa_ws_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor,
                   scale: float, prefix_len: int = 0, prefix_bias: float = 0.0,
                   token_perm: torch.Tensor | None = None, suffix_len: int = 0,
                   suffix_bias: float = 0.0, pooled_tail: bool = False, int8: bool = False) -> torch.Tensor:
        return _attention_ws.block_sparse_attention_ws(q, k, v, block_map, scale, prefix_len=prefix_len,
                                                       prefix_bias=prefix_bias, token_perm=token_perm,
                                                       suffix_len=suffix_len, suffix_bias=suffix_bias,
                                                       pooled_tail=pooled_tail, int8=int8)

    @_bsa_ws_op.register_fake
    def _bsa_ws_fake(q, k, v, block_map, scale, prefix_len=0, prefix_bias=0.0, token_perm=None, suffix_len=0,
                     suffix_bias=0.0, pooled_tail=False, int8=False):
        return output_like(q)

if not op_registered("block_sparse_attention_int8"):
    @torch.library.custom_op("chorus::block_sparse_attention_int8", mutates_args=())
    def _bsa_int8_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor,
                     scale: float, prefix_len: int = 0, prefix_bias: float = 0.0,
                     token_perm: torch.Tensor | None = None, suffix_len: int = 0,
                     suffix_bias: float = 0.0, pooled_tail: bool = False) -> torch.Tensor:
        return block_sparse_attention_triton_impl(q, k, v, block_map, 128, scale, False, prefix_len=prefix_len,
                                                  prefix_bias=prefix_bias, token_perm=token_perm,
                                                  suffix_len=suffix_len, suffix_bias=suffix_bias,
                                                  pooled_tail=pooled_tail, int8=True)

    @_bsa_int8_op.register_fake
    def _bsa_int8_fake(q, k, v, block_map, scale, prefix_len=0, prefix_bias=0.0, token_perm=None, suffix_len=0,
                       suffix_bias=0.0, pooled_tail=False):
        return output_like(q)

if not op_registered("block_mass_triton"):
    @torch.library.custom_op("chorus::block_mass_triton", mutates_args=())
    def _mass_op(q: torch.Tensor, k: torch.Tensor, block_size: int, sample_rows: int, scale: float,
                 token_perm: torch.Tensor | None = None) -> torch.Tensor:
        return block_mass_triton_impl(q, k, block_size, sample_rows if sample_rows > 0 else None, scale,
                                      token_perm=token_perm)

    @_mass_op.register_fake
    def _mass_fake(q, k, block_size, sample_rows, scale, token_perm=None):
        qb, kb = -(-q.shape[2] // block_size), -(-k.shape[2] // block_size)
        return q.new_empty((q.shape[0], q.shape[1], qb, kb), dtype=torch.float32)


def block_sparse_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor, *,
                                  block_size: int = 128, scale: float | None = None, fp8: bool = True,
                                  prefix_len: int = 0, prefix_bias: float = 0.0,
                                  token_perm: torch.Tensor | None = None, suffix_len: int = 0,
                                  suffix_bias: float = 0.0, pooled_tail: bool = False) -> torch.Tensor:
    """Block-sparse forward attention (FP8 e4m3 when ``fp8``, else the inputs' 16-bit dtype).

    Args:
        q: ``[B, H, Lq, D]``; k, v: ``[B, H, Lk, D]``; fp16/bf16, one device, unit stride on D, D 64|128.
        block_map: bool ``[B or 1, H or 1, ceil(Lq/bs), ceil(Lk/bs)]`` on q's device.
        block_size: power of two in [16, 256] (128 is the tuned size).
        scale: softmax scale, default ``1/sqrt(D)``.
        fp8: FP8 Q/K (per-128-token scales, K smoothed) and FP8 P/V (per-channel V scale).
        prefix_len, prefix_bias: ``prefix_bias`` (natural-log units) added to the scaled logits of keys
            ``[0, prefix_len)`` (see :func:`chorus.kernels.block_sparse_attention`); ``suffix_len`` /
            ``suffix_bias`` the same for the last ``suffix_len`` keys.
        token_perm: None, or (``Lq == Lk == L``) an int32/int64 ``[L]`` permutation: attention runs on
            the sequence in that order (position ``i`` = input row ``token_perm[i]``; ``block_map`` is in
            that order) and the output is returned in the input order; fused into the FP8 pre-pass and
            the output store; ``prefix_len`` and ``suffix_len`` then count positions of that order.
        pooled_tail: every key block a row's map skips enters that row's softmax as one pooled term (its
            mean key with weight ``log`` of its key count plus the biases' log-sum-exp, its mean value; see
            :func:`chorus.kernels.block_sparse_attention`): the pooled keys are extra key blocks after the
            real ones (FP8: written by the pre-pass, which reads K and V anyway; 16-bit: one extra read).

    Returns ``[B, H, Lq, D]`` in q's dtype, in ``[B, Lq, H, D]`` memory when q is such a
    head-transposed view (:func:`._attention.output_like`), else contiguous. Raises ``ValueError`` on bad shapes/dtypes/maps.
    A map row with no kept block gives zeros, or with ``pooled_tail`` the pooled terms' average (the public
    API rejects such maps first).
    """
    scale = softmax_scale(q.shape[-1], scale)
    return torch.ops.chorus.block_sparse_attention_triton(q, k, v, block_map, int(block_size), scale, bool(fp8),
                                                          int(prefix_len), float(prefix_bias), token_perm,
                                                          int(suffix_len), float(suffix_bias), bool(pooled_tail))


def block_sparse_attention_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor, *,
                                scale: float | None = None, prefix_len: int = 0, prefix_bias: float = 0.0,
                                token_perm: torch.Tensor | None = None, suffix_len: int = 0,
                                suffix_bias: float = 0.0, pooled_tail: bool = False) -> torch.Tensor:
    """The accurate INT8 path (``int8=True`` of :func:`._attention.block_sparse_attention_triton_impl`; block
    size 128; numerics: :mod:`._quant_int8` and item 7 of :mod:`._attention`), as the custom op
    ``torch.ops.chorus.block_sparse_attention_int8``; arguments, output layout and errors as
    :func:`block_sparse_attention_triton`'s."""
    scale = softmax_scale(q.shape[-1], scale)
    return torch.ops.chorus.block_sparse_attention_int8(q, k, v, block_map, scale, int(prefix_len), float(prefix_bias),
                                                        token_perm, int(suffix_len), float(suffix_bias),
                                                        bool(pooled_tail))


def ws_unavailable(q: torch.Tensor, int8: bool = False) -> str | None:
    """Reason the warp-specialised kernel (backend ``triton_fp8_ws``; ``int8``: ``triton_int8_ws``) cannot run
    on tensors like ``q`` (any call options aside: :func:`._attention_ws.supports`), or None. On a Hopper GPU
    the first question per (device, dtype, head dim, numerics) also builds and runs the kernel once on one
    block (:func:`build_probe`): a Triton whose Gluon cannot build it is a reason found while resolving, so
    ``auto`` (or the engine's accurate choice) takes the next backend from the start instead of failing at
    the first real call."""
    name = "triton_int8_ws" if int8 else "triton_fp8_ws"
    if q.device.type != "cuda":
        return f"{name} needs a CUDA tensor, got device {q.device} (Gluon has no CPU interpreter)"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"{name} is built for sm_90 (Hopper), this GPU is sm_{major}{minor}"
    reason = _attention_ws.supports(q.shape[-1], _attention_ws.BLOCK)
    if reason is not None:
        return reason
    return build_probe(("ws", str(q.device), q.dtype, q.shape[-1], bool(int8)),
                       f"the warp-specialised {'INT8' if int8 else 'FP8'} kernel", lambda: _run_one_ws_block(q, int8))


def portable_unavailable(q: torch.Tensor, numerics: str) -> str | None:
    """Reason the portable Triton kernel cannot run on tensors like ``q`` with ``numerics`` (``"fp8"``,
    ``"int8"`` or ``"16-bit"``: backends ``triton_fp8``, ``triton_int8``, ``triton_bf16``), or None. The first
    question per (device, dtype, head dim, numerics) builds and runs the kernel once on a small input
    (:func:`check_portable_kernel`, through :func:`build_probe`): on a GPU it was never run on, a kernel that
    does not build, or builds and computes wrong, is a reason found while resolving, and ``auto`` takes the
    next backend of its chain instead of every call failing (and building again) or a wrong video."""
    return build_probe(("portable", str(q.device), q.dtype, q.shape[-1], numerics), f"the Triton {numerics} kernel",
                       lambda: check_portable_kernel(q, numerics))


def check_portable_kernel(q: torch.Tensor, numerics: str) -> float:
    """Run the portable kernel with ``numerics`` on unit Gaussian q / k / v like ``q`` (2 heads x
    :data:`~chorus.kernels.probe.PROBE_TOKENS`, full map) and return its relative L2 against the fp64 oracle;
    ``RuntimeError`` when it is not finite or past :data:`~chorus.kernels.reference.NUMERICS_CEILINGS`. Whatever
    the kernel raises propagates (:func:`~chorus.kernels.probe.attention_error`)."""
    if numerics == "int8":
        return attention_error(q, numerics, block_sparse_attention_int8)
    fp8 = numerics == "fp8"
    return attention_error(q, numerics, lambda *qkv_map: block_sparse_attention_triton(*qkv_map, fp8=fp8))


def block_mass_unavailable(q: torch.Tensor) -> str | None:
    """Reason the Triton block-mass kernel (a miss's recording) cannot run on tensors like ``q``, or None: the
    first question per (device, dtype, head dim) runs it once (:func:`check_block_mass_kernel`, through
    :func:`build_probe`), so on a GPU where it does not build or computes wrong a miss records with the reference
    instead of writing wrong maps into the cache."""
    return build_probe(("block mass", str(q.device), q.dtype, q.shape[-1]), "the Triton block-mass kernel",
                       lambda: check_block_mass_kernel(q))


def check_block_mass_kernel(q: torch.Tensor, sample_rows: int = 8) -> float:
    """Run the block-mass kernel on unit Gaussian q / k like ``q`` (2 heads x
    :data:`~chorus.kernels.probe.PROBE_TOKENS`, ``sample_rows`` rows per block as a miss records) and return
    the largest absolute difference from
    :func:`~chorus.kernels.reference.block_mass_reference`; ``RuntimeError`` when it is not finite or past
    :data:`~chorus.kernels.reference.BLOCK_MASS_CEILING`. Whatever the kernel raises propagates."""
    x = probe_inputs(q, 2)
    got = block_mass_triton(x[0], x[1], block_size=128, sample_rows=sample_rows)
    want = block_mass_reference(x[0], x[1], 128, sample_rows, softmax_scale(q.shape[-1]))
    diff = (got - want).abs().max().item()
    if not diff <= BLOCK_MASS_CEILING:  # (NaN included)
        raise RuntimeError(f"it computes wrong: block masses {diff:.3g} from the reference's, where a right one "
                           f"stays under {BLOCK_MASS_CEILING}")
    return diff


def _run_one_ws_block(q: torch.Tensor, int8: bool = False) -> None:
    """One 128-token block of zeros like ``q`` through the warp-specialised kernel, synchronised."""
    x = torch.zeros(1, 1, _attention_ws.BLOCK, q.shape[-1], device=q.device, dtype=q.dtype)
    block_sparse_attention_ws(x, x, x, torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device), int8=int8)
    torch.cuda.synchronize(q.device)


def ws_call_unsupported(head_dim: int, block_size: int) -> str | None:
    """Why the warp-specialised kernel cannot run a call of this geometry (block size, head dim), or None."""
    return _attention_ws.supports(head_dim, block_size)


def block_sparse_attention_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor, *,
                              scale: float | None = None, prefix_len: int = 0, prefix_bias: float = 0.0,
                              token_perm: torch.Tensor | None = None, suffix_len: int = 0,
                              suffix_bias: float = 0.0, pooled_tail: bool = False, int8: bool = False) -> torch.Tensor:
    """The warp-specialised kernel (contract: :mod:`._attention_ws`; block size 128), as the custom op
    ``torch.ops.chorus.block_sparse_attention_ws``: FP8, or with ``int8`` the accurate path's INT8 numerics
    (:mod:`._quant_int8`, item 7 of :mod:`._attention`); ``prefix_len`` / ``prefix_bias`` / ``token_perm`` /
    ``suffix_len`` / ``suffix_bias`` (fused into the pre-pass and the output store) and ``pooled_tail`` as in
    :func:`block_sparse_attention_triton`. Output layout as :func:`block_sparse_attention_triton`'s. Raises
    ``ValueError`` outside the contract."""
    scale = softmax_scale(q.shape[-1], scale)
    return torch.ops.chorus.block_sparse_attention_ws(q, k, v, block_map, scale, int(prefix_len), float(prefix_bias),
                                                      token_perm, int(suffix_len), float(suffix_bias),
                                                      bool(pooled_tail), bool(int8))


def block_mass_triton(q: torch.Tensor, k: torch.Tensor, *, block_size: int = 128, sample_rows: int | None = None,
                      scale: float | None = None, token_perm: torch.Tensor | None = None) -> torch.Tensor:
    """Block attention mass, float32 ``[B, H, Qb, Kb]`` (see :mod:`._block_mass`); ``sample_rows``
    rows per query block as :func:`chorus.kernels.reference.sample_row_offsets` picks them, or all;
    ``token_perm``: the mass of the sequence in that order (fused into the loads)."""
    if sample_rows is not None and (not isinstance(sample_rows, int) or sample_rows < 1):
        raise ValueError(f"sample_rows must be a positive int or None, got {sample_rows!r}")
    scale = softmax_scale(q.shape[-1], scale)
    return torch.ops.chorus.block_mass_triton(q, k, int(block_size), int(sample_rows or 0), scale, token_perm)
