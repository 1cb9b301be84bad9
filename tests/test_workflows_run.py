"""Every shipped workflow, queued for real through a headless ComfyUI (CPU).

The API twins of ``workflows/`` name the model files of ComfyUI's Wan templates. Here those exact
file names hold random-weight stand-ins made at test time in the models folder of the shared run
server (``host/run_host.py``), so each graph runs as committed:

- Wan 2.2 A14B 4-step (plain and with feature reuse + guidance): two A14B-shaped experts (dim 256,
  2 layers) in the layout of the FP8-scaled files the graphs name (linear weights e4m3 with a per-tensor
  scale; ComfyUI loads them with its scaled FP8 operations), rank-4 LoRAs on every self-attention q, a
  random full-size Wan 2.1 VAE; UNETLoader x2 ->
  LoraLoaderModelOnly x2 -> ModelSamplingSD3 x2 -> Chorus nodes -> KSamplerAdvanced 0-2 / 2-4 (cfg 1);
- Wan 2.2 TI2V 5B: a tiny 48-channel ``WanModel`` (ComfyUI detects Wan 2.2 TI2V: per-frame
  timesteps) and a random full-size Wan 2.2 VAE (``vae2_2``: ComfyUI hard-codes its config, ~705 M
  params; 48 latent channels, 16x spatial) -> Wan22ImageToVideoLatent (start image encoded into the
  first latent frame) -> KSampler uni_pc, cfg 5;
- Wan 2.1 I2V 14B: a tiny ``WanModel`` with the CLIP image projection, a random full-size CLIP
  vision ViT-H (``comfy/clip_vision.py`` picks ViT-H from the layer count; Wan 2.1 needs its
  1280-wide features, no smaller config exists) -> CLIPVisionEncode -> WanImageToVideo
  (``clip_vision_output`` -> the model's ``clip_fea``; ChorusMaskRetrieve embeds it) -> KSampler uni_pc,
  cfg 6;

- the long video (Wan 2.2 A14B 4-step in ComfyUI's Wan context windows, with feature reuse): 17 frames in
  windows of 9 overlapping by 4 (two windows of three latent frames; from 0.28.2 on the second gets the frame
  before it, the host's causal window fix); on 0.3.64 the run server cuts the image conditioning to each
  window as later ComfyUI does (``tests/host/conditioning_node.py``);

then VAEDecode -> CreateVideo -> SaveVideo, ChorusCacheWrite on the last sampler's latent. Two
changes a CPU test needs: the umt5-xxl text encoder (11 GB, fixed size) is replaced by a test-only
node giving random CONDITIONING, and the video is 64x64, 5 frames (and the 20-step graphs sample 4 steps). Each workflow is queued twice
with nearly the same conditioning: the first request is a miss that writes an entry, the second a
hit whose every self-attention call ran sparse (on both experts for A14B). Skips without a ComfyUI
checkout.
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
from host import run_host  # noqa: E402
SKIP_REASON = tiny.import_comfy()
WORKFLOWS = ["chorus_wan22_a14b_i2v_4step", "chorus_wan22_a14b_i2v_4step_feature_reuse",
             "chorus_wan22_a14b_flf2v_4step", "chorus_wan22_a14b_i2v_4step_long", "chorus_wan22_ti2v_5b",
             "chorus_wan21_i2v_14b"]
# the long video on the CPU: 17 pixel frames (5 latent) in windows of 9 (3 latent) overlapping by 4 (1 latent)
LONG_FRAMES, LONG_WINDOW, LONG_OVERLAP, LONG_WINDOWS = 17, 9, 4, 2
CPU_STEPS = 4  # the 20-step KSampler graphs (5B, 2.1) run 4 steps here (same sampler, scheduler, cfg)
# model calls per request (ComfyUI batches cond and uncond into one call on CPU): A14B 2 steps per
# expert, cfg 1; 5B and 2.1 4 steps uni_pc (one model call per step)
MODEL_CALLS = {"chorus_wan22_a14b_i2v_4step": 2 * 2, "chorus_wan22_a14b_i2v_4step_feature_reuse": 2 * 2,
               "chorus_wan22_a14b_flf2v_4step": 2 * 2, "chorus_wan22_a14b_i2v_4step_long": 2 * 2 * LONG_WINDOWS,
               "chorus_wan22_ti2v_5b": CPU_STEPS, "chorus_wan21_i2v_14b": CPU_STEPS}


def stage_models(api: dict) -> None:
    """Write the stand-in of every model file ``api`` names into the run server's models folder."""
    unets = [n for n in api.values() if n["class_type"] == "UNETLoader"]
    vae_name = next(n["inputs"]["vae_name"] for n in api.values() if n["class_type"] == "VAELoader")
    clip_vision = [n for n in api.values() if n["class_type"] == "CLIPVisionLoader"]
    if vae_name == "wan2.2_vae.safetensors":  # Wan 2.2 TI2V 5B: 48 latent channels
        unet_kwargs, vae = dict(in_dim=48, out_dim=48), tiny.random_wan22_vae_state_dict
    elif clip_vision:  # Wan 2.1 I2V: the CLIP image projection
        unet_kwargs, vae = dict(i2v_clip=True), tiny.random_wan21_vae_state_dict
    else:  # Wan 2.2 A14B I2V experts
        unet_kwargs, vae = {}, tiny.random_wan21_vae_state_dict
    for seed, node in enumerate(unets):
        name = node["inputs"]["unet_name"]
        seed += 10 * len(name)  # another model file, other weights
        # a file named as ComfyUI's FP8-scaled Wan files is written in their layout, so the graph loads it as
        # it loads the published file (ComfyUI's scaled FP8 operations)
        layout = tiny.fp8_scaled_state_dict if name.endswith("_fp8_scaled.safetensors") else dict
        run_host.ensure_model("diffusion_models", name,
                              lambda: layout(tiny.tiny_wan_state_dict(seed=seed, **unet_kwargs)))
        for lora in (n for n in api.values() if n["class_type"] == "LoraLoaderModelOnly"
                     and n["inputs"]["model"] == [key_of(api, node), 0]):
            run_host.ensure_model("loras", lora["inputs"]["lora_name"],
                                  lambda: tiny.tiny_lora_state_dict(tiny.tiny_wan_state_dict(seed=seed, **unet_kwargs),
                                                                     seed=seed + 10))
    run_host.ensure_model("vae", vae_name, vae)
    for node in clip_vision:
        run_host.ensure_model("clip_vision", node["inputs"]["clip_name"], tiny.random_clip_vision_h_state_dict)
    for node in api.values():
        if node["class_type"] == "LoadImage":
            run_host.ensure_input_image(node["inputs"]["image"])


