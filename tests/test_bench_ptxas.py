"""``benchmarks/kernels/bench_ptxas.py`` on the CPU: one assembler per version among the candidates, and the copy of
the kernel module each gets: a kernel object of its own (Triton keeps its builds per kernel object, whatever
assembler it was given), whose build by that assembler is that assembler's (the FP8 pooled tiles' own loop only
where it assembles it right). The timing itself needs an sm_90 GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from chorus.benchmarks.kernels.bench_ptxas import assemblers, kernel_copy  # noqa: E402
from chorus.kernels.triton import _attention_ws, _ptxas  # noqa: E402


def test_one_assembler_per_version_in_order_and_a_filter():
    found = assemblers(None)
    versions = [asm.version for asm in found]
    assert versions == sorted(set(versions)) and versions
    assert {asm.version for asm in _ptxas.candidates()} == set(versions)
    assert [asm.version for asm in assemblers([versions[0], (99, 9)])] == [versions[0]]


def test_each_assembler_gets_a_kernel_module_of_its_own_and_builds_its_own_binary():
    if _attention_ws.available():
        pytest.skip(f"this Triton has no Gluon Hopper API: {_attention_ws.available()}")
    found = assemblers(None)
    if len(found) < 2:
        pytest.skip("this Triton bundles one ptxas only")
    old, new = found[0], found[-1]
    copies = [kernel_copy(old), kernel_copy(new)]
    assert copies[0] is kernel_copy(old) and copies[0] is not copies[1]
    kernels = {id(_attention_ws._bsa_ws_kernel)} | {id(c._bsa_ws_kernel) for c in copies}
    assert len(kernels) == 3
    builds = [c.compile_sm90(has_tail=True, assembler=asm) for c, asm in zip(copies, (old, new))]
    assert builds[0].asm["cubin"] != builds[1].asm["cubin"]
    for copy, asm in zip(copies, (old, new)):
        assert copy.kernel_form(True, False, asm) == (_ptxas.pooled_loop_right(asm), asm)
