"""Synthetic, structured block maps for tests and benchmarks of the cache store.

A randomly initialised Wan has nearly uniform attention, so its masks say nothing about what a
real entry looks like on disk. This module builds block maps from a *stated* attention-mass model
with the structure trained video DiTs show (see DESIGN.md, "Measuring"):

* a 3D-local window around each query block (per-head temporal and spatial widths),
* sink columns on the first latent frame (the start image in I2V),
* content-driven clusters: a low-rank random similarity between blocks (per head, drifting a
  little from step to step),

then keeps, per query row, the key blocks whose mass is at least ``rel_threshold`` (per head, drawn
from ``rel_threshold_range``) times the row maximum, at least the ``k_min`` largest, and the
diagonal (a sort-free stand-in for top-p selection, fast enough to build a full Wan 14B entry in
a test). :func:`top_p_maps` is the exact top-p rule for smaller cases. Everything is seeded; the
same arguments give the same maps.
Token order is Wan's frame-major ``(t, h, w)`` after the 1x2x2 patchify; blocks are ``block_size``
consecutive tokens.
"""

from __future__ import annotations

import math

import torch

CONTENT_WEIGHT = 48.0  # weight of the content-driven (clustered) mass: larger = more scattered blocks, harder to compress
WAN_480P_81F_GRID = (21, 30, 52)  # latent frames, patchified height, patchified width: 32 760 tokens


def block_centres(grid: tuple[int, int, int], block_size: int = 128) -> torch.Tensor:
    """Mean ``(t, h, w)`` token coordinate of each block: float64 ``[ceil(L / block_size), 3]``."""
    t, h, w = grid
    coords = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    coords = coords.reshape(-1, 3).double()
    num_blocks = math.ceil(coords.shape[0] / block_size)
    pad = num_blocks * block_size - coords.shape[0]
    counts = torch.full((num_blocks,), float(block_size), dtype=torch.float64)
    counts[-1] -= pad
    padded = torch.cat([coords, torch.zeros(pad, 3, dtype=torch.float64)])
    return padded.reshape(num_blocks, block_size, 3).sum(1) / counts[:, None]


def top_p_maps(mass: torch.Tensor, top_p: float, k_min: int) -> torch.Tensor:
    """Bool maps keeping per row the fewest largest entries of ``mass`` reaching ``top_p`` (>= k_min), plus the diagonal."""
    mass = mass / mass.sum(-1, keepdim=True)
    values, order = mass.sort(-1, descending=True)
    before = values.cumsum(-1) - values  # mass of the strictly larger entries
    keep_sorted = before < top_p
    keep_sorted[..., :k_min] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    n = min(keep.shape[-2], keep.shape[-1])
    idx = torch.arange(n)
    keep[..., idx, idx] = True
    return keep


def structured_masks(*, layers: int = 40, heads: int = 40, steps: int = 4, grid=WAN_480P_81F_GRID,
                     block_size: int = 128, rel_threshold_range=(0.1, 0.4), k_min: int = 4,
                     experts=("high", "low"), seed: int = 0) -> dict:
    """Masks of one request: ``{(expert, step, layer, 0): bool [1, heads, Qb, Kb]}``.

    Steps are split evenly over ``experts`` in order (Wan 2.2 A14B: 2 high-noise + 2 low-noise
    steps). ``head_group`` is 0: all heads of a layer live in one map.
    """
    gen = torch.Generator().manual_seed(seed)
    centres = block_centres(grid, block_size).float()
    nb = centres.shape[0]
    dt = centres[:, None, 0] - centres[None, :, 0]
    ds2 = (centres[:, None, 1] - centres[None, :, 1]) ** 2 + (centres[:, None, 2] - centres[None, :, 2]) ** 2
    first_frame = (centres[:, 0] < 1.0).float()
    diagonal = torch.eye(nb, dtype=torch.bool)
    rank = 8
    masks = {}
    for layer in range(layers):
        sigma_t = 0.5 + 3.5 * torch.rand(heads, 1, 1, generator=gen)
        sigma_s = 3.0 + 12.0 * torch.rand(heads, 1, 1, generator=gen)
        sink = 0.5 * torch.rand(heads, 1, 1, generator=gen)
        content = 2.0 * torch.rand(heads, 1, 1, generator=gen)
        lo, hi = rel_threshold_range
        rel = lo + (hi - lo) * torch.rand(heads, 1, 1, generator=gen)
        feats = torch.randn(heads, nb, rank, generator=gen)
        local = torch.exp(-(dt / sigma_t) ** 2 - ds2 / sigma_s ** 2)
        for step in range(steps):
            drift = feats + 0.2 * torch.randn(heads, nb, rank, generator=gen)
            sim = drift @ drift.transpose(1, 2) / rank
            mass = 4.0 * local + sink * first_frame + CONTENT_WEIGHT * torch.exp(content * sim) / nb
            expert = experts[min(step * len(experts) // steps, len(experts) - 1)]
            keep = mass >= rel * mass.amax(-1, keepdim=True)
            keep.scatter_(-1, mass.topk(k_min, dim=-1).indices, True)
            keep |= diagonal
            masks[(expert, step, layer, 0)] = keep.unsqueeze(0)
    return masks
