"""One Chorus patch per model (``nodes/comfy_patch.py``), through the three nodes' ``execute`` on
ComfyUI's tiny ``WanModel`` (CPU, random weights).

Covers: the three nodes in every order give one ``ChorusPatch`` under one key with one override, one
wrapper of each kind, one block patch per block and one post-CFG function; re-patching replaces a part
and keeps hooks of other packs chained; strength 0 removes guidance;
per forward the token grid is computed once and every part gets the sigma as a float; an
older Chorus patch left inside another pack's override chain passes through (nothing is recorded
twice); the A14B pair gets two patches sharing one plan; a node with another plan moves every part
to it; a block patch that never runs its block (ComfyUI's Skip Layer Guidance) is told from its code
and the layer count passes over its layer.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch

from host import tiny_wan as tiny  # tests/host (pytest pythonpath)

SKIP_REASON = tiny.import_comfy()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")

from chorus.engine import Plan  # noqa: E402
from chorus.engine import attend as engine_attend  # noqa: E402

LATENT = (1, 16, 3, 16, 16)  # grid (3, 8, 8) = 192 tokens
LAYERS = 2
OVERRIDE = "optimized_attention_override"


@pytest.fixture(scope="module")
def cp():
    from chorus.nodes import comfy_patch

    return comfy_patch


@pytest.fixture(scope="module")
def nodes():
    from chorus.nodes.feature_reuse import ChorusFeatureReuse
    from chorus.nodes.guidance_boost import ChorusGuidanceBoost
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

    return {
        "sparse": lambda m, plan, k_min=2: ChorusSparseSampler.execute(model=m, plan=plan, top_p=0.9, k_min=k_min,
                                                                       refresh_steps=0, backend="auto").result[0],
        "fr": lambda m, plan, share=0.3: ChorusFeatureReuse.execute(model=m, plan=plan,
                                                                    downsample_share=share).result[0],
        "guidance": lambda m, plan, s=0.5, i=0.7, c=0.4: ChorusGuidanceBoost.execute(
            model=m, plan=plan, strength=s, image_strength=i, cfg_strength=c).result[0],
    }


@pytest.fixture(scope="module")
def model():
    return tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0, num_layers=LAYERS))


def _miss():
    return Plan.miss("test miss", latent_shape=LATENT[1:], embedding=np.ones(4, np.float32))


def _sample(m, steps=2, cfg=1.0):
    import comfy.sample

    positive, negative = tiny.random_conditioning(3), tiny.random_conditioning(103)
    latent = torch.zeros(LATENT)
    noise = comfy.sample.prepare_noise(latent, 0)
    return comfy.sample.sample(m, noise, steps, cfg, "euler", "simple", positive, negative, latent,
                               disable_pbar=True, seed=0)


def _chorus_wrappers(m):
    import comfy.patcher_extension as pe

    out = {}
    for kind in (pe.WrappersMP.OUTER_SAMPLE, pe.WrappersMP.APPLY_MODEL, pe.WrappersMP.DIFFUSION_MODEL):
        out[kind] = {key: len(fns) for key, fns in m.wrappers.get(kind, {}).items() if "chorus" in key}
    return out


def test_three_nodes_in_any_order_make_one_patch(cp, nodes, model):
    plan = _miss()
    for order in itertools.permutations(("sparse", "fr", "guidance")):
        m = model
        for name in order:
            m = nodes[name](m, plan)
        opts = m.model_options["transformer_options"]
        patch = opts[cp.PATCH_KEY]
        assert isinstance(patch, cp.ChorusPatch) and cp.get_patch(m) is patch, order
        assert isinstance(opts[OVERRIDE], cp.ChorusOverride) and opts[OVERRIDE].previous is None
        assert patch.plan is plan and patch.attention.plan is plan and patch.feature_reuse.plan is plan
        assert patch.guidance.plan is plan and patch.previous_override is None
        assert patch.attention.config.k_min == 2 and patch.feature_reuse.config.downsample_share == 0.3
        assert (patch.guidance.strength, patch.guidance.image_strength, patch.guidance.cfg_strength) == (0.5, 0.7, 0.4)
        assert all(w == {cp.WRAPPER_KEY: 1} for w in _chorus_wrappers(m).values()), (order, _chorus_wrappers(m))
        dit = opts["patches_replace"]["dit"]
        assert sorted(dit) == [("double_block", i) for i in range(LAYERS)]
        assert all(isinstance(b, cp.ChorusBlock) and b.previous is None for b in dit.values())
        post = m.model_options["sampler_post_cfg_function"]
        assert len(post) == 1 and isinstance(post[0], cp.CfgCorrection) and post[0].boost is patch.guidance
        assert [k for k in opts if "chorus" in k] == [cp.PATCH_KEY]
    from chorus.nodes.guidance_boost import ChorusGuidanceBoost

    out = ChorusGuidanceBoost.execute(model=m, plan=plan, strength=0.5, image_strength=0.0, cfg_strength=0.0)
    assert "Chorus patch: sparse sampler + feature reuse + guidance" in out.ui["text"][0], out.ui
    base = model.model_options["transformer_options"]
    assert cp.PATCH_KEY not in base and OVERRIDE not in base and "patches_replace" not in base
    assert not any(_chorus_wrappers(model).values())
    # clone() deep-copies model_options: the patch objects come through as themselves
    clone = m.clone()
    assert cp.get_patch(clone) is patch and clone.model_options["transformer_options"][OVERRIDE] is opts[OVERRIDE]
    for obj in (patch, opts[OVERRIDE], dit[("double_block", 0)], post[0]):
        assert copy.deepcopy(obj) is obj


def test_repatching_replaces_parts_and_keeps_other_packs_hooks(cp, nodes, model):
    def foreign_override(func, *args, **kwargs):
        return func(*args, **kwargs)

    def foreign_block(args, extra):
        return extra["original_block"](args)

    def foreign_post_cfg(args):
        return args["denoised"]

    base = model.clone()
    opts = base.model_options["transformer_options"]
    opts[OVERRIDE] = foreign_override
    opts["patches_replace"] = {"dit": {("double_block", 0): foreign_block}}
    base.model_options["sampler_post_cfg_function"] = [foreign_post_cfg]

    plan = _miss()
    m = nodes["sparse"](base, plan)
    m = nodes["fr"](m, plan)
    m = nodes["sparse"](m, plan, k_min=3)
    m = nodes["guidance"](m, plan)
    m = nodes["guidance"](m, plan, s=1.0, i=0.0, c=0.2)
    m = nodes["fr"](m, plan, share=0.5)
    patch = cp.get_patch(m)
    opts = m.model_options["transformer_options"]
    assert isinstance(opts[OVERRIDE], cp.ChorusOverride) and opts[OVERRIDE].previous is foreign_override
    assert patch.previous_override is foreign_override
    assert patch.attention.config.k_min == 3 and patch.feature_reuse.config.downsample_share == 0.5
    assert (patch.guidance.strength, patch.guidance.image_strength, patch.guidance.cfg_strength) == (1.0, 0.0, 0.2)
    dit = opts["patches_replace"]["dit"]
    assert dit[("double_block", 0)].previous is foreign_block and dit[("double_block", 1)].previous is None
    post = m.model_options["sampler_post_cfg_function"]
    assert post[0] is foreign_post_cfg and len(post) == 2 and isinstance(post[1], cp.CfgCorrection)
    assert all(w == {cp.WRAPPER_KEY: 1} for w in _chorus_wrappers(m).values()), _chorus_wrappers(m)

    # strength 0 removes the guidance part (and its post-CFG function); the other parts stay
    off = nodes["guidance"](m, plan, s=0.0, i=0.0, c=0.0)
    patch_off = cp.get_patch(off)
    assert patch_off.guidance is None and patch_off.attention is not None and patch_off.feature_reuse is not None
    assert off.model_options["sampler_post_cfg_function"] == [foreign_post_cfg]
    # ... and on a model without guidance it returns the model itself
    assert nodes["guidance"](off, plan, s=0.0, i=0.0, c=0.0) is off
    out = _sample(m)
    assert torch.isfinite(out).all() and plan.stats.recorded_calls == 2 * LAYERS and plan.stats.fallback_calls == 0


def test_one_patch_object_per_chained_patch_and_old_chained_patches_not_kept_alive(cp):
    """The override and the block patch are one object per patch they chain (what a compiled model's
    guards see request after request), and a pack that makes a new patch per prompt does not make
    Chorus keep every old one alive: at most ``MAX_CHAINED`` of them are held."""
    import gc
    import weakref

    from chorus.nodes import comfy_forward as cf
    from chorus.nodes.comfy_override import ChorusOverride

    assert ChorusOverride.chaining(None) is ChorusOverride.chaining(None)
    kept = []
    for i in range(3 * cf.MAX_CHAINED):
        def per_prompt_patch(*args, i=i):  # another pack's patch, made anew for each prompt
            return i

        override, block = ChorusOverride.chaining(per_prompt_patch), cf.ChorusBlock.at(True, per_prompt_patch)
        assert ChorusOverride.chaining(per_prompt_patch) is override and override.previous is per_prompt_patch
        assert cf.ChorusBlock.at(True, per_prompt_patch) is block and block.previous is per_prompt_patch
        kept.append(weakref.ref(per_prompt_patch))
        del per_prompt_patch, override, block
    gc.collect()
    assert 0 < sum(ref() is not None for ref in kept) <= cf.MAX_CHAINED


def test_one_grid_and_one_float_sigma_per_forward(cp, nodes, model, monkeypatch):
    """Per forward the DIFFUSION_MODEL wrapper computes the token grid once (engine.token_grid) and
    reads the sigma once: the sparse, feature-reuse and guidance parts all get it as a float."""
    from chorus.engine import ChorusAttention
    from chorus.engine.feature_reuse import FeatureReuse
    from chorus.engine.guidance import GuidanceBoost

    grids, sigmas = [], []
    real_grid = cp.token_grid
    monkeypatch.setattr(cp, "token_grid", lambda shape: grids.append(tuple(shape)) or real_grid(shape))
    for cls, name in ((ChorusAttention, "record"), (FeatureReuse, "record_block"), (GuidanceBoost, "reuse_acted")):
        real = getattr(cls, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            sigma = {"record": lambda: args[0].sigma, "reuse_acted": lambda: args[0]}.get(_name, lambda: None)()
            sigmas.append((_name, kwargs.get("sigma", sigma)))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    plan = _miss()
    m = nodes["guidance"](nodes["fr"](nodes["sparse"](model, plan), plan), None, s=1.0, i=0.0, c=0.0)
    _sample(m, steps=2)
    assert len(grids) == 2  # one forward per step at cfg 1
    names = {n for n, _ in sigmas}
    assert names == {"record", "record_block", "reuse_acted"}, names
    assert all(type(s) is float for _, s in sigmas), {type(s) for _, s in sigmas}
    assert plan.stats.recorded_calls == 2 * LAYERS


def test_an_older_chorus_patch_inside_another_packs_chain_passes_through(cp, nodes, model):
    """Sparse sampler, then another pack's override that chains its Chorus override, then feature
    reuse: the new patch's override chains the other pack's; the old Chorus override inside it passes
    every call through (the forward's Chorus keys are removed on the way down), so nothing is recorded
    twice."""
    seen = []

    class Foreign:
        def __init__(self, inner):
            self.inner = inner

        def __deepcopy__(self, memo):
            return self

        def __call__(self, func, *args, **kwargs):
            seen.append(args[0].shape[1])
            return self.inner(func, *args, **kwargs)

    plan = _miss()
    m1 = nodes["sparse"](model, plan)
    old = m1.model_options["transformer_options"][OVERRIDE]
    m2 = m1.clone()
    m2.model_options["transformer_options"][OVERRIDE] = Foreign(old)
    m3 = nodes["fr"](m2, plan)
    new = cp.get_patch(m3)
    assert isinstance(new.previous_override, Foreign) and new.previous_override.inner is old
    assert m3.model_options["transformer_options"][OVERRIDE].previous is new.previous_override
    _sample(m3, steps=2)
    assert seen and plan.stats.recorded_calls == 2 * LAYERS and plan.stats.dense_calls == 2 * LAYERS


def test_a14b_pair_gets_two_patches_sharing_one_plan(cp, nodes):
    experts = [tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=s)) for s in (0, 1)]
    plan = _miss()
    high, low = (nodes["fr"](nodes["sparse"](e, plan), plan) for e in experts)
    ph, pl = cp.get_patch(high), cp.get_patch(low)
    assert ph is not pl and ph.plan is pl.plan is plan
    assert ph.model_info.fingerprint != pl.model_info.fingerprint
    assert ph.attention is not pl.attention and ph.feature_reuse is not pl.feature_reuse
    assert plan.state.feature_reuse is ph.feature_reuse.state is pl.feature_reuse.state


def test_a_node_with_another_plan_moves_every_part_to_it(cp, nodes, model):
    first, second = _miss(), _miss()
    m = nodes["guidance"](nodes["sparse"](model, first), first)
    m = nodes["fr"](m, second)
    patch = cp.get_patch(m)
    assert patch.plan is second and patch.attention.plan is second and patch.guidance.plan is second
    assert any("another plan" in msg for msg in second.stats.messages)
    _sample(m, steps=1)
    assert second.stats.recorded_calls == LAYERS and first.stats.recorded_calls == 0


def test_unsupported_model_keeps_guidance_but_gets_no_sparse_part(cp, nodes):
    t2v = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0, in_dim=16))
    plan = _miss()
    m = nodes["sparse"](t2v, plan)
    assert cp.get_patch(m) is None and OVERRIDE not in m.model_options["transformer_options"]
    m = nodes["guidance"](m, plan, s=1.0, i=0.0, c=0.0)
    patch = cp.get_patch(m)
    assert patch.guidance is not None and patch.attention is None and patch.feature_reuse is None
    assert any("unsupported model" in msg for msg in plan.stats.messages)
    # no APPLY_MODEL keyword for a model Chorus does not support (its forward might not take it)
    import comfy.patcher_extension as pe

    assert _chorus_wrappers(m)[pe.WrappersMP.APPLY_MODEL] == {}
    assert _chorus_wrappers(m)[pe.WrappersMP.OUTER_SAMPLE] == {cp.WRAPPER_KEY: 1}


def test_a_model_of_another_class_gets_no_guidance_either(cp, nodes):
    """ComfyUI's Wan Animate 2 / SCAIL models subclass ``WanModel`` under another name, and their self-attention
    can take keys of another length than its queries (Animate 2's per-frame attention over the reference
    tokens), which guidance would take for cross-attention and scale. Guidance patches ``WanModel`` itself
    only (a text-to-video one too, above); any other class comes back unpatched, said so."""
    other = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0, num_layers=LAYERS))
    diffusion_model = other.model.diffusion_model
    diffusion_model.__class__ = type("WanAnimate2Model", (type(diffusion_model),), {})
    plan = _miss()
    m = nodes["guidance"](other, plan, s=1.0, i=1.0, c=0.0)
    assert cp.get_patch(m) is None and OVERRIDE not in m.model_options["transformer_options"]
    assert any("guidance not applied: WanAnimate2Model is not a Wan diffusion model" in msg
               for msg in plan.stats.messages), plan.stats.messages
    assert torch.equal(_sample(m, steps=1), _sample(other, steps=1))


def test_a_latent_as_long_as_the_text_context_runs_dense_with_a_note(cp, nodes, model):
    """512 latent tokens = the 512 text tokens: self- and cross-attention cannot be told apart, so the
    patch stays out of every such call (no recording, no bias, no pooled blocks): the output is the
    unpatched model's, bit for bit."""
    import comfy.sample

    latent = torch.zeros(1, 16, 2, 32, 32)  # grid (2, 16, 16) = 512 tokens
    positive, negative = tiny.random_conditioning(3), tiny.random_conditioning(103)

    def sample(m):
        return comfy.sample.sample(m, comfy.sample.prepare_noise(latent, 0), 1, 1.0, "euler", "simple", positive,
                                   negative, latent, disable_pbar=True, seed=0)

    plan = Plan.miss("test miss", latent_shape=latent.shape[1:], embedding=np.ones(4, np.float32))
    m = nodes["guidance"](nodes["fr"](nodes["sparse"](model, plan), plan), None, s=0.0, i=2.0, c=0.0)
    assert torch.equal(sample(m), sample(model))
    assert plan.stats.recorded_calls == 0 and plan.stats.fallback_calls == LAYERS  # every self-attention call
    assert any("cannot be told apart" in msg for msg in plan.stats.messages), plan.stats.messages
    assert cp.get_patch(m).guidance.biased_calls == 0


def test_a_run_that_cannot_start_goes_dense_and_every_reset_runs_when_sampling_fails(cp, nodes, model, monkeypatch):
    from chorus.engine import ChorusAttention

    plan = _miss()
    m = nodes["guidance"](nodes["fr"](nodes["sparse"](model, plan), plan), None, s=1.0, i=0.0, c=0.0)
    patch = cp.get_patch(m)
    real_begin = ChorusAttention.begin_run

    def broken(self, *args, **kwargs):
        raise RuntimeError("begin_run broke (test)")

    monkeypatch.setattr(ChorusAttention, "begin_run", broken)
    # dense attention and full blocks; the cross-attention gain (no self-attention involved) still acts
    assert torch.equal(_sample(m, steps=1), _sample(nodes["guidance"](model, None, s=1.0, i=0.0, c=0.0), steps=1))
    assert plan.stats.recorded_calls == 0 and any("could not start" in msg for msg in plan.stats.messages)
    assert patch._run_failed is None and not patch.feature_reuse._running
    monkeypatch.setattr(ChorusAttention, "begin_run", real_begin)

    # the sampler itself fails mid-run (here: another pack's override raises): the error reaches
    # ComfyUI as it would without Chorus, and every part's run state is reset on the way out
    def failing(func, *args, **kwargs):
        raise KeyError("another pack failed (test)")

    failing_model = m.clone()
    failing_model.model_options["transformer_options"][OVERRIDE] = failing
    failing_model = nodes["sparse"](failing_model, plan)
    fpatch = cp.get_patch(failing_model)
    assert fpatch.previous_override is failing
    with pytest.raises(KeyError, match="another pack failed"):
        _sample(failing_model, steps=1)
    assert fpatch.attention.run is None and fpatch.attention.expert is None
    assert not fpatch.feature_reuse._running and fpatch.guidance.sample_sigmas is None


def test_a_compiled_forward_is_not_recompiled_for_each_sigma(cp, nodes, model):
    """Under torch.compile (TorchCompileModel compiles the model forward around the DIFFUSION_MODEL
    wrapper) the sigma read and the forward's context are made on the host side: a new sigma value at
    every step must not make dynamo recompile the forward (it did when sigma was a Python float in the
    traced frame)."""
    import torch._dynamo
    import torch._dynamo.testing

    patched = nodes["sparse"](model, _miss())
    patch = cp.get_patch(patched)
    seen = []

    @torch.compiler.disable  # (in ComfyUI only the ops, when they run, read the forward's context)
    def record(options):
        seen.append(engine_attend.current().sigma)

    def executor(x, timestep, context, clip_fea, time_dim_concat, transformer_options):
        record(transformer_options)
        return x * 2.0

    def forward(x, sigmas):
        opts = {"sigmas": sigmas, "sample_sigmas": torch.tensor([1.0, 0.5, 0.0]), cp.PATCH_KEY: patch}
        return cp.diffusion_model_wrapper(executor, x, sigmas, None, None, None, opts)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(forward, backend=counter)
    x = torch.randn(LATENT)
    assert torch.equal(compiled(x, torch.tensor([1.0])), x * 2.0)
    frames_after_first = counter.frame_count
    for sigma in (0.75, 0.5, 0.25, 0.125):
        assert torch.equal(compiled(x, torch.tensor([sigma])), x * 2.0)
    assert seen == [1.0, 0.75, 0.5, 0.25, 0.125]
    assert counter.frame_count == frames_after_first, \
        f"new sigmas compiled {counter.frame_count - frames_after_first} more frames"
    torch._dynamo.reset()


def test_the_sparse_sampler_alone_hands_block_0_a_row_major_stream(cp, nodes, model):
    """WanModel passes its blocks the patch embedding's transposed view; the one ChorusBlock of a
    sparse-only patch (block 0) makes it row-major, values unchanged: a miss samples the unpatched
    model's output bit for bit."""
    plan = _miss()
    m = nodes["sparse"](model, plan)
    dit = m.model_options["transformer_options"]["patches_replace"]["dit"]
    assert list(dit) == [("double_block", 0)] and isinstance(dit[("double_block", 0)], cp.ChorusBlock)
    seen = []

    def original_block(args):
        seen.append(args["img"].is_contiguous())
        return {"img": args["img"]}

    x = torch.randn(1, 8, 6).transpose(1, 2)
    out = dit[("double_block", 0)]({"img": x, "transformer_options": {}}, {"original_block": original_block})
    assert seen == [True] and torch.equal(out["img"], x)
    assert torch.equal(_sample(m), _sample(model))
    assert plan.stats.recorded_calls == 2 * LAYERS


def sage_like_override(func, *args, **kwargs):
    """An attention override as a SageAttention patch node sets it: its own backend for every call, the
    override it replaced never called (here ComfyUI's PyTorch attention stands in for the backend)."""
    import comfy.ldm.modules.attention as attention

    return attention.attention_pytorch.__wrapped__(*args, **kwargs)


def test_an_attention_override_applied_after_the_chorus_nodes_is_named_in_the_run_notes(nodes, model):
    """Applied after the Chorus nodes, an override that does not chain the one it replaced hides every
    call from Chorus: the run's notes say which override and how to order the nodes. Applied before
    them, it is chained: the miss records every call and no such note appears."""
    after = _miss()
    patched = nodes["sparse"](model, after).clone()
    patched.model_options["transformer_options"][OVERRIDE] = sage_like_override
    _sample(patched, steps=1)
    assert after.stats.recorded_calls == 0
    notes = [m for m in after.stats.messages if "applied after the Chorus nodes" in m]
    assert notes and "sage_like_override" in notes[0] and "apply it before the Chorus nodes" in notes[0], \
        after.stats.messages

    before = _miss()
    first = model.clone()
    first.model_options["transformer_options"][OVERRIDE] = sage_like_override
    _sample(nodes["sparse"](first, before), steps=1)
    assert before.stats.recorded_calls == LAYERS, before.stats.summary()
    assert not any("applied after the Chorus nodes" in m for m in before.stats.messages), before.stats.messages


def test_under_comfyui_s_multi_gpu_split_chorus_stays_out_with_a_note(cp, nodes, model):
    """ComfyUI's multi-GPU split (its MultiGPU CFG Split node) runs a step's cond and uncond calls on two
    GPUs at once, each call's options naming its device (``multigpu_thread_device``): Chorus's maps and
    recordings live on one GPU, so every such call runs dense (the unpatched model's output, bit for bit),
    counted and noted."""
    plan = _miss()
    m = nodes["sparse"](model, plan)
    m.model_options["transformer_options"][cp.MULTI_GPU_KEY] = torch.device("cpu")
    plain = model.clone()
    plain.model_options.setdefault("transformer_options", {})[cp.MULTI_GPU_KEY] = torch.device("cpu")
    assert torch.equal(_sample(m, steps=1), _sample(plain, steps=1))
    assert plan.stats.recorded_calls == 0 and plan.stats.fallback_calls == LAYERS, plan.stats.summary()
    assert any("multi-GPU split" in msg for msg in plan.stats.messages), plan.stats.messages


def test_a_block_patch_that_never_reads_extra_is_a_skipped_layer():
    """``never_runs_block``: a block patch reaches its block only through ``extra["original_block"]``, so one
    whose code never reads ``extra`` skips it (ComfyUI's Skip Layer Guidance patch); any read, ``*args`` or a
    builtin: not known to skip. ``skipped_layers`` looks through a Chorus block patch at the one it chains."""
    from chorus.nodes import comfy_forward as cf

    def skip(args, extra_args):
        return args

    def runs(args, extra):
        return extra["original_block"](args)

    def passes_extra_on(args, extra):
        return runs(args, extra)

    def captures(args, extra):
        return (lambda: extra)()["original_block"](args)

    class Skips:
        def __call__(self, args, extra):
            return args

    class Runs:
        def __call__(self, args, extra):
            return extra["original_block"](args)

        def method(self, args, extra):
            return args

    assert cf.never_runs_block(skip) and cf.never_runs_block(Skips()) and cf.never_runs_block(Runs().method)
    assert cf.never_runs_block(lambda a, e: a)
    for patch in (runs, passes_extra_on, captures, Runs(), lambda *a: a[0], lambda a: a, print,
                  cf.ChorusBlock.at(False)):
        assert not cf.never_runs_block(patch), patch
    blocks = {("double_block", 0): cf.ChorusBlock.at(False), ("double_block", 1): skip,
              ("double_block", 2): cf.ChorusBlock.at(True, previous=skip), ("double_block", 3): runs,
              ("single_block", 4): skip}
    assert cf.skipped_layers({"patches_replace": {"dit": blocks}}) == {1, 2}
    assert cf.skipped_layers({}) == frozenset()


def test_layers_skip_layer_guidance_skips_are_passed_over_by_the_layer_count(cp, nodes, monkeypatch):
    """ComfyUI's Skip Layer Guidance node runs one more forward per step in its window with the chosen
    layers' blocks replaced by a patch that returns its arguments: that forward's self-attention calls come
    from the other layers, and each is counted as its own layer (it took the map of the layer below where the
    layer is counted: 0.3.64, compiled code). A miss records every layer of both forwards under its own key."""
    from comfy_extras.nodes_slg import SkipLayerGuidanceDiT

    layers = []
    next_layer = engine_attend.ForwardContext.next_layer

    def spy(self, hint=-1):
        layer = next_layer(self, hint)
        layers.append((self, layer))  # the context itself: kept alive, so ids are not reused
        return layer

    monkeypatch.setattr(engine_attend.ForwardContext, "next_layer", spy)
    three = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0, num_layers=3))
    plan = Plan.miss("test miss", latent_shape=LATENT[1:], embedding=np.ones(4, np.float32))
    m = nodes["fr"](nodes["sparse"](three, plan), plan)
    m = SkipLayerGuidanceDiT.execute(m, scale=3.0, start_percent=0.0, end_percent=1.0, double_layers="1",
                                     single_layers="").result[0]
    assert torch.isfinite(_sample(m, steps=2)).all()
    forwards = {}
    for forward, layer in layers:
        forwards.setdefault(id(forward), []).append(layer)
    assert sorted(map(tuple, forwards.values())) == [(0, 1, 2)] * 2 + [(0, 2)] * 2, forwards
    assert plan.stats.recorded_calls == 2 * 3 + 2 * 2 and plan.stats.fallback_calls == 0, plan.stats.summary()
    assert sorted({key[2] for key in plan.recorder.block_maps()}) == [0, 1, 2]
