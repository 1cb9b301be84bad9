"""Compatibility signatures: a canonical hash of the dict that says which requests may share masks.

A signature holds model family/variant and a weights fingerprint, latent shape, block geometry,
token order, step schedule (sigmas) and expert (DESIGN.md, "Retrieval and the cache"). Two entries
are compatible exactly when their signatures are equal; :func:`signature_key` turns that equality
into equality of short strings, stored in an indexed SQLite column and used to partition the
faiss index so that a filtered search is as exact as an unfiltered one.
"""

from __future__ import annotations

import hashlib
import json
import math


def _canonical(value, path="signature"):
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{path}: keys must be strings, got {k!r}")
            out[k] = _canonical(v, f"{path}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: NaN/inf is not a valid signature value")
        # Integral floats hash like ints (latent shape 60 == 60.0); others use repr (round-trip exact).
        return int(value) if value.is_integer() else float(repr(value))
    if hasattr(value, "tolist"):  # numpy / torch scalars and arrays (e.g. sigmas)
        return _canonical(value.tolist(), path)
    raise ValueError(f"{path}: unsupported type {type(value).__name__} in signature")


def canonical_signature(signature: dict) -> str:
    """Canonical JSON of ``signature`` (sorted keys, tuples as lists, integral floats as ints)."""
    if not isinstance(signature, dict):
        raise ValueError(f"signature must be a dict, got {type(signature).__name__}")
    return json.dumps(_canonical(signature), sort_keys=True, separators=(",", ":"), allow_nan=False)


def signature_key(signature: dict) -> str:
    """32 hex chars (sha256 prefix) of :func:`canonical_signature`; equal signatures give equal keys."""
    return hashlib.sha256(canonical_signature(signature).encode()).hexdigest()[:32]
