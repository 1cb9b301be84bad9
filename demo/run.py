"""``chorus demo``: a stream of similar and unrelated I2V requests through the engine.

What it runs (CPU; 1-2 minutes with the defaults on a 2-core machine that is not busy with other jobs):

* **Requests** from three templates built on scikit-image's sample images (astronaut, chelsea the
  cat, coffee), each with controlled changes (a shifted crop, a brightness/contrast change, a
  rewording of the prompt), plus unrelated requests (rocket, camera man, with other prompts).
* **Model**: a tiny Wan 2.2 A14B-shaped I2V model with random weights (two experts, high-noise
  then low-noise, 2 + 2 flow-matching Euler steps, cfg 1): diffusers' ``WanTransformer3DModel``,
  or ComfyUI's ``WanModel`` when ``comfy`` is importable (run from a ComfyUI folder or with
  ``PYTHONPATH=<ComfyUI>``; ``--model comfy`` forces it, ``--model diffusers`` the other).
  A randomly initialised Wan attends almost uniformly, which says nothing about reuse; by default
  (``--attention structured``) each self-attention's q/k biases are set to one shared random
  vector so that, after RoPE, attention prefers nearby positions in (t, h, w) — the 3D-local
  structure trained video DiTs show — on top of the random content part. Every line of output
  says which attention source ran. ``--attention random`` keeps the plain random init.
* **Engine**: per request ``retrieve_plan`` (joint text+image embedding of the start image and the
  prompt, ``chorus.cache_store.embedders.HashEmbedder``) against a ``chorus.cache_store.Workspace``;
  one ``ChorusAttention`` per expert sharing the plan; sampling; ``commit_plan``.
* **Printed per request**: hit/miss, similarity to the best entry, density of the blocks computed,
  attention error against dense attention on the same q/k/v (relative L2, mean and max over calls),
  and the PSNR of the request's frames against a dense run of the same request (hits only).
* **Saved**: the start image and the decoded frames of each request as PNG under ``--out``
  (default ``./chorus_demo_out``): ``req_NN_<template>_<hit|miss>/frame_KK.png``, and for a hit
  ``mask_preview.png`` (the reused masks as the nodes' heatmap). The "VAE" is a
  fixed, invertible pixel <-> latent packing (no weights), and the denoiser's clean-latent estimate is
  the start image's latent on every frame (a still-video prior) plus the random transformer's output
  (see :func:`sample`): the frames show the start image with what the random model adds, not a
  trained video; sparse attention changes only the added part.

Library use: :func:`run_demo` returns one :class:`RequestResult` per request; :func:`serve_request` is one
request's path (retrieve, patch, sample, commit, save).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..cache_store import Workspace
from ..cache_store.cli import OneLineErrorParser
from ..cache_store.embedders import HashEmbedder
from ..engine import (BACKENDS, AttnCall, ChorusAttention, SparseConfig, commit_plan, mask_heatmap, retrieve_plan,
                      wan_model_info)
from ..engine.model_info import token_grid
from ..hosts.diffusers import patch_diffusers_wan
from ..kernels.reference import expand_block_map

LATENT_CHANNELS = 16
PIXELS_PER_LATENT = 8  # the pseudo-VAE: 8x8 pixels per latent position
TEXT_DIM = 64
TEXT_TOKENS = 24
MODEL_GAIN = 0.25  # RMS of the random model's part of x0 (the start image latent has RMS ~0.5)
STRUCTURE_GAIN = 4.0  # logit gain of the structured attention: ~50% of blocks kept at top_p 0.9 here

# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------

TEMPLATES = {
    "astronaut": ("astronaut", "An astronaut in a white suit waves at the camera, slow zoom in, studio light"),
    "cat": ("chelsea", "A tabby cat turns its head and blinks, soft window light, shallow depth of field"),
    "coffee": ("coffee", "Steam rises from a cup of coffee on a saucer, the camera pans slowly to the right"),
}
UNRELATED = {
    "rocket": ("rocket", "A rocket lifts off the launch pad in a cloud of smoke and fire at dawn"),
    "cameraman": ("camera", "Black and white film: a photographer adjusts his tripod in an empty park"),
}
# Controlled changes of a template request: (name, crop shift (dy, dx) as a fraction of the image
# side, gain, prompt suffix).
VARIANTS = (
    ("original", (0.0, 0.0), 1.00, ""),
    ("shifted crop, brighter", (0.047, -0.039), 1.10, ""),
    ("shifted crop, darker, reworded", (-0.031, 0.055), 0.90, " gently"),
)
# The default stream: (kind, name, variant index). Similar requests come back; unrelated ones don't.
DEFAULT_STREAM = (
    ("template", "astronaut", 0), ("template", "cat", 0), ("template", "astronaut", 1),
    ("template", "coffee", 0), ("template", "cat", 1), ("unrelated", "rocket", 0),
    ("template", "astronaut", 2), ("template", "coffee", 1), ("template", "cat", 2),
    ("unrelated", "cameraman", 0), ("template", "coffee", 2), ("template", "astronaut", 1),
)


@dataclass
class Request:
    """One I2V request: start image ``[H, W, 3]`` float in [0, 1] and a prompt."""

    index: int
    kind: str  # "template" | "unrelated"
    name: str
    variant: str
    image: np.ndarray
    prompt: str


def _sample_image(skimage_name: str, size: int, shift=(0.0, 0.0), gain: float = 1.0) -> np.ndarray:
    """A scikit-image sample image: centre square crop moved by ``shift`` (fractions of the crop
    side), resized to ``size`` x ``size``, times ``gain``, clipped to [0, 1]."""
    try:
        from skimage import data
    except ImportError as exc:
        raise ValueError("the demo's start images come from scikit-image's bundled samples: "
                         "pip install scikit-image (or pip install -e '.[dev]')") from exc

    img = getattr(data, skimage_name)()
    img = img.astype(np.float32) / 255.0
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=-1)
    img = img[..., :3]
    h, w = img.shape[:2]
    side = int(min(h, w) * 0.85)
    top = int(np.clip((h - side) // 2 + round(shift[0] * side), 0, h - side))
    left = int(np.clip((w - side) // 2 + round(shift[1] * side), 0, w - side))
    crop = torch.from_numpy(np.ascontiguousarray(img[top:top + side, left:left + side])).permute(2, 0, 1)[None]
    small = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return (small[0].permute(1, 2, 0).numpy() * gain).clip(0.0, 1.0)


def build_requests(num_requests: int | None = None, size: int = 256, stream=DEFAULT_STREAM) -> list[Request]:
    """The request stream (``num_requests`` first items of ``stream``, all of it when None)."""
    stream = list(stream)[: (len(stream) if num_requests is None else int(num_requests))]
    out = []
    for i, (kind, name, v) in enumerate(stream):
        skimage_name, prompt = (TEMPLATES if kind == "template" else UNRELATED)[name]
        vname, shift, gain, suffix = VARIANTS[v]
        out.append(Request(i, kind, name, vname, _sample_image(skimage_name, size, shift, gain), prompt + suffix))
    return out


# --------------------------------------------------------------------------------------------
# Pseudo-VAE and text conditioning (no weights: fixed, deterministic maps)
# --------------------------------------------------------------------------------------------

def encode_image(image: np.ndarray) -> torch.Tensor:
    """``[H, W, 3]`` in [0, 1] -> latent ``[16, H/8, W/8]``: per latent position, the 2x2 Haar
    coefficients of the 4x4-pooled colours (12 channels, centred) and 4 zero channels."""
    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float() * 2 - 1
    pooled = F.avg_pool2d(x, 4)  # [1, 3, H/4, W/4]
    a, b = pooled[..., 0::2, 0::2], pooled[..., 0::2, 1::2]
    c, d = pooled[..., 1::2, 0::2], pooled[..., 1::2, 1::2]
    haar = torch.cat([(a + b + c + d) / 2, (a - b + c - d) / 2, (a + b - c - d) / 2, (a - b - c + d) / 2], 1)
    zeros = torch.zeros(1, LATENT_CHANNELS - haar.shape[1], *haar.shape[-2:])
    return torch.cat([haar, zeros], 1)[0]


def decode_latent(latent: torch.Tensor) -> np.ndarray:
    """Inverse of :func:`encode_image` for one latent frame ``[16, h, w]`` -> uint8 ``[8h, 8w, 3]``."""
    z = latent[None, :12].float()
    s, hx, vy, dd = z[:, 0:3], z[:, 3:6], z[:, 6:9], z[:, 9:12]
    a, b = (s + hx + vy + dd) / 2, (s - hx + vy - dd) / 2
    c, d = (s + hx - vy - dd) / 2, (s - hx - vy + dd) / 2
    h, w = z.shape[-2:]
    pooled = torch.empty(1, 3, 2 * h, 2 * w)
    pooled[..., 0::2, 0::2], pooled[..., 0::2, 1::2], pooled[..., 1::2, 0::2], pooled[..., 1::2, 1::2] = a, b, c, d
    img = F.interpolate(pooled, scale_factor=4, mode="nearest")[0].permute(1, 2, 0)
    return ((img.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()


def text_conditioning(prompt: str, tokens: int = TEXT_TOKENS, dim: int = TEXT_DIM) -> torch.Tensor:
    """Stand-in for a text encoder: one fixed random vector per word (seeded by its crc32), ``[1, tokens, dim]``."""
    words = prompt.lower().replace(",", " ").replace(".", " ").split()[:tokens]
    out = torch.zeros(1, tokens, dim)
    for i, word in enumerate(words):
        gen = torch.Generator().manual_seed(zlib.crc32(word.encode()))
        out[0, i] = torch.randn(dim, generator=gen)
    return out


# --------------------------------------------------------------------------------------------
# Tiny Wan models
# --------------------------------------------------------------------------------------------

def _structure_attention(attns, seed: int, gain: float = STRUCTURE_GAIN) -> None:
    """Give each self-attention ``(q_linear, k_linear, norm_q, norm_k)`` 3D-local structure (module docstring).

    q and k biases become one shared random vector per layer, so after the RMS norm q ~ k ~ c and,
    with RoPE, the logit q_m . k_n is a sum of cosines of the position difference, largest at 0:
    attention prefers nearby (t, h, w). The random weights stay as the content part. The norms'
    weights are scaled by sqrt(``gain``), which multiplies the logits by ``gain`` (sharper attention).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q_lin, k_lin, norm_q, norm_k in attns:
            shared = torch.randn(q_lin.bias.shape[0], generator=gen).abs() + 0.5
            q_lin.bias.copy_(shared)
            k_lin.bias.copy_(shared)
            norm_q.weight.mul_(math.sqrt(gain))
            norm_k.weight.mul_(math.sqrt(gain))


