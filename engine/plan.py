"""The plan of one request: the immutable retrieval result plus the request's state.

- :class:`Retrieval` (frozen): what retrieval decided — a hit (reuse an entry's masks) or a miss
  (dense + record) — with the request's embedding, latent shape, metadata and threshold. A hit whose
  entry was made for other weights or another sampler schedule than it meets is replaced, before any
  sparse call, by the retrieval of a candidate made for them (``Plan.serve_model``), or demoted.
- :class:`~chorus.engine.state.RequestState` (``plan.state``): what changes while the request
  samples (stats, recorder, experts, refresh, feature-reuse state, entry extras, commit result).
- :class:`Plan`: the object passed between nodes / hosts; read-only properties over both, and the
  methods the patched models call (``note``, ``demote``, ``register_expert``, ``stored_map``,
  ``refresh_state``). Attributes cannot be set on it: per-request state is a declared field of
  ``plan.state``.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from .. import kernels
from .recorder import MassRecorder
from .signature import ModelInfo, entry_sampler_sigmas, entry_token_order, model_mismatch, run_mismatch, token_grid
from .state import PlanStats, RequestState

log = logging.getLogger("chorus.engine")

__all__ = ["Plan", "PlanStats", "RequestState", "Retrieval"]



@dataclass(frozen=True, eq=False)
class Retrieval:
    """The retrieval result of one request, immutable once made (see :class:`Plan` for the fields).

    ``masks`` and ``request_meta`` are read-only mappings (``request_meta`` as the caller gave it;
    what feature reuse adds for a new entry is ``RequestState.entry_extras``)."""

    kind: str
    message: str = ""
    entry_id: Any = None
    similarity: float | None = None
    masks: Mapping = field(default_factory=dict)
    entry_meta: Mapping | None = None
    embedding: np.ndarray | None = None
    latent_shape: tuple | None = None
    resample_to: tuple | None = None
    similarity_threshold: float | None = None
    request_meta: Mapping = field(default_factory=dict)
    workspace: Any = field(default=None, repr=False)
    # a hit's other search results at or above the threshold, ``((entry_id, similarity), ...)`` best
    # first: where :meth:`Plan.serve_model` looks when the entry was made for another model or schedule
    alternatives: tuple = ()
    # a hit's token order (None: raster), read from its entry's signature once, here
    entry_order: Any = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.kind not in ("hit", "miss"):
            raise ValueError(f"plan kind must be 'hit' or 'miss', got {self.kind!r}")
        if self.kind == "hit" and (not self.masks or self.entry_meta is None or "signature" not in self.entry_meta):
            raise ValueError("a hit needs masks and entry_meta with a signature")
        if self.kind == "hit":
            try:
                order = entry_token_order(self.entry_meta["signature"])
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"a hit's entry has an unreadable token order ({exc})") from None
            if order is not None and self.resample_to is not None:  # (retrieval misses first)
                raise ValueError(f"a hit in token order {order.name} cannot be resampled (raster order only)")
            object.__setattr__(self, "entry_order", order)

        def fix(name, value):
            object.__setattr__(self, name, value)

        if self.embedding is not None:
            fix("embedding", np.asarray(self.embedding, dtype=np.float32).reshape(-1))
        if self.latent_shape is not None:
            fix("latent_shape", tuple(int(s) for s in self.latent_shape)[-4:])
        if self.resample_to is not None:
            fix("resample_to", tuple(int(g) for g in self.resample_to))
        if self.similarity_threshold is not None:
            fix("similarity_threshold", float(self.similarity_threshold))
        fix("alternatives", tuple((entry_id, float(sim)) for entry_id, sim in (self.alternatives or ())))
        fix("masks", types.MappingProxyType(dict(self.masks or {})))
        fix("request_meta", types.MappingProxyType(dict(self.request_meta or {})))

    def __deepcopy__(self, memo):
        return self


class Plan:
    """What a request does with self-attention: ``plan.retrieval`` (:class:`Retrieval`, immutable)
    plus ``plan.state`` (:class:`~chorus.engine.state.RequestState`, per request).

    - ``kind``: ``"hit"`` or ``"miss"`` (a demoted hit is a miss); ``message`` says why.
    - hit: ``entry_id``, ``similarity``, ``masks`` = ``{(expert, step, layer, head_group): bool
      [H, Qb, Kb]}`` on the CPU, ``entry_meta`` (with ``"signature"``), ``step_sigmas`` of the entry,
      and ``resample_to`` = the token grid to resample masks to (None when the grid is the entry's).
    - miss: ``recorder`` (a :class:`MassRecorder`) that the patched models fill; None when
      ``record=False`` (nothing could be written: no embedding or no usable workspace).
    - both: ``embedding`` (float32 numpy, L2-normalised by the store), ``latent_shape`` ``[C, T, H, W]``,
      ``request_meta`` (the request's free-form fields merged with ``state.entry_extras``: what a new
      entry's metadata gets), ``similarity_threshold`` (the one retrieval used, or None),
      ``stats`` (:class:`PlanStats`), ``experts`` (ModelInfo of the models that sampled, in order).

    ``Plan("hit", ...)`` / ``Plan.miss(message, ...)`` take the :class:`Retrieval` fields as keywords
    (plus ``keep_mass`` / ``record`` for the recorder); ``Plan.from_retrieval(r)`` takes one.
    ``copy.deepcopy(plan)`` returns the plan itself: hosts deep-copy model options (ComfyUI's
    ``clone()``), while every patched model of a request must share one plan. Setting an attribute
    on a plan raises ``AttributeError``.
    """

    __slots__ = ("retrieval", "state")
    MAX_MESSAGES = 20

    def __init__(self, kind: str, *, message: str = "", embedding=None, latent_shape=None,
                 request_meta: dict | None = None, entry_id=None, similarity: float | None = None,
                 masks: dict | None = None, entry_meta: dict | None = None, resample_to=None,
                 workspace=None, similarity_threshold: float | None = None, alternatives=(),
                 keep_mass: bool = False, record: bool = True):
        retrieval = Retrieval(kind, message=message, entry_id=entry_id, similarity=similarity, masks=masks or {},
                              entry_meta=entry_meta, embedding=embedding, latent_shape=latent_shape,
                              resample_to=resample_to, similarity_threshold=similarity_threshold,
                              request_meta=request_meta or {}, workspace=workspace,
                              alternatives=tuple(alternatives))
        self._init(retrieval, keep_mass=keep_mass, record=record)

    def _init(self, retrieval: Retrieval, *, keep_mass: bool, record: bool) -> None:
        recorder = MassRecorder(keep_mass=keep_mass) if retrieval.kind == "miss" and record else None
        object.__setattr__(self, "retrieval", retrieval)
        object.__setattr__(self, "state", RequestState(stats=PlanStats(similarity=retrieval.similarity),
                                                       recorder=recorder))

    # -- construction helpers ------------------------------------------------------------------
    @classmethod
    def miss(cls, message: str, **kwargs) -> "Plan":
        return cls("miss", message=message, **kwargs)

    @classmethod
    def from_retrieval(cls, retrieval: Retrieval, *, keep_mass: bool = False, record: bool = True) -> "Plan":
        if not isinstance(retrieval, Retrieval):
            raise ValueError(f"retrieval must be a Retrieval, got {type(retrieval).__name__}")
        plan = cls.__new__(cls)
        plan._init(retrieval, keep_mass=keep_mass, record=record)
        return plan

    def __setattr__(self, name, value):
        raise AttributeError(f"a Plan is read-only (tried to set {name!r}); per-request state is a declared "
                             "field of plan.state (chorus.engine.state.RequestState)")

    def __delattr__(self, name):
        raise AttributeError(f"a Plan is read-only (tried to delete {name!r})")

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __reduce__(self):
        raise TypeError("a Plan is not picklable (it holds live request state)")

    def __repr__(self) -> str:
        who = f"entry {self.entry_id}, similarity {self.similarity:.3f}" if self.is_hit else self.message
        return f"Plan({self.kind}: {who})"

    # -- read-only views ---------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return "miss" if self.state.demoted_reason is not None else self.retrieval.kind

    @property
    def is_hit(self) -> bool:
        return self.kind == "hit"

    @property
    def message(self) -> str:
        reason = self.state.demoted_reason
        if reason is not None:
            return f"miss ({reason}); was a hit on entry {self.retrieval.entry_id}"
        return self.retrieval.message

    @property
    def entry_id(self):
        return self.retrieval.entry_id

    @property
    def similarity(self) -> float | None:
        return self.retrieval.similarity

    @property
    def masks(self) -> Mapping:
        return self.retrieval.masks

    @property
    def entry_meta(self) -> Mapping | None:
        return self.retrieval.entry_meta

    @property
    def entry_order(self):
        """A hit's token order (a :class:`~chorus.kernels.tile_order.TileOrder` /
        ``RegionTileOrder``; None: raster or a miss), from its entry's signature."""
        return self.retrieval.entry_order

    @property
    def embedding(self):
        return self.retrieval.embedding

    @property
    def latent_shape(self):
        return self.retrieval.latent_shape

    @property
    def resample_to(self):
        return self.retrieval.resample_to

    @property
    def similarity_threshold(self) -> float | None:
        return self.retrieval.similarity_threshold

    @property
    def workspace(self):
        return self.retrieval.workspace

    @property
    def request_meta(self) -> dict:
        """The request's own fields merged with ``state.entry_extras`` (a new dict on every read)."""
        with self.state.lock:
            return {**self.retrieval.request_meta, **self.state.entry_extras}

    @property
    def stats(self) -> PlanStats:
        return self.state.stats

    @property
    def recorder(self) -> MassRecorder | None:
        return self.state.recorder

    @property
    def experts(self) -> list[ModelInfo]:
        return self.state.experts

    @property
    def demoted_reason(self) -> str | None:
        return self.state.demoted_reason

    @property
    def committed(self) -> str | None:
        return self.state.committed

    @property
    def step_sigmas(self) -> list[float]:
        if self.is_hit:
            try:
                return [float(s) for s in self.entry_meta["signature"].get("step_sigmas", [])]
            except (TypeError, ValueError, AttributeError):
                return []  # an unreadable schedule matches no step: the plan is demoted, runs dense
        return self.recorder.step_sigmas() if self.recorder is not None else []

    @property
    def sampler_sigmas(self) -> list[float]:
        """A hit's entry's sampler schedule (the sigmas its runs' steps started at; its ``step_sigmas``
        when it recorded every step): what a sampler run must match (``signature.run_mismatch``)."""
        if not self.is_hit:
            return []
        try:
            return entry_sampler_sigmas(self.entry_meta["signature"])
        except (TypeError, ValueError, AttributeError):
            return []

    @property
    def token_grid(self):
        if self.resample_to is not None:
            return self.resample_to
        if self.is_hit:
            return tuple(self.entry_meta["signature"]["token_grid"])
        return None if self.latent_shape is None else token_grid(self.latent_shape)

    # -- state shared by the patched models --------------------------------------------------------
    def note(self, message: str) -> None:
        """Log a message once per plan and keep it for the UI (at most ``MAX_MESSAGES`` distinct
        ones; later ones are counted in ``stats.suppressed_messages`` and logged at debug level)."""
        state = self.state
        with state.lock:
            if message in state.noted:
                return
            state.noted.add(message)
            if len(state.stats.messages) >= self.MAX_MESSAGES:
                state.stats.suppressed_messages += 1
                log.debug("Chorus II: %s", message)
                return
            state.stats.messages.append(message)
        log.warning("Chorus II: %s", message)

    def demote(self, reason: str, recorder: MassRecorder | None = None) -> None:
        """Turn a hit into a miss: dense attention + recording from now on.

        ``recorder``: a recording that already covers every sparse call of the request (the
        verification's record-ahead, engine/verify.py); it continues, so the request can be written.
        Without one, if sparse calls already ran, the recording cannot cover the request: it is
        marked incomplete and no entry will be written from it.
        """
        state = self.state
        with state.lock:
            if not self.is_hit:
                return
            state.demoted_reason = reason
            if recorder is not None and recorder.incomplete_reason is None:
                state.recorder = recorder
            else:
                state.recorder = MassRecorder()
                if state.stats.sparse_calls:
                    state.recorder.mark_incomplete(f"plan demoted after {state.stats.sparse_calls} sparse calls "
                                                   f"({reason})")
        self.note(f"plan demoted to dense: {reason}")

    def register_expert(self, info: ModelInfo, *, run_starts=None, block_size: int | None = None) -> int | None:
        """Expert index of a model in this request (order of first sampling), at the start of one of
        its sampler runs (``run_starts``: the sigmas the run's steps start at; ``block_size``: the
        sparse sampler's, when it runs one).

        On a hit the entry must serve the model and the run (:meth:`serve_model`); otherwise the plan
        is demoted and the index is the model's position among this request's models. Returns None
        for an unsupported model (the caller runs it dense). The run's starts join
        ``state.sampler_steps`` (what a new entry records as its sampler schedule).
        """
        with self.state.lock:
            for s in run_starts or ():
                self.state.sampler_steps.canonical(s)
            if not info.supported:
                self.note(f"unsupported model: {info.reason}; dense attention")
                return None
            for i, known in enumerate(self.experts):
                if known.fingerprint == info.fingerprint:
                    index = i
                    break
            else:
                self.experts.append(info)
                index = len(self.experts) - 1
            if self.is_hit and self.serve_model(info, run_starts=run_starts, block_size=block_size) is None:
                return list(self.entry_meta["signature"].get("experts", [])).index(info.fingerprint)
            return index

    def serve_model(self, info: ModelInfo, *, run_starts=None, block_size: int | None = None) -> str | None:
        """Make a hit serve this model (and, given ``run_starts`` / ``block_size``, this sampler run), or
        demote it; returns the demotion reason, or None.

        Retrieval sees neither the models nor the sampler (the embedding is the request's), so the
        best entry can be one made for other weights or another schedule: the same prompt sampled with
        another LoRA, strength or step count has an equal embedding. Before the request's first sparse
        call, a hit whose entry does not serve them moves to the most similar of retrieval's other
        candidates that serves them and every model this plan served so far
        (:func:`~chorus.engine.retrieval.retrieval_for_models`); when none does, or sparse calls
        already ran, the plan is demoted.
        """
        with self.state.lock:
            if not self.is_hit:
                return None
            served = self.state.served_models
            signature = self.entry_meta["signature"]
            reason = model_mismatch(signature, info) or run_mismatch(signature, run_starts, block_size)
            if reason is not None:
                moved, why = None, ""
                if self.state.stats.sparse_calls == 0 and self.retrieval.alternatives:
                    from .retrieval import retrieval_for_models  # retrieval builds plans: imported when used

                    moved, why = retrieval_for_models(self.retrieval, [*served, info], run_starts=run_starts,
                                                      block_size=block_size)
                if moved is None:
                    reason += f"; no other candidate serves it ({why})" if why else ""
                    self.demote(reason)
                    return reason
                old = self.retrieval.entry_id
                object.__setattr__(self, "retrieval", moved)
                self.state.resampled.clear()
                self.state.stats.similarity = moved.similarity
                self.note(f"hit moved from entry {old} ({reason}) to entry {moved.entry_id}, similarity "
                          f"{moved.similarity:.3f}, made for this model and schedule")
            if all(m.fingerprint != info.fingerprint for m in served):
                served.append(info)
            return None

    def refresh_state(self, refresh_steps: int):
        """The request's ``VisitRefresh`` for this R (shared by all experts)."""
        with self.state.lock:
            refresh = self.state.refresh
            if refresh_steps not in refresh:
                refresh[refresh_steps] = kernels.VisitRefresh(refresh_steps)
            return refresh[refresh_steps]

    def stored_map(self, expert: int, step: int, layer: int, *, block_size: int, top_p: float,
                   k_min: int, device=None) -> torch.Tensor:
        """Bool ``[H, Qb, Kb]`` for a key (on ``device``, default CPU), resampled to ``resample_to``.

        Entries store bool maps (possibly bit-packed, ``cache_store.PackedMap``: unpacked on
        ``device``); an entry that stores float block *mass* instead is turned into a map here with
        ``select_blocks(top_p, k_min)`` (density chosen at retrieval time). Transformed maps are
        cached on the CPU for the request. Raises ``KeyError`` when the entry has no map for the key,
        ``ValueError`` on a bad map.
        """
        key = (expert, step, layer, 0)
        resampled = self.state.resampled
        with self.state.lock:
            stored = self.masks[key]
            cache_key = (key, top_p, k_min, block_size)
            if cache_key in resampled:
                return resampled[cache_key].to(device) if device is not None else resampled[cache_key]
            if hasattr(stored, "unpack") and not isinstance(stored, torch.Tensor):  # cache_store PackedMap
                stored = stored.unpack(device) if device is not None else stored.unpack()
            if not isinstance(stored, torch.Tensor):
                raise ValueError(f"entry map {key} is not a tensor")
            block_map = stored
            if block_map.dim() == 4 and block_map.shape[0] == 1:
                block_map = block_map[0]
            if block_map.dim() == 2:
                block_map = block_map[None]
            if block_map.dim() != 3:
                raise ValueError(f"entry map {key} must be [H, Qb, Kb], got {tuple(stored.shape)}")
            transformed = False
            if block_map.dtype != torch.bool:
                if not block_map.is_floating_point():
                    raise ValueError(f"entry map {key} has dtype {block_map.dtype}, expected bool or float mass")
                block_map = kernels.select_blocks(block_map.float()[None], top_p=top_p,
                                                  k_min=min(k_min, block_map.shape[-1]))[0]
                transformed = True
            if self.resample_to is not None:
                src = tuple(self.entry_meta["signature"]["token_grid"])
                block_map = kernels.resample_block_map(block_map.cpu()[None], src, self.resample_to,
                                                       block_size=block_size)[0]
                transformed = True
            if transformed:
                resampled[cache_key] = block_map.cpu()
            return block_map.to(device) if device is not None else block_map
