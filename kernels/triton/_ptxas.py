"""Which ptxas assembles the warp-specialised Gluon kernel (:mod:`._attention_ws`) for sm_90, pinned per variant.

Measured on an H200 (2026-12-04, Nsight Compute, 720p, 15%; ``docs/BENCHMARK_LOG.md``): ptxas 13.0 and 13.3 build
every FP8 form of the kernel 0.3-1.3 ms faster than Triton 3.6's own (12.8), and they alone assemble right the
form whose pooled tiles run in a loop of their own (``POOLED_LOOP``): ptxas before 13.0 gets that loop wrong when
it is a query block's only one (its map row keeps nothing: the first consumer warpgroup's 64 rows off). The INT8
variant, whose pooled tiles have always had their own loop, runs 4% slower by 13.0 than by 12.8 and spills more by
13.3, and no caller of ours gives it a row that keeps nothing. Hence:

- the FP8 kernel, every form: :func:`fixed_ptxas`, the first ptxas >= :data:`FIXED_PTXAS` (13.0) among

  1. Triton's own for sm_90 (:func:`triton_ptxas`);
  2. the one a CUDA 13 torch wheel bundles (``torch/bin/ptxas``: 13.0 in torch 2.11+cu130);
  3. Triton's ``ptxas-blackwell`` (Triton 3.8 bundles ptxas 13.3 for sm_100 under that name);
  4. the ``nvidia-cuda-nvcc`` wheel's (``pip install "chorus-ii[ptxas]"``),

  only where the driver runs CUDA 13 code: a CUDA 13 build of torch (which runs on nothing older), or a CUDA 12
  torch on a driver that reports CUDA >= 13 (:func:`driver_cuda_version`; Triton loads the kernel's cubin through
  the driver, not torch's runtime), and never one whose major version is above the driver's; where none is
  found, Triton's own, and the pooled tiles in the kept blocks' loop;
- the INT8 kernel: Triton's own (:func:`triton_ptxas`).

Pinned, because Triton's own can change inside a process: TorchInductor's first compile sets
``TRITON_PTXAS_PATH`` to the ptxas a CUDA 13 torch wheel bundles where it is unset, and every Triton kernel built
after that would be assembled by it, those built before by Triton's bundled one. :func:`triton_ptxas` therefore
takes ``TRITON_PTXAS_PATH`` only where it names another ptxas than torch's, and :func:`assembling` sets Triton's
``ptxas`` knob around every launch of the kernel, with a cache directory per assembler version (Triton's compile
cache key does not change with the assembler, so a kernel built by one ptxas would otherwise be reused for
another). The choice is made once per process. ``CHORUS_PTXAS=triton`` turns the search off (Triton's own ptxas
for every variant).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import logging
import os
import re
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch

try:
    from triton.runtime.errors import PTXASError
except ImportError:  # (no Triton, or an older one without that error: nothing to tell apart)
    PTXASError = ()

LOG = logging.getLogger(__name__)
T = TypeVar("T")
# the oldest ptxas measured to assemble the pooled tiles' own loop right and every FP8 form fast (H200: 13.0 and
# 13.3 within 0.1 ms of each other in every form, the GPU cases of both)
FIXED_PTXAS = (13, 0)
ENV_PTXAS = "CHORUS_PTXAS"
_PTXAS_NAME = "ptxas" + (sysconfig.get_config_var("EXE") or "")  # (ptxas.exe on Windows)


@dataclass(frozen=True)
class Assembler:
    """A ptxas: its ``path``, ``version`` (major, minor), where it was found (``source``) and whether it is
    Triton's own for sm_90 (``triton_default``: :func:`triton_ptxas`)."""

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


def _torch_ptxas() -> str:
    return str(Path(torch.__file__).parent / "bin" / _PTXAS_NAME)


