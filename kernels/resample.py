"""Resampling block maps and block mass between token grids, in 3D block coordinates.

Wan tokens are frame-major ``(t, h, w)`` (w fastest) after the 1x2x2 patchify, so a token grid is
``(T, H, W)`` latent frames x token rows x token columns and token ``n`` sits at
``(n // (H*W), (n // W) % H, n % W)``. A ``bs`` block is ``bs`` consecutive tokens. To carry a map
from one grid to another, every destination token is mapped to the source token at the same
relative position (nearest, by cell centre) and so to a source block; the destination map is the
pair-wise overlap of those assignments.

Only grids of the same aspect (H/W) are resampled; a caller treats anything else as a miss.
"""

from __future__ import annotations

import functools

import torch

from .masks import num_blocks


def _check_grid(grid, name: str) -> tuple[int, int, int]:
    if len(grid) != 3 or any(int(x) < 1 for x in grid):
        raise ValueError(f"{name} must be a (frames, height, width) token grid of positive ints, got {grid!r}")
    return tuple(int(x) for x in grid)


def aspect_matches(src_grid, dst_grid, *, rel_tol: float = 0.05) -> bool:
    """True when the two token grids have the same height/width aspect within ``rel_tol``."""
    _, hs, ws = _check_grid(src_grid, "src_grid")
    _, hd, wd = _check_grid(dst_grid, "dst_grid")
    return abs((hs / ws) - (hd / wd)) <= rel_tol * (hs / ws)


@functools.lru_cache(maxsize=16)
def _source_block_assignment(src_grid, dst_grid, block_size: int) -> torch.Tensor:
    """Count matrix ``[Qb_dst, Qb_src]``: how many tokens of each destination block map into each
    source block (on the CPU; cached: a run of context windows of two lengths resamples every call of the
    longer ones; callers never write into it)."""
    ts, hs, ws = src_grid
    td, hd, wd = dst_grid

    def nearest(n_dst: int, n_src: int) -> torch.Tensor:
        centres = (torch.arange(n_dst, dtype=torch.float64) + 0.5) * (n_src / n_dst)
        return centres.floor().long().clamp(0, n_src - 1)

    t_idx, h_idx, w_idx = nearest(td, ts), nearest(hd, hs), nearest(wd, ws)
    src_token = (t_idx[:, None, None] * hs + h_idx[None, :, None]) * ws + w_idx[None, None, :]
    src_block = src_token.reshape(-1) // block_size
    dst_block = torch.arange(td * hd * wd) // block_size
    counts = torch.zeros(num_blocks(td * hd * wd, block_size), num_blocks(ts * hs * ws, block_size),
                         dtype=torch.float64)
    counts.index_put_((dst_block, src_block), torch.ones_like(src_block, dtype=torch.float64), accumulate=True)
    return counts


def resample_block_map(block_map: torch.Tensor, src_grid, dst_grid, *, block_size: int = 128,
                       threshold: float = 0.0) -> torch.Tensor:
    """Carry a self-attention block map (bool) or block mass (float) to another token grid.

    Args:
        block_map: ``[..., Qb_src, Qb_src]`` with ``Qb_src = ceil(T*H*W / bs)`` of ``src_grid``.
            bool: a kept-block map. float: block mass (rows are distributions).
        src_grid, dst_grid: ``(T, H, W)`` token grids of the same aspect.
        threshold: bool maps only. A destination pair is kept when the fraction of its token pairs
            whose source pair was kept exceeds ``threshold`` (0 keeps any overlap: the safe default).

    Returns:
        ``[..., Qb_dst, Qb_dst]``: bool (every row keeps >= 1 block, its best-covered one) or float
        mass whose rows still sum to the source rows' sums.

    Raises:
        ValueError: bad grids, a map that does not match ``src_grid``, or different aspects.
    """
    src_grid = _check_grid(src_grid, "src_grid")
    dst_grid = _check_grid(dst_grid, "dst_grid")
    if not aspect_matches(src_grid, dst_grid):
        raise ValueError(f"cannot resample between token grids of different aspect: {src_grid} -> {dst_grid}")
    n_src = num_blocks(src_grid[0] * src_grid[1] * src_grid[2], block_size)
    if block_map.dim() < 2 or tuple(block_map.shape[-2:]) != (n_src, n_src):
        raise ValueError(f"block map grid {tuple(block_map.shape[-2:])} does not match src_grid {src_grid} "
                         f"at block size {block_size} (expected {(n_src, n_src)})")
    counts = _source_block_assignment(src_grid, dst_grid, block_size).to(block_map.device)
    rows = counts / counts.sum(1, keepdim=True)  # [Qb_dst, Qb_src], each dst block's token share
    if block_map.dtype == torch.bool:
        covered = rows @ block_map.double() @ rows.transpose(0, 1)
        keep = covered > threshold
        best = covered.argmax(-1, keepdim=True)
        keep.scatter_(-1, best, True)
        return keep
    if not block_map.is_floating_point():
        raise ValueError(f"block_map must be bool or floating point, got {block_map.dtype}")
    # Source kv block mass is spread over destination kv blocks in proportion to its tokens.
    spread = counts.transpose(0, 1) / counts.sum(0).clamp_min(1.0)[:, None]  # [Qb_src, Qb_dst]
    return (rows @ block_map.double() @ spread).to(block_map.dtype)
