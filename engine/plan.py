"""The plan of one request (a request as a session): the frozen retrieval result plus the request's state.

- :class:`Retrieval` (frozen): what retrieval decided — a hit (reuse an entry's masks) or a miss
  (dense + record) — with the request's embedding, latent shape, metadata and threshold, and a hit's
  other :class:`Candidate` entries. It holds no store: retrieval gives the plan a ``reselect``
  callable bound to its store, the only way a plan reaches an entry it was not made with.
- :class:`~chorus.engine.state.RequestState` (``plan.state``): what changes while the request
  samples (the retrieval it serves now, stats, recorder, experts, refresh, feature-reuse state,
  entry extras, commit result).
- :class:`Plan`: the object passed between nodes / hosts; read-only properties over both, and the
  methods the patched models call. :meth:`Plan.serve_run`, at the start of every sampler run of a
  model and again at the run's first forward (its token grid: the entry is served at it, resampled where
  needed), is the one place where a hit may move to another candidate or be demoted for a model, schedule
  or grid it does not serve (a note says why);
  verification's demotion (``engine/verify.py``) and :meth:`Plan.demote` are the other ways a hit ends.
  Attributes cannot be set on a plan.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from .. import kernels
from .recorder import MassRecorder
from .compat import entry_sampler_sigmas, entry_token_order, grid_compatibility, model_mismatch, serve_mismatch
from .model_info import ModelInfo, token_grid
from .state import PlanStats, RequestState, failure_text

log = logging.getLogger("chorus.engine")

__all__ = ["Candidate", "Plan", "PlanStats", "RequestState", "Retrieval"]


class Candidate(NamedTuple):
    """Another search result of a hit's retrieval, at or above its threshold (best first)."""

    entry_id: Any
    similarity: float


@dataclass(frozen=True, eq=False)
class Retrieval:
    """The retrieval result of one request, immutable once made (see :class:`Plan` for the fields).

    ``masks`` and ``request_meta`` are read-only mappings (``request_meta`` as the caller gave it;
    what feature reuse adds for a new entry is ``RequestState.entry_extras``). ``candidates``: a hit's
    other search results at or above the threshold, best first (where :meth:`Plan.serve_run` looks
    when the entry was made for another model or schedule). ``workspace_name``: the store the request
    was retrieved from, by the name its host opened it under (``ChorusCacheWrite`` commits there), or
    None."""

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
    workspace_name: str | None = None
    candidates: tuple = ()
    # a hit's token order (None: raster), read from its entry's signature once, here
    entry_order: Any = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.kind not in ("hit", "miss"):
            raise ValueError(f"plan kind must be 'hit' or 'miss', got {self.kind!r}")
        if self.kind == "hit" and (not self.masks or self.entry_meta is None or "signature" not in self.entry_meta):
            raise ValueError("a hit needs masks and entry_meta with a signature")

        def fix(name, value):  # normalising the fields of a frozen dataclass as it is made
            object.__setattr__(self, name, value)

        if self.kind == "hit":
            try:
                order = entry_token_order(self.entry_meta["signature"])
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"a hit's entry has an unreadable token order ({exc})") from None
            fix("entry_order", order)
        if self.embedding is not None:
            fix("embedding", np.asarray(self.embedding, dtype=np.float32).reshape(-1))
        if self.latent_shape is not None:
            fix("latent_shape", tuple(int(s) for s in self.latent_shape)[-4:])
        if self.resample_to is not None:
            fix("resample_to", tuple(int(g) for g in self.resample_to))
        if self.similarity_threshold is not None:
            fix("similarity_threshold", float(self.similarity_threshold))
        fix("candidates", tuple(Candidate(entry_id, float(sim)) for entry_id, sim in (self.candidates or ())))
        fix("masks", types.MappingProxyType(dict(self.masks or {})))
        fix("request_meta", types.MappingProxyType(dict(self.request_meta or {})))

    @property
    def maps_grid(self) -> tuple | None:
        """A hit's: the token grid its maps serve (``resample_to``, else its entry's ``token_grid``); a
        miss: None."""
        if self.kind != "hit":
            return None
        if self.resample_to is not None:
            return self.resample_to
        return tuple(int(g) for g in self.entry_meta["signature"]["token_grid"])

    def __deepcopy__(self, memo):
        return self

    @property
    def signature(self) -> Mapping | None:
        """A hit's entry signature (None: a miss)."""
        return self.entry_meta["signature"] if self.kind == "hit" else None


