"""benchmarks/quality/tile_order.py on its --quick sizes (synthetic source, random weights): the
measurement runs, and its tile-order mass is the permuted exact mass."""

from __future__ import annotations

import json

import pytest
import torch

tile_bench = pytest.importorskip("chorus.benchmarks.quality.tile_order")


def test_quick_run_writes_both_orders(tmp_path):
    assert tile_bench.main(["--out", str(tmp_path), "--quick", "--no-wan"]) == 0
    res = json.loads((tmp_path / "tile_order.json").read_text())
    orders = res["sections"]["synthetic_quick"]["orders"]
    assert "raster" in orders and len(orders) == 3
    for per_target in orders.values():
        for target, r in per_target.items():
            assert 0 < r["density"] <= 1 and r["recall"] >= float(target) - 1e-6
    assert "kept vs raster" in (tmp_path / "tile_order.md").read_text()


def test_mass_by_head_is_the_kernel_block_mass_in_each_order():
    from chorus import kernels
    from chorus.kernels.tile_order import TileOrder

    order = TileOrder((3, 4, 6), 8)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, order.length, 16, generator=gen) for _ in range(2))
    masses = tile_bench.mass_by_head(q, k, 8, {"raster": None, "tile": order.perm})
    torch.testing.assert_close(masses["raster"], kernels.block_mass(q, k, block_size=8, scale=1.0)[0],
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(masses["tile"], kernels.block_mass(q, k, block_size=8, scale=1.0, token_perm=order)[0],
                               rtol=1e-5, atol=1e-6)
