"""Checks of what a store reads back from its own tables, the same for both stores.

A row is not trusted because the store wrote it: a one-host workspace's SQLite file may have been
edited, and the fleet's PostgreSQL tables are writable by every worker (one of them may be buggy
or compromised). Whatever reads a row (an open, the change feed, a load, ``verify``, a listing)
checks it with these functions before using it, and the same functions check a new entry before
it is written, so that a row passes exactly when a local ``add`` would have accepted it:

* :func:`check_embedding`: a 1-D vector of ``dim`` finite float32 values, ``1 <= dim <=
  MAX_EMBEDDING_DIM``, that normalises (:func:`~chorus.cache_store.index.normalise`);
* :func:`is_digest` / :func:`is_sig_key`: a sha256 is 64 lowercase hex digits (the fleet's local
  tier builds file names from it), a signature key 32 (``signature.signature_key``);
* :func:`row_meta`: row metadata is JSON text of at most ``MAX_META_BYTES``, nested at most
  ``MAX_JSON_DEPTH`` deep, holding an object; anything else reads as ``{"unreadable": reason}``;
* :func:`check_entry_matches_row`: a decoded entry carries the signature and the embedding its
  row states.

Every check raises ``ValueError`` (or returns a marker) and never costs more than the bytes it is
given; the callers bound those bytes before fetching them (the fleet in SQL, see ``fleet.py``).
Tested in ``tests/test_fleet_hostile.py::test_hostile_rows_never_stop_an_open_a_feed_or_a_listing``
and ``tests/test_cache_hardening.py::test_rows_edited_in_sqlite_never_stop_an_open_or_a_listing``.
"""

from __future__ import annotations

import math
import numbers
import re

import numpy as np

from .entry_format import MAX_META_BYTES, EntryFormatError, loads_bounded
from .index import NORM_SAFE, normalise
from .signature import signature_key

MAX_EMBEDDING_DIM = 16384  # 64 KiB per embedding; the default embedder has 512
QUIET_FLOATS = dict(over="ignore", under="ignore", invalid="ignore")  # np.errstate(**QUIET_FLOATS)
DIGEST_CHARS = 64  # a sha256 in hex
SIG_KEY_CHARS = 32  # signature.signature_key
_DIGEST = re.compile(r"[0-9a-f]{%d}" % DIGEST_CHARS)
_SIG_KEY = re.compile(r"[0-9a-f]{%d}" % SIG_KEY_CHARS)


def check_dim(dim) -> int:
    """An embedding dimension as an int in ``[1, MAX_EMBEDDING_DIM]``; ``ValueError`` otherwise."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or not 1 <= int(dim) <= MAX_EMBEDDING_DIM:
        raise ValueError(f"embedding dimension must be an int in [1, {MAX_EMBEDDING_DIM}], got {dim!r}")
    return int(dim)


def check_embedding(vector, dim: int | None = None) -> np.ndarray:
    """``vector`` (array-like, or a row's raw float32 bytes) as a float32 ``[d]`` array after the
    checks of the module docstring (``d == dim`` when ``dim`` is given). Raises ``ValueError``.
    Costs one dot product for a sound vector; callers checking many rows wrap the loop in
    :data:`QUIET_FLOATS` (an overflowing row would otherwise print numpy's RuntimeWarning)."""
    if isinstance(vector, (bytes, bytearray, memoryview)):
        raw = memoryview(vector)
        if raw.nbytes % 4:
            raise ValueError(f"embedding of {raw.nbytes} bytes is not a float32 vector")
        vec = np.frombuffer(raw, dtype=np.float32)
    else:
        vec = np.asarray(vector, dtype=np.float32).reshape(-1)
    if dim is None:
        check_dim(vec.size)
    elif vec.size != dim:  # (``dim`` itself was checked by the caller, once)
        raise ValueError(f"embedding has dim {vec.size}, this workspace holds dim {dim}")
    energy = float(np.dot(vec, vec))  # within this range the values are finite and the norm is sound
    if not NORM_SAFE[0] ** 2 < energy < NORM_SAFE[1] ** 2:
        normalise(vec)  # the careful way: NaN/inf or a zero norm raise, tiny or huge values normalise
    return vec


def is_digest(value) -> bool:
    """Whether ``value`` is a sha256 hex digest as the stores write them."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def is_sig_key(value) -> bool:
    """Whether ``value`` is a signature key as :func:`~chorus.cache_store.signature_key` makes them."""
    return isinstance(value, str) and _SIG_KEY.fullmatch(value) is not None


def finite_number(value) -> bool:
    """Whether ``value`` is a finite int or float (not a bool): row counters and timestamps."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def row_meta(meta_json, nbytes: int | None = None) -> dict:
    """A row's metadata as a dict, or ``{"unreadable": reason}`` (too large, not JSON, nested too
    deep, not an object). ``nbytes``: the column's length when the caller did not fetch a text
    that long (``meta_json`` is then None)."""
    if meta_json is None:
        size = "unknown" if nbytes is None else str(nbytes)
        return {"unreadable": f"row metadata of {size} bytes, more than the {MAX_META_BYTES} the store keeps"}
    if len(meta_json) > MAX_META_BYTES:
        return {"unreadable": f"row metadata of {len(meta_json)} bytes, more than the {MAX_META_BYTES} the store keeps"}
    try:
        meta = loads_bounded(meta_json, "row metadata")
    except EntryFormatError as exc:
        return {"unreadable": str(exc)}
    return meta if isinstance(meta, dict) else {"unreadable": "row metadata is not a JSON object"}


def check_entry_matches_row(embedding, meta, sig_key: str, row_embedding: bytes | None) -> None:
    """Raise :class:`EntryFormatError` unless a decoded entry's signature has the row's key and
    (when ``row_embedding`` is given) its embedding has the row's bytes."""
    if not isinstance(meta, dict) or not isinstance(meta.get("signature"), dict):
        raise EntryFormatError("the entry has no signature")
    try:
        key = signature_key(meta["signature"])
    except (TypeError, ValueError) as exc:
        raise EntryFormatError(f"the entry's signature is unreadable ({exc})") from None
    if key != sig_key:
        raise EntryFormatError("the entry's signature does not match its row")
    if row_embedding is not None:
        raw = embedding.numpy().tobytes() if hasattr(embedding, "numpy") else np.asarray(embedding).tobytes()
        if raw != bytes(row_embedding):
            raise EntryFormatError("the entry's embedding does not match its row")
