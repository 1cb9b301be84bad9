"""Self-verifying hits: how well a reused map fits the request, estimated during the hit.

A hit trusts the similarity score; if the entry's maps do not fit the new request (drift the
threshold did not see, another subject under the same prompt), the video quietly loses attention
mass. The *recall* of a map is the share of the request's true attention mass (softmax over all
keys) that falls in the blocks the map keeps; the *best* recall at its density is the recall of the
map that keeps, in every query-block row, as many blocks as it does but those with the most mass.
:func:`recall_terms` estimates both per head from a few sampled query rows per block
(``kernels.block_mass(sample_rows=...)``, the recorder's estimator). The verdict's number is the
*fit ratio* recall / best (means over the checked layers and heads; :attr:`ExpertCheck.ratio`):

* Relative, not absolute: a share of mass depends on ``top_p`` and on how peaked the model's
  attention is, so no absolute threshold separated wrong entries from near-duplicates on the quality
  harness, and near-uniform attention (random weights) keeps only about a map's density of the mass
  whatever the map. A map that fits is near-optimal for its own density (ratio ~1), a map of another
  request is not; on near-uniform attention every map is as good as any other (ratio ~1).
* The mean over all checked (layer, head), not their minimum or a low quantile: on the harness the
  minimum separated permuted maps no better and its sampled-row error was 2-3x that of the mean
  (0.04 against 0.017 at 8 rows per block of 16), and a minimum drifts lower as more (layer, head)
  are checked (16 on Wan against 4 on the harness), which would move any threshold.
* ``best`` is taken on the same sampled mass, so it is biased up by the row-sampling noise (the top
  blocks of a noisy mass include those the noise favoured): ``verify_rows`` 64 of a 128 block keeps
  that bias small enough for random weights to pass (``engine/config.py``). A genuine hit's ratio is
  also bounded by how precisely its entry was recorded where the check looks (a map selected on a
  noisier mass is further from the best): the recorder therefore records exact mass there (its
  verification anchors, named in the entry's metadata under :data:`ANCHORS_META_KEY`; a hit on an entry
  without them notes it), and the check stays off by default until real weights say where genuine
  hits' ratios fall (``DEFAULT_VERIFY_THRESHOLD``).

How a hit's run uses it (:class:`Verifier`, one per expert run; ``SparseConfig.verify_*``; the plan's
request-wide record is :class:`ExpertCheck` in ``plan.state.verification``):

* At the first step of each expert of a hit, every checked layer (``verify_layers``) adds its
  ``[recall, best]`` terms on ``verify_heads`` evenly spaced heads with ``verify_rows`` rows per
  block, as a device tensor (no host sync inside the call).
* After the last checked layer of that step the terms are read in one stacked copy: one host sync
  per expert and request (a few microseconds of lost launch overlap against a step of seconds;
  deciding at the next sigma read instead would let one more forward run on a map already known to
  be wrong). The verdict compares the fit ratio with ``verify_threshold``; ``plan.stats.verification``
  reports the ratio, the estimated recall and best, and the worst layer's ratio.
* A failed verdict demotes the plan: the rest of the request runs dense and records, the safe
  choice (dense attention keeps all the mass). So that the request still writes a better entry,
  the *first* expert's calls up to its verdict are recorded exactly as a miss records them while
  they run sparse (the recorder's cost on those few calls; dropped on a pass): a request whose first
  expert fails thus has a complete recording and ``ChorusCacheWrite`` writes it, so the next similar
  request hits an entry that fits. A later expert failing (A14B low noise after a high-noise expert
  that passed) leaves steps that ran sparse unrecorded: the recording is incomplete and nothing is
  written (``Plan.demote``), the rest of the request still runs dense.
* Re-selecting only the checked layers' maps from the measured mass was not chosen: the mass is
  measured on a few layers and heads of one step, every other (layer, head, step) would keep the map
  that was just shown not to fit, and nothing better would reach the cache.
* Anything failing inside verification gives no verdict and a note, never an exception.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import kernels
from .recorder import MassRecorder
from .state import failure_text


ANCHORS_META_KEY = "verify_anchors"  # entry metadata: where the recorder's mass was exact (layers, heads)


def anchors_cover(meta, layers, heads: int) -> bool:
    """True when an entry's metadata says its maps were recorded from exact mass on ``layers`` x
    ``heads`` evenly spaced heads at the first step of each expert (the recorder's verification
    anchors), i.e. where a hit with these settings checks."""
    anchors = (meta or {}).get(ANCHORS_META_KEY)
    if not isinstance(anchors, dict):
        return False
    try:
        return set(layers) <= {int(l) for l in anchors.get("layers", ())} and int(anchors.get("heads", 0)) == int(heads)
    except (TypeError, ValueError):
        return False


def verify_head_index(num_heads: int, count: int) -> list[int]:
    """``count`` evenly spaced head indices of ``num_heads`` (all heads when ``count >= num_heads``)."""
    num_heads = int(num_heads)
    if count >= num_heads:
        return list(range(num_heads))
    return sorted({int(i * num_heads // count) for i in range(count)})


def recall_terms(q: torch.Tensor, k: torch.Tensor, block_map: torch.Tensor, *, heads, sample_rows: int | None,
                 block_size: int, backend: str = "auto", token_perm=None) -> torch.Tensor:
    """Per head, the recall of ``block_map`` and the best recall at its density: a float32 ``[2, h]``
    tensor on q's device (``[0]`` recall, ``[1]`` best; not read here, so no host sync).

    ``q, k``: ``[B, H, L, D]``; ``block_map``: bool ``[1 or B, H, Qb, Kb]`` (the map the call computes);
    ``heads``: head indices to use (None = all; ``h`` = their number); ``sample_rows``: query rows per
    block (None = exact). *Recall* of a head: the mean over its query blocks and batch rows of the
    block's attention mass (averaged over the block's sampled rows) in kept blocks (``token_perm``: the
    token order ``block_map`` is in, as :func:`chorus.kernels.block_mass` takes it; None = raster). *Best*: the same
    for the map that keeps, in every row, as many blocks as ``block_map`` but those with the most of
    the same sampled mass: what any map that sparse can keep, so ``recall <= best``. With sampled rows
    ``best`` is biased up (the top blocks of a noisy mass include the ones the noise favoured; the bias
    shrinks with more rows per block): on near-uniform attention, where that noise is all there is, a
    map that fits keeps visibly less than ``best`` with few rows (docs/BENCHMARK_LOG.md, "Self-verifying hits").
    """
    if heads is not None:
        idx = torch.as_tensor(list(heads), dtype=torch.long, device=q.device)
        q, k = q.index_select(1, idx), k.index_select(1, idx)
        block_map = block_map.index_select(1, idx.to(block_map.device))
    mass = kernels.block_mass(q, k, block_size=block_size, sample_rows=sample_rows, backend=backend,
                              token_perm=token_perm)
    kept = block_map.to(device=mass.device)
    recall = (mass * kept.to(mass.dtype)).sum(-1)                                   # [B, h, Qb]
    count = kept.sum(-1, dtype=torch.int64).expand(mass.shape[:-1])
    top = mass.sort(-1, descending=True).values.cumsum(-1)
    best = top.gather(-1, (count - 1).clamp_min(0)[..., None])[..., 0] * (count > 0)
    return torch.stack([recall.mean(dim=(0, 2)), best.mean(dim=(0, 2))]).float()


def recall_estimate(q: torch.Tensor, k: torch.Tensor, block_map: torch.Tensor, *, heads, sample_rows: int | None,
                    block_size: int, backend: str = "auto", with_best: bool = False) -> torch.Tensor:
    """Estimated recall of ``block_map`` for attention ``softmax(q k^T / sqrt(D))``: a 0-dim float32
    tensor on q's device (no host sync): :func:`recall_terms` averaged over the heads, i.e. the mean
    over the heads, query blocks and batch rows of the mass in kept blocks (exact with
    ``sample_rows=None``). ``with_best``: the 2-vector ``[recall, best]`` (``best`` as there).
    """
    terms = recall_terms(q, k, block_map, heads=heads, sample_rows=sample_rows, block_size=block_size,
                         backend=backend).mean(-1)
    return terms if with_best else terms[0]


def fit_ratio(recall: float, best: float) -> float:
    """The verdict's number: ``recall / best`` (1 = the map keeps as much as any map as sparse; 1 when
    ``best`` is 0, i.e. nothing to keep)."""
    return recall / best if best > 0 else 1.0


@dataclass
class ExpertCheck:
    """The verification of one expert of a request (``plan.state.verification[expert]``).

    ``step``: the step checked (the expert's first); ``layers``: the layers checked; ``estimates``:
    layer -> device ``[2, h]`` :func:`recall_terms` until the verdict; ``values``: layer -> ``(recall,
    best)`` (means over the checked heads) after it; ``verdict``: None (pending), ``"pass"``, ``"fail"``
    or ``"no verdict"``; ``records``: this check's calls are recorded ahead (the request's first expert)."""

    step: int
    layers: tuple
    records: bool = False
    estimates: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)
    verdict: str | None = None
    reason: str = ""

    @property
    def ratio(self) -> float | None:
        """The verdict's number: the recall over all checked (layer, head) divided by the best recall at
        the same density over them (:func:`fit_ratio` of the means); None before any value."""
        if not self.values:
            return None
        recall = sum(r for r, _ in self.values.values()) / len(self.values)
        best = sum(b for _, b in self.values.values()) / len(self.values)
        return fit_ratio(recall, best)

    def summary(self) -> dict:
        """``plan.stats.verification[expert]``: ``ratio`` (the verdict's number), ``recall`` (mean estimated
        recall), ``best`` (mean best recall at the same density), ``min_ratio`` (the worst checked layer)."""
        vals = list(self.values.values())
        n = len(vals)
        return {"step": self.step, "layers": sorted(self.values), "verdict": self.verdict,
                "ratio": self.ratio,
                "recall": sum(r for r, _ in vals) / n if n else None,
                "best": sum(b for _, b in vals) / n if n else None,
                "min_ratio": min(fit_ratio(r, b) for r, b in vals) if n else None,
                **({"reason": self.reason} if self.reason else {})}


class Verifier:
    """The verification of one expert's sampler run of a hit (the module docstring says what it does).

    ``plan``: the request's plan; ``config``: the model's ``SparseConfig``; ``expert``: the run's
    expert; ``num_layers``: the model's; ``record_into(recorder, call, sigma, grid)``: the run's
    recording of one call (how the first expert's calls are recorded ahead). Never raises.
    """

    def __init__(self, plan, config, expert: int, num_layers: int, record_into):
        self.plan, self.config, self.expert = plan, config, expert
        self.num_layers = num_layers
        self.record_into = record_into

    def observe(self, call, step: int, sigma: float, grid, block_map, order=None) -> ExpertCheck | None:
        """At the first step of this expert: record ``call`` ahead (first expert) and add the estimate
        of a checked layer (``block_map``: the map the call computes; ``order``: the token order the
        run's maps are in, None = raster). Returns the pending :class:`ExpertCheck` or None."""
        plan, cfg = self.plan, self.config
        if cfg.verify_threshold <= 0:
            return None
        state = plan.state
        layer = int(call.layer)
        try:
            with state.lock:
                check = state.verification.get(self.expert)
                if check is None:
                    check = self._start(step)
                    if check is None:
                        return None
            if check.verdict is not None or check.step != step:
                return None
            recorder = state.verify_recorder if check.records else None
            if recorder is not None and recorder.incomplete_reason is None:
                try:
                    self.record_into(recorder, call, sigma, grid)
                    state.verify_covered += 1
                except Exception as exc:  # noqa: BLE001
                    recorder.mark_incomplete(f"recording ahead failed ({failure_text(exc)})")
            if layer in check.layers and layer not in check.estimates:
                qs, ks = call.positive_rows(keep_all=True)
                with torch.no_grad():
                    check.estimates[layer] = recall_terms(
                        qs, ks, block_map, heads=verify_head_index(call.q.shape[1], cfg.verify_heads),
                        sample_rows=cfg.verify_rows, block_size=cfg.block_size, token_perm=order)
            return check
        except Exception as exc:  # noqa: BLE001 - verification never breaks sampling
            why = failure_text(exc)
            plan.note(f"hit verification gave no verdict for expert {self.expert} ({why})")
            check = state.verification.get(self.expert)
            if check is not None and check.verdict is None:
                check.verdict, check.reason, check.estimates = "no verdict", why, {}
                self._publish(check)
                self._drop_record_ahead(check)
            return None

    def _start(self, step: int) -> ExpertCheck | None:
        """This expert's check, made at its first sparse call (under the plan's lock)."""
        plan, cfg, state = self.plan, self.config, self.plan.state
        layers = tuple(l for l in cfg.verify_layers if l < self.num_layers)
        if not layers:
            check = state.verification[self.expert] = ExpertCheck(step, (), verdict="no verdict",
                                                                  reason="no checked layer in the model")
            self._publish(check)
            return None
        first = not state.verification and plan.stats.sparse_calls == 0
        check = state.verification[self.expert] = ExpertCheck(step, layers, records=first)
        if first and not anchors_cover(plan.entry_meta, layers, cfg.verify_heads):
            plan.note("hit verification: the entry was recorded without exact mass where this check "
                      "looks (no verification anchors for these layers / heads), so its fit ratio is "
                      "held down by the recording's row sampling and a fitting hit may be demoted "
                      "(the request then writes an entry that has them)")
        if first and plan.embedding is not None:  # a demoted request could be written
            state.verify_recorder, state.verify_covered = MassRecorder(), 0
        return check

    def after_call(self, check: ExpertCheck | None, layer: int) -> None:
        """After a sparse call that :meth:`observe` saw: decide once the last checked layer ran."""
        if check is not None and int(layer) >= check.layers[-1]:
            self.decide(check)

    def moved_on(self, step: int) -> bool:
        """Decide this expert's check if it is still pending at a later step (its last checked layer
        never ran sparse, e.g. a fallback); True when a verdict was taken now."""
        check = self.plan.state.verification.get(self.expert)
        if check is None or check.verdict is not None or check.step == step:
            return False
        self.decide(check)
        return True

    def decide_pending(self) -> None:
        """At the end of the run: decide a check still pending."""
        check = self.plan.state.verification.get(self.expert)
        if check is not None and check.verdict is None:
            self.decide(check)

    def fell_back(self, why: str) -> None:
        """A call of the run fell back to dense: the record-ahead did not record it."""
        recorder = self.plan.state.verify_recorder
        if recorder is not None:
            recorder.mark_incomplete(f"a call fell back during verification ({why})")

    def decide(self, check: ExpertCheck) -> None:
        """The verdict of a pending check: reads its estimates (the one host sync of the check: one
        stacked copy), demotes the plan when the fit ratio (recall / best recall at the same density,
        over the checked layers and heads) is below the threshold."""
        plan, cfg = self.plan, self.config
        state = plan.state
        if check.verdict is not None:
            return
        try:
            layers = sorted(check.estimates)
            terms = (torch.stack([check.estimates[l].float().reshape(2, -1).mean(-1) for l in layers]).cpu().tolist()
                     if layers else [])
            check.values = {layer: (float(r), float(b)) for layer, (r, b) in zip(layers, terms)}
            check.estimates = {}
            vals = [v for pair in check.values.values() for v in pair]
            if not vals or not all(math.isfinite(v) for v in vals):  # none, or NaN / inf
                check.verdict, check.reason = "no verdict", "no estimate" if not vals else "non-finite estimate"
                plan.note(f"hit verification gave no verdict for expert {self.expert} ({check.reason})")
                self._publish(check)
                self._drop_record_ahead(check)
                return
            ratio = check.ratio
            check.verdict = "pass" if ratio >= cfg.verify_threshold else "fail"
            self._publish(check)
            if check.verdict == "pass":
                self._drop_record_ahead(check)
                return
            recorder = state.verify_recorder if check.records else None
            if recorder is not None and state.verify_covered != plan.stats.sparse_calls:
                recorder = None  # some sparse call was not recorded ahead: nothing can be written
            self._drop_record_ahead(check)
            if recorder is not None:
                plan.stats.recorded_calls += state.verify_covered  # the calls recorded ahead
            summary = check.summary()
            plan.demote(f"hit verification failed for expert {self.expert}: the reused maps keep an estimated "
                        f"{summary['recall']:.3f} of the attention mass where maps as sparse could keep "
                        f"{summary['best']:.3f} (fit ratio {ratio:.3f} < verify_threshold {cfg.verify_threshold:g}) "
                        f"on layers {sorted(check.values)} at step {check.step}", recorder=recorder)
            if plan.recorder is not None and plan.recorder.incomplete_reason is not None:
                plan.note("hit verification failed after other steps ran sparse: the rest of the request runs "
                          "dense; nothing will be written to the cache")
        except Exception as exc:  # noqa: BLE001
            check.verdict, check.reason = "no verdict", failure_text(exc)
            plan.note(f"hit verification gave no verdict for expert {self.expert} ({check.reason})")
            self._publish(check)
            self._drop_record_ahead(check)

    def _publish(self, check: ExpertCheck) -> None:
        self.plan.stats.verification[self.expert] = {**check.summary(), "threshold": self.config.verify_threshold}

    def _drop_record_ahead(self, check: ExpertCheck) -> None:
        if check.records:
            self.plan.state.verify_recorder = None
