"""Self-verifying hits: how much attention mass a reused map keeps, estimated during the hit.

A hit trusts the similarity score; if the entry's maps do not fit the new request (drift the
threshold did not see, another subject under the same prompt), the video quietly loses attention
mass. The *recall* of a map is the share of the request's true attention mass (softmax over all
keys) that falls in the blocks the map keeps; :func:`recall_estimate` estimates it from a few
sampled query rows per block (``kernels.block_mass(sample_rows=...)``, the recorder's estimator) on a
few heads: ``(mass * map).sum(-1).mean()`` over those heads, query blocks and batch rows.

How ``ChorusAttention`` uses it (``SparseConfig.verify_*``; the plan's request-wide record is
:class:`ExpertCheck` in ``plan.state.verification``):

* At the first step of each expert of a hit, every checked layer (``verify_layers``) adds an
  estimate on ``verify_heads`` evenly spaced heads with ``verify_rows`` rows per block, as a device
  tensor (no host sync inside the call).
* After the last checked layer of that step the estimates are read: one host sync per expert and
  request (a few microseconds of lost launch overlap against a step of seconds; deciding at the
  next sigma read instead would let one more forward run on a map already known to be wrong). The
  verdict compares the mean over the checked layers with ``verify_threshold``.
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


def verify_head_index(num_heads: int, count: int) -> list[int]:
    """``count`` evenly spaced head indices of ``num_heads`` (all heads when ``count >= num_heads``)."""
    num_heads = int(num_heads)
    if count >= num_heads:
        return list(range(num_heads))
    return sorted({int(i * num_heads // count) for i in range(count)})


def recall_estimate(q: torch.Tensor, k: torch.Tensor, block_map: torch.Tensor, *, heads, sample_rows: int | None,
                    block_size: int, backend: str = "auto", with_best: bool = False) -> torch.Tensor:
    """Estimated recall of ``block_map`` for attention ``softmax(q k^T / sqrt(D))``: a 0-dim float32
    tensor on q's device (not read here, so no host sync).

    ``q, k``: ``[B, H, L, D]``; ``block_map``: bool ``[1 or B, H, Qb, Kb]`` (the map the call computes);
    ``heads``: head indices to use (None = all); ``sample_rows``: query rows per block (None = exact).
    The value is the mean over the heads, query blocks and batch rows of the mass (averaged over the
    block's sampled rows) in kept blocks; with ``sample_rows=None`` it is the exact recall.
    ``with_best``: a 2-vector ``[recall, best]`` with ``best`` the recall of the best map with the same
    number of kept blocks per row (the top blocks of the same mass): what any map that sparse keeps.
    """
    if heads is not None:
        idx = torch.as_tensor(list(heads), dtype=torch.long, device=q.device)
        q, k = q.index_select(1, idx), k.index_select(1, idx)
        block_map = block_map.index_select(1, idx.to(block_map.device))
    mass = kernels.block_mass(q, k, block_size=block_size, sample_rows=sample_rows, backend=backend)
    kept = block_map.to(device=mass.device)
    recall = (mass * kept.to(mass.dtype)).sum(-1).mean()
    if not with_best:
        return recall
    count = kept.sum(-1, dtype=torch.int64).expand(mass.shape[:-1])
    top = mass.sort(-1, descending=True).values.cumsum(-1)
    best = top.gather(-1, (count - 1).clamp_min(0)[..., None])[..., 0] * (count > 0)
    return torch.stack([recall, best.mean()])


@dataclass
class ExpertCheck:
    """The verification of one expert of a request (``plan.state.verification[expert]``).

    ``step``: the step checked (the expert's first); ``layers``: the layers checked; ``estimates``:
    layer -> device tensor until the verdict; ``values``: layer -> float after it; ``verdict``: None
    (pending), ``"pass"``, ``"fail"`` or ``"no verdict"``; ``records``: this check's calls are recorded
    ahead (the request's first expert)."""

    step: int
    layers: tuple
    records: bool = False
    estimates: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)
    verdict: str | None = None
    reason: str = ""

    def summary(self) -> dict:
        vals = list(self.values.values())
        return {"step": self.step, "layers": sorted(self.values), "verdict": self.verdict,
                "min": min(vals) if vals else None, "mean": sum(vals) / len(vals) if vals else None,
                **({"reason": self.reason} if self.reason else {})}
