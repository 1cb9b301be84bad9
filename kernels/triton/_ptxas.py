"""Which ptxas assembles the warp-specialised Gluon kernel (:mod:`._attention_ws`) for sm_90.

ptxas before 13.3 miscompiles that kernel's loop of pooled tiles when it is a query block's only loop (its
map row keeps nothing): the first consumer warpgroup's 64 rows come out off, the second's are right, and
the same PTX assembled by ptxas 13.3 is right on every run (H200, 2026-12-04; Triton 3.6 assembles sm_90 with
ptxas 12.8, Triton 3.8 with 12.9). The FP8 variant runs its pooled tiles that way (faster with the tail:
``docs/BENCHMARKS.md``) only when :func:`fixed_ptxas` finds an assembler that gets it right, and otherwise keeps
them in its kept blocks' loop. The INT8 variant has always had the separate loop and stays on Triton's ptxas
(13.3 spills 24 bytes more in it); no caller of ours gives it a row that keeps nothing.

:func:`fixed_ptxas` takes the first ptxas of version >= :data:`FIXED_PTXAS` among

1. Triton's own for sm_90 (``TRITON_PTXAS_PATH``, else the one Triton bundles);
2. the one a CUDA 13 torch wheel bundles (``torch/bin/ptxas``: 13.0 in torch 2.11+cu130, below the floor);
3. Triton's ``ptxas-blackwell`` (Triton 3.8 bundles ptxas 13.3 for sm_100 under that name);
4. the ``nvidia-cuda-nvcc`` wheel's (``pip install "chorus-ii[ptxas]"``),

and only under a CUDA 13 build of torch (a CUDA 13 assembler's cubin needs a CUDA 13 driver, and a CUDA 13
torch runs on nothing older). Triton's own may change inside a process: TorchInductor's first compile sets
``TRITON_PTXAS_PATH`` to the ptxas a CUDA 13 torch wheel bundles (``torch/bin/ptxas``, 13.0) when it is unset, so
the choice is made once, at the first launch, and the form it picks is built by the same assembler every time.
``CHORUS_PTXAS=triton`` turns the search off (Triton's own assembler, the FP8 kernel's single loop).
:func:`assembling` scopes Triton's ``ptxas`` knob to the chosen one around a launch or a build, with a cache
directory of its own: Triton's compile cache key does not change with the assembler, so a kernel built by one
ptxas would otherwise be reused for the other.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import re
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    from triton.runtime.errors import PTXASError
except ImportError:  # (no Triton, or an older one without that error: nothing to tell apart)
    PTXASError = ()

LOG = logging.getLogger(__name__)
# the ptxas measured to assemble the pooled tiles' own loop right *and* fast (H200: 60 GPU cases, the request of
# record). 13.0 (the one a CUDA 13 torch wheel bundles) assembled it right in the empty-row cases too; its speed
# is not measured, so it is not chosen
FIXED_PTXAS = (13, 3)
ENV_PTXAS = "CHORUS_PTXAS"
_PTXAS_NAME = "ptxas" + (sysconfig.get_config_var("EXE") or "")  # (ptxas.exe on Windows)


@dataclass(frozen=True)
class Assembler:
    """A ptxas: its ``path``, ``version`` (major, minor), where it was found (``source``) and whether it is
    the one Triton uses for sm_90 anyway (``triton_default``: no knob needs changing)."""

    path: str
    version: tuple[int, int]
    source: str
    triton_default: bool = False

    @property
    def label(self) -> str:
        return f"ptxas {self.version[0]}.{self.version[1]} ({self.source})"


@functools.lru_cache(maxsize=None)
def ptxas_version(path: str) -> tuple[int, int] | None:
    """``(major, minor)`` that ``path --version`` reports ("release 13.3"), or None where it does not run."""
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _nvcc_wheel_ptxas() -> str | None:
    """The ``nvidia-cuda-nvcc`` wheel's ptxas (``nvidia/cu13/bin``), where that wheel is installed."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(root).glob(f"cu*/bin/{_PTXAS_NAME}")):
            return str(path)
    return None


def candidates() -> list[Assembler]:
    """Every ptxas :func:`fixed_ptxas` considers, in its order, with the version each reports (those that do
    not run are left out)."""
    found = []
    try:
        from triton import knobs  # noqa: PLC0415
    except ImportError:
        knobs = None
    tools = []
    if knobs is not None:
        for name, source, default in (("ptxas", "Triton's sm_90 ptxas", True),
                                      ("ptxas_blackwell", "Triton's ptxas-blackwell", False)):
            try:
                tools.append((getattr(knobs.nvidia, name).path, source, default))
            except (AttributeError, RuntimeError):
                pass
    bundled_by_torch = Path(torch.__file__).parent / "bin" / _PTXAS_NAME
    if bundled_by_torch.is_file():
        tools.insert(1 if tools else 0, (str(bundled_by_torch), "torch's bundled ptxas", False))
    wheel = _nvcc_wheel_ptxas()
    if wheel:
        tools.append((wheel, "the nvidia-cuda-nvcc wheel", False))
    for path, source, default in tools:
        version = ptxas_version(path)
        if version is not None:
            found.append(Assembler(path, version, source, default))
    return found


