"""The graph editor (ComfyUI's own frontend) loads each UI workflow of ``workflows/`` cleanly.

A headless ComfyUI (CPU, this pack in its custom nodes; see ``tests/frontend/comfy_host.py``) serves
its frontend (the comfyui-frontend-package of ComfyUI's requirements.txt); headless Chromium (Debian's
``chromium``, driven by the ``playwright`` package; no browser is downloaded) opens it, and for each
workflow the test calls ``app.loadGraphData(workflow)`` and checks:
- no "Some Nodes Are Missing" dialog, every node type is registered with LiteGraph, no node marked in error
  (the files the workflows name are in the server's folders, as on a user's machine: ``installed_files``);
- the loaded graph has the workflow's nodes and exactly its links (origin/target node and slot, type);
- every widget shows the value the workflow stores (catches a widget order the editor reads otherwise); widgets
  a ComfyUI later than the workflows' 0.3.64 adds after the stored ones are optional and at their defaults;
- the API graph the editor makes from it (``app.graphToPrompt()``) equals the committed API twin (but for
  those added widgets, the host's display titles and 0.33.0's nested name of SaveVideo's codec);
- no page error and no console error while loading (network-resource errors excepted: the editor
  probes resources that a machine without network does not have);
and saves a screenshot ``<workflow>.png`` (under ``$CHORUS_SCREENSHOT_DIR`` when set, else a pytest
temporary folder; the path is printed). On a ComfyUI whose node API sends the ``advanced`` flag (0.33.0), the
editor's Nodes 2.0 view shows a fresh sampler and guidance node without their advanced inputs until "Show
advanced inputs" is clicked, and the node search finds the nodes by their search aliases (both skipped on
0.3.64, whose node API has neither).

A workflow made for a later ComfyUI (``comfy_host.LATER_HOST_WORKFLOWS``: the long video in context windows,
0.28.2 or later) skips on an earlier one, with the reason. Skips, with the reason, without a ComfyUI checkout, without the ``playwright`` package or without a
Chromium binary (``$CHROMIUM``, /usr/bin/chromium). Install: ``apt-get install -y chromium`` and
``pip install playwright`` (never ``playwright install``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.host

WORKFLOWS_DIR = Path(__file__).resolve().parents[1] / "workflows"
UI_FILES = sorted(WORKFLOWS_DIR.glob("*.json"))
NETWORK_NOISE = ("Failed to load resource", "net::ERR_", "ERR_NAME_NOT_RESOLVED", "ERR_INTERNET_DISCONNECTED",
                 # 0.28.2's editor probes a remote template's model downloads, which its own CSP refuses
                 "violates the document's Content Security Policy",
                 "violates the following Content Security Policy directive")

GRAPH_STATE_JS = """() => {
  const g = window.app.graph;
  const links = g.links instanceof Map ? Array.from(g.links.values()) : Object.values(g.links || {});
  return {
    nodes: g._nodes.map(n => ({
      id: n.id, type: n.type,
      registered: !!window.LiteGraph.registered_node_types[n.type],
      has_errors: !!n.has_errors,
      // widgets the editor saves (not its own previews such as '$$canvas-image-preview')
      widgets: (n.widgets || []).filter(w => !String(w.name).startsWith('$$') && w.serialize !== false)
                                .map(w => [w.name, w.value]),
    })),
    links: links.filter(l => l).map(l => [l.origin_id, l.origin_slot, l.target_id, l.target_slot, l.type]),
    dialogs: Array.from(document.querySelectorAll('.p-dialog')).map(d => d.innerText.slice(0, 500)),
  };
}"""


def _host():
    """tests/frontend/comfy_host.py (on pytest's pythonpath): one shared server per process."""
    import frontend.comfy_host

    return frontend.comfy_host


@pytest.fixture(scope="module")
def server():
    srv = _host().shared_server()
    if isinstance(srv, str):
        pytest.skip(srv)
    if isinstance(srv, Exception):
        pytest.fail(f"ComfyUI did not start: {srv}")
    # Settings of a fresh user: no "Get started with a template" dialog, no minimap over the graph.
    settings = srv.workdir / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False}))
    return srv


MODEL_FOLDERS = {"UNETLoader": "diffusion_models", "CLIPLoader": "text_encoders", "VAELoader": "vae",
                 "CLIPVisionLoader": "clip_vision", "LoraLoaderModelOnly": "loras"}


