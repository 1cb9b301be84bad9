"""Model identity, token geometry and the compatibility signature of a cache entry.

A signature is a plain JSON-able dict (stored in ``meta["signature"]`` of an entry):

``{"format": 1, "family": "wan", "variant": str, "experts": [fingerprint, ...],
"num_layers": int, "num_heads": int, "latent_shape": [C, T, H, W], "token_grid": [T', H', W'],
"block_size": int, "token_order": str, "step_sigmas": [float, ...], "head_groups": 1}``

``token_order`` is the order of the tokens the entry's blocks were cut from: ``"thw"``
(:data:`TOKEN_ORDER`, raster: Wan's frame-major order after the 1x2x2 patchify; an entry without
the field is raster too), the name of a :class:`chorus.kernels.tile_order.TileOrder` of the
entry's token grid and block size (e.g. ``"tile2x8x8-f8x16-s"``) or of a
:class:`~chorus.kernels.tile_order.RegionTileOrder` (``"regions2x8x8"``: what a request with feature
reuse records, so that a hit can run self-attention on the compact sequence; :func:`entry_token_order`).

``experts`` lists the weights fingerprints of the models that sampled the request, in the order
they first sampled (Wan 2.2 A14B: high-noise expert first). ``step_sigmas`` is the sigma at the
start of every step of the whole request the model ran at (descending), so a step is identified by
its sigma. ``sampler_sigmas`` (only when the request's sampler had steps the model was not called
at, e.g. EasyCache skipped them) is the sampler's whole schedule: a hit must match it
(:func:`run_mismatch`), and runs the steps without maps dense.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .routing import match_step

SIGNATURE_FORMAT = 1
TOKEN_ORDER = "thw"  # the raster default: Wan's frame-major order after the 1x2x2 patchify
RASTER_ORDER_NAMES = (TOKEN_ORDER, "raster")
MAX_ORDER_TOKENS = 1 << 22  # a tile order is rebuilt from an entry's grid only up to this many tokens
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


def _sample_values(t: torch.Tensor, count: int = 64) -> bytes:
    if t.device.type == "meta" or t.numel() == 0:
        return b"meta"
    flat = t.detach().reshape(-1)
    stride = max(1, flat.numel() // count)
    vals = flat[::stride][:count].to(device="cpu", dtype=torch.float32)
    return vals.numpy().tobytes()


def weights_fingerprint(module: torch.nn.Module, extra: str = "", max_tensors: int = 8,
                        exclude: frozenset | set = frozenset()) -> str:
    """Cheap, stable fingerprint of a module's weights: 16 hex chars.

    Hashes every parameter's name and shape (the architecture) plus up to 64 strided values of up to
    ``max_tensors`` parameters chosen evenly among those outside attention / feed-forward linears
    (patch embedding, modulation, norms, head: tensors weight patches such as LoRAs rarely touch, so
    the value does not depend on whether a host has applied its patches yet). Parameters named in
    ``exclude`` (e.g. the keys a host patches in place when it loads the model) are never sampled;
    callers pass a description of such patches in ``extra``. Costs well under a millisecond per tensor.
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
            h.update(_sample_values(p))
    h.update(extra.encode())
    return h.hexdigest()[:16]


def wan_model_info(module: torch.nn.Module, *, fingerprint_extra: str = "",
                   fingerprint_exclude: frozenset | set = frozenset()) -> ModelInfo:
    """Identify a Wan diffusion model: ComfyUI's ``WanModel`` or diffusers' ``WanTransformer3DModel``.

    Supported: Wan 2.1 I2V (in_dim 36 with a CLIP image projection), Wan 2.2 TI2V 5B (48 latent
    channels), Wan 2.2 A14B I2V (in_dim 36, no image projection; one ModelInfo per expert). Any other
    module gives ``supported=False`` with a reason (never raises for a module of another kind).
    """
    name = type(module).__name__
    fp = (weights_fingerprint(module, extra=fingerprint_extra, exclude=fingerprint_exclude)
          if isinstance(module, torch.nn.Module) else "")
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


def token_order_name(order) -> str:
    """What a signature records for an order: :data:`TOKEN_ORDER` for raster (None), else the
    order's name."""
    return TOKEN_ORDER if order is None else order.name


def region_order_for(grid, region, block_size: int):
    """The :class:`~chorus.kernels.tile_order.RegionTileOrder` of a grid whose tiles are feature
    reuse's ``region`` (``rt * rh * rw == block_size``), or None when the region is not one block."""
    from ..kernels.tile_order import cached_region_order

    region = tuple(int(r) for r in region)
    if len(region) != 3 or math.prod(region) != int(block_size):
        return None
    return cached_region_order(tuple(int(g) for g in grid), region, int(block_size))


