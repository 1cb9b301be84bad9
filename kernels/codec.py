"""Mask codec: bool block maps <-> bit-packed tensors/bytes <-> FlexAttention ``BlockMask``.

A *block map* is a bool tensor ``[B or 1, H or 1, Qb, Kb]`` (any number of leading dims is
accepted by the bit codec): ``block_map[..., i, j]`` is True when query block ``i`` attends to
key block ``j``. Every conversion here is lossless.

Bit layout: bits are packed along the last (key-block) axis, most significant bit first
(``numpy.packbits`` order), so a packed map has shape ``[..., Qb, ceil(Kb / 8)]`` and dtype
uint8. The byte form adds a small self-describing header so that it decodes without side
information.
"""

from __future__ import annotations

import functools
import inspect
import struct

import numpy as np
import torch

_MAGIC = b"CHBM"
_VERSION = 1


def _check_bool_map(block_map: torch.Tensor, name: str = "block_map") -> None:
    if not isinstance(block_map, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(block_map).__name__}")
    if block_map.dtype != torch.bool:
        raise ValueError(f"{name} must have dtype torch.bool, got {block_map.dtype}")
    if block_map.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims [..., Qb, Kb], got shape {tuple(block_map.shape)}")


def pack_bits(block_map: torch.Tensor) -> torch.Tensor:
    """Pack a bool block map ``[..., Qb, Kb]`` into uint8 ``[..., Qb, ceil(Kb/8)]`` (CPU tensor)."""
    _check_bool_map(block_map)
    packed = np.packbits(block_map.detach().cpu().numpy(), axis=-1)
    return torch.from_numpy(packed)


def unpack_bits(packed: torch.Tensor, num_kv_blocks: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., Qb, ceil(Kb/8)]`` -> bool ``[..., Qb, Kb]``.

    Raises ``ValueError`` when the packed width does not match ``num_kv_blocks``.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError("packed must be a uint8 torch.Tensor")
    if num_kv_blocks < 1:
        raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
    if packed.dim() < 2 or packed.shape[-1] != (num_kv_blocks + 7) // 8:
        raise ValueError(
            f"packed last dim {tuple(packed.shape)[-1:]} does not hold {num_kv_blocks} key blocks "
            f"(expected {(num_kv_blocks + 7) // 8} bytes)"
        )
    bits = np.unpackbits(packed.cpu().numpy(), axis=-1, count=num_kv_blocks)
    return torch.from_numpy(bits.astype(bool))


_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)
_WEIGHTS_ON: dict = {}  # device -> the bit weights there (made once: a host -> device copy waits for the GPU)


def _bit_weights(device) -> torch.Tensor:
    key = str(device)
    weights = _WEIGHTS_ON.get(key)
    if weights is None:
        weights = _WEIGHTS_ON[key] = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8).to(device)
    return weights


def pack_bits_on_device(block_map: torch.Tensor) -> torch.Tensor:
    """Bit-pack a bool map ``[..., Kb]`` into uint8 ``[..., ceil(Kb/8)]`` on its own device, in the
    layout of ``chorus.kernels.codec.pack_bits`` (MSB first, numpy ``packbits`` order), so a GPU
    recording never waits for a host copy per call; :func:`unpack_bits` reads it."""
    kb = block_map.shape[-1]
    pad = (-kb) % 8
    bits = block_map.to(torch.uint8)
    if pad:
        bits = torch.cat([bits, bits.new_zeros(*bits.shape[:-1], pad)], dim=-1)
    bits = bits.reshape(*bits.shape[:-1], -1, 8)
    return (bits * _bit_weights(bits.device)).sum(-1, dtype=torch.uint8)


