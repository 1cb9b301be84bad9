"""Fuzzing the Chorus nodes in-process (ComfyUI imported on CPU; hypothesis).

Part 1, the graph-building path (no sampling): ``ChorusMaskRetrieve.execute`` with fuzzed latents
(any rank, empty, NaN/inf, huge shapes as zero-stride views), workspace names (traversal
``../x``, absolute paths, separators, NUL bytes, unicode, 65+ characters, ``~``, ``.``/``..``),
thresholds (NaN, +-inf, out of [0, 1]), conditionings (NaN/inf, wrong shapes and types), prompts
(NUL, unicode, 100k characters) and start images; then ``ChorusSparseSampler`` (fuzzed top_p,
k_min, refresh_steps, backend names), ``ChorusFeatureReuse``, ``ChorusGuidanceBoost`` on a tiny
real Wan ModelPatcher, ``ChorusCacheWrite`` and ``ChorusCacheMaintenance`` (fuzzed action and
max_entries). Every call returns its outputs with a message; none raises; the input model is
never modified.

Part 2, sampling: requests through MaskRetrieve -> SparseSampler, FeatureReuse and GuidanceBoost in a
fuzzed order (each optional but the first; they configure one Chorus patch) -> ``comfy.sample.sample``
(tiny Wan, 1-2 steps) -> CacheWrite with fuzzed latent sizes, NaN/inf injected into the latent or the
conditioning, input images as ComfyUI's image-to-video nodes give them (none, a start image, a start and an
end image), and fuzzed sampler settings, on a workspace that fills up as the cases run (so later cases
hit). Sampling never raises; the write either says "wrote entry N" or why nothing was written; entries
written stay loadable; a hit runs only an entry recorded with the request's image frames.

Part 3, inputs of any type (beyond what ComfyUI's UI sends: a linked or API-queued input is not
range-checked): every node's ``execute`` with some inputs replaced by None, bools, huge and negative
ints, NaN/inf, strings, bytes, lists, dicts, tensors, numpy scalars, other objects. Each returns its
message; a patching node that refuses an input returns the model it was given, unpatched (dense
attention); nothing raises.

Around all: nothing is written outside the cache root (snapshot of its parent), every directory
the nodes created under the root has a valid workspace name, and ``verify`` of each workspace is
clean at the end. Case counts are printed (FuzzReport warning). Skips with a visible reason without
a ComfyUI checkout.
"""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import serving_helpers as sh

SKIP = sh.skip_reason()
pytestmark = [pytest.mark.host, pytest.mark.skipif(SKIP is not None, reason=f"ComfyUI not available: {SKIP}")]

GRAPH_CASES = 150
SAMPLING_CASES = 16
ANY_TYPE_CASES = 300

NAMES = ["../x", "..", ".", "/abs", "/etc/passwd", "a/b", "a\\b", "a\x00b", "", " ", "~", "~root", "default",
         "-x", ".hidden", "x" * 65, "x" * 64, "é", "\U0001d518", "CON", "fuzz", "fuzz.2", "_x", "a\nb",
         "..\\..\\x", "%2e%2e%2fx", "file:///x", "fuzz/../../x"]
FLOATS = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1.0, 2.0, 1e308, -0.0]),
                   st.floats(allow_nan=True, allow_infinity=True, width=32))
INTS = st.one_of(st.sampled_from([-(2**63), -1, 0, 1, 4, 2**31, 2**62]), st.integers(-10, 5000))
TEXT = st.one_of(st.sampled_from(["", "a\x00b", "\u202e" * 3, "x" * 100_000, "\ud7ff"]), st.text(max_size=30))


def _tensor(shape, fill):
    if fill == "zeros_view":  # a huge shape without memory (zero-stride view)
        return torch.zeros(1).expand(*shape) if shape else torch.zeros(())
    t = torch.randn(*shape) if shape else torch.randn(())
    if fill == "nan" and t.numel():
        t.view(-1)[0] = math.nan
    elif fill == "inf" and t.numel():
        t.view(-1)[-1] = math.inf
    return t


