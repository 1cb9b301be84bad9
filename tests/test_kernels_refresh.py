"""Visit refresh: no block pair stays unvisited for more than R consecutive steps."""

import pytest
import torch

import chorus.kernels as K


@pytest.mark.parametrize("max_unvisited", [1, 2, 3, 5])
def test_no_pair_starves(max_unvisited):
    gen = torch.Generator().manual_seed(max_unvisited)
    refresh = K.VisitRefresh(max_unvisited)
    steps, shape = 12, (1, 4, 9, 9)
    fixed = torch.rand(*shape, generator=gen) < 0.2  # a reused mask that never changes
    visited = []
    for step in range(steps):
        extra = refresh.extra_pairs(("layer", 0), fixed, step)
        assert not (extra & fixed).any()
        used = fixed | extra
        refresh.record(("layer", 0), used, step)
        visited.append(used)
    visited = torch.stack(visited)
    # Longest run of consecutive unvisited steps per pair, counted from step 0.
    run = torch.zeros(shape, dtype=torch.long)
    longest = torch.zeros(shape, dtype=torch.long)
    for step in range(steps):
        run = torch.where(visited[step], torch.zeros_like(run), run + 1)
        longest = torch.maximum(longest, run)
    assert int(longest.max()) <= max_unvisited
    # The refresh is staggered: no single step recomputes everything that the mask leaves out.
    extra_per_step = (visited.float() - fixed.float()).clamp_min(0).sum(dim=(1, 2, 3, 4))
    assert extra_per_step.max() < (~fixed).sum()


def test_disabled_and_reset_and_bad_input():
    refresh = K.VisitRefresh(0)
    block_map = torch.eye(4, dtype=torch.bool)[None, None]
    assert not refresh.extra_pairs("k", block_map, 10).any()
    refresh = K.VisitRefresh(1)
    refresh.record("k", torch.ones_like(block_map), 0)
    assert not refresh.extra_pairs("k", block_map, 1).any()
    refresh.reset()
    assert refresh.extra_pairs("k", block_map, 1).any()
    with pytest.raises(ValueError):
        K.VisitRefresh(-1)
    with pytest.raises(ValueError, match="bool"):
        refresh.extra_pairs("k", block_map.float(), 0)
