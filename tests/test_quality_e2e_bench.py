"""The end-to-end GPU benchmark (benchmarks/e2e) runs its whole code path at toy sizes on the CPU.

Timings on the CPU mean nothing and are not asserted; what is checked is that every variant runs
through the engine as intended (misses record, hits run sparse with no fallback) and that the FP8
linear emulation is close to bf16.
"""

from __future__ import annotations

import json

import pytest
import torch


wan_model = pytest.importorskip("benchmarks.e2e.wan_model")


def test_fp8_linear_emulation_is_close_to_bf16():
    torch.manual_seed(0)
    lin = wan_model.Linear(256, 384, "cpu")
    lin.to_fp8()
    x = torch.randn(40, 256).bfloat16()                 # 40 rows: padded to 48 for the GEMM
    x8, s, rows = wan_model.quantize_rows(x)
    assert rows == 40 and x8.shape[0] == 40   # the CPU emulation needs no padding
    y8 = lin.fp8(x8, s, rows).float()
    y16 = lin(x).float()
    assert y8.shape == y16.shape
    assert float((y8 - y16).norm() / y16.norm()) < 0.08     # e4m3 has a 3-bit mantissa: ~2-4% per operand


def test_structured_bench_masks_have_the_requested_density():
    from benchmarks.e2e.run import structured_map

    for density in (0.05, 0.15):
        m = structured_map((21, 30, 52), 4, density, 128, "cpu", seed=1)
        assert m.shape == (4, 256, 256)
        assert abs(float(m.float().mean()) - density) < 0.01
        assert bool(m[:, torch.arange(256), torch.arange(256)].all())


def test_tiny_run_exercises_every_variant(tmp_path):
    from benchmarks.e2e import run

    assert run.main(["--out", str(tmp_path), "--tiny", "--layers", "1", "--precisions", "fp8",
                     "--densities", "0.15"]) == 0
    res = json.loads((tmp_path / "e2e_results.json").read_text())["results"]["tiny"]
    for precision in ("fp8",):
        rows = res[precision]
        assert set(rows) == {"dense_cudnn", "dense_fp8", "miss", "hit@0.15"}
        assert rows["miss"]["recorded_calls"] == 4 and rows["miss"]["fallback_calls"] == 0
        assert rows["hit@0.15"]["fallback_calls"] == 0 and rows["hit@0.15"]["density"] is not None
        for row in rows.values():
            assert row["latency_s"] > 0
    assert res["fp8_block_check"]["cosine_of_update"] > 0.99
