"""The plan of one request: a hit (reuse an entry's masks) or a miss (dense + record)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import kernels
from .recorder import MassRecorder
from .signature import ModelInfo, token_grid

log = logging.getLogger("chorus.engine")


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
    blocks_total: int = 0
    blocks_computed: int = 0
    attention_seconds: float = 0.0
    runs: int = 0
    messages: list[str] = field(default_factory=list)
    suppressed_messages: int = 0

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
        parts.append(f"attention {self.attention_seconds * 1e3:.1f} ms")
        return "; ".join(parts)


class Plan:
    """What a request does with self-attention.

    - ``kind``: ``"hit"`` or ``"miss"``; ``message`` says why (similarity, reason for a miss).
    - hit: ``entry_id``, ``similarity``, ``masks`` = ``{(expert, step, layer, head_group): bool
      [H, Qb, Kb]}`` on the CPU, ``entry_meta`` (with ``"signature"``), ``step_sigmas`` of the entry,
      and ``resample_to`` = the token grid to resample masks to (None when the grid is the entry's).
    - miss: ``recorder`` (a :class:`MassRecorder`) that the patched models fill; None when
      ``record=False`` (nothing could be written: no embedding or no usable workspace).
    - both: ``embedding`` (float32 numpy, L2-normalised by the store), ``latent_shape`` ``[C, T, H, W]``,
      ``request_meta`` (free-form fields written with a new entry), ``stats`` (:class:`PlanStats`),
      ``experts`` (ModelInfo of the models that sampled, in order).

    ``copy.deepcopy(plan)`` returns the plan itself: hosts deep-copy model options (ComfyUI's
    ``clone()``), while every patched model of a request must share one plan.
    """

    def __init__(self, kind: str, *, message: str = "", embedding=None, latent_shape=None,
                 request_meta: dict | None = None, entry_id=None, similarity: float | None = None,
                 masks: dict | None = None, entry_meta: dict | None = None, resample_to=None,
                 workspace=None, keep_mass: bool = False, record: bool = True):
        if kind not in ("hit", "miss"):
            raise ValueError(f"plan kind must be 'hit' or 'miss', got {kind!r}")
        if kind == "hit" and (not masks or entry_meta is None or "signature" not in entry_meta):
            raise ValueError("a hit needs masks and entry_meta with a signature")
        self.kind = kind
        self.message = message
        self.embedding = None if embedding is None else np.asarray(embedding, dtype=np.float32).reshape(-1)
        self.latent_shape = None if latent_shape is None else tuple(int(s) for s in latent_shape)[-4:]
        self.request_meta = dict(request_meta or {})
        self.entry_id = entry_id
        self.similarity = similarity
        self.masks = masks or {}
        self.entry_meta = entry_meta
        self.resample_to = None if resample_to is None else tuple(int(g) for g in resample_to)
        self.workspace = workspace
        self.stats = PlanStats(similarity=similarity)
        self.experts: list[ModelInfo] = []
        self.recorder = MassRecorder(keep_mass=keep_mass) if kind == "miss" and record else None
        self.demoted_reason: str | None = None
        self.committed: str | None = None
        self._refresh: dict[int, object] = {}
        self._resampled: dict = {}
        self._warned: set[str] = set()
        self._lock = threading.RLock()

    # -- construction helpers ------------------------------------------------------------------
    @classmethod
    def miss(cls, message: str, **kwargs) -> "Plan":
        return cls("miss", message=message, **kwargs)

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        who = f"entry {self.entry_id}, similarity {self.similarity:.3f}" if self.is_hit else self.message
        return f"Plan({self.kind}: {who})"

    @property
    def is_hit(self) -> bool:
        return self.kind == "hit"

    @property
    def step_sigmas(self) -> list[float]:
        if self.is_hit:
            try:
                return [float(s) for s in self.entry_meta["signature"].get("step_sigmas", [])]
            except (TypeError, ValueError, AttributeError):
                return []  # an unreadable schedule matches no step: the plan is demoted, runs dense
        return self.recorder.step_sigmas()

    @property
    def token_grid(self):
        if self.resample_to is not None:
            return self.resample_to
        if self.is_hit:
            return tuple(self.entry_meta["signature"]["token_grid"])
        return None if self.latent_shape is None else token_grid(self.latent_shape)

    # -- state shared by the patched models --------------------------------------------------------
    MAX_MESSAGES = 20

    def note(self, message: str) -> None:
        """Log a message once per plan and keep it for the UI (at most ``MAX_MESSAGES`` distinct
        ones; later ones are counted in ``stats.suppressed_messages`` and logged at debug level)."""
        with self._lock:
            if message in self._warned:
                return
            self._warned.add(message)
            if len(self.stats.messages) >= self.MAX_MESSAGES:
                self.stats.suppressed_messages += 1
                log.debug("Chorus II: %s", message)
                return
            self.stats.messages.append(message)
        log.warning("Chorus II: %s", message)

    def demote(self, reason: str) -> None:
        """Turn a hit into a miss: dense attention + recording from now on.

        If sparse calls already ran, the recording cannot cover the request: it is marked
        incomplete and no entry will be written from it.
        """
        with self._lock:
            if not self.is_hit:
                return
            self.kind = "miss"
            self.demoted_reason = reason
            self.message = f"miss ({reason}); was a hit on entry {self.entry_id}"
            self.recorder = MassRecorder()
            if self.stats.sparse_calls:
                self.recorder.mark_incomplete(f"plan demoted after {self.stats.sparse_calls} sparse calls ({reason})")
        self.note(f"plan demoted to dense: {reason}")

    def register_expert(self, info: ModelInfo) -> int | None:
        """Expert index of a model in this request (order of first sampling).

        On a hit the model must be one of the entry's experts (same fingerprint and geometry);
        otherwise the plan is demoted and the index is the model's position among this request's
        models. Returns None for an unsupported model (the caller runs it dense).
        """
        with self._lock:
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
            if self.is_hit:
                reason = self.model_mismatch(info)
                if reason is None:
                    return list(self.entry_meta["signature"].get("experts", [])).index(info.fingerprint)
                self.demote(reason)
            return index

    def model_mismatch(self, info: ModelInfo) -> str | None:
        """Why a hit's entry cannot serve this model (variant, geometry, weights), or None."""
        if not self.is_hit:
            return None
        sig = self.entry_meta["signature"]
        try:
            if sig.get("variant") != info.variant:
                return f"entry made for {sig.get('variant')}, this model is {info.variant}"
            if int(sig.get("num_layers", -1)) != info.num_layers or int(sig.get("num_heads", -1)) != info.num_heads:
                return "entry made for a model with other layer/head counts"
            if not isinstance(sig.get("experts"), list) or info.fingerprint not in sig["experts"]:
                return f"plan made for another model (weights fingerprint {info.fingerprint} not in the entry)"
        except (TypeError, ValueError, AttributeError) as exc:  # a hostile or damaged signature
            return f"entry signature unreadable ({type(exc).__name__}: {exc})"
        return None

    def refresh_state(self, refresh_steps: int):
        """The request's ``VisitRefresh`` for this R (shared by all experts)."""
        with self._lock:
            if refresh_steps not in self._refresh:
                self._refresh[refresh_steps] = kernels.VisitRefresh(refresh_steps)
            return self._refresh[refresh_steps]

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
        with self._lock:
            stored = self.masks[key]
            cache_key = (key, top_p, k_min, block_size)
            if cache_key in self._resampled:
                return self._resampled[cache_key].to(device) if device is not None else self._resampled[cache_key]
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
                self._resampled[cache_key] = block_map.cpu()
            return block_map.to(device) if device is not None else block_map
