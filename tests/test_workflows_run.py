"""The Wan 2.2 A14B 4-step workflows, queued for real through a headless ComfyUI (CPU).

The API twins of ``workflows/`` name the model files of ComfyUI's Wan templates. Here those exact
file names hold tiny random-weight stand-ins made at test time (two A14B-shaped experts: dim 256,
2 layers; rank-4 LoRAs on every self-attention q; a random full-size Wan 2.1 VAE), so the graph runs
as committed — UNETLoader x2 -> LoraLoaderModelOnly x2 -> ModelSamplingSD3 x2 -> Chorus nodes ->
KSamplerAdvanced 0-2 / 2-4 (cfg 1) -> VAEDecode -> CreateVideo -> SaveVideo, ChorusCacheWrite on the
low-noise sampler's latent — with two changes a CPU test needs: the umt5-xxl text encoder (11 GB,
fixed size) is replaced by a test-only node giving random CONDITIONING, and the video is 64x64, 5
frames. Each workflow is queued twice with nearly the same conditioning: the first request is a
miss that writes an entry, the second a hit whose sparse attention ran on both experts.
Skips without a ComfyUI checkout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.host, pytest.mark.slow]

_HERE = Path(__file__).resolve().parent
WORKFLOWS_DIR = _HERE.parent / "workflows"




from host import tiny_wan as tiny  # noqa: E402
from host import server as server_mod  # noqa: E402
SKIP_REASON = tiny.import_comfy()


def _tiny_lora(state_dict: dict, seed: int, rank: int = 4) -> dict:
    """A rank-``rank`` LoRA on every block's self-attention q, in ComfyUI's generic key format."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lora = {}
    for key, weight in state_dict.items():
        if key.endswith("self_attn.q.weight"):
            base = "diffusion_model." + key[: -len(".weight")]
            lora[f"{base}.lora_up.weight"] = torch.randn(weight.shape[0], rank, generator=gen) * 0.01
            lora[f"{base}.lora_down.weight"] = torch.randn(rank, weight.shape[1], generator=gen) * 0.01
    return lora


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    from PIL import Image

    base = server_mod.prepare_base(tmp_path_factory.mktemp("comfy_run_base"))
    api = json.loads((WORKFLOWS_DIR / "api" / "chorus_wan22_a14b_i2v_4step_api.json").read_text())
    for seed, node in enumerate(n for n in api.values() if n["class_type"] == "UNETLoader"):
        sd = tiny.tiny_wan_state_dict(seed=seed)
        tiny.save_safetensors(sd, base / "models" / "diffusion_models" / node["inputs"]["unet_name"])
        lora = next(n for n in api.values() if n["class_type"] == "LoraLoaderModelOnly"
                    and n["inputs"]["model"] == [key_of(api, node), 0])
        tiny.save_safetensors(_tiny_lora(sd, seed + 10), base / "models" / "loras" / lora["inputs"]["lora_name"])
    vae_name = next(n["inputs"]["vae_name"] for n in api.values() if n["class_type"] == "VAELoader")
    tiny.save_safetensors(tiny.random_wan21_vae_state_dict(), base / "models" / "vae" / vae_name)
    Image.new("RGB", (64, 64), (150, 110, 70)).save(base / "input" / "example.png")
    srv = server_mod.ComfyHost(tiny.find_comfyui_dir(), base)
    yield srv
    srv.stop()


def key_of(api: dict, node: dict) -> str:
    return next(k for k, v in api.items() if v is node)


def cpu_sized(api: dict, *, seed: int, noise: float, workspace: str) -> dict:
    """The committed graph with the text encoder replaced by test conditioning and a 64x64x5 video."""
    graph = json.loads(json.dumps(api))
    clip_ids = [k for k, v in graph.items() if v["class_type"] == "CLIPLoader"]
    text_ids = [k for k, v in graph.items() if v["class_type"] == "CLIPTextEncode"]
    assert len(clip_ids) == 1 and len(text_ids) == 2
    positive_id = graph[text_ids[0]]["_meta"]["title"] == "Positive prompt" and text_ids[0] or text_ids[1]
    for k in clip_ids + text_ids:
        del graph[k]
    graph["900"] = {"class_type": "ChorusTestConditioning",
                    "inputs": {"seed": seed, "noise": noise, "noise_seed": 77}}
    for node in graph.values():
        for name, value in node["inputs"].items():
            if isinstance(value, list) and value[0] in text_ids:
                node["inputs"][name] = ["900", 0 if value[0] == positive_id else 1]
        if node["class_type"] == "WanImageToVideo":
            node["inputs"].update(width=64, height=64, length=5)
        if node["class_type"] == "ChorusMaskRetrieve":
            node["inputs"]["workspace"] = workspace
    return graph


def _texts(record: dict, class_type: str, graph: dict) -> str:
    node_id = next(k for k, v in graph.items() if v["class_type"] == class_type)
    return " ".join(record["outputs"].get(node_id, {}).get("text", []))


@pytest.mark.parametrize("name", ["chorus_wan22_a14b_i2v_4step", "chorus_wan22_a14b_i2v_4step_feature_reuse"])
def test_a14b_workflow_miss_then_hit(host, name):
    api = json.loads((WORKFLOWS_DIR / "api" / f"{name}_api.json").read_text())
    first = cpu_sized(api, seed=5, noise=0.0, workspace=name)
    record = host.queue(first, timeout=300)
    assert record["status"]["status_str"] == "success", (record["status"], host.log_tail())
    written = _texts(record, "ChorusCacheWrite", first)
    assert "wrote entry" in written, written
    save_id = next(k for k, v in first.items() if v["class_type"] == "SaveVideo")
    assert record["outputs"].get(save_id), "SaveVideo produced nothing"

    second = cpu_sized(api, seed=5, noise=0.01, workspace=name)
    record = host.queue(second, timeout=300)
    assert record["status"]["status_str"] == "success", (record["status"], host.log_tail())
    retrieved = _texts(record, "ChorusMaskRetrieve", second)
    assert retrieved.startswith("HIT"), retrieved
    written = _texts(record, "ChorusCacheWrite", second)
    assert written.startswith("hit"), written
    # Both experts ran sparse: 2 steps x 2 layers each (cfg 1: one model call per step).
    sparse = int(re.search(r"calls sparse (\d+)", written).group(1))
    fallback = int(re.search(r"fallback (\d+)", written).group(1))
    assert sparse == 2 * 2 * tiny.TINY_LAYERS and fallback == 0, written
