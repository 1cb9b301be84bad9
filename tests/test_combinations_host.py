"""What Wan users combine with the Chorus nodes, queued through a headless ComfyUI: each test asserts
the outcome (hit, miss, or dense with a message), never a failed prompt.

The graph is the cheap serving request (``serving_helpers.request_graph``: tiny A14B-shaped Wan,
dim 256, 2 layers; 32x32, 5 frames = 8 tokens; test-only conditioning; no VAE) on the shared run
server (``host/run_host.py``), one workspace per test. Combinations:

- KSampler, KSamplerAdvanced (4 steps, cfg 1) and SamplerCustomAdvanced (CFGGuider cfg 3,
  KSamplerSelect, BasicScheduler 3 steps): miss writes, hit is sparse on every call;
- ``weight_dtype`` fp8_e4m3fn / fp8_e4m3fn_fast (on CPU ComfyUI stores the weights in fp8 and casts
  them to the compute dtype per layer; ``_fast`` needs an fp8-matmul GPU, so on CPU it is the same
  cast): another weights fingerprint than the default dtype — an entry of the fp16/fp32 model is
  demoted to dense, never reused; the fp8 model's own entry is a hit, shared by both fp8 options
  (the same stored fp8 values), also when retrieval ranks the other model's entry first;
- a LoRA loaded, or its strength changed, after an entry was written: the entry is demoted (dense,
  a note), a new entry is written for the LoRA model, never reused for another model; each model
  back again hits its own entry, also when retrieval ranks another model's (equal embedding) first;
- ComfyUI's EasyCache node on the patched model: EasyCache skips steps, so the miss records fewer
  steps than the sampler's schedule; the entry keeps that schedule, so the next request hits it
  (sparse on the recorded steps, dense on a skipped one), with or without EasyCache;
- ComfyUI's TorchCompileModel (inductor) on the patched model: miss records, hit sparse on every call
  (the Chorus attention override runs eagerly inside the compiled model);
- GPU only: ComfyUI started with ``--use-sage-attention`` and PyPI's ``sageattention``: a miss's dense
  calls and cross-attention go through ``sageattn``; a hit's sparse calls do not.
"""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.host, pytest.mark.slow]

from host import run_host  # noqa: E402
from host import tiny_wan as tiny  # noqa: E402
import serving_helpers as sh  # noqa: E402

SKIP_REASON = tiny.import_comfy()
LORA = "chorus_combo_lora.safetensors"


@pytest.fixture(scope="module")
def host():
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    srv = run_host.run_host_or_skip()
    run_host.ensure_model("diffusion_models", sh.UNET, lambda: tiny.tiny_wan_state_dict(seed=0))
    run_host.ensure_model("loras", LORA, lambda: tiny.tiny_lora_state_dict(tiny.tiny_wan_state_dict(seed=0), seed=3,
                                                                            scale=0.05))
    return srv


def graph(workspace: str, variant: int = 0, *, steps: int = 2) -> dict:
    return sh.request_graph(1, variant, workspace=workspace, steps=steps)


def run(host, g: dict, timeout: float = 300) -> dict:
    record = host.queue(g, timeout=timeout)
    out = sh.outcome(record)
    assert out["status"] == "success" and not out["errors"], (out, host.log_tail())
    numbers = {name: int(m.group(1)) for name in ("sparse", "dense", "fallback")
               if (m := re.search(rf"{'calls sparse' if name == 'sparse' else name} (\d+)", out["write"]))}
    out.update(numbers)
    return out


def assert_miss_written(out: dict, calls: int) -> None:
    assert out["retrieve"].startswith("MISS") and out["wrote"] is not None, out
    assert out["sparse"] == 0 and out["dense"] == calls and out["fallback"] == 0, out


def assert_sparse_hit(out: dict, entry: int, calls: int) -> None:
    assert out["hit_entry"] == entry and out["write"].startswith("hit"), out
    assert out["sparse"] == calls and out["dense"] == 0 and out["fallback"] == 0, out


