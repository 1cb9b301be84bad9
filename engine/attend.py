"""One engine entry per attention call, callable from inside a compiled model.

The ComfyUI patch makes one :class:`ForwardContext` per model forward (:func:`begin_forward`), on the
host side of the graph, and makes it current (:func:`activate`); every self-attention call of that
forward then goes through these ``torch.library`` custom ops (the diffusers adapter, whose blocks run
in Python, calls :func:`~chorus.engine.runtime.attend` itself):

- ``torch.ops.chorus.attend(q, k, v, layer_hint) -> out``: the call's whole Chorus work (sparse
  attention with the run's map, or the dense fallback, the image biases, verification, the
  counters and notes) on the current context;
- ``torch.ops.chorus.record_mass(q, k, layer_hint, token) -> ()``: a miss's recording of one call whose
  output the host's own dense attention computed;
- ``torch.ops.chorus.record_block(x, y, token) -> ()``: a miss's feature-reuse region scores of one
  block the host ran in full (its input and output residual stream ``[B, L, C]``), for the layer of the
  block's own self-attention call, so a host's block patch needs no per-layer constant;
- ``torch.ops.chorus.refuse(q, reason, layer_hint, token) -> ()``: a self-attention call the host
  answers densely because Chorus must not take it (a note and a fallback count);
- feature reuse's reduced block on a hit (the forward's :class:`~chorus.engine.feature_reuse.Reduction`,
  decided by the host before the forward): ``torch.ops.chorus.compact_tokens(t, rule, length) -> t'``
  (the block's per-token inputs on the compact sequence of ``length`` tokens),
  ``torch.ops.chorus.attend_compact(q, k, v, layer_hint) -> out`` (its self-attention, as ``attend``
  with the layout) and ``torch.ops.chorus.expand_block(x, x_c, y_c) -> y`` (its output on the full
  sequence), so a compiled model keeps a reduced block one graph too.

All are opaque to ``torch.compile`` with shape-only fake implementations, and their arguments are
tensors and one int that is constant per call site, so dynamo traces a transformer block through
them without a graph break and recompiles for neither a new sigma, step, expert nor request:
everything that changes lives in the context, read when the op runs. The layer of a call is
``layer_hint`` when the host knows it (ComfyUI >= 0.4 passes ``block_index``), else the context's
counter, advanced by every op call in program order.

Shapes: q/k/v ``[B, H, L, D]`` (any strides: ComfyUI's ``[B, L, H*D]`` viewed per head works);
``attend`` returns ``[B, H, L, D]`` in q's dtype with ``torch.empty_like(q)``'s strides. No op
raises for anything a request can bring: an unusable call is answered with dense attention
(PyTorch SDPA, the image biases included) and a note in the plan. (The feature-reuse ops raise
``RuntimeError`` only when a host calls them in a forward it did not reduce: a bug, not an input;
a request's problems with feature reuse are settled before the forward, where the blocks then run
in full.)
"""

from __future__ import annotations

import inspect
import threading
from typing import TYPE_CHECKING

import torch

from ..kernels.custom_ops import op_registered
from ..kernels.process_tensors import outside_inference_mode
from .call import AttnCall, sdpa
from .model_info import frames_summary
from .runtime import attend as engine_attend

if TYPE_CHECKING:
    from .feature_reuse import Reduction

