"""Test helper: a headless ComfyUI subprocess on CPU with this pack (and test-only nodes) loaded.

``ComfyHost(comfy_dir, base_dir)`` starts ``main.py --cpu --use-pytorch-cross-attention --listen 127.0.0.1 --port <free>
--base-directory <base_dir>`` with every custom node disabled except the whitelisted folders in
``<base_dir>/custom_nodes`` (the pack is symlinked there by :func:`prepare_base`). The base
directory holds models/, input/, output/, temp/, user/, so a restart on the same base keeps the
cache workspaces (under user/). ``queue(graph)`` posts to ``/prompt`` and polls ``/history`` until
the prompt finished. On the CPU the server also gets ``--use-pytorch-cross-attention``: it attends with SDPA,
ComfyUI's attention on a GPU, as the in-process tests do (``tiny_wan.py``). ``cpu=False`` (GPU tests) leaves
both flags out; ``extra_args`` (e.g. ``--use-sage-attention``) and ``extra_env`` go to the subprocess. Nothing
is downloaded; the frontend package must be installed (ComfyUI exits without it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parents[2]
PACK_LINK = "chorus_ii"
TEST_NODES = "chorus_test_nodes"


def prepare_base(base_dir: Path) -> Path:
    """Create the base folder layout with the pack symlinked and the test-only node copied in."""
    base_dir = Path(base_dir)
    for sub in ("models/diffusion_models", "models/vae", "custom_nodes", "input", "output", "temp", "user"):
        (base_dir / sub).mkdir(parents=True, exist_ok=True)
    link = base_dir / "custom_nodes" / PACK_LINK
    if not link.exists():
        link.symlink_to(PACK_ROOT, target_is_directory=True)
    nodes = base_dir / "custom_nodes" / TEST_NODES
    nodes.mkdir(exist_ok=True)
    shutil.copyfile(Path(__file__).parent / "conditioning_node.py", nodes / "__init__.py")
    shutil.copyfile(Path(__file__).parent / "comfy038.py", nodes / "comfy038.py")  # its window conds (env-gated)
    return base_dir


def server_requirement_missing() -> str | None:
    """Why ComfyUI's server cannot start in this Python (it exits at startup without its frontend
    package), or None. Checked before a launch so that such a machine skips with this reason instead of
    failing; under ``CHORUS_REQUIRE_HOST=1`` (CI) the skip is turned into a failure (tests/conftest.py)."""
    import importlib.util

    if importlib.util.find_spec("comfyui_frontend_package") is None:
        return ("ComfyUI's server needs its frontend package, not installed in this Python "
                "(pip install -r <ComfyUI>/requirements.txt)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyHost:
    def __init__(self, comfy_dir: Path, base_dir: Path, startup_timeout: float = 120.0,
                 extra_env: dict | None = None, extra_args: list | None = None, cpu: bool = True):
        missing = server_requirement_missing()
        if missing:
            import pytest

            pytest.skip(missing)
        self.comfy_dir, self.base_dir = Path(comfy_dir), Path(base_dir)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.base_dir / f"server_{self.port}.log"
        cpu_flags = ["--cpu", "--use-pytorch-cross-attention"] if cpu else []
        cmd = [sys.executable, "main.py", *cpu_flags, "--listen", "127.0.0.1", "--port", str(self.port),
               "--base-directory", str(self.base_dir), "--user-directory", str(self.base_dir / "user"),
               "--disable-all-custom-nodes", "--whitelist-custom-nodes", PACK_LINK, TEST_NODES,
               "--database-url", "sqlite:///:memory:", "--disable-api-nodes", "--disable-auto-launch",
               *(extra_args or [])]
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("CHORUS_CACHE_DIR", None)  # the cache must land in ComfyUI's user directory
        env.update(extra_env or {})  # e.g. CHORUS_CACHE_DIR: several servers sharing one cache root
        self.proc = subprocess.Popen(cmd, cwd=self.comfy_dir, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode} during startup:\n{self.log_tail()}")
            try:
                self.get_json("/system_stats", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"ComfyUI did not answer within {startup_timeout:.0f} s:\n{self.log_tail()}")
                time.sleep(0.3)

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

    def queue(self, graph: dict, timeout: float = 120.0) -> dict:
        """Queue an API-format graph; return its ``/history`` record once finished (raises on timeout
        or a rejected prompt)."""
        status, body = self.post_json("/prompt", {"prompt": graph, "client_id": uuid.uuid4().hex})
        if status != 200:
            raise AssertionError(f"/prompt rejected the graph ({status}): {json.dumps(body)[:2000]}")
        prompt_id = body["prompt_id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.get_json(f"/history/{prompt_id}")
            record = history.get(prompt_id)
            if record and record.get("status", {}).get("completed") is not None and (
                    record["status"].get("status_str") in ("success", "error")):
                return record
            time.sleep(0.2)
        raise AssertionError(f"prompt {prompt_id} did not finish within {timeout:.0f} s:\n{self.log_tail()}")

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
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)
        if getattr(self, "_log", None) is not None and not self._log.closed:
            self._log.close()
