"""A hit inside ComfyUI's own ``WanModel`` on a CUDA GPU (skipped without CUDA or ComfyUI).

With a full map (every block kept) a hit computes dense attention through the Triton kernels, so the
sampled result must match the unpatched model. Tolerances come from an fp32 oracle (the unpatched
model sampled in fp32): the bf16 kernel's error is at most 2x that of ComfyUI's own bf16 dense
attention; the FP8 and the accurate INT8 kernels meet the FP8 kernel's stated bound (cosine >= 0.998 against the oracle, the bound its
kernel tests use on attention outputs). The grid holds 4 680 tokens: not a multiple of 128.
"""

from __future__ import annotations

import numpy as np
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
    import comfy.model_patcher

    patcher = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0, num_layers=LAYERS))
    model = patcher.model
    model.diffusion_model.to(device="cuda", dtype=dtype)
    model.diffusion_model.patch_embedding.to(torch.float32)  # ComfyUI's Wan keeps the patch embedding fp32
    model.diffusion_model.dtype = dtype  # what the model casts its inputs to
    model.manual_cast_dtype = None
    model.model_config.set_inference_dtype(dtype, None)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cuda"),
                                            offload_device=torch.device("cuda"))


def _sample(model, seed=0):
    import comfy.sample

    positive, negative = tiny.random_conditioning(3), tiny.random_conditioning(103)
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(LATENT, generator=gen)
    return comfy.sample.sample(model, torch.zeros(LATENT), 4, 1.0, "euler", "simple", positive, negative, latent,
                               start_step=2, last_step=10000, force_full_denoise=True, disable_noise=True,
                               disable_pbar=True, seed=0).float()


def _full_map_hit(model):
    """A miss run (records the schedule and fingerprints), then a hit on its entry with full maps."""
    from chorus.engine import Plan, build_signature
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

    miss = Plan.miss("gpu test miss", latent_shape=LATENT[1:], embedding=np.ones(4, np.float32))
    _sample(ChorusSparseSampler.execute(model, miss).result[0])
    sig = build_signature(miss)
    qb = -(-LATENT[2] * (LATENT[3] // 2) * (LATENT[4] // 2) // 128)
    masks = {key: torch.ones(2, qb, qb, dtype=torch.bool) for key in miss.recorder.block_maps()}
    return Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": sig},
                latent_shape=LATENT[1:], embedding=np.ones(4, np.float32))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _compiled(model):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    compiled = model.clone()
    set_torch_compile_wrapper(compiled, backend="inductor")
    return compiled


@pytest.mark.parametrize("backend,compiled", [("triton_bf16", False), ("triton_fp8", False), ("auto", False),
                                              ("triton_int8", False), ("triton_bf16", True), ("auto", True),
                                              ("triton_int8", True), ("triton_int8_ws", False),
                                              ("triton_int8_ws", True)])
def test_full_map_hit_matches_the_unpatched_wan_model(backend, compiled):
    """Also under TorchCompileModel (inductor): the hit's attention runs in the compiled graph through
    torch.ops.chorus.attend; the yardstick is then the larger of the eager and the compiled dense
    model's errors (inductor fuses the rest of the block in bf16 its own way)."""
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

    oracle = _sample(_model(torch.float32))
    model = _model(torch.bfloat16)
    dense = _sample(model)
    hit = _full_map_hit(model)
    if compiled:
        model = _compiled(model)
    patched = ChorusSparseSampler.execute(model, hit, backend=backend).result[0]
    out = _sample(patched)
    assert hit.is_hit and hit.stats.sparse_calls == 2 * LAYERS and hit.stats.fallback_calls == 0, hit.stats.messages
    assert torch.isfinite(out).all()
    err_dense, err_hit = _rel(dense, oracle), _rel(out, oracle)
    if compiled:
        err_dense = max(err_dense, _rel(_sample(model), oracle))
    print(f"{backend}{' compiled' if compiled else ''}: rel error vs fp32 oracle: ComfyUI bf16 dense {err_dense:.3g}, "
          f"hit {err_hit:.3g}")
    if backend == "triton_bf16":
        assert err_hit <= 2 * err_dense + 1e-6, (err_hit, err_dense)
    else:
        cos = float(torch.nn.functional.cosine_similarity(out.flatten(), oracle.flatten(), dim=0))
        assert cos >= 0.998, cos
