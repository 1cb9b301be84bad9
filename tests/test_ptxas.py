"""Which ptxas assembles each variant of the warp-specialised kernel (``chorus.kernels.triton._ptxas``), on the CPU
with the installed Triton's real assemblers: the search's order and version floor, its opt-out and the CUDA 13
rule (torch's build or the driver's version), Triton's own pinned against TorchInductor's switch, the knobs' scope,
a failing assembler dropped, and that a kernel assembled by the chosen ptxas is cached apart from Triton's own build
of it (Triton's cache key does not change with the assembler), and the one log line per variant. The GPU half (the
loop it enables is right on a query block that keeps nothing): tests/test_kernels_ws_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from chorus.kernels.triton import _ptxas  # noqa: E402


@pytest.fixture
def fresh_choice():
    _ptxas.reset()
    yield
    _ptxas.reset()


def test_every_candidate_reports_its_real_version_and_triton_s_own_comes_first():
    found = _ptxas.candidates()
    assert found, "the installed Triton bundles a ptxas"
    assert found[0].triton_default and found[0].path == triton.knobs.nvidia.ptxas.path
    for asm in found:
        assert asm.version == _ptxas.ptxas_version(asm.path) and asm.version >= (11, 0), asm
        assert os.access(asm.path, os.X_OK)
    assert _ptxas.ptxas_version(os.devnull) is None  # not a program: no version, no exception
    torch_bin = os.path.join(os.path.dirname(torch.__file__), "bin", "ptxas")
    torch_bundles_one = os.path.isfile(torch_bin) and _ptxas.ptxas_version(torch_bin) is not None
    assert any(asm.path == torch_bin for asm in found) == torch_bundles_one


def test_the_choice_is_the_first_candidate_at_the_fixed_version_or_none(fresh_choice):
    chosen = _ptxas.fixed_ptxas()
    cuda, driver = torch.version.cuda, _ptxas.driver_cuda_version()
    ceiling = driver[0] if driver else (int(cuda.split(".")[0]) if cuda else None)  # the CUDA the driver runs
    if ceiling is not None and ceiling >= 13:
        fixed = [asm for asm in _ptxas.candidates() if asm.version >= _ptxas.FIXED_PTXAS and asm.version[0] <= ceiling]
        assert chosen == (fixed[0] if fixed else None)
    else:
        assert chosen is None and "CUDA" in _ptxas.describe()
    assert ("a loop of their own" in _ptxas.describe()) == (chosen is not None)
    own = _ptxas.triton_ptxas()
    assert own is not None and own.triton_default
    assert _ptxas.kernel_ptxas(int8=False) == (chosen or own) and _ptxas.kernel_ptxas(int8=True) == own
    assert _ptxas.pooled_loop_right(chosen) == (chosen is not None) and not _ptxas.pooled_loop_right(None)


def test_triton_s_own_is_pinned_against_torchinductor_s_switch(fresh_choice, monkeypatch):
    """TorchInductor's first compile sets ``TRITON_PTXAS_PATH`` to torch's bundled ptxas: Triton's own stays the
    one it bundles (the same before and after); a path the user names is taken, a broken one ignored."""
    others = [asm for asm in _ptxas.candidates() if not asm.triton_default]
    if not others:
        pytest.skip("this Triton bundles one ptxas only")
    bundled = _ptxas.triton_ptxas()
    monkeypatch.setattr(_ptxas, "_torch_ptxas", lambda: others[0].path)  # (the one it sets on a CUDA 13 torch)
    monkeypatch.setenv("TRITON_PTXAS_PATH", others[0].path)
    _ptxas.reset()
    assert _ptxas.triton_ptxas() == bundled and _ptxas.kernel_ptxas(int8=True) == bundled
    monkeypatch.setattr(_ptxas, "_torch_ptxas", lambda: os.devnull)  # now a path the user named
    _ptxas.reset()
    named = _ptxas.triton_ptxas()
    assert named.path == others[0].path and named.version == others[0].version and named.triton_default
    monkeypatch.setenv("TRITON_PTXAS_PATH", os.path.join(os.devnull, "ptxas"))  # not there: Triton's bundled
    _ptxas.reset()
    assert _ptxas.triton_ptxas() == bundled


def test_opting_out_or_an_older_cuda_build_keeps_triton_s_own(fresh_choice, monkeypatch):
    monkeypatch.setenv(_ptxas.ENV_PTXAS, "triton")
    assert _ptxas.fixed_ptxas() is None
    assert f"{_ptxas.ENV_PTXAS}=triton" in _ptxas.describe()
    _ptxas.reset()
    monkeypatch.delenv(_ptxas.ENV_PTXAS)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    _driver(monkeypatch, None)  # (no driver, as on a CPU machine)
    assert _ptxas.fixed_ptxas() is None
    assert "CUDA 12.8, no NVIDIA driver found" in _ptxas.describe()
    _ptxas.reset()
    _driver(monkeypatch, 12090)
    assert _ptxas.fixed_ptxas() is None
    assert "CUDA 12.8 and the driver runs CUDA 12.9" in _ptxas.describe()
    _ptxas.reset()
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build
    _driver(monkeypatch, None)
    assert _ptxas.fixed_ptxas() is None


class _DriverLibrary:
    """Stands in for the driver's library in ``ctypes.CDLL``: ``cuDriverGetVersion`` writes ``value``."""

    def __init__(self, value, status=0):
        self.value, self.status = value, status

    def cuDriverGetVersion(self, pointer):  # noqa: N802 (the driver API's name)
        pointer._obj.value = self.value
        return self.status


