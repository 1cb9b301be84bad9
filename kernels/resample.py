"""Resampling block maps and block mass between token grids, in 3D block coordinates.

Wan tokens are frame-major ``(t, h, w)`` (w fastest) after the 1x2x2 patchify, so a token grid is
``(T, H, W)`` latent frames x token rows x token columns and token ``n`` sits at
``(n // (H*W), (n // W) % H, n % W)``. A ``bs`` block is ``bs`` consecutive tokens. To carry a map
from one grid to another, every destination token is mapped to the source token at the same
relative position (nearest, by cell centre) and so to a source block; the destination map is the
pair-wise overlap of those assignments.

Maps cut in a token order (``kernels.tile_order``: a :class:`~chorus.kernels.tile_order.TileOrder` or
:class:`~chorus.kernels.tile_order.RegionTileOrder`, whose block ``i`` is positions ``[i*bs, (i+1)*bs)`` of the
permuted sequence) are carried the same way: a token's block is read at its position in the source order,
and the destination map is in the destination grid's order (``src_order`` / ``dst_order``).

Only grids of the same aspect (H/W) are resampled; a caller treats anything else as a miss.
"""

from __future__ import annotations

import functools

import torch

from .masks import num_blocks
from .pooling import region_cells
from .process_tensors import outside_inference_mode
from .tile_order import check_order


def _check_grid(grid, name: str) -> tuple[int, int, int]:
    if len(grid) != 3 or any(int(x) < 1 for x in grid):
        raise ValueError(f"{name} must be a (frames, height, width) token grid of positive ints, got {grid!r}")
    return tuple(int(x) for x in grid)


def aspect_matches(src_grid, dst_grid, *, rel_tol: float = 0.05) -> bool:
    """True when the two token grids have the same height/width aspect within ``rel_tol``."""
    _, hs, ws = _check_grid(src_grid, "src_grid")
    _, hd, wd = _check_grid(dst_grid, "dst_grid")
    return abs((hs / ws) - (hd / wd)) <= rel_tol * (hs / ws)


def nearest_source_tokens(src_grid, dst_grid) -> torch.Tensor:
    """int64 ``[T'*H'*W']``: for every token of ``dst_grid`` (raster position), the raster position of the
    ``src_grid`` token at the same relative place (nearest by cell centre along each of t, h, w)."""
    ts, hs, ws = _check_grid(src_grid, "src_grid")
    td, hd, wd = _check_grid(dst_grid, "dst_grid")

    def nearest(n_dst: int, n_src: int) -> torch.Tensor:
        centres = (torch.arange(n_dst, dtype=torch.float64) + 0.5) * (n_src / n_dst)
        return centres.floor().long().clamp(0, n_src - 1)

    t_idx, h_idx, w_idx = nearest(td, ts), nearest(hd, hs), nearest(wd, ws)
    return ((t_idx[:, None, None] * hs + h_idx[None, :, None]) * ws + w_idx[None, None, :]).reshape(-1)


@functools.lru_cache(maxsize=16)
@outside_inference_mode
def _source_block_assignment(src_grid, dst_grid, block_size: int, src_order=None, dst_order=None) -> torch.Tensor:
    """:func:`source_block_assignment` by :func:`nearest_source_tokens` (on the CPU; cached: a run of context
    windows of two lengths resamples every call of the longer ones; callers never write into it)."""
    return source_block_assignment(src_grid, dst_grid, block_size, src_order, dst_order)


def source_block_assignment(src_grid, dst_grid, block_size: int, src_order=None, dst_order=None,
                            src_token=None) -> torch.Tensor:
    """float64 count matrix ``[Qb_dst, Qb_src]``: how many tokens of each destination block map into each
    source block, blocks cut in ``src_order`` / ``dst_order`` (None: raster). ``src_token``: int64 ``[T'*H'*W']``,
    the source token (raster position) of each destination token (raster position); None:
    :func:`nearest_source_tokens`, the library's carry (a study of another carry passes its own)."""
    if src_token is None:
        src_token = nearest_source_tokens(src_grid, dst_grid)  # indexed by the destination token's raster position
    src_block = (src_token if src_order is None else src_order.inverse[src_token]) // block_size
    dst_token = torch.arange(src_token.numel())
    dst_block = (dst_token if dst_order is None else dst_order.inverse) // block_size
    counts = torch.zeros(num_blocks(src_token.numel(), block_size),
                         num_blocks(src_grid[0] * src_grid[1] * src_grid[2], block_size), dtype=torch.float64)
    counts.index_put_((dst_block, src_block), torch.ones_like(src_block, dtype=torch.float64), accumulate=True)
    return counts


@functools.lru_cache(maxsize=8)
@outside_inference_mode
def _assignment_on(device: torch.device, src_grid, dst_grid, block_size: int, src_order, dst_order) -> torch.Tensor:
    """:func:`_source_block_assignment` on ``device``, kept there: a run in context windows of two lengths
    resamples every map of every step on the GPU (and a miss every longer window's call), where a fresh copy from
    the host each time would wait for the GPU's queue."""
    return _source_block_assignment(src_grid, dst_grid, block_size, src_order, dst_order).to(device)