__all__ = ["ForwardContext", "begin_forward", "activate", "current", "attend", "record_mass", "record_block", "refuse",
           "compact_tokens", "attend_compact", "expand_block"]


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
        reduction: the forward's :class:`~chorus.engine.feature_reuse.Reduction` (a hit whose blocks
            feature reuse reduces; ``feature_reuse.reduction``), or None.
        skipped_layers: layers whose block the host skips in this forward (no self-attention call comes
            from them): the layer count passes over them.
        image_flags: a callable giving, per latent frame of the forward's input, whether it holds an input
            image (:func:`~chorus.engine.model_info.image_frame_flags`; the host keeps it, so asking costs no
            sync after the first time), or None (not known): guidance's biases go where the forward's own
            frames hold the images (a context window holds part of the video).
        window_start: the latent frame of the whole video at the forward's first frame when the forward runs in
            a context window, else None (the whole latent).
    """

    def __init__(self, attention, guidance, grid, sigma: float | None, cond_or_uncond=None, note=None,
                 disabled_reason: str | None = None, feature_reuse=None, reduction=None,
                 skipped_layers: frozenset = frozenset(), image_flags=None, window_start: int | None = None):
        self.attention = attention
        self.guidance = guidance
        self.feature_reuse = feature_reuse
        self.reduction = reduction
        self.grid = tuple(int(g) for g in grid)
        self.tokens = self.grid[0] * self.grid[1] * self.grid[2]
        self.sigma = sigma
        self.cond_or_uncond = cond_or_uncond
        self.note = note or (lambda message: None)
        self.disabled_reason = disabled_reason
        self.skipped_layers = frozenset(int(layer) for layer in skipped_layers)
        self.image_flags = image_flags
        self.window_start = None if window_start is None else int(window_start)
        self.layer_counter = 0
        self.current_layer = -1  # the layer of the forward's last self-attention call (record_block's layer)
        self._cond_rows: dict[int, torch.Tensor | None] = {}

    def __deepcopy__(self, memo):
        return self

    def next_layer(self, hint: int = -1) -> int:
        """The layer of the next self-attention call: ``hint`` when >= 0, else the counter (which
        advances either way, so a hint on some calls keeps the others' count right), past the skipped
        layers."""
        counted = self.layer_counter
        while counted in self.skipped_layers:
            counted += 1
        self.layer_counter = counted + 1
        self.current_layer = int(hint) if hint >= 0 else counted
        return self.current_layer

    def cond_rows(self, batch: int):
        """Bool ``[batch]`` marking positive-conditioning rows (from ``cond_or_uncond``), or None."""
        if batch not in self._cond_rows:
            rows = None
            cond = self.cond_or_uncond
            if cond and batch % len(cond) == 0:
                rows = torch.tensor([c == 0 for c in cond], dtype=torch.bool).repeat_interleave(batch // len(cond))
            self._cond_rows[batch] = rows
        return self._cond_rows[batch]

    def _flags(self) -> tuple | None:
        return self.image_flags() if self.image_flags is not None else None

    def starts_with_image(self) -> bool:
        """Whether the forward's first latent frame is where guidance's start-image bias goes: always on the
        whole latent; in a context window where the window begins with the video's first frame (its causal anchor
        included) or its first frame holds an image (a start image ComfyUI keeps in every window), not where it
        begins with a later frame of the video."""
        if self.window_start is None or self.window_start == 0:
            return True
        flags = self._flags()
        return bool(flags) and bool(flags[0])

    def first_frame_bias(self) -> float:
        """Guidance's first-frame logit bias for this forward's calls (0.0: none, also where the forward's first
        frame is not the start image: :meth:`starts_with_image`)."""
        guidance = self.guidance
        if guidance is None or not guidance.image_strength or self.sigma is None or not self.starts_with_image():
            return 0.0
        return float(guidance.first_frame_bias(self.sigma))

    def last_frame_bias(self) -> float:
        """Guidance's logit bias toward the last frame's keys for this forward's calls
        (:func:`end_image_bias`)."""
        return end_image_bias(self.guidance, self.sigma, self.image_flags)

    def cross_attention_gain(self) -> float | None:
        """Guidance's text gain for this forward's cross-attention outputs (also in a forward Chorus
        otherwise stays out of: no self-attention is involved), or None. Counts the forward as boosted."""
        if self.guidance is None or self.sigma is None:
            return None
        return self.guidance.text_gain(self.sigma)

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
                        first_frame_bias=self.first_frame_bias(), dense_fn=dense_fn,
                        last_frame_bias=self.last_frame_bias())
        return engine_attend(call, self.attention, self.note)

    def reduced(self) -> "Reduction":
        """The forward's reduction; ``RuntimeError`` when it has none (a reduced block's op outside the
        forward the host reduced: a bug in the host, never a request's input)."""
        if self.reduction is None or self.feature_reuse is None:
            raise RuntimeError("a feature-reuse op in a forward without a reduction")
        return self.reduction

    def compact(self, t: torch.Tensor, rule: str) -> torch.Tensor:
        """A reduced block's per-token input on the compact sequence (:meth:`FeatureReuse.compact`)."""
        return self.feature_reuse.compact(t, rule, self.reduced())

    def attend_compact(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_hint: int = -1) -> torch.Tensor:
        """A reduced block's self-attention on the compact sequence (q/k/v ``[B, H, L', D]``): the
        engine's entry with the forward's layout (:meth:`self_attention`)."""
        return self.self_attention(q, k, v, layer_hint, layout=self.reduced().layout)

    def expand(self, x: torch.Tensor, x_c: torch.Tensor, y_c: torch.Tensor) -> torch.Tensor:
        """A reduced block's output on the full sequence (:meth:`FeatureReuse.expand`)."""
        return self.feature_reuse.expand(x, x_c, y_c, self.reduced())

    def record(self, q: torch.Tensor, k: torch.Tensor, layer_hint: int = -1) -> None:
        """Record one dense call's block mass (a miss) into the plan's recorder; never raises."""
        layer = self.next_layer(layer_hint)
        attention = self.attention
        if attention is None or self.disabled_reason is not None or self.sigma is None:
            return
        attention.record(AttnCall(q, k, k, layer, self.sigma, self.grid, cond_rows=self.cond_rows(q.shape[0])))

    def record_block(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Record a miss's region scores of one full block call (input ``x``, output ``y``) for the layer of the
        self-attention call since the previous block's record (each block's own runs inside it, before its
        output exists; none: a note, no scores); never raises."""
        if self.feature_reuse is None or self.disabled_reason is not None or self.sigma is None:
            return
        layer = self.current_layer
        self.current_layer = -1
        if layer < 0:  # no self-attention call reached Chorus since the last block's: not this block's layer
            self.note("feature reuse: a block whose self-attention did not reach Chorus; no region scores from it")
            return
        self.feature_reuse.record_block(x, y, layer=layer, sigma=self.sigma, grid=self.grid)

    def refuse(self, reason: str, layer_hint: int = -1) -> None:
        """A self-attention call the host answers with its own dense attention because Chorus must not
        take it (``reason``, e.g. grouped-query attention): one note, counted as a fallback."""
        self.next_layer(layer_hint)
        self.note(f"{reason}; dense attention")
        if self.attention is not None:
            self.attention.skip_calls(1)


def end_image_bias(guidance, sigma, image_flags=None) -> float:
    """Guidance's logit bias toward a forward's last-frame keys (a first-last-frame request's end image; 0.0:
    none): where the forward's own last frame holds it (``image_flags``: a callable giving the forward's per-frame
    image flags; in context windows, the window that ends with the video's end image), else, where the
    forward's frames are not known, where the request holds one. ``guidance``: a ``GuidanceBoost`` or None;
    ``sigma``: the forward's (None: no bias)."""
    if guidance is None or not guidance.image_strength or sigma is None:
        return 0.0

    def frames():
        flags = image_flags() if image_flags is not None else None
        return None if flags is None else frames_summary(flags)

    return float(guidance.last_frame_bias(sigma, frames))  # (frames() None: the request's)