@pytest.fixture(scope="module")
def installed_files(server):
    """The files the workflows name, present as on a user's machine that has them: the editor of ComfyUI after
    0.3.64 marks a loader whose file is not in its folder and a LoadImage whose image is not in ``input/``.
    Empty model files (the editor lists names, it never opens them) and a small image; removed after the
    module, so that the host tests' server has no model file again."""
    from PIL import Image

    made = []
    for ui_path in UI_FILES:
        for node in json.loads(ui_path.read_text(encoding="utf-8"))["nodes"]:
            if node["type"] in MODEL_FOLDERS:
                path = server.workdir / "models" / MODEL_FOLDERS[node["type"]] / node["widgets_values"][0]
            elif node["type"] == "LoadImage":
                path = server.workdir / "input" / node["widgets_values"][0]
            else:
                continue
            if path.exists():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            if node["type"] == "LoadImage":
                Image.new("RGB", (64, 64), (120, 90, 60)).save(path)
            else:
                path.write_bytes(b"")
            made.append(path)
    yield
    for path in made:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def browser_page(server, installed_files):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    chromium = _host().find_chromium()
    if chromium is None:
        pytest.skip("no Chromium binary (apt-get install -y chromium, or set $CHROMIUM)")
    events: list[tuple[str, str]] = []
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            tempfile.mkdtemp(prefix="chorus_chromium_"), executable_path=chromium, headless=True,
            args=_host().CHROMIUM_FLAGS, viewport={"width": 1600, "height": 1000})
        try:
            page = context.new_page()
            page.on("console", lambda msg: events.append((msg.type, msg.text)))
            page.on("pageerror", lambda err: events.append(("pageerror", str(err))))
            page.goto(server.url, timeout=120_000)
            page.wait_for_function("() => window.app && window.app.graph && window.LiteGraph", timeout=120_000)
            # Node definitions arrive asynchronously; wait until ours are registered.
            page.wait_for_function(
                "() => !!window.LiteGraph.registered_node_types['ChorusMaskRetrieve']", timeout=60_000)
            startup = list(events)
            if any(kind == "pageerror" for kind, _ in startup):
                print("page errors while the editor started (before any workflow was loaded):",
                      [text for kind, text in startup if kind == "pageerror"])
            yield page, events
        finally:
            context.close()


@pytest.fixture(scope="module")
def screenshot_dir(tmp_path_factory):
    path = os.environ.get("CHORUS_SCREENSHOT_DIR")
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        return Path(path)
    return tmp_path_factory.mktemp("screenshots")


def _default(spec) -> object:
    """The value the editor gives a widget the workflow stores none for: its default, else the first choice
    (a combo's first item, a dynamic combo's first option)."""
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if "default" in options:
        return options["default"]
    if isinstance(spec[0], list):
        return spec[0][0]
    choices = options.get("options") or [None]
    return choices[0]["key"] if isinstance(choices[0], dict) else choices[0]


@pytest.mark.parametrize("ui_path", UI_FILES, ids=lambda p: p.stem)
def test_graph_editor_loads_workflow(ui_path, browser_page, screenshot_dir):
    if reason := _host().later_host_needed(ui_path.stem, _host().shared_object_info()):
        pytest.skip(reason)
    page, events = browser_page
    workflow = json.loads(ui_path.read_text(encoding="utf-8"))
    page.evaluate("() => window.app.graph.clear()")
    first_event = len(events)
    page.evaluate("async (wf) => { await window.app.loadGraphData(wf); }", workflow)
    time.sleep(1.0)  # let dialogs open and the canvas draw
    page.evaluate("() => window.app.canvas.setDirty(true, true)")
    state = page.evaluate(GRAPH_STATE_JS)
    shot = screenshot_dir / f"{ui_path.stem}.png"
    page.screenshot(path=str(shot))
    print(f"screenshot: {shot}")

    missing_dialogs = [d for d in state["dialogs"] if "missing" in d.lower()]
    assert not missing_dialogs, missing_dialogs
    assert all(n["registered"] for n in state["nodes"]), [n["type"] for n in state["nodes"] if not n["registered"]]
    assert not [n for n in state["nodes"] if n["has_errors"]]
    # node ids as strings: the editor of ComfyUI 0.33.0 keeps them so, 0.3.64's as the workflow's numbers
    assert sorted((str(n["id"]), n["type"]) for n in state["nodes"]) == \
        sorted((str(n["id"]), n["type"]) for n in workflow["nodes"])
    assert sorted((str(a), i, str(b), j, t) for a, i, b, j, t in state["links"]) == \
        sorted((str(a), i, str(b), j, t) for _, a, i, b, j, t in workflow["links"])
    loaded = {str(n["id"]): n for n in state["nodes"]}
    object_info = _host().shared_object_info()
    added = {}  # widgets a ComfyUI later than the workflows' 0.3.64 shows after the stored ones, at their defaults
    for node in workflow["nodes"]:
        stored = node.get("widgets_values", [])
        widgets = loaded[str(node["id"])]["widgets"]
        assert [value for _, value in widgets[:len(stored)]] == stored, (node["type"], widgets)
        optional = object_info.get(node["type"], {}).get("input", {}).get("optional", {})
        for name, value in widgets[len(stored):]:
            assert name in optional and value == _default(optional[name]), (node["type"], name, value, widgets)
            added.setdefault(str(node["id"]), set()).add(name)
    # What the editor would queue for this graph is exactly the committed API twin (but for those added widgets;
    # 0.33.0's SaveVideo names the stored codec "format.codec", a widget nested in its format, the twin "codec").
    queued = page.evaluate("async () => (await window.app.graphToPrompt()).output")
    api = json.loads((WORKFLOWS_DIR / "api" / f"{ui_path.stem}_api.json").read_text(encoding="utf-8"))
    for node_id, names in added.items():
        inputs = {k: v for k, v in queued[node_id]["inputs"].items() if k not in names}
        queued[node_id]["inputs"] = {_host().api_twin_input(k, api[node_id]["inputs"]): v for k, v in inputs.items()}
    # a node the workflow gives no title of its own is titled with the host's display name (0.33.0's
    # LoraLoaderModelOnly: "Load LoRA"); metadata the prompt does not run
    for node in workflow["nodes"]:
        if "title" not in node and str(node["id"]) in queued and str(node["id"]) in api:
            queued[str(node["id"])]["_meta"] = api[str(node["id"])].get("_meta")
    assert queued == api, {k: (queued.get(k), api.get(k)) for k in set(queued) | set(api) if queued.get(k) != api.get(k)}
    problems = [(kind, text) for kind, text in events[first_event:]
                if kind in ("error", "pageerror") and not any(s in text for s in NETWORK_NOISE)]
    assert not problems, problems