def _init_all(module: torch.nn.Module, seed: int) -> None:
    """Every weight explicitly: linears/convs N(0, 0.02) (ComfyUI's ops skip init), norms 1, biases 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("modulation") or "scale_shift" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.zero_()


class DiffusersWanHost:
    """Two tiny diffusers ``WanTransformer3DModel`` experts and the calls the demo needs."""

    name = "diffusers WanTransformer3DModel"

    def __init__(self, layers: int, heads: int, attention: str, seed: int):
        from diffusers import WanTransformer3DModel

        self.experts = []
        for e in range(2):
            model = WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128, in_channels=36,
                out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=256, ffn_dim=256 * heads,
                num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                image_dim=None, rope_max_seq_len=1024).eval()
            _init_all(model, seed + 101 * e)
            if attention == "structured":
                _structure_attention([(b.attn1.to_q, b.attn1.to_k, b.attn1.norm_q, b.attn1.norm_k)
                                      for b in model.blocks], seed + 7 + e)
            self.experts.append(model)
        self._patches = []

    def patch(self, expert: int, handle) -> None:
        self._patches.append(patch_diffusers_wan(self.experts[expert], handle))

    def unpatch(self) -> None:
        while self._patches:
            self._patches.pop().remove()

    @torch.no_grad()
    def velocity(self, expert: int, x: torch.Tensor, sigma: float, context: torch.Tensor) -> torch.Tensor:
        t = torch.tensor([sigma * 1000.0])
        return self.experts[expert](hidden_states=x, timestep=t, encoder_hidden_states=context,
                                    return_dict=False)[0]


class ComfyWanHost:
    """Two tiny ComfyUI ``WanModel`` experts; self-attention routed through ``optimized_attention_override``.

    Needs ``comfy`` importable (ComfyUI folder on the path). The override receives ComfyUI's
    ``[B, L, heads * head_dim]`` q/k/v; self-attention (q and k of equal length) goes to the
    expert's handle as ``[B, H, L, D]``, with the layer counted per forward; cross-attention goes to
    ComfyUI's own function untouched.
    """

    name = "ComfyUI WanModel"

    def __init__(self, layers: int, heads: int, attention: str, seed: int):
        import comfy.cli_args

        if not torch.cuda.is_available():
            comfy.cli_args.args.cpu = True
        import comfy.ops
        from comfy.ldm.wan.model import WanModel

        self.experts = []
        for e in range(2):
            model = WanModel(model_type="t2v", in_dim=36, dim=128 * heads, ffn_dim=256 * heads, text_dim=TEXT_DIM,
                             text_len=TEXT_TOKENS, out_dim=LATENT_CHANNELS, num_heads=heads, num_layers=layers,
                             operations=comfy.ops.disable_weight_init).eval()
            _init_all(model, seed + 101 * e)
            if attention == "structured":
                _structure_attention([(b.self_attn.q, b.self_attn.k, b.self_attn.norm_q, b.self_attn.norm_k)
                                      for b in model.blocks], seed + 7 + e)
            self.experts.append(model)
        self.handles = [None, None]
        self._grid = None
        self._sigma = None
        self._layer = 0

    def patch(self, expert: int, handle) -> None:
        self.handles[expert] = handle

    def unpatch(self) -> None:
        self.handles = [None, None]

    def _override(self, expert):
        def override(func, q, k, v, heads, *args, **kwargs):
            handle = self.handles[expert]
            if handle is None or q.shape[1] != k.shape[1] or kwargs.get("skip_reshape") or kwargs.get("mask") is not None:
                return func(q, k, v, heads, *args, **kwargs)
            b, length, inner = q.shape
            d = inner // heads
            layer = self._layer
            self._layer += 1

            def dense(q4, k4, v4):
                return func(q4, k4, v4, heads, *args, **{**kwargs, "skip_reshape": True, "skip_output_reshape": True})

            q4, k4, v4 = (t.view(b, length, heads, d).transpose(1, 2) for t in (q, k, v))
            out = handle.self_attention(q4, k4, v4, layer=layer, sigma=self._sigma, grid=self._grid, dense_fn=dense)
            return out.transpose(1, 2).reshape(b, length, inner)

        return override

    @torch.no_grad()
    def velocity(self, expert: int, x: torch.Tensor, sigma: float, context: torch.Tensor) -> torch.Tensor:
        _, _, t, h, w = x.shape
        self._grid, self._sigma, self._layer = (t, math.ceil(h / 2), math.ceil(w / 2)), sigma, 0
        options = {"optimized_attention_override": self._override(expert)}
        return self.experts[expert](x, torch.tensor([sigma * 1000.0]), context, transformer_options=options)


def comfy_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("comfy") is not None and importlib.util.find_spec("comfy.ldm") is not None
    except (ImportError, ValueError):
        return False


def make_host(kind: str, layers: int, heads: int, attention: str, seed: int):
    if kind == "auto":
        kind = "comfy" if comfy_importable() else "diffusers"
    if kind == "comfy":
        if not comfy_importable():
            raise ValueError("--model comfy: ComfyUI's 'comfy' package is not importable "
                             "(run from the ComfyUI folder or set PYTHONPATH to it)")
        return ComfyWanHost(layers, heads, attention, seed)
    if kind == "diffusers":
        try:
            importlib.import_module("diffusers")  # the demo extra
        except ImportError as exc:
            raise ValueError(f"--model diffusers needs diffusers ({exc}): pip install -e '.[demo]'") from None
        return DiffusersWanHost(layers, heads, attention, seed)
    raise ValueError(f"--model must be auto, diffusers or comfy, got {kind!r}")


# --------------------------------------------------------------------------------------------
# Sampling with the engine
# --------------------------------------------------------------------------------------------

def flow_sigmas(steps: int, shift: float) -> list[float]:
    """Wan's shifted flow-matching schedule: ``shift*s / (1 + (shift-1)*s)`` for s = 1 .. 0."""
    s = np.linspace(1.0, 0.0, steps + 1)
    return [float(shift * x / (1 + (shift - 1) * x)) for x in s]


