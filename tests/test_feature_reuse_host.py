"""Host test: ChorusFeatureReuse and ChorusGuidanceBoost inside a real, headless ComfyUI (CPU).

The graph is the host tests' I2V graph (tiny random Wan 2.2 A14B-shaped UNET, random full-size Wan
2.1 VAE, EmptyImage start image, test-only conditioning node) with the model chain
UNETLoader -> ChorusFeatureReuse -> ChorusSparseSampler -> ChorusGuidanceBoost -> KSampler, queued
twice through ``POST /prompt``: the first request is a miss that records region scores and writes an
entry; the second, the same request, is a hit whose feature-reuse node reports downsampled regions.
128x128 pixels and 13 frames give a token grid of (4, 8, 8): one 2x8x8 region past the first frame.
Skips with a visible reason without a ComfyUI checkout.
"""

from __future__ import annotations

import re

from pathlib import Path

import pytest

_HERE = Path(__file__).parent




from host import tiny_wan as tiny  # noqa: E402
from host import server as hostlib  # noqa: E402

SKIP_REASON = tiny.import_comfy()
pytestmark = [pytest.mark.host,
              pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")]

UNET = "chorus_tiny_wan_i2v_fr.safetensors"
VAE = "chorus_random_wan21_vae_fr.safetensors"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = hostlib.prepare_base(tmp_path_factory.mktemp("comfy_base_fr"))
    tiny.save_safetensors(tiny.tiny_wan_state_dict(seed=0), base / "models" / "diffusion_models" / UNET)
    tiny.save_safetensors(tiny.random_wan21_vae_state_dict(seed=0), base / "models" / "vae" / VAE)
    try:
        host = hostlib.ComfyHost(tiny.find_comfyui_dir(), base)
    except RuntimeError as exc:
        pytest.fail(f"ComfyUI did not start: {exc}")
    yield host
    host.stop()


def graph(workspace="fr_host"):
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "3": {"class_type": "ChorusTestConditioning", "inputs": {"seed": 7, "noise": 0.0, "noise_seed": 99}},
        "4": {"class_type": "EmptyImage", "inputs": {"width": 128, "height": 128, "batch_size": 1, "color": 0}},
        "5": {"class_type": "WanImageToVideo", "inputs": {
            "positive": ["3", 0], "negative": ["3", 1], "vae": ["2", 0], "width": 128, "height": 128,
            "length": 13, "batch_size": 1, "start_image": ["4", 0]}},
        "6": {"class_type": "ChorusMaskRetrieve", "inputs": {
            "latent": ["5", 2], "workspace": workspace, "similarity_threshold": 0.9, "start_image": ["4", 0],
            "positive": ["3", 0]}},
        "12": {"class_type": "ChorusFeatureReuse", "inputs": {"model": ["1", 0], "plan": ["6", 0],
                                                             "downsample_share": 0.5}},
        "7": {"class_type": "ChorusSparseSampler", "inputs": {
            "model": ["12", 0], "plan": ["6", 0], "top_p": 0.9, "k_min": 4, "refresh_steps": 0, "backend": "auto"}},
        "13": {"class_type": "ChorusGuidanceBoost", "inputs": {"model": ["7", 0], "plan": ["6", 0], "strength": 0.5,
                                                          "image_strength": 0.5, "cfg_strength": 0.0}},
        "8": {"class_type": "KSampler", "inputs": {
            "model": ["13", 0], "seed": 0, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["5", 0], "negative": ["5", 1], "latent_image": ["5", 2], "denoise": 1.0}},
        "10": {"class_type": "ChorusCacheWrite", "inputs": {"latent": ["8", 0], "plan": ["6", 0]}},
    }


def _texts(record, node):
    return " ".join(record["outputs"].get(node, {}).get("text", []))


def test_miss_records_regions_then_hit_downsamples(server):
    first = server.queue(graph(), timeout=600)
    assert first["status"]["status_str"] == "success", f"{first['status']}\n{server.log_tail()}"
    assert "MISS" in _texts(first, "12") and "recording region redundancy" in _texts(first, "12")
    assert "no boost" in _texts(first, "13")
    written = re.match(r"wrote entry (\d+) ", _texts(first, "10"))
    assert written, _texts(first, "10")
    entry = int(written.group(1))

    second = server.queue(graph(), timeout=600)
    assert second["status"]["status_str"] == "success", f"{second['status']}\n{server.log_tail()}"
    assert _texts(second, "6").startswith(f"HIT entry {entry} |"), _texts(second, "6")
    fr_text = _texts(second, "12")
    assert "HIT: 50% of regions downsampled" in fr_text, fr_text
    assert "boost on the reused steps" in _texts(second, "13")
    write_text = _texts(second, "10")
    assert write_text.startswith(f"hit: updated stats of entry {entry},") and \
        "feature reuse: 2/4 block calls downsampled" in write_text, write_text
