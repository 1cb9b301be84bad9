"""The nodes' ``execute`` in-process (ComfyUI imported on CPU, no server): a miss -> write -> hit
cycle with a tiny Wan, the preview, maintenance, the node contract, and bad inputs as messages.
(ChorusFeatureReuse / ChorusGuidanceBoost behaviour is tested with their engine modules.)"""

from __future__ import annotations

import json

import pytest
import torch

from host import tiny_wan as tiny  # tests/host (pytest pythonpath)

SKIP_REASON = tiny.import_comfy()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")

LATENT = {"samples": torch.zeros(1, 16, 2, 8, 8)}


@pytest.fixture(scope="module")
def model():
    return tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0))


def _text(out):
    return " ".join(out.ui["text"])


def _sample(model_patched, positive):
    return tiny.sample_two_steps(model_patched, positive, LATENT["samples"])


def test_miss_write_hit_cycle_through_the_nodes(nodes, model, tmp_path):
    image = torch.rand(1, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    positive = tiny.random_conditioning(5)
    out = nodes.ChorusMaskRetrieve.execute(latent=LATENT, workspace="cycle", similarity_threshold=0.9,
                                           start_image=image, positive=positive, prompt="a red fox")
    plan, preview, info = out.args
    assert info.startswith("MISS") and not plan.is_hit and preview.shape == (1, 64, 64, 3)
    assert torch.all(preview == 0.5)  # gray placeholder on a miss
    patched = nodes.ChorusSparseSampler.execute(model=model, plan=plan, top_p=0.9, k_min=4, refresh_steps=0,
                                                backend="auto")
    assert "MISS: dense attention + recording" in _text(patched)
    samples = _sample(patched.args[0], positive)
    written = nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=plan)
    assert "wrote entry 1" in written.args[0] and "recorded 4" in written.args[0]
    assert (tmp_path / "cache" / "cycle").is_dir()

    similar = nodes.ChorusMaskRetrieve.execute(latent=LATENT, workspace="cycle", similarity_threshold=0.9,
                                               start_image=image * 0.98, positive=tiny.random_conditioning(5, noise=0.05),
                                               prompt="a red fox")
    plan2, preview2, info2 = similar.args
    assert plan2.is_hit and info2.startswith("HIT entry 1") and "stored density 100.0%" in info2
    assert preview2.shape[0] == 1 and preview2.shape[-1] == 3 and not torch.all(preview2 == 0.5)
    patched2 = nodes.ChorusSparseSampler.execute(model=model, plan=plan2, top_p=0.9, k_min=4, refresh_steps=2,
                                                 backend="reference")
    assert "HIT: sparse attention with entry 1" in _text(patched2) and "pooled tail on" in _text(patched2)
    for backend in ("flex", "fa4_bf16"):  # no pooled tail there: the node runs them with it off and says so
        other = nodes.ChorusSparseSampler.execute(model=model, plan=plan2, backend=backend)
        assert f"pooled tail off ({backend} has none)" in _text(other), _text(other)
    off = nodes.ChorusSparseSampler.execute(model=model, plan=plan2, backend="reference", pooled_tail=False)
    assert "HIT: sparse attention" in _text(off) and "pooled tail off" in _text(off)
    _sample(patched2.args[0], positive)
    text = nodes.ChorusCacheWrite.execute(latent=LATENT, plan=plan2).args[0]
    assert text.startswith("hit: updated stats of entry 1,") and "calls sparse 4, dense 0" in text and \
        "fallback 0" in text, text

    report = nodes.ChorusCacheMaintenance.execute(workspace="cycle", action="stats", max_entries=0).args[0]
    assert report.startswith("stats cycle: ") and json.loads(report[len("stats cycle: "):])["entries"] == 1, report
    for action in ("verify", "rebuild-index", "prune"):
        report = nodes.ChorusCacheMaintenance.execute(workspace="cycle", action=action, max_entries=5).args[0]
        assert report.startswith(f"{action} cycle: "), report
        result = json.loads(report[len(f"{action} cycle: "):])
        assert (result["checked"] if action == "verify" else result["entries"]) == 1, report


