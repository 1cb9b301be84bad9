"""Test helpers: import ComfyUI in-process on CPU and build tiny random-weight Wan files at test time.

Loaded by file path from the tests (the tests folder is not a package). Nothing here is committed
model data: every weight is drawn from a seeded generator when a test runs.

ComfyUI is found through env ``COMFYUI_DIR``, else ``/opt/ComfyUI``, else the ComfyUI folder this
pack sits in (``ComfyUI/custom_nodes/<pack>``). :func:`import_comfy` puts that folder on
``sys.path`` (tests only; ComfyUI is not an installable package) and sets
``comfy.cli_args.args.cpu = True`` before any ``comfy.model_management`` import, as ComfyUI's own
``tests-unit`` do on machines without a GPU, with ``use_pytorch_cross_attention`` (ComfyUI's
``--use-pytorch-cross-attention``): the models attend with ``attention_pytorch`` (SDPA), as ComfyUI attends
on a GPU, not with its CPU default ``attention_sub_quad``, whose free-memory read (psutil) breaks every
compiled graph and makes dynamo wrap all of ``sys.modules`` at each compile.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

PACK_ROOT = Path(__file__).resolve().parents[2]

TINY_DIM = 256       # 2 heads of 128 (ComfyUI fixes head_dim = 128 for Wan)
TINY_LAYERS = 2
TINY_FFN = 512
TEXT_DIM = 4096      # fixed by ComfyUI's Wan config
TEXT_TOKENS = 512    # UMT5 pads prompts to 512 tokens
WAN21_VAE_CONFIG = {"dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
                    "temperal_downsample": [False, True, True], "dropout": 0.0}
# ComfyUI's comfy.sd.VAE hard-codes this config for a state dict with the Wan 2.2 VAE's keys
# ("decoder.upsamples.0.upsamples.0.residual.2.weight"): full size, ~705 M params, 48 latent channels
WAN22_VAE_CONFIG = {"dim": 160, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
                    "temperal_downsample": [False, True, True], "dropout": 0.0}


def find_comfyui_dir() -> Path | None:
    candidates = []
    if os.environ.get("COMFYUI_DIR"):
        candidates.append(Path(os.environ["COMFYUI_DIR"]))
    candidates.append(Path("/opt/ComfyUI"))
    if PACK_ROOT.parent.name == "custom_nodes":
        candidates.append(PACK_ROOT.parent.parent)
    for path in candidates:
        if (path / "main.py").is_file() and (path / "comfy").is_dir():
            return path
    return None


_IMPORT_STATE: dict = {}


def import_comfy() -> str | None:
    """Make ``import comfy`` work in this process on CPU. Returns None, or why it cannot."""
    if "reason" in _IMPORT_STATE:
        return _IMPORT_STATE["reason"]
    comfy_dir = find_comfyui_dir()
    if comfy_dir is None:
        reason = "no ComfyUI checkout (set COMFYUI_DIR; looked at $COMFYUI_DIR, /opt/ComfyUI, ../../ of custom_nodes)"
    else:
        if str(comfy_dir) not in sys.path:
            sys.path.insert(0, str(comfy_dir))
        try:
            import comfy.cli_args

            if not torch.cuda.is_available():
                comfy.cli_args.args.cpu = True
                comfy.cli_args.args.use_pytorch_cross_attention = True  # a GPU's attention function (docstring)
            import comfy.ldm.wan.model  # noqa: F401
            import comfy.model_management  # noqa: F401
            import comfy.sample  # noqa: F401
            import comfy.sd  # noqa: F401
            reason = None
            if not torch.cuda.is_available():
                _trace_less_on_the_cpu()
                import comfy.ldm.modules.attention as attention

                if attention.optimized_attention is not attention.attention_pytorch:
                    reason = (f"ComfyUI at {comfy_dir} attends with {attention.optimized_attention.__name__} on the "
                              "CPU despite use_pytorch_cross_attention (the host tests expect attention_pytorch)")
        except Exception as exc:  # noqa: BLE001 - a broken checkout is a skip reason, not a test error
            reason = f"ComfyUI at {comfy_dir} does not import: {type(exc).__name__}: {exc}"
    _IMPORT_STATE["reason"] = reason
    return reason


def _trace_less_on_the_cpu() -> None:
    """einops' pattern parsing, which dynamo would trace at every compile of ComfyUI's Wan on the CPU, costing
    the suite minutes that no test asserts: ComfyUI's RoPE (``comfy.ldm.flux.math.rope``) calls
    ``einops.rearrange``; einops puts its functions in dynamo's graph itself below torch 2.8, from 2.8 on dynamo
    traces the parsing (about half the bytecode it steps through in a tiny forward). Here they are in the graph
    as before 2.8.

    Tests only, and only without CUDA (the GPU tests compile as users do)."""
    import einops

    for function in (einops.rearrange, einops.repeat, einops.reduce, einops.einsum):
        torch.compiler.allow_in_graph(function)


def _init_(module: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Initialise EVERY parameter (ComfyUI's ops skip reset_parameters: untouched weights are garbage)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                p.zero_()
            elif "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def tiny_wan_state_dict(*, seed: int = 0, i2v_clip: bool = False, in_dim: int = 36, out_dim: int = 16,
                        dim: int = TINY_DIM, num_layers: int = TINY_LAYERS, ffn_dim: int = TINY_FFN) -> dict:
    """State dict of a tiny random ComfyUI ``WanModel`` with ComfyUI's key names.

    Defaults: Wan 2.2 A14B-I2V shaped (in_dim 36, no CLIP image projection). ``i2v_clip=True`` adds
    the image projection (Wan 2.1 I2V shape); ``in_dim=out_dim=48`` is the Wan 2.2 TI2V 5B shape.
    """
    import comfy.ldm.wan.model
    import comfy.ops

    model = comfy.ldm.wan.model.WanModel(
        model_type="i2v" if i2v_clip else "t2v", in_dim=in_dim, dim=dim, ffn_dim=ffn_dim, freq_dim=256,
        text_dim=TEXT_DIM, out_dim=out_dim, num_heads=dim // 128, num_layers=num_layers,
        operations=comfy.ops.disable_weight_init)
    _init_(model, seed)
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def load_tiny_wan(state_dict: dict):
    """A ComfyUI ``ModelPatcher`` from a tiny state dict (as UNETLoader would load it)."""
    import comfy.sd

    patcher = comfy.sd.load_diffusion_model_state_dict(dict(state_dict))
    if patcher is None:
        raise RuntimeError("ComfyUI did not recognise the tiny Wan state dict")
    return patcher


def tiny_wan_in(dtype: torch.dtype, device="cpu", *, num_layers: int = TINY_LAYERS, seed: int = 0):
    """A ``ModelPatcher`` over the tiny Wan (:func:`tiny_wan_state_dict`) computing in ``dtype`` on ``device``, as
    ComfyUI's loader sets a model up for that inference dtype with no manual cast (the patch embedding stays fp32,
    as ``WanModel`` keeps it), loaded and offloaded on ``device``. ComfyUI's loader picks fp16 for a Wan model on a
    GPU with fp16 (sm >= 8: Wan lists fp16 first among its inference dtypes), from any weight file."""
    import comfy.model_patcher

    model = load_tiny_wan(tiny_wan_state_dict(seed=seed, num_layers=num_layers)).model
    model.diffusion_model.to(device=device, dtype=dtype)
    model.diffusion_model.patch_embedding.to(torch.float32)
    model.diffusion_model.dtype = dtype  # what the model casts its inputs to
    model.manual_cast_dtype = None
    model.model_config.set_inference_dtype(dtype, None)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device(device),
                                            offload_device=torch.device(device))


def sample_last_steps(model, latent: torch.Tensor) -> torch.Tensor:
    """``comfy.sample.sample`` of ``model`` on ``latent`` (fp32 result): steps 2-4 of 4 euler steps at cfg 1,
    :func:`random_conditioning` ``(3)`` against ``(103)``, no added noise."""
    import comfy.sample

    positive, negative = random_conditioning(3), random_conditioning(103)
    return comfy.sample.sample(model, torch.zeros_like(latent), 4, 1.0, "euler", "simple", positive, negative, latent,
                               start_step=2, last_step=10000, force_full_denoise=True, disable_noise=True,
                               disable_pbar=True, seed=0).float()


def full_map_hit(model, latent: torch.Tensor, block_size: int = 128):
    """A hit plan on ``model`` whose maps keep every block: a miss of :func:`sample_last_steps` on ``latent`` through
    ``ChorusSparseSampler`` records the schedule and the model's fingerprint, then a ``Plan("hit")`` carries a full
    map of ``block_size``-token blocks for every key the miss recorded."""
    import numpy as np

    from chorus.engine import Plan, build_signature
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

    shape = tuple(latent.shape)
    miss = Plan.miss("full-map miss", latent_shape=shape[1:], embedding=np.ones(4, np.float32))
    sample_last_steps(ChorusSparseSampler.execute(model, miss).result[0], latent)
    _, _, t, h, w = shape
    blocks = -(-t * (h // 2) * (w // 2) // block_size)
    masks = {key: torch.ones(2, blocks, blocks, dtype=torch.bool) for key in miss.recorder.block_maps()}
    return Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": build_signature(miss)},
                latent_shape=shape[1:], embedding=np.ones(4, np.float32))


def random_wan21_vae_state_dict(seed: int = 0, dtype=torch.bfloat16) -> dict:
    """Full-size Wan 2.1 VAE (ComfyUI hard-codes its config) with random weights (~127 M params)."""
    import comfy.ldm.wan.vae

    vae = comfy.ldm.wan.vae.WanVAE(**WAN21_VAE_CONFIG)
    _init_(vae, seed, std=0.01)
    return {k: v.detach().to(dtype).contiguous() for k, v in vae.state_dict().items()}


def _shapes(build) -> dict:
    """``{key: shape}`` of a module's state dict, built on the meta device (no memory)."""
    with torch.device("meta"):
        module = build()
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def _pooled_random_state_dict(shapes: dict, seed: int, std: float, dtype) -> dict:
    """Random weights for a large fixed-size model, fast: every tensor is a window at a seeded random
    offset of one seeded N(0, std) pool (biases 0, norm scales 1). Drawing ~700 M fresh normals
    costs ~7 s on this machine's CPU; windows of a 32 M pool cost a copy. Real architectures, random
    weights made at test time, finite outputs: all a stand-in checkpoint must give."""
    gen = torch.Generator().manual_seed(seed)
    pool_size = 1 << 25
    pool = (torch.randn(pool_size, generator=gen) * std).to(dtype)
    out = {}
    for key, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        leaf = key.rsplit(".", 1)[-1]
        if leaf == "bias":
            out[key] = torch.zeros(shape, dtype=dtype)
        elif leaf == "gamma" or (len(shape) == 1 and leaf == "weight"):  # norm scales
            out[key] = torch.ones(shape, dtype=dtype)
        elif n <= pool_size:
            start = int(torch.randint(0, pool_size - n + 1, (1,), generator=gen))
            out[key] = pool[start:start + n].clone().reshape(shape)
        else:
            reps = -(-n // pool_size)
            out[key] = pool.repeat(reps)[:n].clone().reshape(shape)
    return out


def random_wan22_vae_state_dict(seed: int = 0, dtype=torch.bfloat16) -> dict:
    """Full-size Wan 2.2 VAE (``comfy/ldm/wan/vae2_2.py``; ComfyUI hard-codes its config, found by
    its keys) with random weights (~705 M params, ~1.4 GB in bf16; 48 latent channels, 16x spatial)."""
    import comfy.ldm.wan.vae2_2

    shapes = _shapes(lambda: comfy.ldm.wan.vae2_2.WanVAE(**WAN22_VAE_CONFIG))
    return _pooled_random_state_dict(shapes, seed, 0.01, dtype)


def random_clip_vision_h_state_dict(seed: int = 0, dtype=torch.float16) -> dict:
    """ComfyUI's CLIP vision ViT-H/14 (``comfy/clip_vision.py`` + ``clip_vision_config_h.json``; the
    config ComfyUI picks for a state dict with 32 encoder layers; Wan 2.1 I2V's ``clip_vision_h``) with
    random weights (~632 M params). No smaller config can be had: ComfyUI chooses the config from the
    layer count (ViT-L/H/G), and Wan 2.1's image projection takes 1280-wide features (ViT-H only)."""
    import json

    import comfy.clip_model
    import comfy.clip_vision
    import comfy.ops

    config_path = Path(comfy.clip_vision.__file__).parent / "clip_vision_config_h.json"
    config = json.loads(config_path.read_text())
    shapes = _shapes(lambda: comfy.clip_model.CLIPVisionModelProjection(
        config, torch.float32, "meta", comfy.ops.manual_cast))
    return _pooled_random_state_dict(shapes, seed, 0.02, dtype)


def tiny_lora_state_dict(state_dict: dict, *, seed: int, rank: int = 4, scale: float = 0.01) -> dict:
    """A rank-``rank`` LoRA on every block's self-attention q of ``state_dict`` (a tiny Wan), in
    ComfyUI's generic key format, random up/down factors times ``scale``."""
    gen = torch.Generator().manual_seed(seed)
    lora = {}
    for key, weight in state_dict.items():
        if key.endswith("self_attn.q.weight"):
            base = "diffusion_model." + key[: -len(".weight")]
            lora[f"{base}.lora_up.weight"] = torch.randn(weight.shape[0], rank, generator=gen) * scale
            lora[f"{base}.lora_down.weight"] = torch.randn(rank, weight.shape[1], generator=gen) * scale
    return lora


def fp8_scaled_state_dict(state_dict: dict) -> dict:
    """``state_dict`` (a tiny Wan) in the layout of ComfyUI's ``*_fp8_scaled.safetensors`` Wan files (linear
    weights e4m3 with a per-tensor scale and an input scale, the rest fp16, the ``scaled_fp8`` marker:
    ``benchmarks/comfy_e2e/fp8_scaled.py``), which ComfyUI loads with its scaled FP8 operations."""
    from chorus.benchmarks.comfy_e2e.fp8_scaled import fp8_scaled_state_dict as layout

    return layout(state_dict.items())


def save_safetensors(state_dict: dict, path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, str(path))
    return path


def sample_two_steps(model, positive, latent: torch.Tensor) -> torch.Tensor:
    """``comfy.sample.sample`` of ``model`` on ``latent``: 2 euler steps, cfg 1, seed 0, ``positive`` against
    :func:`random_conditioning` ``(1)`` (the in-process node tests' request)."""
    import comfy.sample

    noise = comfy.sample.prepare_noise(latent, 0)
    return comfy.sample.sample(model, noise, 2, 1.0, "euler", "simple", positive, random_conditioning(1), latent,
                               disable_pbar=True, seed=0)


def a14b_fingerprint(model) -> str:
    """The weights fingerprint Chorus gives ``model`` (a ModelPatcher), asserting the pack reads it as a supported
    Wan 2.2 A14B I2V expert (what a loader test's file must be)."""
    from chorus.nodes.comfy_adapter import comfy_model_info

    info = comfy_model_info(model)
    assert info.supported and info.variant == "wan2.2-a14b-i2v", info
    return info.fingerprint


def miss_write_hit(nodes, model, workspace: str) -> None:
    """A user's A14B-shaped ``model`` (a ModelPatcher from some loader) through the Chorus nodes in-process, as the
    loader tests run it: a miss (two steps on an 8 x 8 x 2 latent) writes an entry of 4 maps, the model's
    :func:`a14b_fingerprint` is the same after sampling (else no entry would ever hit), a similar request hits with
    every self-attention call sparse, and that full-map hit's latent equals the model's dense latent. ``nodes``:
    ``chorus.nodes``."""
    latent = torch.zeros(1, 16, 2, 8, 8)
    before = a14b_fingerprint(model)
    image = torch.rand(1, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    positive = random_conditioning(5)

    plan = nodes.ChorusMaskRetrieve.execute(latent={"samples": latent}, workspace=workspace, similarity_threshold=0.9,
                                            start_image=image, positive=positive, prompt="a red fox").args[0]
    assert not plan.is_hit
    patched = nodes.ChorusSparseSampler.execute(model=model, plan=plan, backend="auto")
    assert "MISS: dense attention + recording | patched wan2.2-a14b-i2v" in " ".join(patched.ui["text"])
    samples = sample_two_steps(patched.args[0], positive, latent)
    assert torch.isfinite(samples).all()
    written = nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=plan).args[0]
    assert written.startswith("wrote entry 1 (4 maps") and "recorded 4" in written, written
    assert a14b_fingerprint(model) == before  # sampling loaded the model and its patches: still the same model

    plan = nodes.ChorusMaskRetrieve.execute(latent={"samples": latent}, workspace=workspace, similarity_threshold=0.9,
                                            start_image=image * 0.98, prompt="a red fox",
                                            positive=random_conditioning(5, noise=0.05)).args[0]
    assert plan.is_hit
    hit = sample_two_steps(nodes.ChorusSparseSampler.execute(model=model, plan=plan, backend="auto").args[0],
                           positive, latent)
    text = nodes.ChorusCacheWrite.execute(latent={"samples": hit}, plan=plan).args[0]
    assert text.startswith("hit: updated stats of entry 1,") and "calls sparse 4, dense 0" in text, text
    assert "density 100.0%" in text  # 8 tokens a frame: the recorded map keeps every block
    dense = sample_two_steps(model, positive, latent)
    torch.testing.assert_close(hit, dense, rtol=1e-4, atol=1e-5)  # a full map: the same attention, summed otherwise


def random_conditioning(seed: int, *, scale: float = 1.0, noise: float = 0.0, noise_seed: int = 1000):
    """ComfyUI CONDITIONING ``[[cond [1, 512, 4096], {}]]`` from a seed (+ optional small noise)."""
    gen = torch.Generator().manual_seed(seed)
    cond = torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=gen) * scale
    if noise:
        cond = cond + noise * torch.randn(cond.shape, generator=torch.Generator().manual_seed(noise_seed))
    return [[cond, {}]]


def with_input_images(conditioning, latent_shape, end_image: bool, seed: int):
    """``conditioning`` as ComfyUI's WanImageToVideo (a start image) or WanFirstLastFrameToVideo (``end_image``: a
    start and an end image) leaves it for a latent ``[1, 16, T, H, W]``: each entry's options gain
    ``concat_latent_image`` (a random image latent from ``seed``) and ``concat_mask`` (0 where a pixel frame holds
    an image: the start image's latent frame whole, the end image's last pixel frame only)."""
    _, _, t, h, w = latent_shape
    mask = torch.ones(1, 1, t * 4, h, w)
    mask[:, :, :4] = 0.0
    if end_image:
        mask[:, :, -1:] = 0.0
    image = torch.randn(1, 16, t, h, w, generator=torch.Generator().manual_seed(seed))
    extra = {"concat_latent_image": image, "concat_mask": mask.view(1, t, 4, h, w).transpose(1, 2)}
    return [[c[0], dict(c[1], **extra)] for c in conditioning]
