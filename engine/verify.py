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

How ``ChorusAttention`` uses it (``SparseConfig.verify_*``; the plan's request-wide record is
:class:`ExpertCheck` in ``plan.state.verification``):

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

from dataclasses import dataclass, field

import torch

from .. import kernels


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
    map that fits keeps visibly less than ``best`` with few rows (docs/BENCHMARKS.md, "Self-verifying hits").
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