def assert_sparse_hit_on(out: dict, entry: int, calls: int) -> None:
    """A sparse hit on ``entry``: retrieval's first candidate, or the one the hit moved to because
    the first was made for another model (equal embeddings: same prompt and image)."""
    assert out["write"].startswith(f"hit: updated stats of entry {entry},"), out
    assert out["sparse"] == calls and out["dense"] == 0 and out["fallback"] == 0, out
    assert out["hit_entry"] == entry or f"hit moved from entry {out['hit_entry']}" in out["write"], out


def assert_demoted(out: dict, entry: int, calls: int, why: str) -> None:
    """A hit on ``entry`` that ran dense: never reused for this model; the note says why."""
    assert out["hit_entry"] == entry, out
    assert out["sparse"] == 0 and out["dense"] == calls, out
    assert "plan demoted to dense" in out["write"] and why in out["write"], out


# -- samplers ---------------------------------------------------------------------------------------

def _ksampler_advanced(g: dict) -> dict:
    g["5"] = {"class_type": "KSamplerAdvanced", "inputs": {
        "model": ["4", 0], "add_noise": "enable", "noise_seed": 0, "steps": 4, "cfg": 1.0, "sampler_name": "euler",
        "scheduler": "simple", "positive": ["2", 0], "negative": ["2", 1], "latent_image": ["7", 0],
        "start_at_step": 0, "end_at_step": 10000, "return_with_leftover_noise": "disable"}}
    return g


def _sampler_custom_advanced(g: dict) -> dict:
    g["10"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": 0}}
    g["11"] = {"class_type": "CFGGuider", "inputs": {"model": ["4", 0], "positive": ["2", 0], "negative": ["2", 1],
                                                     "cfg": 3.0}}
    g["12"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}}
    g["13"] = {"class_type": "BasicScheduler", "inputs": {"model": ["4", 0], "scheduler": "simple", "steps": 3,
                                                          "denoise": 1.0}}
    g["5"] = {"class_type": "SamplerCustomAdvanced", "inputs": {
        "noise": ["10", 0], "guider": ["11", 0], "sampler": ["12", 0], "sigmas": ["13", 0], "latent_image": ["7", 0]}}
    return g


@pytest.mark.parametrize("sampler,make,calls", [
    ("KSampler", lambda g: g, 2 * tiny.TINY_LAYERS),
    ("KSamplerAdvanced", _ksampler_advanced, 4 * tiny.TINY_LAYERS),
    # cfg 3: cond and uncond batched into one model call per step
    ("SamplerCustomAdvanced", _sampler_custom_advanced, 3 * tiny.TINY_LAYERS),
])
def test_sampler_miss_then_sparse_hit(host, sampler, make, calls):
    ws = f"combo_{sampler.lower()}"
    first = run(host, make(graph(ws)))
    assert_miss_written(first, calls)
    assert_sparse_hit(run(host, make(graph(ws, 1))), first["wrote"], calls)


# -- weight dtype -----------------------------------------------------------------------------------

def _dtype(g: dict, weight_dtype: str) -> dict:
    g["1"]["inputs"]["weight_dtype"] = weight_dtype
    return g


def test_fp8_weight_dtypes_are_another_model_with_their_own_entry(host):
    calls = 2 * tiny.TINY_LAYERS
    ws = "combo_fp8"
    default = run(host, graph(ws))
    assert_miss_written(default, calls)
    # the fp8 model meets the default model's entry: demoted (another fingerprint), writes its own
    fp8 = run(host, _dtype(graph(ws, 1), "fp8_e4m3fn"))
    assert_demoted(fp8, default["wrote"], calls, "another model")
    assert fp8["wrote"] is not None and fp8["wrote"] != default["wrote"], fp8
    # fp8_e4m3fn_fast on CPU: the same fp8 weights, cast per layer (no fp8 matmul): the fp8 entry's model
    # (retrieval may rank the default model's entry first: the hit moves to the fp8 entry)
    assert_sparse_hit_on(run(host, _dtype(graph(ws, 2), "fp8_e4m3fn_fast")), fp8["wrote"], calls)
    # the default dtype still hits its own entry, sparse
    assert_sparse_hit_on(run(host, graph(ws, 3)), default["wrote"], calls)


