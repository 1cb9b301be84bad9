"""The per-request state of a plan, declared in one place.

A :class:`~chorus.engine.plan.Plan` is one :class:`RequestState` (``plan.state``): everything that
changes while the request samples and is committed. Every patched model of the request (Wan 2.2 A14B:
both experts) shares it. Nothing else is attached to a plan: hosts and engine parts read and write
these declared fields only.

- ``retrieval`` (the frozen :class:`~chorus.engine.plan.Retrieval` the request serves now: the one
  retrieval made, or the candidate a sampler run moved it to, ``Plan.serve_run``);
- ``stats`` (:class:`PlanStats`, the UI messages included), ``noted`` (messages already logged);
- ``recorder`` (a miss's :class:`~chorus.engine.recorder.MassRecorder`, or None);
- ``experts`` (``ModelInfo`` of the models that sampled, in order), ``demoted_reason``,
  ``models`` (those patched with the plan or sampled: what a hit's entry must serve),
  ``sampler_steps`` (the sigmas every sampler run's steps start at: the request's schedule, also
  where a step cache such as EasyCache skipped the model);
- ``refresh`` (one ``kernels.VisitRefresh`` per refresh period), ``resampled`` (transformed maps);
- ``feature_reuse`` (:class:`FeatureReuseState`), ``entry_extras`` (fields a new entry's metadata
  gets on top of the request's own, e.g. feature reuse's region scores: ``commit_plan`` merges them);
- ``verification`` (expert -> :class:`~chorus.engine.verify.ExpertCheck`), ``verify_recorder`` /
  ``verify_covered`` (the first expert's calls recorded ahead while its verdict is pending, and how
  many sparse calls that recording covers; engine/verify.py);
- ``committed`` (what ``commit_plan`` did, so a second commit does nothing), ``lock``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels import aspect_matches, resample_region_scores
from .recorder import MassRecorder
from .routing import SigmaSchedule

FEATURE_REUSE_META_VERSION = 1


def failure_text(exc: BaseException) -> str:
    """``"<exception type>: <first line of its message>"``: how every note and message names a failure (a
    Triton build error, for one, runs to many lines)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


@dataclass
class PlanStats:
    """Per-request counters. ``density`` = computed / total blocks over sparse calls (batch rows
    counted). ``attention_seconds`` is host wall time spent inside the patched self-attention calls
    (on CUDA, launch time unless the host synchronises): a ratio between runs, not a kernel timing."""

    similarity: float | None = None
    sparse_calls: int = 0
    dense_calls: int = 0
    recorded_calls: int = 0
    fallback_calls: int = 0
    tail_calls: int = 0  # sparse calls with the pooled tail (SparseConfig.pooled_tail)
    blocks_total: int = 0
    blocks_computed: int = 0
    attention_seconds: float = 0.0
    runs: int = 0
    messages: list[str] = field(default_factory=list)
    suppressed_messages: int = 0
    # the sparse kernels the request's runs asked for: "name" or "resolved (asked)", once each (ExpertRun._backend)
    kernels: list[str] = field(default_factory=list)
    # self-verifying hits (engine/verify.py): expert -> {"step", "layers", "verdict", "ratio", "recall",
    # "best", "min_ratio", "threshold"[, "reason"]}: at the expert's first step, the estimated recall of
    # the reused maps, the best recall at their density, and their ratio (the verdict's number)
    verification: dict = field(default_factory=dict)

    def note_kernel(self, asked: str, resolved: str | None) -> None:
        """Name once the kernel a run's sparse calls ask for (``asked``) and what it resolves to here (None: it
        cannot run here)."""
        name = asked if resolved == asked else f"{resolved} ({asked})" if resolved else f"{asked} (cannot run here)"
        if name not in self.kernels:
            self.kernels.append(name)

    @property
    def density(self) -> float | None:
        return self.blocks_computed / self.blocks_total if self.blocks_total else None

    def summary(self) -> str:
        parts = []
        if self.similarity is not None:
            parts.append(f"similarity {self.similarity:.3f}")
        if self.density is not None:
            parts.append(f"density {self.density:.1%} ({self.blocks_computed}/{self.blocks_total} blocks)")
        parts.append(f"calls sparse {self.sparse_calls}, dense {self.dense_calls} (recorded {self.recorded_calls}), "
                     f"fallback {self.fallback_calls}")
        if self.kernels:
            parts.append(f"kernel {', '.join(self.kernels)}")
        if self.tail_calls:
            parts.append(f"pooled tail on {self.tail_calls} sparse calls")
        parts.append(f"attention {self.attention_seconds * 1e3:.1f} ms")
        for expert, v in sorted(self.verification.items()):
            if v.get("ratio") is None:
                parts.append(f"verify expert {expert}: {v.get('verdict')} ({v.get('reason', 'no estimate')})")
            else:
                parts.append(f"verify expert {expert}: estimated recall {v['recall']:.3f} of a best {v['best']:.3f} "
                             f"at the same density, fit ratio {v['ratio']:.3f} (worst layer {v['min_ratio']:.3f}) "
                             f"on layers {v['layers']} vs threshold {v['threshold']:g}: {v['verdict']}")
        return "; ".join(parts)


