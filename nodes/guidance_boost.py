"""ChorusGuidanceBoost: reinforce text and image conditioning on the steps where reuse acted.

ComfyUI glue for :mod:`chorus.engine.guidance` (see there for the method). Installed on a clone of
the model:

- ``transformer_options[GUIDANCE_KEY]`` = the :class:`GuidanceBoost`: ChorusSparseSampler's override
  reads it on every self-attention call it handles and applies the first-frame logit bias inside
  the sparse kernel (or a biased dense call), whichever node comes first.
- an attention override (an override already set is chained, in either order with
  ChorusSparseSampler / ChorusFeatureReuse): every cross-attention call (k length != q length: text,
  and the CLIP image tokens of Wan 2.1 I2V) gets the gain ``1 + 0.2 * strength``; a self-attention
  call (q and k lengths = the latent's tokens) gets the first-frame bias as a dense SDPA call, unless
  a ChorusSparseSampler override is in the chain (then it applies the bias: never twice).
- a post-CFG function (``cfg_strength > 0``; an earlier one of ours is replaced, others kept): the
  CFG-style correction where the sampler's cfg > 1.
- keyed wrappers (key ``"chorus_ii_guidance"``): OUTER_SAMPLE hands the run's sigmas to the boost,
  DIFFUSION_MODEL puts the latent's token grid into a copy of ``transformer_options``.

All strengths 0 returns the model unpatched; a 0 leaves that part out.
"""

from __future__ import annotations

import functools
import logging

import torch
from comfy_api.latest import io

from ..engine import Plan
from ..engine.guidance import (CFG_GAIN_PER_STRENGTH, GAIN_PER_STRENGTH, IMAGE_GAIN_PER_STRENGTH, MAX_STRENGTH,
                               GuidanceBoost)
from ..engine.guidance import biased_dense_or_plain
from .comfy_adapter import GUIDANCE_KEY, _find_transformer_options, chain_has_chorus_attention, latent_token_grid
from .common import CATEGORY, ChorusPlan, ui_text

log = logging.getLogger("chorus.nodes")

WRAPPER_KEY = "chorus_ii_guidance"
FORWARD_KEY = "chorus_ii_guidance_grid"
OVERRIDE = "optimized_attention_override"


class _Grid(tuple):
    def __deepcopy__(self, memo):
        return self


