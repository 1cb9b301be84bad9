"""Wan loaded from a GGUF file by ComfyUI-GGUF's Unet Loader (GGUF), with a LoRA, through the Chorus nodes
in-process (CPU, tiny A14B-shaped Wan written as GGUF at test time; ``host/gguf_nodes.py``).

Many users run Wan 2.2 14B from GGUF files (quantized weights the pack dequantizes per layer, LoRAs kept
beside the quantized weights instead of merged). Covers: the model is recognised; its fingerprint is
the same before and after sampling (else no entry would ever hit) and on a second load of the file, and
differs from the same weights' safetensors model and from another quantization (other numerics, other
masks); a miss writes an entry, a similar request hits it with every self-attention call sparse, and a
full-map hit's latent equals the same model's dense latent.

Skips without a ComfyUI-GGUF checkout (``CHORUS_GGUF_NODES_DIR`` or ComfyUI's ``custom_nodes/``): it is a
custom node pack, not an installable package, and nothing of it is vendored.
"""

from __future__ import annotations

import pytest

from host import gguf_nodes
from host import tiny_wan as tiny

GGUF_NODES, SKIP_REASON = gguf_nodes.import_gguf_nodes()
pytestmark = [pytest.mark.host,
              pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI-GGUF not available: {SKIP_REASON}")]

@pytest.fixture(scope="module")
def state_dict():
    return tiny.tiny_wan_state_dict(seed=0)


@pytest.fixture()
def load_gguf(tmp_path, monkeypatch, state_dict):
    """``load(qtype)``: the tiny Wan written as ``tiny_<qtype>.gguf`` in a models folder of this test, loaded by
    the pack's Unet Loader (GGUF) node as a user's graph loads it."""
    import folder_paths

    models = tmp_path / "diffusion_models"
    paths, extensions = folder_paths.folder_names_and_paths["diffusion_models"]
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "diffusion_models", ([str(models), *paths], extensions))

    def load(qtype: str):
        name = f"tiny_{qtype}.gguf"
        if not (models / name).is_file():
            gguf_nodes.save_gguf(state_dict, models / name, qtype)
        return GGUF_NODES.UnetLoaderGGUF().load_unet(name)[0]

    return load


def _with_lora(model, state_dict):
    import comfy.sd

    return comfy.sd.load_lora_for_models(model, None, tiny.tiny_lora_state_dict(state_dict, seed=3), 1.0, 0)[0]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_gguf_wan_with_a_lora_misses_writes_and_hits_through_the_nodes(nodes, load_gguf, state_dict, qtype):
    import gguf

    model = _with_lora(load_gguf(qtype), state_dict)
    quantized = [p for p in model.model.diffusion_model.parameters()
                 if getattr(p, "tensor_type", None) == getattr(gguf.GGMLQuantizationType, qtype)]
    assert quantized and type(model).__name__ == "GGUFModelPatcher"  # the pack's model, its weights quantized
    tiny.miss_write_hit(nodes, model, "gguf")


def test_a_gguf_file_is_one_model_and_not_another(load_gguf, state_dict):
    q8 = load_gguf("Q8_0")
    assert tiny.a14b_fingerprint(q8) == tiny.a14b_fingerprint(load_gguf("Q8_0"))  # a second load of the same file
    assert tiny.a14b_fingerprint(q8) != tiny.a14b_fingerprint(load_gguf("Q4_0"))
    assert tiny.a14b_fingerprint(q8) != tiny.a14b_fingerprint(tiny.load_tiny_wan(state_dict))  # the unquantized weights
    assert tiny.a14b_fingerprint(_with_lora(q8, state_dict)) != tiny.a14b_fingerprint(q8)
