"""What both stores share about one entry: the checked and encoded new entry, the size caps, the
error of a damaged entry.

:func:`encode_new_entry` checks and encodes a new entry once, the same way for the one-host
workspace and the fleet store, so the bytes and the refusals are the same everywhere. Tested
through both stores (``tests/test_cache_workspace.py``, ``tests/test_fleet_store.py``,
``tests/test_cache_hardening.py::test_deep_json_is_quarantined_and_refused_by_add``).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import numpy as np

from .entry_format import MAX_ENTRY_RAW_BYTES, MAX_HEADER_BYTES, encode_entry, json_depth_ok
from .rows import QUIET_FLOATS, check_embedding
from .signature import signature_key

DEFAULT_MAX_BYTES = 20 << 30  # a store's default size cap
MAX_ENTRY_FILE_BYTES = MAX_ENTRY_RAW_BYTES + MAX_HEADER_BYTES + (1 << 20)  # an entry file never exceeds this


@dataclass(frozen=True)
class NewEntry:
    """A new entry, checked and encoded: what every store writes (see :func:`encode_new_entry`)."""

    sig_key: str
    embedding: np.ndarray  # float32 [dim], as given (rows.check_embedding)
    data: bytes            # the entry file's bytes
    digest: str            # sha256 of ``data``
    meta_json: str
    created: float


def encode_new_entry(embedding, masks: dict, meta: dict) -> NewEntry:
    """Check and encode a new entry once, the same way for every store (one-host and fleet).

    Raises ``ValueError`` for metadata without a ``"signature"`` dict or nested deeper than 64 levels,
    an embedding ``rows.check_embedding`` refuses (NaN/inf/zero, more than ``MAX_EMBEDDING_DIM``
    values: the checks every row read back passes too), masks the entry format refuses, and an entry larger than the
    ``MAX_ENTRY_FILE_BYTES`` a store ever reads back (so nothing is written that could not be loaded).
    ``meta`` gets ``"created"`` when it has none (the caller's dict is not modified)."""
    if not isinstance(meta, dict) or not isinstance(meta.get("signature"), dict):
        raise ValueError('meta must be a dict holding a "signature" dict')
    if not json_depth_ok(meta):
        raise ValueError("meta is nested deeper than 64 levels; the store cannot keep it")
    sig_key = signature_key(meta["signature"])
    with np.errstate(**QUIET_FLOATS):
        emb = check_embedding(embedding)
    now = time.time()
    meta = dict(meta)
    meta.setdefault("created", now)
    data = encode_entry(emb, masks, meta)
    if len(data) > MAX_ENTRY_FILE_BYTES:
        raise ValueError(f"the entry takes {len(data)} bytes, more than the {MAX_ENTRY_FILE_BYTES} the store reads")
    return NewEntry(sig_key, emb, data, hashlib.sha256(data).hexdigest(), json.dumps(meta, sort_keys=True), now)


class CorruptEntryError(ValueError):
    """An entry failed its checks (file kind, size, checksum, decoding); it has been quarantined
    (or, on a read-only or busy store, set aside for this handle)."""


class EntryGone(Exception):
    """The entry's row disappeared (evicted or removed) while it was being read: not damage."""


RUN_COUNTERS = ("sparse_calls", "tail_calls", "fallback_calls")
"""What the hits of an entry did with its maps, summed per entry beside ``hits`` (``touch(entry_id, run=)``):
self-attention calls on the sparse path, of them with the pooled tail, and calls that fell back to dense."""


def run_counts(run) -> tuple[int, ...]:
    """``run`` (None or a mapping of some :data:`RUN_COUNTERS` to non-negative ints) as one int per
    counter, in :data:`RUN_COUNTERS` order. ``ValueError`` for an unknown name or a bad count, before
    anything is counted."""
    if run is None:
        return (0,) * len(RUN_COUNTERS)
    if not hasattr(run, "items"):
        raise ValueError(f"run stats must be a mapping of {', '.join(RUN_COUNTERS)} to counts, not {type(run).__name__}")
    unknown = sorted(str(k) for k in run if k not in RUN_COUNTERS)
    if unknown:
        raise ValueError(f"unknown run stats {unknown} (known: {', '.join(RUN_COUNTERS)})")
    counts = []
    for name in RUN_COUNTERS:
        value = run.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) < 2 ** 62:
            raise ValueError(f"run stat {name} must be a non-negative int, not {value!r}")
        counts.append(int(value))
    return tuple(counts)


def add_counts(counts: tuple[int, ...] | None, more: tuple[int, ...]) -> tuple[int, ...]:
    """Two :func:`run_counts` tuples added (``counts`` None: ``more``)."""
    return more if counts is None else tuple(a + b for a, b in zip(counts, more))
