"""The FP8 error budget (``benchmarks/kernels/fp8_budget.py``) at a toy size on the CPU: every form of P is checked
against an independent rounding, the operands' quantisers (the emulation's) on their grids, and the budget orders
the forms as their precisions do."""

from __future__ import annotations

import json
import math

import pytest
import torch

from chorus.benchmarks.kernels import fp8_budget


def test_the_forms_of_p_are_the_kernels_roundings():
    s = torch.tensor([[0.0, -0.1, -0.5, -1.0, -3.0, -30.0]], dtype=torch.float64)
    exact = fp8_budget._p_weights(s, "exact")
    assert torch.allclose(exact, torch.exp(s) * 256.0)  # row maximum 256
    e4m3 = fp8_budget._p_weights(s, "e4m3")
    assert torch.all((e4m3 - exact).abs() <= exact / 16 + 2.0 ** -9)  # 3 mantissa bits, subnormals to 2^-9
    ffma = fp8_budget._p_weights(s, "ffma")
    assert ffma[0, 0] == 256.0 and ffma[0, -1] == 0.0  # the row maximum exact; far below: the byte 0
    # exp2 linear between powers of two: never below the exact value at the grid's points, at most ~6% above
    y = (s - s.amax()) * math.log2(math.e) + 8.0
    k = torch.round(8 * y + 56).clamp(0, 128)
    grid = torch.exp2((k - 56) / 8)
    assert torch.all(ffma[k > 0] >= grid[k > 0] * (1 - 1e-12)) and torch.all(ffma <= grid * 1.0616)
    # the INT8 kernel's levels: per 128-key tile round(255 exp(s - m_tile)), the tile weighted by exp(m_tile - m_row)
    logits = -torch.rand(1, 258, dtype=torch.float64) * 4  # 3 tiles, the last of 2 keys
    maxima = torch.tensor([0.0, -2.0, -1.0], dtype=torch.float64)
    for t, m in enumerate(maxima):
        logits[0, 128 * t:128 * (t + 1)] += m
        logits[0, 128 * t] = m
    u8 = fp8_budget._p_weights(logits, "u8")
    for t, m in enumerate(maxima):
        levels = u8[0, 128 * t:128 * (t + 1)] / math.exp(m)
        assert torch.allclose(levels, torch.round(levels)) and levels.max() == pytest.approx(255.0), t
        assert torch.allclose(levels, torch.round(255 * torch.exp(logits[0, 128 * t:128 * (t + 1)] - m)))


def test_operands_in_int8_or_e4m3_are_on_their_grids():
    """The quantisers the budget takes from the emulation (:mod:`chorus.kernels.triton.emulation`)."""
    from chorus.kernels.triton.emulation import e4m3_fake, e4m3_token_blocks, int8_fake, int8_key_tiles

    x = torch.randn(1, 2, 300, 128, dtype=torch.float64)  # 300 tokens: not a multiple of 128
    per_row = {"e4m3": lambda t: e4m3_fake(t, t.abs().amax(dim=-1, keepdim=True)),
               "int8": lambda t: int8_fake(t, t.abs().amax(dim=-1, keepdim=True))}
    per_tile = {"e4m3": lambda t: e4m3_token_blocks(t, 128), "int8": lambda t: int8_key_tiles(t, 128)}
    for fmt in ("e4m3", "int8"):
        for quantise in (per_row[fmt], per_tile[fmt]):
            y = quantise(x)
            assert y.shape == x.shape and torch.isfinite(y).all()
            rel = ((y - x).norm() / x.norm()).item()
            assert 0 < rel < (0.04 if fmt == "e4m3" else 0.02), (fmt, rel)
    assert per_row["int8"](x).sub(x).abs().max() <= x.abs().amax(-1).max() / 127 / 2 + 1e-12


def test_the_budget_orders_the_forms_as_their_precisions(tmp_path):
    errors = fp8_budget.budget(length=300, heads=1, sharpen=3.0)
    for source, row in errors.items():
        assert all(math.isfinite(e) and e > 0 for e in row.values()), (source, row)
        fp8, int8 = row["the FP8 kernel's numerics (all three)"], row["the INT8 kernel's numerics (all three)"]
        for label in ("Q.K in e4m3 only", "P as the FP8 kernel's FFMA byte only", "V in e4m3 only"):
            assert row[label] < fp8, (source, label, row)
        assert row["Q.K in int8 only"] < row["Q.K in e4m3 only"]
        assert row["V in int8 only"] < row["V in e4m3 only"]
        assert int8 < fp8 / 2, (source, row)
    assert fp8_budget.main(["--out", str(tmp_path), "--length", "200", "--heads", "1"]) == 0
    saved = json.loads((tmp_path / "fp8_budget.json").read_text())
    assert set(saved["errors"]) == {"gaussian", "q x 3"}


def test_an_unknown_form_is_refused():
    q = torch.randn(1, 1, 8, 128, dtype=torch.float64)
    with pytest.raises(ValueError, match="form of P"):
        fp8_budget.attention(q, q, q, p="fp4")
    with pytest.raises(ValueError, match="form of Q.K"):
        fp8_budget.attention(q, q, q, qk="fp4")
