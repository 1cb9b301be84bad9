"""ChorusFeatureReuse: downsampled computation of redundant regions (not active yet: passes through)."""

from __future__ import annotations

from comfy_api.latest import io

from .common import CATEGORY, ChorusPlan, ui_text

NOT_ACTIVE = "Chorus feature reuse is not active yet in this version: the model passes through unchanged."


class ChorusFeatureReuse(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusFeatureReuse",
            display_name="Chorus Feature Reuse",
            category=CATEGORY,
            description="Computes highly redundant spatiotemporal regions at a downsampled resolution on a hit. "
                        + NOT_ACTIVE,
            inputs=[
                io.Model.Input("model", tooltip="The Wan model (after Chorus Sparse Sampler, or before it)."),
                ChorusPlan.Input("plan", tooltip="The plan from Chorus Mask Retrieve."),
                io.Float.Input("downsample_share", default=0.25, min=0.0, max=1.0, step=0.01,
                               tooltip="Share of regions computed at reduced resolution on a hit."),
            ],
            outputs=[io.Model.Output("model", display_name="model")],
        )

    @classmethod
    def execute(cls, model, plan, downsample_share=0.25) -> io.NodeOutput:
        return io.NodeOutput(model, ui=ui_text(NOT_ACTIVE))