class FeatureReuseState:
    """Request-wide feature-reuse state (``plan.state.feature_reuse``), shared by every patched model.

    Recording: sums of per-region redundancy per (expert, step sigma, token grid). The first call's grid is the
    entry's; calls at another grid of the same aspect (context windows of two lengths, whose schedule may give a
    step no window at the first grid) are summed apart and carried to it when exported; another aspect or
    region geometry is not recorded. Acting: counters of the block calls reduced and run in full, and of the
    tokens saved, for the UI.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.grid = None
        self.region = None
        self.pool = None
        # (expert, sigma, grid) -> [sum [R] float64, count (0-dim float64)], both on the recording's device: a
        # block call adds to them without waiting for the GPU; export() reads them once
        self.sums: dict[tuple[int, float, tuple], list] = {}
        self.blocks_reduced = 0
        self.blocks_full = 0
        self.tokens_saved = 0
        self.tokens_total = 0

    def __deepcopy__(self, memo):
        return self

    def record(self, expert: int, sigma: float, grid, region, pool, redundancy: torch.Tensor) -> None:
        """Add one block call's per-region redundancy ``[R]`` (the complete ``region``s of ``grid``)."""
        grid = tuple(int(g) for g in grid)
        with self.lock:
            if self.grid is None:
                self.grid, self.region, self.pool = grid, tuple(region), tuple(pool)
            elif (tuple(region), tuple(pool)) != (self.region, self.pool) or not aspect_matches(grid, self.grid):
                return  # another geometry within one request: keep the first
            key = (int(expert), round(float(sigma), 6), grid)
            vals = redundancy.detach().double()
            finite = torch.isfinite(vals).all()  # a non-finite block output adds no score (decided on the device)
            vals = torch.where(finite, vals, torch.zeros_like(vals))
            cur = self.sums.get(key)
            if cur is None:
                self.sums[key] = [vals, finite.double()]
            else:
                cur[0] += vals
                cur[1] += finite.double()

    def export(self) -> dict | None:
        """JSON-able dict written with the entry (None if nothing was recorded): per (expert, step) the mean
        redundancy of each complete region of the first grid, over the calls at that grid and, carried there
        (:func:`chorus.kernels.resample_region_scores`, weighted by their call count), those at other grids
        of its aspect; a region no call scored gets 0 (not redundant: never downsampled)."""
        with self.lock:
            steps: dict[tuple[int, float], list] = {}  # (expert, sigma) -> [weighted sum [R], weight [R]]
            for (expert, sigma, grid), (total, count) in sorted(self.sums.items()):
                count = float(count)
                if count <= 0:
                    continue
                mean = total.cpu() / count
                if grid != self.grid:
                    mean = resample_region_scores(mean, grid, self.grid, self.region)
                weight = torch.where(torch.isnan(mean), 0.0, count).double()
                acc = steps.setdefault((expert, sigma), [torch.zeros_like(weight), torch.zeros_like(weight)])
                acc[0] += torch.nan_to_num(mean.double(), nan=0.0) * weight
                acc[1] += weight
            scores: dict[str, dict[str, list[float]]] = {}
            for (expert, sigma), (weighted, weight) in steps.items():
                means = torch.where(weight > 0, weighted / weight.clamp_min(1e-30), 0.0)
                scores.setdefault(str(expert), {})[repr(sigma)] = [round(float(v), 4) for v in means]
            if not scores:
                return None
            return {"version": FEATURE_REUSE_META_VERSION, "metric": "1 - cell-detail share of the block update",
                    "token_grid": list(self.grid), "region": list(self.region), "pool": list(self.pool),
                    "scores": scores}

    def summary(self) -> str:
        total = self.blocks_reduced + self.blocks_full
        if not total:
            return "feature reuse: no block calls"
        saved = self.tokens_saved / self.tokens_total if self.tokens_total else 0.0
        return (f"feature reuse: {self.blocks_reduced}/{total} block calls downsampled, "
                f"{saved:.1%} fewer tokens in those blocks")


@dataclass(eq=False)
class RequestState:
    """Everything of one request that changes after retrieval (see the module docstring).

    Made by :class:`~chorus.engine.plan.Plan`; ``copy.deepcopy`` returns the object itself (hosts
    deep-copy model options, while every patched model of a request shares one state)."""

    retrieval: Any = None
    stats: PlanStats = field(default_factory=PlanStats)
    recorder: MassRecorder | None = None
    experts: list = field(default_factory=list)
    models: list = field(default_factory=list)  # ModelInfo of the models patched with the plan or sampled
    sampler_steps: SigmaSchedule = field(default_factory=SigmaSchedule)  # where the sampler runs' steps start
    demoted_reason: str | None = None
    refresh: dict = field(default_factory=dict)
    resampled: dict = field(default_factory=dict)
    feature_reuse: FeatureReuseState = field(default_factory=FeatureReuseState)
    entry_extras: dict = field(default_factory=dict)
    committed: str | None = None
    verification: dict = field(default_factory=dict)
    verify_recorder: MassRecorder | None = None
    verify_covered: int = 0
    noted: set = field(default_factory=set)
    image_frames: tuple | None = None  # (first, last, other) latent frames with an input image (first forward's)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __deepcopy__(self, memo):
        return self
