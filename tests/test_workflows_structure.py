"""Structure of the example workflows in ``workflows/`` (CPU, no ComfyUI needed).

Checks: every JSON parses; the UI graphs are internally consistent (node ids unique, each link's
origin output and target input exist, carry the link id and the link's type); the committed files
are what ``workflows/build_workflows.py`` builds; each API twin has exactly the UI graph's executable
nodes, the same connections and the same widget values; the Chorus wiring follows the node contract;
model file names are the ones ComfyUI's own Wan templates use (when the comfyui-workflow-templates
package is installed). Checks against a real ComfyUI's node definitions: ``test_workflows_host.py``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

WORKFLOWS_DIR = Path(__file__).resolve().parents[1] / "workflows"
UI_FILES = sorted(WORKFLOWS_DIR.glob("*.json"))
VIRTUAL_TYPES = {"MarkdownNote", "Note", "Reroute", "PrimitiveNode"}
EXPECTED = {
    "chorus_wan22_a14b_i2v_4step",
    "chorus_wan22_a14b_i2v_4step_feature_reuse",
    "chorus_wan22_a14b_flf2v_4step",
    "chorus_wan22_a14b_i2v_4step_long",
    "chorus_wan22_ti2v_5b",
    "chorus_wan21_i2v_14b",
}


def _api_path(ui_path: Path) -> Path:
    return WORKFLOWS_DIR / "api" / f"{ui_path.stem}_api.json"


def _load(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _load_builder():
    name = "chorus_workflows_builder"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, WORKFLOWS_DIR / "build_workflows.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_expected_workflows_exist():
    assert {p.stem for p in UI_FILES} == EXPECTED
    for ui in UI_FILES:
        assert _api_path(ui).is_file(), f"missing API twin for {ui.name}"
    assert len(list((WORKFLOWS_DIR / "api").glob("*.json"))) == len(EXPECTED)


@pytest.mark.parametrize("ui_path", UI_FILES, ids=lambda p: p.stem)
def test_ui_graph_links_are_consistent(ui_path):
    wf = _load(ui_path)
    nodes = {n["id"]: n for n in wf["nodes"]}
    assert len(nodes) == len(wf["nodes"]), "duplicate node ids"
    assert wf["last_node_id"] >= max(nodes)
    link_ids = [link[0] for link in wf["links"]]
    assert len(set(link_ids)) == len(link_ids), "duplicate link ids"
    assert wf["last_link_id"] >= max(link_ids)
    for link_id, src, src_slot, dst, dst_slot, typ in wf["links"]:
        assert src in nodes and dst in nodes, f"link {link_id} names a missing node"
        out = nodes[src]["outputs"][src_slot]
        inp = nodes[dst]["inputs"][dst_slot]
        assert link_id in out["links"], f"link {link_id} not listed on its origin output"
        assert inp["link"] == link_id, f"link {link_id} not set on its target input"
        assert out["type"] == typ == inp["type"], f"link {link_id}: {out['type']} -> {inp['type']} as {typ}"
    # And the reverse: every link a node names is in the links table.
    listed = set(link_ids)
    for node in wf["nodes"]:
        for inp in node.get("inputs", []):
            assert inp["link"] is None or inp["link"] in listed
        for out in node.get("outputs", []):
            assert set(out["links"] or []) <= listed


@pytest.mark.parametrize("ui_path", UI_FILES, ids=lambda p: p.stem)
def test_committed_json_is_what_the_builder_makes(ui_path):
    builder = _load_builder()
    graphs = {g.name: g for g in (build() for build in builder.WORKFLOWS)}
    graph = graphs[ui_path.stem]
    assert _load(ui_path) == json.loads(json.dumps(graph.to_ui()))
    assert _load(_api_path(ui_path)) == json.loads(json.dumps(graph.to_api()))


@pytest.mark.parametrize("ui_path", UI_FILES, ids=lambda p: p.stem)
def test_api_twin_matches_ui(ui_path):
    ui, api = _load(ui_path), _load(_api_path(ui_path))
    executable = {str(n["id"]): n for n in ui["nodes"] if n["type"] not in VIRTUAL_TYPES}
    assert set(api) == set(executable)
    links = {link[0]: link for link in ui["links"]}
    for node_id, node in executable.items():
        entry = api[node_id]
        assert entry["class_type"] == node["type"]
        ui_connections = {}
        for inp in node.get("inputs", []):
            if inp["link"] is not None:
                _, src, src_slot, _, _, _ = links[inp["link"]]
                ui_connections[inp["name"]] = [str(src), src_slot]
        api_connections = {k: v for k, v in entry["inputs"].items() if isinstance(v, list)}
        assert api_connections == ui_connections, f"node {node_id} ({node['type']})"
        # Widget values: every literal API input value appears in the UI widgets, in order.
        literals = [v for v in entry["inputs"].values() if not isinstance(v, list)]
        widgets = list(node.get("widgets_values", []))
        it = iter(widgets)
        assert all(any(v == w for w in it) for v in literals), f"node {node_id}: {literals} vs {widgets}"


def _by_type(api: dict, class_type: str) -> dict:
    return {k: v for k, v in api.items() if v["class_type"] == class_type}


@pytest.mark.parametrize("ui_path", UI_FILES, ids=lambda p: p.stem)
def test_chorus_wiring_follows_the_contract(ui_path):
    api = _load(_api_path(ui_path))
    retrieve = _by_type(api, "ChorusMaskRetrieve")
    assert len(retrieve) == 1
    (retrieve_id, r), = retrieve.items()
    assert r["inputs"]["workspace"] == "default" and r["inputs"]["similarity_threshold"] == 0.9
    # The latent the retrieval sees is the one the first sampler starts from.
    samplers = {**_by_type(api, "KSampler"), **_by_type(api, "KSamplerAdvanced")}
    first = [s for s in samplers.values() if api[s["inputs"]["latent_image"][0]]["class_type"]
             not in ("KSampler", "KSamplerAdvanced")]
    assert len(first) == 1 and r["inputs"]["latent"] == first[0]["inputs"]["latent_image"]
    assert api[r["inputs"]["start_image"][0]]["class_type"] == "LoadImage"
    # A first-last-frame graph's end image joins the embedding: the one WanFirstLastFrameToVideo gets.
    first_last = list(_by_type(api, "WanFirstLastFrameToVideo").values())
    assert r["inputs"].get("end_image") == (first_last[0]["inputs"]["end_image"] if first_last else None)
    if first_last:
        assert r["inputs"]["start_image"] == first_last[0]["inputs"]["start_image"] != r["inputs"]["end_image"]
    assert api[r["inputs"]["positive"][0]]["class_type"] == "CLIPTextEncode"
    # Every sampler runs a model patched by ChorusSparseSampler (and, in the feature-reuse variant,
    # ChorusFeatureReuse and ChorusGuidanceBoost; in the long video, ChorusFeatureReuse under ComfyUI's Wan
    # context windows, the node next to the sampler) with the one plan, on top of ModelSamplingSD3.
    sparse = _by_type(api, "ChorusSparseSampler")
    assert len(sparse) == len(samplers)
    chorus_model_nodes = ("ChorusSparseSampler", "ChorusFeatureReuse", "ChorusGuidanceBoost")
    long_video = ui_path.stem.endswith("_long")
    assert len(_by_type(api, "WanContextWindowsManual")) == (len(samplers) if long_video else 0)
    chains = []
    for s in samplers.values():
        node_id, chain = s["inputs"]["model"][0], []
        if long_video:
            windows = api[node_id]
            assert windows["class_type"] == "WanContextWindowsManual"
            assert (windows["inputs"]["context_length"], windows["inputs"]["context_overlap"]) == (81, 30)
            node_id = windows["inputs"]["model"][0]
        while api[node_id]["class_type"] in chorus_model_nodes:
            assert api[node_id]["inputs"]["plan"] == [retrieve_id, 0]
            chain.append(api[node_id]["class_type"])
            node_id = api[node_id]["inputs"]["model"][0]
        assert api[node_id]["class_type"] == "ModelSamplingSD3"
        assert chain.count("ChorusSparseSampler") == 1
        chains.append(tuple(chain))
    assert len(set(chains)) == 1, "every expert must be patched the same way"
    if "feature_reuse" in ui_path.stem:
        assert set(chains[0]) == set(chorus_model_nodes)
    elif long_video:
        assert chains[0] == ("ChorusFeatureReuse", "ChorusSparseSampler")
    else:
        assert chains[0] == ("ChorusSparseSampler",)
    # The cache write takes the last sampler's latent (so it runs after sampling) and the plan.
    last = [k for k, s in samplers.items()
            if not any(o["inputs"].get("latent_image") == [k, 0] for o in samplers.values())]
    (write_id, w), = _by_type(api, "ChorusCacheWrite").items()
    assert w["inputs"]["latent"] == [last[0], 0] and w["inputs"]["plan"] == [retrieve_id, 0]
    decode = _by_type(api, "VAEDecode")
    assert [d["inputs"]["samples"] for d in decode.values()] == [[last[0], 0]]


@pytest.mark.parametrize("name", ["chorus_wan22_a14b_i2v_4step", "chorus_wan22_a14b_i2v_4step_feature_reuse",
                                  "chorus_wan22_a14b_flf2v_4step", "chorus_wan22_a14b_i2v_4step_long"])
def test_a14b_is_the_4step_lora_2_plus_2_graph(name):
    api = _load(WORKFLOWS_DIR / "api" / f"{name}_api.json")
    unets = sorted(v["inputs"]["unet_name"] for v in _by_type(api, "UNETLoader").values())
    assert unets == ["wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors",
                     "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors"]
    loras = _by_type(api, "LoraLoaderModelOnly")
    assert sorted(v["inputs"]["lora_name"] for v in loras.values()) == [
        "wan2.2_i2v_lightx2v_4steps_lora_v1_high_noise.safetensors",
        "wan2.2_i2v_lightx2v_4steps_lora_v1_low_noise.safetensors"]
    for lora in loras.values():  # each LoRA on the expert of the same noise level
        unet = api[lora["inputs"]["model"][0]]["inputs"]["unet_name"]
        assert ("high_noise" in unet) == ("high_noise" in lora["inputs"]["lora_name"])
    samplers = sorted(_by_type(api, "KSamplerAdvanced").values(), key=lambda s: s["inputs"]["start_at_step"])
    assert [(s["inputs"]["start_at_step"], s["inputs"]["end_at_step"]) for s in samplers] == [(0, 2), (2, 4)]
    assert all(s["inputs"]["steps"] == 4 and s["inputs"]["cfg"] == 1.0 for s in samplers)
    assert [s["inputs"]["add_noise"] for s in samplers] == ["enable", "disable"]
    assert [s["inputs"]["return_with_leftover_noise"] for s in samplers] == ["enable", "disable"]

    def expert_of(sampler):  # follow sampler -> Chorus nodes -> ModelSamplingSD3 -> LoRA -> UNETLoader
        node = api[sampler["inputs"]["model"][0]]
        while node["class_type"] != "UNETLoader":
            node = api[node["inputs"]["model"][0]]
        return node["inputs"]["unet_name"]

    assert "high_noise" in expert_of(samplers[0]) and "low_noise" in expert_of(samplers[1])


def _template_file(name: str) -> Path | None:
    """ComfyUI's template ``name`` (a ``.json``) from the installed comfyui-workflow-templates, or None: in its
    own ``templates/`` folder (releases up to 0.1.x), or through its ``get_asset_path`` (later releases split the
    templates over several packages)."""
    spec = importlib.util.find_spec("comfyui_workflow_templates")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "templates" / name
    if path.is_file():
        return path
    import comfyui_workflow_templates

    try:
        return Path(comfyui_workflow_templates.get_asset_path(Path(name).stem, name))
    except Exception:  # noqa: BLE001 - no such template, or a release without get_asset_path
        return None


def _nodes_with_subgraphs(workflow: dict) -> list:
    """A UI workflow's nodes and those of its subgraph definitions (later templates fold nodes into subgraphs)."""
    subgraphs = workflow.get("definitions", {}).get("subgraphs", [])
    return list(workflow["nodes"]) + [n for sg in subgraphs for n in sg.get("nodes", [])]


