"""One headless ComfyUI per pytest process for the tests that RUN graphs with tiny stand-in models.

``shared_run_host()`` starts (once) ``server.py``'s ``ComfyHost`` on a fresh temporary base folder
whose ``models/`` the tests fill with tiny random-weight files under the names the graphs use:
``ensure_model("vae", "wan2.2_vae.safetensors", builder)`` writes ``builder()``'s state dict there
once per process (ComfyUI re-lists a model folder when its mtime changes, so files may be added
after the server started). Kept apart from ``frontend/comfy_host.py``'s shared server on purpose:
that one must have NO model files (``test_workflows_host.py`` checks that validation reports every
model file missing). Used by ``test_workflows_run.py`` and ``test_combinations_host.py``.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest

from host import server as hostlib
from host import tiny_wan as tiny

_SHARED: dict = {}


def run_host_or_skip():
    """The process's run server for a module fixture; skips (with the reason) when there is none."""
    srv = shared_run_host()
    if isinstance(srv, str):
        pytest.skip(srv)
    return srv


def shared_run_host():
    """The process's run server, or a string saying why there is none (a skip reason)."""
    if "host" not in _SHARED:
        reason = tiny.import_comfy()
        if reason:
            _SHARED["host"] = reason
        else:
            base = hostlib.prepare_base(Path(tempfile.mkdtemp(prefix="chorus_run_")))
            for sub in ("loras", "clip_vision"):
                (base / "models" / sub).mkdir(parents=True, exist_ok=True)
            try:
                # later ComfyUI's window conds on a host without them (the long-video workflow; conditioning_node.py)
                host = hostlib.ComfyHost(tiny.find_comfyui_dir(), base, startup_timeout=180,
                                         extra_env={"CHORUS_TEST_WINDOW_CONDS": "1"})
            except RuntimeError:
                shutil.rmtree(base, ignore_errors=True)
                raise

            def stop_and_clean():  # the stand-ins are ~3 GB (full-size VAEs, CLIP vision): never left in /tmp
                host.stop()
                shutil.rmtree(base, ignore_errors=True)

            atexit.register(stop_and_clean)
            _SHARED["host"] = host
            _SHARED["models"] = set()
    return _SHARED["host"]


def ensure_model(subdir: str, name: str, build) -> Path:
    """``models/<subdir>/<name>`` of the run server, written from ``build()`` (a state dict) on first use."""
    host = shared_run_host()
    if isinstance(host, str):
        raise RuntimeError(host)
    path = host.base_dir / "models" / subdir / name
    if (subdir, name) not in _SHARED["models"]:
        tiny.save_safetensors(build(), path)
        _SHARED["models"].add((subdir, name))
    return path


def ensure_input_image(name: str = "example.png", color=(150, 110, 70), size: int = 64) -> Path:
    from PIL import Image

    host = shared_run_host()
    path = host.base_dir / "input" / name
    if not path.exists():
        Image.new("RGB", (size, size), color).save(path)
    return path
