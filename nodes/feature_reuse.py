"""ChorusFeatureReuse: on a hit, redundant spatiotemporal regions run at a downsampled resolution.

ComfyUI glue for :mod:`chorus.engine.feature_reuse` (the method is described there):

- ``patches_replace["dit"][("double_block", i)]`` for every block ``i`` wraps the block (a patch
  already at that key is chained: it receives the compacted arguments). On a hit it hands the engine
  a ``block_fn`` that runs the block on the compact sequence: ``img`` compacted, RoPE ``pe``
  (``[1, L, 1, 64, 2, 2]`` rotations) pooled to cell centres, per-frame modulation ``vec`` (Wan 2.2
  TI2V 5B) expanded per token and pooled; on a miss it runs the block in full and records region
  scores.
- During a compacted block call the block's ``transformer_options`` carry a
  :class:`ExpandedSelfAttention` as the *outermost* attention override (whatever override is set —
  ChorusSparseSampler's, another pack's — is its inner one, in either node order): self-attention
  q/k/v are expanded back to the full token sequence (each pooled token repeated over its cell), the
  inner attention (sparse or dense) runs on the full grid, and the output rows are compacted again.
  So pooled keys carry the attention mass of the tokens they stand for, and sparse masks apply as is.
- keyed wrappers (key ``"chorus_ii_feature_reuse"``): OUTER_SAMPLE brackets each sampler run,
  DIFFUSION_MODEL computes the token grid and stores a per-forward context.
Anything unexpected runs the block in full with a note in the plan; never a failed prompt.
"""

from __future__ import annotations

import functools
import logging

import torch
from comfy_api.latest import io

from ..engine import Plan
from ..engine.feature_reuse import FeatureReuse, FeatureReuseConfig
from ..kernels import pooling
from .comfy_adapter import comfy_model_info, latent_token_grid
from .common import CATEGORY, ChorusPlan, ui_text

log = logging.getLogger("chorus.nodes")

WRAPPER_KEY = "chorus_ii_feature_reuse"
FORWARD_KEY = "chorus_ii_feature_reuse_forward"
LAYOUT_KEY = "chorus_ii_feature_reuse_layout"
OVERRIDE = "optimized_attention_override"


class ExpandedSelfAttention:
    """Attention override used inside a compacted block call (see the module docstring)."""

    def __init__(self, layout: pooling.RegionLayout, inner=None):
        self.layout, self.inner = layout, inner

    def __deepcopy__(self, memo):
        return self

    def _call_inner(self, func, args, kwargs):
        if self.inner is not None:
            return self.inner(func, *args, **kwargs)
        return func(*args, **kwargs)

    def __call__(self, func, *args, **kwargs):
        layout = self.layout
        if len(args) >= 3:
            q, k, v = args[:3]
            if (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
                    and q.dim() == 3 and q.shape[1] == k.shape[1] == v.shape[1] == layout.compact_length
                    and kwargs.get("mask") is None and not kwargs.get("skip_reshape")
                    and not kwargs.get("skip_output_reshape")):
                full = tuple(pooling.expand_tokens(t, layout) for t in (q, k, v))
                out = self._call_inner(func, full + tuple(args[3:]), kwargs)
                return pooling.compact_rows(out, layout)
        return self._call_inner(func, args, kwargs)


class _Forward:
    def __init__(self, grid):
        self.grid = grid

    def __deepcopy__(self, memo):
        return self


def _per_token_vec(vec: torch.Tensor, length: int) -> torch.Tensor | None:
    """Wan time modulation ``[B, Tt, 6, C]`` as per-token ``[B, L, 6, C]`` (ComfyUI's ``repeat_e``), or
    None when it is one vector per sample (``Tt == 1``: nothing to compact)."""
    if not isinstance(vec, torch.Tensor) or vec.dim() != 4 or vec.shape[1] == 1:
        return None
    repeats = length // vec.shape[1]
    if repeats * vec.shape[1] == length:
        return torch.repeat_interleave(vec, repeats, dim=1)
    return torch.repeat_interleave(vec, repeats + 1, dim=1)[:, :length]


class FeatureReusePatch:
    """``patches_replace["dit"][("double_block", layer)]`` for one block."""

    def __init__(self, handle: FeatureReuse, layer: int, previous=None):
        self.handle, self.layer, self.previous = handle, layer, previous

    def __deepcopy__(self, memo):
        return self

    def _run(self, args, extra):
        if self.previous is not None:
            return self.previous(args, extra)
        return extra["original_block"](args)

    def __call__(self, args, extra):
        options = args.get("transformer_options") or {}
        ctx = options.get(FORWARD_KEY)
        x = args.get("img")
        if ctx is None or not isinstance(x, torch.Tensor) or x.dim() != 3:
            return self._run(args, extra)
        pe = args.get("pe")
        if not isinstance(pe, torch.Tensor) or pe.dim() < 3 or pe.shape[1] != x.shape[1] or pe.shape[-2:] != (2, 2):
            self.handle.plan.note("feature reuse: unexpected RoPE layout in the block arguments; blocks run in full")
            return self._run(args, extra)
        per_token = {"pe": (pe, "rotation")}
        vec_tok = _per_token_vec(args.get("vec"), x.shape[1])
        if vec_tok is not None:
            per_token["vec"] = (vec_tok, "mean")

        def block_fn(x_in, inputs, layout):
            if layout is None and x_in is x:
                return self._run(args, extra)["img"]
            call = dict(args)
            call["img"] = x_in
            call["pe"] = inputs["pe"]
            if "vec" in inputs:
                call["vec"] = inputs["vec"]
            if layout is not None:
                opts = dict(options)
                opts[OVERRIDE] = ExpandedSelfAttention(layout, options.get(OVERRIDE))
                opts[LAYOUT_KEY] = layout
                call["transformer_options"] = opts
            return self._run(call, extra)["img"]

        y = self.handle.block(block_fn, x, layer=self.layer, sigma=options.get("sigmas"), grid=ctx.grid,
                              per_token=per_token)
        return {"img": y}


