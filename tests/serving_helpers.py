"""Helpers for the serving tests (``tests/test_serving_*.py``): tiny-request ComfyUI workers that
share one Chorus cache root.

Reuses the host helpers (``tests/host/tiny_wan.py`` for the tiny random Wan checkpoint and the
ComfyUI import, ``tests/host/server.py`` for the headless server subprocess and its base folder).

A serving request here is the cheapest graph that still goes through every Chorus step on a real
ComfyUI: ``UNETLoader`` (tiny Wan 2.2 A14B-I2V-shaped model: dim 256, 2 layers, in_dim 36; its 20
image channels are zeros because no start image is concatenated) -> ``ChorusSparseSampler`` ->
``KSampler`` (1-2 steps, cfg 1, euler) on an ``EmptyHunyuanLatentVideo`` latent (32x32, 5 frames:
``[1, 16, 2, 4, 4]``, 8 tokens), conditioning from the test-only node ``ChorusTestConditioning``
(no text encoder), ``ChorusMaskRetrieve`` (embedding from the positive conditioning) and
``ChorusCacheWrite``. No VAE, no image saved: the requests cost a few hundred milliseconds each.

Requests are named by a *template* (the conditioning seed) and a *variant* (small noise on top):
the same template is a hit at the default threshold once an entry exists, different templates are
dissimilar (independent 512x4096 Gaussian conditionings: cosine ~0).

Several servers share the cache by ``CHORUS_CACHE_DIR`` (each has its own base folder, user
directory, output and temp folders), exactly as an operator would run them (docs/OPERATIONS.md).

Also the pieces the fuzz tests (``tests/test_fuzz_*.py``) share: case counting that shows in the
test output (a :class:`FuzzReport` warning, which pytest prints in its warnings summary with or
without ``-s``/``-rA``, plus a junit ``record_property``), filesystem snapshots around a cache
root, and a tiny engine-shaped entry (signature, masks, model info).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
UNET = "chorus_serving_tiny_wan.safetensors"
WORKSPACE = "serving"




from host import tiny_wan as tiny  # noqa: E402
from host import server as hostlib  # noqa: E402


def skip_reason() -> str | None:
    """None when a ComfyUI checkout imports in-process (needed to build the tiny checkpoint)."""
    return tiny.import_comfy()


def write_tiny_unet(path: Path, seed: int = 0) -> Path:
    """The tiny Wan checkpoint UNETLoader loads (every weight initialised, ~13 MB)."""
    return tiny.save_safetensors(tiny.tiny_wan_state_dict(seed=seed), path)


def prepare_worker_base(base_dir: Path, unet_file: Path) -> Path:
    """A ComfyUI base folder (pack + test node via :func:`hostlib.prepare_base`) with the tiny
    checkpoint linked into ``models/diffusion_models``."""
    base = hostlib.prepare_base(base_dir)
    link = base / "models" / "diffusion_models" / UNET
    if not link.exists():
        link.symlink_to(unet_file)
    return base


def start_worker(base_dir: Path, cache_root: Path, *, startup_timeout: float = 180.0):
    """Start one headless ComfyUI worker whose Chorus cache root is ``cache_root``."""
    comfy_dir = tiny.find_comfyui_dir()
    return hostlib.ComfyHost(comfy_dir, base_dir, startup_timeout=startup_timeout,
                             extra_env={"CHORUS_CACHE_DIR": str(cache_root)})


def request_graph(template: int, variant: int = 0, *, workspace: str = WORKSPACE, steps: int = 1,
                  threshold: float = 0.9, size: int = 32, length: int = 5, noise: float = 0.05,
                  seed: int = 0) -> dict:
    """API-format graph of one tiny request. Node ids: 3 = ChorusMaskRetrieve, 4 =
    ChorusSparseSampler, 6 = ChorusCacheWrite. ``variant`` > 0 adds ``noise`` x N(0, 1) (seeded by
    the variant) to the template's conditioning: a near-duplicate (cosine ~0.999)."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}},
        "2": {"class_type": "ChorusTestConditioning", "inputs": {
            "seed": int(template), "noise": noise if variant else 0.0, "noise_seed": int(variant)}},
        "7": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {
            "width": size, "height": size, "length": length, "batch_size": 1}},
        "3": {"class_type": "ChorusMaskRetrieve", "inputs": {
            "latent": ["7", 0], "workspace": workspace, "similarity_threshold": threshold, "positive": ["2", 0],
            "prompt": f"template {template}"}},
        "4": {"class_type": "ChorusSparseSampler", "inputs": {
            "model": ["1", 0], "plan": ["3", 0], "top_p": 0.9, "k_min": 1, "refresh_steps": 0, "backend": "auto"}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["4", 0], "seed": int(seed), "steps": int(steps), "cfg": 1.0, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["2", 0], "negative": ["2", 1], "latent_image": ["7", 0],
            "denoise": 1.0}},
        "6": {"class_type": "ChorusCacheWrite", "inputs": {"latent": ["5", 0], "plan": ["3", 0]}},
    }


def post_prompt(worker, graph) -> str:
    """Queue ``graph`` on ``worker`` (``POST /prompt``); returns its prompt id (asserts the server took it)."""
    import json
    import uuid

    status, body = worker.post_json("/prompt", {"prompt": graph, "client_id": uuid.uuid4().hex})
    assert status == 200, f"/prompt rejected the graph ({status}): {json.dumps(body)[:1000]}"
    return body["prompt_id"]