@pytest.fixture(scope="module")
def host():
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    return run_host.run_host_or_skip()


def key_of(api: dict, node: dict) -> str:
    return next(k for k, v in api.items() if v is node)


def cpu_sized(api: dict, *, seed: int, noise: float, workspace: str, length: int = 5) -> dict:
    """The committed graph with the text encoder replaced by test conditioning and a 64x64 video of ``length``
    frames (5: two latent frames; 9: three, so that an end image has a frame of its own); a graph in context
    windows: :data:`LONG_FRAMES` in windows of :data:`LONG_WINDOW` overlapping by :data:`LONG_OVERLAP`."""
    if any(node["class_type"] == "WanContextWindowsManual" for node in api.values()):
        length = LONG_FRAMES
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
        if node["class_type"] in ("WanImageToVideo", "Wan22ImageToVideoLatent", "WanFirstLastFrameToVideo"):
            node["inputs"].update(width=64, height=64, length=length)
        if node["class_type"] == "WanContextWindowsManual":
            node["inputs"].update(context_length=LONG_WINDOW, context_overlap=LONG_OVERLAP)
        if node["class_type"] == "KSampler":
            node["inputs"]["steps"] = min(node["inputs"]["steps"], CPU_STEPS)
        if node["class_type"] == "ChorusMaskRetrieve":
            node["inputs"]["workspace"] = workspace
    return graph


def _assert_saved_one_video(host, record: dict, save_id: str) -> None:
    """SaveVideo's history output names one file, and the host's output folder holds it, not empty."""
    files = record["outputs"].get(save_id, {}).get("images", [])
    assert len(files) == 1, record["outputs"].get(save_id)
    saved = host.base_dir / "output" / files[0]["subfolder"] / files[0]["filename"]
    assert saved.is_file() and saved.stat().st_size > 0, saved