@functools.lru_cache(maxsize=1)
def triton_ptxas() -> Assembler | None:
    """Triton's own ptxas for sm_90: the one ``TRITON_PTXAS_PATH`` names, unless that is torch's bundled ptxas
    (which TorchInductor's first compile sets it to: module docstring), else the one Triton bundles; None where
    neither runs (no Triton). Decided once per process (:func:`reset`)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.origin:
        return None
    bundled = str(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / _PTXAS_NAME)
    named = os.environ.get("TRITON_PTXAS_PATH")
    set_by_inductor = bool(named) and os.path.realpath(named) == os.path.realpath(_torch_ptxas())
    for path in ([named] if named and not set_by_inductor else []) + [bundled]:
        version = ptxas_version(path)
        if version is not None:
            return Assembler(path, version, "Triton's sm_90 ptxas", triton_default=True)
    return None


def candidates() -> list[Assembler]:
    """Every ptxas :func:`fixed_ptxas` considers, in its order, with the version each reports (those that do
    not run are left out)."""
    found = [asm for asm in [triton_ptxas()] if asm is not None]
    tools = []
    if os.path.isfile(_torch_ptxas()):
        tools.append((_torch_ptxas(), "torch's bundled ptxas"))
    try:
        from triton import knobs  # noqa: PLC0415

        tools.append((knobs.nvidia.ptxas_blackwell.path, "Triton's ptxas-blackwell"))
    except (ImportError, AttributeError, RuntimeError):
        pass
    wheel = _nvcc_wheel_ptxas()
    if wheel:
        tools.append((wheel, "the nvidia-cuda-nvcc wheel"))
    for path, source in tools:
        version = ptxas_version(path)
        if version is not None:
            found.append(Assembler(path, version, source))
    return found


_REFUSED: dict[str, str] = {}  # path -> why it failed to assemble this process's kernel (run_assembled)


@functools.lru_cache(maxsize=1)
def driver_cuda_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the CUDA version the installed NVIDIA driver supports (``cuDriverGetVersion``:
    13.0 for the 580 drivers), or None where no driver library loads (no NVIDIA driver: a CPU machine). Needs no
    GPU context. Read once per process."""
    for name in ("nvcuda.dll",) if os.name == "nt" else ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        try:
            status = lib.cuDriverGetVersion(ctypes.byref(version))
        except AttributeError:  # (a library of that name without the driver API)
            return None
        return (version.value // 1000, version.value % 1000 // 10) if status == 0 and version.value > 0 else None
    return None


def _torch_cuda_major() -> int | None:
    cuda = torch.version.cuda
    return int(cuda.split(".")[0]) if cuda else None


def _cuda_ceiling() -> int | None:
    """The newest CUDA major version whose assembler's code can run here: the driver's where it can be read,
    else that of torch's build (a CUDA 13 torch runs on CUDA 13 drivers only); None for a CPU build of torch on a
    machine without a driver."""
    driver = driver_cuda_version()
    return driver[0] if driver is not None else _torch_cuda_major()


def _why_not_searched() -> str | None:
    if os.environ.get(ENV_PTXAS, "").strip().lower() == "triton":
        return f"{ENV_PTXAS}=triton"
    ceiling = _cuda_ceiling()
    if ceiling is None or ceiling < FIXED_PTXAS[0]:
        driver = driver_cuda_version()
        where = (f"torch is built for CUDA {torch.version.cuda or 'none'}" +
                 (f" and the driver runs CUDA {driver[0]}.{driver[1]}" if driver else ", no NVIDIA driver found"))
        return f"{where} (a CUDA {FIXED_PTXAS[0]} assembler's kernels need a CUDA {FIXED_PTXAS[0]} driver)"
    return None


@functools.lru_cache(maxsize=1)
def fixed_ptxas() -> Assembler | None:
    """The ptxas the FP8 kernel is assembled with, every form, and the one that lets it run its pooled tiles in
    a loop of their own (module docstring: the search), or None (then Triton's own, and the FP8 kernel's single
    loop). Decided once per process, so every build of the kernel in it has the same form and assembler.
    ``CHORUS_PTXAS`` set to anything but ``triton`` is ignored with a warning (no other value means anything)."""
    setting = os.environ.get(ENV_PTXAS, "").strip()
    if setting and setting.lower() != "triton":
        LOG.warning("Chorus: %s=%r is not a setting (the only one is %s=triton: Triton's own ptxas); ignored",
                    ENV_PTXAS, setting, ENV_PTXAS)
    if _why_not_searched():
        return None
    ceiling = _cuda_ceiling()
    return next((asm for asm in candidates() if FIXED_PTXAS <= asm.version and asm.version[0] <= ceiling
                 and asm.path not in _REFUSED), None)


def kernel_ptxas(int8: bool) -> Assembler | None:
    """The ptxas that builds the warp-specialised kernel's FP8 (``int8`` False) or INT8 variant: FP8
    :func:`fixed_ptxas`, where found, else Triton's own; INT8 Triton's own (:func:`triton_ptxas`). The first
    answer for each variant and assembler is logged (:func:`_announce`)."""
    asm = triton_ptxas() if int8 else (fixed_ptxas() or triton_ptxas())
    _announce(int8, asm)
    return asm


@functools.lru_cache(maxsize=None)
def _announce(int8: bool, asm: Assembler | None) -> None:
    """One INFO line per variant and assembler in a process (ComfyUI's log shows INFO): which ptxas builds the
    kernel, and for an FP8 kernel built by an older one, why, or what to install where a newer one would run."""
    hint = ""
    if not int8 and not pooled_loop_right(asm):
        why = _why_not_searched()
        if why is None:
            hint = (f"; a ptxas >= {FIXED_PTXAS[0]}.{FIXED_PTXAS[1]} builds it faster (about 1 ms a 720p call with "
                    "the pooled tail): install the pack's `ptxas` extra, docs/INSTALL.md")
        elif not why.startswith(ENV_PTXAS):
            hint = f": {why}"
    LOG.info("Chorus: the warp-specialised %s kernel is built by %s%s", "INT8" if int8 else "FP8",
             asm.label if asm is not None else "Triton's ptxas", hint)


def pooled_loop_right(asm: Assembler | None) -> bool:
    """Whether ``asm`` assembles the pooled tiles' own loop right (version >= :data:`FIXED_PTXAS`)."""
    return asm is not None and asm.version >= FIXED_PTXAS


def describe() -> str:
    """One line for logs and the benchmark's header: the assembler of each variant, and for FP8 why where no
    fixed one was found."""
    fp8, int8 = kernel_ptxas(False), kernel_ptxas(True)
    refused = "".join(f"; {path} failed: {reason}" for path, reason in _REFUSED.items())
    int8_part = f"; INT8 by {int8.label if int8 else 'Triton'}"
    if fixed_ptxas() is not None:
        return f"FP8 by {fp8.label}, the pooled tiles in a loop of their own{int8_part}{refused}"
    why = _why_not_searched() or f"no ptxas >= {FIXED_PTXAS[0]}.{FIXED_PTXAS[1]} found"
    return (f"FP8 by {fp8.label if fp8 else 'Triton'} ({why}), the pooled tiles in its kept blocks' loop"
            f"{int8_part}{refused}")


@contextlib.contextmanager
def assembling(asm: Assembler | None):
    """Triton builds the kernels compiled inside with ``asm`` (None: nothing changes), cached in a directory of
    their own (``<Triton's cache>/chorus-ptxas-<major>.<minor>``). Scoped: Triton's knobs and the environment
    variables they set are restored on exit. Costs ~10-35 us (Triton's knob scopes); only a launch that builds
    needs it, but which launch builds is Triton's to know, so the launcher takes it on every call."""
    if asm is None:
        yield
        return
    from triton import knobs  # noqa: PLC0415

    with knobs.nvidia.scope(), knobs.cache.scope():
        cache_dir = os.path.join(knobs.cache.dir, f"chorus-ptxas-{asm.version[0]}.{asm.version[1]}")
        knobs.nvidia.ptxas = asm.path
        knobs.cache.dir = cache_dir
        yield


def reset() -> None:
    """Forget the choices and any refused assembler: the next call searches again (tests; a process that
    installed a ptxas since)."""
    _REFUSED.clear()
    fixed_ptxas.cache_clear()
    triton_ptxas.cache_clear()
    driver_cuda_version.cache_clear()
    _announce.cache_clear()


def run_assembled(asm: Assembler | None, build: Callable[[Assembler | None], T]) -> T:
    """``build(asm)`` inside :func:`assembling` ``(asm)``. If a ptxas other than Triton's own fails to assemble
    it (Triton's ``PTXASError``: a crash, an unknown option, a PTX it does not take), ``asm`` is refused for the
    rest of the process (one warning; :func:`fixed_ptxas` then looks past it) and ``build(triton_ptxas())``
    runs instead, inside that one's scope. Any other error, or Triton's own failing, propagates."""
    try:
        with assembling(asm):
            return build(asm)
    except PTXASError as exc:
        if asm is None or asm.triton_default:
            raise
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        _REFUSED[asm.path] = reason
        fixed_ptxas.cache_clear()
        LOG.warning("Chorus: %s could not assemble the warp-specialised kernel (%s); using Triton's own ptxas "
                    "from now on in this process", asm.label, reason)
    own = triton_ptxas()
    with assembling(own):
        return build(own)


__all__ = ["Assembler", "FIXED_PTXAS", "ENV_PTXAS", "assembling", "candidates", "describe", "driver_cuda_version",
           "fixed_ptxas", "kernel_ptxas", "pooled_loop_right", "ptxas_version", "reset", "run_assembled",
           "triton_ptxas"]