def _driver(monkeypatch, value, status=0):
    """The driver library reports CUDA ``value`` (13000 = 13.0; None: no library loads)."""

    def load(name):
        if value is None:
            raise OSError(f"{name}: cannot open shared object file")
        return _DriverLibrary(value, status)

    monkeypatch.setattr(_ptxas.ctypes, "CDLL", load)
    _ptxas.driver_cuda_version.cache_clear()


@pytest.mark.parametrize(("value", "status", "expected"), [
    (13000, 0, (13, 0)), (12090, 0, (12, 9)), (13020, 0, (13, 2)), (13000, 3, None), (0, 0, None), (None, 0, None)])
def test_the_driver_s_cuda_version_is_read_from_cuDriverGetVersion(fresh_choice, monkeypatch, value, status,
                                                                  expected):
    _driver(monkeypatch, value, status)
    assert _ptxas.driver_cuda_version() == expected


def _fake(version):
    return _ptxas.Assembler(f"/nonexistent/{version[0]}.{version[1]}/ptxas", version, "a test's ptxas")


def test_a_cuda_12_torch_on_a_cuda_13_driver_gets_the_fixed_assembler(fresh_choice, monkeypatch):
    """Triton loads the kernel through the driver, so a CUDA 12 build of torch on a driver that runs CUDA 13
    takes the first ptxas >= 13.0, never one whose major version is above the driver's."""
    own = _ptxas.triton_ptxas()
    monkeypatch.setattr(_ptxas, "candidates", lambda: [own, _fake((14, 0)), _fake((13, 0)), _fake((13, 3))])
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    _driver(monkeypatch, 13000)
    assert _ptxas.fixed_ptxas() == _fake((13, 0))  # 14.0's code would not load on a CUDA 13 driver
    assert _ptxas.kernel_ptxas(int8=False) == _fake((13, 0)) and _ptxas.kernel_ptxas(int8=True) == own
    assert "a loop of their own" in _ptxas.describe()
    _ptxas.reset()
    _driver(monkeypatch, 14010)
    assert _ptxas.fixed_ptxas() == _fake((14, 0))
    _ptxas.reset()
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a CUDA 13 torch, no driver read: torch's build decides
    _driver(monkeypatch, None)
    assert _ptxas.fixed_ptxas() == _fake((13, 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and its driver)")
def test_the_real_driver_reads_as_a_version_where_a_gpu_runs(fresh_choice):
    real = _ptxas.driver_cuda_version()
    # (a driver older than torch's build runs nothing)
    assert real is not None and 0 <= real[1] < 100 and real[0] >= int(torch.version.cuda.split(".")[0]), real


def test_an_unknown_setting_is_named_in_a_warning_and_ignored(fresh_choice, monkeypatch, caplog):
    monkeypatch.setenv(_ptxas.ENV_PTXAS, "off")
    with caplog.at_level("WARNING", logger=_ptxas.__name__):
        chosen = _ptxas.fixed_ptxas()
    assert "'off' is not a setting" in caplog.text and f"{_ptxas.ENV_PTXAS}=triton" in caplog.text
    monkeypatch.delenv(_ptxas.ENV_PTXAS)
    _ptxas.reset()
    assert chosen == _ptxas.fixed_ptxas()  # the same choice as with the variable unset


def _another_assembler():
    """A ptxas other than Triton's own sm_90 one (the fixed one where found, else any), or skip."""
    others = [asm for asm in _ptxas.candidates() if not asm.triton_default]
    if not others:
        pytest.skip("this Triton bundles one ptxas only")
    return others[-1]


def test_the_scope_sets_triton_s_knobs_and_restores_them():
    asm = _another_assembler()
    knobs = triton.knobs
    before = (knobs.nvidia.ptxas.path, knobs.cache.dir, os.environ.get("TRITON_PTXAS_PATH"))
    with _ptxas.assembling(asm):
        assert knobs.nvidia.ptxas.path == asm.path
        assert knobs.cache.dir == os.path.join(before[1], f"chorus-ptxas-{asm.version[0]}.{asm.version[1]}")
    assert (knobs.nvidia.ptxas.path, knobs.cache.dir, os.environ.get("TRITON_PTXAS_PATH")) == before
    with _ptxas.assembling(None):
        assert knobs.nvidia.ptxas.path == before[0]
    with pytest.raises(KeyError), _ptxas.assembling(asm):  # restored on an error too
        raise KeyError("x")
    assert knobs.nvidia.ptxas.path == before[0] and knobs.cache.dir == before[1]


def _finalize_kernel_cubin(fp8: bool = False):
    """The pooled rows' finalisation kernel (a small one) built for sm_90 by the ptxas Triton holds: its FP8 form
    (D 128, V^T in the wgmma key order, 8 warps) or its 16-bit one (D 64, 4 warps)."""
    from aot_check import compile_jit

    from chorus.kernels.triton import _quant as Q

    out = "*fp8e4nv" if fp8 else "*bf16"
    return compile_jit(Q._pooled_finalize_kernel, dict(pool_sums="*fp32", k_out=out, v_out=out, k_scale="*fp32",
                                                       v_stats="*fp32"),
                       dict(HEAD_DIM=128 if fp8 else 64, TILE=128, BS=256, POOL_CHUNK=128, FP8=fp8, INTERPRET=False,
                            V_WGMMA_ORDER=fp8), num_warps=8 if fp8 else 4).asm["cubin"]


def test_a_kernel_assembled_by_another_ptxas_is_cached_apart(tmp_path, monkeypatch):
    """Same kernel (the pooled rows' finalisation, a small one), same Triton cache: built inside the scope and
    outside it, the two cubins are each assembler's own (neither build reuses the other's), and each is found
    again on a rebuild."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    asm = _another_assembler()

    def build():
        return _finalize_kernel_cubin(fp8=True)

    own = build()
    with _ptxas.assembling(asm):
        other = build()
        assert build() == other
    assert other != own and build() == own
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("chorus-ptxas-")] == [
        f"chorus-ptxas-{asm.version[0]}.{asm.version[1]}"]


def test_an_assembler_that_fails_is_dropped_for_the_process_and_triton_s_own_builds(fresh_choice, tmp_path,
                                                                                      monkeypatch, caplog):
    """An assembler that reports a version and then fails (a two-line script: Triton takes a path only from a
    program whose ``--version`` it can read) behind the scope: Triton raises its PTXASError, the build runs again
    with Triton's own ptxas, one warning says so, the choice looks past that path from then on and says why;
    an error that is not the assembler's, or Triton's own assembler failing, propagates."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    script = tmp_path / "ptxas"
    script.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Cuda compilation tools, release 13.3, V13.3.0" '
                      '&& exit 0\necho "this assembler fails" >&2; exit 2\n')
    script.chmod(0o755)
    assert _ptxas.ptxas_version(str(script)) == (13, 3)
    broken = _ptxas.Assembler(str(script), (13, 3), "a script that fails")
    own = _finalize_kernel_cubin()
    built_by = []

    def build(asm):
        built_by.append(asm)
        return _finalize_kernel_cubin()

    with caplog.at_level("WARNING", logger=_ptxas.__name__):
        got = _ptxas.run_assembled(broken, build)
    assert got == own and built_by == [broken, _ptxas.triton_ptxas()]
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "could not assemble" in caplog.text
    assert broken.path in _ptxas.describe() and _ptxas.fixed_ptxas() != broken
    with pytest.raises(ZeroDivisionError):  # not an assembler error: not caught, nothing refused
        _ptxas.run_assembled(_another_assembler(), lambda asm: 1 / 0)
    assert _ptxas.run_assembled(None, lambda asm: asm) is None
    own_broken = _ptxas.Assembler(str(script), (13, 3), "Triton's own, failing", triton_default=True)
    with pytest.raises(_ptxas.PTXASError):  # Triton's own failing: nothing to fall back to
        _ptxas.run_assembled(own_broken, lambda asm: _finalize_kernel_cubin())


