"""Suite-wide pytest hooks, and the fleet tests' PostgreSQL fixtures.

``CHORUS_REQUIRE_HOST=1`` (set by ``.ci/run`` once it has a ComfyUI checkout) turns a test that skips
for want of the host (no ComfyUI checkout, ComfyUI not importable, no workflow templates package) into
a failure, so CI never passes while silently skipping the host tests.

The Triton interpreter cases (``tests/test_triton_interpret_cases.py``) run in a subprocess of their own
(``tests/test_triton_cpu.py``); once collection has kept that test, the subprocess starts at once, so its
few single-threaded minutes run beside the rest of the suite instead of after it (``interpreter_cases``).

``nodes`` (the ``chorus.nodes`` package with ``CHORUS_CACHE_DIR`` in the test's temporary folder: the in-process
node tests' workspaces) serves ``tests/test_nodes_inprocess.py`` and ``tests/test_gguf_host.py``.

``pg`` (a throwaway PostgreSQL cluster of ``tests/fleet_pg.py``, per test module; skips with the
reason where it cannot start) and ``url`` (a fresh database on it, per test) serve
``tests/test_fleet_store.py`` and ``tests/test_fleet_hostile.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# "ComfyUI at <dir> does not import: ..." is tests/host/tiny_wan.py's reason for a checkout missing a requirement
HOST_SKIP_MARKERS = ("no ComfyUI checkout", "ComfyUI not available", "ComfyUI is not importable", "ComfyUI at ",
                     "comfyui-workflow-templates", "comfyui_workflow_templates")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CHORUS_REQUIRE_HOST") != "1" or not report.skipped:
        return
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if any(marker in reason for marker in HOST_SKIP_MARKERS):
        report.outcome = "failed"
        report.longrepr = f"host test skipped although CI has a ComfyUI checkout (CHORUS_REQUIRE_HOST=1): {reason}"


INTERPRETER_TEST = "test_triton_kernels_under_interpreter"
INTERPRETER_CASES = Path(__file__).with_name("test_triton_interpret_cases.py")
_interpreter_run = pytest.StashKey[tuple]()


def _start_interpreter_cases() -> tuple:
    """``(process, output file)``: ``pytest`` on the interpreter cases with ``TRITON_INTERPRET=1``, its
    output in an unnamed temporary file (read when the test collects it)."""
    output = tempfile.TemporaryFile(mode="w+")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(INTERPRETER_CASES)],
                            env=env, stdout=output, stderr=subprocess.STDOUT, text=True,
                            cwd=str(INTERPRETER_CASES.parent.parent))
    return proc, output


def pytest_collection_finish(session):
    """Start the interpreter cases if the session kept their test and none of its own ``skipif`` conditions
    (booleans, in ``test_triton_cpu.py``) holds."""
    if session.config.option.collectonly:
        return
    if any(item.name == INTERPRETER_TEST and not any(mark.args and mark.args[0] is True
                                                     for mark in item.iter_markers("skipif"))
           for item in session.items):
        session.config.stash[_interpreter_run] = _start_interpreter_cases()


def pytest_sessionfinish(session):
    run = session.config.stash.get(_interpreter_run, None)
    if run is not None and run[0].poll() is None:  # the session stopped before the test collected it
        run[0].kill()
        run[0].wait()


@pytest.fixture
def interpreter_cases(request):
    """The interpreter cases' finished run: ``(returncode, output)`` (started at collection, else now)."""
    proc, output = request.config.stash.get(_interpreter_run, None) or _start_interpreter_cases()
    try:
        proc.wait(timeout=1500)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with output:
        output.seek(0)
        return proc.returncode, output.read()


@pytest.fixture()
def nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "cache"))
    import chorus.nodes as nodes_pkg

    return nodes_pkg


@pytest.fixture(scope="module")
def pg():
    """Module-scoped: another module (``tests/test_fleet_serving.py``) stops the process-wide
    cluster when it is done, so each module asks for a running one."""
    import fleet_pg

    cluster = fleet_pg.require()
    yield cluster
    fleet_pg.stop()


@pytest.fixture
def url(pg):
    return pg.url(pg.new_database())
