"""Block-map construction and validation.

A block map is a bool tensor ``[B or 1, H or 1, Qb, Kb]``; ``True`` at ``[..., i, j]`` means query
block ``i`` attends to key block ``j`` (geometry: ``bs x bs`` tokens, Wan token order).
Block mass is a float tensor of the same shape whose rows are (close to) probability
distributions, as :func:`chorus.kernels.block_mass` returns.

:func:`select_blocks` / :func:`select_blocks_packed` check their arguments, then select: float32 /
float16 / bfloat16 mass on a CUDA device with rows of at most 4096 key blocks in one Triton kernel
(:mod:`chorus.kernels.triton._select`: no sort indices, gather or scatter; the packed map written by the
kernel), anything else, or if the kernel fails (logged once), in torch (:func:`select_blocks_torch`, the
kernel's reference). The two give the same map except where a block's preceding mass lies within float64
rounding of the target (they sum in different orders).

:func:`floor_k_min` gives each row of a reused map a floor of kept blocks (its nearest blocks,
:func:`nearest_blocks`); :func:`floor_packed_map` makes a hit's map from its entry's bit-packed one (that floor,
the heads, the packed copy and the row counts) in one Triton kernel on CUDA
(:mod:`chorus.kernels.triton._floor_map`), else or if it fails (logged once) in torch
(:func:`floor_packed_map_torch`, the kernel's reference); the two are equal.
"""

from __future__ import annotations

import torch

from .codec import pack_bits_on_device, unpack_bits_on_device
from .fused import FusedSwitch

SELECTION_TOLERANCE = 1e-6  # relative to the row's mass: a target met to within it counts as met
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FUSED = FusedSwitch("the Triton block selection")
_FUSED_FLOOR = FusedSwitch("the Triton map floor")