def wait_prompt(worker, prompt_id, timeout: float = 240.0, poll: float = 0.1) -> dict:
    """``/history`` record of ``prompt_id`` once it succeeded or failed; ``AssertionError`` (with the
    worker's log tail) past ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = worker.get_json(f"/history/{prompt_id}").get(prompt_id)
        if record and record.get("status", {}).get("status_str") in ("success", "error"):
            return record
        time.sleep(poll)
    raise AssertionError(f"prompt {prompt_id} did not finish within {timeout:.0f} s:\n{worker.log_tail()}")


def outcome(record: dict) -> dict:
    """Summary of a finished request's ``/history`` record: status, hit/miss, entry ids, texts."""
    status = record.get("status", {})
    outputs = record.get("outputs", {})
    retrieve = " ".join(outputs.get("3", {}).get("text", []))
    write = " ".join(outputs.get("6", {}).get("text", []))
    hit_entry = None
    if retrieve.startswith("HIT entry "):
        hit_entry = int(retrieve.split()[2])
    wrote = None
    if write.startswith("wrote entry "):
        wrote = int(write.split()[2])
    errors = [{k: m[1].get(k) for k in ("node_type", "exception_type", "exception_message")}
              for m in status.get("messages", []) if m[0] == "execution_error" and isinstance(m[1], dict)]
    return {"status": status.get("status_str"), "hit": hit_entry is not None, "hit_entry": hit_entry,
            "wrote": wrote, "retrieve": retrieve, "write": write,
            "messages": [m[0] for m in status.get("messages", [])], "errors": errors}


def chorus_cli(*args: str, env_root: Path | None = None, timeout: float = 120.0):
    """Run ``python -m chorus <args>`` in a subprocess; returns the CompletedProcess."""
    import subprocess

    env = dict(os.environ)
    if env_root is not None:
        env["CHORUS_CACHE_DIR"] = str(env_root)
    return subprocess.run([sys.executable, "-m", "chorus", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def unique_writer(path: str, barrier, results, rounds: int = 5) -> None:
    """Child process for the dedupe test: :func:`testing.add_same_requests` on the one-host workspace."""
    from chorus.cache_store import Workspace
    from testing import add_same_requests

    add_same_requests(Workspace.open(path), barrier, results, rounds)


# -- fuzz helpers ---------------------------------------------------------------------------

# the engine-shaped signature of a tiny Wan 2.2 A14B-I2V request: latent [16, 2, 4, 4] -> 8 tokens
NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 2, 64
LATENT = (16, 2, 4, 4)
GRID = (2, 2, 2)
FINGERPRINT = "fuzz0000fuzz0000"
STEP_SIGMAS = [1.0, 0.5]
EMB_DIM = 32


class FuzzReport(UserWarning):
    """How many cases a fuzz test ran (shown in pytest's warnings summary)."""


def report(record_property, name: str, counts: dict) -> None:
    total = sum(counts.values())
    detail = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    record_property("fuzz_cases", total)
    warnings.warn(FuzzReport(f"fuzz: {name}: {total} cases ({detail})"), stacklevel=2)


def snapshot(root: Path, *, skip: Path | None = None) -> dict:
    """``{relative path: (size, mtime_ns)}`` of everything under ``root`` (``skip`` subtree left out)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        if skip is not None and (here == skip or skip in here.parents):
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = here / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size if not p.is_dir() else 0, st.st_mtime_ns if not p.is_dir() else 0)
    return out


def signature(**overrides) -> dict:
    sig = {"format": 1, "family": "wan", "variant": "wan2.2-a14b-i2v", "experts": [FINGERPRINT],
           "num_layers": NUM_LAYERS, "num_heads": NUM_HEADS, "latent_shape": list(LATENT),
           "token_grid": list(GRID), "block_size": 128, "token_order": "thw", "step_sigmas": STEP_SIGMAS,
           "head_groups": 1}
    sig.update(overrides)
    return sig


def entry_masks(seed: int) -> dict:
    """Engine-shaped masks ``{(expert, step, layer, head_group): bool [H, 1, 1]}`` (8 tokens = 1 block)."""
    return {(0, step, layer, 0): torch.ones(NUM_HEADS, 1, 1, dtype=torch.bool)
            for step in range(len(STEP_SIGMAS)) for layer in range(NUM_LAYERS)}


def embedding(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=EMB_DIM).astype(np.float32)


def model_info():
    from chorus.engine import ModelInfo

    return ModelInfo("wan", "wan2.2-a14b-i2v", NUM_LAYERS, NUM_HEADS, HEAD_DIM, 36, FINGERPRINT)


def dense(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def record_miss(plan, seed: int = 0):
    """Run seeded tiny attention calls through ``plan`` (a miss) for every (step, layer) of the tiny
    signature, so that it records; returns ``plan``."""
    from chorus.engine import ChorusAttention, SparseConfig

    handle = ChorusAttention(plan, SparseConfig(backend="reference"), model_info())
    handle.begin_run(sample_sigmas=STEP_SIGMAS + [0.0])
    gen = torch.Generator().manual_seed(seed)
    for sigma in STEP_SIGMAS:
        for layer in range(NUM_LAYERS):
            q, k, v = (torch.randn(1, NUM_HEADS, 8, HEAD_DIM, generator=gen) for _ in range(3))
            handle.self_attention(q, k, v, layer=layer, sigma=sigma, grid=GRID, dense_fn=dense)
    handle.end_run()
    return plan