def test_fp8_model_alone_miss_then_sparse_hit(host):
    calls = 2 * tiny.TINY_LAYERS
    for weight_dtype in ("fp8_e4m3fn", "fp8_e4m3fn_fast"):
        ws = f"combo_{weight_dtype}"
        first = run(host, _dtype(graph(ws), weight_dtype))
        assert_miss_written(first, calls)
        assert_sparse_hit(run(host, _dtype(graph(ws, 1), weight_dtype)), first["wrote"], calls)


# -- LoRA after an entry was written ----------------------------------------------------------------

def _with_lora(g: dict, strength: float) -> dict:
    g["8"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": LORA,
                                                              "strength_model": strength}}
    g["4"]["inputs"]["model"] = ["8", 0]
    return g


def test_lora_loaded_or_strength_changed_after_the_entry_demotes_it(host):
    calls = 2 * tiny.TINY_LAYERS
    ws = "combo_lora"
    base = run(host, graph(ws))
    assert_miss_written(base, calls)
    # LoRA loaded after the entry was written: the entry is demoted, never reused; the LoRA model's
    # dense run becomes its own entry
    lora = run(host, _with_lora(graph(ws, 1), 1.0))
    assert_demoted(lora, base["wrote"], calls, "another model")
    assert lora["wrote"] is not None and lora["wrote"] != base["wrote"], lora
    # strength changed: another model again (the fingerprint holds the strengths); no candidate
    # serves it, so it is demoted and written too
    half = run(host, _with_lora(graph(ws, 2), 0.5))
    # equal embeddings rank the older entry first (the store's tie rule); the LoRA entry is the other candidate
    assert_demoted(half, base["wrote"], calls, "no other candidate serves it")
    assert half["wrote"] not in (None, base["wrote"], lora["wrote"]), half
    # every model back again: the entries' embeddings are equal (same prompt and image), so retrieval
    # may rank another model's entry first; the hit moves to the entry made for the model it meets
    # (before the first sparse call) and runs sparse on it, never on another model's masks
    for model_graph, entry in ((_with_lora(graph(ws, 3), 1.0), lora["wrote"]),
                               (_with_lora(graph(ws, 4), 0.5), half["wrote"]), (graph(ws, 5), base["wrote"])):
        assert_sparse_hit_on(run(host, model_graph), entry, calls)


# -- EasyCache --------------------------------------------------------------------------------------

def _easycache(g: dict) -> dict:
    g["5"]["inputs"]["steps"] = 8
    g["9"] = {"class_type": "EasyCache", "inputs": {"model": ["4", 0], "reuse_threshold": 0.2, "start_percent": 0.15,
                                                    "end_percent": 0.95, "verbose": False}}
    g["5"]["inputs"]["model"] = ["9", 0]
    return g


