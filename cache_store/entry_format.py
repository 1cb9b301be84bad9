"""On-disk format of one cache entry: a safetensors file (never pickle) holding compressed mask chunks.

An entry holds the masks of one request, ``{(expert, step, layer, head_group): tensor}``, and the
request's embedding. Layout of the safetensors file:

* tensor ``embedding``: float32 ``[dim]``, the embedding as given to ``Workspace.add``;
* tensors ``chunk_000``, ``chunk_001``, ...: uint8 ``[n]``, each a compressed run of map payloads;
* ``__metadata__``: ``format`` (``chorus-mask-entry``), ``version``, ``codec`` (``zstd`` / ``zlib`` /
  ``none``), ``maps`` (JSON list: key, shape, dtype, encoding, chunk, offset, nbytes, raw chunk size)
  and ``meta`` (the caller's JSON metadata, including ``signature``).

Map payloads: a bool block map ``[..., Qb, Kb]`` (any leading dims, e.g. ``[H, Qb, Kb]`` or
``[1, H, Qb, Kb]``; the shape is kept) is bit-packed with :func:`chorus.kernels.codec.pack_bits`
(``[..., Qb, ceil(Kb/8)]`` uint8, MSB first). Float16 / bfloat16 / float32 / uint8 / int8 tensors
(e.g. quantised block mass) are stored as raw little-endian bytes. Payloads are ordered by
``(layer, head_group, expert, step)`` so that the maps of one layer at successive steps sit next
to each other, where the compressor finds their redundancy, and are cut into chunks of about
``CHUNK_RAW_BYTES`` that (de)compress in parallel threads (zstd and zlib release the GIL).

Loading can stop at the packed form (:class:`PackedMap`): a Wan 14B 480p entry is ~52 MB of packed
bits but ~420 MB of bool, so the engine should move the packed bits to the GPU and unpack there
(:meth:`PackedMap.unpack` works on any device).

torch is imported by :func:`encode_entry` and :func:`decode_entry`, where tensors are made; the header
functions (:func:`read_meta`, the caps) and :func:`decode_entry_arrays` (every check of decoding, on numpy
arrays: what ``verify`` runs) need none, so the command line never pays its import.

Bad input to :func:`encode_entry` raises ``ValueError``; a file that does not decode raises
:class:`EntryFormatError` (a ``ValueError``).

Hostile bytes cost at most what they state, within caps (checked before anything is allocated):

* JSON (the header, the map records, the caller's meta) nested deeper than ``MAX_JSON_DEPTH`` is
  refused, on decode (:class:`EntryFormatError`) and on encode (``ValueError``); the caller's meta
  must serialise to at most ``MAX_META_BYTES``.
* Chunk sizes must equal the summed sizes of the map records that lie in them (the layout the
  encoder writes), so a chunk is never decompressed past what its records need, and decompression
  (zstd and zlib alike) stops at the declared size.
* The maps' total element count (= the bytes of the unpacked bool maps) is capped: by
  :func:`geometry_element_cap` of the entry's signature when the signature states its geometry
  (``token_grid``, ``block_size``, ``num_layers``, ``num_heads``, ``step_sigmas``: the engine's
  signatures do), else by ``MAX_ENTRY_ELEMENTS``; raw chunk bytes by ``MAX_ENTRY_RAW_BYTES``.
  :func:`encode_entry` refuses masks past the same caps, so every entry it writes decodes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

try:  # zstd compresses bit maps ~3x better than zlib (window >= one layer's maps); zlib is the fallback.
    import zstandard as _zstd
except ImportError:  # pragma: no cover - exercised only where zstandard is absent
    _zstd = None

if TYPE_CHECKING:  # torch is imported where a tensor is made: the header-level functions need none
    import torch

LOG = logging.getLogger(__name__)

FORMAT = "chorus-mask-entry"
VERSION = 1
CHUNK_RAW_BYTES = 4 << 20
MAX_ENTRY_RAW_BYTES = 2 << 30  # decompressed size ceiling (a Wan 14B 1080p 4-step entry is ~1.4 GB of bits)
MAX_ENTRY_ELEMENTS = 8 * MAX_ENTRY_RAW_BYTES  # map elements (unpacked bool bytes) of a signature without geometry
MAX_HEADER_BYTES = 100 << 20  # safetensors header (JSON) of one entry
MAX_META_BYTES = 16 << 20  # the caller's meta, as JSON
MAX_JSON_DEPTH = 64  # nesting of any JSON the store reads or writes
GEOMETRY_SLACK = 1.25  # block-count slack per map side over ceil(tokens / block_size) (token reordering pads)
ZSTD_LEVEL = 3
ZLIB_LEVEL = 6
_THREADS = max(1, min(4, os.cpu_count() or 1))

_RAW_ITEMSIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "uint8": 1, "int8": 1}  # raw payload dtypes, bytes each


class EntryFormatError(ValueError):
    """The bytes are not a valid Chorus entry (truncated, corrupt, wrong format or version)."""


@dataclass
class PackedMap:
    """A bool block map kept bit-packed: ``bits`` uint8 ``[..., Qb, ceil(Kb/8)]`` of map ``shape``."""

    bits: torch.Tensor
    shape: tuple

    def unpack(self, device=None) -> torch.Tensor:
        """Bool ``shape`` tensor on ``device`` (default: where ``bits`` is). The unpack runs on that device."""
        from ..kernels.codec import unpack_bits, unpack_bits_on_device

        bits = self.bits if device is None else self.bits.to(device, non_blocking=True)
        if bits.device.type == "cpu":
            return unpack_bits(bits, self.shape[-1]).reshape(self.shape)
        return unpack_bits_on_device(bits, self.shape[-1]).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return self.bits.numel()


def json_depth_ok(obj, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``obj`` (decoded JSON, or a dict/list tree) nests at most ``limit`` containers deep.
    Iterative: any depth is checked without recursion."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def loads_bounded(text, what: str):
    """``json.loads`` that raises :class:`EntryFormatError` for invalid JSON and for nesting past
    ``MAX_JSON_DEPTH`` (also where the decoder itself would hit the recursion limit)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise EntryFormatError(f"{what}: JSON nested too deeply") from None
    except (ValueError, TypeError) as exc:
        raise EntryFormatError(f"{what}: invalid JSON ({exc})") from None
    if not json_depth_ok(value):
        raise EntryFormatError(f"{what}: JSON nested deeper than {MAX_JSON_DEPTH}")
    return value