def _diffusion_model_wrapper(handle: FeatureReuse, executor, *args, **kwargs):
    """Per forward: token grid of ``x`` ``[B, C, T, H, W]`` into a copy of ``transformer_options``."""
    x = args[0] if args else kwargs.get("x")
    where, options = None, None
    if isinstance(kwargs.get("transformer_options"), dict):
        where, options = "kw", kwargs["transformer_options"]
    elif len(args) > 5 and isinstance(args[5], dict):
        where, options = 5, args[5]
    time_dim_concat = args[4] if len(args) > 4 and not isinstance(args[4], dict) else kwargs.get("time_dim_concat")
    if (where is None or not isinstance(x, torch.Tensor) or x.dim() != 5 or time_dim_concat is not None
            or "reference_latent" in kwargs):
        return executor(*args, **kwargs)
    options = dict(options)
    options[FORWARD_KEY] = _Forward(latent_token_grid(x))
    if where == "kw":
        kwargs["transformer_options"] = options
    else:
        args = args[:5] + (options,) + args[6:]
    return executor(*args, **kwargs)


def _outer_sample_wrapper(handle: FeatureReuse, executor, *args, **kwargs):
    sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
    try:
        handle.begin_run(sigmas.detach().float().cpu() if isinstance(sigmas, torch.Tensor) else sigmas)
    except Exception as exc:  # noqa: BLE001 - never fail the prompt
        handle.plan.note(f"feature reuse could not start ({type(exc).__name__}: {exc}); blocks run in full")
        return executor(*args, **kwargs)
    try:
        return executor(*args, **kwargs)
    finally:
        handle.end_run()
        log.info("Chorus II %s", handle.state.summary())


def patch_feature_reuse(model, plan: Plan, config: FeatureReuseConfig):
    """Return ``(patched clone, FeatureReuse or None, message)``; the input model is not modified."""
    import comfy.model_patcher
    import comfy.patcher_extension

    patched = model.clone()
    info = comfy_model_info(patched)
    if not info.supported:
        return patched, None, f"not patched: {info.reason}"
    handle = FeatureReuse(plan, config, info)
    options = patched.model_options.setdefault("transformer_options", {})
    existing = options.get("patches_replace", {}).get("dit", {})
    for layer in range(info.num_layers):
        previous = existing.get(("double_block", layer))
        if isinstance(previous, FeatureReusePatch):
            previous = previous.previous  # re-patching replaces, never stacks
        comfy.model_patcher.set_model_options_patch_replace(
            patched.model_options, FeatureReusePatch(handle, layer, previous), "dit", "double_block", layer)
    for wrapper_type, fn in ((comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, _outer_sample_wrapper),
                             (comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, _diffusion_model_wrapper)):
        patched.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)
        patched.add_wrapper_with_key(wrapper_type, WRAPPER_KEY, functools.partial(fn, handle))
    return patched, handle, f"patched {info.num_layers} blocks of {info.variant}"


class ChorusFeatureReuse(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusFeatureReuse",
            display_name="Chorus Feature Reuse",
            category=CATEGORY,
            description="On a hit, the spatiotemporal regions the cache entry found most redundant run at a "
                        "2x2x2-downsampled resolution (a lightweight context that still takes part in attention "
                        "and the feed-forward; its update is upsampled back), the rest in full. On a miss, the "
                        "dense run records which regions were redundant, for the entry Chorus Cache Write "
                        "writes. Works before or after Chorus Sparse Sampler; for Wan 2.2 A14B patch both models.",
            inputs=[
                io.Model.Input("model", tooltip="The Wan model (after Chorus Sparse Sampler, or before it)."),
                ChorusPlan.Input("plan", tooltip="The plan from Chorus Mask Retrieve (the same one the sparse "
                                                  "sampler gets)."),
                io.Float.Input("downsample_share", default=0.25, min=0.0, max=1.0, step=0.01,
                               tooltip="Share of regions (2x8x8 tokens each) computed at reduced resolution on a "
                                       "hit; the first frame is never reduced. 0 = off. Higher is faster and "
                                       "drifts more; 0.25 is the safe default."),
            ],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, plan, downsample_share=0.25) -> io.NodeOutput:
        if not isinstance(plan, Plan):
            return io.NodeOutput(model, ui=ui_text(
                f"not patched: the plan input is not a Chorus plan ({type(plan).__name__})"))
        try:
            config = FeatureReuseConfig(downsample_share=float(downsample_share))
        except ValueError as exc:
            plan.note(f"feature reuse not patched: {exc}")
            return io.NodeOutput(model, ui=ui_text(f"not patched: {exc}"))
        patched, handle, message = patch_feature_reuse(model, plan, config)
        if handle is None:
            mode = "blocks run in full"
        elif plan.is_hit:
            fr = (plan.entry_meta or {}).get("feature_reuse")
            mode = (f"HIT: {config.downsample_share:.0%} of regions downsampled where the entry scored them"
                    if fr else "HIT, but the entry has no region scores: blocks run in full")
        else:
            mode = ("MISS: full blocks + recording region redundancy for the new entry (stored with the masks "
                    "Chorus Sparse Sampler records; without it no entry is written)")
        return io.NodeOutput(patched, ui=ui_text(f"{mode} | {message}"))
