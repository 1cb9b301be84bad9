"""Resampling block maps/mass between token grids in 3D block coordinates."""

import pytest
import torch

import chorus.kernels as K
from chorus.kernels.resample import _source_block_assignment


def local_window_map(grid, block_size, radius):
    """Bool map of a 3D-local attention pattern: blocks whose token centroids are within ``radius``
    (in relative frame/row/column units), so it is defined independently of the grid size."""
    t, h, w = grid
    n = t * h * w
    idx = torch.arange(n)
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


def test_mass_rows_keep_their_sum():
    src, dst = (4, 8, 8), (6, 12, 12)
    nb = -(-256 // 64)
    mass = torch.softmax(torch.randn(2, 3, nb, nb), -1)
    out = K.resample_block_map(mass, src, dst, block_size=64)
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 3, out.shape[-2]), atol=1e-5, rtol=0)


def test_every_row_keeps_a_block_even_with_high_threshold():
    src, dst = (4, 8, 8), (5, 8, 8)
    block_map = torch.eye(4, dtype=torch.bool)[None, None]
    out = K.resample_block_map(block_map, src, dst, block_size=64, threshold=0.99)
    assert out.any(-1).all()


def test_assignment_counts_every_destination_token():
    counts = _source_block_assignment((3, 5, 7), (4, 6, 9), 16)
    assert counts.sum() == 4 * 6 * 9


def test_aspect_mismatch_and_bad_input():
    assert K.aspect_matches((21, 30, 52), (21, 45, 78))
    assert not K.aspect_matches((21, 30, 52), (21, 52, 30))
    with pytest.raises(ValueError, match="different aspect"):
        K.resample_block_map(torch.ones(1, 1, 2, 2, dtype=torch.bool), (1, 8, 16), (1, 16, 8), block_size=64)
    with pytest.raises(ValueError, match="does not match src_grid"):
        K.resample_block_map(torch.ones(1, 1, 3, 3, dtype=torch.bool), (1, 8, 16), (1, 8, 16), block_size=64)
    with pytest.raises(ValueError, match="token grid"):
        K.resample_block_map(torch.ones(1, 1, 2, 2, dtype=torch.bool), (8, 16), (1, 8, 16), block_size=64)