def resample_region_scores(scores: torch.Tensor, src_grid, dst_grid, region) -> torch.Tensor:
    """Carry per-region scores (feature reuse's redundancy) to another token grid of the same aspect.

    Args:
        scores: ``[R_src]`` float, one per complete ``region`` of ``src_grid`` in raster order of regions
            (:func:`chorus.kernels.pooling.region_cells`).
        src_grid, dst_grid: ``(T, H, W)`` token grids of the same aspect; ``region``: ``(rt, rh, rw)``.

    Returns:
        ``[R_dst]`` float64: each complete destination region's score is the mean, over its tokens, of the
        score of the source region its nearest source token lies in (:func:`nearest_source_tokens`); tokens
        that land outside every complete source region do not count, and a region none of whose tokens lands
        in one gets NaN (no score: a caller does not choose it).

    Raises:
        ValueError: bad grids or region, ``scores`` of another length, or different aspects.
    """
    src_grid = _check_grid(src_grid, "src_grid")
    dst_grid = _check_grid(dst_grid, "dst_grid")
    if not aspect_matches(src_grid, dst_grid):
        raise ValueError(f"cannot resample between token grids of different aspect: {src_grid} -> {dst_grid}")
    src_regions = region_cells(src_grid, region, region)[:, 0]  # [R_src, tokens]
    if scores.dim() != 1 or scores.numel() != src_regions.shape[0]:
        raise ValueError(f"{tuple(scores.shape)} scores for {src_regions.shape[0]} complete regions of {src_grid}")
    region_of = torch.full((src_grid[0] * src_grid[1] * src_grid[2],), -1, dtype=torch.int64)
    region_of[src_regions.reshape(-1)] = torch.arange(src_regions.shape[0]).repeat_interleave(src_regions.shape[1])
    dst_regions = region_cells(dst_grid, region, region)[:, 0]  # [R_dst, tokens]
    landed = region_of[nearest_source_tokens(src_grid, dst_grid)[dst_regions]]
    values = scores.double()[landed.clamp_min(0)]
    return torch.where(landed >= 0, values, torch.nan).nanmean(-1)


def resample_block_map(block_map: torch.Tensor, src_grid, dst_grid, *, block_size: int = 128,
                       threshold: float = 0.0, src_order=None, dst_order=None) -> torch.Tensor:
    """Carry a self-attention block map (bool) or block mass (float) to another token grid.

    Args:
        block_map: ``[..., Qb_src, Qb_src]`` with ``Qb_src = ceil(T*H*W / bs)`` of ``src_grid``.
            bool: a kept-block map. float: block mass (rows are distributions).
        src_grid, dst_grid: ``(T, H, W)`` token grids of the same aspect.
        threshold: bool maps only. A destination pair is kept when the fraction of its token pairs
            whose source pair was kept exceeds ``threshold`` (0 keeps any overlap: the safe default).
        src_order, dst_order: the token orders the source map's and the destination map's blocks are cut
            in (a ``TileOrder`` / ``RegionTileOrder`` of that grid and ``block_size``; None: raster). The same
            grid in two orders is :func:`chorus.kernels.tile_order.convert_map`'s job.

    Returns:
        ``[..., Qb_dst, Qb_dst]``: bool (every row keeps >= 1 block, its best-covered one) or float
        mass whose rows still sum to the source rows' sums.

    Raises:
        ValueError: bad grids, a map that does not match ``src_grid``, different aspects, or an order
        that is not of its grid and block size.
    """
    src_grid = _check_grid(src_grid, "src_grid")
    dst_grid = _check_grid(dst_grid, "dst_grid")
    src_order = check_order(src_order, src_grid, block_size, "src_order")
    dst_order = check_order(dst_order, dst_grid, block_size, "dst_order")
    if not aspect_matches(src_grid, dst_grid):
        raise ValueError(f"cannot resample between token grids of different aspect: {src_grid} -> {dst_grid}")
    n_src = num_blocks(src_grid[0] * src_grid[1] * src_grid[2], block_size)
    if block_map.dim() < 2 or tuple(block_map.shape[-2:]) != (n_src, n_src):
        raise ValueError(f"block map grid {tuple(block_map.shape[-2:])} does not match src_grid {src_grid} "
                         f"at block size {block_size} (expected {(n_src, n_src)})")
    counts = _assignment_on(block_map.device, src_grid, dst_grid, block_size, src_order, dst_order)
    if block_map.dtype == torch.bool and threshold == 0:
        # any overlap: the 0/1 touch matrix in float32 (counts of kept source pairs, exact integers; twice as fast
        # as float64 on a CPU, and what a GPU runs at full rate) decides the same pairs as the token shares would
        touch = (counts > 0).float()
        keep = (touch @ block_map.float() @ touch.transpose(0, 1)) > 0
        keep[..., 0] |= ~keep.any(-1)  # a row covering nothing keeps its best-covered block (all tie at 0: the first)
        return keep
    rows = counts / counts.sum(1, keepdim=True)  # [Qb_dst, Qb_src], each dst block's token share
    if block_map.dtype == torch.bool:
        covered = rows @ block_map.double() @ rows.transpose(0, 1)
        keep = covered > threshold
        best = covered.argmax(-1, keepdim=True)
        keep.scatter_(-1, best, True)
        return keep
    if not block_map.is_floating_point():
        raise ValueError(f"block_map must be bool or floating point, got {block_map.dtype}")
    # Source kv block mass is spread over destination kv blocks in proportion to its tokens: the destination
    # tokens that carry it. A source block no destination token samples (a grid shrunk by more than a block's
    # worth) goes where its own tokens' nearest destination tokens lie, so that no row loses mass.
    spread = counts.transpose(0, 1).clone()  # [Qb_src, Qb_dst]
    unsampled = spread.sum(1) == 0
    if bool(unsampled.any()):
        reverse = _assignment_on(block_map.device, dst_grid, src_grid, block_size, dst_order, src_order)
        spread[unsampled] = reverse[unsampled]
    spread = spread / spread.sum(1, keepdim=True)
    return (rows @ block_map.double() @ spread).to(block_map.dtype)
