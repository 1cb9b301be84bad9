"""ChorusGuidanceBoost: reinforce text and image conditioning on the steps where reuse acted.

Sets the guidance part (:class:`chorus.engine.guidance.GuidanceBoost`, the method is described there)
of the model's one Chorus patch (:mod:`.comfy_patch`), in either order with ChorusSparseSampler /
ChorusFeatureReuse: the patch's attention override multiplies every cross-attention output (k length
!= q length: text, and the CLIP image tokens of Wan 2.1 I2V) by ``1 + 0.2 * strength`` and adds the
first-frame logit bias to self-attention exactly once — inside the sparse kernel or the engine's dense
call when the sparse sampler is on the model, else as a biased dense SDPA call; with
``cfg_strength > 0`` a post-CFG function applies the CFG-style correction where the sampler's cfg > 1.

All strengths 0 returns the model unpatched (or removes the guidance part a model already has).
"""

from __future__ import annotations

from comfy_api.latest import io

from ..engine import Plan
from ..engine.guidance import (CFG_GAIN_PER_STRENGTH, GAIN_PER_STRENGTH, IMAGE_GAIN_PER_STRENGTH, MAX_STRENGTH,
                               GuidanceBoost)
from .comfy_patch import configure, describe, get_patch
from .common import CATEGORY, EXPERT_INPUT, ChorusPlan, model_input_problem, number_input, search_aliases, ui_text


def patch_guidance(model, plan: Plan | None, strength: float, image_strength: float, cfg_strength: float = 0.0):
    """Return ``(patched clone, or the model itself when all strengths are 0 and it has no Chorus
    guidance; GuidanceBoost or None; message)``. Raises ``ValueError`` for a strength outside
    [0, MAX_STRENGTH]."""
    boost = GuidanceBoost(plan, strength, image_strength, cfg_strength)
    if boost.is_off:
        existing = get_patch(model)
        if existing is None or existing.guidance is None:
            return model, None, "strengths 0: model unchanged"
        patched, _, _ = configure(model, None, guidance=None)
        return patched, None, "strengths 0: the guidance the model had is removed"
    patched, patch, info = configure(model, plan, guidance=boost)
    if patch is None or patch.guidance is None:
        if plan is not None:
            plan.note(f"guidance not applied: {info.reason}")
        return patched, None, f"not patched: {info.reason}"
    parts = []
    if boost.strength:
        parts.append(f"cross-attention gain {boost.gain:.2f}")
    if boost.image_strength:
        parts.append(f"image-frame attention weight x{1 + IMAGE_GAIN_PER_STRENGTH * boost.image_strength:.2f}")
    if boost.cfg_strength:
        parts.append(f"cfg x{1 + CFG_GAIN_PER_STRENGTH * boost.cfg_strength:.2f} where cfg > 1")
    return patched, patch.guidance, ", ".join(parts)


class ChorusGuidanceBoost(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusGuidanceBoost",
            display_name="Chorus Guidance Boost",
            category=CATEGORY,
            **search_aliases("guidance enhancement", "reinforce conditioning"),
            description="Reinforces the conditioning on the steps where reuse acted (the steps of a cache hit), "
                        "against semantic drift and identity loss: the text through a gain of "
                        f"1 + {GAIN_PER_STRENGTH} x strength on the cross-attention output (Wan 2.1: also its "
                        "CLIP image tokens), the start image (the first latent frame) through a self-attention "
                        f"bias that multiplies the first frame's attention weights by 1 + {IMAGE_GAIN_PER_STRENGTH}"
                        " x image_strength (and the last frame's, for a first-last-frame video), and optionally "
                        "(cfg > 1 graphs) the CFG scale by 1 + "
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
                                       "renormalised) where reuse acted; for a first-last-frame video the last "
                                       "frame's (the end image) too. 0 = off."),
                io.Float.Input("cfg_strength", default=0.0, min=0.0, max=MAX_STRENGTH, step=0.05, **EXPERT_INPUT,
                               tooltip="Only for graphs sampled with cfg > 1: where reuse acted the step runs at "
                                       f"cfg x (1 + {CFG_GAIN_PER_STRENGTH} x cfg_strength). 0 = off (the default: "
                                       "cfg is already a strong text guidance). All three 0 leave the model "
                                       "unchanged (bit-identical)."),
            ],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, plan=None, strength=0.5, image_strength=0.5, cfg_strength=0.0) -> io.NodeOutput:
        problem = model_input_problem(model)
        if problem is not None:
            return io.NodeOutput(model, ui=ui_text(f"not patched: {problem}"))
        if plan is not None and not isinstance(plan, Plan):
            return io.NodeOutput(model, ui=ui_text(
                f"not patched: the plan input is not a Chorus plan ({type(plan).__name__})"))
        try:
            patched, boost, message = patch_guidance(model, plan, number_input(strength, "strength"),
                                                     number_input(image_strength, "image_strength"),
                                                     number_input(cfg_strength, "cfg_strength"))
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
        return io.NodeOutput(patched, ui=ui_text(f"{mode} | {message} | {describe(get_patch(patched))}"))