def _positive_int(value) -> int | None:
    return value if type(value) is int and value > 0 else None


def geometry_element_cap(signature) -> int | None:
    """The most map elements an entry of this signature can hold, from its geometry: steps x layers
    x head groups x heads x ``nb``², ``nb`` = ``GEOMETRY_SLACK`` x ceil(tokens / block_size) + 8.
    ``None`` when the signature does not state ``token_grid`` (3 positive ints), ``block_size``,
    ``num_layers``, ``num_heads`` (positive ints) and ``step_sigmas`` (a list). A tuple counts as a list
    (the stored JSON turns one into the other, so an entry's cap is the same when written and read)."""
    if not isinstance(signature, dict):
        return None
    grid = signature.get("token_grid")
    block = _positive_int(signature.get("block_size"))
    layers = _positive_int(signature.get("num_layers"))
    heads = _positive_int(signature.get("num_heads"))
    steps = signature.get("step_sigmas")
    groups = signature.get("head_groups", 1)
    groups = _positive_int(groups) if groups is not None else 1
    if not (isinstance(grid, (list, tuple)) and len(grid) == 3 and all(_positive_int(g) for g in grid)) \
            or None in (block, layers, heads, groups) or not isinstance(steps, (list, tuple)) or not steps:
        return None
    blocks = math.ceil(math.prod(grid) / block)
    nb = math.ceil(GEOMETRY_SLACK * blocks) + 8
    return len(steps) * layers * groups * heads * nb * nb


def element_cap(signature) -> int:
    """The element cap that applies to an entry of ``signature`` (see the module docstring)."""
    cap = geometry_element_cap(signature)
    return MAX_ENTRY_ELEMENTS if cap is None else min(cap, MAX_ENTRY_ELEMENTS)


