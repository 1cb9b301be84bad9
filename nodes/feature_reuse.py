"""ChorusFeatureReuse: on a hit, redundant spatiotemporal regions run at a downsampled resolution.

Sets the feature-reuse part (:class:`chorus.engine.feature_reuse.FeatureReuse`, the method is
described there) of the model's one Chorus patch (:mod:`.comfy_patch`): every transformer block goes
through ``patches_replace["dit"][("double_block", i)]`` (a patch already at that key is chained; its
layer then runs in full on a hit). On a hit each forward's redundant regions are decided once on the
host side, and the block patch runs the block on the compact sequence (``img`` compacted, RoPE ``pe``
pooled to cell centres, Wan 2.2 TI2V 5B's per-frame modulation ``vec`` as each cell's share of tokens in each
frame times the frames' vectors, ``comfy_forward.compact_per_frame``) through the engine's custom ops, so a
compiled model keeps it one graph; the patch's one attention override hands its self-attention to the
engine, which runs it on the compact sequence (an entry in the region order) or expanded to the full grid,
so pooled keys carry the attention mass of the tokens they stand for and sparse masks apply as is. On a
miss the blocks run in full and region scores are recorded. Anything unexpected runs the block in full with
a note in the plan; never a failed prompt.
"""

from __future__ import annotations

from comfy_api.latest import io

from ..engine import Plan
from ..engine.feature_reuse import FeatureReuseConfig
from .comfy_patch import configure, describe, get_patch
from .common import CATEGORY, ChorusPlan, model_input_problem, number_input, search_aliases, ui_text


# where feature reuse measured slower than the same hit without it on an eager model and faster under
# TorchCompileModel (docs/BENCHMARK_LOG.md, the TI2V 5B section): eagerly the model's per-token modulation runs per
# compact token in every reduced block, which outweighs the tokens saved; compiled, the request is faster
PAYS_ONLY_COMPILED_ON = {
    "wan2.2-ti2v-5b": "on Wan 2.2 TI2V 5B it pays only under TorchCompileModel: 720p on an H100, 17.7 s against "
                      "19.2 s for the same compiled hit without it, but eagerly 23.6 against 23.3 s; leave this "
                      "node out of an eager 5B graph"}


def patch_feature_reuse(model, plan: Plan, config: FeatureReuseConfig):
    """Return ``(patched clone, FeatureReuse or None, message)``; the input model is not modified. The message
    says so where feature reuse pays on the model's variant only when compiled (:data:`PAYS_ONLY_COMPILED_ON`)."""
    patched, patch, info = configure(model, plan, feature_reuse=config)
    if not info.supported:
        return patched, None, f"not patched: {info.reason}"
    message = f"patched {info.num_layers} blocks of {info.variant}"
    if info.variant in PAYS_ONLY_COMPILED_ON:
        message += f" ({PAYS_ONLY_COMPILED_ON[info.variant]})"
    return patched, patch.feature_reuse, message


class ChorusFeatureReuse(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusFeatureReuse",
            display_name="Chorus Feature Reuse",
            category=CATEGORY,
            **search_aliases("downsample redundant regions", "speed up Wan"),
            description="On a hit, the spatiotemporal regions the cache entry found most redundant run at a "
                        "2x2x2-downsampled resolution (a lightweight context that still takes part in attention "
                        "and the feed-forward; its update is upsampled back), the rest in full. On a miss, the "
                        "dense run records which regions were redundant, for the entry Chorus Cache Write "
                        "writes. Works before or after Chorus Sparse Sampler; for Wan 2.2 A14B patch both models. "
                        "On Wan 2.2 TI2V 5B it pays only under TorchCompileModel (eagerly it measured slower than "
                        "the hit without it): there, use it with TorchCompileModel only.",
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
        problem = model_input_problem(model)
        if problem is not None:
            return io.NodeOutput(model, ui=ui_text(f"not patched: {problem}"))
        if not isinstance(plan, Plan):
            return io.NodeOutput(model, ui=ui_text(
                f"not patched: the plan input is not a Chorus plan ({type(plan).__name__})"))
        try:
            config = FeatureReuseConfig(downsample_share=number_input(downsample_share, "downsample_share"))
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
        elif plan.recorder is None:  # Chorus Mask Retrieve's miss that cannot be written (it says why)
            mode = f"MISS: full blocks, nothing recorded ({plan.message})"
        else:
            mode = ("MISS: full blocks + recording region redundancy for the new entry (stored with the masks "
                    "Chorus Sparse Sampler records; without it no entry is written)")
        return io.NodeOutput(patched, ui=ui_text(f"{mode} | {message} | {describe(get_patch(patched))}"))