def entry_text(entry_id, similarity: float | None) -> str:
    """``"entry <id>, similarity <s>"`` (``"entry <id>"`` where the similarity is None: a hit a library
    caller made without one): how every message names a hit's entry."""
    return f"entry {entry_id}" + ("" if similarity is None else f", similarity {similarity:.3f}")


def hit_message(entry_id, similarity: float | None, why: str = "") -> str:
    """A hit's :attr:`Retrieval.message`: the entry, its similarity, and why it is served as it is (e.g.
    resampled), if anything."""
    message = f"hit: {entry_text(entry_id, similarity)}"
    return f"{message} ({why})" if why else message


def grid_unchecked(grid, exc: Exception) -> str:
    """The note of a part's ``serve_grid`` that failed (``ChorusAttention``'s and ``FeatureReuse``'s one wording).
    Never raises: ``grid`` may be what failed to read as a grid (``None``, a number), so it is shown as given."""
    shown = tuple(grid) if isinstance(grid, (tuple, list)) else repr(grid)
    return f"could not check the entry against this forward's token grid {shown} ({failure_text(exc)})"


# reselect(candidates, models, run_starts=, block_size=, forward_grid=, image_frames=) -> (Retrieval or None, why
# not): retrieval's loader of the first candidate whose entry serves every model and the run (engine/retrieval.py)
Reselect = Callable[..., "tuple[Retrieval | None, str]"]


