"""The attention override of Chorus-patched models: the traced translation of ComfyUI's attention
calls into the engine's custom ops (``engine/attend.py``).

:class:`ChorusOverride` is ``transformer_options["optimized_attention_override"]`` of every
Chorus-patched model (``nodes/comfy_patch.py`` installs it): one object per chained override, the same
for every request, so ``TorchCompileModel`` traces it once. It reads a call through
``nodes/comfy_call.py`` (both of ComfyUI's calling conventions) and the forward's constants
(``nodes/comfy_forward.py``, read through its guarded :func:`~.comfy_forward.constants`) only; everything
that changes is read by the ops when they run.
"""

from __future__ import annotations

import torch

from ..engine import attend as engine_attend
from . import comfy_call
from .comfy_forward import DENSE_KEY, FORWARD_KEY, FORWARD_KEYS, GAIN_KEY, MODE_KEY, REDUCE_KEY, TOKENS_KEY, \
    chained_instance, constants


class ChorusOverride:
    """The attention override of Chorus-patched models (``optimized_attention_override``): one object
    per chained override (:meth:`chaining`), the same for every request.

    It only translates ComfyUI's call (read in either calling convention by :func:`comfy_call.read_call`:
    q, k, v ``[B, L, H*D]``, ``heads``, ``scale``) by the forward's constants (module docstring):
    self-attention (q, k and v as long as the grid) to ``torch.ops.chorus.attend``, or, on a recording
    miss, to the host's attention and ``torch.ops.chorus.record_mass``; a self-attention call Chorus
    must not take (:func:`comfy_call.sparse_refusal`) to the host's attention, noted by
    ``torch.ops.chorus.refuse``; cross-attention to the host's attention, times guidance's gain; the
    self-attention of a block feature reuse reduced (q, k and v as long as the forward's compact
    sequence, :data:`REDUCE_KEY`) to ``torch.ops.chorus.attend_compact``; everything else (another
    layout, a mask, no Chorus forward) to ``previous`` or the host's attention unchanged."""

    _by_previous: dict = {}

    def __init__(self, previous=None):
        self.previous = previous

    @classmethod
    def chaining(cls, previous) -> "ChorusOverride":
        """The override that chains ``previous`` (None: the host's attention), made once per process while it
        is in use (:func:`~.comfy_forward.chained_instance`)."""
        return chained_instance(cls._by_previous, id(previous), previous, lambda: cls(previous))

    @property
    def previous_override(self):
        """The override this one chains (what ``nodes/override_stack.py`` walks)."""
        return self.previous

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"ChorusOverride(previous={self.previous!r})"

    def __call__(self, func, *args, **kwargs):
        call = comfy_call.read_call(args, kwargs)
        if call is None:
            return _pass(self.previous, func, args, kwargs)
        args = call.args  # plain tensors from here on, to func and any chained override alike
        options = kwargs.get("transformer_options")
        if not isinstance(options, dict) or comfy_call.layout_refusal(call) is not None:
            return _pass(self.previous, func, args, kwargs)
        q, k, v = args[:3]
        forward = constants(options)
        tokens = forward.get(TOKENS_KEY)
        if tokens is None:
            return _pass(self.previous, func, args, kwargs)
        if k.shape[1] != q.shape[1]:  # cross-attention: text, CLIP image tokens
            out = _pass(self.previous, func, args, kwargs)
            gain = forward.get(GAIN_KEY)
            return out if gain is None else out * gain
        mode = forward.get(MODE_KEY)
        reduce = forward.get(REDUCE_KEY)
        compact = reduce is not None and reduce[1] and q.shape[1] == v.shape[1] == reduce[0]
        if compact:
            mode = "attend"  # a reduced block's pooled keys weigh as their cells' tokens (also without a map)
        elif mode is None or q.shape[1] != tokens or v.shape[1] != tokens:
            return _pass(self.previous, func, args, kwargs)
        hint = _layer_hint(kwargs)
        refusal = comfy_call.sparse_refusal(call)
        if refusal is not None:
            engine_attend.refuse(q, refusal, hint)
            return _pass(_dense_chain(forward, self.previous), func, args, kwargs)
        heads = int(call.heads)
        size = q.shape[2] // heads
        if mode == "record":
            out = _pass(_dense_chain(forward, self.previous), func, args, kwargs)
            engine_attend.record_mass(_per_head(comfy_call.scaled_query(q, call.scale, size), heads),
                                      _per_head(k, heads), hint)
            return out
        batch, length, width = q.shape
        attend = engine_attend.attend_compact if compact else engine_attend.attend
        out = attend(_per_head(comfy_call.scaled_query(q, call.scale, size), heads), _per_head(k, heads),
                     _per_head(v, heads), hint)
        return out.transpose(1, 2).reshape(batch, length, width)


def _dense_chain(options: dict, previous):
    """Where Chorus's own dense calls of this forward go: the forward's chain without a foreign sparse
    override (:data:`DENSE_KEY`), else the override's own chain."""
    dense = options.get(DENSE_KEY)
    return previous if dense is None else dense[0]


def _layer_hint(kwargs) -> int:
    """The block index ComfyUI >= 0.4 puts in transformer_options (-1 when absent, and in compiled code: there
    a block compiled as a frame of its own may keep the index it was traced with, as ComfyUI's
    ``TorchCompileModel`` keeps no guard on ``transformer_options``; the engine's per-forward count of
    self-attention calls, which runs when the op does, is the layer then)."""
    if torch.compiler.is_compiling():
        return -1
    index = (kwargs.get("transformer_options") or {}).get("block_index")
    return index if isinstance(index, int) and not isinstance(index, bool) and index >= 0 else -1


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, L, H*D]`` viewed as ``[B, H, L, D]`` (no copy)."""
    batch, length, width = t.shape
    return t.view(batch, length, heads, width // heads).transpose(1, 2)


def _pass(previous, func, args, kwargs):
    """The call as if Chorus were not there: through the chained override, else the host's attention
    (:func:`comfy_call.dense_call`), with this forward's Chorus keys removed from its options (an older
    Chorus override further down the chain, or the one a foreign override chains back to, passes it on)."""
    options = kwargs.get("transformer_options")
    if isinstance(options, dict) and (FORWARD_KEY in options or MODE_KEY in options):
        options = {key: value for key, value in options.items() if key not in FORWARD_KEYS}
    else:
        options = None
    return comfy_call.dense_call(func, previous, args, kwargs, options)
