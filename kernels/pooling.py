"""Token pooling over (t, h, w) regions: the geometry and numerics of feature reuse.

Tokens follow Wan's frame-major order after the 1x2x2 patchify: token ``(t, h, w)`` of a grid
``(T, H, W)`` sits at index ``(t * H + h) * W + w`` of the sequence (dim 1 of ``[B, L, ...]``).

- A *region* is a tile of ``region = (rt, rh, rw)`` tokens; regions tile the grid from the origin.
  Only *complete* regions (fully inside the grid) can be downsampled; the ragged rim never is.
- A region that is downsampled is cut into *cells* of ``pool = (pt, ph, pw)`` tokens (``pool``
  divides ``region``); each cell becomes one pooled token (the mean of its tokens).
- :class:`RegionLayout` describes one choice of downsampled regions: the *compact* sequence holds
  the kept (full-resolution) tokens in their original order (or in a token order's, see below),
  then one token per cell. It carries the index tensors to go between the two sequences.
- *Compact self-attention* (a layout built with a :class:`~chorus.kernels.tile_order.RegionTileOrder`
  whose tiles are the regions, ``order=``): the kept tokens sit in that order, so every kept tile is
  one whole block of the compact sequence too, and a block-sparse map in that order serves the
  compact sequence directly: :func:`compact_block_map` keeps a compact block pair when any pair of
  the blocks their tokens come from is kept (kept tiles: their own entry; a block of cells: the union
  over their regions). Each cell's key stands for its ``P`` tokens: with ``log(P)`` added to its
  logits (the kernels' ``suffix_bias``: cells are the end of the compact sequence) it weighs exactly
  as its ``P`` copies would, so the attention mass is that of the full-grid computation. Built with
  ``end_image_leads``, the last frame's tokens come first, then frame 0's (a first-last-frame request:
  its image frames are the keys' prefix, where the kernels' prefix bias reaches them).

Functions (``x`` is ``[B, L, ...]``, float; indices are int64 on ``x``'s device):

- :func:`pool_tokens` ``[B, L, ...] -> [B, L', ...]`` (kept tokens, then cell means);
- :func:`expand_tokens` ``[B, L', ...] -> [B, L, ...]`` (each token takes its compact token: a cell's
  value is repeated over its members, i.e. nearest-neighbour upsampling);
- :func:`compact_rows` ``[B, L, ...] -> [B, L', ...]`` (the row of each compact token's first
  member: the inverse of :func:`expand_tokens` on expanded tensors);
- :func:`unpool_residual` (input ``x``, pooled input, block output on the compact sequence) ->
  full output: kept tokens take their own output; a cell's members keep their own input and add
  the cell's update ``y_c - x_c`` (the block's *update* is what is computed at low resolution);
- :func:`pool_rotations`: pooled RoPE rotations ``[..., 2, 2]``: the mean of a cell's rotations,
  renormalised, is the rotation at the cell's centre position;
- :func:`region_detail` per complete region, the share of a tensor's energy that the cell means
  do not hold (0 = constant over every cell, i.e. downsampling loses nothing; 1 = none kept).

``*_reference`` functions compute the same with explicit per-cell loops (tests compare).
Bad geometry raises ``ValueError``.

On a CUDA device, :func:`pool_tokens` and :func:`unpool_residual` of ``[B, L, C]`` fp16/bf16/fp32
tensors run as fused Triton kernels (:mod:`chorus.kernels.triton._pooling`: one pass each instead of
several gathers, casts and scatters); anywhere else, or if a kernel fails (logged once), the torch
code below runs. Both agree to fp32 rounding (cell means) and are exact copies for kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fused import FusedSwitch

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FUSED = FusedSwitch("fused pooling kernels")


def _fused_kernels(layout, *tensors):
    """The Triton pooling module when every tensor is a ``[B, L, C]`` CUDA tensor with unit channel
    stride of a supported dtype, on the device of the layout's indices (and the kernels have not
    failed before), else None."""
    if not _FUSED.on:
        return None
    device = layout.expand_index.device
    if not all(isinstance(t, torch.Tensor) and t.is_cuda and t.dim() == 3 and t.stride(-1) == 1
               and t.dtype in _FUSED_DTYPES and t.device == device for t in tensors):
        return None
    try:
        from .triton import _pooling
    except Exception:  # noqa: BLE001 - no Triton: the torch path
        return None
    return _pooling


def positive_triple(v, name: str) -> tuple[int, int, int]:
    """``v`` as three positive ints (a (t, h, w) grid, region or tile); ``ValueError`` naming ``name``
    otherwise."""
    try:
        out = tuple(int(s) for s in v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be three ints (t, h, w), got {v!r}") from None
    if len(out) != 3 or min(out) < 1:
        raise ValueError(f"{name} must be three positive ints (t, h, w), got {v!r}")
    return out


def check_geometry(grid, region, pool) -> tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]]:
    """Validate and normalise ``(grid, region, pool)``; ``pool`` must divide ``region``."""
    grid, region, pool = positive_triple(grid, "grid"), positive_triple(region, "region"), positive_triple(pool, "pool")
    if any(r % p for r, p in zip(region, pool)):
        raise ValueError(f"pool {pool} must divide region {region} in every dimension")
    return grid, region, pool


def region_counts(grid, region) -> tuple[int, int, int]:
    """Complete regions along (t, h, w)."""
    return tuple(g // r for g, r in zip(positive_triple(grid, "grid"), positive_triple(region, "region")))


def region_cells(grid, region, pool, device=None) -> torch.Tensor:
    """Token indices of every cell of every complete region: int64 ``[R, C, P]``.

    ``R`` = complete regions in (t, h, w) raster order, ``C`` = cells per region (raster order),
    ``P = pt * ph * pw`` tokens per cell (raster order). ``R`` may be 0.
    """
    (T, H, W), (rt, rh, rw), (pt, ph, pw) = check_geometry(grid, region, pool)
    nt, nh, nw = T // rt, H // rh, W // rw
    tok = torch.arange(T * H * W, device=device, dtype=torch.int64).view(T, H, W)
    tok = tok[: nt * rt, : nh * rh, : nw * rw]
    tok = tok.reshape(nt, rt // pt, pt, nh, rh // ph, ph, nw, rw // pw, pw)
    tok = tok.permute(0, 3, 6, 1, 4, 7, 2, 5, 8)
    return tok.reshape(nt * nh * nw, (rt // pt) * (rh // ph) * (rw // pw), pt * ph * pw)


def region_frames(grid, region) -> torch.Tensor:
    """First frame index ``[R]`` of every complete region (raster order)."""
    (T, H, W), (rt, rh, rw) = positive_triple(grid, "grid"), positive_triple(region, "region")
    nt, nh, nw = T // rt, H // rh, W // rw
    return (torch.arange(nt, dtype=torch.int64) * rt).repeat_interleave(nh * nw)


@dataclass
class RegionLayout:
    """One choice of downsampled regions over a token grid (see the module docstring).

    Attributes (int64 tensors on one device):
        grid, region, pool: the geometry; ``regions``: sorted ids of the downsampled regions.
        keep_index ``[Lk]``: original indices of the kept tokens (ascending, or in ``order``).
        cell_index ``[Nc, P]``: original indices of each cell's tokens.
        expand_index ``[L]``: compact position of every original token.
        rep_index ``[L']``: one original token per compact token (kept token / cell's first member).
        order: None, or the token order the layout was built in (compact self-attention), with
        ``block_sources`` bool ``[ceil(L'/bs), ceil(L/bs)]`` (the order's blocks each compact block's
        tokens come from; ``bs`` = the order's block size).
        end_image_leads: the compact sequence begins with the last frame's tokens, then frame 0's
        (:func:`build_layout`).
    ``length`` = L, ``compact_length`` = L' = Lk + Nc.
    """

    grid: tuple
    region: tuple
    pool: tuple
    regions: torch.Tensor
    keep_index: torch.Tensor
    cell_index: torch.Tensor
    expand_index: torch.Tensor
    rep_index: torch.Tensor
    order: object = None
    block_sources: torch.Tensor | None = None
    end_image_leads: bool = False

    @property
    def length(self) -> int:
        return int(self.expand_index.numel())

    @property
    def compact_length(self) -> int:
        return int(self.rep_index.numel())

    @property
    def cell_size(self) -> int:
        """Tokens per cell (``P``)."""
        return int(self.pool[0] * self.pool[1] * self.pool[2])

    @property
    def num_cells(self) -> int:
        return int(self.cell_index.shape[0])

    @property
    def pooled_tokens(self) -> int:
        return int(self.cell_index.numel())

    def to(self, device) -> "RegionLayout":
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return RegionLayout(self.grid, self.region, self.pool,
                            *(t.to(device) for t in (self.regions, self.keep_index, self.cell_index,
                                                     self.expand_index, self.rep_index)),
                            order=self.order, block_sources=move(self.block_sources),
                            end_image_leads=self.end_image_leads)

    def __deepcopy__(self, memo):
        return self


def build_layout(grid, region, pool, regions, device=None, order=None, end_image_leads: bool = False) -> RegionLayout:
    """:class:`RegionLayout` downsampling the complete regions ``regions`` (ids in raster order).

    ``order``: None (kept tokens in raster order), or a token order of this grid (``perm`` /
    ``inverse`` / ``block_size``, e.g. a :class:`~chorus.kernels.tile_order.RegionTileOrder`): kept
    tokens in that order, plus the compact self-attention block sources (``block_sources``).

    ``end_image_leads`` (a :class:`~chorus.kernels.tile_order.RegionTileOrder` whose last frame is its
    suffix, ``last_frame_is_suffix``: the frame is rim, never pooled): the compact sequence is the last
    frame's tokens (raster), then frame 0's, then as many rim tokens as bring the two frames to whole
    blocks, then the kept tiles (still one whole block each) and the rest of the rim. A first-last-frame
    request's end image is then the keys ``[0, H * W)`` and its start image ``[H * W, 2 * H * W)``: the
    kernels' one prefix bias range covers the end image, or both (their one suffix range holds the cells'
    weight).

    Raises ``ValueError`` for bad geometry, a region id outside ``[0, R)``, an order of another
    length, or ``end_image_leads`` with another order, a pooled region on the last frame or too little rim to
    pad the two frames.
    Duplicates are ignored.
    """
    grid, region, pool = check_geometry(grid, region, pool)
    cells = region_cells(grid, region, pool, device=device)
    regions = torch.as_tensor(regions, dtype=torch.int64).reshape(-1).unique().to(cells.device)
    if regions.numel() and (int(regions.min()) < 0 or int(regions.max()) >= cells.shape[0]):
        raise ValueError(f"region ids must be in [0, {cells.shape[0]}), got {regions.tolist()[:8]}...")
    length = grid[0] * grid[1] * grid[2]
    # cells in region id order; in a token order, grouped by place (regions close in (h, w), then t, are
    # neighbours), so that a block of cells draws on few and similar blocks of the map
    cell_regions = regions if order is None else regions[_locality_order(regions, region_counts(grid, region))]
    cell_index = cells[cell_regions].reshape(-1, cells.shape[-1])
    pooled = torch.zeros(length, dtype=torch.bool, device=cells.device)
    pooled[cell_index.reshape(-1)] = True
    if order is None:
        if end_image_leads:
            raise ValueError("end_image_leads needs a region tile order")
        keep_index = torch.nonzero(~pooled).reshape(-1)
    else:
        if int(order.perm.numel()) != length:
            raise ValueError(f"token order of {order.perm.numel()} tokens for a grid of {length}")
        perm, position = order.indices(cells.device)  # position: the order position of every raster token
        keep_index = perm[~pooled[perm]]  # kept tokens, in the order's positions
        if end_image_leads:
            keep_index = _end_image_first(keep_index, position, order)
    expand_index = torch.empty(length, dtype=torch.int64, device=cells.device)
    expand_index[keep_index] = torch.arange(keep_index.numel(), device=cells.device)
    cell_pos = keep_index.numel() + torch.arange(cell_index.shape[0], device=cells.device)
    expand_index[cell_index] = cell_pos[:, None].expand_as(cell_index)
    rep_index = torch.cat([keep_index, cell_index[:, 0]])
    if order is None:
        return RegionLayout(grid, region, pool, regions, keep_index, cell_index, expand_index, rep_index)
    bs = int(order.block_size)
    sources = torch.zeros(-(-rep_index.numel() // bs), -(-length // bs), dtype=torch.bool, device=cells.device)
    sources[expand_index // bs, position // bs] = True
    return RegionLayout(grid, region, pool, regions, keep_index, cell_index, expand_index, rep_index,
                        order=order, block_sources=sources, end_image_leads=bool(end_image_leads))


def _end_image_first(keep_index: torch.Tensor, position: torch.Tensor, order) -> torch.Tensor:
    """``keep_index`` (kept raster tokens in a region tile order's sequence: frame 0, rim padding, the kept tiles,
    the other rim tokens, the last frame) rearranged as :func:`build_layout`'s ``end_image_leads`` says: the last
    frame, frame 0, padding to whole blocks (the order's own padding tokens first, then the rim's last tokens),
    the kept tiles, the other rim tokens, any padding tokens left over. The kept tiles and the other rim tokens
    keep their places modulo the block size, so their compact blocks draw on the blocks they filled in the order
    (no wider map rows or columns there). ``ValueError`` where the order cannot lead with the last frame."""
    tile_regions, first_tile_block = getattr(order, "tile_regions", None), getattr(order, "first_tile_block", None)
    if tile_regions is None or first_tile_block is None or not order.last_frame_is_suffix:
        raise ValueError(f"end_image_leads needs a region tile order whose last frame is its suffix, got "
                         f"{getattr(order, 'name', type(order).__name__)} on grid {getattr(order, 'grid', None)}")
    hw, length, bs = order.first_frame_tokens, order.length, int(order.block_size)
    at = position[keep_index]  # each kept token's place in the order
    tiles_start, tiles_end = first_tile_block * bs, (first_tile_block + tile_regions.numel()) * bs
    last = at >= length - hw
    if int(last.sum()) != hw:  # a region on the last frame pooled: its keys are not one range
        raise ValueError("end_image_leads needs the last frame's tokens kept whole (no pooled region on it)")
    padding = keep_index[(at >= hw) & (at < tiles_start)]
    rest = keep_index[(at >= tiles_end) & ~last]
    need = (-2 * hw) % bs
    if padding.numel() + rest.numel() < need:
        raise ValueError(f"a grid of {order.grid} has {padding.numel() + rest.numel()} rim tokens, {need} needed to "
                         f"pad frame 0 and the last frame to whole blocks of {bs}")
    borrowed = max(need - padding.numel(), 0)  # from the rim's end: the rest's blocks keep their places
    lead = [keep_index[last], keep_index[at < hw], padding[:need], rest[rest.numel() - borrowed:]]
    return torch.cat(lead + [keep_index[(at >= tiles_start) & (at < tiles_end)], rest[:rest.numel() - borrowed],
                             padding[need:]])


def _locality_order(regions: torch.Tensor, counts) -> torch.Tensor:
    """A permutation of ``regions`` (ids, raster over ``counts`` = regions along t, h, w): by the
    Morton (Z-order) index of their (h, w) place, then t."""
    nt, nh, nw = counts
    t, h, w = regions // (nh * nw), (regions // nw) % nh, regions % nw
    morton = torch.zeros_like(regions)
    for bit in range(16):
        morton |= ((h >> bit) & 1) << (2 * bit + 1) | ((w >> bit) & 1) << (2 * bit)
    return torch.argsort(morton * max(nt, 1) + t, stable=True)


def compact_block_map(block_map: torch.Tensor, block_sources: torch.Tensor) -> torch.Tensor:
    """The self-attention map of the compact sequence: bool ``[..., C, C]`` from a map ``[..., Qb, Qb]``
    in the layout's order and its ``block_sources`` ``[C, Qb]``: compact pair ``(i, j)`` is kept when
    any pair of their source blocks is (exactly the source pair for two kept tiles). Two matmuls on
    the map's device, no host sync. Raises ``ValueError`` on mismatched block counts."""
    if block_map.dim() < 2 or block_sources.dim() != 2 or tuple(block_map.shape[-2:]) != (block_sources.shape[1],) * 2:
        raise ValueError(f"map {tuple(block_map.shape)} and block sources {tuple(block_sources.shape)} do not fit")
    dtype = torch.float16 if block_map.is_cuda else torch.float32  # counts of source pairs: > 0 is all that matters
    sources = block_sources.to(block_map.device, dtype)
    rows = (torch.matmul(sources, block_map.to(dtype)) > 0).to(dtype)
    return torch.matmul(rows, sources.transpose(0, 1)) > 0


def _check_x(x: torch.Tensor, layout: RegionLayout, length: int, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"{what} must be a tensor [B, L, ...], got {type(x).__name__}")
    if x.shape[1] != length:
        raise ValueError(f"{what} has {x.shape[1]} tokens on dim 1, the layout expects {length}")


def pool_tokens(x: torch.Tensor, layout: RegionLayout) -> torch.Tensor:
    """``[B, L, ...] -> [B, L', ...]``: kept tokens in order, then each cell's mean (in x's dtype,
    accumulated in float32 for half types)."""
    _check_x(x, layout, layout.length, "x")
    fused = _fused_kernels(layout, x)
    if fused is not None:
        try:
            return fused.pool_tokens_triton(x, layout)
        except Exception as exc:  # noqa: BLE001 - the torch path below (kernels/fused.py)
            _FUSED.failure(exc)
    return pool_tokens_torch(x, layout)


def pool_tokens_torch(x: torch.Tensor, layout: RegionLayout) -> torch.Tensor:
    """:func:`pool_tokens` in torch ops (any device and shape; the fused kernel's reference)."""
    out = x.new_empty((x.shape[0], layout.compact_length, *x.shape[2:]))
    n_keep = layout.keep_index.numel()
    out[:, :n_keep] = x.index_select(1, layout.keep_index)
    if layout.num_cells:
        # only the pooled members are read (and upcast): one pass over ~share of the tokens
        members = x.index_select(1, layout.cell_index.reshape(-1))
        members = members.view(x.shape[0], layout.num_cells, layout.cell_index.shape[1], *x.shape[2:])
        if x.dtype in (torch.float16, torch.bfloat16):
            members = members.float()
        out[:, n_keep:] = members.mean(2).to(x.dtype)
    return out


def expand_tokens(x_compact: torch.Tensor, layout: RegionLayout, dim: int = 1) -> torch.Tensor:
    """``[B, L', ...] -> [B, L, ...]`` (tokens on ``dim``, default 1; e.g. 2 for ``[B, H, L', D]``):
    every token takes its compact token's value."""
    if not isinstance(x_compact, torch.Tensor) or x_compact.dim() <= dim or x_compact.shape[dim] != layout.compact_length:
        raise ValueError(f"x_compact must hold {layout.compact_length} tokens on dim {dim}, got "
                         f"{tuple(getattr(x_compact, 'shape', ()))}")
    return x_compact.index_select(dim, layout.expand_index)


def compact_rows(x_full: torch.Tensor, layout: RegionLayout, dim: int = 1) -> torch.Tensor:
    """``[B, L, ...] -> [B, L', ...]`` (tokens on ``dim``): the row of each compact token's
    representative token."""
    if not isinstance(x_full, torch.Tensor) or x_full.dim() <= dim or x_full.shape[dim] != layout.length:
        raise ValueError(f"x_full must hold {layout.length} tokens on dim {dim}, got "
                         f"{tuple(getattr(x_full, 'shape', ()))}")
    return x_full.index_select(dim, layout.rep_index)


def unpool_residual(x: torch.Tensor, x_compact: torch.Tensor, y_compact: torch.Tensor,
                    layout: RegionLayout) -> torch.Tensor:
    """Full-length block output from a block run on the compact sequence.

    ``x`` ``[B, L, C]``: the block input; ``x_compact = pool_tokens(x)``; ``y_compact``: the block's
    output on ``x_compact``. Kept tokens take their own output; each cell member gets
    ``x[member] + (y_c[cell] - x_c[cell])`` (own input, upsampled update), so the detail of the
    input survives and only the block's update is coarse.
    """
    _check_x(x, layout, layout.length, "x")
    _check_x(x_compact, layout, layout.compact_length, "x_compact")
    _check_x(y_compact, layout, layout.compact_length, "y_compact")
    fused = _fused_kernels(layout, x, x_compact, y_compact)
    if fused is not None:
        try:
            return fused.unpool_residual_triton(x, x_compact, y_compact, layout)
        except Exception as exc:  # noqa: BLE001 - the torch path below (kernels/fused.py)
            _FUSED.failure(exc)
    return unpool_residual_torch(x, x_compact, y_compact, layout)


def unpool_residual_torch(x: torch.Tensor, x_compact: torch.Tensor, y_compact: torch.Tensor,
                          layout: RegionLayout) -> torch.Tensor:
    """:func:`unpool_residual` in torch ops (any device and shape; the fused kernel's reference)."""
    n_keep = layout.keep_index.numel()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # row-major, as the fused kernel's
    # kept tokens: exactly the block output
    out.index_copy_(1, layout.keep_index, y_compact[:, :n_keep].to(x.dtype))
    if layout.num_cells:
        flat = layout.cell_index.reshape(-1)
        delta = (y_compact[:, n_keep:] - x_compact[:, n_keep:]).unsqueeze(2)  # [B, Nc, 1, ...]
        members = x.index_select(1, flat).view(x.shape[0], layout.num_cells, layout.cell_index.shape[1], *x.shape[2:])
        out.index_copy_(1, flat, (members + delta).reshape(x.shape[0], -1, *x.shape[2:]).to(x.dtype))
    return out


MAX_ROTATION_POOL = 6
"""The largest cell extent along one axis whose averaged RoPE rotations point at the centre: the mean of ``n``
rotations ``omega`` apart is the centre's rotation times ``sin(n omega / 2) / (n sin(omega / 2))``, positive for
every RoPE frequency (``omega <= 1``) while ``n <= 6``; from 7 on the highest frequencies come out reversed."""


def pool_rotations(rot: torch.Tensor, layout: RegionLayout) -> torch.Tensor:
    """Pool RoPE rotation matrices ``[B or 1, L, ..., 2, 2]`` (ComfyUI Wan ``freqs`` layout).

    A cell's rotations are averaged and each 2x2 rotation is renormalised: for positions symmetric
    about the cell centre the result is exactly the rotation at the centre (half-integer position).
    ``ValueError`` for a layout whose cells are longer than :data:`MAX_ROTATION_POOL` along an axis.
    """
    if rot.shape[-2:] != (2, 2):
        raise ValueError(f"rotations must end in [2, 2], got {tuple(rot.shape)}")
    if max(layout.pool) > MAX_ROTATION_POOL:
        raise ValueError(f"rotations cannot be pooled over cells of {tuple(layout.pool)} tokens (at most "
                         f"{MAX_ROTATION_POOL} along an axis: past it the averaged high frequencies reverse)")
    pooled = pool_tokens(rot.float(), layout)
    cos, sin = pooled[..., 0, 0], pooled[..., 1, 0]
    norm = torch.sqrt(cos * cos + sin * sin).clamp_min(1e-12)
    return (pooled / norm[..., None, None]).to(rot.dtype)


def region_detail(x: torch.Tensor, grid, region, pool) -> torch.Tensor:
    """Float32 ``[R]``: per complete region, ``sum |x - cellmean(x)|^2 / sum |x|^2`` over ``x``'s
    batch, tokens and channels (``x`` ``[B, L, ...]``, ``L = T*H*W``). A region with no energy gives 0.
    """
    grid, region, pool = check_geometry(grid, region, pool)
    length = grid[0] * grid[1] * grid[2]
    if x.dim() < 2 or x.shape[1] != length:
        raise ValueError(f"x must be [B, {length}, ...] for grid {grid}, got {tuple(x.shape)}")
    cells = region_cells(grid, region, pool, device=x.device)
    if cells.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=x.device)
    xf = x.float().reshape(x.shape[0], length, -1)
    members = xf.index_select(1, cells.reshape(-1)).view(x.shape[0], *cells.shape, xf.shape[-1])  # [B,R,C,P,D]
    mean = members.mean(3, keepdim=True)
    detail = (members - mean).square().sum(dim=(0, 2, 3, 4))
    total = members.square().sum(dim=(0, 2, 3, 4))
    return torch.where(total > 0, detail / total.clamp_min(1e-30), torch.zeros_like(total))


