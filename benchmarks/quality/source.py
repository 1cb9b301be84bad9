"""Synthetic *structured* attention source: per-head q/k/v for a Wan-like token grid.

A randomly initialised Wan has nearly uniform attention, so its masks say nothing about reuse
(DESIGN.md, "Caution"). This module builds attention with the structure trained video DiTs show,
from two ingredients:

* **RoPE-aligned positional components.** Each head owns an amplitude vector over the rotary pairs
  of Wan's 3-axis RoPE (head dim split into t / h / w parts exactly as Wan does, theta 10 000). q
  and k are that vector rotated by the token's (t, h, w) position, so ``q_i . k_j`` is a sum of
  cosines of the position difference: a 3D-local window whose width is set by which frequencies
  carry amplitude (head-specific), or -- with no amplitude on the t axis -- a "same position in the
  other frames" head, or -- with none on h/w -- a "whole own frame" head.
* **Content features of the real input image.** The request's frames (the start image with a slow
  pan/zoom over time, like an I2V clip) are cut into patches, one per token; patch features (RGB and
  gradients) are projected with a fixed seeded random matrix (the same for every request) and
  soft-assigned to each head's seeded content prototypes, so tokens of one cluster (a segment of the
  image) attend to each other wherever they are, and similar images give similar attention. At step ``s`` the features are mixed with request-seeded noise of weight
  ``sigma_s`` (early, noisy steps see less content).
* **Sink / first-frame columns.** Two extra dims give every query a head-specific logit bonus on the
  first frame's keys (the image condition in I2V).

Heads are mixed per (expert, layer, head) from a seeded generator: ``local`` (narrow or wide),
``temporal``, ``frame``, ``content`` and ``mixed`` heads. The softmax scale is folded into q, so
attention must be computed with ``scale=1.0``.

Everything is deterministic in ``(SourceConfig, request image, request seed)``.
Attention source label for reports: ``"synthetic structured source, random weights"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

SOURCE_LABEL = "synthetic structured source (RoPE-aligned positional + image-content q/k), random weights"

HEAD_TYPES = ("local_narrow", "local_wide", "temporal", "frame", "content", "mixed")
HEAD_TYPE_PROBS = (0.2, 0.12, 0.14, 0.09, 0.2, 0.25)
# ``content_heavy`` sources: most heads content-driven (a sensitivity check for the threshold)
HEAD_TYPE_PROBS_CONTENT = (0.1, 0.05, 0.08, 0.05, 0.42, 0.3)


@dataclass(frozen=True)
class SourceConfig:
    """Geometry of the synthetic model.

    ``grid``: token grid ``(T, H, W)`` (frame-major order, as Wan after the 1x2x2 patchify);
    ``heads`` x ``head_dim`` (head_dim = 96 positional + content + 2 sink dims);
    ``layers`` per expert; ``step_sigmas``: noise level of each step (descending), the first
    ``high_steps`` on expert 0 (high noise) and the rest on expert 1, like Wan 2.2 A14B;
    ``patch``: pixels per token side for the content features; ``seed``: the model's seed.
    """

    grid: tuple = (12, 10, 14)
    heads: int = 8
    head_dim: int = 128
    layers: int = 2
    step_sigmas: tuple = (0.94, 0.83, 0.62, 0.35)
    high_steps: int = 2
    patch: int = 4
    seed: int = 0
    pos_dim: int = 96
    rope_theta: float = 10000.0
    content_heavy: bool = False   # more content heads and 1.5x content logits (sensitivity check)

    def __post_init__(self):
        if len(self.grid) != 3 or min(self.grid) < 1:
            raise ValueError(f"grid must be (T, H, W) >= 1, got {self.grid}")
        if self.head_dim < self.pos_dim + 4:
            raise ValueError(f"head_dim {self.head_dim} leaves no room for content dims after {self.pos_dim} + 2")
        if not 0 <= self.high_steps <= len(self.step_sigmas):
            raise ValueError("high_steps must be within the number of steps")

    @property
    def content_dim(self) -> int:
        return self.head_dim - self.pos_dim - 2

    @property
    def tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def pixel_size(self) -> tuple[int, int]:
        return self.grid[1] * self.patch, self.grid[2] * self.patch

    def expert_of_step(self, step: int) -> int:
        return 0 if step < self.high_steps else 1

    def keys(self):
        """``(expert, step, layer)`` of every self-attention call of one request."""
        return [(self.expert_of_step(s), s, l) for s in range(len(self.step_sigmas)) for l in range(self.layers)]


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of a rotary head dim into (t, h, w) parts (diffusers ``WanRotaryPosEmbed``)."""
    h_dim = w_dim = 2 * (head_dim // 6)
    return head_dim - h_dim - w_dim, h_dim, w_dim


def rope_angles(grid, pos_dim: int, theta: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Rotation angles ``[L, pos_dim/2]`` of every token and the per-axis frequency vectors."""
    t, h, w = grid
    parts = rope_split(pos_dim)
    coords = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    coords = coords.reshape(-1, 3).double()
    angles, freqs = [], []
    for axis, dim in enumerate(parts):
        f = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        freqs.append(f)
        angles.append(coords[:, axis:axis + 1] * f[None, :])
    return torch.cat(angles, dim=1), freqs


@dataclass
class HeadSpec:
    kind: str
    beta_pos: float           # positional logit scale
    amp: torch.Tensor         # [pos_dim/2] amplitudes (unit norm) over rotary pairs
    gamma: float              # content logit scale
    protos: torch.Tensor      # [clusters, content_dim] unit prototypes of this head's content clusters
    kappa: float              # first-frame logit bonus


@dataclass
class SyntheticModel:
    """Head specs for every (expert, layer), fixed projections and the RoPE tables."""

    cfg: SourceConfig
    heads: dict = field(default_factory=dict)       # (expert, layer) -> [HeadSpec]
    feat_proj: torch.Tensor | None = None            # [feat_dim, content_dim]
    value_proj: torch.Tensor | None = None           # [feat_dim, head_dim]
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    _positional: dict = field(default_factory=dict)

    def positional(self, expert: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request-independent positional q/k parts ``[H, L, pos_dim]`` of (expert, layer) (cached).

        Rotary pairs ``(a, 0)`` rotated by the token angle: ``(a cos, a sin)``, so that
        ``q_i . k_j = beta * sum a^2 cos(phi_i - phi_j)``."""
        key = (expert, layer)
        if key not in self._positional:
            cfg = self.cfg
            ks = [torch.stack([s.amp * self.cos, s.amp * self.sin], dim=-1).reshape(cfg.tokens, cfg.pos_dim)
                  for s in self.heads[key]]
            qs = [s.beta_pos * k for s, k in zip(self.heads[key], ks)]
            self._positional[key] = (torch.stack(qs), torch.stack(ks))
        return self._positional[key]


FEAT_DIM_PER_PIXEL = 5  # R, G, B, d/dx, d/dy of luminance
CLUSTERS = 16           # content clusters per head
CLUSTER_SHARPNESS = 20.0


def _amplitudes(kind: str, freqs: list[torch.Tensor], width: float, gen: torch.Generator) -> torch.Tensor:
    """Amplitude^2 per rotary pair: ``omega * exp(-(omega * width)^2 / 2)`` per axis (a Gaussian
    window of about ``width`` tokens sampled on RoPE's log-spaced frequencies), zeroed on the axes
    the head is global over."""
    use = {"local_narrow": (1, 1, 1), "local_wide": (1, 1, 1), "mixed": (1, 1, 1), "content": (1, 1, 1),
           "temporal": (0, 1, 1), "frame": (1, 0, 0)}[kind]
    amps = []
    for axis, f in enumerate(freqs):
        w = width * (1.0 if axis else 0.6)  # time windows are shorter in latent frames
        # Gaussian kernel of width w sampled on log-spaced frequencies: spectrum x d(omega) ~ omega
        a = f * torch.exp(-0.5 * (f * w) ** 2) * use[axis]
        a = a * (0.8 + 0.4 * torch.rand(f.shape, generator=gen, dtype=torch.float64))
        amps.append(a)
    amp = torch.cat(amps).sqrt()
    return amp / amp.norm().clamp_min(1e-12)


def build_model(cfg: SourceConfig) -> SyntheticModel:
    """Seeded head specs for every (expert, layer) and the fixed projections."""
    model = SyntheticModel(cfg)
    angles, freqs = rope_angles(cfg.grid, cfg.pos_dim, cfg.rope_theta)
    model.cos, model.sin = angles.cos(), angles.sin()
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + 17)
    feat_dim = FEAT_DIM_PER_PIXEL * cfg.patch * cfg.patch
    model.feat_proj = torch.randn(feat_dim, cfg.content_dim, generator=gen, dtype=torch.float64) / math.sqrt(feat_dim)
    model.value_proj = torch.randn(feat_dim, cfg.head_dim, generator=gen, dtype=torch.float64) / math.sqrt(feat_dim)
    probs = torch.tensor(HEAD_TYPE_PROBS_CONTENT if cfg.content_heavy else HEAD_TYPE_PROBS, dtype=torch.float64)
    content_gain = 1.5 if cfg.content_heavy else 1.0
    for expert in (0, 1):
        for layer in range(cfg.layers):
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + expert * 1009 + layer * 31 + 1)
            specs = []
            for _ in range(cfg.heads):
                kind = HEAD_TYPES[int(torch.multinomial(probs, 1, generator=g))]
                u = lambda lo, hi: lo + (hi - lo) * float(torch.rand((), generator=g))  # noqa: E731
                width = {"local_narrow": u(0.8, 1.6), "local_wide": u(2.0, 4.0), "temporal": u(0.6, 1.2),
                         "frame": u(0.5, 1.0), "content": u(1.5, 3.0), "mixed": u(1.0, 2.5)}[kind]
                beta = {"local_narrow": u(12, 18), "local_wide": u(9, 13), "temporal": u(10, 14), "frame": u(7, 10),
                        "content": u(1, 3), "mixed": u(5, 9)}[kind]
                gamma = content_gain * {"content": u(10, 14), "mixed": u(6, 9)}.get(kind, u(0.5, 2.0))
                kappa = u(0.5, 3.5) if float(torch.rand((), generator=g)) < 0.6 else 0.0
                protos = torch.randn(CLUSTERS, cfg.content_dim, generator=g, dtype=torch.float64)
                protos = protos / protos.norm(dim=1, keepdim=True)
                specs.append(HeadSpec(kind, beta, _amplitudes(kind, freqs, width, g), gamma, protos, kappa))
            model.heads[(expert, layer)] = specs
    return model