def num_blocks(length: int, block_size: int) -> int:
    """Number of ``block_size`` blocks covering ``length`` tokens (the last may be partial)."""
    return -(-length // block_size)


def validate_block_map(block_map, batch: int, heads: int, q_len: int, kv_len: int, block_size: int, *,
                       check_rows: bool = True) -> None:
    """Raise ``ValueError`` unless ``block_map`` is a usable bool map for these shapes.

    Checks dtype, rank, the block grid ``(ceil(q_len/bs), ceil(kv_len/bs))``, broadcastable batch and
    head dims, and that every query block keeps at least one key block (an empty row would be a
    division by zero in the softmax, i.e. NaN output).
    """
    if not isinstance(block_map, torch.Tensor):
        raise ValueError(f"block_map must be a torch.Tensor, got {type(block_map).__name__}")
    if block_map.dtype != torch.bool:
        raise ValueError(f"block_map must be bool, got {block_map.dtype}")
    if block_map.dim() != 4:
        raise ValueError(f"block_map must be [B or 1, H or 1, Qb, Kb], got shape {tuple(block_map.shape)}")
    want = (num_blocks(q_len, block_size), num_blocks(kv_len, block_size))
    if tuple(block_map.shape[-2:]) != want:
        raise ValueError(
            f"block_map grid {tuple(block_map.shape[-2:])} does not match the block grid {want} of "
            f"q_len={q_len}, kv_len={kv_len} at block_size={block_size}"
        )
    if block_map.shape[0] not in (1, batch):
        raise ValueError(f"block_map batch dim {block_map.shape[0]} must be 1 or {batch}")
    if block_map.shape[1] not in (1, heads):
        raise ValueError(f"block_map head dim {block_map.shape[1]} must be 1 or {heads}")
    if not check_rows:
        return
    empty = ~block_map.any(dim=-1)
    if bool(empty.any()):
        where = tuple(int(x) for x in empty.nonzero()[0].tolist())
        raise ValueError(f"block_map has a query block that keeps no key block (first at [b, h, qb] = {where})")


def select_blocks(mass: torch.Tensor, *, top_p: float, k_min: int, keep_diagonal: bool = True,
                  keep_first_frame_blocks: int = 0, keep_last_frame_blocks: int = 0,
                  check_values: bool = True) -> torch.Tensor:
    """Block map from block mass: per row, top-p selection, a top-k floor, and keep-sets.

    Args:
        mass: float ``[..., Qb, Kb]``, non-negative, no NaN/inf. Rows are normally probability
            distributions; otherwise ``top_p`` is taken relative to the row sum.
        top_p: in (0, 1]. Per row, keep the fewest highest-mass blocks whose cumulative mass reaches
            ``top_p`` of the row (ties broken by lower key-block index).
        k_min: keep at least ``min(k_min, Kb)`` highest-mass blocks per row (the safety floor).
        keep_diagonal: also keep block ``(i, i)`` (for ``i < min(Qb, Kb)``).
        keep_first_frame_blocks: also keep key blocks ``0 .. n-1`` in every row (the blocks that
            hold the first frame, i.e. the image condition in I2V).
        keep_last_frame_blocks: also keep the last ``n`` key blocks ``Kb - n .. Kb - 1`` in every row
            (the blocks that hold the last frame, i.e. the end image of a first-last-frame request).
        check_values: reject NaN, inf and negative mass (three reads of the values: on a GPU, three
            host syncs). ``False`` for a caller that checks the mass itself without a sync (the miss
            recorder keeps a device flag and refuses to write a recording that saw such mass); the
            map selected from such mass is then undefined, never an error.

    Returns:
        bool tensor shaped like ``mass``, on its device; every row keeps at least one block.

    Raises:
        ValueError: non-float or empty ``mass``, NaN/inf or negative mass, ``top_p`` outside (0, 1],
            negative ``k_min``, ``keep_first_frame_blocks`` or ``keep_last_frame_blocks``.
    """
    _check_selection(mass, top_p, k_min, keep_first_frame_blocks, keep_last_frame_blocks, check_values)
    return _select(mass, False, top_p=top_p, k_min=k_min, keep_diagonal=keep_diagonal,
                   keep_first_frame_blocks=keep_first_frame_blocks, keep_last_frame_blocks=keep_last_frame_blocks)


def select_blocks_packed(mass: torch.Tensor, *, top_p: float, k_min: int, keep_diagonal: bool = True,
                         keep_first_frame_blocks: int = 0, keep_last_frame_blocks: int = 0,
                         check_values: bool = True) -> torch.Tensor:
    """:func:`select_blocks`, bit-packed on ``mass``'s device: uint8 ``[..., Qb, ceil(Kb / 8)]`` in the
    layout of :func:`chorus.kernels.codec.pack_bits` (what the miss recorder keeps; the Triton kernel
    writes the bytes itself). Same arguments and errors as :func:`select_blocks`."""
    _check_selection(mass, top_p, k_min, keep_first_frame_blocks, keep_last_frame_blocks, check_values)
    return _select(mass, True, top_p=top_p, k_min=k_min, keep_diagonal=keep_diagonal,
                   keep_first_frame_blocks=keep_first_frame_blocks, keep_last_frame_blocks=keep_last_frame_blocks)


def _select(mass: torch.Tensor, packed: bool, **selection) -> torch.Tensor:
    """The Triton kernel where it takes ``mass`` (see :func:`_fused_kernel`), else or if it raises torch."""
    fused = _fused_kernel(mass)
    if fused is not None:
        try:
            return fused.select_blocks_triton(mass, packed=packed, **selection)
        except Exception as exc:  # noqa: BLE001 - the torch path below (kernels/fused.py)
            _FUSED.failure(exc)
    keep = select_blocks_torch(mass, **selection)
    return pack_bits_on_device(keep) if packed else keep


def _check_selection(mass, top_p, k_min, keep_first_frame_blocks, keep_last_frame_blocks, check_values) -> None:
    if not isinstance(mass, torch.Tensor) or not mass.is_floating_point():
        raise ValueError("mass must be a floating-point torch.Tensor")
    if mass.dim() < 2 or mass.shape[-1] == 0 or mass.shape[-2] == 0:
        raise ValueError(f"mass must be [..., Qb, Kb] with Qb, Kb >= 1, got shape {tuple(mass.shape)}")
    if not (isinstance(top_p, (int, float)) and 0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if int(k_min) < 0:
        raise ValueError(f"k_min must be >= 0, got {k_min}")
    if int(keep_first_frame_blocks) < 0:
        raise ValueError(f"keep_first_frame_blocks must be >= 0, got {keep_first_frame_blocks}")
    if int(keep_last_frame_blocks) < 0:
        raise ValueError(f"keep_last_frame_blocks must be >= 0, got {keep_last_frame_blocks}")
    if check_values:
        if bool(torch.isnan(mass).any()):
            raise ValueError("mass contains NaN")
        if bool(torch.isinf(mass).any()):
            raise ValueError("mass contains inf")
        if bool((mass < 0).any()):
            raise ValueError("mass contains negative values")


def _fused_kernel(mass: torch.Tensor):
    """The Triton selection module when ``mass`` is a CUDA tensor of a dtype and row width it takes (and
    it has not failed before), else None."""
    if not _FUSED.on or not mass.is_cuda or mass.dtype not in _FUSED_DTYPES:
        return None
    try:
        from .triton import _select
    except Exception:  # noqa: BLE001 - no Triton: the torch path
        return None
    return _select if mass.shape[-1] <= _select.SELECT_MAX_KEYS else None


def select_blocks_torch(mass: torch.Tensor, *, top_p: float, k_min: int, keep_diagonal: bool = True,
                        keep_first_frame_blocks: int = 0, keep_last_frame_blocks: int = 0) -> torch.Tensor:
    """:func:`select_blocks` in torch ops (any device and float dtype; the Triton kernel's reference).
    Arguments as there, not checked here."""
    num_q, num_kv = mass.shape[-2:]
    mass64 = mass.double()
    # Stable descending sort: equal masses keep increasing key-block order. Sorting float32 (or narrower)
    # mass as float32 gives the same order as sorting it in float64 (the widening is exact) at half the
    # radix passes.
    keys = mass.float() if mass.dtype != torch.float64 else mass64
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices
    sorted_mass = torch.gather(mass64, -1, order)
    before = torch.cumsum(sorted_mass, dim=-1) - sorted_mass  # mass of the better blocks
    row_total = sorted_mass.sum(-1, keepdim=True)
    target = float(top_p) * row_total
    # A block is needed while the better blocks have not yet reached the target. The relative tolerance
    # absorbs float32 rounding of the input mass and of the cumulative sum (so top_p=1 keeps no
    # zero-mass block and a target met exactly counts as met).
    needed = before < target - SELECTION_TOLERANCE * row_total
    needed[..., 0] = True
    rank = torch.arange(num_kv, device=mass.device)
    needed |= rank < min(int(k_min), num_kv)
    keep = torch.zeros_like(needed)
    keep.scatter_(-1, order, needed)
    if keep_diagonal:  # blocks (i, i), i < min(Qb, Kb): a view, no index tensor (nothing crosses to a GPU)
        keep.diagonal(dim1=-2, dim2=-1).fill_(True)
    if keep_first_frame_blocks:
        keep[..., : min(int(keep_first_frame_blocks), num_kv)] = True
    if keep_last_frame_blocks:
        keep[..., num_kv - min(int(keep_last_frame_blocks), num_kv):] = True
    return keep


def first_frame_blocks(tokens_per_frame: int, block_size: int = 128) -> int:
    """Number of leading key blocks that contain any first-frame token."""
    return num_blocks(tokens_per_frame, block_size)


def last_frame_blocks(tokens: int, tokens_per_frame: int, block_size: int = 128) -> int:
    """Number of trailing key blocks that contain any token of the last ``tokens_per_frame`` of a sequence
    of ``tokens`` (blocks of ``block_size`` from the start, the last one possibly partial): the blocks that
    hold the last frame where it is the sequence's suffix (raster order)."""
    if not 0 <= tokens_per_frame <= tokens:
        raise ValueError(f"a frame of {tokens_per_frame} tokens in a sequence of {tokens}")
    if tokens_per_frame == 0:
        return 0
    return num_blocks(tokens, block_size) - (tokens - tokens_per_frame) // block_size


def density(block_map: torch.Tensor) -> float:
    """Fraction of kept block pairs (full blocks counted equally)."""
    return float(block_map.float().mean()) if block_map.numel() else 0.0


_NEAR_TABLES: dict = {}


def nearest_blocks(num_q: int, num_kv: int, k: int, device) -> torch.Tensor:
    """Bool ``[Qb, Kb]``: for each query block row, its ``k`` key blocks nearest to the diagonal position
    ``j ~ i * Kb / Qb`` (ties to the lower index); cached per geometry and device."""
    key = (num_q, num_kv, k, str(device))
    table = _NEAR_TABLES.get(key)
    if table is None:
        centre = torch.arange(num_q, dtype=torch.float64)[:, None] * (num_kv / num_q)
        dist = (torch.arange(num_kv, dtype=torch.float64)[None, :] - centre).abs()
        rank = torch.argsort(torch.argsort(dist, dim=-1, stable=True), dim=-1)
        table = _NEAR_TABLES[key] = (rank < k).to(device)
    return table


def floor_k_min(block_map: torch.Tensor, k_min: int) -> torch.Tensor:
    """Give every row of a bool map ``[..., Qb, Kb]`` at least ``min(k_min, Kb)`` kept blocks.

    Rows below the floor gain the ``k_min`` key blocks nearest to their diagonal position
    (``j ~ i * Kb / Qb``; a reused map has no mass left to rank by, and local blocks are the ones
    video attention needs most). Rows already at the floor are unchanged. Runs on the map's device
    without a host sync (a few elementwise kernels; the nearest-block table is built once per grid).
    """
    num_q, num_kv = block_map.shape[-2:]
    k = min(int(k_min), num_kv)
    if k <= 0:
        return block_map
    short = block_map.sum(-1, dtype=torch.int32) < k
    return block_map | (nearest_blocks(num_q, num_kv, k, block_map.device) & short[..., None])


def floor_packed_map(packed: torch.Tensor, num_kv: int, heads: int, k_min: int):
    """A hit's map from its entry's bit-packed map: ``(map, packed, kept)``, the map being
    :func:`floor_k_min` of the entry's on every head.

    Args:
        packed: uint8 ``[Hs, Qb, ceil(Kb / 8)]`` in :func:`chorus.kernels.codec.pack_bits`' layout (the entry's
            map; ``Hs`` is 1, a map every head shares, or ``heads``).
        num_kv: ``Kb``, the key blocks per row.
        heads: the call's heads (a multiple of ``Hs``).
        k_min: the floor of kept blocks per row (``<= 0``: none).

    Returns:
        bool ``[heads, Qb, Kb]``, the same map bit-packed (uint8 ``[heads, Qb, ceil(Kb / 8)]``, padding bits
        zero) and int32 ``[heads, Qb]`` kept blocks per row, on ``packed``'s device, with no host sync.

    Raises:
        ValueError: shapes that do not fit (a packed width other than ``ceil(Kb / 8)``, ``heads`` not a
            multiple of ``Hs``).
    """
    if packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[-1] != -(-int(num_kv) // 8):
        raise ValueError(f"packed must be uint8 [Hs, Qb, ceil({num_kv} / 8)], got {packed.dtype} {tuple(packed.shape)}")
    if heads < 1 or heads % packed.shape[0]:
        raise ValueError(f"heads ({heads}) must be a multiple of the map's heads ({packed.shape[0]})")
    kernel = _floor_kernel(packed, num_kv)
    if kernel is not None:
        try:
            return kernel.floor_packed_map_triton(packed, num_kv, heads, k_min)
        except Exception as exc:  # noqa: BLE001 - the torch path below (kernels/fused.py)
            _FUSED_FLOOR.failure(exc)
    return floor_packed_map_torch(packed, num_kv, heads, k_min)


def _floor_kernel(packed: torch.Tensor, num_kv: int):
    """The Triton map-floor module when ``packed`` is on a CUDA device and its rows fit one program (and it
    has not failed before), else None."""
    if not _FUSED_FLOOR.on or not packed.is_cuda:
        return None
    try:
        from .triton import _floor_map
    except Exception:  # noqa: BLE001 - no Triton: the torch path
        return None
    return _floor_map if num_kv <= _floor_map.FLOOR_MAP_MAX_KEYS else None


def floor_packed_map_torch(packed: torch.Tensor, num_kv: int, heads: int, k_min: int):
    """:func:`floor_packed_map` in torch ops (any device; the Triton kernel's reference). Arguments as there,
    not checked here."""
    block_map = floor_k_min(unpack_bits_on_device(packed, num_kv), k_min)
    if block_map.shape[0] != heads:
        block_map = block_map.repeat(heads // block_map.shape[0], 1, 1)
    return block_map, pack_bits_on_device(block_map), block_map.sum(-1, dtype=torch.int32)