class GuidanceOverride:
    """Attention override: boosted cross-attention, first-frame-biased self-attention (when no
    ChorusSparseSampler is in the chain to do it), everything else passed to ``previous``."""

    def __init__(self, boost: GuidanceBoost, previous=None):
        self.boost, self.previous = boost, previous

    def __deepcopy__(self, memo):
        return self

    def _call(self, func, args, kwargs):
        return self.previous(func, *args, **kwargs) if self.previous is not None else func(*args, **kwargs)

    def __call__(self, func, *args, **kwargs):
        if not (len(args) >= 3 and all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in args[:3])):
            return self._call(func, args, kwargs)
        q, k, v = args[:3]
        options = kwargs.get("transformer_options") or {}
        sigma = options.get("sigmas")
        if k.shape[1] != q.shape[1]:  # cross-attention
            out = self._call(func, args, kwargs)
            if sigma is not None and isinstance(out, torch.Tensor):
                return self.boost.cross_attention(out, sigma)
            return out
        grid = options.get(FORWARD_KEY)
        heads = kwargs.get("heads", args[3] if len(args) > 3 else None)
        if (self.boost.image_strength == 0.0 or grid is None or sigma is None or not heads
                or q.shape[1] != grid[0] * grid[1] * grid[2] or kwargs.get("mask") is not None
                or kwargs.get("skip_reshape") or kwargs.get("skip_output_reshape") or q.shape[2] % int(heads)
                or chain_has_chorus_attention(options.get(OVERRIDE))):
            return self._call(func, args, kwargs)
        bias = self.boost.first_frame_bias(sigma)
        if not bias:
            return self._call(func, args, kwargs)
        batch, length, width = q.shape
        heads = int(heads)
        q4, k4, v4 = (t.view(batch, length, heads, width // heads).transpose(1, 2) for t in (q, k, v))

        def plain(*_):
            return self._call(func, args, kwargs).view(batch, length, heads, width // heads).transpose(1, 2)

        out = biased_dense_or_plain(plain, grid[1] * grid[2], bias, self._note)(q4, k4, v4)
        return out.transpose(1, 2).reshape(batch, length, width)

    def _note(self, message: str) -> None:
        if self.boost.plan is not None:
            self.boost.plan.note(message)
        elif not getattr(self, "_warned", False):
            self._warned = True
            log.warning("Chorus II guidance: %s", message)


class CfgCorrection:
    """ComfyUI post-CFG function applying :meth:`GuidanceBoost.cfg_correction` (never raises)."""

    def __init__(self, boost: GuidanceBoost):
        self.boost = boost

    def __deepcopy__(self, memo):
        return self

    def __call__(self, args):
        denoised = args["denoised"]
        try:
            return self.boost.cfg_correction(denoised, args.get("cond_denoised"), args.get("uncond_denoised"),
                                             args.get("cond_scale"), args.get("sigma"))
        except Exception:  # noqa: BLE001 - guidance must never fail a prompt
            return denoised


def _outer_sample_wrapper(boost: GuidanceBoost, executor, *args, **kwargs):
    sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
    try:
        boost.sample_sigmas = [float(s) for s in sigmas.detach().float().cpu().tolist()] \
            if isinstance(sigmas, torch.Tensor) else None
    except Exception:  # noqa: BLE001
        boost.sample_sigmas = None
    try:
        return executor(*args, **kwargs)
    finally:
        boost.sample_sigmas = None


def _diffusion_model_wrapper(executor, *args, **kwargs):
    """Per forward: the latent's token grid into a copy of ``transformer_options``."""
    where, options = _find_transformer_options(args, kwargs)
    grid = latent_token_grid(args[0] if args else kwargs.get("x"))
    if where is None or grid is None:
        return executor(*args, **kwargs)
    options = dict(options)
    options[FORWARD_KEY] = _Grid(grid)
    if where == "kw":
        kwargs["transformer_options"] = options
    else:
        args = args[:where] + (options,) + args[where + 1:]
    return executor(*args, **kwargs)


def patch_guidance(model, plan: Plan | None, strength: float, image_strength: float, cfg_strength: float = 0.0):
    """Return ``(patched clone, or the model itself when all strengths are 0; GuidanceBoost or None;
    message)``. Raises ``ValueError`` for a strength outside [0, MAX_STRENGTH]."""
    boost = GuidanceBoost(plan, strength, image_strength, cfg_strength)
    if boost.is_off:
        return model, None, "strengths 0: model unchanged"
    import comfy.patcher_extension

    patched = model.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    previous = options.get(OVERRIDE)
    if isinstance(previous, GuidanceOverride):
        previous = previous.previous  # re-patching replaces, never stacks
    options[OVERRIDE] = GuidanceOverride(boost, previous)
    options[GUIDANCE_KEY] = boost
    post_cfg = [fn for fn in patched.model_options.get("sampler_post_cfg_function", [])
                if not isinstance(fn, CfgCorrection)]  # re-patching replaces, never stacks
    if boost.cfg_strength:
        post_cfg.append(CfgCorrection(boost))
    patched.model_options["sampler_post_cfg_function"] = post_cfg
    for wrapper_type, fn in ((comfy.patcher_extension.WrappersMP.OUTER_SAMPLE,
                              functools.partial(_outer_sample_wrapper, boost)),
                             (comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, _diffusion_model_wrapper)):
        patched.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)
        patched.add_wrapper_with_key(wrapper_type, WRAPPER_KEY, fn)
    parts = []
    if boost.strength:
        parts.append(f"cross-attention gain {boost.gain:.2f}")
    if boost.image_strength:
        parts.append(f"first-frame attention weight x{1 + IMAGE_GAIN_PER_STRENGTH * boost.image_strength:.2f}")
    if boost.cfg_strength:
        parts.append(f"cfg x{1 + CFG_GAIN_PER_STRENGTH * boost.cfg_strength:.2f} where cfg > 1")
    return patched, boost, ", ".join(parts)


class ChorusGuidanceBoost(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusGuidanceBoost",
            display_name="Chorus Guidance Boost",
            category=CATEGORY,
            description="Reinforces the conditioning on the steps where reuse acted (the steps of a cache hit), "
                        "against semantic drift and identity loss: the text through a gain of "
                        f"1 + {GAIN_PER_STRENGTH} x strength on the cross-attention output (Wan 2.1: also its "
                        "CLIP image tokens), the start image (the first latent frame) through a self-attention "
                        f"bias that multiplies the first frame's attention weights by 1 + {IMAGE_GAIN_PER_STRENGTH}"
                        " x image_strength, and optionally (cfg > 1 graphs) the CFG scale by 1 + "
                        f"{CFG_GAIN_PER_STRENGTH} x cfg_strength. On a miss it does nothing; without a plan it "
                        "acts on every step.",
            inputs=[
                io.Model.Input("model", tooltip="The Wan model (before or after the other Chorus nodes)."),
                ChorusPlan.Input("plan", optional=True,
                                 tooltip="The plan from Chorus Mask Retrieve: the boost acts only on a hit's steps. "
                                         "Without a plan every step is boosted."),
                io.Float.Input("strength", default=0.5, min=0.0, max=MAX_STRENGTH, step=0.05,
                               tooltip=f"Text: cross-attention gain 1 + {GAIN_PER_STRENGTH} x strength where "
                                       "reuse acted. 0 = off."),
                io.Float.Input("image_strength", default=0.5, min=0.0, max=MAX_STRENGTH, step=0.05,
                               tooltip="Start image: the first latent frame's self-attention weights are "
                                       f"multiplied by 1 + {IMAGE_GAIN_PER_STRENGTH} x image_strength (then "
                                       "renormalised) where reuse acted. 0 = off."),
                io.Float.Input("cfg_strength", default=0.0, min=0.0, max=MAX_STRENGTH, step=0.05,
                               tooltip="Only for graphs sampled with cfg > 1: where reuse acted the step runs at "
                                       f"cfg x (1 + {CFG_GAIN_PER_STRENGTH} x cfg_strength). 0 = off (the default: "
                                       "cfg is already a strong text guidance). All three 0 leave the model "
                                       "unchanged (bit-identical)."),
            ],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, plan=None, strength=0.5, image_strength=0.5, cfg_strength=0.0) -> io.NodeOutput:
        if plan is not None and not isinstance(plan, Plan):
            return io.NodeOutput(model, ui=ui_text(
                f"not patched: the plan input is not a Chorus plan ({type(plan).__name__})"))
        try:
            patched, boost, message = patch_guidance(model, plan, float(strength), float(image_strength),
                                                     float(cfg_strength))
        except (TypeError, ValueError) as exc:
            return io.NodeOutput(model, ui=ui_text(f"not patched: {exc}"))
        if boost is None:
            mode = "off"
        elif plan is None:
            mode = "every step (no plan)"
        elif plan.is_hit:
            mode = "HIT: boost on the reused steps"
        else:
            mode = "MISS: no reuse, no boost"
        return io.NodeOutput(patched, ui=ui_text(f"{mode} | {message}"))