class Plan:
    """What a request does with self-attention: ``plan.retrieval`` (:class:`Retrieval`, immutable; the
    one the request serves now, ``plan.state.retrieval``) plus ``plan.state``
    (:class:`~chorus.engine.state.RequestState`, per request).

    - ``kind``: ``"hit"`` or ``"miss"`` (a demoted hit is a miss); ``message`` says why.
    - hit: ``entry_id``, ``similarity``, ``masks`` = ``{(expert, step, layer, head_group): map}``, each a bool
      ``[H, Qb, Kb]`` tensor or, as retrieval loads them, bit-packed (``cache_store.PackedMap``, pinned on
      CUDA machines; :func:`~chorus.engine.maps.unpacked_map`), ``entry_meta`` (with ``"signature"``), ``step_sigmas`` of the entry,
      and ``resample_to`` = the token grid to resample masks to (None when the grid is the entry's).
    - miss: ``recorder`` (a :class:`MassRecorder`) that the patched models fill; None when
      ``record=False`` (nothing could be written: no embedding or no usable workspace).
    - both: ``embedding`` (float32 numpy, L2-normalised by the store), ``latent_shape`` ``[C, T, H, W]``,
      ``request_meta`` (the request's free-form fields merged with ``state.entry_extras``: what a new
      entry's metadata gets), ``similarity_threshold`` (the one retrieval used, or None),
      ``workspace_name``, ``stats`` (:class:`PlanStats`), ``experts`` (ModelInfo of the models that
      sampled, in order).

    ``Plan("hit", ...)`` / ``Plan.miss(message, ...)`` take the :class:`Retrieval` fields as keywords
    (plus ``keep_mass`` / ``record`` for the recorder, ``reselect`` for the candidates);
    ``Plan.from_retrieval(r)`` takes one. ``copy.deepcopy(plan)`` returns the plan itself: hosts
    deep-copy model options (ComfyUI's ``clone()``), while every patched model of a request must share
    one plan. Setting an attribute on a plan raises ``AttributeError``.
    """

    __slots__ = ("state", "_reselect")
    MAX_MESSAGES = 20

    def __init__(self, kind: str, *, message: str = "", embedding=None, latent_shape=None,
                 request_meta: dict | None = None, entry_id=None, similarity: float | None = None,
                 masks: dict | None = None, entry_meta: dict | None = None, resample_to=None,
                 workspace_name: str | None = None, similarity_threshold: float | None = None, candidates=(),
                 reselect: Reselect | None = None, keep_mass: bool = False, record: bool = True):
        retrieval = Retrieval(kind, message=message, entry_id=entry_id, similarity=similarity, masks=masks or {},
                              entry_meta=entry_meta, embedding=embedding, latent_shape=latent_shape,
                              resample_to=resample_to, similarity_threshold=similarity_threshold,
                              request_meta=request_meta or {}, workspace_name=workspace_name,
                              candidates=tuple(candidates))
        self._init(retrieval, reselect=reselect, keep_mass=keep_mass, record=record)

    def _init(self, retrieval: Retrieval, *, reselect, keep_mass: bool, record: bool) -> None:
        recorder = MassRecorder(keep_mass=keep_mass) if retrieval.kind == "miss" and record else None
        state = RequestState(retrieval=retrieval, stats=PlanStats(similarity=retrieval.similarity), recorder=recorder)
        object.__setattr__(self, "state", state)  # the slots are set once, here (__setattr__ refuses)
        object.__setattr__(self, "_reselect", reselect)

    # -- construction helpers ------------------------------------------------------------------
    @classmethod
    def miss(cls, message: str, **kwargs) -> "Plan":
        return cls("miss", message=message, **kwargs)

    @classmethod
    def from_retrieval(cls, retrieval: Retrieval, *, reselect: Reselect | None = None, keep_mass: bool = False,
                       record: bool = True) -> "Plan":
        """A plan of ``retrieval``; ``reselect``: retrieval's loader of its candidates (None: a hit made
        for another model or schedule is demoted, never moved)."""
        if not isinstance(retrieval, Retrieval):
            raise ValueError(f"retrieval must be a Retrieval, got {type(retrieval).__name__}")
        plan = cls.__new__(cls)
        plan._init(retrieval, reselect=reselect, keep_mass=keep_mass, record=record)
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
        who = entry_text(self.entry_id, self.similarity) if self.is_hit else self.message
        return f"Plan({self.kind}: {who})"

    # -- read-only views ---------------------------------------------------------------------------
    @property
    def retrieval(self) -> Retrieval:
        """The retrieval the request serves now (the one retrieval made, or the candidate a sampler
        run moved it to)."""
        return self.state.retrieval

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
    def workspace_name(self) -> str | None:
        return self.retrieval.workspace_name

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
        when it recorded every step): what a sampler run must match (``compat.run_mismatch``)."""
        if not self.is_hit:
            return []
        try:
            return entry_sampler_sigmas(self.entry_meta["signature"])
        except (TypeError, ValueError, AttributeError):
            return []

    @property
    def token_grid(self):
        """The token grid the request runs at: a hit's :attr:`Retrieval.maps_grid`, else the latent's (None
        without one)."""
        if self.is_hit:
            return self.retrieval.maps_grid
        if self.resample_to is not None:
            return self.resample_to
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
        Without one, if calls of the hit already ran (sparse, or dense where the hit fell back or no
        kernel beats dense: none of them recorded), the recording cannot cover the request: it is
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
                stats = state.stats
                ran = stats.sparse_calls + stats.fallback_calls + stats.dense_calls  # the hit's calls: none recorded
                if ran:
                    state.recorder.mark_incomplete(f"plan demoted after {ran} calls of the hit ({stats.sparse_calls} "
                                                   f"sparse; {reason})")
        self.note(f"plan demoted to dense: {reason}")

    def mismatch(self, info: ModelInfo) -> str | None:
        """Why the entry this hit serves now was not made for this model, or None (a miss, or it was).
        A query: the sampler run decides (:meth:`serve_run`)."""
        return model_mismatch(self.entry_meta["signature"], info) if self.is_hit else None

    def expect_model(self, info: ModelInfo) -> None:
        """A model patched with this plan (patch time; Wan 2.2 A14B patches both experts before either
        samples): every sampler run's check (:meth:`serve_run`) then wants an entry made for it too.
        Moves and loads nothing."""
        if info.supported:
            with self.state.lock:
                _add_model(self.state.models, info)

    def serve_run(self, info: ModelInfo, *, run_starts=None, block_size: int | None = None,
                  forward_grid=None, image_frames=None) -> int | None:
        """At the start of a sampler run of one model: the expert index of the model in this request
        (the order models first sampled; a hit: the index in its entry), or None for an unsupported
        model (the caller runs it dense). ``run_starts``: the sigmas the run's steps start at (they join
        ``state.sampler_steps``, what a new entry records as its sampler schedule); ``block_size``: the
        sparse sampler's, when it runs one; ``forward_grid``: the token grid of the run's forwards, told
        by the run's first forward (the parts call this again then: the latent alone does not tell it);
        ``image_frames``: the latent frames that forward's input holds images on
        (:func:`~chorus.engine.model_info.image_frames`), kept as the request's (``state.image_frames``, what a
        new entry records) when it is the first told; a hit's entry must have been recorded with the same
        (:func:`~chorus.engine.compat.image_frames_mismatch`: a start image alone, or a start and an end image).

        The one place where a hit may change entry: retrieval sees neither the models nor the sampler
        (the embedding is the request's), so the best entry can be one made for other weights or
        another schedule (the same prompt sampled with another LoRA, strength or step count has an
        equal embedding), nor the grid the model runs at (an entry recorded in context windows has the
        whole latent's shape and the window's grid). The run's token grid is served by the rule retrieval
        applies to latents (:func:`~chorus.engine.compat.grid_compatibility`): before the request's first
        sparse call, the entry is served at that grid -- unresampled where it is the entry's own, resampled
        where the aspect is the same (in a token order, to the order of its kind there; a note says so) --; later,
        calls of another grid get the maps resampled one by one (``RunMaps``). When the entry does not serve every model met so
        far (:meth:`expect_model` and earlier runs), this run or its grid, then before the request's first
        sparse call the hit moves to the most similar candidate that does (retrieval's ``reselect`` loads
        them, outside the plan's lock), with a note saying why; when none does, or sparse calls already ran,
        it is demoted.
        """
        state = self.state
        with state.lock:
            for s in run_starts or ():
                state.sampler_steps.canonical(s)
            if image_frames is not None and state.image_frames is None:
                state.image_frames = tuple(int(f) for f in image_frames)
            if not info.supported:
                self.note(f"unsupported model: {info.reason}; dense attention")
                return None
            index = _add_model(state.experts, info)
            _add_model(state.models, info)
        while True:
            with state.lock:
                if not self.is_hit:
                    return index
                current = state.retrieval
                models = list(state.models)
                frames = state.image_frames
                reason = serve_mismatch(current.signature, models, run_starts, block_size, frames)
                if reason is None and forward_grid is not None:
                    reason = self._serve_grid(current, tuple(int(g) for g in forward_grid))
                if reason is None:
                    return list(current.signature.get("experts", [])).index(info.fingerprint)
                if state.stats.sparse_calls or not current.candidates or self._reselect is None:
                    self.demote(reason)
                    return index
            moved, why = self._reselect(current.candidates, models, run_starts=run_starts, block_size=block_size,
                                        forward_grid=forward_grid, image_frames=frames)
            with state.lock:
                if state.retrieval is not current or state.stats.sparse_calls or not self.is_hit:
                    continue  # decided meanwhile (another thread): check what is there now
                if moved is None:
                    self.demote(reason + (f"; no other candidate serves it ({why})" if why else ""))
                    return index
                state.retrieval = moved
                state.resampled.clear()
                state.stats.similarity = moved.similarity
                self.note(f"hit moved from entry {current.entry_id} ({reason}) to "
                          f"{entry_text(moved.entry_id, moved.similarity)}, made for this model, schedule, grid and "
                          "input images")

    def _serve_grid(self, current: Retrieval, grid: tuple) -> str | None:
        """(The plan's lock held.) Why the hit's entry cannot serve forwards of token ``grid``, or None: it does,
        and before the request's first sparse call the plan serves it at that grid (``resample_to`` set, or
        dropped where the grid is the entry's own)."""
        if current.maps_grid == grid:
            return None
        verdict, why = grid_compatibility(current.signature, grid)
        if verdict == "incompatible":
            return why
        if not self.state.stats.sparse_calls:
            self.state.retrieval = dataclasses.replace(
                current, resample_to=None if verdict == "same" else grid,
                message=hit_message(current.entry_id, current.similarity, "" if verdict == "same" else why))
            self.state.resampled.clear()
            self.note(f"entry {current.entry_id} served at this run's token grid {grid}"
                      + (" (the entry's own)" if verdict == "same" else f" ({why})"))
        return None

    def refresh_state(self, refresh_steps: int):
        """The request's ``VisitRefresh`` for this R (shared by all experts)."""
        with self.state.lock:
            refresh = self.state.refresh
            if refresh_steps not in refresh:
                refresh[refresh_steps] = kernels.VisitRefresh(refresh_steps)
            return refresh[refresh_steps]


def _add_model(models: list, info: ModelInfo) -> int:
    """The index of ``info``'s fingerprint in ``models``, appended when new."""
    for i, known in enumerate(models):
        if known.fingerprint == info.fingerprint:
            return i
    models.append(info)
    return len(models) - 1
