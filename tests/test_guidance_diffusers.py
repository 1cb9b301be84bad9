"""ChorusGuidanceBoost's corrections in a diffusers ``WanTransformer3DModel`` (tiny, random weights, CPU):
the text gain equals scaling the attention result before ``attn2.to_out``; the first-frame bias (and a
first-last-frame request's last-frame bias) is applied once whether the guidance patch comes before or after
``patch_diffusers_wan`` or alone;
strength 0 and removal leave the model unchanged."""

from __future__ import annotations

import math

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from chorus.engine import ChorusAttention, Plan, SparseConfig, build_signature, wan_model_info  # noqa: E402
from chorus.hosts.diffusers import patch_diffusers_guidance, patch_diffusers_wan  # noqa: E402
from chorus.engine.guidance import IMAGE_GAIN_PER_STRENGTH, GuidanceBoost  # noqa: E402
from testing import tiny_diffusers_wan  # noqa: E402

BS = 32
SHAPE = (1, 36, 5, 16, 16)   # token grid (5, 8, 8) = 320 tokens, first frame 64 tokens
SIGMAS = (0.8, 0.4)
CFG = SparseConfig(top_p=0.9, k_min=1, block_size=BS, sample_rows=None, backend="reference")


def tiny_transformer():
    model = tiny_diffusers_wan(num_layers=3)
    with torch.no_grad():  # self-attention gate near 1 (random init leaves it near 0), so attention matters
        for block in model.blocks:
            block.scale_shift_table[:, 2].add_(1.0)
            block.attn2.to_out[0].bias.normal_()  # a non-zero output bias: the gain must not scale it
    return model.eval()


def inputs(sigma, end_image=False):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(SHAPE, generator=g) * 2
    if end_image:  # the I2V mask channels of a start and an end image (the pipeline's last_image)
        hidden[:, 16:20] = 0.0
        hidden[:, 16:20, 0] = 1.0
        hidden[:, 19, -1] = 1.0
    return dict(hidden_states=hidden, timestep=torch.tensor([sigma * 1000.0]),
                encoder_hidden_states=torch.randn(1, 8, 64, generator=g), return_dict=False)


def forward(model, end_image=False):
    with torch.no_grad():
        return [model(**inputs(s, end_image))[0] for s in SIGMAS]


def test_text_gain_scales_the_attention_result_before_the_output_projection():
    model = tiny_transformer()
    plain = forward(model)
    boost = GuidanceBoost(None, strength=1.0, image_strength=0.0)
    patch = patch_diffusers_guidance(model, boost)
    got = forward(model)
    patch.remove()
    hooks = [b.attn2.to_out[0].register_forward_pre_hook(lambda m, a: (a[0] * boost.gain,)) for b in model.blocks]
    want = forward(model)
    for h in hooks:
        h.remove()
    for g, w, p in zip(got, want, plain):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert (g - p).abs().max() > 1e-3
    assert boost.boosted_calls == 2 * 3
    assert all(torch.equal(a, b) for a, b in zip(forward(model), plain))  # removed


def _hit_plan(model, end_image=False):
    """A hit with every block kept, for the two sigmas (sparse attention = dense, through the engine)."""
    miss = Plan.miss("m", latent_shape=SHAPE)
    handle = ChorusAttention(miss, CFG, wan_model_info(model))
    patch = patch_diffusers_wan(model, handle)
    handle.begin_run(list(SIGMAS) + [0.0])
    forward(model, end_image)
    handle.end_run()
    patch.remove()
    masks = {k: torch.ones_like(v) for k, v in miss.recorder.block_maps().items()}
    return Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": build_signature(miss)})


