"""Attention-level quality of mask reuse on the synthetic structured source.

For every entry request the harness records masks exactly as the engine's miss path does
(``chorus.kernels.block_mass`` with the engine's default ``sample_rows``, then ``select_blocks``
with ``top_p``, ``k_min``, the diagonal and the first-frame keep-set) and writes them to a real
``chorus.cache_store.Workspace``. Every query is embedded with a ``chorus.cache_store`` embedder,
searched (top 1), and the entry's maps go through the engine's hit path (``floor_k_min`` and,
when ``refresh_steps > 0``, ``VisitRefresh``). Against the query's own exact attention it measures,
per (expert, step, layer) and then averaged:

* ``recall``: the share of the query's attention mass (exact block mass, rows sum to 1) that the
  reused map keeps -- mean over heads and query blocks; ``recall_min``: the worst call;
* ``rel_l2`` / ``cosine``: attention output with the reused map against dense attention;
* ``density``: kept block pairs of the reused map (after the floor);
* the same for the query's own oracle map (``own_*``: what a miss would record) and recall and
  density of a static prompt-agnostic map (``static_*``: the mean mass of all entries, selected the
  same way).

Exact attention is computed once per call as fp32 probabilities ``P`` ``[H, L, L]``; a map's output
is ``(P * M) v / rowsum(P * M)``, which equals masked softmax attention exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from chorus import kernels
from chorus.engine import SparseConfig
from chorus.engine.runtime import floor_k_min
from chorus.engine.verify import verify_head_index

from .source import RequestAttention, SourceConfig, SyntheticModel


@dataclass(frozen=True)
class ReuseConfig:
    """The engine settings the harness mirrors (``chorus.engine.SparseConfig`` defaults).

    ``anchors``: the recorder's verification anchors -- at the first step of each expert, on
    ``verify_layers`` x ``verify_heads`` (evenly spaced), the mass is exact instead of sampled
    (``ChorusAttention._record_into``); off only for comparisons."""

    top_p: float = 0.9
    k_min: int = 4
    refresh_steps: int = 0
    sample_rows: int | None = 16
    block_size: int = 32
    anchors: bool = True
    anchor_rows: int | None = None  # rows per block on the anchors (None = exact, the engine's choice)
    verify_layers: tuple = SparseConfig.verify_layers
    verify_heads: int = SparseConfig.verify_heads


def exact_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities ``[H, L, L]`` (fp32, scale folded into q) of ``q, k`` ``[1, H, L, D]``."""
    return torch.softmax(torch.matmul(q[0], k[0].transpose(-1, -2)), dim=-1)


