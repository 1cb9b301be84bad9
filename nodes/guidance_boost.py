"""ChorusGuidanceBoost: reinforce image/text conditioning where reuse acted (not active yet: passes through)."""

from __future__ import annotations

from comfy_api.latest import io

from .common import CATEGORY, ChorusPlan, ui_text

NOT_ACTIVE = "Chorus guidance boost is not active yet in this version: the model passes through unchanged."


class ChorusGuidanceBoost(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusGuidanceBoost",
            display_name="Chorus Guidance Boost",
            category=CATEGORY,
            description="Reinforces image and text conditioning on the steps where reuse acted, against drift "
                        "and identity loss. " + NOT_ACTIVE,
            inputs=[
                io.Model.Input("model", tooltip="The Wan model."),
                ChorusPlan.Input("plan", optional=True, tooltip="The plan from Chorus Mask Retrieve (optional)."),
                io.Float.Input("strength", default=0.5, min=0.0, max=5.0, step=0.05,
                               tooltip="Strength of the reinforcement; 0 leaves the model unchanged."),
            ],
            outputs=[io.Model.Output("model", display_name="model")],
        )

    @classmethod
    def execute(cls, model, plan=None, strength=0.5) -> io.NodeOutput:
        return io.NodeOutput(model, ui=ui_text(NOT_ACTIVE))
