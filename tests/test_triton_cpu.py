"""Runs the Triton interpreter cases (``test_triton_interpret_cases.py``) on CPU in a subprocess.

Triton chooses interpreted or compiled kernels when a kernel is defined (at import), from the
``TRITON_INTERPRET`` environment variable; a subprocess keeps that choice out of this process (and out
of GPU tests that may share it). About 6 minutes on 2 idle cores (the pooled tail's cases ~2 of them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("test_triton_interpret_cases.py")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the cases run directly in this process")
@pytest.mark.skipif(not _triton_importable(), reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                          env=env, capture_output=True, text=True, timeout=1500, cwd=str(CASES.parent.parent))
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter cases failed:\n{tail}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1], tail
