"""ChorusCacheWrite: after sampling, write a miss's recorded masks as an entry, or count a hit."""

from __future__ import annotations

from comfy_api.latest import io

from ..engine import Plan, commit_plan
from .common import CATEGORY, ChorusPlan, node_text, open_workspace, search_aliases, ui_text


class ChorusCacheWrite(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusCacheWrite",
            display_name="Chorus Cache Write",
            category=CATEGORY,
            **search_aliases("save attention masks", "mask cache write"),
            description="Runs after sampling (connect the sampled latent). Miss: commits the recorded masks, "
                        "embedding and metadata as a new cache entry. Hit: updates the entry's hit statistics "
                        "(hits, and the hit's sparse attention calls, those with the pooled tail, dense fallbacks).",
            inputs=[
                io.Latent.Input("latent", tooltip="The SAMPLED latent (makes this node run after the sampler)."),
                ChorusPlan.Input("plan", tooltip="The plan from Chorus Mask Retrieve (the same one the sampler used)."),
            ],
            outputs=[io.String.Output("info", display_name="info")],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")  # writes to the cache on disk: run every time

    @classmethod
    def execute(cls, latent, plan) -> io.NodeOutput:
        if not isinstance(plan, Plan):
            info = f"not written: the plan input is not a Chorus plan ({type(plan).__name__})"
            return io.NodeOutput(info, ui=ui_text(info))
        if plan.workspace_name is None:  # Chorus Mask Retrieve's miss that cannot be written: its reason
            info = f"not written: {plan.message}"
        else:
            try:
                info = commit_plan(open_workspace(plan.workspace_name), plan)
            except (ValueError, OSError) as exc:
                info = f"not written: workspace {plan.workspace_name!r} unusable ({exc})"
        stats = plan.stats.summary()
        notes = "; ".join(plan.stats.messages[:5])
        text = node_text(f"{info} | {stats}" + (f" | notes: {notes}" if notes else ""))
        return io.NodeOutput(text, ui=ui_text(text))
