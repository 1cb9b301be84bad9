"""ChorusGuidanceBoost: reinforce text/image conditioning on the steps where reuse acted.

ComfyUI glue for :mod:`chorus.engine.guidance`: an attention override (an override already set is
chained, in either order with ChorusSparseSampler / ChorusFeatureReuse) that multiplies the output of
every cross-attention call (k length != q length: text, and the CLIP image tokens of Wan 2.1 I2V) by
``1 + 0.2 * strength`` in the model calls whose step is one where reuse acted (see the engine
module). Self-attention passes through untouched. ``strength = 0`` returns the model unpatched.
"""

from __future__ import annotations

import functools

import torch
from comfy_api.latest import io

from ..engine import Plan
from ..engine.guidance import GAIN_PER_STRENGTH, MAX_STRENGTH, GuidanceBoost
from .common import CATEGORY, ChorusPlan, ui_text

WRAPPER_KEY = "chorus_ii_guidance"
OVERRIDE = "optimized_attention_override"


class GuidanceOverride:
    """Attention override: boosted cross-attention output, everything else passed to ``previous``."""

    def __init__(self, boost: GuidanceBoost, previous=None):
        self.boost, self.previous = boost, previous

    def __deepcopy__(self, memo):
        return self

    def __call__(self, func, *args, **kwargs):
        out = self.previous(func, *args, **kwargs) if self.previous is not None else func(*args, **kwargs)
        if len(args) >= 2 and isinstance(args[0], torch.Tensor) and isinstance(args[1], torch.Tensor) \
                and args[0].dim() == 3 and args[1].dim() == 3 and args[1].shape[1] != args[0].shape[1]:
            options = kwargs.get("transformer_options") or {}
            sigma = options.get("sigmas")
            if sigma is not None and isinstance(out, torch.Tensor):
                return self.boost.cross_attention(out, sigma)
        return out


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


def patch_guidance(model, plan: Plan | None, strength: float):
    """Return ``(patched clone or the model itself when strength is 0, GuidanceBoost or None, message)``.
    Raises ``ValueError`` for a strength outside [0, MAX_STRENGTH]."""
    boost = GuidanceBoost(plan, strength)
    if boost.strength == 0.0:
        return model, None, "strength 0: model unchanged"
    import comfy.patcher_extension

    patched = model.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    previous = options.get(OVERRIDE)
    if isinstance(previous, GuidanceOverride):
        previous = previous.previous  # re-patching replaces, never stacks
    options[OVERRIDE] = GuidanceOverride(boost, previous)
    patched.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY,
                                 functools.partial(_outer_sample_wrapper, boost))
    return patched, boost, f"cross-attention gain {boost.gain:.2f}"


class ChorusGuidanceBoost(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusGuidanceBoost",
            display_name="Chorus Guidance Boost",
            category=CATEGORY,
            description="Reinforces the text (and Wan 2.1 CLIP image) conditioning on the steps where reuse acted "
                        "(the steps of a cache hit), against semantic drift and identity loss: a gain of "
                        f"1 + {GAIN_PER_STRENGTH} x strength on the cross-attention output. On a miss it does "
                        "nothing; without a plan it acts on every step.",
            inputs=[
                io.Model.Input("model", tooltip="The Wan model (before or after the other Chorus nodes)."),
                ChorusPlan.Input("plan", optional=True,
                                 tooltip="The plan from Chorus Mask Retrieve: the boost acts only on a hit's steps. "
                                         "Without a plan every step is boosted."),
                io.Float.Input("strength", default=0.5, min=0.0, max=MAX_STRENGTH, step=0.05,
                               tooltip=f"Cross-attention gain 1 + {GAIN_PER_STRENGTH} x strength where reuse "
                                       "acted; 0 leaves the model unchanged (bit-identical)."),
            ],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, plan=None, strength=0.5) -> io.NodeOutput:
        if plan is not None and not isinstance(plan, Plan):
            return io.NodeOutput(model, ui=ui_text(
                f"not patched: the plan input is not a Chorus plan ({type(plan).__name__})"))
        try:
            patched, boost, message = patch_guidance(model, plan, float(strength))
        except ValueError as exc:
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