small_dims = st.lists(st.integers(0, 5), min_size=0, max_size=6)
ok_latent = st.tuples(st.just("ok"), st.sampled_from([(1, 16, 2, 4, 4), (1, 16, 4, 8, 8)]), st.just("randn"))
latent_st = st.one_of(
    ok_latent, ok_latent, ok_latent,
    st.tuples(st.just("ok"), st.sampled_from([(1, 16, 2, 4, 4), (1, 16, 3, 8, 8), (2, 16, 1, 2, 2), (1, 48, 2, 4, 4)]),
              st.sampled_from(["randn", "nan", "inf"])),
    st.tuples(st.just("dims"), small_dims, st.sampled_from(["randn", "nan"])),
    st.tuples(st.just("huge"), st.sampled_from([(1, 16, 10**4, 10**4, 10**4), (1, 16, 1, 2**20, 2**20), (10**6, 16, 1, 2, 2)]),
              st.just("zeros_view")),
    st.tuples(st.just("garbage"), st.sampled_from([None, "latent", 5, [], {}, {"samples": "x"}, {"samples": None}]),
              st.none()),
)
ok_cond = st.tuples(st.just("seed"), st.integers(0, 3), st.sampled_from([0.0, 0.01]))
cond_st = st.one_of(
    ok_cond, ok_cond, ok_cond, ok_cond,
    st.none(),
    st.tuples(st.just("shape"), st.sampled_from([(1, 512, 4096), (1, 0, 4096), (1, 7, 3), (2, 512, 4096), (4096,), ()]),
              st.sampled_from(["randn", "nan", "inf"])),
    st.tuples(st.just("garbage"), st.sampled_from([[], [[]], [[None, {}]], "text", 3, [["x", {}]], [[torch.zeros(0), {}]]]),
              st.none()),
)
image_st = st.one_of(
    st.none(), st.none(), st.none(),
    st.tuples(st.sampled_from([(1, 32, 32, 3), (1, 1, 1, 3), (2, 16, 8, 3), (1, 32, 32), (1, 0, 32, 3), (1, 2048, 2048, 3)]),
              st.sampled_from(["randn", "nan", "inf", "zeros_view"])),
)


def _build_latent(spec):
    kind, a, fill = spec
    if kind == "garbage":
        return a
    return {"samples": _tensor(tuple(a), fill)}


def _build_cond(spec):
    if spec is None:
        return None
    kind, a, b = spec
    if kind == "seed":
        return sh.tiny.random_conditioning(100 + a, noise=b, noise_seed=7)
    if kind == "shape":
        return [[_tensor(a, b), {}]]
    return a


def _build_image(spec):
    if spec is None:
        return None
    shape, fill = spec
    return _tensor(shape, fill)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz_nodes")
    root = base / "cache_root"
    root.mkdir()
    (base / "sentinel.txt").write_text("outside the cache root")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHORUS_CACHE_DIR", str(root))
        model = sh.tiny.load_tiny_wan(sh.tiny.tiny_wan_state_dict(seed=0))
        yield base, root, model


def _options_fingerprint(model):
    opts = model.model_options.get("transformer_options", {})
    return (sorted(opts), sorted(model.model_options), {k: len(v) for k, v in getattr(model, "wrappers", {}).items()})


def _check_root(base, root, before):
    from chorus.cache_store import Workspace, validate_workspace_name

    assert sh.snapshot(base, skip=root) == before, "something was written outside the cache root"
    for child in root.iterdir():
        assert child.is_dir() and not child.is_symlink(), child
        validate_workspace_name(child.name)
        assert child.resolve().parent == root.resolve()
    return [Workspace.open(child) for child in root.iterdir()]