# The inputs the nodes mark advanced where ComfyUI's node API takes the flag (nodes/common.py, EXPERT_INPUT).
EXPERT_INPUTS = {"ChorusSparseSampler": ["k_min", "refresh_steps", "backend", "verify_threshold", "pooled_tail"],
                 "ChorusGuidanceBoost": ["cfg_strength"]}


def _widget_labels(text: str, node_type: str, object_info: dict) -> list[str]:
    """The node's inputs the rendered node shows, in order (its inner text holds other lines too)."""
    spec = object_info[node_type]["input"]
    names = [*spec.get("required", {}), *spec.get("optional", {})]
    return [line for line in text.splitlines() if line in names]


def test_the_nodes_2_view_hides_the_advanced_inputs_until_asked(browser_page):
    object_info = _host().shared_object_info()
    sampler = object_info["ChorusSparseSampler"]["input"]["required"]
    if not sampler["k_min"][1].get("advanced"):
        pytest.skip("this ComfyUI's node API has no advanced inputs (0.33.0 has): every input shows")
    page, events = browser_page
    first_event = len(events)
    page.evaluate("() => window.app.graph.clear()")
    page.evaluate("async () => { await window.app.extensionManager.setting.set('Comfy.VueNodes.Enabled', true); }")
    try:
        for row, (node_type, expert) in enumerate(EXPERT_INPUTS.items()):
            node_id = page.evaluate("""(args) => { const n = window.LiteGraph.createNode(args[0]);
                n.pos = [200, 200 + 300 * args[1]]; window.app.graph.add(n); window.app.canvas.setDirty(true, true);
                return String(n.id); }""", [node_type, row])
            node = page.locator(f'[data-node-id="{node_id}"]').first
            node.wait_for(timeout=30_000)
            spec = object_info[node_type]["input"]
            widgets = [name for section in ("required", "optional") for name, s in spec.get(section, {}).items()
                       if isinstance(s[0], list) or s[0] in ("INT", "FLOAT", "BOOLEAN", "STRING", "COMBO")]
            shown = _widget_labels(node.inner_text(), node_type, object_info)
            assert [w for w in widgets if w in shown] == [w for w in widgets if w not in expert], (node_type, shown)
            node.get_by_text("Show advanced inputs").click()
            page.wait_for_timeout(300)
            shown = _widget_labels(node.inner_text(), node_type, object_info)
            assert all(name in shown for name in expert), (node_type, shown)
    finally:
        page.evaluate("async () => { await window.app.extensionManager.setting.set('Comfy.VueNodes.Enabled', false); }")
        page.evaluate("() => window.app.graph.clear()")
    problems = [(kind, text) for kind, text in events[first_event:]
                if kind in ("error", "pageerror") and not any(s in text for s in NETWORK_NOISE)]
    assert not problems, problems


def test_the_node_search_finds_the_nodes_by_their_aliases(browser_page):
    object_info = _host().shared_object_info()
    if not object_info["ChorusSparseSampler"].get("search_aliases"):
        pytest.skip("this ComfyUI's node API has no search aliases (0.33.0 has)")
    page, _ = browser_page
    page.evaluate("() => window.app.graph.clear()")
    page.mouse.dblclick(800, 500)  # an empty spot of the canvas opens the node search, its box focused
    page.wait_for_timeout(1000)
    try:
        page.keyboard.type("speed up Wan")  # in no display name: found through the aliases alone
        page.get_by_text("Chorus Sparse Sampler").first.wait_for(timeout=30_000)
        assert page.get_by_text("Chorus Feature Reuse").count() > 0
    finally:
        page.keyboard.press("Escape")