# ---------------------------------------------------------------------------------------------
# request frames and content features
# ---------------------------------------------------------------------------------------------
def request_frames(image: np.ndarray, cfg: SourceConfig, motion: float = 1.0) -> torch.Tensor:
    """The request's latent-rate frames ``[T, 3, H*patch, W*patch]`` in [0, 1]: the start image
    (any size, float [0, 1] ``[h, w, 3]``) resized to the frame, then a slow zoom-in and pan over
    time (frame 0 is the start image itself)."""
    img = torch.as_tensor(np.ascontiguousarray(image), dtype=torch.float64).permute(2, 0, 1)[None]
    ph, pw = cfg.pixel_size
    base = F.interpolate(img, size=(ph, pw), mode="bilinear", align_corners=False, antialias=True)
    frames = [base[0]]
    for t in range(1, cfg.grid[0]):
        zoom = 1.0 + 0.025 * t * motion
        shift = 0.012 * t * motion
        theta = torch.tensor([[1 / zoom, 0, shift], [0, 1 / zoom, 0.5 * shift]], dtype=torch.float64)[None]
        g = F.affine_grid(theta, list(base.shape), align_corners=False)
        frames.append(F.grid_sample(base, g, mode="bilinear", padding_mode="reflection", align_corners=False)[0])
    return torch.stack(frames).clamp(0, 1)


