"""One engine entry per attention call, callable from inside a compiled model.

A host (the ComfyUI patch, the diffusers adapter) makes one :class:`ForwardContext` per model
forward, on the host side of the graph, and makes it current (:func:`activate`); every
self-attention call of that forward then goes through two ``torch.library`` custom ops:

- ``torch.ops.chorus.attend(q, k, v, layer_hint) -> out``: the call's whole Chorus work (sparse
  attention with the run's map, or the dense fallback, the first-frame bias, verification, the
  counters and notes) on the current context;
- ``torch.ops.chorus.record_mass(q, k, layer_hint, token) -> ()``: a miss's recording of one call whose
  output the host's own dense attention computed;
- ``torch.ops.chorus.record_block(x, y, layer, token) -> ()``: a miss's feature-reuse region scores of
  one block the host ran in full (its input and output residual stream ``[B, L, C]``);
- ``torch.ops.chorus.refuse(q, reason, layer_hint, token) -> ()``: a self-attention call the host
  answers densely because Chorus must not take it (a note and a fallback count).

Both are opaque to ``torch.compile`` with shape-only fake implementations, and their arguments are
tensors and one int that is constant per call site, so dynamo traces a transformer block through
them without a graph break and recompiles for neither a new sigma, step, expert nor request:
everything that changes lives in the context, read when the op runs. The layer of a call is
``layer_hint`` when the host knows it (ComfyUI >= 0.4 passes ``block_index``), else the context's
counter, advanced by every op call in program order.

Shapes: q/k/v ``[B, H, L, D]`` (any strides: ComfyUI's ``[B, L, H*D]`` viewed per head works);
``attend`` returns ``[B, H, L, D]`` in q's dtype with ``torch.empty_like(q)``'s strides. Neither op
raises for anything a request can bring: an unusable call is answered with dense attention
(PyTorch SDPA, the first-frame bias included) and a note in the plan.
"""

from __future__ import annotations

import threading

import torch

from ..kernels.custom_ops import op_registered
from .call import AttnCall, sdpa
from .runtime import attend as engine_attend

__all__ = ["ForwardContext", "begin_forward", "activate", "current", "attend", "record_mass", "record_block", "refuse"]


