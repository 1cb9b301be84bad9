"""Per-model sparse attention settings (what ChorusSparseSampler exposes)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernels.api import ACCURATE_CHAIN, Backend, has_pooled_tail

BACKENDS = tuple(backend.value for backend in Backend)  # the node's choices, in the kernel API's order
# The verdict is RELATIVE (engine/verify.py): the estimated recall of the reused map divided by the best recall
# any map as sparse keeps on the same sampled mass (the "fit ratio"): ~1 for a map that fits the request, lower
# for a map of another request, ~1 on near-uniform attention (random weights) whatever the map. The fit ratio
# of a genuine hit is bounded by how precisely its entry was recorded where the check looks, so the recorder
# records exact mass there (its verification anchors: first step of each expert, verify_layers x verify_heads;
# engine/runtime.py). With them, on the quality harness, 0.95 meets the targets with the recorder's real row
# sampling elsewhere (97-100% of permuted / 99% of other-family entries caught, no near-duplicate demoted;
# without them no threshold does: docs/BENCHMARK_LOG.md, "Self-verifying hits"). Still off by default: the
# near-duplicates' margin there is thin (0.953 against 0.95 on the content-heavy source), nothing says where a
# trained Wan puts it, and entries written before the anchors existed have none (a hit on one says so in its
# messages). SUGGESTED_VERIFY_THRESHOLD is the value to try, and to re-measure on real weights first.
DEFAULT_VERIFY_THRESHOLD = 0.0
SUGGESTED_VERIFY_THRESHOLD = 0.95
# Rows per block for the estimate: the in-sample best is biased up by row-sampling noise, which a map that fits
# still pays on near-uniform attention (i.i.d. Gaussian q/k at 480p's 32 760 tokens, a 5%-density structured
# map: fit ratio 0.918 with 8 rows, 0.957 with 32, 0.969 with 64). 64 of a 128 block on 4 of 40 heads is 5% of
# one layer's QK^T, on 4 layers, once per expert.
DEFAULT_VERIFY_ROWS = 64
# auto's numerics rule: a map that keeps at least this share of the recorded attention mass per row (top_p) leaves
# an error of the same order as the FP8 path's own (~0.055 relative L2 on a full map), so there auto runs the
# accurate INT8 path (~0.016); below it the sparsity error dominates and the fast FP8 path runs
# (docs/BENCHMARK_LOG.md, "The accurate INT8 path").
ACCURATE_TOP_P = 0.95


@dataclass(frozen=True)
class SparseConfig:
    """How a patched model uses a plan.

    - ``top_p`` (0, 1]: on a miss, the cumulative block mass each query-block row keeps when the
      recorded mass becomes a stored block map (and, for entries stored as mass, at retrieval).
    - ``k_min`` >= 1: floor on kept key blocks per query-block row of a reused map (safety fallback).
    - ``refresh_steps`` >= 0: visit refresh; 0 = off, R > 0 = no block pair stays unvisited for more
      than R consecutive steps of a request (``chorus.kernels.VisitRefresh``).
    - ``backend``: one of ``auto | triton_fp8_ws | triton_fp8 | triton_int8_ws | triton_int8 | triton_bf16 |
      fa4_bf16 | flex | reference`` (see kernels; the ``_ws`` kernels are Hopper-only, ``fa4_bf16`` needs the
      optional ``flash-attn-4``). ``auto`` runs the kernels' fast choice (the FP8 path on Hopper), except with
      ``top_p >= ACCURATE_TOP_P`` (0.95), where it runs the accurate INT8 numerics where they can run
      (:attr:`attention_backends`: the warp-specialised ``triton_int8_ws``, else the portable ``triton_int8``):
      the maps then keep nearly all the mass and the FP8 numerics would set the error.
    - ``sample_rows``: query rows per block used by the recorder's ``block_mass`` (None = exact). 8 keeps
      the miss within 10% of a dense run on the H200 and loses 0.0003 of mask recall against exact
      mass (docs/BENCHMARK_LOG.md, "End to end", miss rows).
    - ``block_size``: tokens per block (q and kv), 128 by default.
    - ``pooled_tail``: on a hit, every key block a query block's map skips still enters each of its
      rows' softmax as one pooled term (the block's mean key, weighted by its token count, with its mean
      value, from the current call's K and V: ``kernels.block_sparse_attention(pooled_tail=True)``).
      On by default: measured on the H200 (docs/BENCHMARK_LOG.md, "Two-level P.V accumulation") it lowers the error of the
      FP8 and the 16-bit paths at every density on spread attention (on sharp attention it lowers it at
      5% and leaves it equal above), for +5% of the kernel's time at 15% density and +19%
      at 5% (720p). A backend without one (``flex``, ``fa4_bf16``) with ``pooled_tail=True`` raises
      ``ValueError``: turn it off for them (``kernels.has_pooled_tail``).
    - ``verify_threshold`` in [0, 1]: self-verifying hits (``chorus.engine.verify``). At the first step
      of each expert of a hit, the share of attention mass the reused map keeps (its *recall*) and the
      share the best map with the same number of kept blocks per row would keep (*best*) are estimated
      from sampled query rows on a few (layer, head); the verdict's number is their ratio (the *fit
      ratio*, mean recall / mean best over the checked layers and heads, in (0, 1]). A ratio below the
      threshold demotes the plan: the rest of the request runs dense and records, so it writes its own
      entry (when the first expert fails). A ratio, not a share of mass (a share depends on ``top_p`` and on
      how peaked the model's attention is): a map that fits is near-optimal for its density (ratio ~1; 0.95-0.96
      for near-duplicates on the quality harness, below 1 as the map was selected on the entry's
      mass, with forced diagonal and first-frame blocks), a map of another request is not; near-uniform attention (random weights) gives ~1
      for any map. 0 = off, the default (:data:`DEFAULT_VERIFY_THRESHOLD`, see there why);
      :data:`SUGGESTED_VERIFY_THRESHOLD` (0.95) to turn it on.
    - ``verify_layers``: layer indices checked (those past the model's layers are ignored); the
      first expert's calls up to the last checked layer are also recorded, so keep them early.
    - ``verify_heads`` >= 1: evenly spaced heads checked per layer (all when the model has fewer).
    - ``verify_rows`` >= 1: sampled query rows per block for the estimate (:data:`DEFAULT_VERIFY_ROWS`, 64:
      fewer rows bias the fit ratio of a map that fits down, most on near-uniform attention).

    Bad values raise ``ValueError``.
    """

    top_p: float = 0.9
    k_min: int = 4
    refresh_steps: int = 0
    backend: str = "auto"
    sample_rows: int | None = 8
    block_size: int = 128
    pooled_tail: bool = True
    verify_threshold: float = DEFAULT_VERIFY_THRESHOLD
    verify_layers: tuple = (0, 1, 2, 3)
    verify_heads: int = 4
    verify_rows: int = DEFAULT_VERIFY_ROWS

    @property
    def attention_backends(self) -> tuple:
        """The backends a hit's sparse calls may ask the kernels for, in order of preference (the runtime takes
        the first that can run here): ``(backend,)``, or with ``auto`` and ``top_p >= ACCURATE_TOP_P`` the
        accurate numerics, ``("triton_int8_ws", "triton_int8", "auto")``."""
        if self.backend == Backend.AUTO.value and self.top_p >= ACCURATE_TOP_P:
            return (*(backend.value for backend in ACCURATE_CHAIN), self.backend)
        return (self.backend,)

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
        if not isinstance(self.pooled_tail, bool):
            raise ValueError(f"pooled_tail must be a bool, got {self.pooled_tail!r}")
        if self.pooled_tail and not has_pooled_tail(self.backend):
            raise ValueError(f"backend {self.backend!r} has no pooled tail: set pooled_tail=False with it")
        if not isinstance(self.block_size, int) or self.block_size < 16 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size!r}")
        thr = self.verify_threshold
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not math.isfinite(thr) or not 0.0 <= thr <= 1.0:
            raise ValueError(f"verify_threshold must be in [0, 1] (0 = off), got {thr!r}")
        layers = self.verify_layers
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = (layers,)
        try:
            layers = tuple(layers)
        except TypeError:
            raise ValueError(f"verify_layers must be a tuple of layer indices, got {self.verify_layers!r}") from None
        if not layers or not all(isinstance(l, int) and not isinstance(l, bool) and l >= 0 for l in layers):
            raise ValueError(f"verify_layers must be a non-empty tuple of ints >= 0, got {self.verify_layers!r}")
        object.__setattr__(self, "verify_layers", tuple(sorted(set(layers))))
        for name in ("verify_heads", "verify_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