def test_where_only_the_reference_kernel_runs_on_a_gpu_the_nodes_change_nothing_and_say_so(nodes, model, monkeypatch):
    """A GPU without Triton (the CPU standing in: taken out of ``REFERENCE_SERVES_HITS_ON``): a miss records
    nothing and Chorus Cache Write says why no entry was written; a hit of an entry written elsewhere runs every
    call dense, and its text names the dense kernel and why."""
    from chorus.engine import runtime

    image = torch.rand(1, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    positive = tiny.random_conditioning(5)

    def request(no_fast_kernel: bool):
        plan = nodes.ChorusMaskRetrieve.execute(latent=LATENT, workspace="no_triton", similarity_threshold=0.9,
                                                start_image=image, positive=positive, prompt="a red fox").args[0]
        with monkeypatch.context() as patch:
            if no_fast_kernel:
                patch.setattr(runtime, "REFERENCE_SERVES_HITS_ON", frozenset())
            patched = nodes.ChorusSparseSampler.execute(model=model, plan=plan, top_p=0.9, k_min=4,
                                                        refresh_steps=0, backend="auto")
            samples = _sample(patched.args[0], positive)
        return plan, nodes.ChorusCacheWrite.execute(latent={"samples": samples}, plan=plan).args[0]

    plan, text = request(no_fast_kernel=True)
    assert not plan.is_hit and text.startswith("not written") and "a hit would run dense here" in text, text
    assert "recorded 0" in text and "this miss records nothing" in text, text
    plan, text = request(no_fast_kernel=False)  # the entry a worker with Chorus's kernels writes
    assert not plan.is_hit and "wrote entry 1" in text, text
    plan, text = request(no_fast_kernel=True)
    assert plan.is_hit and text.startswith("hit: updated stats of entry 1,"), text
    assert "calls sparse 0, dense 4" in text and "kernel dense" in text and "runs dense (no speed-up)" in text, text


def test_a_hit_made_without_a_similarity_is_named_by_its_entry(nodes, model):
    """A library caller's hit plan may carry no similarity: the sparse sampler's text names the entry alone."""
    from chorus.engine import Plan
    from chorus.nodes.comfy_adapter import comfy_model_info

    info = comfy_model_info(model)
    sig = {"variant": info.variant, "experts": [info.fingerprint], "num_layers": info.num_layers,
           "num_heads": info.num_heads, "token_grid": [2, 4, 4], "step_sigmas": [1.0, 0.5], "block_size": 128}
    masks = {(0, s, layer, 0): torch.ones(info.num_heads, 1, 1, dtype=torch.bool)
             for s in range(2) for layer in range(info.num_layers)}
    plan = Plan("hit", entry_id=3, similarity=None, masks=masks, entry_meta={"signature": sig},
                latent_shape=tuple(LATENT["samples"].shape[1:]))
    text = _text(nodes.ChorusSparseSampler.execute(model=model, plan=plan, backend="reference"))
    assert "HIT: sparse attention with entry 3, pooled tail on" in text, text


def test_bad_inputs_are_messages(nodes, model):
    out = nodes.ChorusMaskRetrieve.execute(latent=LATENT, workspace="w")
    assert "no request embedding" in out.args[2] and out.args[0].recorder is None
    out = nodes.ChorusMaskRetrieve.execute(latent={"samples": torch.zeros(1, 4, 8, 8)}, workspace="w",
                                           positive=tiny.random_conditioning(1))
    assert "video latent" in out.args[2]
    out = nodes.ChorusMaskRetrieve.execute(latent=LATENT, workspace="/etc", positive=tiny.random_conditioning(1))
    assert "unusable" in out.args[2]
    assert "not written" in nodes.ChorusCacheWrite.execute(latent=LATENT, plan=out.args[0]).args[0]
    assert "not a Chorus plan" in nodes.ChorusCacheWrite.execute(latent=LATENT, plan="x").args[0]
    passed = nodes.ChorusSparseSampler.execute(model=model, plan=None)
    assert passed.args[0] is model and "not a Chorus plan" in _text(passed)
    assert "failed" in nodes.ChorusCacheMaintenance.execute(workspace="../up", action="stats").args[0]
    t2v = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0, in_dim=16))
    plan = nodes.ChorusMaskRetrieve.execute(latent=LATENT, workspace="w", positive=tiny.random_conditioning(1)).args[0]
    out = nodes.ChorusSparseSampler.execute(model=t2v, plan=plan)
    assert "not patched" in _text(out) and "not supported" in _text(out)