def validate_key(key) -> tuple:
    """Check a mask key ``(expert, step, layer, head_group)``: 4 items, each an int or a str."""
    if not isinstance(key, (tuple, list)) or len(key) != 4:
        raise ValueError(f"mask key must be a tuple (expert, step, layer, head_group), got {key!r}")
    for item in key:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise ValueError(f"mask key items must be int or str, got {item!r} in {key!r}")
    return tuple(key)


def _order(key: tuple):
    expert, step, layer, head_group = key

    def norm(v):
        return (0, v, "") if isinstance(v, int) else (1, 0, v)

    return (norm(layer), norm(head_group), norm(expert), norm(step))


def _compress(codec: str, data: bytes) -> bytes:
    if codec == "zstd":
        return _zstd.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    if codec == "zlib":
        return zlib.compress(data, ZLIB_LEVEL)
    return data


def _decompress_into(codec: str, blob: memoryview, out: np.ndarray) -> None:
    view = memoryview(out)
    if codec == "zstd":
        if _zstd is None:
            raise EntryFormatError("entry is zstd-compressed but the zstandard package is not installed")
        reader = _zstd.ZstdDecompressor().stream_reader(blob)
        filled = 0
        while filled < len(view):
            got = reader.readinto(view[filled:])
            if not got:
                break
            filled += got
        extra = reader.read(1)
    elif codec == "zlib":
        inflater = zlib.decompressobj()
        data = inflater.decompress(blob, len(view) + 1)  # never more than the declared size + 1
        filled = min(len(data), len(view))
        view[:filled] = data[:filled]
        extra = data[filled:] or inflater.unconsumed_tail[:1]
    elif codec == "none":
        filled = min(len(blob), len(view))
        view[:filled] = blob[:filled]
        extra = blob[filled:]
    else:
        raise EntryFormatError(f"unknown codec {codec!r}")
    if filled != len(view) or len(extra):
        raise EntryFormatError(f"chunk decompressed to the wrong size (expected {len(view)} bytes)")


def default_codec() -> str:
    return "zstd" if _zstd is not None else "zlib"


def encode_entry(embedding, masks: dict, meta: dict, *, codec: str | None = None) -> bytes:
    """Serialise one entry to safetensors bytes.

    ``embedding``: 1-D float array-like (finite). ``masks``: non-empty dict ``key -> tensor`` (bool
    block maps with >= 2 dims, or float16/bfloat16/float32/uint8/int8 tensors). ``meta``:
    JSON-serialisable dict, nested at most ``MAX_JSON_DEPTH`` deep, at most ``MAX_META_BYTES`` as
    JSON. Raises ``ValueError`` on anything else, and for masks past the element cap of
    ``meta["signature"]`` (:func:`element_cap`) or past ``MAX_ENTRY_RAW_BYTES``.
    """
    import torch
    from safetensors.torch import save as st_save

    codec = codec or default_codec()
    if codec not in ("zstd", "zlib", "none"):
        raise ValueError(f"unknown codec {codec!r}")
    emb = torch.as_tensor(np.asarray(embedding, dtype=np.float32)).reshape(-1).contiguous()
    meta_json = _meta_json(meta)
    items = _mask_payloads(masks)
    elements = sum(math.prod(shape) for *_, shape, _ in items)
    cap = element_cap(meta.get("signature") if isinstance(meta, dict) else None)
    if elements > cap:
        raise ValueError(f"masks hold {elements} elements, more than the {cap} that an entry of this signature "
                         "may hold (its token grid, block size, layers, heads and steps)")
    if sum(payload.numel() for *_, payload in items) > MAX_ENTRY_RAW_BYTES:
        raise ValueError(f"masks take more than {MAX_ENTRY_RAW_BYTES} bytes")
    records, raw_chunks = _chunked(items)
    with ThreadPoolExecutor(_THREADS) as pool:
        blobs = list(pool.map(lambda data: _compress(codec, data), raw_chunks))

    tensors = {"embedding": emb}
    for i, blob in enumerate(blobs):
        tensors[f"chunk_{i:03d}"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
    metadata = {
        "format": FORMAT,
        "version": str(VERSION),
        "codec": codec,
        "chunk_raw_sizes": json.dumps([len(c) for c in raw_chunks]),
        "maps": json.dumps(records),
        "meta": meta_json,
    }
    return st_save(tensors, metadata=metadata)


def _meta_json(meta) -> str:
    """``meta`` as the canonical JSON an entry stores (sorted keys, no NaN); ``ValueError`` past
    ``MAX_JSON_DEPTH`` levels or ``MAX_META_BYTES`` bytes, or for anything JSON cannot hold."""
    if not json_depth_ok(meta):
        raise ValueError(f"meta is nested deeper than {MAX_JSON_DEPTH} levels; the store cannot keep it")
    try:
        meta_json = json.dumps(meta, sort_keys=True, allow_nan=False)
    except RecursionError:
        raise ValueError("meta is nested too deeply; the store cannot keep it") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"meta must be JSON-serialisable: {exc}") from exc
    if len(meta_json) > MAX_META_BYTES:
        raise ValueError(f"meta is {len(meta_json)} bytes as JSON; the store keeps at most {MAX_META_BYTES}")
    return meta_json


