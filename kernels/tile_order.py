"""3D-tile token order: blocks of ``bs`` tokens that are compact (t, h, w) tiles instead of raster strips.

Wan's tokens are frame-major ``(t, h, w)`` (w fastest) after the 1x2x2 patchify: raster token
``n = (t * H + h) * W + w`` of a token grid ``(T, H, W)``. A block of 128 raster tokens is a strip
of 2-3 token rows of one frame. Attention is permutation-equivariant: running block-sparse attention
on q/k/v permuted by ``perm`` (maps recorded in that order) and un-permuting the output is exact.

:class:`TileOrder` defines the permutation (the *tile order*), precisely:

1. **Slabs** along t: frame 0 alone (slab 0, Wan's first latent frame = the I2V image), then slabs
   of ``tile[0]`` frames from frame 1 on (the last slab may hold fewer frames). Slabs come in t
   order, so frame 0's ``H * W`` tokens are exactly positions ``[0, H*W)`` of the tile order: a
   prefix bias (``prefix_len = H * W``) and the first-frame keep-set (``first_frame_blocks``) mean
   the same in both orders.
2. **Tiles** inside a slab: slab 0 is cut into ``(1, fh, fw) = first_tile`` tiles, the other slabs
   into ``(tt, th, tw) = tile`` tiles, from the slab's top-left corner; tiles at the bottom / right
   rim (and in a short last slab) are *partial*: just the tokens of that tile rectangle that exist
   (smaller tiles, no padding). Tiles are enumerated in tile rows top to bottom; within a tile row
   left to right, or with ``serpentine=True`` (default) right to left in odd tile rows (so the
   block that straddles two tile rows joins tiles that touch).
3. **Tokens** of one tile are contiguous, in raster (t, h, w) order inside the tile.
4. **Blocks** are consecutive runs of ``bs`` tokens of that order (the last may be partial), as in
   raster order. A full tile holds exactly ``bs`` tokens; after a partial tile the runs shift, so
   a block is then a tile's worth of tokens taken from two neighbouring tiles (still compact);
   only grids whose sizes are multiples of the tile have blocks that are exactly tiles everywhere.

``perm[p]`` = the raster index of the token at tile position ``p``; ``inverse[n]`` = the tile
position of raster token ``n``. :func:`to_tile_order` / :func:`to_raster_order` are the single
place where the kernel API gathers q/k/v into tile order and scatters the output back
(``torch.index_select``); a fused kernel replaces exactly these two.

:func:`convert_map` carries a block map between two orders of one grid, conservatively (every
token pair a kept source block pair covers is covered by a kept destination pair);
:func:`convert_mass` carries block mass (rows keep their sums).

:class:`RegionTileOrder` is the *region-aligned* tile order that feature reuse's compact attention
needs: its tiles are exactly feature reuse's complete regions (``region`` tokens from the grid's
origin, :mod:`chorus.kernels.pooling`) and each is exactly one block, on any grid:

1. frame 0's ``H * W`` tokens first (raster): the prefix, as above;
2. then as many *rim* tokens (tokens in no tile, raster order) as bring the prefix to a whole
   number of blocks (``P0`` blocks);
3. then the tiles: the complete regions that do not hold frame 0, in region id order, each as one
   run of ``block_size`` tokens (raster inside the region): tile ``i`` is block ``P0 + i``;
4. then the remaining rim tokens (raster; the last block may be partial).

Regions holding frame 0 (feature reuse never pools them) are rim; with ``last_frame_rim`` (a first-last-frame
request's entries) so are those holding the last frame, which then ends the order at every frame count (its keys
the kernels' suffix, its blocks a trailing keep-set; without it only at an odd count with 2-frame regions). A grid
whose rim is too small to pad the prefix gives up its last tiles to the rim. Its name is
``"regions{rt}x{rh}x{rw}"``, with ``last_frame_rim`` ``"regions{rt}x{rh}x{rw}-last"``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from .pooling import positive_triple, region_cells, region_frames
from .process_tensors import outside_inference_mode


RASTER = "raster"


def _rim_tokens(extent: tuple[int, ...], tile: tuple[int, ...]) -> int:
    """Tokens of ``extent`` outside the full tiles of ``tile``."""
    full = math.prod((e // t) * t for e, t in zip(extent, tile))
    return math.prod(extent) - full


def _divisor_pairs(n: int):
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


def choose_tile(grid, block_size: int = 128) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(tile, first_tile)`` for a grid: tiles of exactly ``block_size`` tokens.

    ``tile = (tt, th, tw)`` for the slabs after frame 0: ``tt = 2`` frames when the grid has at
    least 2 frames after frame 0 and ``block_size`` is even (else 1), then the most square
    ``th x tw = block_size / tt`` rectangle that fits ``H x W`` (ties: fewer rim tokens, then the
    wider tile). ``first_tile = (1, fh, fw)`` the same for frame 0 alone. For 128 and Wan's 480p /
    720p grids: ``(2, 8, 8)`` and ``(1, 8, 16)``. A grid smaller than a block gets whatever fits
    (e.g. ``(1, H, ...)``); the order is then still a valid permutation.
    """
    T, H, W = positive_triple(grid, "grid")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")

    def best_rect(area: int, frames: int) -> tuple[int, int]:
        pairs = _divisor_pairs(area)
        fitting = [(h, w) for h, w in pairs if h <= H and w <= W] or pairs
        return min(fitting, key=lambda hw: (abs(math.log2(hw[0] / hw[1])),
                                            _rim_tokens((frames, H, W), (frames, *hw)), -hw[1]))

    tt = 2 if T - 1 >= 2 and block_size % 2 == 0 else 1
    th, tw = best_rect(block_size // tt, tt)
    fh, fw = best_rect(block_size, 1)
    return (tt, th, tw), (1, fh, fw)


class _OrderOfGrid:
    """What every token order of a grid offers (its dataclass sets ``grid``, ``perm``, ``inverse`` and
    an ``_on_device`` dict)."""

    @property
    def length(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def first_frame_tokens(self) -> int:
        return self.grid[1] * self.grid[2]

    @functools.cached_property  # (per order object: the orders are cached per grid, asked per call)
    def last_frame_is_suffix(self) -> bool:
        """Whether the last frame's ``H * W`` tokens take this order's last ``H * W`` positions (as in raster
        order), so that its key blocks are the trailing blocks: e.g. a region order of an odd frame count with
        2-frame regions (the last frame in no complete region), a tile order of an even one (frame 0, then
        2-frame slabs: the last slab is that frame alone). False for a one-frame grid (its last frame is the
        first)."""
        hw, length = self.grid[1] * self.grid[2], self.length
        return self.grid[0] > 1 and bool((self.perm[length - hw:] >= length - hw).all())

    def indices(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(perm, inverse)`` on ``device`` (copied once per device and kept)."""
        key = str(torch.device(device))
        found = self._on_device.get(key)
        if found is None:
            found = self._on_device[key] = self._copies_on(device)
        return found

    @outside_inference_mode
    def _copies_on(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.perm.to(device), self.inverse.to(device)

    def to_tile(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """``x`` with its raster token dim ``dim`` (size ``L``) in this order: ``out[p] = x[perm[p]]``."""
        _check_token_dim(x, dim, self.length)
        return x.index_select(dim, self.indices(x.device)[0])

    def to_raster(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """Inverse of :meth:`to_tile`: ``out[n] = x[inverse[n]]``."""
        _check_token_dim(x, dim, self.length)
        return x.index_select(dim, self.indices(x.device)[1])


@dataclass(frozen=True)
class TileOrder(_OrderOfGrid):
    """The tile order of one token grid (module docstring: slabs, tiles, tokens, blocks).

    Args:
        grid: token grid ``(T, H, W)``; ``L = T * H * W`` tokens.
        block_size: tokens per block (the order is built so that blocks of this size are tiles).
        tile: ``(tt, th, tw)`` with ``tt * th * tw == block_size`` for the slabs after frame 0;
            None: :func:`choose_tile`.
        first_tile: ``(1, fh, fw)`` with ``fh * fw == block_size`` for frame 0; None: chosen.
        serpentine: odd tile rows run right to left.

    Attributes (computed): ``perm`` int64 ``[L]`` (tile position -> raster index), ``inverse``
    int64 ``[L]`` (raster index -> tile position), both on the CPU; ``name`` (for signatures,
    e.g. ``"tile2x8x8-f8x16-s"``); ``length`` ``L``; ``first_frame_tokens`` ``H * W`` (the prefix
    of the tile order that is frame 0).

    Raises ``ValueError`` for a bad grid, block size or tile.
    """

    grid: tuple
    block_size: int = 128
    tile: tuple | None = None
    first_tile: tuple | None = None
    serpentine: bool = True
    perm: torch.Tensor = field(init=False, repr=False, compare=False)
    inverse: torch.Tensor = field(init=False, repr=False, compare=False)
    _on_device: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    @outside_inference_mode
    def __post_init__(self):
        grid = positive_triple(self.grid, "grid")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        chosen_tile, chosen_first = choose_tile(grid, self.block_size)
        tile = chosen_tile if self.tile is None else positive_triple(self.tile, "tile")
        first = chosen_first if self.first_tile is None else positive_triple(self.first_tile, "first_tile")
        if math.prod(tile) != self.block_size:
            raise ValueError(f"tile {tile} must hold block_size={self.block_size} tokens, holds {math.prod(tile)}")
        if first[0] != 1 or math.prod(first) != self.block_size:
            raise ValueError(f"first_tile {first} must be (1, fh, fw) with fh * fw == block_size={self.block_size}")
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        fix("grid", grid)
        fix("tile", tile)
        fix("first_tile", first)
        fix("serpentine", bool(self.serpentine))
        perm = _tile_permutation(grid, tile, first, self.serpentine)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), dtype=torch.int64)
        fix("perm", perm)
        fix("inverse", inverse)

    @property
    def name(self) -> str:
        tt, th, tw = self.tile
        _, fh, fw = self.first_tile
        return f"tile{tt}x{th}x{tw}-f{fh}x{fw}" + ("-s" if self.serpentine else "")


@functools.lru_cache(maxsize=32)
def cached_tile_order(grid: tuple, block_size: int = 128, serpentine: bool = True) -> TileOrder:
    """The default :class:`TileOrder` of ``(grid, block_size)`` (tiles from :func:`choose_tile`),
    built once per process and geometry (the engine asks for it on every call)."""
    return TileOrder(tuple(int(g) for g in grid), int(block_size), serpentine=serpentine)


@dataclass(frozen=True)
class RegionTileOrder(_OrderOfGrid):
    """The region-aligned tile order of one token grid (module docstring, last part).

    Args: ``grid`` ``(T, H, W)``; ``region`` ``(rt, rh, rw)`` with ``rt * rh * rw == block_size``
    (feature reuse's region, default 2 x 8 x 8 = 128 tokens); ``block_size``; ``last_frame_rim``: regions
    holding the last frame are rim too (the module docstring).

    Attributes (computed): ``perm`` / ``inverse`` int64 ``[L]`` as :class:`TileOrder`'s;
    ``tile_regions`` int64 ``[F]`` (the complete-region id of tile ``i``, ascending);
    ``first_tile_block`` ``P0`` (tile ``i`` is block ``P0 + i``); ``name``; ``length``;
    ``first_frame_tokens``. Raises ``ValueError`` for a bad grid, region or block size.
    """

    grid: tuple
    region: tuple = (2, 8, 8)
    block_size: int = 128
    last_frame_rim: bool = False
    perm: torch.Tensor = field(init=False, repr=False, compare=False)
    inverse: torch.Tensor = field(init=False, repr=False, compare=False)
    tile_regions: torch.Tensor = field(init=False, repr=False, compare=False)
    first_tile_block: int = field(init=False, compare=False)
    _on_device: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    @outside_inference_mode
    def __post_init__(self):
        grid = positive_triple(self.grid, "grid")
        region = positive_triple(self.region, "region")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"block_size must be a positive int, got {bs!r}")
        if math.prod(region) != bs:
            raise ValueError(f"region {region} must hold block_size={bs} tokens, holds {math.prod(region)}")
        T, H, W = grid
        regions = region_cells(grid, region, region)[:, 0]  # [R, tokens]: one cell per region, raster inside
        starts = region_frames(grid, region)
        tiles = starts > 0  # regions holding frame 0: rim
        if self.last_frame_rim:
            tiles &= starts + region[0] < T  # and those holding the last frame
        tiles = torch.nonzero(tiles).reshape(-1)
        prefix = H * W
        need = (-prefix) % bs

        def rim_of(tile_ids):
            in_tile = torch.zeros(T * H * W, dtype=torch.bool)
            in_tile[regions[tile_ids].reshape(-1)] = True
            in_tile[:prefix] = True  # frame 0 is the prefix, not rim
            return torch.nonzero(~in_tile).reshape(-1)

        rim = rim_of(tiles)
        while rim.numel() < need and tiles.numel():  # a grid that is all tiles: give the last ones up
            tiles = tiles[:-1]
            rim = rim_of(tiles)
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        fix("grid", grid)
        fix("region", region)
        perm = torch.cat([torch.arange(prefix, dtype=torch.int64), rim[:need], regions[tiles].reshape(-1),
                          rim[need:]])
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), dtype=torch.int64)
        fix("perm", perm)
        fix("inverse", inverse)
        fix("tile_regions", tiles)
        fix("first_tile_block", (prefix + min(need, rim.numel())) // bs)

    @property
    def name(self) -> str:
        return "regions{}x{}x{}".format(*self.region) + ("-last" if self.last_frame_rim else "")


ORDER_TYPES = (TileOrder, RegionTileOrder)


def cached_region_order(grid: tuple, region: tuple = (2, 8, 8), block_size: int = 128,
                        last_frame_rim: bool = False) -> RegionTileOrder:
    """The :class:`RegionTileOrder` of ``(grid, region, block_size, last_frame_rim)``, built once per process."""
    return _region_order(tuple(int(g) for g in grid), tuple(int(r) for r in region), int(block_size),
                         bool(last_frame_rim))


@functools.lru_cache(maxsize=32)
def _region_order(grid: tuple, region: tuple, block_size: int, last_frame_rim: bool) -> RegionTileOrder:
    return RegionTileOrder(grid, region, block_size, last_frame_rim)


def _tile_permutation(grid, tile, first, serpentine: bool) -> torch.Tensor:
    """``perm`` of the module docstring: a stable sort of raster tokens by (slab, tile row, tile)."""
    T, H, W = grid
    tt, th, tw = tile
    _, fh, fw = first
    t = torch.arange(T).view(T, 1, 1)
    h = torch.arange(H).view(1, H, 1)
    w = torch.arange(W).view(1, 1, W)
    first_frame = t == 0
    slab = torch.where(first_frame, 0, 1 + (t - 1).clamp_min(0) // tt)
    cell_h = torch.where(first_frame, fh, th)
    cell_w = torch.where(first_frame, fw, tw)
    tile_row = h // cell_h
    tile_col = w // cell_w
    if serpentine:
        cols = -(-W // cell_w)  # tile columns of the slab
        tile_col = torch.where(tile_row % 2 == 1, cols - 1 - tile_col, tile_col)
    key = (slab * H + tile_row) * W + tile_col  # lexicographic (slab, tile row, tile col): tile_row < H, col < W
    key = key.expand(T, H, W).reshape(-1)
    return torch.sort(key, stable=True).indices  # stable: raster order inside a tile


def _check_token_dim(x, dim: int, length: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} out of range for a {x.dim()}-dim tensor")
    if x.shape[dim] != length:
        raise ValueError(f"token dim {dim} of shape {tuple(x.shape)} has {x.shape[dim]} tokens, the order {length}")


# -- the one gather / scatter of the kernel API -------------------------------------------------
def resolve_token_perm(token_perm, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, inverse)`` int64 ``[length]`` on ``device`` from a :class:`TileOrder`, a
    :class:`RegionTileOrder` or a perm tensor.

    A tensor must be a 1-D integer permutation of ``range(length)`` (checked: one host read).
    Raises ``ValueError`` otherwise, or for an order of another length.
    """
    if isinstance(token_perm, ORDER_TYPES):
        if token_perm.length != length:
            raise ValueError(f"token_perm is a {type(token_perm).__name__} of {token_perm.length} tokens "
                             f"({token_perm.grid}), the call has {length}")
        return token_perm.indices(device)
    if not isinstance(token_perm, torch.Tensor):
        raise ValueError(f"token_perm must be a TileOrder or an int64 tensor, got {type(token_perm).__name__}")
    if token_perm.dim() != 1 or token_perm.numel() != length or token_perm.dtype.is_floating_point \
            or token_perm.dtype == torch.bool or token_perm.is_complex():
        raise ValueError(f"token_perm must be an integer tensor [{length}], got {token_perm.dtype} "
                         f"{tuple(token_perm.shape)}")
    perm = token_perm.to(device=device, dtype=torch.int64)
    seen = torch.zeros(length, dtype=torch.bool, device=device)
    if bool(((perm < 0) | (perm >= length)).any()):
        raise ValueError(f"token_perm has values outside [0, {length})")
    seen[perm] = True
    if not bool(seen.all()):
        raise ValueError("token_perm is not a permutation (a raster index appears twice)")
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(length, dtype=torch.int64, device=device)
    return perm, inverse


def to_tile_order(perm: torch.Tensor, *tensors: torch.Tensor, dim: int = -2) -> tuple[torch.Tensor, ...]:
    """Gather each ``[..., L, D]`` tensor into tile order along ``dim`` (``index_select``). The kernel
    API's only gather; the Triton FP8 pre-pass is meant to replace it."""
    return tuple(t.index_select(dim, perm) for t in tensors)


def to_raster_order(inverse: torch.Tensor, out: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Scatter an output computed in tile order back to raster order (``index_select`` by the
    inverse). The kernel API's only scatter; the Triton epilogue store is meant to replace it."""
    return out.index_select(dim, inverse)


# -- maps between orders ----------------------------------------------------------------------
def check_order(order, grid, block_size: int, name: str = "order"):
    """``order`` checked to be a token order of ``grid`` cut into ``block_size`` blocks: None for raster
    (``None`` or ``"raster"``), else the :class:`TileOrder` / :class:`RegionTileOrder` itself. ValueError naming
    ``name`` for anything else, or an order of another grid or block size."""
    if order is None or order == RASTER:
        return None
    if not isinstance(order, ORDER_TYPES):
        raise ValueError(f"{name} must be a TileOrder or RegionTileOrder (None or 'raster': raster), got {order!r}")
    grid = tuple(int(g) for g in grid)
    if tuple(order.grid) != grid or int(order.block_size) != int(block_size):
        raise ValueError(f"{name} {order.name} is for token grid {tuple(order.grid)} at block size {order.block_size}, "
                         f"not {grid} at {block_size}")
    return order


def block_overlap(src_order, dst_order, *, grid=None, block_size: int = 128) -> torch.Tensor:
    """Token counts float64 ``[Qb, Qb]``: ``[i, j]`` = tokens in destination block ``i`` and source
    block ``j`` (orders: ``"raster"``/None or :class:`TileOrder`; ``grid`` needed when both are raster)."""
    grids = {o.grid for o in (src_order, dst_order) if isinstance(o, ORDER_TYPES)}
    if len(grids) > 1:
        raise ValueError(f"orders of different grids: {sorted(grids)}")
    grid = positive_triple(grid, "grid") if grid is not None else (grids.pop() if grids else None)
    if grid is None:
        raise ValueError("grid is needed when both orders are raster")
    src = check_order(src_order, grid, block_size, "src_order")
    dst = check_order(dst_order, grid, block_size, "dst_order")
    length = grid[0] * grid[1] * grid[2]
    nb = -(-length // block_size)
    raster = torch.arange(length, dtype=torch.int64)
    src_block = (raster if src is None else src.inverse) // block_size  # block of raster token n
    dst_block = (raster if dst is None else dst.inverse) // block_size
    counts = torch.zeros(nb, nb, dtype=torch.float64)
    counts.index_put_((dst_block, src_block), torch.ones(length, dtype=torch.float64), accumulate=True)
    return counts


def _check_map_grid(block_map, nb: int, what: str):
    if not isinstance(block_map, torch.Tensor) or block_map.dim() < 2 or tuple(block_map.shape[-2:]) != (nb, nb):
        shape = tuple(block_map.shape) if isinstance(block_map, torch.Tensor) else type(block_map).__name__
        raise ValueError(f"{what} must be [..., {nb}, {nb}] for this grid and block size, got {shape}")


def convert_map(block_map: torch.Tensor, src_order, dst_order, *, grid=None, block_size: int = 128) -> torch.Tensor:
    """Carry a self-attention bool block map ``[..., Qb, Qb]`` from ``src_order`` to ``dst_order``.

    Destination pair ``(i, j)`` is kept when any token pair of it lies in a kept source pair: every
    token pair the source covers stays covered (conservative; usually denser, since a raster strip
    and a tile overlap several blocks of the other order). Same order: returned unchanged.
    Raises ``ValueError`` for a non-bool map, a map of another block grid or mismatched orders.
    """
    if isinstance(block_map, torch.Tensor) and block_map.dtype != torch.bool:
        raise ValueError(f"block_map must be bool, got {block_map.dtype} (block mass: convert_mass)")
    overlap = block_overlap(src_order, dst_order, grid=grid, block_size=block_size)
    _check_map_grid(block_map, overlap.shape[0], "block_map")
    if _same_order(src_order, dst_order):
        return block_map
    touch = (overlap > 0).to(block_map.device, torch.float64)
    covered = touch @ block_map.double() @ touch.transpose(0, 1)
    return covered > 0


def convert_mass(mass: torch.Tensor, src_order, dst_order, *, grid=None, block_size: int = 128) -> torch.Tensor:
    """Carry block mass ``[..., Qb, Qb]`` (rows = distributions over key blocks) to another order.

    Each destination query block's row is the token-weighted mean of the source rows of its tokens;
    a source key block's mass is spread over destination key blocks in proportion to its tokens
    (uniform within a block: an approximation, exact only when the orders share blocks). Rows keep
    their sums. Raises ``ValueError`` for a non-float mass or mismatched grids.
    """
    if not isinstance(mass, torch.Tensor) or not mass.is_floating_point():
        raise ValueError("mass must be a floating-point tensor")
    overlap = block_overlap(src_order, dst_order, grid=grid, block_size=block_size).to(mass.device)
    _check_map_grid(mass, overlap.shape[0], "mass")
    if _same_order(src_order, dst_order):
        return mass
    rows = overlap / overlap.sum(1, keepdim=True)
    spread = overlap.transpose(0, 1) / overlap.sum(0).clamp_min(1.0)[:, None]
    return (rows @ mass.double() @ spread).to(mass.dtype)


def _same_order(a, b) -> bool:
    a = None if a == RASTER else a
    b = None if b == RASTER else b
    return a == b