def test_a_miss_that_cannot_be_written_says_so_in_every_node_and_empty_inputs_are_messages(nodes, model, tmp_path):
    """Chorus Mask Retrieve's miss without an embedding (here: empty conditioning or CLIP vision output, a
    message, not an IndexError) records nothing: Sparse Sampler and Feature Reuse say "nothing recorded" with
    its reason, Cache Write repeats that reason (not "no workspace"). Cache Maintenance on a workspace that does
    not exist (a typo) reports it and creates nothing, as the command line does."""
    empty = [[torch.zeros(0, 5, 4096), {}]]
    for inputs in ({"positive": empty}, {"positive": torch.zeros(0, 5, 4096)},
                   {"clip_vision_output": {"image_embeds": torch.zeros(0, 1024)}},
                   {"clip_vision_output": {"penultimate_hidden_states": torch.zeros(0, 257, 1280)}}):
        plan, _, info = nodes.ChorusMaskRetrieve.execute(latent=LATENT, workspace="w", **inputs).args
        assert info.startswith("MISS") and plan.recorder is None, info
    sampler = _text(nodes.ChorusSparseSampler.execute(model=model, plan=plan))
    assert "MISS: dense attention, nothing recorded" in sampler and "+ recording" not in sampler, sampler
    reuse = _text(nodes.ChorusFeatureReuse.execute(model=model, plan=plan))
    assert "MISS: full blocks, nothing recorded" in reuse and "recording region" not in reuse, reuse
    written = nodes.ChorusCacheWrite.execute(latent=LATENT, plan=plan).args[0]
    assert written.startswith(f"not written: {plan.message}") and "no workspace" not in written, written
    report = nodes.ChorusCacheMaintenance.execute(workspace="defualt", action="stats").args[0]
    assert "stats defualt failed" in report and "nothing was created" in report, report
    assert not (tmp_path / "cache" / "defualt").exists()


def test_schemas_match_the_node_contract(nodes):
    ids = {c.define_schema().node_id: c.define_schema() for c in nodes.NODES}
    assert set(ids) == {"ChorusMaskRetrieve", "ChorusSparseSampler", "ChorusFeatureReuse", "ChorusGuidanceBoost",
                        "ChorusCacheWrite", "ChorusCacheMaintenance"}
    for schema in ids.values():
        assert schema.category == "Chorus II"
        assert all(i.tooltip for i in schema.inputs), schema.node_id
    assert ids["ChorusCacheWrite"].is_output_node and ids["ChorusCacheMaintenance"].is_output_node
    assert ids["ChorusMaskRetrieve"].not_idempotent
    import math

    assert math.isnan(nodes.ChorusMaskRetrieve.fingerprint_inputs()) and math.isnan(nodes.ChorusCacheWrite.fingerprint_inputs())
    defaults = {i.id: getattr(i, "default", None) for i in ids["ChorusSparseSampler"].inputs}
    assert defaults == {"model": None, "plan": None, "top_p": 0.9, "k_min": 4, "refresh_steps": 0, "backend": "auto",
                        "verify_threshold": 0.0, "pooled_tail": True}
    assert [i.id for i in ids["ChorusFeatureReuse"].inputs] == ["model", "plan", "downsample_share"]
    guidance = {i.id: getattr(i, "default", None) for i in ids["ChorusGuidanceBoost"].inputs}
    assert guidance == {"model": None, "plan": None, "strength": 0.5, "image_strength": 0.5, "cfg_strength": 0.0}


# The inputs the defaults serve: folded under the graph editor's "advanced inputs" where ComfyUI can.
EXPERT_INPUTS = {("ChorusSparseSampler", name) for name in
                 ("k_min", "refresh_steps", "backend", "verify_threshold", "pooled_tail")} | {
                ("ChorusGuidanceBoost", "cfg_strength")}


def test_expert_inputs_are_advanced_where_the_host_takes_it_and_every_schema_builds_where_it_does_not(nodes):
    import inspect

    from comfy_api.latest import io

    takes_advanced = "advanced" in inspect.signature(io.Input.__init__).parameters
    advanced = set()
    for node in nodes.NODES:
        schema = node.define_schema()  # an older ComfyUI's inputs take no ``advanced``: this must not raise there
        advanced |= {(schema.node_id, i.id) for i in schema.inputs if getattr(i, "advanced", None)}
    assert advanced == (EXPERT_INPUTS if takes_advanced else set())
    if takes_advanced:  # what the graph editor reads: the input's options in the V1 node info
        info = nodes.ChorusSparseSampler.GET_NODE_INFO_V1()
        assert info["input"]["required"]["k_min"][1]["advanced"] is True
        assert not info["input"]["required"]["top_p"][1].get("advanced")
        assert info["input"]["optional"]["pooled_tail"][1]["advanced"] is True


def test_every_node_has_search_aliases_where_the_host_schema_takes_them(nodes):
    import dataclasses

    from comfy_api.latest import io

    takes_aliases = "search_aliases" in {f.name for f in dataclasses.fields(io.Schema)}
    for node in nodes.NODES:
        schema = node.define_schema()
        aliases = getattr(schema, "search_aliases", None) or []
        if not takes_aliases:
            assert aliases == [], schema.node_id
            continue
        assert aliases and all(isinstance(a, str) and a.strip() for a in aliases), schema.node_id
        assert node.GET_NODE_INFO_V1()["search_aliases"] == aliases  # what the editor's node search reads
