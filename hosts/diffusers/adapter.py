"""Use the engine from a diffusers Wan pipeline: patch ``WanTransformer3DModel`` self-attention.

``patch_diffusers_wan(transformer, handle)`` installs, on every block's ``attn1`` (self-attention),
a processor that computes q/k/v exactly as diffusers' ``WanAttnProcessor`` does (projections,
RMS norms, rotary embedding) and hands them, as one :class:`~chorus.engine.call.AttnCall`, to the
engine's entry (:func:`chorus.engine.runtime.attend`, i.e. ``handle.attend``); cross-attention
(``attn2``) keeps its processor. A forward pre-hook on the transformer reads, per call, the token
grid from ``hidden_states`` ``[B, C, T, H, W]`` (``T/pt, H/ph, W/pw``) and the sigma from
``timestep`` (flow-matching timesteps are ``1000 * sigma``; for per-token timesteps, Wan 2.2 TI2V,
the largest value). The first call at a new sigma counts as the positive (cond) pass and later
calls at the same sigma as negative passes, which matches how diffusers' Wan pipelines run CFG
(cond first, then uncond, as separate calls); with CFG batched into one call every row is recorded.
``patch.remove()`` restores the original processors and removes the hook.

``patch_diffusers_guidance(transformer, boost)`` adds ChorusGuidanceBoost's corrections
(:mod:`chorus.engine.guidance`) to the same model, before or after ``patch_diffusers_wan``: the
cross-attention (``attn2``) output gets the text gain (applied to the attention result before the
output projection: ``g * out - (g - 1) * to_out.bias``), and self-attention the first-frame logit
bias (and the last frame's, for a request with ``last_image``) — inside the sparse processor when
``patch_diffusers_wan`` is installed, else through a dense processor that leaves every call without a bias to
diffusers' own processor. Remove patches in the reverse order of installing them.
"""

from __future__ import annotations

import functools
import logging

import torch

from ...engine.call import AttnCall
from ...engine.model_info import image_frames, wan_model_info
from ...engine.guidance import GuidanceBoost
from ...engine.runtime import ChorusAttention, attend

log = logging.getLogger("chorus.hosts")


def _rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotary embedding on ``[B, L, H, D]`` (diffusers Wan convention)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class _CallState:
    def __init__(self):
        self.sigma = None
        self.grid = None
        self.cond = True
        self.last_sigma = None
        self.image_frames = None  # the forward's image_frames callable (forward_image_frames)


class ChorusWanSelfAttnProcessor:
    """Self-attention processor for one diffusers ``WanAttention`` (``attn1`` of block ``layer``).

    ``handle``: the :class:`ChorusAttention` of ``patch_diffusers_wan``, or None for the dense
    processor of ``patch_diffusers_guidance`` (then calls without a first-frame bias go to
    ``original`` untouched). ``guidance``: a :class:`GuidanceBoost` whose first-frame bias is applied."""

    def __init__(self, handle: ChorusAttention | None, layer: int, state: _CallState, original,
                 guidance: GuidanceBoost | None = None):
        self.handle, self.layer, self.state, self.original = handle, layer, state, original
        self.guidance = guidance

    def _note(self, message: str) -> None:
        plan = self.handle.plan if self.handle is not None else getattr(self.guidance, "plan", None)
        if plan is not None:
            plan.note(message)
        else:
            log.warning("Chorus II: %s", message)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        st = self.state
        if encoder_hidden_states is not None or attention_mask is not None or st.sigma is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        bias = last_bias = 0.0
        if self.guidance is not None:
            bias = self.guidance.first_frame_bias(st.sigma)
            # a diffusers forward holds the whole latent: the request's frames (the plan's, read at the run's
            # first forward) are its own, read from it only without a plan (a sync each forward then)
            plan = self.guidance.plan
            known = plan is not None and plan.state.image_frames is not None
            last_bias = self.guidance.last_frame_bias(st.sigma, None if known else st.image_frames) if bias else 0.0
        grid = st.grid
        biased = bool(bias) and grid is not None and grid[0] * grid[1] * grid[2] == hidden_states.shape[1]
        if self.handle is None and not biased:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _rotary(query, *rotary_emb)
            key = _rotary(key, *rotary_emb)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, H, L, D]
        call = AttnCall(q, k, v, layer=self.layer, sigma=st.sigma, grid=st.grid, first_frame_bias=bias,
                        cond_rows=torch.full((q.shape[0],), st.cond, dtype=torch.bool), last_frame_bias=last_bias)
        out = attend(call, self.handle, self._note).transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class DiffusersPatch:
    """Handle returned by :func:`patch_diffusers_wan`; ``remove()`` undoes the patch."""

    def __init__(self, transformer, handle, originals, hook):
        self.transformer, self.handle, self._originals, self._hook = transformer, handle, originals, hook

    def remove(self) -> None:
        for block, proc in self._originals:
            _set_processor(block.attn1, proc)
        self._originals = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def diffusers_wan_blocks(transformer):
    """``(blocks, (pt, ph, pw))`` of a diffusers ``WanTransformer3DModel``; ``ValueError`` for anything else."""
    blocks = getattr(transformer, "blocks", None)
    patch_size = getattr(getattr(transformer, "config", None), "patch_size", None)
    if blocks is None or patch_size is None or not all(hasattr(b, "attn1") for b in blocks):
        raise ValueError(f"{type(transformer).__name__} is not a diffusers WanTransformer3DModel")
    return blocks, tuple(int(p) for p in patch_size)