class DenseErrorProbe:
    """Wraps a ``ChorusAttention`` handle to measure what a hit costs in attention accuracy.

    On every call of a hit it also computes, on the same q/k/v, the host's dense attention and a
    block-sparse attention with a *random* map of the same kept-block count per row (diagonal kept;
    seeded), and appends the relative L2 errors ``|out - dense| / |dense|`` to ``errors`` and
    ``random_errors``: a reused mask is useful only if it beats a random one of the same density.
    """

    def __init__(self, handle: ChorusAttention, errors: list, random_errors: list, seed: int = 0):
        self.handle, self.errors, self.random_errors = handle, errors, random_errors
        self.gen = torch.Generator().manual_seed(seed)

    def attend(self, call: AttnCall):
        out = self.handle.attend(call)
        if self.handle.plan.is_hit:
            q, k, v = call.q, call.k, call.v
            ref = (call.dense_fn or F.scaled_dot_product_attention)(q, k, v).float()
            norm = ref.norm().clamp_min(1e-30)
            self.errors.append(float((out.float() - ref).norm() / norm))
            # The map this call used (stored map + k_min floor + refresh), at the run's current step.
            used = self.handle.used_map(self.handle.current_step, int(call.layer))
            if used is not None:
                rand = self._random_like(used)
                token_mask = expand_block_map(rand, q.shape[-2], k.shape[-2], self.handle.config.block_size)
                other = F.scaled_dot_product_attention(q, k, v, attn_mask=token_mask)
                self.random_errors.append(float((other.float() - ref).norm() / norm))
        return out

    def self_attention(self, q, k, v, **kwargs):
        return self.attend(AttnCall(q, k, v, **kwargs))

    def _random_like(self, block_map: torch.Tensor) -> torch.Tensor:
        """Random bool map with the same number of kept blocks in every row as ``block_map``, diagonal kept."""
        num_q, num_kv = block_map.shape[-2:]
        counts = block_map.sum(-1, keepdim=True)
        scores = torch.rand(block_map.shape, generator=self.gen)
        idx = torch.arange(min(num_q, num_kv))
        scores[..., idx, idx] = 2.0  # the diagonal first, as every reused map keeps it
        rank = scores.argsort(-1, descending=True).argsort(-1)
        return rank < counts

    def __getattr__(self, name):
        return getattr(self.handle, name)


