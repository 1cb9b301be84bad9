"""The example workflows against a real ComfyUI (headless, CPU, this pack in its custom nodes).

Skips with a reason when no ComfyUI checkout is found (``COMFYUI_DIR``, ``/opt/ComfyUI``, or the
folder this pack sits in). Checks, using the server's own ``/object_info`` and validator:
- every node type of every UI workflow is a ComfyUI core node or a node of this pack (frontend-only
  note nodes excepted);
- each link joins an output and an input whose types ComfyUI declares equal;
- each node's ``widgets_values`` has one value per widget input (plus the UI-only seed control and
  image-upload widgets), and each value sits where the API twin says (same name, same value);
- each API twin passes ``POST /prompt`` validation except for the model files, which a test server
  does not have (only ``value_not_in_list`` on the model-file inputs is allowed, and every model file
  is reported missing, so the validator reached each loader).
A workflow made for a later ComfyUI (``comfy_host.LATER_HOST_WORKFLOWS``) skips these checks on an earlier one,
with the reason.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.host

WORKFLOWS_DIR = Path(__file__).resolve().parents[1] / "workflows"
UI_FILES = sorted(WORKFLOWS_DIR.glob("*.json"))
VIRTUAL_TYPES = {"MarkdownNote", "Note", "Reroute", "PrimitiveNode"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
MODEL_FILE_INPUTS = {
    ("UNETLoader", "unet_name"), ("CLIPLoader", "clip_name"), ("VAELoader", "vae_name"),
    ("CLIPVisionLoader", "clip_name"), ("LoraLoaderModelOnly", "lora_name"),
}
CHORUS_NODES = {"ChorusMaskRetrieve", "ChorusSparseSampler", "ChorusFeatureReuse", "ChorusGuidanceBoost",
                "ChorusCacheWrite"}


def _host():
    """tests/frontend/comfy_host.py (on pytest's pythonpath): one shared server per process."""
    import frontend.comfy_host

    return frontend.comfy_host


@pytest.fixture(scope="module")
def server():
    host = _host()
    srv = host.shared_server()
    if isinstance(srv, str):
        pytest.skip(srv)
    if isinstance(srv, Exception):
        pytest.fail(f"ComfyUI did not start: {srv}")
    return srv


@pytest.fixture(scope="module")
def object_info(server):
    return _host().shared_object_info()


def _load(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"  # a combo whose chosen option brings widgets of its own (ComfyUI 0.33.0)


def _is_widget(spec) -> bool:
    typ = spec[0]
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return (isinstance(typ, list) or typ in WIDGET_TYPES or typ == DYNAMIC_COMBO) and not opts.get("forceInput")


def _widget_layout(inputs: dict, order: dict | None, values: list, prefix: str = "") -> list[str]:
    """Widget names in the order the graph editor creates them; "" for UI-only widgets. A dynamic combo is
    followed by the widgets of the option it holds (its value among ``values``, stored in this order), named
    ``combo.widget`` as the editor names them."""
    names = []
    for category in ("required", "optional"):
        section = inputs.get(category, {})
        for name in (order or {}).get(category, list(section)):
            spec = section[name]
            if not _is_widget(spec):
                continue
            names.append(prefix + name)
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            if spec[0] == DYNAMIC_COMBO:
                chosen = values[len(names) - 1] if len(names) <= len(values) else opts["options"][0]["key"]
                option = next(o for o in opts["options"] if o["key"] == chosen)
                names += _widget_layout(option["inputs"], None, values[len(names):], f"{prefix}{name}.")
            if opts.get("control_after_generate"):
                names.append("")
            if opts.get("image_upload") or opts.get("video_upload") or opts.get("audio_upload"):
                names.append("")
    return names


def _stored_and_added_widgets(info: dict, values: list) -> tuple[list[str], list[str]]:
    """``(layout of the stored widget values, widgets after them)``: the workflows are saved on ComfyUI 0.3.64;
    a later ComfyUI may add widgets after those (0.28.2's ``CreateVideo``: ``bit_depth``), which the editor fills
    with their defaults and an API prompt may leave out when they are optional."""
    layout = _widget_layout(info["input"], info.get("input_order"), values)
    return layout[:len(values)], layout[len(values):]


def _input_type(info: dict, name: str) -> str:
    for category in ("required", "optional"):
        if name in info["input"].get(category, {}):
            typ = info["input"][category][name][0]
            return "COMBO" if isinstance(typ, list) else typ
    raise KeyError(name)


def test_pack_nodes_are_registered(object_info):
    missing = CHORUS_NODES - set(object_info)
    assert not missing, f"pack nodes missing from /object_info: {sorted(missing)}"
    for name in CHORUS_NODES:
        assert object_info[name]["category"] == "Chorus II"


@pytest.mark.parametrize("ui_path", UI_FILES, ids=lambda p: p.stem)
def test_node_types_links_and_widgets_match_comfyui(ui_path, object_info):
    if reason := _host().later_host_needed(ui_path.stem, object_info):
        pytest.skip(reason)
    wf = _load(ui_path)
    api = _load(WORKFLOWS_DIR / "api" / f"{ui_path.stem}_api.json")
    nodes = {n["id"]: n for n in wf["nodes"]}
    unknown = sorted({n["type"] for n in wf["nodes"]} - set(object_info) - VIRTUAL_TYPES)
    assert not unknown, f"node types unknown to this ComfyUI + pack: {unknown}"
    for link_id, src, src_slot, dst, dst_slot, typ in wf["links"]:
        src_info, dst_info = object_info[nodes[src]["type"]], object_info[nodes[dst]["type"]]
        assert src_info["output"][src_slot] == typ, f"link {link_id}: origin type"
        dst_name = nodes[dst]["inputs"][dst_slot]["name"]
        assert _input_type(dst_info, dst_name) == typ, f"link {link_id}: target {dst_name}"
    for node in wf["nodes"]:
        if node["type"] in VIRTUAL_TYPES:
            continue
        info = object_info[node["type"]]
        # Socket names and output names/types as ComfyUI declares them.
        for inp in node["inputs"]:
            assert _input_type(info, inp["name"]) == inp["type"], f"{node['type']}.{inp['name']}"
        # ... a later ComfyUI may add outputs after them (0.33.0's SaveVideo passes its video on), unlinked here
        assert [o["type"] for o in node["outputs"]] == list(info["output"])[:len(node["outputs"])], node["type"]
        values = node.get("widgets_values", [])
        layout, added = _stored_and_added_widgets(info, values)
        assert len(values) == len(layout), f"{node['type']}: {len(values)} widget values, layout {layout + added}"
        assert not [n for n in added if n not in info["input"].get("optional", {})], (
            f"{node['type']}: this ComfyUI added required widgets {added} after the stored ones")
        api_inputs = api[str(node["id"])]["inputs"]
        for name, value in zip(layout, values):
            if name:
                twin = api_inputs[_host().api_twin_input(name, api_inputs)]
                assert twin == value, f"{node['type']}.{name}: API {twin!r} UI {value!r}"
        literal_names = {k for k, v in api_inputs.items() if not isinstance(v, list)}
        assert literal_names == {_host().api_twin_input(n, api_inputs) for n in layout if n}, node["type"]


@pytest.mark.parametrize("ui_path", UI_FILES, ids=lambda p: p.stem)
def test_api_twin_passes_comfyui_validation_but_for_model_files(ui_path, server, object_info):
    from PIL import Image

    if reason := _host().later_host_needed(ui_path.stem, object_info):
        pytest.skip(reason)
    api = _load(WORKFLOWS_DIR / "api" / f"{ui_path.stem}_api.json")
    for node in api.values():  # the start image the LoadImage nodes name, in the server's input folder
        if node["class_type"] == "LoadImage":
            Image.new("RGB", (64, 64), (120, 90, 60)).save(server.workdir / "input" / node["inputs"]["image"])
    status, body = server.post_json("/prompt", {"prompt": api, "client_id": uuid.uuid4().hex})
    assert status == 400, f"a test server has no Wan model files, so validation must stop: {body}"
    errors = body.get("node_errors", {})
    reported = set()
    for node_id, entry in errors.items():
        for err in entry["errors"]:
            key = (entry["class_type"], err.get("extra_info", {}).get("input_name"))
            assert err["type"] == "value_not_in_list" and key in MODEL_FILE_INPUTS, (
                f"node {node_id} {entry['class_type']}: {err['type']}: {err.get('details')}")
            reported.add(node_id)
    loaders = {k for k, v in api.items() if any(v["class_type"] == t for t, _ in MODEL_FILE_INPUTS)}
    assert reported == loaders


def test_template_browser_lists_the_ui_workflows_only(server):
    """ComfyUI serves ``workflows/*.json`` of a pack as templates; the API twins (``workflows/api/``) stay out."""
    host = _host()
    templates = server.get_json("/api/workflow_templates")
    assert sorted(templates.get(host.PACK_LINK_NAME, [])) == sorted(p.stem for p in UI_FILES)
    for ui_path in UI_FILES:
        served = server.get_json(f"/api/workflow_templates/{host.PACK_LINK_NAME}/{ui_path.name}")
        assert served == _load(ui_path)