_REFUSED: dict[str, str] = {}  # path -> why it failed to assemble this process's kernel (run_assembled)


def _why_not_searched() -> str | None:
    if os.environ.get(ENV_PTXAS, "").strip().lower() == "triton":
        return f"{ENV_PTXAS}=triton"
    cuda = torch.version.cuda
    if not cuda or int(cuda.split(".")[0]) < FIXED_PTXAS[0]:
        return (f"torch is built for CUDA {cuda or 'none'} (a CUDA {FIXED_PTXAS[0]} assembler's kernels need "
                f"CUDA {FIXED_PTXAS[0]})")
    return None


@functools.lru_cache(maxsize=1)
def fixed_ptxas() -> Assembler | None:
    """The ptxas the warp-specialised kernel is assembled with when it runs its pooled tiles in a loop of their
    own (module docstring: the search), or None (then Triton's own, and the FP8 kernel's single loop). Decided
    once per process, so every build of the kernel in it has the same form and assembler. ``CHORUS_PTXAS`` set to
    anything but ``triton`` is ignored with a warning (no other value means anything)."""
    setting = os.environ.get(ENV_PTXAS, "").strip()
    if setting and setting.lower() != "triton":
        LOG.warning("Chorus: %s=%r is not a setting (the only one is %s=triton: Triton's own ptxas); ignored",
                    ENV_PTXAS, setting, ENV_PTXAS)
    if _why_not_searched():
        return None
    return next((asm for asm in candidates() if asm.version >= FIXED_PTXAS and asm.path not in _REFUSED), None)


def describe() -> str:
    """One line for logs and the benchmark's header: the assembler :func:`fixed_ptxas` chose, or why none."""
    asm = fixed_ptxas()
    refused = "".join(f"; {path} failed: {reason}" for path, reason in _REFUSED.items())
    if asm is not None:
        return f"{asm.label}: the FP8 kernel's pooled tiles in a loop of their own{refused}"
    why = _why_not_searched() or f"no ptxas >= {FIXED_PTXAS[0]}.{FIXED_PTXAS[1]} found"
    return f"Triton's own ptxas ({why}{refused}): the FP8 kernel's pooled tiles in its kept blocks' loop"


@contextlib.contextmanager
def assembling(asm: Assembler | None):
    """Triton builds the kernels compiled inside with ``asm`` (None, or Triton's own: nothing changes), cached
    in a directory of their own (``<Triton's cache>/chorus-ptxas-<major>.<minor>``). Scoped: Triton's knobs and
    the environment variables they set are restored on exit."""
    if asm is None or asm.triton_default:
        yield
        return
    from triton import knobs  # noqa: PLC0415

    with knobs.nvidia.scope(), knobs.cache.scope():
        cache_dir = os.path.join(knobs.cache.dir, f"chorus-ptxas-{asm.version[0]}.{asm.version[1]}")
        knobs.nvidia.ptxas = asm.path
        knobs.cache.dir = cache_dir
        yield


def reset() -> None:
    """Forget the choice and any refused assembler: the next :func:`fixed_ptxas` searches again (tests; a
    process that installed a ptxas since)."""
    _REFUSED.clear()
    fixed_ptxas.cache_clear()


def run_assembled(asm: Assembler | None, with_asm, without):
    """``with_asm()`` inside :func:`assembling` ``(asm)``; if that ptxas fails to assemble it (Triton's
    ``PTXASError``: a crash, an unknown option, a PTX it does not take), ``asm`` is refused for the rest of the
    process (one warning; :func:`fixed_ptxas` then looks past it) and ``without()`` runs instead, outside the
    scope. Any other error propagates. ``asm`` None: ``without()``."""
    if asm is None:
        return without()
    try:
        with assembling(asm):
            return with_asm()
    except PTXASError as exc:
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        _REFUSED[asm.path] = reason
        fixed_ptxas.cache_clear()
        LOG.warning("Chorus: %s could not assemble the warp-specialised kernel (%s); using Triton's own ptxas "
                    "from now on in this process", asm.label, reason)
    return without()


__all__ = ["Assembler", "FIXED_PTXAS", "ENV_PTXAS", "assembling", "candidates", "describe", "fixed_ptxas",
           "ptxas_version", "reset", "run_assembled"]