class ForwardContext:
    """Everything one model forward's self-attention calls need, made by the host before the forward
    (:func:`begin_forward`). It turns each call into an :class:`~chorus.engine.call.AttnCall` (layer,
    sigma, grid, cond rows, guidance's first-frame bias) for the engine's one entry
    (:func:`chorus.engine.runtime.attend`).

    Args:
        attention: the model's :class:`~chorus.engine.runtime.ChorusAttention`, or None (guidance only).
        guidance: the model's :class:`~chorus.engine.guidance.GuidanceBoost`, or None.
        grid: token grid ``(T', H', W')`` of the forward's latent.
        sigma: the forward's sigma (a float, read once by the host), or None when it had none.
        cond_or_uncond: ComfyUI's list (0 = positive conditioning per batch chunk) or None (all rows
            positive).
        note: ``note(message)``, the plan's (or the patch's) once-per-request message sink.
        disabled_reason: why Chorus stays out of this forward (every call dense, one note), or None.
        feature_reuse: the model's :class:`~chorus.engine.feature_reuse.FeatureReuse`, or None.
    """

    def __init__(self, attention, guidance, grid, sigma: float | None, cond_or_uncond=None, note=None,
                 disabled_reason: str | None = None, feature_reuse=None):
        self.attention = attention
        self.guidance = guidance
        self.feature_reuse = feature_reuse
        self.grid = tuple(int(g) for g in grid)
        self.tokens = self.grid[0] * self.grid[1] * self.grid[2]
        self.sigma = sigma
        self.cond_or_uncond = cond_or_uncond
        self.note = note or (lambda message: None)
        self.disabled_reason = disabled_reason
        self.layer_counter = 0
        self._cond_rows: dict[int, torch.Tensor | None] = {}

    def __deepcopy__(self, memo):
        return self

    def next_layer(self, hint: int = -1) -> int:
        """The layer of the next self-attention call: ``hint`` when >= 0, else the counter (which
        advances either way, so a hint on some calls keeps the others' count right)."""
        counted = self.layer_counter
        self.layer_counter += 1
        return int(hint) if hint >= 0 else counted

    def cond_rows(self, batch: int):
        """Bool ``[batch]`` marking positive-conditioning rows (from ``cond_or_uncond``), or None."""
        if batch not in self._cond_rows:
            rows = None
            cond = self.cond_or_uncond
            if cond and batch % len(cond) == 0:
                rows = torch.tensor([c == 0 for c in cond], dtype=torch.bool).repeat_interleave(batch // len(cond))
            self._cond_rows[batch] = rows
        return self._cond_rows[batch]

    def first_frame_bias(self) -> float:
        """Guidance's first-frame logit bias for this forward's calls (0.0: none)."""
        guidance = self.guidance
        if guidance is None or not guidance.image_strength or self.sigma is None:
            return 0.0
        return float(guidance.first_frame_bias(self.sigma))

    def cross_attention_gain(self) -> float | None:
        """Guidance's text gain for this forward's cross-attention outputs (also in a forward Chorus
        otherwise stays out of: no self-attention is involved), or None. Counts the forward as boosted."""
        guidance = self.guidance
        if guidance is None or not guidance.strength or self.sigma is None or not guidance.reuse_acted(self.sigma):
            return None
        guidance.boosted_calls += 1
        return float(guidance.gain)

    # -- the calls -------------------------------------------------------------------------------
    def self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_hint: int = -1, *,
                       layout=None, dense_fn=None) -> torch.Tensor:
        """``[B, H, L, D]`` attention of one self-attention call of this forward (the engine's entry,
        :func:`chorus.engine.runtime.attend`). ``layout``: a feature-reuse block's ``RegionLayout`` when
        q/k/v are its compact sequence; ``dense_fn``: the host's dense attention (None: SDPA)."""
        layer = self.next_layer(layer_hint)
        if self.disabled_reason is not None:
            return AttnCall(q, k, v, layer, self.sigma, self.grid, dense_fn=dense_fn).dense(self.note)
        call = AttnCall(q, k, v, layer, self.sigma, self.grid, cond_rows=self.cond_rows(q.shape[0]), layout=layout,
                        first_frame_bias=self.first_frame_bias(), dense_fn=dense_fn)
        return engine_attend(call, self.attention, self.note)

    def record(self, q: torch.Tensor, k: torch.Tensor, layer_hint: int = -1) -> None:
        """Record one dense call's block mass (a miss) into the plan's recorder; never raises."""
        layer = self.next_layer(layer_hint)
        attention = self.attention
        if attention is None or self.disabled_reason is not None or self.sigma is None:
            return
        attention.record(AttnCall(q, k, k, layer, self.sigma, self.grid, cond_rows=self.cond_rows(q.shape[0])))

    def record_block(self, x: torch.Tensor, y: torch.Tensor, layer: int) -> None:
        """Record a miss's region scores of one full block call (input ``x``, output ``y``); never raises."""
        if self.feature_reuse is None or self.disabled_reason is not None or self.sigma is None:
            return
        self.feature_reuse.record_block(x, y, layer=layer, sigma=self.sigma, grid=self.grid)

    def refuse(self, reason: str, layer_hint: int = -1) -> None:
        """A self-attention call the host answers with its own dense attention because Chorus must not
        take it (``reason``, e.g. grouped-query attention): one note, counted as a fallback."""
        self.next_layer(layer_hint)
        self.note(f"{reason}; dense attention")
        if self.attention is not None:
            self.attention.skip_calls(1)


def begin_forward(attention, guidance, grid, sigma: float | None, cond_or_uncond=None, note=None,
                  disabled_reason: str | None = None, feature_reuse=None) -> ForwardContext:
    """The :class:`ForwardContext` of one model forward (arguments as there), made current
    (:func:`activate`). A forward Chorus stays out of (``disabled_reason``) is noted, and its
    self-attention calls (one per layer; they run the host's attention) counted as fallbacks."""
    context = ForwardContext(attention, guidance, grid, sigma, cond_or_uncond, note, disabled_reason, feature_reuse)
    activate(context)
    if disabled_reason is not None and (attention is not None or guidance is not None):
        context.note(f"{disabled_reason}; dense attention")
        if attention is not None:
            attention.skip_calls(attention.model_info.num_layers)
    return context


_CURRENT = threading.local()


def activate(context: ForwardContext | None) -> None:
    """Make ``context`` the one this thread's attention ops run on (None: none). A host calls this on
    its own side of the graph at the start of every forward it handles."""
    _CURRENT.context = context


