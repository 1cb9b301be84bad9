"""3D-tile token order (kernels/tile_order.py): permutation, round trips, map conversion, exactness."""

from __future__ import annotations

import pytest
import torch

from chorus.kernels import block_mass, block_sparse_attention
from chorus.kernels.masks import num_blocks
from chorus.kernels.reference import dense_attention_oracle, expand_block_map
from chorus.kernels.tile_order import (TileOrder, block_overlap, cached_region_order, cached_tile_order, choose_tile,
                                       convert_map, convert_mass, resolve_token_perm)

from testing import assert_matches_oracle, make_qkv, random_block_map

AWKWARD = [((3, 5, 7), 8), ((4, 3, 9), 16), ((1, 6, 10), 16), ((2, 1, 1), 4), ((6, 10, 14), 32), ((5, 7, 11), 128)]


@pytest.mark.parametrize("grid,bs", AWKWARD)
def test_perm_is_a_bijection_and_round_trips_exactly(grid, bs):
    order = TileOrder(grid, bs)
    length = grid[0] * grid[1] * grid[2]
    assert order.perm.dtype == torch.int64 and order.perm.shape == (length,)
    assert torch.equal(torch.sort(order.perm).values, torch.arange(length))
    assert torch.equal(order.perm[order.inverse], torch.arange(length))
    x = torch.randn(2, 3, length, 5, dtype=torch.float64)
    assert torch.equal(order.to_raster(order.to_tile(x, dim=2), dim=2), x)
    p = length // 2
    assert torch.equal(order.to_tile(x, dim=-2)[:, :, p], x[:, :, order.perm[p]])
    # frame 0 is the prefix [0, H*W) of the tile order (prefix bias and first-frame keep-set hold)
    assert set(order.perm[: grid[1] * grid[2]].tolist()) == set(range(grid[1] * grid[2]))