def test_fuzz_node_inputs(env, record_property):
    from chorus.engine import Plan
    from chorus.nodes.cache_maintenance import ChorusCacheMaintenance
    from chorus.nodes.cache_write import ChorusCacheWrite
    from chorus.nodes.feature_reuse import ChorusFeatureReuse
    from chorus.nodes.guidance_boost import ChorusGuidanceBoost
    from chorus.nodes.mask_retrieve import ChorusMaskRetrieve
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

    from chorus.nodes.common import open_workspace
    from chorus.nodes.mask_retrieve import request_embedding

    base, root, model = env
    before = sh.snapshot(base, skip=root)
    model_state = _options_fingerprint(model)
    ws = open_workspace("fuzz")  # entries for templates 0 and 1, so some requests hit
    for template in (0, 1):
        ws.add(request_embedding(positive=sh.tiny.random_conditioning(100 + template)), sh.entry_masks(template),
               {"signature": sh.signature(), "prompt": f"template {template}"})
    counts: dict[str, int] = {}

    good = {"latent": ok_latent, "workspace": st.just("fuzz"), "threshold": st.sampled_from([0.9, 0.5]),
            "positive": ok_cond, "image": st.none()}
    hostile = {"latent": latent_st, "workspace": st.one_of(st.sampled_from(NAMES), st.text(max_size=70)),
               "threshold": FLOATS, "positive": cond_st, "image": image_st}

    @settings(max_examples=GRAPH_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data(),
           # a good request, one hostile input at a time, or everything drawn from the hostile pools
           scenario=st.sampled_from(["good", "good", "good"] + sorted(hostile) * 2 + ["all", "all"]),
           prompt=TEXT, top_p=FLOATS, k_min=INTS, refresh=INTS,
           backend=st.one_of(st.sampled_from(["auto", "reference", "triton_fp8", "flex", "none", ""]), TEXT),
           share=FLOATS, strength=FLOATS, image_strength=FLOATS, cfg_strength=FLOATS, action=st.sampled_from(["stats", "verify", "prune", "rebuild-index", "x"]),
           max_entries=INTS)
    def case(data, scenario, prompt, top_p, k_min, refresh, backend, share, strength, image_strength, cfg_strength,
             action, max_entries):
        drawn = {name: data.draw(hostile[name] if scenario in (name, "all") else good[name], label=name)
                 for name in sorted(good)}
        latent, workspace, threshold = drawn["latent"], drawn["workspace"], drawn["threshold"]
        positive, image = drawn["positive"], drawn["image"]
        out = ChorusMaskRetrieve.execute(latent=_build_latent(latent), workspace=workspace,
                                         similarity_threshold=threshold, start_image=_build_image(image),
                                         positive=_build_cond(positive), prompt=prompt)
        plan, preview, info = out.result
        assert isinstance(plan, Plan) and isinstance(info, str) and info.startswith(("HIT", "MISS"))
        assert isinstance(preview, torch.Tensor) and preview.dim() == 4 and torch.isfinite(preview).all()
        kind = "hit" if plan.is_hit else ("miss-ws" if plan.workspace_name is not None else "miss-nows")
        patched = ChorusSparseSampler.execute(model=model, plan=plan, top_p=top_p, k_min=k_min,
                                              refresh_steps=refresh, backend=backend).result[0]
        reused = ChorusFeatureReuse.execute(model=patched, plan=plan, downsample_share=share).result[0]
        boosted = ChorusGuidanceBoost.execute(model=reused, plan=plan, strength=strength,
                                              image_strength=image_strength, cfg_strength=cfg_strength).result[0]
        assert boosted is not None and hasattr(boosted, "model_options")
        written = ChorusCacheWrite.execute(latent=_build_latent(latent), plan=plan).result[0]
        assert isinstance(written, str) and written
        assert not written.startswith("wrote entry")  # nothing was sampled, so nothing recorded
        report = ChorusCacheMaintenance.execute(workspace=workspace, action=action, max_entries=max_entries).result[0]
        assert isinstance(report, str) and report.startswith(action)
        assert _options_fingerprint(model) == model_state, "the input model was modified"
        counts[kind] = counts.get(kind, 0) + 1
        scenarios[scenario] = scenarios.get(scenario, 0) + 1

    scenarios: dict[str, int] = {}
    case()
    for ws in _check_root(base, root, before):
        report = ws.verify()
        assert report["ok"] and report["index_consistent"], report
        ws.close()
    sh.report(record_property, f"node inputs (scenarios {dict(sorted(scenarios.items()))})", counts)
    assert sum(counts.values()) >= GRAPH_CASES // 2, counts
    assert counts.get("hit") and counts.get("miss-ws") and counts.get("miss-nows"), counts


EDGE_IMAGES = [(1, 0, 32, 3), (1, 32, 0, 3), (0, 32, 32, 3), (1, 32, 32, 0), (1, 32, 32, 2), (1, 1, 1, 1),
               (32, 32, 3), (3,), ()]
EDGE_CONDS = [None, [], [[]], [[None, {}]], [["x", {}]], [[torch.zeros(0), {}]], [[torch.zeros(1, 0, 4096), {}]],
              [[torch.zeros(1, 512, 4096), {}]], [[torch.full((1, 512, 4096), math.inf), {}]], "text", 3]