def _texts(record: dict, class_type: str, graph: dict) -> str:
    node_id = next(k for k, v in graph.items() if v["class_type"] == class_type)
    return " ".join(record["outputs"].get(node_id, {}).get("text", []))


@pytest.mark.parametrize("name", WORKFLOWS)
def test_workflow_miss_then_hit(host, name):
    api = json.loads((WORKFLOWS_DIR / "api" / f"{name}_api.json").read_text())
    stage_models(api)
    first = cpu_sized(api, seed=5, noise=0.0, workspace=name)
    record = host.queue(first, timeout=300)
    assert record["status"]["status_str"] == "success", (record["status"], host.log_tail())
    retrieved = _texts(record, "ChorusMaskRetrieve", first)
    assert retrieved.startswith("MISS"), retrieved
    written = _texts(record, "ChorusCacheWrite", first)
    assert "wrote entry" in written, written
    dense = int(re.search(r"dense (\d+)", written).group(1))
    assert dense == MODEL_CALLS[name] * tiny.TINY_LAYERS, written
    save_id = next(k for k, v in first.items() if v["class_type"] == "SaveVideo")
    _assert_saved_one_video(host, record, save_id)

    second = cpu_sized(api, seed=5, noise=0.01, workspace=name)
    record = host.queue(second, timeout=300)
    assert record["status"]["status_str"] == "success", (record["status"], host.log_tail())
    retrieved = _texts(record, "ChorusMaskRetrieve", second)
    assert retrieved.startswith("HIT"), retrieved
    written = _texts(record, "ChorusCacheWrite", second)
    assert written.startswith("hit"), written
    # every self-attention call sparse (A14B: on both experts), none dense, none fell back
    sparse = int(re.search(r"calls sparse (\d+)", written).group(1))
    dense = int(re.search(r"dense (\d+)", written).group(1))
    fallback = int(re.search(r"fallback (\d+)", written).group(1))
    assert sparse == MODEL_CALLS[name] * tiny.TINY_LAYERS and dense == 0 and fallback == 0, written
    _assert_saved_one_video(host, record, save_id)


def test_a_first_last_frame_entry_serves_first_last_frame_requests_only(host):
    """The first-last-frame graph and the start-image graph of the same models, prompt and start image in one
    workspace (three latent frames: the end image on a frame of its own): the start-image request finds the
    first-last-frame entry by its embedding, is demoted before any sparse call and writes an entry of its own;
    each graph then hits its own entry, every call sparse."""
    workspace = "image_layouts"
    graphs = {}
    for name in ("chorus_wan22_a14b_flf2v_4step", "chorus_wan22_a14b_i2v_4step"):
        api = json.loads((WORKFLOWS_DIR / "api" / f"{name}_api.json").read_text())
        stage_models(api)
        graphs[name] = cpu_sized(api, seed=5, noise=0.0, workspace=workspace, length=9)

    def queue(name):
        record = host.queue(graphs[name], timeout=300)
        assert record["status"]["status_str"] == "success", (record["status"], host.log_tail())
        return (_texts(record, "ChorusMaskRetrieve", graphs[name]), _texts(record, "ChorusCacheWrite", graphs[name]))

    retrieved, written = queue("chorus_wan22_a14b_flf2v_4step")
    assert retrieved.startswith("MISS") and "wrote entry 1" in written, written
    retrieved, written = queue("chorus_wan22_a14b_i2v_4step")
    assert retrieved.startswith("HIT entry 1"), retrieved
    assert "wrote entry 2" in written and "calls sparse 0" in written, written
    assert "recorded with a start and an end image" in written and "this request has a start image" in written
    for name, entry in (("chorus_wan22_a14b_flf2v_4step", 1), ("chorus_wan22_a14b_i2v_4step", 2)):
        _, written = queue(name)
        assert written.startswith(f"hit: updated stats of entry {entry},"), written
        assert f"calls sparse {MODEL_CALLS[name] * tiny.TINY_LAYERS}, dense 0" in written, written