def test_wan_grids_get_2x8x8_tiles_and_full_tiles_are_blocks():
    for grid in [(21, 30, 52), (21, 45, 80), (1, 30, 52), (21, 60, 104)]:
        tile, first = choose_tile(grid, 128)
        assert first == (1, 8, 16)
        assert tile == ((2, 8, 8) if grid[0] > 2 else (1, 8, 16))
    order = TileOrder((5, 16, 32), 128)  # multiples of the tile: every block is exactly one tile
    assert order.name == "tile2x8x8-f8x16-s"
    t, h, w = (order.perm // (16 * 32)), (order.perm // 32) % 16, order.perm % 32
    for b in range(order.length // 128):
        sl = slice(b * 128, (b + 1) * 128)
        extent = [int(a[sl].max() - a[sl].min()) + 1 for a in (t, h, w)]
        assert extent in ([1, 8, 16], [2, 8, 8]), (b, extent)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="grid"):
        TileOrder((0, 4, 4), 16)
    with pytest.raises(ValueError, match="block_size"):
        TileOrder((2, 4, 4), 16, tile=(2, 2, 2))
    with pytest.raises(ValueError, match="first_tile"):
        TileOrder((2, 4, 4), 16, first_tile=(2, 2, 4))
    order = TileOrder((2, 4, 4), 16)
    with pytest.raises(ValueError, match="tokens"):
        order.to_tile(torch.zeros(1, 1, 31, 2))
    with pytest.raises(ValueError, match="permutation"):
        resolve_token_perm(torch.zeros(32, dtype=torch.int64), 32, "cpu")
    with pytest.raises(ValueError, match="TileOrder of 32"):
        resolve_token_perm(order, 33, "cpu")
    with pytest.raises(ValueError, match="bool"):
        convert_map(torch.zeros(2, 2), "raster", order, block_size=16)
    with pytest.raises(ValueError, match="block size"):
        convert_map(torch.zeros(2, 2, dtype=torch.bool), "raster", order, block_size=8)


def _token_cover(block_map, order, bs):
    """Token-pair coverage [L, L] in raster token indices of a map in ``order`` (None = raster)."""
    length = order.length if order is not None else None
    cover = expand_block_map(block_map, length, length, bs)
    if order is None:
        return cover
    inv = order.inverse
    return cover[..., inv[:, None], inv[None, :]]  # raster pair (a, b) -> tile positions (inv a, inv b)


@pytest.mark.parametrize("grid,bs", [((3, 5, 7), 8), ((4, 6, 10), 16), ((1, 6, 10), 16)])
def test_converted_maps_cover_every_source_token_pair(grid, bs):
    order = TileOrder(grid, bs)
    length = order.length
    nb = num_blocks(length, bs)
    for seed in range(3):
        src = random_block_map(1, 2, length, length, bs, density=0.2, seed=seed)
        to_tile = convert_map(src, "raster", order, block_size=bs)
        back = convert_map(to_tile, order, "raster", block_size=bs)
        raster_cover = expand_block_map(src, length, length, bs)
        tile_cover = _token_cover(to_tile, order, bs)
        assert tile_cover.shape == raster_cover.shape and to_tile.shape[-2:] == (nb, nb)
        assert not (raster_cover & ~tile_cover).any()  # never drops a covered token pair
        assert not (tile_cover & ~expand_block_map(back, length, length, bs)).any()
        assert torch.equal(convert_map(src, "raster", None, grid=grid, block_size=bs), src)
    overlap = block_overlap("raster", order, block_size=bs)
    per_block = torch.bincount(torch.arange(length) // bs).double()
    assert torch.equal(overlap.sum(1), per_block) and torch.equal(overlap.sum(0), per_block)


def test_converted_mass_keeps_row_sums_and_exact_mass_in_tile_order():
    grid, bs = (3, 5, 7), 8
    order = TileOrder(grid, bs)
    q, k, _ = make_qkv(heads=2, q_len=order.length, head_dim=16, dtype=torch.float64, seed=1)
    raster_mass = block_mass(q, k, block_size=bs, backend="reference")
    tile_mass = block_mass(q, k, block_size=bs, backend="reference", token_perm=order)
    direct = block_mass(order.to_tile(q), order.to_tile(k), block_size=bs, backend="reference")
    torch.testing.assert_close(tile_mass, direct, rtol=0, atol=0)
    carried = convert_mass(raster_mass, "raster", order, block_size=bs)
    torch.testing.assert_close(carried.sum(-1), torch.ones_like(carried.sum(-1)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("grid,bs", [((3, 5, 7), 8), ((4, 6, 10), 16)])
def test_tile_order_attention_with_full_coverage_map_equals_raster_attention(grid, bs):
    """Attention in tile order with the conversion of a map (to a map covering at least the same
    pairs; a full map stays full) equals raster attention (fp64 oracle)."""
    order = TileOrder(grid, bs)
    q, k, v = make_qkv(heads=2, q_len=order.length, head_dim=16, seed=2)
    nb = num_blocks(order.length, bs)
    full = torch.ones(1, 2, nb, nb, dtype=torch.bool)
    tile_map = convert_map(full, "raster", order, block_size=bs)
    assert tile_map.all()
    out = block_sparse_attention(q, k, v, tile_map, block_size=bs, backend="reference", token_perm=order)
    assert_matches_oracle(out, q, k, v, full, bs)
    # the perm-tensor form is the same computation
    out2 = block_sparse_attention(q, k, v, tile_map, block_size=bs, backend="reference", token_perm=order.perm)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    # a sparse map recorded in tile order: exactly the tile-order computation, un-permuted
    sparse = random_block_map(1, 2, order.length, order.length, bs, density=0.4, seed=3)
    got = block_sparse_attention(q, k, v, sparse, block_size=bs, backend="reference", token_perm=order)
    want = dense_attention_oracle(order.to_tile(q), order.to_tile(k), order.to_tile(v), sparse, bs)
    torch.testing.assert_close(got.double(), order.to_raster(want), rtol=1e-5, atol=1e-5)
    # flex goes through the same gather / scatter (eager on the CPU)
    flex = block_sparse_attention(q, k, v, sparse, block_size=bs, backend="flex", token_perm=order)
    torch.testing.assert_close(flex, got, rtol=1e-5, atol=1e-5)


def test_prefix_bias_in_tile_order_is_the_first_frame():
    grid, bs = (3, 4, 6), 8
    order = TileOrder(grid, bs)
    q, k, v = make_qkv(heads=1, q_len=order.length, head_dim=16, seed=4)
    nb = num_blocks(order.length, bs)
    full = torch.ones(1, 1, nb, nb, dtype=torch.bool)
    hw = grid[1] * grid[2]
    got = block_sparse_attention(q, k, v, full, block_size=bs, backend="reference", token_perm=order,
                                 prefix_len=hw, prefix_bias=1.5)
    assert_matches_oracle(got, q, k, v, full, bs, prefix_len=hw, prefix_bias=1.5)


@pytest.mark.parametrize("grid,region,want", [((21, 8, 16), (2, 8, 8), True), ((5, 16, 16), (2, 8, 8), True),
                                              ((4, 16, 16), (2, 8, 8), False), ((1, 16, 16), (2, 8, 8), False)])
def test_last_frame_is_suffix_of_a_region_order_of_an_odd_frame_count(grid, region, want):
    """A first-last-frame request's end image keeps its key blocks only where the last frame is the order's
    suffix: a region order of an odd frame count (the last frame in no complete 2-frame region; with an even
    count the rim's frame 1 ends the order), a tile order whose last slab is that frame alone (an even count:
    frame 0, then 2-frame slabs), never a one-frame grid."""
    from chorus.kernels.tile_order import cached_region_order, cached_tile_order

    order = cached_region_order(grid, region, 128)
    hw = grid[1] * grid[2]
    last = set(range(order.length - hw, order.length))
    assert order.last_frame_is_suffix == want
    assert (set(order.perm[order.length - hw:].tolist()) == last) == (want or grid[0] == 1)
    if grid[0] > 1:
        assert cached_tile_order(grid, 128).last_frame_is_suffix == (grid[0] % 2 == 0)


@pytest.mark.parametrize("pooled_tail", [False, True])
def test_a_suffix_bias_with_a_token_order_is_the_orders_suffix(pooled_tail):
    """``suffix_len`` with ``token_perm`` counts the last positions of the order (as ``prefix_len`` the first): in a
    region order of an odd frame count those are the last frame's keys (a first-last-frame request's end image)."""
    from chorus.kernels.tile_order import cached_region_order

    order = cached_region_order((5, 8, 16), (2, 8, 8), 128)  # 640 tokens, frames of 128
    hw = 128
    assert order.last_frame_is_suffix
    q, k, v = make_qkv(heads=2, q_len=order.length, head_dim=32, seed=6)
    bm = random_block_map(1, 2, order.length, order.length, 128, density=0.4, seed=3)
    biases = dict(prefix_len=hw, prefix_bias=0.4, suffix_len=hw, suffix_bias=0.7)
    got = block_sparse_attention(q, k, v, bm, block_size=128, backend="reference", token_perm=order,
                                 pooled_tail=pooled_tail, **biases)
    in_order = [order.to_tile(t) for t in (q, k, v)]
    want = order.to_raster(dense_attention_oracle(*in_order, bm, 128, pooled_tail=pooled_tail, **biases))
    assert (got.double() - want).abs().max() < 1e-5
    full = torch.ones(1, 1, 5, 5, dtype=torch.bool)  # every block: raster attention biased on frames 0 and 4
    got = block_sparse_attention(q, k, v, full, block_size=128, backend="reference", token_perm=order, **biases)
    assert (got.double() - dense_attention_oracle(q, k, v, **biases)).abs().max() < 1e-5


def test_orders_first_asked_for_under_inference_mode_serve_a_grad_enabled_call():
    """ComfyUI asks for the cached orders inside ``torch.inference_mode``; a later call with autograd on (a
    diffusers pipeline run without ``no_grad``) gathers with the same cached indices and must be able to save
    them for backward."""
    grid = (3, 8, 9)  # a grid no other test caches
    with torch.inference_mode():
        orders = [cached_tile_order(grid, 64), cached_region_order(grid, (1, 8, 8), 64)]
        for order in orders:
            order.indices("cpu")
    for order in orders:
        assert not any(t.is_inference() for t in (order.perm, order.inverse, *order.indices("cpu")))
        x = torch.randn(2, order.length, 3, dtype=torch.float64, requires_grad=True)
        weights = torch.randn(2, order.length, 3, dtype=torch.float64)
        (order.to_tile(x, dim=1) * weights).sum().backward()
        assert torch.equal(x.grad, order.to_raster(weights, dim=1))


def test_the_int8_pre_pass_hadamard_matrix_first_made_under_inference_mode_is_an_ordinary_tensor():
    """The other tensor the kernels keep across calls through :func:`outside_inference_mode`."""
    pytest.importorskip("triton")
    from chorus.kernels.triton._quant_int8 import hadamard

    with torch.inference_mode():
        h = hadamard(32, "cpu", torch.float64)
    assert not h.is_inference()
    assert torch.equal(h @ h.T, 32 * torch.eye(32, dtype=torch.float64))
