"""Glue between a request and a cache store: find a plan, commit a plan.

The store is anything that follows ``chorus.cache_store.protocol.CacheStore`` (the one-host
``Workspace`` or the PostgreSQL ``FleetStore``); only its ``__len__``, ``search``, ``load``,
``touch``, ``add_unique`` and ``add`` are used here."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from .. import kernels
from .plan import Plan, Retrieval, entry_text, hit_message
from .routing import match_step
from .compat import SIGNATURE_FORMAT, TOKEN_ORDER, grid_compatibility, latent_compatibility, serve_mismatch
from .model_info import token_grid
from .state import failure_text

log = logging.getLogger("chorus.engine")

SEARCH_CANDIDATES = 8  # also the candidates a hit can move to when it meets another model or schedule


def retrieve_plan(workspace, embedding, latent_shape, *, similarity_threshold: float = 0.9,
                  request_meta: dict | None = None, candidates: int = SEARCH_CANDIDATES,
                  workspace_name: str | None = None) -> Plan:
    """Search ``workspace`` (a store) for the most similar compatible entry and return a :class:`Plan`.

    ``embedding``: 1-D float vector (the store normalises it). ``latent_shape``: ``[C, T, H, W]`` or
    ``[B, C, T, H, W]``. The best ``candidates`` entries by similarity are tried in order; an entry
    is used when its similarity >= ``similarity_threshold`` and its latent is compatible (same grid,
    or another grid of the same aspect: masks resampled); a hit keeps the candidates ranked after it
    at or above the threshold (``Retrieval.candidates``) and a loader of them bound to ``workspace``
    (the plan's ``reselect``: where :meth:`Plan.serve_run` moves a hit that meets a model or schedule
    its entry was not made for). Unreadable entries are skipped with a message. The plan carries
    ``similarity_threshold`` so that :func:`commit_plan` writes a miss only if no entry that would
    serve it was written meanwhile (e.g. by another worker that missed on the same request at the
    same time), and ``workspace_name`` (the host's name of the store, or None) as given.
    Never raises for a store problem: returns a miss that says what happened.
    Raises ``ValueError`` for a threshold outside [0, 1] or a bad latent shape.
    """
    if not (0.0 <= float(similarity_threshold) <= 1.0):
        raise ValueError(f"similarity_threshold must be in [0, 1], got {similarity_threshold!r}")
    grid = token_grid(latent_shape)
    latent = tuple(int(s) for s in latent_shape)[-4:]
    emb = np.asarray(embedding, dtype=np.float32).reshape(-1)
    if emb.size == 0 or not np.isfinite(emb).all():
        raise ValueError("embedding must be a non-empty finite vector")
    common = dict(embedding=emb, latent_shape=latent, request_meta=request_meta, workspace_name=workspace_name,
                  similarity_threshold=float(similarity_threshold))
    try:
        found = workspace.search(emb, k=candidates) if len(workspace) else []
    except Exception as exc:  # noqa: BLE001 - a broken index is a miss, not a failed prompt
        return Plan.miss(f"miss: search failed ({failure_text(exc)})", **common)
    if not found:
        return Plan.miss("miss: the workspace has no entries yet", **common)
    loader = CandidateLoader(workspace, grid, latent, common)
    reasons = []
    for i, (entry_id, similarity) in enumerate(found):
        similarity = float(similarity)
        if similarity < similarity_threshold:
            reasons.append(f"best remaining similarity {similarity:.3f} < threshold {similarity_threshold:.3f}")
            break
        others = tuple((e, float(s)) for e, s in found[i + 1:] if float(s) >= similarity_threshold)
        hit, why = loader.hit(entry_id, similarity, others)
        if hit is not None:
            return Plan.from_retrieval(hit, reselect=loader.reselect)
        reasons.append(why)
    best = float(found[0][1])
    return Plan.miss(f"miss (best similarity {best:.3f}): " + "; ".join(reasons), **common)


class CandidateLoader:
    """A retrieval's access to its store's entries, bound by :func:`retrieve_plan`: loads one candidate
    as a hit (:meth:`hit`), or the first of a list that serves given models and a sampler run
    (:meth:`reselect`, what a plan calls at the start of a sampler run; an entry is ~5 MB, tens of
    ms). Never raises for a store problem (that candidate is skipped, with its reason)."""

    def __init__(self, workspace, grid, latent, common: dict):
        self._workspace, self._grid, self._latent, self._common = workspace, grid, latent, dict(common)

    def hit(self, entry_id, similarity: float, others=(), models=(), run_starts=None, block_size=None,
            forward_grid=None, image_frames=None):
        """``(Retrieval, "")`` of a hit on this entry (``others``: its candidates), or ``(None, why not)``:
        unreadable, incompatible latent, no masks, made for another of ``models`` (ModelInfo), not for
        this sampler run (``run_starts`` / ``block_size``, :func:`~chorus.engine.compat.run_mismatch`) or, when
        ``forward_grid`` is given, not for its forwards' token grid (then that grid, not the latent's, decides
        whether the maps are resampled: :func:`~chorus.engine.compat.grid_compatibility`), or recorded with
        input images on other latent frames than ``image_frames`` (all but the grid:
        :func:`~chorus.engine.compat.serve_mismatch`)."""
        try:
            masks, meta = _load(self._workspace, entry_id)
            signature = meta["signature"]
        except Exception as exc:  # noqa: BLE001 - corrupt entry: the store quarantines it; go on
            return None, f"entry {entry_id} unreadable ({failure_text(exc)})"
        verdict, why = latent_compatibility(signature, self._latent)
        if verdict == "incompatible":
            return None, f"entry {entry_id} (similarity {similarity:.3f}) incompatible: {why}"
        if not masks:
            return None, f"entry {entry_id} holds no masks"
        mismatch = serve_mismatch(signature, models, run_starts, block_size, image_frames)
        if mismatch is not None:
            return None, f"entry {entry_id}: {mismatch}"
        grid = self._grid
        if forward_grid is not None:
            grid = tuple(int(g) for g in forward_grid)
            verdict, why = grid_compatibility(signature, grid)
            if verdict == "incompatible":
                return None, f"entry {entry_id}: {why}"
        try:
            return Retrieval("hit", message=hit_message(entry_id, similarity, why), entry_id=entry_id,
                             similarity=similarity, masks=masks, entry_meta=meta,
                             resample_to=grid if verdict == "resample" else None, candidates=others,
                             **self._common), ""
        except ValueError as exc:  # e.g. an order that cannot be rebuilt: not this entry
            return None, f"entry {entry_id}: {exc}"

    def reselect(self, candidates, models, *, run_starts=None, block_size=None,
                 forward_grid=None, image_frames=None) -> tuple[Retrieval | None, str]:
        """The hit on the most similar of ``candidates`` (``(entry_id, similarity)``, best first) whose
        entry serves every model of ``models`` (:class:`ModelInfo`), the sampler run (``run_starts``:
        the sigmas its steps start at; ``block_size``), its forwards' token grid (``forward_grid``, or
        None: not known yet) and input images (``image_frames``, or None), with the candidates after it, or
        ``(None, why not)``."""
        reasons = []
        candidates = list(candidates)
        for i, (entry_id, similarity) in enumerate(candidates):
            hit, why = self.hit(entry_id, similarity, tuple(candidates[i + 1:]), models, run_starts, block_size,
                                forward_grid, image_frames)
            if hit is not None:
                return hit, ""
            reasons.append(why)
        return None, "; ".join(reasons)


def _load(workspace, entry_id):
    """Load an entry without counting a hit (the hit is counted by :func:`commit_plan`), bit-packed
    (maps are unpacked on the device that uses them); the store protocol has both options. With CUDA
    present the packed maps are moved into pinned host memory here, before sampling, so the first
    sparse call of a run only starts one asynchronous host -> device copy (``ChorusAttention``)."""
    masks, meta = workspace.load(entry_id, packed=True, touch=False)
    return _pin_packed(masks), meta


def _pin_packed(masks: dict) -> dict:
    """``masks`` with every bit-packed map's ``bits`` in pinned host memory (same keys, same maps).
    A no-op without CUDA, and for plain tensors (stored mass) and maps that cannot be pinned."""
    if not torch.cuda.is_available():
        return masks
    out = {}
    for key, stored in masks.items():
        bits = getattr(stored, "bits", None)
        if isinstance(bits, torch.Tensor) and bits.device.type == "cpu" and not bits.is_pinned():
            try:
                stored = dataclasses.replace(stored, bits=bits.pin_memory())
            except (RuntimeError, TypeError, ValueError):  # no pinned memory here: the plain copy stays
                pass
        out[key] = stored
    return out


def build_signature(plan: Plan) -> dict:
    """The signature written with a new entry (see ``compat.py``). Raises ``ValueError`` if the
    plan has not recorded anything."""
    rec = plan.recorder
    if rec is None:
        raise ValueError("the plan did not record (nothing can be written for it)")
    if rec.grid is None or not plan.experts:
        raise ValueError("nothing recorded")
    first = plan.experts[0]
    steps = rec.step_sigmas()
    sampler = plan.state.sampler_steps.steps()
    signature = {
        "format": SIGNATURE_FORMAT,
        "family": first.family,
        "variant": first.variant,
        "experts": [e.fingerprint for e in plan.experts],
        "num_layers": first.num_layers,
        "num_heads": first.num_heads,
        "latent_shape": list(plan.latent_shape) if plan.latent_shape else None,
        "token_grid": list(rec.grid),
        "block_size": rec.block_size,
        "token_order": rec.token_order or TOKEN_ORDER,  # the order the recording ran in (None: raster)
        "step_sigmas": [round(s, 6) for s in steps],
        "head_groups": 1,
    }
    if plan.state.image_frames is not None:
        signature["image_frames"] = [int(f) for f in plan.state.image_frames]
    if any(match_step(s, steps) is None for s in sampler):
        # the sampler had steps the model was not called at (a step cache such as EasyCache skipped
        # them): a hit needs this schedule, and runs those steps dense
        signature["sampler_sigmas"] = [round(s, 6) for s in sampler]
    return signature


def commit_plan(workspace, plan: Plan) -> str:
    """After sampling: write a miss's recording as a new entry, or count a hit. Returns a message.

    A hit demoted while it ran (its verification failed) is written as a miss is, beside its entry: the
    deduplication (``add_unique``) does not count that entry as serving the request (``replacing``).

    Never raises for an incomplete recording or a store error: the message says why nothing was
    written. Committing the same plan twice does nothing the second time.
    """
    if plan.committed is not None:
        return plan.committed
    if plan.is_hit:
        msg = f"hit: reused {entry_text(plan.entry_id, plan.similarity)}"
        counter = getattr(workspace, "touch", None)
        if counter is not None:
            stats = plan.stats
            run = {"sparse_calls": stats.sparse_calls, "tail_calls": stats.tail_calls,
                   "fallback_calls": stats.fallback_calls}
            try:
                counter(plan.entry_id, run=run)
                msg = (f"hit: updated stats of {entry_text(plan.entry_id, plan.similarity)} ("
                       f"{run['sparse_calls']} sparse calls, {run['tail_calls']} with the pooled tail, "
                       f"{run['fallback_calls']} dense fallbacks)")
            except Exception as exc:  # noqa: BLE001
                msg += f"; hit stats not updated ({failure_text(exc)})"
        plan.state.committed = msg
        return msg
    if plan.embedding is None:
        plan.state.committed = "not written: the request has no embedding"
        return plan.committed
    if plan.recorder is None:
        plan.state.committed = "not written: the plan did not record"
        return plan.committed
    try:
        masks = plan.recorder.block_maps()
        signature = build_signature(plan)
    except ValueError as exc:
        plan.state.committed = f"not written: {exc}"
        return plan.committed
    meta = plan.request_meta  # the request's fields + e.g. feature reuse's
    meta.update({"signature": signature, "created": time.time(), "hits": 0})
    threshold = plan.similarity_threshold
    add_unique = getattr(workspace, "add_unique", None)
    # a hit demoted mid-request (its verification failed) is written anew: its entry does not serve it
    replacing = plan.entry_id if plan.demoted_reason is not None else None
    try:
        if threshold is not None and add_unique is not None:
            # dedupe under the store's writer lock: a concurrent worker may have written this request
            entry_id, created = add_unique(plan.embedding, masks, meta, min_similarity=threshold, replacing=replacing)
            if not created:
                plan.state.committed = (f"not written: entry {entry_id} (written meanwhile, e.g. by another worker) "
                                        f"already serves this request at threshold {threshold:.3f}")
                return plan.committed
        else:
            entry_id = workspace.add(plan.embedding, masks, meta)
    except Exception as exc:  # noqa: BLE001 - the request succeeded; the cache just did not grow
        log.warning("Chorus II: writing the cache entry failed: %s", exc)
        plan.state.committed = f"not written: the store refused the entry ({failure_text(exc)})"
        return plan.committed
    density = sum(kernels.density(m) for m in masks.values()) / max(len(masks), 1)
    plan.state.committed = f"wrote entry {entry_id} ({len(masks)} maps, density {density:.1%})" + (
        "" if replacing is None else f", for the request entry {replacing} failed to serve")
    return plan.committed