@pytest.mark.parametrize("order", ["guidance_only", "sparse_then_guidance", "guidance_then_sparse"])
def test_first_frame_bias_applied_once_in_any_order(order):
    model = tiny_transformer()
    plan = _hit_plan(model)
    plain = forward(model)
    boost = GuidanceBoost(plan, strength=0.0, image_strength=2.0)
    handle = ChorusAttention(plan, CFG, wan_model_info(model))
    patches = []
    for step in {"guidance_only": ["g"], "sparse_then_guidance": ["s", "g"], "guidance_then_sparse": ["g", "s"]}[order]:
        patches.append(patch_diffusers_guidance(model, boost) if step == "g" else patch_diffusers_wan(model, handle))
    handle.begin_run(list(SIGMAS) + [0.0])
    got = forward(model)
    handle.end_run()
    for p in reversed(patches):
        p.remove()
    assert boost.biased_calls == 2 * 3
    if order != "guidance_only":
        assert plan.stats.sparse_calls == 2 * 3 and plan.stats.fallback_calls == 0
    assert all(boost.first_frame_bias(s) == pytest.approx(math.log1p(IMAGE_GAIN_PER_STRENGTH * 2.0)) for s in SIGMAS)
    # the reference, from the other implementation of the bias: for the sparse orders guidance alone (its biased
    # dense call), for guidance alone the engine's kernel taking the bias (the sparse part on the same full maps)
    ref_boost = GuidanceBoost(plan, strength=0.0, image_strength=2.0)
    refs = [patch_diffusers_guidance(model, ref_boost)]
    ref_handle = ChorusAttention(plan, CFG, wan_model_info(model))
    if order == "guidance_only":
        refs.append(patch_diffusers_wan(model, ref_handle))
    ref_handle.begin_run(list(SIGMAS) + [0.0])
    want = forward(model)
    ref_handle.end_run()
    for p in reversed(refs):
        p.remove()
    if order == "guidance_only":
        assert plan.stats.sparse_calls == 2 * 3 and plan.stats.fallback_calls == 0  # the reference ran sparse
    for g, w, p in zip(got, want, plain):
        change = float((w - p).norm() / p.norm())
        assert change > 1e-3, change
        assert float((g - w).norm() / p.norm()) < 0.01 * change
    assert all(torch.equal(a, b) for a, b in zip(forward(model), plain))  # everything removed


def test_an_end_image_is_biased_as_the_start_image_sparse_and_dense(monkeypatch):
    """A request with a start and an end image (``last_image``): the last frame's keys get the first frame's bias,
    in the sparse processor (the plan tells the end image) and in guidance's own dense call (the forward tells it)
    alike; both differ from biasing the start image alone."""
    model = tiny_transformer()

    def run(sparse):
        plan = _hit_plan(model, end_image=True)
        assert plan.entry_meta["signature"]["image_frames"] == [1, 1, 0]
        patches = [patch_diffusers_guidance(model, GuidanceBoost(plan, strength=0.0, image_strength=2.0))]
        handle = ChorusAttention(plan, CFG, wan_model_info(model))
        if sparse:
            patches.append(patch_diffusers_wan(model, handle))
        handle.begin_run(list(SIGMAS) + [0.0])
        out = forward(model, end_image=True)
        handle.end_run()
        for p in reversed(patches):
            p.remove()
        assert plan.stats.sparse_calls == (2 * 3 if sparse else 0) and plan.stats.fallback_calls == 0
        return out

    sparse, dense = run(True), run(False)
    monkeypatch.setattr(GuidanceBoost, "last_frame_bias", lambda self, sigma, image_frames=None: 0.0)
    start_only = run(False)
    for s, d, f in zip(sparse, dense, start_only):
        effect = float((d - f).norm() / f.norm())
        assert effect > 1e-3 and float((s - d).norm() / f.norm()) < 0.01 * effect, effect


def test_strength_zero_and_a_miss_leave_the_outputs_bit_identical():
    model = tiny_transformer()
    plain = forward(model)
    patch = patch_diffusers_guidance(model, GuidanceBoost(None, 0.0, 0.0))
    assert all(torch.equal(a, b) for a, b in zip(forward(model), plain))
    patch.remove()
    patch = patch_diffusers_guidance(model, GuidanceBoost(Plan.miss("m"), 2.0, 2.0))
    assert all(torch.equal(a, b) for a, b in zip(forward(model), plain))
    patch.remove()
    with pytest.raises(ValueError, match="GuidanceBoost"):
        patch_diffusers_guidance(model, 0.5)
    with pytest.raises(ValueError, match="not a diffusers"):
        patch_diffusers_guidance(torch.nn.Linear(2, 2), GuidanceBoost(None))