def test_edge_inputs_of_mask_retrieve(env, record_property):
    """Every edge image x edge conditioning (empty dims, zero channels, None/str tensors, all-zero
    and all-inf conditioning): a MISS with a message, never an exception (deterministic grid)."""
    from chorus.nodes.mask_retrieve import ChorusMaskRetrieve

    counts: dict[str, int] = {}
    for shape in EDGE_IMAGES:
        for cond in EDGE_CONDS:
            for fill in ("randn", "nan"):
                image = _tensor(shape, fill)
                plan, _, info = ChorusMaskRetrieve.execute(latent={"samples": torch.zeros(1, 16, 2, 4, 4)},
                                                           workspace="edges", similarity_threshold=0.9,
                                                           start_image=image, positive=cond).result
                assert info.startswith(("MISS", "HIT")) and plan.message, info
                key = "usable" if plan.embedding is not None else "no embedding"
                counts[key] = counts.get(key, 0) + 1
    sh.report(record_property, "mask retrieve edge grid", counts)
    assert counts.get("no embedding", 0) > 100, counts


def test_fuzz_sampling_requests(env, record_property):
    import comfy.sample

    from chorus.nodes.cache_write import ChorusCacheWrite
    from chorus.nodes.feature_reuse import ChorusFeatureReuse
    from chorus.nodes.guidance_boost import ChorusGuidanceBoost
    from chorus.nodes.mask_retrieve import ChorusMaskRetrieve
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

    base, root, model = env
    before = sh.snapshot(base, skip=root)
    counts: dict[str, int] = {}
    written: list[int] = []
    guided = [0]
    orders: dict[str, int] = {}
    frames_served: dict[str, int] = {}
    workspaces = {}

    def ws_of(name):
        from chorus.cache_store import Workspace

        if name not in workspaces:
            workspaces[name] = Workspace.open(root / name)
        return workspaces[name]

    @settings(max_examples=SAMPLING_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(template=st.integers(0, 2), noise=st.sampled_from([0.0, 0.01]), shape=st.sampled_from(
               [(1, 16, 2, 4, 4), (1, 16, 1, 6, 10), (1, 16, 3, 8, 8), (1, 16, 2, 8, 4)]),
           poison=st.sampled_from(["none", "none", "latent_nan", "latent_inf", "cond_nan", "cond_inf"]),
           steps=st.integers(1, 2), cfg=st.sampled_from([1.0, 2.0]), k_min=st.sampled_from([1, 4, 10**6]),
           refresh=st.sampled_from([0, 1, 10**6]), top_p=st.sampled_from([0.01, 0.9, 1.0]),
           guidance=st.sampled_from([None, (0.5, 0.5, 0.0), (5.0, 5.0, 5.0)]),
           order=st.permutations(["sparse", "feature_reuse", "guidance"]), share=st.sampled_from([None, 0.25, 1.0]),
           images=st.sampled_from(["none", "start", "start_end"]))
    def case(template, noise, shape, poison, steps, cfg, k_min, refresh, top_p, guidance, order, share, images):
        positive = _with_images(sh.tiny.random_conditioning(200 + template, noise=noise, noise_seed=11), shape, images)
        negative = _with_images(sh.tiny.random_conditioning(300), shape, images)
        latent_image = torch.zeros(shape)
        if poison.startswith("latent"):
            latent_image.view(-1)[0] = math.nan if poison.endswith("nan") else math.inf
        if poison.startswith("cond"):
            positive[0][0].view(-1)[5] = math.nan if poison.endswith("nan") else math.inf
        latent = {"samples": latent_image}
        plan = ChorusMaskRetrieve.execute(latent=latent, workspace="fuzzrun", similarity_threshold=0.9,
                                          positive=positive).result[0]
        patched = model
        for node in order:  # the three nodes configure one Chorus patch, in any order
            if node == "sparse":
                patched = ChorusSparseSampler.execute(model=patched, plan=plan, top_p=top_p, k_min=k_min,
                                                      refresh_steps=refresh, backend="auto").result[0]
            elif node == "feature_reuse" and share is not None:
                patched = ChorusFeatureReuse.execute(model=patched, plan=plan, downsample_share=share).result[0]
            elif node == "guidance" and guidance is not None:
                # text gain, first-frame bias and CFG correction, at the defaults or the maximum
                patched = ChorusGuidanceBoost.execute(model=patched, plan=plan, strength=guidance[0],
                                                      image_strength=guidance[1], cfg_strength=guidance[2]).result[0]
        noise_t = comfy.sample.prepare_noise(latent_image, 0)
        samples = comfy.sample.sample(patched, noise_t, steps, cfg, "euler", "simple", positive, negative,
                                      latent_image, disable_pbar=True, seed=0)
        assert samples.shape == latent_image.shape
        if poison == "none":
            assert torch.isfinite(samples).all()
        info = ChorusCacheWrite.execute(latent={"samples": samples}, plan=plan).result[0]
        assert info.startswith(("wrote entry", "hit:", "not written")), info
        if plan.is_hit:  # a hit runs only an entry recorded with the request's image frames (or none recorded)
            served = ws_of("fuzzrun").load(plan.entry_id, touch=False)[1]["signature"].get("image_frames")
            assert served is None or tuple(served) == plan.state.image_frames, (served, plan.state.image_frames)
            frames_served[images] = frames_served.get(images, 0) + 1
        if info.startswith("wrote entry"):
            assert poison == "none", f"a poisoned request was written: {info}"
            written.append(int(info.split()[2]))
        outcome = info.split(":")[0].split(" entry")[0]
        counts[f"{poison}/{outcome}"] = counts.get(f"{poison}/{outcome}", 0) + 1
        guided[0] += guidance is not None
        key = ">".join(n[0] for n in order)
        orders[key] = orders.get(key, 0) + 1

    case()
    for ws in workspaces.values():
        ws.close()
    for ws in _check_root(base, root, before):
        if ws.path.name == "fuzzrun":
            live = {e["id"] for e in ws.entries()}
            assert set(written) <= live
            for entry_id in written:
                masks, meta = ws.load(entry_id, touch=False)
                assert masks and all(not torch.is_floating_point(m) or torch.isfinite(m).all() for m in masks.values())
        report = ws.verify()
        assert report["ok"] and report["index_consistent"], report
        ws.close()
    sh.report(record_property, f"sampling requests ({guided[0]} with ChorusGuidanceBoost; node orders "
                               f"{dict(sorted(orders.items()))}; hits by input images {frames_served})", counts)
    assert written and any(k.endswith("/hit") for k in counts), counts
    assert guided[0] > 0


def _with_images(conditioning, shape, images: str):
    """``conditioning`` with input images as ComfyUI's image-to-video nodes give them for a latent of ``shape``
    (``"start"``, ``"start_end"``: ``tiny.with_input_images``); ``"none"``: unchanged."""
    if images == "none":
        return conditioning
    return sh.tiny.with_input_images(conditioning, shape, images == "start_end", seed=shape[2] * 100 + shape[3])


def test_symlinked_workspace_leading_outside_is_refused(tmp_path, monkeypatch):
    """A workspace directory under the root that is a symlink to elsewhere is refused by name
    (resolution follows symlinks), with a message; nothing is written at the link's target."""
    from chorus.nodes.cache_maintenance import ChorusCacheMaintenance
    from chorus.nodes.mask_retrieve import ChorusMaskRetrieve

    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "evil").symlink_to(outside, target_is_directory=True)
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(root))
    plan, _, info = ChorusMaskRetrieve.execute(latent={"samples": torch.zeros(1, 16, 2, 4, 4)}, workspace="evil",
                                               similarity_threshold=0.9,
                                               positive=sh.tiny.random_conditioning(1)).result
    assert info.startswith("MISS") and "outside the cache root" in info and plan.workspace_name is None, info
    report = ChorusCacheMaintenance.execute(workspace="evil", action="verify", max_entries=0).result[0]
    assert "failed" in report and "outside the cache root" in report, report
    assert list(outside.iterdir()) == []


ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-10, 10),
    st.integers(min_value=2**53, max_value=2**1000), st.integers(min_value=-(2**1000), max_value=-(2**53)),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e308]),
    st.text(max_size=12), st.binary(max_size=8), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.tuples(st.integers()),
    st.sampled_from([object(), torch.zeros(()), torch.ones(3), torch.full((2, 2), math.nan), np.float64("nan"),
                     np.int64(-1), np.float32(0.5), complex(1, 1), Decimal("0.5"), Fraction(1, 3), ..., type]),
)
PATCHING = ("ChorusSparseSampler", "ChorusFeatureReuse", "ChorusGuidanceBoost")


