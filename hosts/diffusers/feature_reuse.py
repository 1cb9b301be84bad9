"""Feature reuse in a diffusers Wan pipeline: drive ``WanTransformer3DModel``'s blocks through a
:class:`chorus.engine.feature_reuse.FeatureReuse` (``patch_diffusers_feature_reuse``)."""

from __future__ import annotations

import torch

from ...engine.feature_reuse import FeatureReuse
from ...kernels import pooling
from .adapter import diffusers_wan_blocks, forward_grid_and_sigma, forward_image_frames


_ABSENT = object()  # no instance attribute ``forward`` before the patch


def _install_forward(module, wrap) -> tuple:
    """Set ``module.forward`` to ``wrap(current forward)`` (an instance attribute) and return ``(module, what
    remove restores)``. The current forward is whatever runs now: the class's method, or another library's
    instance-level forward (diffusers' ``HookRegistry`` hooks: group offloading, caches; accelerate's device
    hooks), which keeps running inside the wrapper; an older Chorus wrapper is replaced, not stacked."""
    before = module.__dict__.get("forward", _ABSENT)
    older = getattr(before, "_chorus_feature_reuse", None)
    before, current = older if older is not None else (before, module.forward)
    wrapper = wrap(current)
    wrapper._chorus_feature_reuse = (before, current)
    module.forward = wrapper
    return module, before


def _restore_forward(module, before) -> None:
    """Undo :func:`_install_forward` where its wrapper is still the module's forward (one installed on top of
    it since is left alone)."""
    if getattr(module.__dict__.get("forward"), "_chorus_feature_reuse", None) is None:
        return
    if before is _ABSENT:
        module.__dict__.pop("forward", None)
    else:
        module.forward = before


class _DiffusersState:
    def __init__(self):
        self.sigma = None
        self.grid = None
        self.layout = None
        self.rope_full = None


def _rope_as_rotations(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))


class DiffusersFeatureReusePatch:
    """Handle returned by :func:`patch_diffusers_feature_reuse`; ``remove()`` undoes the patch."""

    def __init__(self, transformer, handle, installed, hook):
        self.transformer, self.handle, self._installed, self._hook = transformer, handle, installed, hook

    def remove(self) -> None:
        for module, before in self._installed:
            _restore_forward(module, before)
        self._installed = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def patch_diffusers_feature_reuse(transformer, handle: FeatureReuse) -> DiffusersFeatureReusePatch:
    """Drive a diffusers ``WanTransformer3DModel``'s blocks through ``handle`` (a :class:`FeatureReuse`).

    Each block's ``forward`` is wrapped (instance attribute, around whatever forward it had, other libraries'
    hooks included; ``remove()`` restores it; patching again replaces the older wrapper): the block runs
    on the compact sequence with pooled RoPE (``cos, sin`` renormalised) and, for Wan 2.2 TI2V, pooled
    per-token ``temb``. During a compacted call the block's ``attn1`` (self-attention) gets its input
    expanded back to the full token grid with the pooled tokens' RoPE repeated over their cells, runs
    there (through whatever processor is installed, e.g. ``patch_diffusers_wan``'s sparse one), and its
    output rows are compacted again, as the ComfyUI node does with q/k/v (here the q/k/v projections run
    on the expanded sequence). A forward pre-hook on the transformer reads the token grid and sigma
    (``timestep / 1000``, the largest value for per-token timesteps). Combine with
    ``patch_diffusers_wan`` in either order. Raises ``ValueError`` for a module that is not a diffusers Wan.
    """
    blocks, patch_size = diffusers_wan_blocks(transformer)
    state = _DiffusersState()

    def pre_hook(module, args, kwargs):
        found = forward_grid_and_sigma(args, kwargs, patch_size)
        state.grid, state.sigma = found if found is not None else (state.grid, None)
        if found is not None:
            handle.serve_grid(state.grid, forward_image_frames(args, kwargs, handle.model_info))
        return None

    def wrap_attn1(attn, original):
        def forward(hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None, **kwargs):
            layout = state.layout
            if (layout is None or encoder_hidden_states is not None or hidden_states.dim() != 3
                    or hidden_states.shape[1] != layout.compact_length):
                return original(hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
            full = pooling.expand_tokens(hidden_states, layout)
            out = original(full, None, attention_mask, state.rope_full, **kwargs)
            return pooling.compact_rows(out, layout)
        return forward

    def wrap_block(block, layer, original):
        def forward(hidden_states, encoder_hidden_states, temb, rotary_emb):
            if state.sigma is None or state.grid is None or not isinstance(rotary_emb, (tuple, list)):
                return original(hidden_states, encoder_hidden_states, temb, rotary_emb)
            cos, sin = rotary_emb
            per_token = {"rope": (_rope_as_rotations(cos, sin), "rotation")}
            if isinstance(temb, torch.Tensor) and temb.dim() == 4:
                per_token["temb"] = (temb, "mean")

            def block_fn(x_in, inputs, layout):
                if layout is None and x_in is hidden_states:
                    return original(hidden_states, encoder_hidden_states, temb, rotary_emb)
                rot = inputs["rope"]
                rope_c = (rot[..., 0, 0].contiguous(), rot[..., 1, 0].contiguous())
                temb_c = inputs.get("temb", temb)
                if layout is None:
                    return original(x_in, encoder_hidden_states, temb_c, rope_c)
                state.layout = layout
                state.rope_full = tuple(pooling.expand_tokens(r, layout) for r in rope_c)
                try:
                    return original(x_in, encoder_hidden_states, temb_c, rope_c)
                finally:
                    state.layout = None
                    state.rope_full = None

            return handle.block(block_fn, hidden_states, layer=layer, sigma=state.sigma, grid=state.grid,
                                per_token=per_token)
        return forward

    installed = []
    for i, block in enumerate(blocks):
        installed.append(_install_forward(block, lambda current, block=block, i=i: wrap_block(block, i, current)))
        installed.append(_install_forward(block.attn1, lambda current, attn=block.attn1: wrap_attn1(attn, current)))
    hook = transformer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    return DiffusersFeatureReusePatch(transformer, handle, installed, hook)
