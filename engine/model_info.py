"""Model identity and token geometry: what the engine knows about one diffusion model (one expert).

``ModelInfo`` (variant, layers, heads, weights fingerprint) of a ComfyUI ``WanModel`` or a diffusers
``WanTransformer3DModel`` (:func:`wan_model_info`), the token grid of a latent (:func:`token_grid`) and the
latent frames a forward's input conditions on an image (:func:`image_frames`).
What an entry records about them, and the checks against a request, is ``compat.py``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

PATCH_SIZE = (1, 2, 2)

SUPPORTED_VARIANTS = ("wan2.1-i2v", "wan2.2-ti2v-5b", "wan2.2-a14b-i2v")


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about one diffusion model (one expert).

    ``variant`` is one of :data:`SUPPORTED_VARIANTS`, or a descriptive name when ``supported`` is
    False (then ``reason`` says why). ``fingerprint`` is a short hex string that changes when the
    weights (or the weight patches applied on top, e.g. LoRAs) change.
    """

    family: str
    variant: str
    num_layers: int
    num_heads: int
    head_dim: int
    in_dim: int
    fingerprint: str
    supported: bool = True
    reason: str = ""


def _sample_values(t: torch.Tensor, count: int = 64, dtype: torch.dtype | None = None) -> bytes:
    """Up to ``count`` strided values of ``t`` as float32 bytes, rounded to ``dtype`` first when given."""
    if t.device.type == "meta" or t.numel() == 0:
        return b"meta"
    flat = t.detach().reshape(-1)
    stride = max(1, flat.numel() // count)
    vals = flat[::stride][:count].to(device="cpu")
    if dtype is not None:
        vals = vals.to(dtype)
    return vals.to(torch.float32).numpy().tobytes()


def weights_fingerprint(module: torch.nn.Module, extra: str = "", max_tensors: int = 8,
                        exclude: frozenset | set = frozenset(), dtypes: dict | None = None) -> str:
    """Cheap, stable fingerprint of a module's weights: 16 hex chars.

    Hashes every parameter's name and shape (the architecture) plus up to 64 strided values of up to
    ``max_tensors`` parameters chosen evenly among those outside attention / feed-forward linears
    (patch embedding, modulation, norms, head: tensors weight patches such as LoRAs rarely touch, so
    the value does not depend on whether a host has applied its patches yet). Parameters named in
    ``exclude`` (e.g. the keys a host patches in place when it loads the model) are never sampled;
    callers pass a description of such patches in ``extra``. ``dtypes`` (parameter name -> dtype): the
    dtype a host computes a parameter in, when its stored tensor may be another until the model is
    loaded; sampled values are rounded to it first, so the fingerprint is the same before and after
    loading. Costs well under a millisecond per tensor.
    """
    h = hashlib.sha256()
    h.update(type(module).__name__.encode())
    named = list(module.named_parameters())
    for name, p in named:
        h.update(f"{name}:{tuple(p.shape)};".encode())
    candidates = [(n, p) for n, p in named if n not in exclude]
    untouched = [(n, p) for n, p in candidates if not any(s in n for s in ("attn", "ffn", "lora"))] or candidates
    if untouched:
        step = max(1, len(untouched) // max_tensors)
        for name, p in untouched[::step][:max_tensors]:
            h.update(name.encode())
            h.update(_sample_values(p, dtype=(dtypes or {}).get(name)))
    h.update(extra.encode())
    return h.hexdigest()[:16]


def wan_model_info(module: torch.nn.Module, *, fingerprint_extra: str = "",
                   fingerprint_exclude: frozenset | set = frozenset(),
                   fingerprint_dtypes: dict | None = None) -> ModelInfo:
    """Identify a Wan diffusion model: ComfyUI's ``WanModel`` or diffusers' ``WanTransformer3DModel``.

    Supported: Wan 2.1 I2V (in_dim 36 with a CLIP image projection), Wan 2.2 TI2V 5B (48 latent
    channels), Wan 2.2 A14B I2V (in_dim 36, no image projection; one ModelInfo per expert). Any other
    module gives ``supported=False`` with a reason (never raises for a module of another kind).
    """
    name = type(module).__name__
    fp = (weights_fingerprint(module, extra=fingerprint_extra, exclude=fingerprint_exclude,
                              dtypes=fingerprint_dtypes) if isinstance(module, torch.nn.Module) else "")
    if name == "WanModel" and hasattr(module, "in_dim"):  # ComfyUI comfy.ldm.wan.model.WanModel
        num_layers, num_heads = int(module.num_layers), int(module.num_heads)
        head_dim = int(module.dim) // num_heads
        in_dim, out_dim = int(module.in_dim), int(module.out_dim)
        has_img = getattr(module, "img_emb", None) is not None
        extra_inputs = getattr(module, "ref_conv", None) is not None
    elif name == "WanTransformer3DModel" and hasattr(module, "config"):  # diffusers
        cfg = module.config
        num_layers, num_heads = int(cfg.num_layers), int(cfg.num_attention_heads)
        head_dim = int(cfg.attention_head_dim)
        in_dim, out_dim = int(cfg.in_channels), int(cfg.out_channels)
        has_img = getattr(cfg, "image_dim", None) is not None
        extra_inputs = False
    else:
        return ModelInfo("unknown", name, 0, 0, 0, 0, fp, False,
                         f"{name} is not a Wan diffusion model (Chorus II supports Wan 2.1 I2V, Wan 2.2 TI2V 5B, Wan 2.2 A14B I2V)")
    if extra_inputs:
        variant, reason = "wan-reference-latent", "Wan models with a reference-latent input are not supported"
    elif in_dim == 48 and out_dim == 48:
        variant, reason = "wan2.2-ti2v-5b", ""
    elif in_dim == 36 and has_img:
        variant, reason = "wan2.1-i2v", ""
    elif in_dim == 36:
        variant, reason = "wan2.2-a14b-i2v", ""
    else:
        variant = f"wan-in{in_dim}-out{out_dim}"
        reason = f"Wan model with in_dim={in_dim}, out_dim={out_dim} (text-to-video or a control variant) is not supported"
    return ModelInfo("wan", variant, num_layers, num_heads, head_dim, in_dim, fp, not reason, reason)


def token_grid(latent_shape, patch_size=PATCH_SIZE) -> tuple[int, int, int]:
    """Token grid ``(T', H', W')`` of a latent ``[C, T, H, W]`` or ``[B, C, T, H, W]``.

    ``T' = ceil(T / pt)``, ``H' = ceil(H / ph)``, ``W' = ceil(W / pw)`` (ComfyUI pads to the patch).
    Raises ``ValueError`` for anything that is not a 4- or 5-dim shape of positive ints.
    """
    shape = tuple(int(s) for s in latent_shape)
    if len(shape) == 5:
        shape = shape[1:]
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"latent shape must be [C, T, H, W] or [B, C, T, H, W] with positive sizes, got {tuple(latent_shape)}")
    _, t, h, w = shape
    pt, ph, pw = patch_size
    return (math.ceil(t / pt), math.ceil(h / ph), math.ceil(w / pw))


# Wan I2V models (in_dim 36) take [noise (16), mask (4), image latent (16)] channels, in ComfyUI and diffusers alike
I2V_IN_CHANNELS = 36
I2V_MASK_CHANNELS = slice(16, 20)


def image_frames(x: torch.Tensor, info: ModelInfo, timestep=None) -> tuple[int, int, int] | None:
    """Which latent frames of a Wan forward's input ``x`` ``[B, C, T, H, W]`` carry an input image, as
    ``(first, last, other)``: the number of leading frames, of trailing frames after those, and of any others.
    ``(1, 0, 0)``: image to video (a start image); ``(1, 1, 0)``: a start and an end image (ComfyUI's
    WanFirstLastFrameToVideo, diffusers' ``last_image``); ``(0, 0, 0)``: none. Entries record it and a hit needs
    the same (:func:`~chorus.engine.compat.image_frames_mismatch`): attention runs to the frames that hold an
    image, so a map recorded with one image does not fit a request with two. :func:`frames_summary` of
    :func:`image_frame_flags` (where each of the frames is read from); None where that is None. One host sync:
    ask it once per sampler run, not per forward."""
    flags = image_frame_flags(x, info, timestep)
    return None if flags is None else frames_summary(flags)


def image_frame_flags(x: torch.Tensor, info: ModelInfo, timestep=None) -> tuple[bool, ...] | None:
    """Per latent frame of a Wan forward's input ``x`` ``[B, C, T, H, W]``, whether it holds an input image
    (``T`` bools). Read from the I2V models' mask channels (``x[:, 16:20]``, :func:`mask_frame_flags`), and for
    Wan 2.2 TI2V 5B from the per-frame ``timestep`` (``[B, T]``, or per token ``[B, T * n]``): a frame whose
    timestep is 0 holds the image; one timestep per sample means none. None where this cannot be told (another
    variant, other shapes). One host sync."""
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or not info.supported:
        return None
    frames = int(x.shape[2])
    if info.in_dim == I2V_IN_CHANNELS and x.shape[1] == I2V_IN_CHANNELS:
        return mask_frame_flags(x[:, I2V_MASK_CHANNELS])
    if info.variant == "wan2.2-ti2v-5b":
        if not isinstance(timestep, torch.Tensor) or timestep.dim() > 2 or timestep.numel() == 0:
            return None
        if timestep.dim() < 2 or timestep.shape[1] == 1:
            return (False,) * frames
        if timestep.shape[1] % frames:
            return None
        return tuple(bool(h) for h in (timestep[:1].reshape(frames, -1)[:, 0] == 0).tolist())
    return None


def mask_frame_flags(mask: torch.Tensor) -> tuple[bool, ...]:
    """Per latent frame of Wan I2V's 4 mask channels ``[B, 4, T, H, W]`` (1 where the input holds an image, as
    ComfyUI's model concatenates them after the noise), whether the frame holds an image: any of its mask values
    (of the first sample) above 0.5 (an end image covers one of its frame's four). One host sync."""
    held = mask[:1].amax(dim=(0, 1, 3, 4)) > 0.5
    return tuple(bool(h) for h in held.tolist())


def frames_summary(flags) -> tuple[int, int, int]:
    """``(first, last, other)`` of per-frame image flags (:func:`image_frame_flags`): the leading frames that hold
    an image, the trailing ones after those, and the rest that do."""
    held = [bool(h) for h in flags]
    first = next((i for i, h in enumerate(held) if not h), len(held))
    last = next((i for i, h in enumerate(reversed(held[first:])) if not h), len(held) - first)
    return first, last, sum(held) - first - last


def ends_with_image(frames) -> bool:
    """Whether a ``(first, last, other)`` summary (:func:`frames_summary`) holds an end image (a trailing image
    frame: a first-last-frame request); False for None (not known)."""
    return frames is not None and int(frames[1]) >= 1


def frame_flags_of(frames, count: int) -> tuple[bool, ...] | None:
    """Per-frame image flags of ``count`` latent frames from a ``(first, last, other)`` summary
    (:func:`frames_summary`; ``other`` frames are not placed: their positions are not in it), or None for None."""
    if frames is None:
        return None
    first, last = min(int(frames[0]), count), int(frames[1])
    return tuple(i < first or i >= count - last for i in range(count))