TEMPLATE_OF = {
    "chorus_wan22_a14b_i2v_4step": "video_wan2_2_14B_i2v.json",
    "chorus_wan22_a14b_i2v_4step_feature_reuse": "video_wan2_2_14B_i2v.json",
    "chorus_wan22_a14b_flf2v_4step": "video_wan2_2_14B_flf2v.json",
    "chorus_wan22_a14b_i2v_4step_long": "video_wan2_2_14B_i2v.json",
    "chorus_wan22_ti2v_5b": "video_wan2_2_5B_ti2v.json",
    "chorus_wan21_i2v_14b": "image_to_video_wan.json",
}
FILE_WIDGETS = {"UNETLoader": 0, "CLIPLoader": 0, "VAELoader": 0, "CLIPVisionLoader": 0, "LoraLoaderModelOnly": 0}


@pytest.mark.parametrize("ui_path", UI_FILES, ids=lambda p: p.stem)
def test_model_files_are_those_of_comfyuis_wan_templates(ui_path):
    template_file = _template_file(TEMPLATE_OF[ui_path.stem])
    if template_file is None:
        pytest.skip(f"comfyui-workflow-templates (it comes with ComfyUI's requirements.txt) is not installed or has "
                    f"no {TEMPLATE_OF[ui_path.stem]}")
    theirs = {(n["type"], n["widgets_values"][FILE_WIDGETS[n["type"]]])
              for n in _nodes_with_subgraphs(_load(template_file)) if n["type"] in FILE_WIDGETS}
    ours = {(n["type"], n["widgets_values"][FILE_WIDGETS[n["type"]]])
            for n in _load(ui_path)["nodes"] if n["type"] in FILE_WIDGETS}
    assert ours and ours <= theirs, f"not in {TEMPLATE_OF[ui_path.stem]}: {sorted(ours - theirs)}"
    # The text encoder is loaded the way the templates load it.
    for n in _load(ui_path)["nodes"]:
        if n["type"] == "CLIPLoader":
            assert n["widgets_values"][1] == "wan"