def entry_token_order(entry_signature: dict):
    """The order an entry's blocks are in: None (raster: ``"thw"``, ``"raster"`` or no field), or the
    :class:`~chorus.kernels.tile_order.TileOrder` / :class:`~chorus.kernels.tile_order.RegionTileOrder`
    of the entry's token grid and block size whose name the entry records. Raises ``ValueError`` for
    any other value (an order this code cannot rebuild is never guessed: the entry is unusable rather
    than misread)."""
    from ..kernels.tile_order import cached_tile_order

    name = entry_signature.get("token_order", TOKEN_ORDER)
    if isinstance(name, str) and name in RASTER_ORDER_NAMES:
        return None
    if not isinstance(name, str) or not name.startswith(("tile", "regions")):
        raise ValueError(f"unknown token order {name!r}")
    grid = tuple(int(g) for g in entry_signature["token_grid"])
    block_size = int(entry_signature["block_size"])
    if len(grid) != 3 or min(grid) < 1 or math.prod(grid) > MAX_ORDER_TOKENS or block_size < 1:
        raise ValueError(f"token grid {grid} / block size {block_size} of a tile-order entry is out of range")
    if name.startswith("regions"):
        try:
            region = tuple(int(r) for r in name[len("regions"):].split("x"))
        except ValueError:
            raise ValueError(f"unknown token order {name!r}") from None
        order = region_order_for(grid, region, block_size) if len(region) == 3 and min(region) >= 1 else None
        if order is None or order.name != name:
            raise ValueError(f"token order {name!r} does not fit block size {block_size}")
        return order
    for serpentine in (True, False):
        order = cached_tile_order(grid, block_size, serpentine)
        if order.name == name:
            return order
    raise ValueError(f"token order {name!r} is not the tile order this version builds for grid {grid} "
                     f"and block size {block_size}")


def model_mismatch(entry_signature, info: ModelInfo) -> str | None:
    """Why an entry (its signature) cannot serve this model, or None: another variant, other layer /
    head counts, or weights whose fingerprint is not among the entry's experts. A damaged signature
    is a reason too (never raises)."""
    try:
        if entry_signature.get("variant") != info.variant:
            return f"entry made for {entry_signature.get('variant')}, this model is {info.variant}"
        if int(entry_signature.get("num_layers", -1)) != info.num_layers \
                or int(entry_signature.get("num_heads", -1)) != info.num_heads:
            return "entry made for a model with other layer/head counts"
        experts = entry_signature.get("experts")
        if not isinstance(experts, list) or info.fingerprint not in experts:
            return f"plan made for another model (weights fingerprint {info.fingerprint} not in the entry)"
    except (TypeError, ValueError, AttributeError) as exc:  # a hostile or damaged signature
        return f"entry signature unreadable ({type(exc).__name__}: {exc})"
    return None


def entry_sampler_sigmas(entry_signature) -> list[float]:
    """The sampler schedule an entry serves: its ``sampler_sigmas`` when its request skipped steps (a
    step cache such as EasyCache), else its ``step_sigmas``. Raises ``TypeError`` / ``ValueError`` /
    ``AttributeError`` for a damaged signature."""
    return [float(s) for s in entry_signature.get("sampler_sigmas", entry_signature.get("step_sigmas", []))]


def run_mismatch(entry_signature, run_starts=None, block_size: int | None = None) -> str | None:
    """Why an entry (its signature) cannot serve a sampler run, or None: another block size, or a step
    of the run (``run_starts``: the sigmas its steps start at) that is not one of the entry's sampler
    steps (matched by value, :func:`~chorus.engine.routing.match_step`; :func:`entry_sampler_sigmas`:
    a step the entry's request skipped then runs dense). Never raises."""
    try:
        if block_size is not None and entry_signature.get("block_size") != block_size:
            return f"entry block size {entry_signature.get('block_size')} differs from {block_size}"
        if run_starts:
            schedule = entry_sampler_sigmas(entry_signature)
            missing = [s for s in run_starts if match_step(s, schedule) is None]
            if missing:
                return (f"step schedule differs from the entry's (sigma {missing[0]:.4g} not in "
                        f"{[round(s, 4) for s in schedule]})")
    except (TypeError, ValueError, AttributeError) as exc:  # a hostile or damaged signature
        return f"entry signature unreadable ({type(exc).__name__}: {exc})"
    return None


def latent_compatibility(entry_signature: dict, latent_shape) -> tuple[str, str]:
    """Can an entry's masks serve a latent of this shape?

    Returns ``("same", "")``, ``("resample", why)`` (same channels and aspect, another token grid:
    masks are resampled in 3D block coordinates) or ``("incompatible", why)``.

    Token order (:func:`entry_token_order`): an entry in any order this version rebuilds is served
    in its own order (the engine runs attention on the tokens in that order: exact); resampling to
    another grid works in raster order only, so a tile- or region-order entry of another grid is
    incompatible (a miss, never misread), as is an order that cannot be rebuilt.
    """
    from ..kernels import aspect_matches

    try:
        if int(entry_signature.get("format", -1)) != SIGNATURE_FORMAT:
            return "incompatible", f"entry signature format {entry_signature.get('format')!r} is not {SIGNATURE_FORMAT}"
        order = entry_token_order(entry_signature)
        shape = tuple(int(s) for s in latent_shape)[-4:]
        e_shape = tuple(int(s) for s in entry_signature["latent_shape"])
        if shape == e_shape:
            return "same", ""
        if order is not None:
            return "incompatible", (f"entry in token order {order.name} for latent {list(e_shape)}: its maps are "
                                    "resampled to other grids in raster order only")
        if shape[0] != e_shape[0]:
            return "incompatible", f"latent has {shape[0]} channels, entry {e_shape[0]} (another model family)"
        src, dst = tuple(entry_signature["token_grid"]), token_grid(shape)
        if aspect_matches(src, dst):
            return "resample", f"token grid {dst} differs from the entry's {src} with the same aspect: masks resampled"
        return "incompatible", f"latent {list(shape)} has another aspect than the entry's {list(e_shape)}"
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return "incompatible", f"entry signature unreadable ({type(e).__name__}: {e})"
