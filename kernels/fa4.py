"""Block-sparse attention through FlashAttention-4's CuTe DSL kernel: the ``fa4_bf16`` backend.

FlashAttention-4 (PyPI ``flash-attn-4``, optional: ``pip install chorus-ii[fa4]``) ships a
warp-specialised Hopper forward (producer warp with TMA loads, two consumer warpgroups) that takes a
FlexAttention-style list of kept key blocks per query block. It computes in the inputs' 16-bit dtype
(no FP8 on sm_90). Measured on the H200 (``docs/BENCHMARK_LOG.md``, "Kernels (H200), 2026-12-01, second
run"): 1.3-1.5x our Triton bf16 path on the same maps; our Triton FP8 path stays faster at 720p 15%,
and per request in ComfyUI's WanModel the two are equal. So ``auto`` takes it on
sm_90 only after ``triton_fp8`` (where FP8 cannot run), and a user who wants bf16 attention picks it.

Contract (:func:`block_sparse_attention_fa4`):
    q ``[B, H, Lq, D]``, k/v ``[B, H, Lk, D]``: bf16 or fp16, one CUDA device, unit stride on D (the
    ``[B, L, H, D]`` memory ComfyUI hands over is read in place: FA4 takes that layout).
    block_map: bool ``[B or 1, H or 1, ceil(Lq/bs), ceil(Lk/bs)]``, every row keeping >= 1 block (the
    public API checks); broadcast dims stay broadcast (FA4 expands size-1 dims itself).
    bs in {64, 128}: FA4's sm_90 tile must match the sparse key block. Partial last blocks are handled
    by FA4's sequence-length masking. D in {64, 96, 128} (64 and 128 tested on the GPU). No key prefix bias (guidance): the public
    API routes such calls elsewhere.
    Returns ``[B, H, Lq, D]`` in q's dtype, a head-transposed view of ``[B, Lq, H, D]`` memory.

The kept-block lists come from the Triton map compressor that our own kernel uses
(:func:`chorus.kernels.triton.compress_block_map`, on the device, no host sync); every kept block is a
"full" block (FA4 applies no per-element mask in it). Wrapped as ``chorus::block_sparse_attention_fa4``
(``torch.library.custom_op``) so that ``torch.compile`` treats it as one opaque call.
"""

from __future__ import annotations

import functools

import torch

from .custom_ops import op_registered
from .reference import softmax_scale

SUPPORTED_BLOCK_SIZES = (64, 128)
SUPPORTED_HEAD_DIMS = (64, 96, 128)
SUPPORTED_MAJORS = (9, 10)  # sm_90 (measured), sm_100 / sm_103 (FA4's own target; not measured here)


@functools.lru_cache(maxsize=1)
def _import_error() -> str | None:
    """None when FlashAttention-4's CuTe DSL interface imports, else the reason (cached: the import
    loads the CuTe DSL compiler, seconds the first time)."""
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure (missing wheel, CUDA libs) is the reason
        return (f"flash-attn-4 is not importable ({type(exc).__name__}: {str(exc).strip()[:300]}); "
                "install the optional dependency: pip install 'chorus-ii[fa4]'")
    return None


def fa4_unavailable(q: torch.Tensor) -> str | None:
    """Reason the ``fa4_bf16`` backend cannot run on tensors like ``q``, or None."""
    if q.device.type != "cuda":
        return f"fa4_bf16 needs a CUDA tensor, got device {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"fa4_bf16 needs fp16/bf16 inputs, got {q.dtype}"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"fa4_bf16 supports head dims {SUPPORTED_HEAD_DIMS}, got {q.shape[-1]}"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major not in SUPPORTED_MAJORS:
        return f"fa4_bf16 (FlashAttention-4 block sparsity) runs on sm_90 / sm_100, this GPU is sm_{major}{minor}"
    return _import_error()


def check_call(block_size: int, prefix_len: int) -> str | None:
    """Reason this call's options are outside the backend, or None (``prefix_len``: the length of any
    key bias, prefix or suffix)."""
    if block_size not in SUPPORTED_BLOCK_SIZES:
        return f"fa4_bf16 needs block size 64 or 128 (FA4's sm_90 tile matches the key block), got {block_size}"
    if prefix_len:
        return ("fa4_bf16 has no key prefix bias (guidance boost) or suffix bias (compact attention); "
                "the Triton backends have them")
    return None


def _fa4_impl(q, k, v, block_map, block_size: int, scale: float) -> torch.Tensor:
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    from .triton import compress_block_map

    kv_num, kv_idx = compress_block_map(block_map)
    # no partially masked blocks: zero counts per query block (FA4 checks that dimension), compact index
    sparse = BlockSparseTensorsTorch(mask_block_cnt=torch.zeros_like(kv_num),
                                     mask_block_idx=kv_num.new_zeros(*kv_num.shape, 1),
                                     full_block_cnt=kv_num, full_block_idx=kv_idx,
                                     block_size=(block_size, block_size))
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                          causal=False, block_sparse_tensors=sparse)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


# registered once per process (ComfyUI and the tests may import the pack under two names)
if not op_registered("block_sparse_attention_fa4"):
    @torch.library.custom_op("chorus::block_sparse_attention_fa4", mutates_args=())
    def _fa4_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor, block_size: int,
                scale: float) -> torch.Tensor:
        return _fa4_impl(q, k, v, block_map, block_size, scale)

    @_fa4_op.register_fake
    def _fa4_fake(q, k, v, block_map, block_size, scale):
        b, h, length, d = q.shape
        return q.new_empty((b, length, h, d)).transpose(1, 2)


def block_sparse_attention_fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor, *,
                               block_size: int = 128, scale: float | None = None) -> torch.Tensor:
    """FlashAttention-4 block-sparse forward on our block map (see the module docstring for the
    contract). Raises ``ValueError`` for inputs outside it (the public API checks shapes and maps
    first; this checks what is FA4's own)."""
    reason = check_call(block_size, 0)
    if reason:
        raise ValueError(reason)
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"fa4_bf16 needs unit stride on D and D in {SUPPORTED_HEAD_DIMS}, got shape "
                         f"{tuple(q.shape)} strides {q.stride()}")
    scale = softmax_scale(q.shape[-1], scale)
    bm = block_map if block_map.device == q.device else block_map.to(q.device)
    return torch.ops.chorus.block_sparse_attention_fa4(q, k, v, bm, int(block_size), scale)
