"""Host tests: the pack inside a real, headless ComfyUI on CPU, driven through its HTTP API.

ComfyUI (0.3.6x checkout: COMFYUI_DIR, /opt/ComfyUI, or the folder above custom_nodes/) runs as a
subprocess with ``--base-directory`` in a temporary folder holding: a tiny random Wan 2.2
A14B-I2V-shaped checkpoint (dim 256, 2 layers, in_dim 36, every weight initialised; loaded by
UNETLoader), a random full-size Wan 2.1 VAE, the pack (symlink) and a test-only node that gives
CONDITIONING in place of the text encoder. The I2V graph is UNETLoader -> ChorusSparseSampler ->
KSampler (2 steps, cfg 2) with WanImageToVideo (32x32, 5 frames) and an EmptyImage start image,
VAEDecode -> SaveImage, and ChorusMaskRetrieve / ChorusCacheWrite around it.
Skips with a visible reason without a ComfyUI checkout.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

_HERE = Path(__file__).parent




from host import tiny_wan as tiny  # noqa: E402
from host import server as hostlib  # noqa: E402

SKIP_REASON = tiny.import_comfy()
pytestmark = [pytest.mark.host,
              pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")]

UNET = "chorus_tiny_wan_i2v.safetensors"
UNET_OTHER = "chorus_tiny_wan_i2v_other.safetensors"  # same shape, other weights
VAE = "chorus_random_wan21_vae.safetensors"
NODE_IDS = ["ChorusMaskRetrieve", "ChorusSparseSampler", "ChorusFeatureReuse", "ChorusGuidanceBoost",
            "ChorusCacheWrite", "ChorusCacheMaintenance"]


class Env:
    def __init__(self, base: Path):
        self.base = base
        self.comfy_dir = tiny.find_comfyui_dir()
        self.server = None

    def start(self):
        self.server = hostlib.ComfyHost(self.comfy_dir, self.base)
        return self.server

    def restart(self):
        self.server.stop()
        return self.start()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = hostlib.prepare_base(tmp_path_factory.mktemp("comfy_base"))
    tiny.save_safetensors(tiny.tiny_wan_state_dict(seed=0), base / "models" / "diffusion_models" / UNET)
    tiny.save_safetensors(tiny.tiny_wan_state_dict(seed=1), base / "models" / "diffusion_models" / UNET_OTHER)
    tiny.save_safetensors(tiny.random_wan21_vae_state_dict(seed=0), base / "models" / "vae" / VAE)
    environment = Env(base)
    try:
        environment.start()
    except RuntimeError as exc:
        pytest.fail(f"ComfyUI did not start: {exc}")
    yield environment
    environment.server.stop()


def i2v_graph(*, workspace="hosttest", cond_seed=7, noise=0.0, color=0, width=32, height=32, seed=0,
              threshold=0.9, decode=True, unet=UNET):
    """API-format I2V graph; node ids: 6 = ChorusMaskRetrieve, 7 = ChorusSparseSampler, 10 = ChorusCacheWrite.

    ``decode=False`` leaves out VAEDecode/SaveImage (the full-size VAE is the slow part on CPU; the
    bad-input checks do not need frames).
    """
    graph = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "3": {"class_type": "ChorusTestConditioning", "inputs": {"seed": cond_seed, "noise": noise, "noise_seed": 99}},
        "4": {"class_type": "EmptyImage", "inputs": {"width": width, "height": height, "batch_size": 1, "color": color}},
        "5": {"class_type": "WanImageToVideo", "inputs": {
            "positive": ["3", 0], "negative": ["3", 1], "vae": ["2", 0], "width": width, "height": height,
            "length": 5, "batch_size": 1, "start_image": ["4", 0]}},
        "6": {"class_type": "ChorusMaskRetrieve", "inputs": {
            "latent": ["5", 2], "workspace": workspace, "similarity_threshold": threshold, "start_image": ["4", 0],
            "positive": ["3", 0]}},
        "7": {"class_type": "ChorusSparseSampler", "inputs": {
            "model": ["1", 0], "plan": ["6", 0], "top_p": 0.9, "k_min": 4, "refresh_steps": 1, "backend": "auto"}},
        "8": {"class_type": "KSampler", "inputs": {
            "model": ["7", 0], "seed": seed, "steps": 2, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["5", 0], "negative": ["5", 1], "latent_image": ["5", 2], "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["2", 0]}},
        "10": {"class_type": "ChorusCacheWrite", "inputs": {"latent": ["8", 0], "plan": ["6", 0]}},
        "11": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "chorus_host"}},
    }
    if not decode:
        del graph["9"], graph["11"]
    return graph


def _run(server, graph, sampler_text=None):
    record = server.queue(graph)
    status = record["status"]
    assert status["status_str"] == "success", f"{status}\n{server.log_tail()}"
    outputs = record["outputs"]
    retrieve = " ".join(outputs["6"]["text"])
    write = " ".join(outputs["10"]["text"])
    if "11" in graph:
        assert outputs["11"]["images"], "the decoded frames were not saved"
    if sampler_text is not None:
        sampler_text.append(" ".join(outputs.get("7", {}).get("text", [])))
    return retrieve, write


def test_object_info_lists_every_node_with_tooltips(env):
    info = env.server.get_json("/object_info", timeout=120)
    for node_id in NODE_IDS:
        assert node_id in info, f"{node_id} missing from /object_info"
        node = info[node_id]
        assert node["category"] == "Chorus II"
        for section in ("required", "optional"):
            for name, spec in node["input"].get(section, {}).items():
                assert len(spec) > 1 and spec[1].get("tooltip"), f"{node_id}.{name} has no tooltip"
    retrieve = info["ChorusMaskRetrieve"]
    assert retrieve["output_name"] == ["plan", "mask_preview", "info"]
    assert list(retrieve["input"]["required"]) == ["latent", "workspace", "similarity_threshold"]
    assert set(retrieve["input"]["optional"]) == {"start_image", "positive", "prompt", "clip_vision_output", "end_image"}
    sampler = info["ChorusSparseSampler"]["input"]["required"]
    assert sampler["top_p"][1]["default"] == 0.9 and sampler["k_min"][1]["default"] == 4
    assert sampler["refresh_steps"][1]["default"] == 0


def test_miss_then_hit_then_dissimilar_miss_and_restart(env):
    started = time.monotonic()
    retrieve, write = _run(env.server, i2v_graph(cond_seed=7))
    assert retrieve.startswith("MISS") and "no entries" in retrieve, retrieve
    assert "wrote entry 1" in write, write

    retrieve, write = _run(env.server, i2v_graph(cond_seed=7, noise=0.05))  # a similar request
    assert retrieve.startswith("HIT entry 1"), retrieve
    similarity = float(retrieve.split("similarity ")[1].split()[0])
    assert 0.9 <= similarity < 1.0
    assert write.startswith("hit: updated stats of entry 1,") and "calls sparse 4, dense 0" in write and \
        "fallback 0" in write, write

    retrieve, write = _run(env.server, i2v_graph(cond_seed=12345, color=0xFF8000))  # a dissimilar request
    assert retrieve.startswith("MISS") and "< threshold" in retrieve, retrieve
    assert "wrote entry 2" in write, write

    server = env.restart()
    retrieve, write = _run(server, i2v_graph(cond_seed=7, noise=0.05))
    assert retrieve.startswith("HIT entry 1"), retrieve
    assert (env.base / "user" / "chorus" / "hosttest").is_dir()  # the workspace lives in ComfyUI's user dir
    assert time.monotonic() - started < 180


def test_bad_inputs_give_a_message_and_dense_attention_never_a_failed_prompt(env):
    # a workspace name that tries to leave the cache root
    retrieve, write = _run(env.server, i2v_graph(workspace="../escape", decode=False))
    assert "unusable" in retrieve and "not written" in write
    assert not (env.base / "user" / "escape").exists()
    # an entry of this test's own workspace to run against
    ws = "badinputs"
    retrieve, write = _run(env.server, i2v_graph(workspace=ws, cond_seed=7, decode=False))
    assert "wrote entry" in write, write
    # a plan made for another model: the entry's weights fingerprint differs -> dense + recording
    sampler = []
    retrieve, write = _run(env.server, i2v_graph(workspace=ws, cond_seed=7, noise=0.05, decode=False, unet=UNET_OTHER), sampler)
    assert retrieve.startswith("HIT entry 1"), retrieve
    assert "plan made for another model" in sampler[0] and "calls sparse 0" in write, (sampler, write)
    # a latent of another aspect than the entry (64x32): a miss that says so, and a new entry
    retrieve, write = _run(env.server, i2v_graph(workspace=ws, cond_seed=7, width=64, height=32, decode=False))
    assert retrieve.startswith("MISS") and "aspect" in retrieve, retrieve
    # a corrupt entry file: caught by its checksum, reported, the request goes on as a miss
    ws_dir = env.base / "user" / "chorus" / ws
    entry_files = sorted(p for p in ws_dir.rglob("*.safetensors") if "quarantine" not in p.parts)
    assert entry_files
    for path in entry_files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    retrieve, write = _run(env.server, i2v_graph(workspace=ws, cond_seed=7, noise=0.05, decode=False))
    assert retrieve.startswith("MISS") and "unreadable" in retrieve, retrieve
    # maintenance from the graph
    record = env.server.queue({"1": {"class_type": "ChorusCacheMaintenance",
                                     "inputs": {"workspace": ws, "action": "verify", "max_entries": 0}}})
    assert record["status"]["status_str"] == "success"
    assert "verify badinputs" in " ".join(record["outputs"]["1"]["text"])
