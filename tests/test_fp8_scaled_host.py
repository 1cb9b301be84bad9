"""Wan loaded from an FP8-scaled safetensors file, as the shipped workflows load it, with a LoRA, through the
Chorus nodes in-process (CPU, a tiny A14B-shaped Wan written in that layout at test time).

The shipped A14B workflows name ComfyUI's own ``wan2.2_i2v_*_14B_fp8_scaled.safetensors``: linear weights
stored as ``float8_e4m3fn`` with a per-tensor scale, which ComfyUI loads with its scaled FP8 operations (0.3.64)
or as ``QuantizedTensor`` weights of its mixed-precision operations (0.28.2 on). Covers: the model is
recognised; its fingerprint is the same before and after sampling and on a second load of the file, and differs
from the same weights' bf16 file; a miss writes an entry, a similar request hits it with every self-attention
call sparse, and a full-map hit's latent equals the same model's dense latent.
"""

from __future__ import annotations

import pytest
import torch

from host import tiny_wan as tiny

SKIP_REASON = tiny.import_comfy()
pytestmark = [pytest.mark.host, pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))]


@pytest.fixture(autouse=True)
def _inference_mode():
    """ComfyUI runs every node of a graph in inference mode (``execution.py``); its LoRA patch of an FP8
    weight (a stochastic rounding with ``out=``) needs it."""
    with torch.inference_mode():
        yield


@pytest.fixture(scope="module")
def state_dict():
    return tiny.tiny_wan_state_dict(seed=0)


@pytest.fixture(scope="module")
def model_files(tmp_path_factory, state_dict):
    folder = tmp_path_factory.mktemp("diffusion_models")
    return {"fp8_scaled": tiny.save_safetensors(tiny.fp8_scaled_state_dict(state_dict), folder / "fp8_scaled.safetensors"),
            "bf16": tiny.save_safetensors({k: v.to(torch.bfloat16) for k, v in state_dict.items()},
                                          folder / "bf16.safetensors")}


def _load(path):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(path))  # what UNETLoader runs, weight_dtype "default"


def _quantized(weight) -> bool:
    return weight.dtype == torch.float8_e4m3fn or type(weight).__name__ == "QuantizedTensor"


def test_an_fp8_scaled_wan_with_a_lora_misses_writes_and_hits_through_the_nodes(nodes, model_files, state_dict):
    import comfy.sd

    base = _load(model_files["fp8_scaled"])
    assert _quantized(base.model.diffusion_model.blocks[0].self_attn.q.weight)  # loaded as the published files are
    model = comfy.sd.load_lora_for_models(base, None, tiny.tiny_lora_state_dict(state_dict, seed=3), 1.0, 0)[0]
    tiny.miss_write_hit(nodes, model, "fp8s")


def test_an_fp8_scaled_file_is_one_model_and_not_its_bf16_weights(model_files, state_dict):
    fp8 = _load(model_files["fp8_scaled"])
    fingerprint = tiny.a14b_fingerprint(fp8)
    assert fingerprint == tiny.a14b_fingerprint(_load(model_files["fp8_scaled"]))  # a second load of the same file
    assert fingerprint != tiny.a14b_fingerprint(_load(model_files["bf16"]))  # other numerics, other masks
