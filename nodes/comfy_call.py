"""How ComfyUI calls an attention override, in both conventions Chorus supports: pure functions.

ComfyUI's ``wrap_attn`` (``comfy/ldm/modules/attention.py``) calls the one
``transformer_options["optimized_attention_override"]`` as ``override(func, *args, **kwargs)``, ``func``
being the raw (undecorated) attention backend, whose signature is ``(q, k, v, heads, mask=None,
attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)``.

- ComfyUI 0.3.64 (commit a125cd84, run here): ``args`` = q, k, v tensors (Wan: ``[B, L, H*D]``), kwargs
  ``heads``, ``transformer_options``, ``_inside_attn_wrapper`` (+ ``mask`` / ``attn_precision`` /
  ``skip_reshape`` / ``skip_output_reshape`` where a model passes them; a masked call may pass ``mask``
  positionally).
- ComfyUI 0.38.x (read from source only: ``attention.py`` at 05080f60, ``wan/model.py`` at 0c9a69ae):
  callers may hand q/k/v over as single-owner ``AttentionTensorContainer`` objects (``take()`` returns
  the tensor and empties the container; a second ``take()`` raises). ``wrap_attn`` pops
  ``preferred_attention`` before it looks at the override, and unwraps the containers for an override
  without a ``container_function`` attribute (Chorus has none), so an override normally gets plain
  tensors; backends honour ``scale=`` and ``enable_gqa=``; Wan's image cross-attention passes
  ``low_precision_attention=False``.

:func:`read_call` turns ``(args, kwargs)`` into an :class:`AttentionCall`: q, k, v as plain tensors
(a container is taken exactly once, here) and the keyword arguments that matter. From then on only the
call's ``args`` are handed on — to ``func`` or to a chained override — never the emptied containers:
they receive plain tensors, as ``wrap_attn`` gives any override. :func:`dense_call` makes that call,
keyword arguments unchanged (``scale``, ``enable_gqa``, ``preferred_attention`` when a chained caller
passes one, unknown ones); :func:`layout_refusal` / :func:`sparse_refusal` say why Chorus's own path
must not take a call; :func:`scaled_query` honours ``scale`` on that path.

Everything here runs inside the override, which ComfyUI's ``TorchCompileModel`` compiles: plain tensor,
shape, tuple, dict and isinstance logic only — no logging, no host syncs, no state
(``tests/test_comfy_call.py`` traces it with ``fullgraph=True``). Nothing imports ComfyUI.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# keyword arguments an override may receive from ComfyUI 0.3.64 or 0.38.x (see the module docstring)
KNOWN_KWARGS = frozenset({
    "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape",  # the backend signature
    "transformer_options", "_inside_attn_wrapper",                            # wrap_attn
    "scale", "enable_gqa", "low_precision_attention", "preferred_attention",  # 0.38.x
})


class AttentionCall(NamedTuple):
    """One attention call as an override received it, q/k/v taken out of any container.

    ``q``, ``k``, ``v``: the plain tensors; ``args``: the positional arguments to hand on — ``(q, k, v,
    *rest)``; ``kwargs``: the keyword arguments as received (handed on unchanged). The other fields are read
    from either (positional ``heads``/``mask``/``skip_*`` after q, k, v as in the backend signature):
    ``heads`` (int or None), ``scale`` (float or None = the backend's default ``1/sqrt(D)``), ``mask``,
    ``skip_reshape`` / ``skip_output_reshape``, ``enable_gqa``, ``low_precision`` (False when the caller
    asked for no low-precision attention), ``unknown`` (names of keyword arguments not in
    :data:`KNOWN_KWARGS`, sorted)."""

    # q / k / v are fields, not properties over ``args``: torch 2.8's dynamo does not trace a NamedTuple's
    # property (a graph break at every attention call under TorchCompileModel there)
    q: object
    k: object
    v: object
    args: tuple
    kwargs: dict
    heads: object
    scale: object
    mask: object
    skip_reshape: bool
    skip_output_reshape: bool
    enable_gqa: bool
    low_precision: bool
    unknown: tuple


def take_tensor(value):
    """A tensor as is; a single-owner container's tensor (its ``take()``, once); anything else as is."""
    if isinstance(value, torch.Tensor):
        return value
    take = getattr(value, "take", None)
    return take() if callable(take) else value


def _argument(name: str, position: int, args, kwargs, default):
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def read_call(args, kwargs) -> AttentionCall | None:
    """The :class:`AttentionCall` of an override's ``(args, kwargs)``; None for fewer than three
    positional arguments (not an attention call this module knows: hand the originals on as they
    are). Takes each q/k/v container exactly once — the caller must hand on ``call.args``."""
    if len(args) < 3:
        return None
    q, k, v = take_tensor(args[0]), take_tensor(args[1]), take_tensor(args[2])
    return AttentionCall(
        q=q, k=k, v=v,
        args=(q, k, v) + tuple(args[3:]),
        kwargs=kwargs,
        heads=_argument("heads", 3, args, kwargs, None),
        scale=kwargs.get("scale"),
        mask=_argument("mask", 4, args, kwargs, None),
        skip_reshape=bool(_argument("skip_reshape", 6, args, kwargs, False)),
        skip_output_reshape=bool(_argument("skip_output_reshape", 7, args, kwargs, False)),
        enable_gqa=bool(kwargs.get("enable_gqa", False)),
        low_precision=kwargs.get("low_precision_attention", True) is not False,
        unknown=tuple(sorted(name for name in kwargs if name not in KNOWN_KWARGS)),
    )


def layout_refusal(call: AttentionCall) -> str | None:
    """Why Chorus cannot read this call as Wan's ``[B, L, H*D]`` attention (another model's or
    module's call: hand it on without a note), or None."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in call.args[:3]):
        return "q/k/v are not [B, L, heads*head_dim] tensors"
    if call.mask is not None:
        return "the call has an attention mask"
    if call.skip_reshape or call.skip_output_reshape:
        return "the call is in [B, heads, L, head_dim] layout"
    return None


def head_dim(call: AttentionCall) -> int | None:
    """q's head size (``width // heads``), or None when ``heads`` does not divide q's width."""
    heads = call.heads
    width = call.q.shape[-1]
    if not heads or width % int(heads):
        return None
    return width // int(heads)


def sparse_refusal(call: AttentionCall) -> str | None:
    """Why a self-attention call Chorus would take (sparse, recorded or biased) must run dense
    instead, as the message of a dense fallback with a note; None when Chorus may take it.

    Refused: a q width that is not a multiple of ``heads``; ``enable_gqa=True`` with fewer key/value
    heads than query heads (Chorus's sparse path has no grouped-query attention; with as many heads
    ``enable_gqa`` changes nothing and the call is taken); ``low_precision_attention=False`` (Chorus's
    hit path is FP8 on Hopper); keyword arguments this module does not know (they may change what
    attention computes)."""
    size = head_dim(call)
    if size is None:
        return f"q width {call.q.shape[-1]} is not a multiple of {call.heads} heads"
    if call.enable_gqa and (call.k.shape[-1] != call.q.shape[-1] or call.v.shape[-1] != call.q.shape[-1]):
        return (f"enable_gqa=True with {call.k.shape[-1] // size} key/value heads for {int(call.heads)} query "
                "heads: Chorus's sparse path has no grouped-query attention")
    if not call.low_precision:
        return "the caller asked for no low-precision attention (low_precision_attention=False)"
    if call.unknown:
        return f"attention keyword arguments Chorus does not know ({', '.join(call.unknown)})"
    return None


def scaled_query(q: torch.Tensor, scale, size: int) -> torch.Tensor:
    """``q`` such that attention at the default scale ``1/sqrt(size)`` computes the caller's ``scale``
    (``q * scale * sqrt(size)``): how Chorus's own path, which works at the default scale, honours
    ``scale=``. ``q`` itself when ``scale`` is None or the default."""
    if scale is None:
        return q
    factor = scale * math.sqrt(size)
    if not isinstance(factor, torch.Tensor) and factor == 1.0:
        return q
    return q * factor


def dense_call(func, previous, args, kwargs, options=None):
    """The host's dense attention for an override's call: ``previous(func, *args, **kwargs)`` when an
    override is chained (``previous`` not None), else ``func(*args, **kwargs)``. ``args`` must hold plain
    tensors (an :class:`AttentionCall`'s ``args``: a container taken by :func:`read_call` is empty and
    never handed on); ``kwargs`` are passed unchanged (``heads``, ``scale``, ``enable_gqa``,
    ``preferred_attention``, unknown ones), except ``transformer_options``, replaced by ``options`` when
    given. Returns what the callee returns (ComfyUI's layout: ``[B, L, H*D]`` for Wan)."""
    if options is not None:
        kwargs = dict(kwargs)
        kwargs["transformer_options"] = options
    if previous is not None:
        return previous(func, *args, **kwargs)
    return func(*args, **kwargs)


def extra_token_input(args, kwargs) -> str | None:
    """The name of a Wan diffusion-model input that adds tokens to the video sequence (so self-attention
    is longer than the latent's grid), or None: ``time_dim_concat`` (positional 5th argument or keyword),
    ``reference_latent``, and 0.38.x's ``context_latents`` (in-context reference streams,
    ``wan/model.py`` at 0c9a69ae). ``args``/``kwargs``: a DIFFUSION_MODEL wrapper's
    (x, timestep, context, clip_fea, time_dim_concat, transformer_options, **kwargs)."""
    time_dim_concat = args[4] if len(args) > 4 and not isinstance(args[4], dict) else kwargs.get("time_dim_concat")
    if time_dim_concat is not None:
        return "time_dim_concat"
    if "reference_latent" in kwargs:  # WanModel lengthens its RoPE for the key's mere presence
        return "reference_latent"
    if kwargs.get("context_latents") is not None:
        return "context_latents"
    return None