def block_mass_from_probs(probs: torch.Tensor, block_size: int) -> torch.Tensor:
    """Exact block mass ``[1, H, Qb, Kb]`` from probabilities ``[H, L, L]`` (same definition as
    ``chorus.kernels.block_mass`` with ``sample_rows=None``; checked against it in the tests)."""
    heads, lq, lk = probs.shape
    qb, kb = -(-lq // block_size), -(-lk // block_size)
    summed = torch.zeros(heads, lq, kb, dtype=probs.dtype)
    summed.index_add_(2, torch.arange(lk) // block_size, probs)
    rows_per_block = torch.bincount(torch.arange(lq) // block_size, minlength=qb).to(probs.dtype)
    per_block = torch.zeros(heads, qb, kb, dtype=probs.dtype)
    per_block.index_add_(1, torch.arange(lq) // block_size, summed)
    return (per_block / rows_per_block[None, :, None])[None]


def sampled_block_mass(q: torch.Tensor, k: torch.Tensor, block_size: int, sample_rows: int | None) -> torch.Tensor:
    """``chorus.kernels.block_mass`` (``scale=1``) with the rows it samples, vectorised over blocks:
    float32 ``[1, H, Qb, Kb]`` (checked against the kernel API in the tests)."""
    lq, lk = q.shape[2], k.shape[2]
    qb = -(-lq // block_size)
    rows, owner = [], []
    for b in range(qb):
        start, stop = b * block_size, min((b + 1) * block_size, lq)
        offs = kernels.reference.sample_row_offsets(stop - start, sample_rows) + start
        rows.append(offs)
        owner.append(torch.full_like(offs, b))
    rows, owner = torch.cat(rows), torch.cat(owner)
    probs = torch.softmax(torch.matmul(q[0, :, rows].float(), k[0].float().transpose(-1, -2)), dim=-1)
    kb = -(-lk // block_size)
    per_key_block = torch.zeros(probs.shape[0], probs.shape[1], kb, dtype=probs.dtype)
    per_key_block.index_add_(2, torch.arange(lk) // block_size, probs)
    mass = torch.zeros(probs.shape[0], qb, kb, dtype=probs.dtype).index_add_(1, owner, per_key_block)
    return (mass / torch.bincount(owner, minlength=qb).to(probs.dtype)[None, :, None])[None]


def masked_output(probs: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor | None, block_size: int) -> torch.Tensor:
    """Attention output ``[H, L, D]`` restricted to ``block_map`` ``[1|H, Qb, Kb]`` (None = dense)."""
    if block_map is None:
        return torch.matmul(probs, v[0])
    heads, lq, lk = probs.shape
    qb, kb = block_map.shape[-2:]
    pq, pk = qb * block_size - lq, kb * block_size - lk
    p = torch.nn.functional.pad(probs, (0, pk, 0, pq)).view(heads, qb, block_size, kb, block_size)
    p = (p * block_map.to(probs.dtype).view(-1, qb, 1, kb, 1)).view(heads, qb * block_size, kb * block_size)
    p = p[:, :lq, :lk]
    return torch.matmul(p, v[0]) / p.sum(-1, keepdim=True).clamp_min(1e-30)


def _errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    cos = float((out * ref).sum() / (out.norm() * ref.norm()).clamp_min(1e-30))
    return rel, cos


def select(mass: torch.Tensor, cfg: SourceConfig, rc: ReuseConfig) -> torch.Tensor:
    """The engine's recording selection: top-p, k_min, diagonal and first-frame keep-set."""
    first = kernels.first_frame_blocks(cfg.grid[1] * cfg.grid[2], rc.block_size)
    return kernels.select_blocks(mass, top_p=rc.top_p, k_min=min(rc.k_min, mass.shape[-1]), keep_diagonal=True,
                                 keep_first_frame_blocks=first)


def record_entry(model: SyntheticModel, attention: RequestAttention, rc: ReuseConfig):
    """Masks ``{(expert, step, layer, 0): bool [H, Qb, Kb]}`` as the miss path records them (block mass
    from the engine's sampled rows, exact on the verification anchors, then ``select_blocks``), and the
    recorded mass (for the static baseline)."""
    masks, masses, first_step = {}, {}, {}
    for expert, step, layer in model.cfg.keys():
        q, k, _ = attention.qkv(expert, step, layer)
        mass = sampled_block_mass(q, k, rc.block_size, rc.sample_rows)
        first_step.setdefault(expert, step)
        if rc.anchors and rc.sample_rows is not None and layer in rc.verify_layers and step == first_step[expert]:
            heads = torch.tensor(verify_head_index(q.shape[1], rc.verify_heads))
            exact = sampled_block_mass(q.index_select(1, heads), k.index_select(1, heads), rc.block_size,
                                       rc.anchor_rows)
            mass = mass.index_copy(1, heads, exact)
        masks[(expert, step, layer, 0)] = select(mass, model.cfg, rc)[0]
        masses[(expert, step, layer, 0)] = mass[0]
    return masks, masses


def _unpack(stored, key):
    m = stored[key]
    if hasattr(m, "unpack") and not isinstance(m, torch.Tensor):
        m = m.unpack()
    m = torch.as_tensor(m)
    return m[0] if m.dim() == 4 else m


def evaluate_query(model: SyntheticModel, attention: RequestAttention, entry_masks: dict, static_masks: dict | None,
                   rc: ReuseConfig) -> dict:
    """Metrics of reusing ``entry_masks`` for this request (module docstring), averaged over calls."""
    cfg = model.cfg
    refresh = kernels.VisitRefresh(rc.refresh_steps) if rc.refresh_steps > 0 else None
    rows = {name: [] for name in ("recall", "density", "rel_l2", "cosine", "own_recall", "own_density", "own_rel_l2",
                                  "own_cosine", "static_recall", "static_density", "static_rel_l2", "static_cosine")}
    for expert, step, layer in cfg.keys():
        key = (expert, step, layer, 0)
        q, k, v = attention.qkv(expert, step, layer)
        probs = exact_probs(q, k)
        mass = block_mass_from_probs(probs, rc.block_size)[0]        # [H, Qb, Kb]
        dense = masked_output(probs, v, None, rc.block_size)
        reused = floor_k_min(_unpack(entry_masks, key).bool(), rc.k_min)
        if refresh is not None:
            reused = reused | refresh.extra_pairs(layer, reused, step)
            refresh.record(layer, reused, step)
        maps = {"": reused, "own_": select(mass[None], cfg, rc)[0]}
        if static_masks is not None:
            maps["static_"] = floor_k_min(static_masks[key], rc.k_min)
        for prefix, bmap in maps.items():
            rows[prefix + "recall"].append(float((mass * bmap).sum(-1).mean()))
            rows[prefix + "density"].append(float(bmap.float().mean()))
            if prefix == "static_":
                continue  # recall and density only (output error costs as much as the rest)
            rel, cos = _errors(masked_output(probs, v, bmap, rc.block_size), dense)
            rows[prefix + "rel_l2"].append(rel)
            rows[prefix + "cosine"].append(cos)
    out = {name: float(np.mean(vals)) for name, vals in rows.items() if vals}
    out["recall_min"] = float(np.min(rows["recall"]))
    out["rel_l2_max"] = float(np.max(rows["rel_l2"]))
    return out


def static_masks_from(masses: list[dict], cfg: SourceConfig, rc: ReuseConfig) -> dict:
    """A prompt-agnostic per-head map per call: the mean recorded mass of all entries, selected."""
    keys = masses[0].keys()
    return {key: select(torch.stack([m[key] for m in masses]).mean(0)[None], cfg, rc)[0] for key in keys}


def threshold_table(results: list[dict], thresholds=None, recall_margin: float = 0.05,
                    error_ratio: float = 1.25) -> tuple[list[dict], dict]:
    """Per threshold: hit rate and, over the hits, mean/worst recall, mean/worst rel-L2, and the
    *unsafe* hits by two criteria: ``unsafe_recall`` = reused recall more than ``recall_margin``
    below the request's own oracle recall; ``unsafe_error`` = reused output error more than
    ``error_ratio`` times the error of the request's own oracle map.

    Returns ``(rows, recommended)`` with ``recommended[criterion]`` = the lowest threshold at which
    no hit is unsafe by that criterion (None if there is none)."""
    if thresholds is None:
        thresholds = [round(x, 2) for x in np.arange(0.0, 1.0, 0.01)]
    rows = []
    for tau in thresholds:
        hits = [r for r in results if r["similarity"] >= tau]
        row = {"threshold": tau, "hit_rate": len(hits) / max(len(results), 1), "hits": len(hits),
               "unsafe_recall": sum(r["recall"] < r["own_recall"] - recall_margin for r in hits),
               "unsafe_error": sum(r["rel_l2"] > error_ratio * r["own_rel_l2"] for r in hits)}
        if hits:
            row.update(recall_mean=float(np.mean([r["recall"] for r in hits])),
                       recall_worst=float(np.min([r["recall_min"] for r in hits])),
                       rel_l2_mean=float(np.mean([r["rel_l2"] for r in hits])),
                       rel_l2_worst=float(np.max([r["rel_l2"] for r in hits])))
        rows.append(row)
    recommended = {}
    for crit in ("unsafe_recall", "unsafe_error"):
        recommended[crit] = next((r["threshold"] for r in rows if r[crit] == 0), None)
    recommended["criteria"] = {"recall_margin": recall_margin, "error_ratio": error_ratio}
    return rows, recommended


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float | None = None) -> float:
    """PSNR of ``a`` against the reference ``b`` (data range: ``b``'s max - min unless given)."""
    a, b = a.double(), b.double()
    rng = float(b.max() - b.min()) if data_range is None else float(data_range)
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * math.log10(rng * rng / mse)