def sample(host, latent_shape, cond_y: torch.Tensor, context: torch.Tensor, sigmas: list[float],
           switch_step: int, seed: int, handles=None, prior: torch.Tensor | None = None,
           model_gain: float = MODEL_GAIN) -> torch.Tensor:
    """Euler flow-matching sampling from seeded noise; steps ``< switch_step`` on expert 0 (high
    noise), the rest on expert 1. ``handles``: per expert, an object with ``begin_run``/``end_run``
    (None: unpatched, dense).

    The denoiser's clean-latent estimate is ``x0 = prior + model_gain * out / rms0``: ``prior`` (the
    start image's latent on every frame, a still-video prior; zeros when None) plus the transformer
    output ``out`` scaled by the RMS ``rms0`` of its first output in this run (a random model's raw
    output is tiny). The flow velocity is ``(x - x0) / sigma``, so the result is that ``x0`` at the
    last step: the start image plus what the random model adds, and attention changes only the added
    part. Returns the latent ``[C, T, h, w]``.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((1, *latent_shape), generator=gen)
    base = torch.zeros_like(x) if prior is None else prior.expand_as(x)
    rms0 = None
    segments = ((0, 0, switch_step), (1, switch_step, len(sigmas) - 1))
    for expert, start, end in segments:
        if start >= end:
            continue
        if handles is not None:
            handles[expert].begin_run(sample_sigmas=sigmas[start:end + 1])
        try:
            for i in range(start, end):
                out = host.velocity(expert, torch.cat([x, cond_y], 1), sigmas[i], context).float()
                if rms0 is None:
                    rms0 = out.pow(2).mean().sqrt().clamp_min(1e-12)
                x0 = base + model_gain * out / rms0
                x = x + (sigmas[i + 1] - sigmas[i]) * (x - x0) / sigmas[i]
        finally:
            if handles is not None:
                handles[expert].end_run()
    return x[0]


def i2v_condition(image: np.ndarray, frames: int) -> torch.Tensor:
    """Wan I2V channel condition ``[1, 20, T, h, w]``: 4 mask channels (1 on the first latent frame)
    and the start image's latent on the first frame (zeros elsewhere)."""
    z = encode_image(image)
    cond = torch.zeros(1, 20, frames, *z.shape[-2:])
    cond[0, :4, 0] = 1.0
    cond[0, 4:, 0] = z
    return cond


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