def _mask_payloads(masks) -> list:
    """``masks`` as ``(key, encoding, dtype name, shape, uint8 payload)`` in the store's key order: a bool block
    map bit-packed (``"bits"``), any other tensor as its raw bytes (``"raw"``). ``ValueError`` for an empty or
    non-dict ``masks``, a bad or duplicate key, a non-tensor, a bool map under 2 dims, an unsupported dtype,
    or a float tensor holding NaN or inf."""
    import torch

    from ..kernels.codec import pack_bits

    if not isinstance(masks, dict) or not masks:
        raise ValueError("masks must be a non-empty dict {(expert, step, layer, head_group): tensor}")
    items = []
    for key, value in masks.items():
        key = validate_key(key)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"mask {key!r} must be a torch.Tensor, got {type(value).__name__}")
        value = value.detach().cpu()
        if value.dtype == torch.bool:
            if value.dim() < 2:
                raise ValueError(f"bool block map {key!r} must have >= 2 dims [..., Qb, Kb], got {tuple(value.shape)}")
            items.append((key, "bits", "bool", tuple(value.shape), pack_bits(value).contiguous()))
            continue
        name = str(value.dtype).replace("torch.", "")
        if name not in _RAW_ITEMSIZES:
            raise ValueError(f"mask {key!r} has unsupported dtype {value.dtype}")
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ValueError(f"mask {key!r} holds NaN or inf")
        items.append((key, "raw", name, tuple(value.shape), value.contiguous().reshape(-1).view(torch.uint8)))
    if len({k for k, *_ in items}) != len(items):
        raise ValueError("duplicate mask keys")
    items.sort(key=lambda item: _order(item[0]))
    return items


def _chunked(items: list) -> tuple[list, list]:
    """``(records, raw_chunks)``: the payloads of ``items`` (from :func:`_mask_payloads`) joined in order into
    chunks of about ``CHUNK_RAW_BYTES`` raw bytes (a payload is never split; one larger than that is a chunk of
    its own), and each map's record (key, encoding, dtype, shape, chunk, offset, nbytes)."""
    chunks, current, current_size, records = [], [], 0, []
    for key, encoding, dtype, shape, payload in items:
        if current and current_size + payload.numel() > CHUNK_RAW_BYTES:
            chunks.append(current)
            current, current_size = [], 0
        records.append({"key": list(key), "encoding": encoding, "dtype": dtype, "shape": list(shape),
                        "chunk": len(chunks), "offset": current_size, "nbytes": int(payload.numel())})
        current.append(payload.numpy().tobytes() if payload.numel() else b"")
        current_size += payload.numel()
    chunks.append(current)
    return records, [b"".join(parts) for parts in chunks]


