"""Test helpers: find a ComfyUI checkout, start it headless on CPU with this pack, find Chromium.

Used by ``tests/test_workflows_*.py``. Loaded by file path (the tests folder is not a package), and
registered in ``sys.modules`` under one name so that the server started for one test module is
shared by the others in the same pytest process.

ComfyUI is found through env ``COMFYUI_DIR``, else ``/opt/ComfyUI``, else the ComfyUI folder this
pack sits in (``ComfyUI/custom_nodes/<pack>``). The server runs ``main.py --cpu`` on 127.0.0.1 on a
free port, with this pack linked (symlink) into a temporary ``custom_nodes`` folder and every other
custom node disabled, a temporary output/input/temp/user directory, an in-memory database and API
nodes off. Nothing is downloaded.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parents[2]
PACK_LINK_NAME = "chorus_ii"
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
CHROMIUM_FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]


def find_comfyui_dir() -> Path | None:
    """The ComfyUI checkout to test against, or None (see the module docstring for the order)."""
    candidates = []
    if os.environ.get("COMFYUI_DIR"):
        candidates.append(Path(os.environ["COMFYUI_DIR"]))
    candidates.append(Path("/opt/ComfyUI"))
    if PACK_ROOT.parent.name == "custom_nodes":
        candidates.append(PACK_ROOT.parent.parent)
    for path in candidates:
        if (path / "main.py").is_file() and (path / "comfy").is_dir():
            return path
    return None


def find_chromium() -> str | None:
    """Path of a Chromium binary (env ``CHROMIUM`` first), or None."""
    for path in ([os.environ["CHROMIUM"]] if os.environ.get("CHROMIUM") else []) + list(CHROMIUM_CANDIDATES):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """A headless ComfyUI subprocess with this pack loaded. ``url``, ``log_path``, ``get_json(path)``."""

    def __init__(self, comfy_dir: Path, startup_timeout: float = 180.0):
        self.comfy_dir = Path(comfy_dir)
        self.workdir = Path(tempfile.mkdtemp(prefix="chorus_comfy_"))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "server.log"
        custom_nodes = self.workdir / "custom_nodes"
        custom_nodes.mkdir()
        (custom_nodes / PACK_LINK_NAME).symlink_to(PACK_ROOT, target_is_directory=True)
        for sub in ("output", "input", "temp", "user"):
            (self.workdir / sub).mkdir()
        yaml_path = self.workdir / "extra_model_paths.yaml"
        yaml_path.write_text(f"chorus_test:\n  base_path: {self.workdir}\n  custom_nodes: custom_nodes\n")
        cmd = [
            sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
            "--extra-model-paths-config", str(yaml_path),
            "--disable-all-custom-nodes", "--whitelist-custom-nodes", PACK_LINK_NAME,
            "--output-directory", str(self.workdir / "output"), "--input-directory", str(self.workdir / "input"),
            "--temp-directory", str(self.workdir / "temp"), "--user-directory", str(self.workdir / "user"),
            "--database-url", "sqlite:///:memory:", "--disable-api-nodes", "--disable-auto-launch",
        ]
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=self.comfy_dir, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        atexit.register(self.stop)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode} during startup:\n{self.log_tail()}")
            try:
                self.get_json("/system_stats", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"ComfyUI did not answer within {startup_timeout:.0f} s:\n{self.log_tail()}")
                time.sleep(0.5)

    def get_json(self, path: str, timeout: float = 30):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return json.loads(response.read())

    def post_json(self, path: str, body, timeout: float = 30):
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        if getattr(self, "_log", None) is not None and not self._log.closed:
            self._log.close()


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
