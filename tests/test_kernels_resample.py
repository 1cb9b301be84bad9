"""Resampling block maps/mass between token grids in 3D block coordinates."""

import pytest
import torch

import chorus.kernels as K
from chorus.kernels import pooling
from chorus.kernels.resample import _source_block_assignment, nearest_source_tokens, source_block_assignment
from chorus.kernels.tile_order import (RegionTileOrder, TileOrder, cached_region_order, convert_map, convert_mass)


def local_window_map(grid, block_size, radius, order=None):
    """Bool map of a 3D-local attention pattern: blocks whose token centroids are within ``radius``
    (in relative frame/row/column units), so it is defined independently of the grid size; blocks cut in
    ``order`` (None: raster)."""
    t, h, w = grid
    n = t * h * w
    idx = torch.arange(n) if order is None else order.perm
    coords = torch.stack([(idx // (h * w)) / t, ((idx // w) % h) / h, (idx % w) / w], -1).double()
    nb = -(-n // block_size)
    centroids = torch.stack([coords[i * block_size:(i + 1) * block_size].mean(0) for i in range(nb)])
    dist = (centroids[:, None] - centroids[None]).abs().amax(-1)
    return (dist <= radius)[None, None]


def test_identity_grid_is_identity():
    grid = (3, 6, 10)
    block_map = torch.rand(1, 2, 3, 3) < 0.5
    block_map |= torch.eye(3, dtype=torch.bool)
    assert torch.equal(K.resample_block_map(block_map, grid, grid, block_size=64), block_map)
    mass = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    torch.testing.assert_close(K.resample_block_map(mass, grid, grid, block_size=64), mass)


@pytest.mark.parametrize("src,dst", [((5, 8, 14), (9, 12, 21)), ((9, 12, 21), (5, 8, 14)), ((4, 10, 10), (7, 6, 6))])
def test_local_pattern_survives_resampling(src, dst):
    """A 3D-local pattern carried to another grid covers the pattern built natively on that grid.

    Block centroids move when the grid changes (a 32-token block spans 1-4 rows), so the native
    pattern is built with a radius smaller by about one block's extent (0.25 -> 0.2)."""
    bs = 32
    carried = K.resample_block_map(local_window_map(src, bs, 0.25), src, dst, block_size=bs)
    native = local_window_map(dst, bs, 0.2)
    assert carried.shape == native.shape
    recall = (carried & native).sum() / native.sum()
    assert recall >= 0.95, float(recall)
    # Any-overlap resampling is conservative but still far from dense for a local pattern.
    assert carried.float().mean() < 0.9


@pytest.mark.parametrize("src,dst,bs", [((4, 8, 8), (6, 12, 12), 64), ((3, 5, 7), (2, 5, 7), 16),
                                        ((4, 8, 8), (2, 4, 4), 32), ((21, 30, 52), (11, 15, 26), 128),
                                        ((3, 4, 6), (5, 8, 12), 8)])
def test_mass_rows_keep_their_sum(src, dst, bs):
    """Mass carried to a larger or a smaller grid keeps each row's sum: a grid shrunk by more than a block's
    worth leaves source blocks no destination token samples, and their mass still lands somewhere."""
    nb = -(-src[0] * src[1] * src[2] // bs)
    mass = torch.softmax(torch.randn(2, 3, nb, nb, generator=torch.Generator().manual_seed(0)), -1)
    out = K.resample_block_map(mass, src, dst, block_size=bs)
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 3, out.shape[-2]), atol=1e-5, rtol=0)


def test_every_row_keeps_a_block_even_with_high_threshold():
    src, dst = (4, 8, 8), (5, 8, 8)
    block_map = torch.eye(4, dtype=torch.bool)[None, None]
    out = K.resample_block_map(block_map, src, dst, block_size=64, threshold=0.99)
    assert out.any(-1).all()


def test_assignment_counts_every_destination_token():
    counts = _source_block_assignment((3, 5, 7), (4, 6, 9), 16)
    assert counts.sum() == 4 * 6 * 9
    assert torch.equal(counts, source_block_assignment((3, 5, 7), (4, 6, 9), 16))


def test_assignment_of_given_source_tokens():
    """Another carry's source tokens (a study's): on the same grid, token n from token n is the block diagonal
    (100 tokens in blocks of 16: six of 16, the last of 4); every token from token 0 puts all in source block 0."""
    grid = (1, 10, 10)
    same = source_block_assignment(grid, grid, 16, src_token=torch.arange(100))
    assert torch.equal(same, torch.diag(torch.tensor([16.0] * 6 + [4.0], dtype=torch.float64)))
    first = source_block_assignment(grid, grid, 16, src_token=torch.zeros(100, dtype=torch.int64))
    assert first[:, 0].tolist() == [16.0] * 6 + [4.0] and first[:, 1:].sum() == 0


def test_aspect_mismatch_and_bad_input():
    assert K.aspect_matches((21, 30, 52), (21, 45, 78))
    assert not K.aspect_matches((21, 30, 52), (21, 52, 30))
    with pytest.raises(ValueError, match="different aspect"):
        K.resample_block_map(torch.ones(1, 1, 2, 2, dtype=torch.bool), (1, 8, 16), (1, 16, 8), block_size=64)
    with pytest.raises(ValueError, match="does not match src_grid"):
        K.resample_block_map(torch.ones(1, 1, 3, 3, dtype=torch.bool), (1, 8, 16), (1, 8, 16), block_size=64)
    with pytest.raises(ValueError, match="token grid"):
        K.resample_block_map(torch.ones(1, 1, 2, 2, dtype=torch.bool), (8, 16), (1, 8, 16), block_size=64)


def brute_force_resample(block_map, src, dst, block_size, src_order, dst_order):
    """The definition, pair by pair: destination block pair ``(I, J)`` is kept when some token pair of it maps
    (nearest source token by cell centre, in each of t, h, w) into a kept source block pair."""
    def nearest(i, n_dst, n_src):
        return min(int((i + 0.5) * n_src / n_dst), n_src - 1)

    def position(order, raster):
        return raster if order is None else int(order.inverse[raster])

    td, hd, wd = dst
    _, hs, ws = src
    dst_len = td * hd * wd
    src_block_of = torch.empty(dst_len, dtype=torch.int64)  # by destination position
    for raster in range(dst_len):
        t, h, w = raster // (hd * wd), (raster // wd) % hd, raster % wd
        s = (nearest(t, td, src[0]) * hs + nearest(h, hd, hs)) * ws + nearest(w, wd, ws)
        src_block_of[position(dst_order, raster)] = position(src_order, s) // block_size
    pairs = block_map[..., src_block_of, :][..., src_block_of]  # [..., L_dst, L_dst]: each token pair's source pair
    nb = -(-dst_len // block_size)
    pad = nb * block_size - dst_len
    pairs = torch.nn.functional.pad(pairs, (0, pad, 0, pad))
    return pairs.unflatten(-1, (nb, block_size)).unflatten(-3, (nb, block_size)).any(-1).any(-2)


ORDERS = {
    "raster": lambda grid, bs: None,
    "regions": lambda grid, bs: RegionTileOrder(grid, (2, 4, 4), bs),
    "tile": lambda grid, bs: TileOrder(grid, bs),
}


@pytest.mark.parametrize("src,dst", [((3, 8, 8), (4, 8, 8)), ((6, 8, 8), (5, 8, 8)), ((4, 8, 12), (7, 10, 15))])
@pytest.mark.parametrize("src_kind,dst_kind", [("regions", "regions"), ("tile", "tile"), ("regions", "raster"),
                                               ("raster", "tile")])
def test_a_map_in_a_token_order_is_carried_to_another_grid_as_its_definition_says(src, dst, src_kind, dst_kind):
    """Token orders at either end (context windows of two lengths with feature reuse: its region order at the
    first window's grid and at the anchored windows' one frame longer), checked token pair by token pair;
    awkward sizes: a partial last block, rim tokens outside every region."""
    bs = 32
    src_order, dst_order = ORDERS[src_kind](src, bs), ORDERS[dst_kind](dst, bs)
    nb = -(-src[0] * src[1] * src[2] // bs)
    block_map = torch.rand(2, nb, nb, generator=torch.Generator().manual_seed(sum(src))) < 0.08
    carried = K.resample_block_map(block_map, src, dst, block_size=bs, src_order=src_order, dst_order=dst_order)
    expected = brute_force_resample(block_map, src, dst, bs, src_order, dst_order)
    empty = ~expected.any(-1)  # a row whose tokens all map into empty source rows keeps its best-covered block
    assert torch.equal(carried[~empty], expected[~empty])
    assert carried.any(-1).all()


def test_on_one_grid_carrying_between_orders_is_converting_them():
    grid, bs = (5, 8, 8), 32
    regions, tiles = RegionTileOrder(grid, (2, 4, 4), bs), TileOrder(grid, bs)
    nb = -(-320 // bs)
    block_map = torch.rand(3, nb, nb, generator=torch.Generator().manual_seed(1)) < 0.3
    block_map |= torch.eye(nb, dtype=torch.bool)
    assert torch.equal(K.resample_block_map(block_map, grid, grid, block_size=bs, src_order=regions, dst_order=tiles),
                       convert_map(block_map, regions, tiles, block_size=bs))
    mass = torch.softmax(torch.randn(3, nb, nb, dtype=torch.float64), -1)
    torch.testing.assert_close(K.resample_block_map(mass, grid, grid, block_size=bs, src_order=tiles,
                                                    dst_order=regions),
                               convert_mass(mass, tiles, regions, block_size=bs))


@pytest.mark.parametrize("src,dst", [((6, 16, 16), (7, 16, 16)), ((7, 16, 16), (6, 16, 16)),
                                     ((6, 16, 16), (9, 24, 24))])
def test_a_local_pattern_in_region_order_survives_resampling_and_mass_keeps_its_rows(src, dst):
    """Feature reuse's region order (2x8x8 regions, one 128-token block each) at both grids: the carried map
    covers the pattern built natively at the destination and stays far from dense."""
    bs = 128
    src_order, dst_order = cached_region_order(src, (2, 8, 8), bs), cached_region_order(dst, (2, 8, 8), bs)
    carried = K.resample_block_map(local_window_map(src, bs, 0.3, src_order), src, dst, block_size=bs,
                                   src_order=src_order, dst_order=dst_order)
    native = local_window_map(dst, bs, 0.2, dst_order)
    assert (carried & native).sum() / native.sum() >= 0.95
    assert carried.float().mean() < 0.9
    nb, nb_src = native.shape[-1], -(-src_order.length // bs)
    mass = torch.softmax(torch.randn(1, 2, nb_src, nb_src), -1)
    out = K.resample_block_map(mass, src, dst, block_size=bs, src_order=src_order, dst_order=dst_order)
    assert out.shape[-2:] == (nb, nb)
    torch.testing.assert_close(out.sum(-1), torch.ones(1, 2, nb), atol=1e-5, rtol=0)


def test_an_order_of_another_grid_or_block_size_is_refused():
    grid, other = (4, 8, 8), (5, 8, 8)
    block_map = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="src_order regions2x4x4 is for token grid"):
        K.resample_block_map(block_map, grid, other, block_size=32, src_order=RegionTileOrder(other, (2, 4, 4), 32))
    with pytest.raises(ValueError, match="dst_order .* at block size 64"):
        K.resample_block_map(block_map, grid, other, block_size=32, dst_order=TileOrder(other, 64))
    with pytest.raises(ValueError, match="TileOrder or RegionTileOrder"):
        K.resample_block_map(block_map, grid, other, block_size=32, dst_order="regions2x4x4")


@pytest.mark.parametrize("src,dst", [((4, 16, 16), (5, 16, 16)), ((5, 16, 16), (4, 16, 16)),
                                     ((6, 16, 24), (9, 24, 36)), ((7, 24, 24), (5, 16, 16)),
                                     ((3, 16, 16), (6, 16, 16))])
def test_region_scores_are_carried_as_their_definition_says(src, dst):
    """Feature reuse's region scores (one per complete 2x8x8 region) at another grid: each destination region's
    score is the mean over its tokens of the source region its nearest source token lies in, tokens landing in
    no complete region (a trailing odd frame, rim rows) not counted."""
    region = (2, 8, 8)
    src_regions = pooling.region_cells(src, region, region)[:, 0]
    scores = torch.rand(src_regions.shape[0], generator=torch.Generator().manual_seed(src[0]), dtype=torch.float64)
    carried = K.resample_region_scores(scores, src, dst, region)
    nearest = nearest_source_tokens(src, dst)
    owner = {int(t): r for r, tokens in enumerate(src_regions) for t in tokens}
    dst_regions = pooling.region_cells(dst, region, region)[:, 0]
    assert carried.shape == (dst_regions.shape[0],)
    for r, tokens in enumerate(dst_regions):
        landed = [scores[owner[int(nearest[t])]] for t in tokens if int(nearest[t]) in owner]
        if landed:
            torch.testing.assert_close(carried[r], torch.stack(landed).mean())
        else:
            assert torch.isnan(carried[r])
    torch.testing.assert_close(K.resample_region_scores(scores, src, src, region), scores)


def test_region_scores_of_another_aspect_or_length_are_refused():
    with pytest.raises(ValueError, match="different aspect"):
        K.resample_region_scores(torch.zeros(4), (4, 16, 32), (4, 32, 16), (2, 8, 8))
    with pytest.raises(ValueError, match="complete regions"):
        K.resample_region_scores(torch.zeros(3), (4, 16, 16), (5, 16, 16), (2, 8, 8))


def test_count_matrices_first_made_under_inference_mode_are_ordinary_tensors():
    """The carry's count matrices are cached for the process; made first inside ComfyUI's ``inference_mode`` they
    must still be ordinary tensors (the orders' indices too: ``test_kernels_tile_order.py``)."""
    from chorus.kernels.resample import _assignment_on

    with torch.inference_mode():
        counts = _source_block_assignment((3, 5, 9), (4, 7, 11), 16)
        on_device = _assignment_on(torch.device("cpu"), (3, 5, 9), (4, 7, 11), 16, None, None)
    assert not counts.is_inference() and not on_device.is_inference()
    assert torch.equal(counts, source_block_assignment((3, 5, 9), (4, 7, 11), 16))