@dataclass
class RequestResult:
    index: int
    kind: str
    name: str
    variant: str
    hit: bool
    similarity: float | None
    density: float | None
    attn_err_mean: float | None
    attn_err_max: float | None
    random_mask_err: float | None
    psnr_vs_dense: float | None
    committed: str
    seconds: float
    frame_dir: str
    messages: list = field(default_factory=list)


def _save_frames(directory: str, start_image: np.ndarray, latent: torch.Tensor) -> list[np.ndarray]:
    from PIL import Image

    os.makedirs(directory, exist_ok=True)
    Image.fromarray((start_image * 255).round().astype(np.uint8)).save(os.path.join(directory, "start_image.png"))
    frames = [decode_latent(latent[:, t]) for t in range(latent.shape[1])]
    for t, frame in enumerate(frames):
        Image.fromarray(frame).save(os.path.join(directory, f"frame_{t:02d}.png"))
    return frames


def _save_mask_preview(directory: str, plan) -> None:
    """``mask_preview.png``: the reused masks as the nodes' heatmap (query blocks down, key blocks
    across; bright = kept in many layers/steps/heads)."""
    from PIL import Image

    heat = mask_heatmap(list(plan.masks.values()))[0]
    Image.fromarray((heat.numpy() * 255).round().astype(np.uint8)).save(os.path.join(directory, "mask_preview.png"))


