"""Per-model sparse attention settings (what ChorusSparseSampler exposes)."""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKENDS = ("auto", "triton_fp8", "triton_bf16", "flex", "reference")


@dataclass(frozen=True)
class SparseConfig:
    """How a patched model uses a plan.

    - ``top_p`` (0, 1]: on a miss, the cumulative block mass each query-block row keeps when the
      recorded mass becomes a stored block map (and, for entries stored as mass, at retrieval).
    - ``k_min`` >= 1: floor on kept key blocks per query-block row of a reused map (safety fallback).
    - ``refresh_steps`` >= 0: visit refresh; 0 = off, R > 0 = no block pair stays unvisited for more
      than R consecutive steps of a request (``chorus.kernels.VisitRefresh``).
    - ``backend``: one of ``auto | triton_fp8 | triton_bf16 | flex | reference`` (see kernels).
    - ``sample_rows``: query rows per block used by the recorder's ``block_mass`` (None = exact). 8 keeps
      the miss within 10% of a dense run on the H200 and loses 0.0003 of mask recall against exact
      mass (docs/BENCHMARKS.md, "End to end", miss rows).
    - ``block_size``: tokens per block (q and kv), 128 by default.

    Bad values raise ``ValueError``.
    """

    top_p: float = 0.9
    k_min: int = 4
    refresh_steps: int = 0
    backend: str = "auto"
    sample_rows: int | None = 8
    block_size: int = 128

    def __post_init__(self):
        if not (isinstance(self.top_p, (int, float)) and math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.k_min, int) or self.k_min < 1:
            raise ValueError(f"k_min must be an int >= 1, got {self.k_min!r}")
        if not isinstance(self.refresh_steps, int) or self.refresh_steps < 0:
            raise ValueError(f"refresh_steps must be an int >= 0, got {self.refresh_steps!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.sample_rows is not None and (not isinstance(self.sample_rows, int) or self.sample_rows < 1):
            raise ValueError(f"sample_rows must be None or an int >= 1, got {self.sample_rows!r}")
        if not isinstance(self.block_size, int) or self.block_size < 16 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size!r}")