def current() -> ForwardContext | None:
    """This thread's current :class:`ForwardContext`, or None."""
    return getattr(_CURRENT, "context", None)


def _like(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` in q's dtype with ``torch.empty_like(q)``'s strides (what the fake promises)."""
    if out.dtype == q.dtype and out.shape == q.shape and out.stride() == torch.empty_like(q, device="meta").stride():
        return out
    return torch.empty_like(q).copy_(out)


# The kernels read ComfyUI's [B, L, H*D] memory through per-head views: a compiler must hand the ops
# their inputs with the strides eager code has (no copy into another layout).
_EXACT_STRIDES = tuple(t for t in (getattr(torch.Tag, "needs_exact_strides", None),) if t is not None)

# ComfyUI imports the pack under its folder name while tests import ``chorus``: register once.
if not op_registered("attend"):
    @torch.library.custom_op("chorus::attend", mutates_args=(), tags=_EXACT_STRIDES)
    def _attend_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_hint: int) -> torch.Tensor:
        context = current()
        if context is None:  # a call outside any Chorus forward: plain attention
            return _like(q, sdpa(q, k, v))
        return _like(q, context.self_attention(q, k, v, layer_hint))

    @_attend_op.register_fake
    def _attend_fake(q, k, v, layer_hint):
        return torch.empty_like(q)

# An op without outputs is dead code to a compiler: the recording ops mutate a one-element counter (the
# number of calls recorded in this process), which keeps every call in the graph, in program order.
_RECORD_TOKEN = torch.zeros(1, dtype=torch.int64)


def _on_context(token: torch.Tensor, method: str, *args) -> None:
    """The body of the recording ops: count the call on ``token``, then ``method(*args)`` on the current
    forward's context (nothing outside a Chorus forward)."""
    token.add_(1)
    context = current()
    if context is not None:
        getattr(context, method)(*args)


if not op_registered("record_mass"):
    @torch.library.custom_op("chorus::record_mass", mutates_args=("token",), tags=_EXACT_STRIDES)
    def _record_op(q: torch.Tensor, k: torch.Tensor, layer_hint: int, token: torch.Tensor) -> None:
        _on_context(token, "record", q, k, layer_hint)

    @_record_op.register_fake
    def _record_fake(q, k, layer_hint, token):
        return None

if not op_registered("refuse"):
    @torch.library.custom_op("chorus::refuse", mutates_args=("token",))
    def _refuse_op(q: torch.Tensor, reason: str, layer_hint: int, token: torch.Tensor) -> None:
        _on_context(token, "refuse", reason, layer_hint)

    @_refuse_op.register_fake
    def _refuse_fake(q, reason, layer_hint, token):
        return None

if not op_registered("record_block"):
    @torch.library.custom_op("chorus::record_block", mutates_args=("token",))
    def _record_block_op(x: torch.Tensor, y: torch.Tensor, layer: int, token: torch.Tensor) -> None:
        _on_context(token, "record_block", x, y, layer)

    @_record_block_op.register_fake
    def _record_block_fake(x, y, layer, token):
        return None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_hint: int = -1) -> torch.Tensor:
    """Self-attention ``[B, H, L, D]`` on the current context (``torch.ops.chorus.attend``)."""
    return torch.ops.chorus.attend(q, k, v, int(layer_hint))


def record_mass(q: torch.Tensor, k: torch.Tensor, layer_hint: int = -1) -> None:
    """Record a dense call's block mass on the current context (``torch.ops.chorus.record_mass``)."""
    torch.ops.chorus.record_mass(q, k, int(layer_hint), _RECORD_TOKEN)


def record_block(x: torch.Tensor, y: torch.Tensor, layer: int) -> None:
    """Record a full block call's region scores on the current context (``torch.ops.chorus.record_block``)."""
    torch.ops.chorus.record_block(x, y, int(layer), _RECORD_TOKEN)


def refuse(q: torch.Tensor, reason: str, layer_hint: int = -1) -> None:
    """Note a self-attention call the host answers densely because Chorus must not take it
    (``torch.ops.chorus.refuse``; ``q`` only orders the call among the others)."""
    torch.ops.chorus.refuse(q, str(reason), int(layer_hint), _RECORD_TOKEN)