def test_each_variant_s_assembler_is_logged_once_with_what_would_make_fp8_faster(fresh_choice, monkeypatch, caplog):
    """One INFO line per variant and assembler: the FP8 kernel built by an older ptxas says what to install where a
    newer one would run, or why none is used; a second launch logs nothing."""
    own = _ptxas.triton_ptxas()
    monkeypatch.setattr(_ptxas, "candidates", lambda: [own, _fake((12, 9))])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    _driver(monkeypatch, 13000)
    with caplog.at_level("INFO", logger=_ptxas.__name__):
        for _ in range(3):
            assert _ptxas.kernel_ptxas(int8=False) == own and _ptxas.kernel_ptxas(int8=True) == own
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"Chorus: the warp-specialised FP8 kernel is built by {own.label}; a ptxas >= 13.0")
    assert "`ptxas` extra" in lines[0]
    assert lines[1] == f"Chorus: the warp-specialised INT8 kernel is built by {own.label}"
    caplog.clear()
    _ptxas.reset()
    _driver(monkeypatch, 12090)  # a driver that runs no CUDA 13 code: the reason, no advice
    with caplog.at_level("INFO", logger=_ptxas.__name__):
        _ptxas.kernel_ptxas(int8=False)
    assert caplog.records[0].getMessage().endswith("the driver runs CUDA 12.9 (a CUDA 13 assembler's kernels need a "
                                                   "CUDA 13 driver)"), caplog.text
    caplog.clear()
    _ptxas.reset()
    monkeypatch.setattr(_ptxas, "candidates", lambda: [own, _fake((13, 0))])
    _driver(monkeypatch, 13000)
    with caplog.at_level("INFO", logger=_ptxas.__name__):
        _ptxas.kernel_ptxas(int8=False)
    message = caplog.records[0].getMessage()
    assert message == f"Chorus: the warp-specialised FP8 kernel is built by {_fake((13, 0)).label}"
