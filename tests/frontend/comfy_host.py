"""Test helpers for the workflow tests: one shared headless ComfyUI with this pack, and Chromium.

Used by ``tests/test_workflows_*.py``; loaded by file path under one name so that the server started
for one test module is shared by the others in the same pytest process. The server itself is
``tests/host/server.py``'s ``ComfyHost`` (``main.py --cpu`` on 127.0.0.1, a temporary
``--base-directory`` with this pack linked into its ``custom_nodes``, every other custom node but the
test-only conditioning node disabled); ComfyUI is found by ``tests/host/tiny_wan.py``'s
``find_comfyui_dir``. Nothing is downloaded.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from host.server import PACK_LINK, ComfyHost, prepare_base
from host.tiny_wan import find_comfyui_dir

PACK_LINK_NAME = PACK_LINK
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
CHROMIUM_FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]


def find_chromium() -> str | None:
    """Path of a Chromium binary (env ``CHROMIUM`` first), or None."""
    for path in ([os.environ["CHROMIUM"]] if os.environ.get("CHROMIUM") else []) + list(CHROMIUM_CANDIDATES):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


class ComfyServer(ComfyHost):
    """A ``ComfyHost`` on a fresh temporary base directory (``workdir``), stopped at exit."""

    def __init__(self, comfy_dir: Path, startup_timeout: float = 180.0):
        self.workdir = prepare_base(Path(tempfile.mkdtemp(prefix="chorus_comfy_")))
        super().__init__(comfy_dir, self.workdir, startup_timeout=startup_timeout)
        atexit.register(self.stop)


# Workflows made for a later ComfyUI than CI's 0.3.64: name -> (a node type, an input of it that release
# added, the release). Wan I2V samples in context windows from 0.28.2 on (0.3.64's windows leave its image
# conditioning whole), whose Wan context-windows node also has more widgets.
LATER_HOST_WORKFLOWS = {"chorus_wan22_a14b_i2v_4step_long": ("WanContextWindowsManual", "freenoise", "0.28.2")}


def later_host_needed(name: str, object_info: dict) -> str | None:
    """Why workflow ``name`` cannot be checked against this ComfyUI's node definitions (a skip reason), or None."""
    need = LATER_HOST_WORKFLOWS.get(name)
    if need is None:
        return None
    node_type, input_name, release = need
    inputs = object_info.get(node_type, {}).get("input", {})
    if input_name in inputs.get("required", {}) or input_name in inputs.get("optional", {}):
        return None
    return (f"{name} needs ComfyUI {release} or later: this ComfyUI's {node_type} has no {input_name!r} input "
            "(its context windows cannot sample Wan I2V)")


_SHARED: dict[str, object] = {}


def shared_server() -> ComfyServer | str:
    """One ComfyServer per process (started on first use), or a string saying why there is none.

    A startup failure is cached as its message, so every test that needs the server reports it.
    """
    if "server" not in _SHARED:
        comfy_dir = find_comfyui_dir()
        if comfy_dir is None:
            _SHARED["server"] = ("no ComfyUI checkout: set COMFYUI_DIR (looked at $COMFYUI_DIR, /opt/ComfyUI "
                                 "and the folder above custom_nodes/)")
        else:
            try:
                _SHARED["server"] = ComfyServer(comfy_dir)
            except RuntimeError as err:
                _SHARED["server"] = RuntimeError(str(err))
    return _SHARED["server"]


def shared_object_info() -> dict:
    """``/object_info`` of the shared server (cached)."""
    if "object_info" not in _SHARED:
        server = shared_server()
        if not isinstance(server, ComfyServer):
            raise RuntimeError(f"no server: {server}")
        _SHARED["object_info"] = server.get_json("/object_info", timeout=120)
    return _SHARED["object_info"]


def api_twin_input(name: str, api_inputs: dict) -> str:
    """The committed API twin's input for the editor's widget ``name``: the twins are saved on ComfyUI 0.3.64,
    so a widget a later editor nests in a dynamic combo (0.33.0's SaveVideo: ``format.codec``) is the twin's flat
    input (``codec``)."""
    return name if name in api_inputs or "." not in name else name.rsplit(".", 1)[-1]
