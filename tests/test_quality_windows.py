"""Context windows of two lengths (later ComfyUI's causal window fix: every window but the first one anchor frame
longer) on the synthetic structured source (CPU): a map recorded on the first window and carried to the longer
window's grid keeps that window's attention mass as a map selected there would, in raster order and in feature
reuse's region order (``kernels.resample_block_map`` with the orders of both grids)."""

from __future__ import annotations

import pytest

pytest.importorskip("skimage")

from chorus import kernels  # noqa: E402
from chorus.kernels.tile_order import cached_region_order  # noqa: E402

TOP_P, K_MIN = 0.9, 2


def _recall(mass, block_map) -> float:
    """Mean over query blocks of the share of their attention mass the map keeps."""
    return float(((mass * block_map).sum(-1) / mass.sum(-1)).mean())


@pytest.mark.parametrize("region", [None, (2, 8, 8)])
def test_a_map_carried_to_the_anchored_window_keeps_its_mass(region):
    from chorus.benchmarks.quality import source
    from chorus.benchmarks.quality.families import load_image

    first, anchored = (7, 16, 24), (8, 16, 24)
    request = source.Request("astronaut", load_image("astronaut"), "an astronaut", seed=1)
    windows = [source.RequestAttention(source.build_model(source.SourceConfig(grid=g)), request)
               for g in (first, anchored)]
    orders = [None if region is None else cached_region_order(g, region, 128) for g in (first, anchored)]
    for key in source.SourceConfig(grid=first).keys()[::3]:
        (q1, k1, _), (q2, k2, _) = (w.qkv(*key) for w in windows)
        recorded = kernels.select_blocks(kernels.block_mass(q1, k1, block_size=128, scale=1.0, token_perm=orders[0]),
                                         top_p=TOP_P, k_min=K_MIN)
        mass = kernels.block_mass(q2, k2, block_size=128, scale=1.0, token_perm=orders[1])
        carried = kernels.resample_block_map(recorded, first, anchored, block_size=128, src_order=orders[0],
                                             dst_order=orders[1])
        richer = kernels.select_blocks(mass, top_p=0.95, k_min=K_MIN)  # the window's own map of more recall
        assert _recall(mass, carried) >= TOP_P - 0.01, key
        assert carried.float().mean() <= 1.25 * richer.float().mean(), key
        if region is not None:  # the orders matter: the same map read in raster order at the longer grid misses
            misread = kernels.resample_block_map(recorded, first, anchored, block_size=128, src_order=orders[0])
            assert _recall(mass, misread) < _recall(mass, carried) - 0.02, key


def test_the_windows_script_writes_its_table(tmp_path):
    import json

    from chorus.benchmarks.quality import windows

    assert windows.main(["--out", str(tmp_path), "--first", "5", "16", "24", "--images", "astronaut"]) == 0
    res = json.loads((tmp_path / "windows.json").read_text())
    maps = {(r["order"], r["map"]) for r in res["rows"]}
    assert maps == {(o, m) for o in ("raster", "regions2x8x8")
                    for m in (*windows.CARRIES, "own top-p 0.9", "own top-p 0.95")}
    own = {r["order"]: r["recall"] for r in res["rows"] if r["map"] == "own top-p 0.9"}
    assert all(0.89 <= v <= 1.0 for v in own.values()) and res["longer"] == [6, 16, 24]