def test_easycache_on_the_patched_model_hits_its_entry(host):
    ws = "combo_easycache"
    first = run(host, _easycache(graph(ws)))
    # EasyCache skipped some of the 8 steps: fewer model calls were recorded, under the whole schedule
    assert first["retrieve"].startswith("MISS") and first["wrote"] is not None, first
    assert first["sparse"] == 0 and 0 < first["dense"] < 8 * tiny.TINY_LAYERS and first["fallback"] == 0, first
    second = run(host, _easycache(graph(ws, 1)))
    # the same schedule: a hit, sparse on the recorded steps; a step EasyCache runs now but skipped
    # then has no map and runs dense, one call at a time (never a demotion)
    assert second["hit_entry"] == first["wrote"] and second["write"].startswith("hit"), second
    assert second["sparse"] > 0 and "plan demoted" not in second["write"], second
    assert second["sparse"] + second["fallback"] <= 8 * tiny.TINY_LAYERS, second
    # EasyCache removed, same schedule: sparse where the entry has maps, dense on the skipped steps
    eight_steps = graph(ws, 2)
    eight_steps["5"]["inputs"]["steps"] = 8
    plain = run(host, eight_steps)
    assert plain["hit_entry"] == first["wrote"] and plain["write"].startswith("hit"), plain
    assert plain["sparse"] == first["dense"] and plain["fallback"] == 8 * tiny.TINY_LAYERS - first["dense"], plain


# -- torch.compile ----------------------------------------------------------------------------------

def _compiled(g: dict) -> dict:
    g["9"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["4", 0], "backend": "inductor"}}
    g["5"]["inputs"]["model"] = ["9", 0]
    return g


def test_torch_compile_model_on_the_patched_model_miss_then_sparse_hit(host):
    """Inductor on CPU compiles the tiny model once (about a minute on 2 busy cores)."""
    calls = 2 * tiny.TINY_LAYERS
    ws = "combo_compile"
    first = run(host, _compiled(graph(ws)), timeout=600)
    assert_miss_written(first, calls)
    hit = run(host, _compiled(graph(ws, 1)), timeout=600)
    assert_sparse_hit(hit, first["wrote"], calls)  # before the fix: layer 0 fell back to dense (dynamo guard)
    assert "sparse attention not used" not in hit["write"], hit


# -- SageAttention (GPU) ----------------------------------------------------------------------------

def _sage_skip_reason() -> str | None:
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (ComfyUI --use-sage-attention with PyPI's sageattention)"
    if importlib.util.find_spec("sageattention") is None:
        return "needs PyPI's sageattention (pip install sageattention)"
    return SKIP_REASON


@pytest.mark.gpu
def test_sage_attention_server_dense_calls_go_through_sageattn(tmp_path):
    reason = _sage_skip_reason()
    if reason:
        pytest.skip(reason)
    from host import server as hostlib

    base = hostlib.prepare_base(tmp_path / "sage_base")
    tiny.save_safetensors(tiny.tiny_wan_state_dict(seed=0), base / "models" / "diffusion_models" / sh.UNET)
    srv = hostlib.ComfyHost(tiny.find_comfyui_dir(), base, cpu=False, extra_args=["--use-sage-attention"],
                            extra_env={"CHORUS_TEST_COUNT_SAGE": "1"}, startup_timeout=240)
    try:
        calls = 2 * tiny.TINY_LAYERS

        def sage_graph(variant):
            g = graph("sage", variant)
            g["20"] = {"class_type": "ChorusTestSageCalls", "inputs": {"latent": ["5", 0]}}
            return g

        def sage_calls(record):
            text = " ".join(record["outputs"].get("20", {}).get("text", []))
            assert text.startswith("sage calls ") and text != "sage calls not counted", text
            return int(text.split()[-1])

        record = srv.queue(sage_graph(0), timeout=300)
        miss = sh.outcome(record)
        assert miss["status"] == "success" and miss["wrote"] is not None, (miss, srv.log_tail())
        # every dense self-attention call and every cross-attention call went through sageattn
        assert sage_calls(record) == 2 * calls, (miss, srv.log_tail())
        record = srv.queue(sage_graph(1), timeout=300)
        hit = sh.outcome(record)
        assert hit["status"] == "success" and hit["hit_entry"] == miss["wrote"], (hit, srv.log_tail())
        assert "calls sparse 4, dense 0" in hit["write"], hit
        assert sage_calls(record) == calls, hit  # cross-attention only: the sparse calls bypass it
    finally:
        srv.stop()