def _read_metadata(data: bytes) -> dict:
    if len(data) < 8:
        raise EntryFormatError("entry file is truncated (no safetensors header)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8 or header_len > MAX_HEADER_BYTES:
        raise EntryFormatError("entry file is truncated or has a corrupt header length")
    header = loads_bounded(bytes(data[8 : 8 + header_len]), "corrupt safetensors header")
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise EntryFormatError("not a Chorus mask entry (format tag missing)")
    if metadata.get("version") != str(VERSION):
        raise EntryFormatError(f"unsupported entry version {metadata.get('version')!r}")
    return metadata


def read_meta(data: bytes) -> dict:
    """The caller's ``meta`` dict of an entry, from the header only."""
    try:
        return loads_bounded(_read_metadata(data)["meta"], "corrupt entry metadata")
    except (KeyError, TypeError) as exc:
        raise EntryFormatError(f"corrupt entry metadata: {exc}") from exc


def _check_records(records, raw_sizes, meta, max_elements):
    """Validate the map records (keys, each once; encodings; sizes against shapes and chunk sizes; the element cap)
    before any allocation; returns ``[(key, encoding, dtype, shape, chunk, offset, nbytes)]``."""
    cap = element_cap(meta.get("signature"))
    if max_elements is not None:
        cap = min(cap, int(max_elements))
    plan, elements, keys = [], 0, set()
    per_chunk = [0] * len(raw_sizes)
    for rec in records:
        try:
            if not isinstance(rec, dict):
                raise TypeError("a map record must be an object")
            key = validate_key(rec["key"])
            shape = rec["shape"]
            if not isinstance(shape, list) or len(shape) > 8 or not all(type(s) is int and s >= 0 for s in shape):
                raise ValueError(f"shape must be a list of at most 8 ints >= 0, got {shape!r}")
            shape = tuple(shape)
            chunk, offset, nbytes = rec["chunk"], rec["offset"], rec["nbytes"]
            if not all(type(v) is int and v >= 0 for v in (chunk, offset, nbytes)):
                raise ValueError("chunk, offset and nbytes must be ints >= 0")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EntryFormatError(f"corrupt map record {str(rec)[:200]}: {exc}") from exc
        if chunk >= len(raw_sizes) or offset + nbytes > raw_sizes[chunk]:
            raise EntryFormatError(f"map {key!r} lies outside its chunk")
        encoding, dtype_name = rec.get("encoding"), rec.get("dtype")
        if encoding == "bits":
            if len(shape) < 2 or math.prod(shape[:-1]) * ((shape[-1] + 7) // 8) != nbytes:
                raise EntryFormatError(f"map {key!r}: {nbytes} bytes do not hold bit-packed shape {shape}")
        elif encoding == "raw" and isinstance(dtype_name, str) and dtype_name in _RAW_ITEMSIZES:
            if math.prod(shape) * _RAW_ITEMSIZES[dtype_name] != nbytes:
                raise EntryFormatError(f"map {key!r}: {nbytes} bytes do not hold {dtype_name} {shape}")
        else:
            raise EntryFormatError(f"map {key!r}: unknown encoding {str(encoding)[:40]!r}")
        if math.prod(max(s, 1) for s in shape) > cap:  # a zero elsewhere must not let a huge dimension pass
            raise EntryFormatError(f"map {key!r}: shape {shape} is past the cap of {cap} elements")
        elements += math.prod(shape)
        if elements > cap:
            raise EntryFormatError(f"maps declare more than {cap} elements, the cap of this entry's signature")
        if key in keys:
            raise EntryFormatError(f"map {key!r} appears twice")
        keys.add(key)
        per_chunk[chunk] += nbytes
        plan.append((key, encoding, dtype_name, shape, chunk, offset, nbytes))
    if per_chunk != list(raw_sizes):
        raise EntryFormatError("chunk sizes do not match the sizes of the maps they hold")
    return plan


def decode_entry_arrays(data: bytes, *, max_elements: int | None = None):
    """Parse and check entry bytes without torch -> ``(payloads, embedding, meta)``.

    ``payloads``: ``[(key, encoding, dtype, shape, payload)]`` in file order, ``payload`` a uint8 numpy array:
    for ``encoding == "bits"`` the bit-packed map ``[..., Qb, ceil(Kb/8)]`` of bool ``shape``, for ``"raw"`` the
    little-endian bytes of a ``dtype`` tensor of ``shape`` (flat). ``embedding``: float32 ``[dim]``. Every check of
    :func:`decode_entry` runs here (what ``cache verify`` needs); raises :class:`EntryFormatError` on any
    inconsistency, and before allocating anything for maps past the caps of the module docstring
    (``max_elements``, if given, lowers the element cap further). ``MemoryError`` (this machine cannot
    allocate what an entry within the caps needs) leaves as it is: a fault of the moment, not of the entry.
    """
    from safetensors.numpy import load as st_load

    metadata = _read_metadata(data)
    try:
        codec = metadata["codec"]
        raw_sizes = loads_bounded(metadata["chunk_raw_sizes"], "chunk sizes")
        records = loads_bounded(metadata["maps"], "map records")
        meta = loads_bounded(metadata["meta"], "entry metadata")
    except (KeyError, TypeError) as exc:
        raise EntryFormatError(f"corrupt entry: missing or bad header field {exc}") from exc
    if not isinstance(raw_sizes, list) or not all(type(s) is int and s >= 0 for s in raw_sizes) \
            or sum(raw_sizes) > MAX_ENTRY_RAW_BYTES:
        raise EntryFormatError(f"chunk sizes must be a list of ints in [0, {MAX_ENTRY_RAW_BYTES}] in all")
    if not isinstance(records, list):
        raise EntryFormatError("the map records must be a list")
    if not isinstance(meta, dict):
        raise EntryFormatError(f"corrupt entry: metadata must be a JSON object, got {type(meta).__name__}")
    plan = _check_records(records, raw_sizes, meta, max_elements)
    try:
        arrays = st_load(bytes(data) if not isinstance(data, bytes) else data)
        embedding = arrays["embedding"]
        blobs = [arrays[f"chunk_{i:03d}"] for i in range(len(raw_sizes))]
    except MemoryError:
        raise
    except Exception as exc:  # safetensors raises its own error types on corrupt bytes (and on dtypes numpy lacks)
        raise EntryFormatError(f"corrupt entry: {exc}") from exc
    if embedding.dtype != np.float32 or embedding.ndim != 1:
        raise EntryFormatError("corrupt entry: embedding must be float32 [dim]")
    if any(blob.dtype != np.uint8 or blob.ndim != 1 for blob in blobs):
        raise EntryFormatError("corrupt entry: chunks must be uint8 [n]")

    buffers = [np.empty(size, dtype=np.uint8) for size in raw_sizes]  # MemoryError: this machine, not the entry
    jobs = [(codec, memoryview(blob), buf) for blob, buf in zip(blobs, buffers)]
    try:
        if len(jobs) > 1:
            with ThreadPoolExecutor(_THREADS) as pool:
                list(pool.map(lambda job: _decompress_into(*job), jobs))
        else:
            for job in jobs:
                _decompress_into(*job)
    except (EntryFormatError, MemoryError):
        raise
    except Exception as exc:  # zstd/zlib errors on corrupt blobs
        raise EntryFormatError(f"corrupt chunk: {exc}") from exc

    payloads = []  # the records' keys, encodings and sizes were checked by _check_records
    for key, encoding, dtype_name, shape, chunk, offset, nbytes in plan:
        payload = buffers[chunk][offset : offset + nbytes]
        if encoding == "bits":
            payload = payload.reshape(shape[:-1] + ((shape[-1] + 7) // 8,))
        payloads.append((key, encoding, dtype_name, shape, payload))
    return payloads, embedding.copy(), meta  # the copy: safetensors' arrays are read-only views of ``data``


def decode_entry(data: bytes, *, packed: bool = False, max_elements: int | None = None):
    """Parse entry bytes -> ``(masks, embedding, meta)``.

    Bool maps come back as bool tensors of their original shape, or as :class:`PackedMap` when
    ``packed`` is true; other dtypes come back as tensors; ``embedding`` a float32 ``[dim]`` tensor. The checks
    (and their errors: :class:`EntryFormatError`) are :func:`decode_entry_arrays`'.
    """
    import torch

    payloads, embedding, meta = decode_entry_arrays(data, max_elements=max_elements)
    masks = {}
    for key, encoding, dtype_name, shape, payload in payloads:
        tensor = torch.from_numpy(payload)
        if encoding == "bits":
            packed_map = PackedMap(tensor, shape)
            masks[key] = packed_map if packed else packed_map.unpack()
        else:
            masks[key] = tensor.view(getattr(torch, dtype_name)).reshape(shape)
    return masks, torch.from_numpy(embedding), meta