def begin_forward(attention, guidance, grid, sigma: float | None, cond_or_uncond=None, note=None,
                  disabled_reason: str | None = None, feature_reuse=None, reduction=None,
                  skipped_layers: frozenset = frozenset(), image_flags=None,
                  window_start: int | None = None) -> ForwardContext:
    """The :class:`ForwardContext` of one model forward (arguments as there), made current
    (:func:`activate`). A forward Chorus stays out of (``disabled_reason``) is noted, and its
    self-attention calls (one per layer; they run the host's attention) counted as fallbacks."""
    context = ForwardContext(attention, guidance, grid, sigma, cond_or_uncond, note, disabled_reason, feature_reuse,
                             reduction, skipped_layers, image_flags, window_start)
    activate(context)
    if disabled_reason is not None and (attention is not None or guidance is not None):
        context.note(f"{disabled_reason}; dense attention")
        if attention is not None:
            attention.skip_calls(attention.model_info.num_layers - len(context.skipped_layers))
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
# (torch 2.7's custom_op takes no ``tags``: there the ops are declared without it; Chorus-patched forwards
# run outside dynamo before torch 2.10 anyway, nodes/comfy_patch.py)
_OP_TAGS = ({"tags": _EXACT_STRIDES}
            if _EXACT_STRIDES and "tags" in inspect.signature(torch.library.custom_op).parameters else {})

# ComfyUI imports the pack under its folder name while tests import ``chorus``: register once.
if not op_registered("attend"):
    @torch.library.custom_op("chorus::attend", mutates_args=(), **_OP_TAGS)
    def _attend_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_hint: int) -> torch.Tensor:
        context = current()
        if context is None:  # a call outside any Chorus forward: plain attention
            return _like(q, sdpa(q, k, v))
        return _like(q, context.self_attention(q, k, v, layer_hint))

    @_attend_op.register_fake
    def _attend_fake(q, k, v, layer_hint):
        return torch.empty_like(q)

# An op without outputs is dead code to a compiler: the recording ops mutate a one-element counter (the
# number of calls recorded in this process), which keeps every call in the graph, in program order. Made outside
# inference mode whoever imports this module first (ComfyUI runs its nodes under ``torch.inference_mode``): an
# inference tensor could not be updated by a later call outside it, a normal tensor can be inside it.
_RECORD_TOKEN = outside_inference_mode(torch.zeros)(1, dtype=torch.int64)