def unpack_bits_on_device(packed: torch.Tensor, num_kv_blocks: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits_on_device` on ``packed``'s device: bool ``[..., num_kv_blocks]``."""
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :num_kv_blocks].bool()


def encode_block_map(block_map: torch.Tensor) -> bytes:
    """Block map -> self-describing bytes: magic, version, ndim, shape (uint32 each), packed bits."""
    packed = pack_bits(block_map)
    shape = tuple(block_map.shape)
    header = _MAGIC + struct.pack("<BB", _VERSION, len(shape)) + struct.pack(f"<{len(shape)}I", *shape)
    return header + packed.numpy().tobytes()


def decode_block_map(data: bytes) -> torch.Tensor:
    """Inverse of :func:`encode_block_map`. Raises ``ValueError`` on a bad header or length."""
    if len(data) < 6 or data[:4] != _MAGIC:
        raise ValueError("not a Chorus block map (bad magic)")
    version, ndim = struct.unpack("<BB", data[4:6])
    if version != _VERSION:
        raise ValueError(f"unsupported block map version {version}")
    if ndim < 2:
        raise ValueError(f"corrupt block map header: ndim {ndim}")
    offset = 6 + 4 * ndim
    if len(data) < offset:
        raise ValueError("truncated block map header")
    shape = struct.unpack(f"<{ndim}I", data[6:offset])
    packed_shape = shape[:-1] + ((shape[-1] + 7) // 8,)
    expected = int(np.prod(packed_shape))
    if len(data) - offset != expected:
        raise ValueError(f"block map payload is {len(data) - offset} bytes, expected {expected}")
    packed = np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(packed_shape)
    return unpack_bits(torch.from_numpy(packed.copy()), shape[-1])


def to_flex_block_mask(block_map: torch.Tensor, *, block_size: int = 128, q_len: int | None = None,
                       kv_len: int | None = None):
    """Bool block map ``[B, H, Qb, Kb]`` -> FlexAttention ``BlockMask`` (all kept blocks as *full*).

    ``q_len``/``kv_len`` default to ``Qb * block_size`` / ``Kb * block_size``; for a partial last
    block pass the true lengths (FlexAttention masks the padding itself). A kept block becomes a
    full block (no ``mask_mod`` evaluation in compiled kernels). The ``mask_mod`` looks the block up
    in the map too, because FlexAttention's unfused (eager, CPU) path ignores the block structure and
    applies only ``mask_mod`` to the full score matrix. ``RuntimeError`` on a torch whose masks cannot take
    the lengths (:func:`flex_masks_unavailable`).
    """
    from torch.nn.attention.flex_attention import BlockMask

    reason = flex_masks_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    _check_bool_map(block_map)
    if block_map.dim() != 4:
        raise ValueError(f"block_map must be [B, H, Qb, Kb], got shape {tuple(block_map.shape)}")
    qb, kb = block_map.shape[-2:]
    q_len = qb * block_size if q_len is None else q_len
    kv_len = kb * block_size if kv_len is None else kv_len
    if -(-q_len // block_size) != qb or -(-kv_len // block_size) != kb:
        raise ValueError(
            f"block map grid {qb}x{kb} does not match lengths ({q_len}, {kv_len}) at block size {block_size}"
        )
    counts = block_map.sum(-1, dtype=torch.int32)
    # Stable sort puts kept block indices first, in increasing order.
    order = torch.argsort((~block_map).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    empty_counts = torch.zeros_like(counts)
    empty_indices = torch.zeros_like(order)
    dense_map = block_map

    def block_map_mod(b, h, q_idx, kv_idx):
        return dense_map[b % dense_map.shape[0], h % dense_map.shape[1], q_idx // block_size, kv_idx // block_size]

    # forward only: no transposed (query-block) lists, where this torch can skip them (>= 2.9)
    skip_q_blocks = {"compute_q_blocks": False} if _from_kv_blocks_skips_q_blocks() else {}
    return BlockMask.from_kv_blocks(
        empty_counts, empty_indices, counts, order, BLOCK_SIZE=block_size, mask_mod=block_map_mod,
        seq_lengths=(q_len, kv_len), **skip_q_blocks,
    )


def _from_kv_blocks_skips_q_blocks() -> bool:
    """Whether this torch's ``BlockMask.from_kv_blocks`` takes ``compute_q_blocks`` (torch 2.8 does not)."""
    return "compute_q_blocks" in _from_kv_blocks_parameters()


def flex_masks_unavailable() -> str | None:
    """Why this torch cannot build :func:`to_flex_block_mask`'s masks, or None: it needs
    ``BlockMask.from_kv_blocks(seq_lengths=)`` (torch >= 2.6) for lengths that are not a multiple of the block."""
    if "seq_lengths" not in _from_kv_blocks_parameters():
        return f"FlexAttention's block masks take no sequence lengths in torch {torch.__version__} (torch >= 2.6)"
    return None


@functools.cache
def _from_kv_blocks_parameters() -> frozenset:
    from torch.nn.attention.flex_attention import BlockMask

    return frozenset(inspect.signature(BlockMask.from_kv_blocks).parameters)


def from_flex_block_mask(block_mask) -> torch.Tensor:
    """FlexAttention ``BlockMask`` -> bool block map ``[B, H, Qb, Kb]`` (partial and full blocks)."""
    kb = block_mask.kv_indices.shape[-1]

    def scatter(num, idx):
        # Entries past ``num`` are undefined: count hits with scatter_add so they can't erase a kept one.
        hits = torch.zeros(idx.shape[:-1] + (kb,), dtype=torch.int32, device=idx.device)
        valid = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
        hits.scatter_add_(-1, idx.long().clamp(0, kb - 1), valid.to(torch.int32))
        return hits > 0

    dense = scatter(block_mask.kv_num_blocks, block_mask.kv_indices)
    if block_mask.full_kv_num_blocks is not None:
        dense |= scatter(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return dense