# -- references: explicit loops over cells --------------------------------------------------------

def _cells_reference(grid, region, pool, regions):
    (T, H, W), (rt, rh, rw), (pt, ph, pw) = check_geometry(grid, region, pool)
    nh, nw = H // rh, W // rw
    out = []
    for r in sorted(set(int(i) for i in regions)):
        a, rem = divmod(r, nh * nw)
        b, c = divmod(rem, nw)
        for ct in range(rt // pt):
            for ch in range(rh // ph):
                for cw in range(rw // pw):
                    cell = []
                    for dt in range(pt):
                        for dh in range(ph):
                            for dw in range(pw):
                                t = a * rt + ct * pt + dt
                                h = b * rh + ch * ph + dh
                                w = c * rw + cw * pw + dw
                                cell.append((t * H + h) * W + w)
                    out.append(cell)
    return out


def pool_tokens_reference(x, grid, region, pool, regions):
    """Loop reference of :func:`pool_tokens` in float64."""
    cells = _cells_reference(grid, region, pool, regions)
    pooled = {i for cell in cells for i in cell}
    xd = x.double()
    kept = [xd[:, i] for i in range(x.shape[1]) if i not in pooled]
    means = [torch.stack([xd[:, i] for i in cell], 0).mean(0) for cell in cells]
    return torch.stack(kept + means, dim=1)


def unpool_residual_reference(x, y_compact, grid, region, pool, regions):
    """Loop reference of :func:`unpool_residual` in float64 (``y_compact`` on the compact order)."""
    cells = _cells_reference(grid, region, pool, regions)
    pooled = {i for cell in cells for i in cell}
    kept = [i for i in range(x.shape[1]) if i not in pooled]
    xd, yd = x.double(), y_compact.double()
    out = xd.clone()
    for pos, i in enumerate(kept):
        out[:, i] = yd[:, pos]
    for c, cell in enumerate(cells):
        mean = torch.stack([xd[:, i] for i in cell], 0).mean(0)
        for i in cell:
            out[:, i] = xd[:, i] + yd[:, len(kept) + c] - mean
    return out


def region_detail_reference(x, grid, region, pool):
    """Loop reference of :func:`region_detail` in float64."""
    grid, region, pool = check_geometry(grid, region, pool)
    n = region_counts(grid, region)
    xd = x.double().reshape(x.shape[0], x.shape[1], -1)
    out = []
    for r in range(n[0] * n[1] * n[2]):
        detail = total = 0.0
        for cell in _cells_reference(grid, region, pool, [r]):
            vals = xd[:, cell]
            detail += float((vals - vals.mean(1, keepdim=True)).square().sum())
            total += float(vals.square().sum())
        out.append(detail / total if total > 0 else 0.0)
    return torch.tensor(out, dtype=torch.float64)
