"""Runs the Triton interpreter cases (``test_triton_interpret_cases.py``) on CPU in a subprocess.

Triton chooses interpreted or compiled kernels when a kernel is defined (at import), from the
``TRITON_INTERPRET`` environment variable; a subprocess keeps that choice out of this process (and out
of GPU tests that may share it). The subprocess starts as soon as collection keeps this test
(``conftest.py``: ``interpreter_cases``) and runs beside the rest of the suite: about 3 minutes of one core.
"""

from __future__ import annotations

import os

import pytest


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the cases run directly in this process")
@pytest.mark.skipif(not _triton_importable(), reason="triton is not installed")
def test_triton_kernels_under_interpreter(interpreter_cases):
    returncode, output = interpreter_cases
    tail = output[-6000:]
    assert returncode == 0, f"interpreter cases failed:\n{tail}"
    assert " passed" in output and " skipped" not in output.strip().splitlines()[-1], tail