@dataclass(frozen=True)
class DemoSetting:
    """What every request of one demo run shares: the host (two experts), the embedder, the sparse config, the
    latent shape ``(C, T, H, W)``, the flow sigmas and steps (split over the two experts), the similarity
    threshold, the seed, where frames go and whether a hit is also sampled dense for its PSNR."""

    host: object
    embedder: HashEmbedder
    config: SparseConfig
    latent_shape: tuple
    sigmas: list
    steps: int
    threshold: float
    seed: int
    out_dir: str
    compare_dense: bool


def serve_request(ws: Workspace, req: Request, setting: DemoSetting) -> RequestResult:
    """One request through the engine, each step once: retrieve a plan from ``ws``, patch both experts with
    ``ChorusAttention`` (each call also measured against dense attention), sample, commit the plan (a miss
    writes its entry), save the frames (and a hit's mask preview), and for a hit with ``compare_dense`` sample
    the request dense for the PSNR of its frames."""
    host, latent_shape, steps, seed = setting.host, setting.latent_shape, setting.steps, setting.seed
    latent_frames = latent_shape[1]
    t0 = time.perf_counter()
    context = text_conditioning(req.prompt)
    cond_y = i2v_condition(req.image, latent_frames)
    prior = cond_y[:, 4:4 + LATENT_CHANNELS, :1]  # the start image latent, first frame
    embedding = setting.embedder.embed(image=torch.from_numpy(req.image)[None], text=req.prompt)
    plan = retrieve_plan(ws, embedding, latent_shape, similarity_threshold=setting.threshold,
                         request_meta={"prompt": req.prompt, "template": req.name})
    # The similarity of the best entry, shown for misses too.
    best = ws.search(embedding, k=1) if len(ws) else []
    similarity = plan.similarity if plan.is_hit else (float(best[0][1]) if best else None)
    errors: list[float] = []
    random_errors: list[float] = []
    handles = []
    for e in range(2):
        info = wan_model_info(host.experts[e])
        handles.append(DenseErrorProbe(ChorusAttention(plan, setting.config, info), errors, random_errors,
                                       seed=seed + 1000 * req.index + e))
        host.patch(e, handles[-1])
    try:
        latent = sample(host, latent_shape, cond_y, context, setting.sigmas, steps // 2, seed + req.index, handles,
                        prior=prior)
    finally:
        host.unpatch()
    message = commit_plan(ws, plan)
    hit = plan.is_hit
    frame_dir = os.path.join(setting.out_dir, f"req_{req.index:02d}_{req.name}_{'hit' if hit else 'miss'}")
    made = _save_frames(frame_dir, req.image, latent)
    if hit:
        _save_mask_preview(frame_dir, plan)
    quality = None
    if hit and setting.compare_dense:
        dense = sample(host, latent_shape, cond_y, context, setting.sigmas, steps // 2, seed + req.index, None,
                       prior=prior)
        quality = float(np.mean([psnr(a, decode_latent(dense[:, t])) for t, a in enumerate(made)]))
    return RequestResult(req.index, req.kind, req.name, req.variant, hit, similarity,
                         plan.stats.density if hit else None,
                         float(np.mean(errors)) if errors else None, max(errors) if errors else None,
                         float(np.mean(random_errors)) if random_errors else None, quality, message,
                         time.perf_counter() - t0, frame_dir, list(plan.stats.messages))


