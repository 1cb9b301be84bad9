"""ChorusSparseSampler: patch a Wan MODEL so its self-attention follows a CHORUS_PLAN.

Sets the sparse part (``ChorusAttention``) of the model's one Chorus patch (:mod:`.comfy_patch`).
"""

from __future__ import annotations

from comfy_api.latest import io

from ..engine import BACKENDS, Plan, SparseConfig
from ..engine.config import DEFAULT_VERIFY_THRESHOLD
from ..engine.plan import entry_text
from ..kernels import has_pooled_tail
from .comfy_patch import configure, describe, get_patch
from .common import (CATEGORY, EXPERT_INPUT, ChorusPlan, boolean_input, model_input_problem, number_input,
                     search_aliases, ui_text)


def patch_model(model, plan: Plan, config: SparseConfig):
    """Return ``(patched clone, ChorusAttention or None, message)``; the input model is not modified.

    An unsupported model comes back as a clone without the sparse part, with a message saying why.
    """
    patched, patch, info = configure(model, plan, sparse=config)
    if not info.supported:
        plan.note(f"unsupported model: {info.reason}; this model runs dense attention")
        return patched, None, f"not patched: {info.reason}"
    return patched, patch.attention, f"patched {info.variant} ({info.num_layers} layers, {info.num_heads} heads)"


class ChorusSparseSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusSparseSampler",
            display_name="Chorus Sparse Sampler",
            category=CATEGORY,
            **search_aliases("sparse attention", "block-sparse attention", "speed up Wan"),
            description="Hit: block-sparse self-attention with the reused masks (+ safety fallback). Miss: dense "
                        "attention while recording block attention mass for a new cache entry. For Wan 2.2 "
                        "A14B patch BOTH models with the same plan.",
            inputs=[
                io.Model.Input("model", tooltip="A Wan 2.1 I2V, Wan 2.2 TI2V 5B or Wan 2.2 A14B (high or low) model."),
                ChorusPlan.Input("plan", tooltip="The plan from Chorus Mask Retrieve."),
                io.Float.Input("top_p", default=0.9, min=0.01, max=1.0, step=0.01,
                               tooltip="On a miss: share of attention mass each query block keeps when the "
                                       "recorded mass becomes the stored mask (higher = denser, safer). From 0.95 "
                                       "the auto backend runs the accurate 8-bit kernel on hits."),
                io.Int.Input("k_min", default=4, min=1, max=4096, **EXPERT_INPUT,
                             tooltip="Safety floor: at least this many key blocks per query block in a reused mask."),
                io.Int.Input("refresh_steps", default=0, min=0, max=1000, **EXPERT_INPUT,
                             tooltip="Visit refresh: 0 = off; R > 0 = every block pair a reused mask skips is "
                                     "still computed at least once every R steps."),
                io.Combo.Input("backend", options=list(BACKENDS), default="auto", **EXPERT_INPUT,
                               tooltip="Sparse attention kernel. auto: the fastest for this GPU (the "
                                       "warp-specialised FP8 kernel on Hopper), or the accurate 8-bit kernel when "
                                       "top_p >= 0.95. A kernel never hands a call to another once chosen: a call it "
                                       "cannot take, or that fails, runs dense attention with a message. Each "
                                       "kernel: docs/NODES.md."),
                io.Float.Input("verify_threshold", default=DEFAULT_VERIFY_THRESHOLD, min=0.0, max=1.0, step=0.01,
                               optional=True, **EXPERT_INPUT,
                               tooltip="Self-verifying hits: at each expert's first step the fit of the reused "
                                       "masks to this request is estimated (a ratio, ~1 = they fit); below this "
                                       "value the rest of the request runs dense and records a new entry. 0 = off "
                                       "(the default); 0.95 to turn it on. Details: docs/NODES.md."),
                io.Boolean.Input("pooled_tail", default=True, optional=True, **EXPERT_INPUT,
                                 tooltip="On a hit, every key block the mask skips still enters the softmax as one "
                                         "pooled term (its mean key and value): closer to dense attention, and "
                                         "safer when a reused mask misses blocks this request needs; a few % of "
                                         "the kernel's time. The flex and fa4_bf16 backends have none: with them "
                                         "it is off."),
            ],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, plan, top_p=0.9, k_min=4, refresh_steps=0, backend="auto",
                verify_threshold=DEFAULT_VERIFY_THRESHOLD, pooled_tail=True) -> io.NodeOutput:
        problem = model_input_problem(model)
        if problem is not None:
            return io.NodeOutput(model, ui=ui_text(f"not patched: {problem}"))
        if not isinstance(plan, Plan):
            msg = f"not patched: the plan input is not a Chorus plan ({type(plan).__name__}); dense attention"
            return io.NodeOutput(model, ui=ui_text(msg))
        try:
            tail = boolean_input(pooled_tail, "pooled_tail")
            tail_note = ""
            if tail and str(backend) in BACKENDS and not has_pooled_tail(str(backend)):
                tail, tail_note = False, f", pooled tail off ({backend} has none)"
            config = SparseConfig(top_p=number_input(top_p, "top_p"), k_min=number_input(k_min, "k_min", integer=True),
                                  refresh_steps=number_input(refresh_steps, "refresh_steps", integer=True),
                                  backend=str(backend), pooled_tail=tail,
                                  verify_threshold=number_input(DEFAULT_VERIFY_THRESHOLD if verify_threshold is None
                                                                else verify_threshold, "verify_threshold"))
        except ValueError as exc:
            msg = f"not patched: {exc}; dense attention"
            plan.note(msg)
            return io.NodeOutput(model, ui=ui_text(msg))
        patched, attention, message = patch_model(model, plan, config)
        mismatch = plan.mismatch(attention.model_info) if attention is not None else None
        if mismatch is not None:  # the sampler run decides: another candidate made for the model, or dense
            mode = (f"HIT on entry {plan.entry_id}, but {mismatch}: at sampling it moves to a candidate made for "
                    "this model, or runs dense attention + recording")
        elif plan.is_hit:
            mode = f"HIT: sparse attention with {entry_text(plan.entry_id, plan.similarity)}"
            mode += ", pooled tail on" if config.pooled_tail else (tail_note or ", pooled tail off")
        elif plan.demoted_reason:
            mode = f"MISS ({plan.demoted_reason}): dense attention + recording"
        elif plan.recorder is None:  # Chorus Mask Retrieve's miss that cannot be written (it says why)
            mode = f"MISS: dense attention, nothing recorded ({plan.message})"
        else:
            mode = "MISS: dense attention + recording"
        if attention is None:
            mode = "dense attention"
        verify = ""
        if plan.is_hit and attention is not None:
            verify = (f"verification: fit ratio (estimated recall / best recall at the same density) >= "
                      f"{config.verify_threshold:g} at each expert's first step (layers {list(config.verify_layers)}, "
                      f"{config.verify_heads} heads, {config.verify_rows} rows per block; recall and ratio are in "
                      "the plan stats)" if config.verify_threshold > 0
                      else "verification off")
        return io.NodeOutput(patched, ui=ui_text(f"{mode} | {message} | {describe(get_patch(patched))}", verify))