def forward_grid_and_sigma(args, kwargs, patch_size):
    """From a ``WanTransformer3DModel.forward`` call: the token grid ``(T', H', W')`` and sigma
    (``timestep / 1000``, the largest value for per-token timesteps), or ``None`` when the call does
    not carry a 5-D latent and a timestep."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    timestep = kwargs.get("timestep", args[1] if len(args) > 1 else None)
    if hidden is None or timestep is None or hidden.dim() != 5:
        return None
    _, _, t, h, w = hidden.shape
    pt, ph, pw = patch_size
    return (t // pt, h // ph, w // pw), float(torch.as_tensor(timestep).float().max()) / 1000.0


def forward_image_frames(args, kwargs, model_info):
    """A callable giving the latent frames a ``WanTransformer3DModel.forward`` call's input holds images on
    (:func:`~chorus.engine.model_info.image_frames`: diffusers lays the I2V input out as ComfyUI does), computed
    once when first asked (it syncs: the engine asks at a run's first forward only)."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    timestep = kwargs.get("timestep", args[1] if len(args) > 1 else None)
    return functools.cache(lambda: image_frames(hidden, model_info, timestep))


def _set_processor(attn, proc) -> None:
    attn.set_processor(proc) if hasattr(attn, "set_processor") else setattr(attn, "processor", proc)


def _state_hook(transformer, patch_size, handle=None):
    """A :class:`_CallState` kept current by a forward pre-hook on ``transformer``, which also tells
    ``handle`` (a ``ChorusAttention``, or None) each forward's grid (its ``serve_grid``): ``(state, hook)``."""
    state = _CallState()
    model_info = handle.model_info if handle is not None else wan_model_info(transformer)

    def pre_hook(module, args, kwargs):
        found = forward_grid_and_sigma(args, kwargs, patch_size)
        if found is None:
            state.sigma = state.image_frames = None
            return None
        state.grid, sigma = found
        state.image_frames = forward_image_frames(args, kwargs, model_info)
        if handle is not None:
            handle.serve_grid(state.grid, state.image_frames)
        state.cond = state.last_sigma is None or abs(sigma - state.last_sigma) > 1e-7
        state.sigma = state.last_sigma = sigma
        return None

    return state, transformer.register_forward_pre_hook(pre_hook, with_kwargs=True)


def patch_diffusers_wan(transformer, handle: ChorusAttention) -> DiffusersPatch:
    """Route the self-attention of a diffusers ``WanTransformer3DModel`` through ``handle``.

    Raises ``ValueError`` when ``transformer`` has no ``blocks[i].attn1`` or no patch-size config.
    """
    blocks, patch_size = diffusers_wan_blocks(transformer)
    state, hook = _state_hook(transformer, patch_size, handle)
    originals = []
    for i, block in enumerate(blocks):
        current = block.attn1.processor
        originals.append((block, current))
        guidance = None
        if isinstance(current, ChorusWanSelfAttnProcessor) and current.handle is None:
            guidance, current = current.guidance, current.original  # guidance patched first: take it inside
        _set_processor(block.attn1, ChorusWanSelfAttnProcessor(handle, i, state, current, guidance))
    return DiffusersPatch(transformer, handle, originals, hook)


class CrossAttentionGain:
    """``attn2`` processor wrapper: the text gain of a :class:`GuidanceBoost` on the attention result."""

    def __init__(self, boost: GuidanceBoost, state: _CallState, original):
        self.boost, self.state, self.original = boost, state, original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        out = self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if self.state.sigma is None or not isinstance(out, torch.Tensor):
            return out
        boosted = self.boost.cross_attention(out, self.state.sigma)
        if boosted is out:
            return out
        bias = getattr(attn.to_out[0], "bias", None)  # to_out(g * a) = g * to_out(a) - (g - 1) * bias
        return boosted if bias is None else boosted - (self.boost.gain - 1.0) * bias


class DiffusersGuidancePatch:
    """Handle returned by :func:`patch_diffusers_guidance`; ``remove()`` undoes the patch."""

    def __init__(self, transformer, boost, undo, hook):
        self.transformer, self.boost, self._undo, self._hook = transformer, boost, undo, hook

    def remove(self) -> None:
        for fn in reversed(self._undo):
            fn()
        self._undo = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def patch_diffusers_guidance(transformer, boost: GuidanceBoost) -> DiffusersGuidancePatch:
    """Apply ``boost`` (text gain on ``attn2``, first-frame bias in ``attn1``) to a diffusers
    ``WanTransformer3DModel``; see the module docstring. A boost with every strength 0 patches nothing.
    Raises ``ValueError`` for a module that is not a diffusers Wan or a ``boost`` that is not a
    :class:`GuidanceBoost`."""
    if not isinstance(boost, GuidanceBoost):
        raise ValueError(f"boost must be a GuidanceBoost, got {type(boost).__name__}")
    blocks, patch_size = diffusers_wan_blocks(transformer)
    if boost.is_off:
        return DiffusersGuidancePatch(transformer, boost, [], None)
    state, hook = _state_hook(transformer, patch_size)
    undo = []
    for i, block in enumerate(blocks):
        attn1, attn2 = block.attn1, getattr(block, "attn2", None)
        if boost.image_strength:
            current = attn1.processor
            if isinstance(current, ChorusWanSelfAttnProcessor) and current.handle is not None:
                previous = current.guidance
                current.guidance = boost
                undo.append(lambda p=current, g=previous: setattr(p, "guidance", g))
            else:
                _set_processor(attn1, ChorusWanSelfAttnProcessor(None, i, state, current, boost))
                undo.append(lambda a=attn1, p=current: _set_processor(a, p))
        if boost.strength and attn2 is not None:
            current = attn2.processor
            _set_processor(attn2, CrossAttentionGain(boost, state, current))
            undo.append(lambda a=attn2, p=current: _set_processor(a, p))
    return DiffusersGuidancePatch(transformer, boost, undo, hook)
