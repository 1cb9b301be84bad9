"""The models the benchmark samples: ComfyUI imported from a checkout, random-weight Wan experts built by ComfyUI's
own loader path (``--weights bf16 | fp16 | fp8 | fp8_scaled``), and how ComfyUI loaded them for a request."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def import_comfy(comfy_dir: Path, cpu: bool):
    """Import ComfyUI from a checkout (a benchmark, not the pack: the checkout goes on sys.path). On the CPU the
    models attend with ``attention_pytorch`` (SDPA, ComfyUI's ``--use-pytorch-cross-attention``), as ComfyUI
    attends on a GPU: its CPU default (``attention_sub_quad``) reads free memory in each call, a graph break in
    every compiled block."""
    if not (comfy_dir / "comfy" / "ldm" / "wan" / "model.py").is_file():
        raise SystemExit(f"error: {comfy_dir} is not a ComfyUI checkout")
    sys.path.insert(0, str(comfy_dir))
    import comfy.cli_args

    comfy.cli_args.args.cpu = cpu
    comfy.cli_args.args.use_pytorch_cross_attention = comfy.cli_args.args.use_pytorch_cross_attention or cpu
    comfy.cli_args.args.highvram = not cpu  # keep both experts resident, as a 141 GB card does
    import comfy.model_management  # noqa: F401
    import comfy.model_patcher  # noqa: F401
    import nodes  # noqa: F401  (ComfyUI's nodes.py: KSamplerAdvanced)
    return comfy


class FastFp8:
    """``--fast fp8_matrix_mult`` while ComfyUI picks the operations of a model (restored after)."""

    def __enter__(self):
        import comfy.cli_args as cli

        self.cli = cli
        self.before = set(cli.args.fast or ())
        cli.args.fast = self.before | {cli.PerformanceFeature.Fp8MatrixMultiplication}

    def __exit__(self, *exc):
        self.cli.args.fast = self.before


def build_expert(shape: dict, weights: str, seed: int, device: torch.device):
    """A ComfyUI ``ModelPatcher`` over a random Wan expert built by ComfyUI's own loader path."""
    import comfy.model_detection
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ldm.wan.model
    import comfy.ops

    with torch.device("meta"):
        meta = comfy.ldm.wan.model.WanModel(model_type="t2v", operations=comfy.ops.disable_weight_init, **shape)
    sd = dict(meta.state_dict())
    config = comfy.model_detection.model_config_from_unet(sd, "")
    if config is None:
        raise RuntimeError("ComfyUI did not detect the Wan state dict")
    if weights == "fp8_scaled":
        return _fp8_scaled_expert(sd, seed, device)
    if weights == "fp8":
        unet_dtype = torch.float8_e4m3fn
        config.optimizations["fp8"] = True
    elif weights == "fp16":
        unet_dtype = torch.float16  # on the CPU too (toy sizes): the fp16 path itself is what these rows are for
    else:
        unet_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    manual_cast = comfy.model_management.unet_manual_cast(unet_dtype, device, config.supported_inference_dtypes)
    config.set_inference_dtype(unet_dtype, manual_cast)
    if weights == "fp8":
        with FastFp8():
            model = config.get_model({}, "", device=device)
    else:
        model = config.get_model({}, "", device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.diffusion_model.named_parameters():
            p.copy_(random_weight(name, p.shape, device, gen))
    # ComfyUI 0.3.64 never leaves training mode for the diffusion model, and its fp8_ops.Linear runs the FP8
    # matmul only outside training mode (later ComfyUI versions dropped that condition): in training mode
    # the FP8-weights path casts each weight back to bf16 (measured: fp8_linears.py and BENCHMARK_LOG.md)
    model.diffusion_model.eval()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)
    return patcher, linear_ops(model.diffusion_model)


def random_weight(name: str, shape, device, gen: torch.Generator) -> torch.Tensor:
    """The benchmark's random value of one Wan parameter, float32 on ``device``: biases 0, norm scales 1, every
    other tensor N(0, 0.02^2) drawn from ``gen``."""
    if name.endswith("bias"):
        return torch.zeros(shape, device=device)
    if "norm" in name and len(shape) == 1:
        return torch.ones(shape, device=device)
    return torch.randn(shape, device=device, generator=gen, dtype=torch.float32) * 0.02


def _fp8_scaled_expert(meta_state_dict: dict, seed: int, device: torch.device):
    """``build_expert`` for ``--weights fp8_scaled``: random weights (:func:`random_weight`) in the layout
    of ComfyUI's FP8-scaled Wan files (``fp8_scaled.py``), made one tensor at a time on ``device`` and loaded by
    ComfyUI's own ``load_diffusion_model_state_dict`` (what UNETLoader runs on such a file, ``weight_dtype``
    default), kept on ``device`` where the host lets the caller name the offload device (0.28.2 on)."""
    import comfy.sd

    from .fp8_scaled import fp8_scaled_state_dict

    gen = torch.Generator(device=device).manual_seed(seed)
    weights = ((name, random_weight(name, p.shape, device, gen)) for name, p in meta_state_dict.items())
    patcher = comfy.sd.load_diffusion_model_state_dict(fp8_scaled_state_dict(weights),
                                                        model_options={"offload_device": device})
    if patcher is None:
        raise RuntimeError("ComfyUI did not detect the FP8-scaled Wan state dict")
    patcher.model.diffusion_model.eval()  # as build_expert: 0.3.64 leaves the model in training mode
    return patcher, linear_ops(patcher.model.diffusion_model)


def linear_ops(diffusion_model) -> str:
    """The operations ComfyUI gave a Wan model's linears, as the JSON's ``ops`` names them: the first self-attention
    q projection's class and its weight's type and dtype (``QuantizedTensor``, e4m3, fp16 ...)."""
    q = diffusion_model.blocks[0].self_attn.q
    return type(q).__module__ + "." + type(q).__qualname__ + f" ({type(q.weight).__name__} {q.weight.dtype})"


def loading_state(models) -> list[dict]:
    """How ComfyUI loaded each expert's weights for the request just run (``ModelPatcher.loaded_size`` /
    ``model_size``, GiB, and whether it loaded it partially, ``model_lowvram``): a GPU too small for both experts
    and the request makes ComfyUI load them partially, and its ops then cast weights per call (slower, and
    under compile another graph); a row where that happened measures ComfyUI's loading, not attention."""
    return [{"loaded_gib": round(m.loaded_size() / 2 ** 30, 2), "size_gib": round(m.model_size() / 2 ** 30, 2),
             "partial": bool(getattr(m.model, "model_lowvram", False))} for m in models]