def test_fuzz_node_inputs_of_any_type(env, record_property):
    """Part 3 (module docstring): hypothesis draws a node, then each of its inputs from a good value
    or from ``ANY``."""
    from chorus.engine import Plan
    from chorus.nodes.cache_maintenance import ChorusCacheMaintenance
    from chorus.nodes.cache_write import ChorusCacheWrite
    from chorus.nodes.comfy_patch import get_patch
    from chorus.nodes.feature_reuse import ChorusFeatureReuse
    from chorus.nodes.guidance_boost import ChorusGuidanceBoost
    from chorus.nodes.mask_retrieve import ChorusMaskRetrieve
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

    base, root, model = env
    before = sh.snapshot(base, skip=root)
    model_state = _options_fingerprint(model)
    latent = {"samples": torch.zeros(1, 16, 2, 4, 4)}
    positive = sh.tiny.random_conditioning(100)
    plans = [ChorusMaskRetrieve.execute(latent=latent, workspace="fuzz", positive=positive).result[0],
             ChorusMaskRetrieve.execute(latent=latent, workspace="anytype",
                                        positive=sh.tiny.random_conditioning(7)).result[0]]
    nodes = {  # node -> (class, good inputs)
        "ChorusMaskRetrieve": (ChorusMaskRetrieve, {"latent": latent, "workspace": "anytype", "similarity_threshold": 0.9,
                                                    "start_image": None, "positive": positive, "prompt": "",
                                                    "clip_vision_output": None}),
        "ChorusSparseSampler": (ChorusSparseSampler, {"model": model, "plan": plans[0], "top_p": 0.9, "k_min": 4,
                                                      "refresh_steps": 0, "backend": "auto", "verify_threshold": 0.0}),
        "ChorusFeatureReuse": (ChorusFeatureReuse, {"model": model, "plan": plans[0], "downsample_share": 0.25}),
        "ChorusGuidanceBoost": (ChorusGuidanceBoost, {"model": model, "plan": plans[0], "strength": 0.5,
                                                      "image_strength": 0.5, "cfg_strength": 0.0}),
        "ChorusCacheWrite": (ChorusCacheWrite, {"latent": latent, "plan": plans[1]}),
        "ChorusCacheMaintenance": (ChorusCacheMaintenance, {"workspace": "anytype", "action": "stats",
                                                            "max_entries": 0}),
    }
    counts: dict[str, int] = {}

    @settings(max_examples=ANY_TYPE_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data(), name=st.sampled_from(sorted(nodes)))
    def case(data, name):
        cls, good = nodes[name]
        names = sorted(good)
        hostile = data.draw(st.sets(st.sampled_from(names), min_size=1), label="hostile inputs")
        inputs = {key: data.draw(ANY, label=key) if key in hostile else good[key] for key in names}
        out = cls.execute(**inputs)
        text = " ".join(out.ui["text"]) if out.ui else ""
        assert text, (name, inputs)
        outcome = "message"
        if name == "ChorusMaskRetrieve":
            assert isinstance(out.result[0], Plan) and out.result[2].startswith(("HIT", "MISS"))
        elif name in PATCHING:
            returned = out.result[0]
            if returned is inputs["model"]:
                outcome = "unpatched"  # the model as given: dense attention
            else:
                assert get_patch(returned) is not None and "not patched" not in text, (name, text)
                outcome = "patched"
            if "not patched" in text:
                assert returned is inputs["model"], (name, text)
        else:
            assert isinstance(out.result[0], str) and out.result[0], (name, out.result)
        counts[f"{name}/{outcome}"] = counts.get(f"{name}/{outcome}", 0) + 1
        assert _options_fingerprint(model) == model_state, "the input model was modified"

    case()
    for ws in _check_root(base, root, before):
        ws.close()
    sh.report(record_property, "node inputs of any type", counts)
    assert all(any(key.startswith(name + "/") for key in counts) for name in nodes), counts
    assert all(counts.get(f"{name}/unpatched") for name in PATCHING), counts