def run_demo(*, num_requests: int | None = None, out_dir: str = "chorus_demo_out", workspace_dir: str | None = None,
             model: str = "auto", attention: str = "structured", size: int = 256, frames: int = 17,
             layers: int = 2, heads: int = 2, steps: int = 4, shift: float = 5.0, threshold: float = 0.9,
             top_p: float = 0.9, k_min: int = 2, block_size: int = 64, backend: str = "auto", seed: int = 0,
             compare_dense: bool = True, log=print) -> list[RequestResult]:
    """Run the request stream; print one line per request through ``log``; return the results.

    ``size``: start-image side in pixels (multiple of 16); ``frames``: video frames (4n+1; latent
    frames = (frames-1)/4 + 1). Raises ``ValueError`` for bad sizes or options.
    """
    if size % 16 or size < 32:
        raise ValueError(f"size must be a multiple of 16 and >= 32, got {size}")
    if frames < 1 or (frames - 1) % 4:
        raise ValueError(f"frames must be 4n+1, got {frames}")
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (split over two experts), got {steps}")
    if layers < 1 or heads < 1:
        raise ValueError(f"layers and heads must be >= 1, got {layers} and {heads}")
    if attention not in ("structured", "random"):
        raise ValueError(f"attention must be 'structured' or 'random', got {attention!r}")
    if num_requests is not None and not (1 <= int(num_requests) <= len(DEFAULT_STREAM)):
        raise ValueError(f"requests must be between 1 and {len(DEFAULT_STREAM)}, got {num_requests}")
    if not 0.0 <= float(threshold) <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    torch.manual_seed(seed)
    requests = build_requests(num_requests, size)
    latent_frames = (frames - 1) // 4 + 1
    latent_shape = (LATENT_CHANNELS, latent_frames, size // PIXELS_PER_LATENT, size // PIXELS_PER_LATENT)
    host = make_host(model, layers, heads, attention, seed)
    config = SparseConfig(top_p=top_p, k_min=k_min, refresh_steps=0, backend=backend, block_size=block_size)
    sigmas = flow_sigmas(steps, shift)
    embedder = HashEmbedder(text_weight=0.5)
    tmp_ws = None
    if workspace_dir is None:
        tmp_ws = tempfile.TemporaryDirectory(prefix="chorus_demo_ws_")
        workspace_dir = tmp_ws.name
    setting = DemoSetting(host, embedder, config, latent_shape, sigmas, steps, threshold, seed, out_dir,
                          compare_dense)
    grid = token_grid(latent_shape)
    tokens = grid[0] * grid[1] * grid[2]
    source = ("random weights, q/k biased toward RoPE-positional (3D-local) structure" if attention == "structured"
              else "random weights (nearly uniform attention)")
    log(f"Chorus II demo: {len(requests)} requests; model: tiny Wan 2.2 A14B-shaped I2V ({host.name}, "
        f"2 experts x {layers} layers x {heads} heads, {steps} steps = {steps // 2}+{steps - steps // 2}, cfg 1)")
    log(f"  attention source: {source}; latent {list(latent_shape)} -> {tokens} tokens, "
        f"block size {block_size} ({math.ceil(tokens / block_size)} blocks per row); threshold {threshold}, "
        f"top_p {top_p}, k_min {k_min}; embedder {embedder.name}")
    log(f"  workspace: {workspace_dir}; frames -> {os.path.abspath(out_dir)}")
    header = (f"{'req':>3}  {'template':<10} {'variant':<31} {'result':<5} {'similarity':>10} {'density':>8} "
              f"{'attn err mean/max':>18} {'random mask':>11} {'PSNR vs dense':>13} {'time':>6}")
    log(header)
    results = []
    os.makedirs(out_dir, exist_ok=True)
    try:
        with Workspace.open(workspace_dir) as ws:
            for req in requests:
                res = serve_request(ws, req, setting)
                results.append(res)
                log(_format_line(res))
                for note in res.messages:
                    log(f"       note: {note}")
            stats = ws.stats()
    finally:
        if tmp_ws is not None:
            tmp_ws.cleanup()
    hits = [r for r in results if r.hit]
    log(f"summary: {len(hits)} hits / {len(results)} requests; "
        + (f"mean density on hits {np.mean([r.density for r in hits if r.density is not None]):.1%}, "
           f"mean attention error {np.mean([r.attn_err_mean for r in hits if r.attn_err_mean is not None]):.2e} "
           f"(random masks of the same density: "
           f"{np.mean([r.random_mask_err for r in hits if r.random_mask_err is not None]):.2e}); "
           if hits else "")
        + f"workspace entries: {stats.get('entries', '?')}")
    return results


def _format_line(r: RequestResult) -> str:
    sim = "-" if r.similarity is None else f"{r.similarity:.3f}"
    dens = "dense" if r.density is None else f"{r.density:.1%}"
    err = "-" if r.attn_err_mean is None else f"{r.attn_err_mean:.1e}/{r.attn_err_max:.1e}"
    rnd = "-" if r.random_mask_err is None else f"{r.random_mask_err:.1e}"
    q = "-" if r.psnr_vs_dense is None else ("inf" if math.isinf(r.psnr_vs_dense) else f"{r.psnr_vs_dense:.1f} dB")
    label = r.name if r.kind == "template" else f"{r.name}*"
    return (f"{r.index:>3}  {label:<10} {r.variant:<31} {'HIT' if r.hit else 'miss':<5} {sim:>10} {dens:>8} "
            f"{err:>18} {rnd:>11} {q:>13} {r.seconds:>5.1f}s  {r.committed}")


def main(argv=None) -> int:
    parser = OneLineErrorParser(prog="chorus demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="chorus_demo_out", help="folder for the PNG frames (default ./chorus_demo_out)")
    parser.add_argument("--workspace", default=None, help="cache workspace folder (default: a temporary one)")
    parser.add_argument("--requests", type=int, default=None, help=f"how many requests (default all {len(DEFAULT_STREAM)})")
    parser.add_argument("--model", default="auto", choices=("auto", "diffusers", "comfy"),
                        help="tiny Wan implementation (auto: ComfyUI's WanModel when 'comfy' is importable)")
    parser.add_argument("--attention", default="structured", choices=("structured", "random"),
                        help="attention source of the random model (see the module docstring)")
    parser.add_argument("--size", type=int, default=256, help="start image side in pixels (multiple of 16)")
    parser.add_argument("--frames", type=int, default=17, help="video frames, 4n+1")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks per expert")
    parser.add_argument("--threshold", type=float, default=0.9, help="similarity threshold for a hit")
    parser.add_argument("--top-p", type=float, default=0.9, help="mass kept per query block when masks are recorded")
    parser.add_argument("--k-min", type=int, default=2, help="minimum key blocks per query block on reuse")
    parser.add_argument("--block-size", type=int, default=64, help="attention block size in tokens")
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-dense-compare", action="store_true", help="skip the dense re-run of hits (PSNR column)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # -h (0) or a bad argument (2, one line)
        return int(exc.code or 0)
    if not args.out:
        print("error: --out: empty", file=sys.stderr)
        return 2
    try:
        run_demo(num_requests=args.requests, out_dir=args.out, workspace_dir=args.workspace, model=args.model,
                 attention=args.attention, size=args.size, frames=args.frames, layers=args.layers,
                 threshold=args.threshold, top_p=args.top_p, k_min=args.k_min, block_size=args.block_size,
                 backend=args.backend, seed=args.seed, compare_dense=not args.no_dense_compare)
    except (ValueError, OSError) as exc:  # bad settings; a folder that cannot be made or written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