def _on_context(token: torch.Tensor, method: str, *args) -> None:
    """The body of the recording ops: count the call on ``token``, then ``method(*args)`` on the current
    forward's context (nothing outside a Chorus forward)."""
    token.add_(1)
    context = current()
    if context is not None:
        getattr(context, method)(*args)


if not op_registered("record_mass"):
    @torch.library.custom_op("chorus::record_mass", mutates_args=("token",), **_OP_TAGS)
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
    def _record_block_op(x: torch.Tensor, y: torch.Tensor, token: torch.Tensor) -> None:
        _on_context(token, "record_block", x, y)

    @_record_block_op.register_fake
    def _record_block_fake(x, y, token):
        return None


# feature reuse's reduced block: the forward's Reduction is read when the ops run; ``length`` (the compact
# sequence's, a constant of the forward's options) gives the fakes their shapes
if not op_registered("compact_tokens"):
    @torch.library.custom_op("chorus::compact_tokens", mutates_args=())
    def _compact_tokens_op(t: torch.Tensor, rule: str, length: int) -> torch.Tensor:
        out = _reduced_context().compact(t, rule)
        if out.shape[1] != length:
            raise RuntimeError(f"the compact sequence has {out.shape[1]} tokens, the traced block {length}")
        return out.contiguous()

    @_compact_tokens_op.register_fake
    def _compact_tokens_fake(t, rule, length):
        return t.new_empty((t.shape[0], length, *t.shape[2:]))

if not op_registered("attend_compact"):
    @torch.library.custom_op("chorus::attend_compact", mutates_args=(), **_OP_TAGS)
    def _attend_compact_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_hint: int) -> torch.Tensor:
        return _like(q, _reduced_context().attend_compact(q, k, v, layer_hint))

    @_attend_compact_op.register_fake
    def _attend_compact_fake(q, k, v, layer_hint):
        return torch.empty_like(q)

if not op_registered("expand_block"):
    @torch.library.custom_op("chorus::expand_block", mutates_args=())
    def _expand_block_op(x: torch.Tensor, x_c: torch.Tensor, y_c: torch.Tensor) -> torch.Tensor:
        return _reduced_context().expand(x, x_c, y_c).contiguous()

    @_expand_block_op.register_fake
    def _expand_block_fake(x, x_c, y_c):
        return x.new_empty(x.shape)


def _reduced_context() -> ForwardContext:
    context = current()
    if context is None:
        raise RuntimeError("a feature-reuse op outside a Chorus forward")
    return context


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_hint: int = -1) -> torch.Tensor:
    """Self-attention ``[B, H, L, D]`` on the current context (``torch.ops.chorus.attend``)."""
    return torch.ops.chorus.attend(q, k, v, int(layer_hint))


def record_mass(q: torch.Tensor, k: torch.Tensor, layer_hint: int = -1) -> None:
    """Record a dense call's block mass on the current context (``torch.ops.chorus.record_mass``)."""
    torch.ops.chorus.record_mass(q, k, int(layer_hint), _RECORD_TOKEN)


def record_block(x: torch.Tensor, y: torch.Tensor) -> None:
    """Record a full block call's region scores on the current context (``torch.ops.chorus.record_block``), for
    the layer of the block's own self-attention call (:meth:`ForwardContext.record_block`)."""
    torch.ops.chorus.record_block(x, y, _RECORD_TOKEN)


def refuse(q: torch.Tensor, reason: str, layer_hint: int = -1) -> None:
    """Note a self-attention call the host answers densely because Chorus must not take it
    (``torch.ops.chorus.refuse``; ``q`` only orders the call among the others)."""
    torch.ops.chorus.refuse(q, str(reason), int(layer_hint), _RECORD_TOKEN)


def compact_tokens(t: torch.Tensor, rule: str, length: int) -> torch.Tensor:
    """A reduced block's per-token input ``[B or 1, L, ...] -> [B or 1, length, ...]`` on the current
    context (``torch.ops.chorus.compact_tokens``; ``rule`` as :meth:`FeatureReuse.compact`)."""
    return torch.ops.chorus.compact_tokens(t, str(rule), int(length))


def attend_compact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_hint: int = -1) -> torch.Tensor:
    """A reduced block's self-attention ``[B, H, L', D]`` on the current context
    (``torch.ops.chorus.attend_compact``)."""
    return torch.ops.chorus.attend_compact(q, k, v, int(layer_hint))


def expand_block(x: torch.Tensor, x_c: torch.Tensor, y_c: torch.Tensor) -> torch.Tensor:
    """A reduced block's output ``[B, L, C]`` on the full sequence (``torch.ops.chorus.expand_block``)."""
    return torch.ops.chorus.expand_block(x, x_c, y_c)
