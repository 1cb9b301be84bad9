"""A hit inside ComfyUI's own ``WanModel`` on a CUDA GPU (skipped without CUDA or ComfyUI).

With a full map (every block kept) a hit computes dense attention through the Triton kernels, so the
sampled result must match the unpatched model. Tolerances come from an fp32 oracle (the unpatched
model sampled in fp32): the 16-bit kernel's (``triton_bf16``, bf16 or fp16 inputs) error is at most 2x that of
ComfyUI's own dense attention in the same dtype; the FP8 and the accurate INT8 kernels meet the FP8 kernel's stated bound (cosine >= 0.998 against the oracle, the bound its
kernel tests use on attention outputs). The grid holds 4 680 tokens: not a multiple of 128.
"""

from __future__ import annotations

import pytest
import torch

from host import tiny_wan as tiny  # tests/host (pytest pythonpath)

SKIP_REASON = None if torch.cuda.is_available() else "needs a CUDA GPU"
if SKIP_REASON is None:
    SKIP_REASON = tiny.import_comfy()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP_REASON is not None, reason=f"GPU test: {SKIP_REASON}")]

LATENT = (1, 16, 3, 60, 104)  # grid (3, 30, 52) = 4 680 tokens, 37 blocks of 128 (the last partial)
LAYERS = 2


def _model(dtype):
    return tiny.tiny_wan_in(dtype, "cuda", num_layers=LAYERS)


def _latent():
    """The request's input latent (seeded): what every sample of a test and its full-map hit's miss run on."""
    return torch.randn(LATENT, generator=torch.Generator().manual_seed(0))


def _sample(model):
    return tiny.sample_last_steps(model, _latent())


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _compiled(model):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    compiled = model.clone()
    set_torch_compile_wrapper(compiled, backend="inductor")
    return compiled


BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize("backend,compiled,dtype", [
    ("triton_bf16", False, BF16), ("triton_fp8", False, BF16), ("auto", False, BF16), ("triton_int8", False, BF16),
    ("triton_bf16", True, BF16), ("auto", True, BF16), ("triton_int8", True, BF16), ("triton_int8_ws", False, BF16),
    ("triton_int8_ws", True, BF16),
    ("triton_bf16", False, FP16), ("auto", False, FP16), ("auto", True, FP16), ("triton_int8_ws", False, FP16)],
    ids=lambda value: {BF16: "bf16", FP16: "fp16"}.get(value, str(value)))
def test_full_map_hit_matches_the_unpatched_wan_model(backend, compiled, dtype):
    """Also under TorchCompileModel (inductor): the hit's attention runs in the compiled graph through
    torch.ops.chorus.attend; the yardstick is then the larger of the eager and the compiled dense
    model's errors (inductor fuses the rest of the block in 16 bits its own way). In fp16 too: the dtype
    ComfyUI's loader computes a Wan model in on a GPU with fp16 (sm >= 8; Wan lists fp16 first among its
    inference dtypes), from an fp16, bf16 or FP8-scaled file alike, unless the user asks for bf16."""
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

    oracle = _sample(_model(torch.float32))
    model = _model(dtype)
    dense = _sample(model)
    hit = tiny.full_map_hit(model, _latent())
    if compiled:
        model = _compiled(model)
    patched = ChorusSparseSampler.execute(model, hit, backend=backend).result[0]
    out = _sample(patched)
    assert hit.is_hit and hit.stats.sparse_calls == 2 * LAYERS and hit.stats.fallback_calls == 0, hit.stats.messages
    assert torch.isfinite(out).all()
    err_dense, err_hit = _rel(dense, oracle), _rel(out, oracle)
    if compiled:
        err_dense = max(err_dense, _rel(_sample(model), oracle))
    print(f"{backend}{' compiled' if compiled else ''}: rel error vs fp32 oracle: ComfyUI {dtype} dense {err_dense:.3g}, "
          f"hit {err_hit:.3g}")
    if backend == "triton_bf16":
        assert err_hit <= 2 * err_dense + 1e-6, (err_hit, err_dense)
    else:
        cos = float(torch.nn.functional.cosine_similarity(out.flatten(), oracle.flatten(), dim=0))
        assert cos >= 0.998, cos