def patch_features(frames: torch.Tensor, patch: int) -> torch.Tensor:
    """Per-token patch features ``[T*H*W, 5*patch*patch]`` (RGB + luminance gradients), centred
    over the request's tokens (frame-major (t, h, w) token order)."""
    lum = (0.299 * frames[:, 0] + 0.587 * frames[:, 1] + 0.114 * frames[:, 2])[:, None]
    gx = F.pad(lum[..., :, 1:] - lum[..., :, :-1], (0, 1, 0, 0))
    gy = F.pad(lum[..., 1:, :] - lum[..., :-1, :], (0, 0, 0, 1))
    x = torch.cat([frames, 4 * gx, 4 * gy], dim=1)  # [T, 5, Hp, Wp]
    t, c, hp, wp = x.shape
    x = x.reshape(t, c, hp // patch, patch, wp // patch, patch).permute(0, 2, 4, 1, 3, 5)
    x = x.reshape(t * (hp // patch) * (wp // patch), c * patch * patch)
    return x - x.mean(0, keepdim=True)


@dataclass
class Request:
    """One request: its start image (float [h, w, 3] in [0, 1]), prompt, seed, family and name."""

    name: str
    image: np.ndarray
    prompt: str
    seed: int
    family: str = ""
    base: str | None = None   # name of the entry this request was derived from (None: unrelated/base)


class RequestAttention:
    """q/k/v of every (expert, step, layer) of one request (computed lazily, float32 [1, H, L, D])."""

    def __init__(self, model: SyntheticModel, request: Request):
        self.model = model
        cfg = model.cfg
        self.frames = request_frames(request.image, cfg)
        feats = patch_features(self.frames, cfg.patch)
        self.feats = feats / feats.norm(dim=1, keepdim=True).mean().clamp_min(1e-12)
        gen = torch.Generator().manual_seed(int(request.seed) * 104729 + 3)
        self.noise = torch.randn(self.feats.shape, generator=gen, dtype=torch.float64)
        self.noise = self.noise / self.noise.norm(dim=1, keepdim=True).mean()
        tokens_per_frame = cfg.grid[1] * cfg.grid[2]
        self.first_frame = torch.zeros(cfg.tokens, dtype=torch.float64)
        self.first_frame[:tokens_per_frame] = 1.0

    def qkv(self, expert: int, step: int, layer: int):
        cfg, model = self.model.cfg, self.model
        sigma = float(cfg.step_sigmas[step])
        # I2V models see the clean image condition at every step: content stays partly visible
        noise_weight = 0.4 * sigma
        f = (1.0 - noise_weight) * self.feats + noise_weight * self.noise
        c = f @ model.feat_proj
        c = c / c.norm(dim=1, keepdim=True).clamp_min(1e-9)          # [L, content_dim], unit rows
        v = f @ model.value_proj
        v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-9)
        pos_q, pos_k = model.positional(expert, layer)
        qs, ks = [], []
        for h, spec in enumerate(model.heads[(expert, layer)]):
            # soft assignment of every token to this head's content clusters: tokens of one cluster
            # (a segment of the image: sky, suit, fur, ...) attend to each other wherever they are
            assign = torch.softmax(CLUSTER_SHARPNESS * (c @ spec.protos.T), dim=1)
            cr = torch.zeros(cfg.tokens, cfg.content_dim, dtype=torch.float64)
            cr[:, :CLUSTERS] = assign
            ones = torch.ones(cfg.tokens, 1, dtype=torch.float64)
            zeros = torch.zeros(cfg.tokens, 1, dtype=torch.float64)
            qs.append(torch.cat([pos_q[h], spec.gamma * cr, spec.kappa * ones, zeros], dim=1))
            ks.append(torch.cat([pos_k[h], cr, self.first_frame[:, None], zeros], dim=1))
        q = torch.stack(qs)[None].float()
        k = torch.stack(ks)[None].float()
        vv = v[None, None].expand(1, cfg.heads, -1, -1).float().contiguous()
        return q, k, vv
