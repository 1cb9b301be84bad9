"""Mask previews as IMAGE-style tensors (float32 ``[1, S, S, 3]`` in [0, 1], ComfyUI's layout)."""

from __future__ import annotations

import torch

from .maps import unpacked_map

# A perceptually ordered dark-blue -> teal -> yellow ramp (viridis-like anchor colours).
_RAMP = torch.tensor([[0.267, 0.005, 0.329], [0.230, 0.322, 0.546], [0.128, 0.567, 0.551],
                      [0.369, 0.789, 0.383], [0.993, 0.906, 0.144]], dtype=torch.float32)


def placeholder(size: int = 64) -> torch.Tensor:
    """Mid-gray image ``[1, size, size, 3]`` (a miss has no mask to show)."""
    return torch.full((1, size, size, 3), 0.5, dtype=torch.float32)


def mask_heatmap(maps, *, min_size: int = 256) -> torch.Tensor:
    """Heatmap of how often each (query block, key block) pair is kept.

    ``maps``: a bool/float tensor ``[..., Qb, Kb]`` or an iterable of them (all the same block grid);
    the value shown is the mean over every leading dim and every map (1 = kept everywhere).
    Rows are query blocks (top = first), columns key blocks. Each block becomes a square of pixels
    (nearest upscaling) so the image is at least ``min_size`` pixels on its long side.
    Raises ``ValueError`` for no maps or maps of different grids.
    """
    if isinstance(maps, torch.Tensor):
        maps = [maps]
    total, count = None, 0
    for m in maps:
        m = unpacked_map(m).float().cpu()
        m = m.reshape(-1, *m.shape[-2:]).mean(0)
        if total is not None and total.shape != m.shape:
            raise ValueError(f"maps of different block grids: {tuple(total.shape)} vs {tuple(m.shape)}")
        total = m if total is None else total + m
        count += 1
    if total is None:
        raise ValueError("no maps to draw")
    value = (total / count).clamp(0, 1)
    pos = value * (len(_RAMP) - 1)
    lo = pos.floor().long().clamp(max=len(_RAMP) - 2)
    frac = (pos - lo.float())[..., None]
    rgb = _RAMP[lo] * (1 - frac) + _RAMP[lo + 1] * frac  # [Qb, Kb, 3]
    scale = max(1, -(-min_size // max(value.shape)))
    rgb = rgb.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    return rgb[None].contiguous()
