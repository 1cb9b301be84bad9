"""What both stores share about one entry: the checked and encoded new entry, the size caps, the
error of a damaged entry, the hits and run stats not written yet; the checks of a search and of a
deduplicating add (:func:`search_index`, :func:`similarity_bound`).

:func:`encode_new_entry` checks and encodes a new entry once, the same way for the one-host
workspace and the fleet store, so the bytes and the refusals are the same everywhere. Tested
through both stores (``tests/test_cache_workspace.py``, ``tests/test_fleet_store.py``,
``tests/test_cache_hardening.py::test_deep_json_is_quarantined_and_refused_by_add``).
:class:`PendingHits` keeps each store's hits and run stats that could not be written yet; tested
through both stores with the store busy or PostgreSQL gone mid-flush
(``tests/test_cache_workspace.py``, ``tests/test_fleet_store.py``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .entry_format import MAX_ENTRY_RAW_BYTES, MAX_HEADER_BYTES, encode_entry, json_depth_ok
from .index import normalise
from .rows import QUIET_FLOATS, check_embedding
from .signature import signature_key

DEFAULT_MAX_BYTES = 20 << 30  # a store's default size cap
MAX_ENTRY_ID = (1 << 63) - 1  # ids are signed 64-bit in SQLite and PostgreSQL alike
MAX_ENTRY_FILE_BYTES = MAX_ENTRY_RAW_BYTES + MAX_HEADER_BYTES + (1 << 20)  # an entry file never exceeds this


def checked_entry_id(entry_id) -> int:
    """An entry id argument of ``load``, ``remove``, ``touch`` and ``entry_path``, as both stores take
    it: an ``int`` (a numpy integer too), neither a ``bool`` nor a ``float`` (``1.7`` is not entry 1):
    else ``ValueError``. An int no entry can have (outside ``[1, MAX_ENTRY_ID]``) is a ``KeyError``
    like any unknown id, raised before anything is counted or sent to the database."""
    if isinstance(entry_id, (bool, np.bool_)) or not isinstance(entry_id, (int, np.integer)):
        raise ValueError(f"an entry id is an int, got {type(entry_id).__name__} {entry_id!r:.40}")
    value = int(entry_id)
    if not 1 <= value <= MAX_ENTRY_ID:
        raise KeyError(f"no entry {value}")
    return value


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


def check_k(k) -> None:
    """``ValueError`` unless ``k`` (a search's result count) is an int >= 1 (a bool is not)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")


def search_index(index, embedding, k, signature) -> list[tuple[int, float]]:
    """A store's ``search`` on its worker's index (``PartitionedIndex``, or None for an empty store): the
    top ``k`` ``(entry_id, cosine)``, best first, restricted to ``signature`` (a signature dict, its
    :func:`~chorus.cache_store.signature.signature_key`, or None). Raises ``ValueError`` for a ``k`` that
    is not an int >= 1 and, even on an empty store, for a query that is NaN/inf or zero. The caller
    holds its index's lock."""
    check_k(k)
    key = None if signature is None else (signature if isinstance(signature, str) else signature_key(signature))
    if index is None:
        normalise(np.asarray(embedding, dtype=np.float32).reshape(1, -1))
        return []
    return index.search(embedding, int(k), key)


def similarity_bound(min_similarity) -> float:
    """``add_unique``'s ``min_similarity`` as a float; ``ValueError`` for NaN or a non-number."""
    try:
        bound = float(min_similarity)
    except (TypeError, ValueError):
        raise ValueError(f"min_similarity must be a number, got {min_similarity!r}") from None
    if bound != bound:
        raise ValueError("min_similarity must be a number")
    return bound


def serving_entry(index, embedding, sig_key: str, min_similarity: float, replacing) -> int | None:
    """``add_unique``'s check, under the store's writer lock: the id of an entry of signature ``sig_key``
    whose cosine with ``embedding`` (a checked float32 vector) is >= ``min_similarity``, other than
    ``replacing`` (an entry the new one replaces: a hit that failed its verification for this very
    request does not serve it); None when there is none. The caller holds its index's lock."""
    found = index.search(embedding, 2, sig_key) if index is not None else []
    for entry_id, similarity in found:
        if similarity >= min_similarity and (replacing is None or int(entry_id) != int(replacing)):
            return int(entry_id)
    return None


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
    """Two count tuples of one shape added element-wise (``counts`` None: ``more``)."""
    return more if counts is None else tuple(a + b for a, b in zip(counts, more))


COUNTED = ("hits", *RUN_COUNTERS)
"""The columns a flush of :class:`PendingHits` adds to, in the order of a pending tuple."""


def counted_increments(columns: tuple[str, ...], placeholder: str) -> str:
    """The SET clause of a flush that adds a pending tuple's counts to ``columns`` (a prefix of :data:`COUNTED`),
    with the store's parameter ``placeholder`` (``"?"`` SQLite, ``"%s"`` PostgreSQL): ``"hits = hits + ?, ..."``."""
    return ", ".join(f"{name} = {name} + {placeholder}" for name in columns)


class PendingHits:
    """The hits a store has counted but not written yet, with their run stats: one map, entry id ->
    ``(hits, *run counts)`` (:data:`COUNTED` order). Both stores keep one per handle (thread-safe; its
    lock is taken alone, never around another).

    :meth:`add` counts one hit (``load(touch=True)``'s, or ``touch``'s with its :func:`run_counts`);
    :meth:`flushing` hands the store everything pending to write in one transaction and, when the
    write fails, merges it back with what was counted meanwhile: a hit and its run stats are written
    once, or stay pending together, never counted twice. :attr:`hits` is what ``close`` reports when it
    cannot write them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[int, tuple[int, ...]] = {}

    def add(self, entry_id: int, runs: tuple[int, ...] = (0,) * len(RUN_COUNTERS)) -> None:
        """One hit of ``entry_id`` with its run counts (a :func:`run_counts` tuple)."""
        self._merge({int(entry_id): (1, *runs)})

    def _merge(self, batch: dict[int, tuple[int, ...]]) -> None:
        with self._lock:
            for entry_id, counts in batch.items():
                self._counts[entry_id] = add_counts(self._counts.get(entry_id), counts)

    @contextmanager
    def flushing(self):
        """Context manager: takes everything pending, as ``{entry_id: (hits, *run counts)}`` (empty when
        nothing is), for the store to write in the ``with`` block; if the block raises, the batch is
        merged back (kept for the next write) and the error goes on."""
        with self._lock:
            batch, self._counts = self._counts, {}
        try:
            yield batch
        except BaseException:
            self._merge(batch)
            raise

    @property
    def hits(self) -> int:
        """The number of hits pending, over all entries."""
        with self._lock:
            return sum(counts[0] for counts in self._counts.values())

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._counts)
