"""kernels/pooling.py against its loop references, and the engine's region selection / recording."""

import math

import pytest
import torch

from chorus.engine.feature_reuse import (FeatureReuse, FeatureReuseConfig, compact_per_token, feature_state,
                                         select_regions)
from chorus.engine.plan import Plan
from chorus.engine.model_info import ModelInfo, frame_flags_of
from chorus.kernels import pooling, resample_region_scores
from chorus.kernels.fused import FusedSwitch

# awkward grids: ragged rims in every dim, token counts not multiples of 128
GEOMETRIES = [
    ((5, 9, 13), (2, 4, 4), (2, 2, 2)),
    ((3, 6, 10), (2, 2, 4), (1, 2, 2)),
    ((4, 8, 8), (2, 8, 8), (2, 2, 2)),
    ((7, 5, 11), (1, 4, 4), (1, 2, 2)),
]


def _some_regions(grid, region, seed):
    n = pooling.region_counts(grid, region)
    total = n[0] * n[1] * n[2]
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=g)[: max(1, total // 2)]


@pytest.mark.parametrize("grid,region,pool", GEOMETRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_and_unpool_match_reference(grid, region, pool, dtype):
    L = grid[0] * grid[1] * grid[2]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, L, 6, generator=g).to(dtype)
    regions = _some_regions(grid, region, 1)
    layout = pooling.build_layout(grid, region, pool, regions)
    pooled = pooling.pool_tokens(x, layout)
    ref = pooling.pool_tokens_reference(x, grid, region, pool, regions)
    assert pooled.shape == ref.shape and pooled.dtype == dtype
    # tolerance: one rounding of the output to dtype (the mean is accumulated in fp32)
    tol = 2 * torch.finfo(dtype).eps * float(ref.abs().max())
    assert float((pooled.double() - ref).abs().max()) <= tol
    y_c = torch.randn(pooled.shape, generator=g).to(dtype)
    out = pooling.unpool_residual(x, pooled, y_c, layout)
    ref_out = pooling.unpool_residual_reference(x, y_c, grid, region, pool, regions)
    # x + (y - mean): three roundings in dtype, magnitudes ~ |x| + |y| + |mean|
    tol = 4 * torch.finfo(dtype).eps * float(ref_out.abs().max() + x.double().abs().max())
    assert float((out.double() - ref_out).abs().max()) <= tol


def test_a_fused_kernel_failure_takes_the_torch_path_and_only_a_real_failure_turns_them_off(monkeypatch):
    """The fused pooling kernels (CUDA; stood in for by a failing module here): an out-of-memory error gives
    the torch result for that call and the next call tries the kernels again; any other error gives the torch
    result and turns them off for the process."""
    grid, region, pool = GEOMETRIES[0]
    layout = pooling.build_layout(grid, region, pool, _some_regions(grid, region, 1))
    x = torch.randn(1, grid[0] * grid[1] * grid[2], 4, generator=torch.Generator().manual_seed(3))
    want = pooling.pool_tokens_torch(x, layout)
    errors = iter([torch.OutOfMemoryError("CUDA out of memory (test)"), RuntimeError("cannot build (test)")])
    tried = []

    class FailingKernels:
        @staticmethod
        def pool_tokens_triton(x, layout):
            tried.append(1)
            raise next(errors)

    monkeypatch.setattr(pooling, "_FUSED", FusedSwitch("test"))  # the process-wide switch the lookup reads (CUDA only)
    monkeypatch.setattr(pooling, "_fused_kernels", lambda layout, *t: FailingKernels if pooling._FUSED.on else None)
    for _ in range(3):
        assert torch.equal(pooling.pool_tokens(x, layout), want)
    assert len(tried) == 2  # out of memory: tried again; a build failure: not after it


@pytest.mark.parametrize("grid,region,pool", GEOMETRIES)
def test_expand_compact_round_trip_and_indices(grid, region, pool):
    L = grid[0] * grid[1] * grid[2]
    regions = _some_regions(grid, region, 2)
    layout = pooling.build_layout(grid, region, pool, regions)
    assert layout.length == L
    assert layout.compact_length == L - layout.pooled_tokens + layout.num_cells
    x_c = torch.randn(1, layout.compact_length, 3)
    assert torch.equal(pooling.compact_rows(pooling.expand_tokens(x_c, layout), layout), x_c)
    # every token is either kept or in exactly one cell
    covered = torch.cat([layout.keep_index, layout.cell_index.reshape(-1)]).sort().values
    assert torch.equal(covered, torch.arange(L))


def test_no_regions_is_identity():
    grid = (3, 4, 4)
    layout = pooling.build_layout(grid, (2, 2, 2), (2, 2, 2), [])
    x = torch.randn(1, 48, 5)
    assert torch.equal(pooling.pool_tokens(x, layout), x)
    assert torch.equal(pooling.unpool_residual(x, x, x * 2, layout), x * 2)


def test_pool_rotations_give_the_centre_rotation():
    grid, region, pool = (2, 4, 4), (2, 4, 4), (2, 2, 2)
    L = 32
    theta = torch.stack(torch.meshgrid(torch.arange(2.0), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1)
    freqs = torch.tensor([0.3, 0.7, 1.1], dtype=torch.float64)
    ang = (theta.reshape(L, 3) * freqs).sum(-1)  # one rotation per token from (t, h, w)
    rot = torch.stack([torch.cos(ang), -torch.sin(ang), torch.sin(ang), torch.cos(ang)], -1).view(1, L, 2, 2)
    layout = pooling.build_layout(grid, region, pool, [0])
    pooled = pooling.pool_rotations(rot, layout)[0, -layout.num_cells:]
    cells = layout.cell_index
    centre = (theta.reshape(L, 3)[cells].mean(1) * freqs).sum(-1)
    want = torch.stack([torch.cos(centre), -torch.sin(centre), torch.sin(centre), torch.cos(centre)], -1).view(-1, 2, 2)
    assert torch.allclose(pooled, want, atol=1e-12)


@pytest.mark.parametrize("extent", [2, 4, 6, 8])
def test_pool_rotations_point_at_the_centre_at_the_highest_frequency_or_refuse_the_cell(extent):
    """At RoPE's highest frequency (1 radian a token) the mean of ``n`` rotations along an axis points at the
    cell's centre while ``n <= 6``; from 7 on it would point the opposite way: such cells are refused, by the
    rotation pooling and by FeatureReuseConfig."""
    from chorus.engine.feature_reuse import FeatureReuseConfig

    grid = region = pool = (1, 1, extent)
    ang = torch.arange(float(extent), dtype=torch.float64)  # omega = 1
    rot = torch.stack([torch.cos(ang), -torch.sin(ang), torch.sin(ang), torch.cos(ang)], -1).view(1, extent, 2, 2)
    layout = pooling.build_layout(grid, region, pool, [0])
    if extent > pooling.MAX_ROTATION_POOL:
        with pytest.raises(ValueError, match="at most 6"):
            pooling.pool_rotations(rot, layout)
        with pytest.raises(ValueError, match="at most 6"):
            FeatureReuseConfig(region=(2, 8, 8), pool=(1, 1, extent))
        return
    pooled = pooling.pool_rotations(rot, layout)[0, -1]
    centre = torch.tensor((extent - 1) / 2, dtype=torch.float64)
    want = torch.stack([torch.cos(centre), -torch.sin(centre), torch.sin(centre), torch.cos(centre)]).view(2, 2)
    assert torch.allclose(pooled, want, atol=1e-12)


@pytest.mark.parametrize("grid,region,pool", GEOMETRIES)
def test_region_detail_matches_reference(grid, region, pool):
    L = grid[0] * grid[1] * grid[2]
    x = torch.randn(2, L, 4, generator=torch.Generator().manual_seed(3))
    got = pooling.region_detail(x, grid, region, pool)
    ref = pooling.region_detail_reference(x, grid, region, pool)
    assert got.shape == ref.shape
    # float32 sums of ~L*C squares: relative error bounded by a few hundred eps
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-6)
    const = torch.ones(1, L, 4)
    assert float(pooling.region_detail(const, grid, region, pool).abs().max()) == 0.0


def test_bad_geometry_raises():
    with pytest.raises(ValueError, match="divide"):
        pooling.build_layout((4, 4, 4), (2, 3, 4), (2, 2, 2), [0])
    with pytest.raises(ValueError, match="region ids"):
        pooling.build_layout((4, 4, 4), (2, 2, 2), (2, 2, 2), [99])
    layout = pooling.build_layout((4, 4, 4), (2, 2, 2), (2, 2, 2), [0])
    with pytest.raises(ValueError, match="tokens"):
        pooling.pool_tokens(torch.zeros(1, 63, 2), layout)
    with pytest.raises(ValueError):
        FeatureReuseConfig(downsample_share=1.5)
    with pytest.raises(ValueError):
        FeatureReuseConfig(downsample_share=math.nan)


def test_select_regions_share_and_first_frame():
    grid, region = (6, 8, 8), (2, 4, 4)
    n = pooling.region_counts(grid, region)
    total = n[0] * n[1] * n[2]  # 3 * 2 * 2 = 12
    scores = torch.arange(total, dtype=torch.float64).flip(0)  # frame-0 regions most redundant
    picked = select_regions(scores, grid, region, 0.25, keep_first_frame=True)
    assert picked.numel() == 3
    frames = pooling.region_frames(grid, region)
    assert bool((frames[picked] > 0).all())
    assert select_regions(scores, grid, region, 0.0).numel() == 0


def test_select_regions_never_picks_a_frame_with_an_input_image():
    """A first-last-frame request (images on the first and the last latent frame): no region holding the end
    image's frame is downsampled; where the frame count leaves the last frame outside every complete region
    (an odd count: Wan's usual lengths), the regions before it stay eligible. An image frame inside the grid (a
    looped context window that holds the video's end and its start) keeps its region whole too; flags of another
    frame count are refused."""
    region = (2, 4, 4)
    for grid, allowed_starts in (((6, 8, 8), {2}), ((7, 8, 8), {2, 4})):
        n = pooling.region_counts(grid, region)
        scores = torch.arange(n[0] * n[1] * n[2], dtype=torch.float64)  # the last frames' regions most redundant
        picked = select_regions(scores, grid, region, 1.0, held_frames=frame_flags_of((1, 1, 0), grid[0]))
        starts = pooling.region_frames(grid, region)[picked]
        assert set(starts.tolist()) == allowed_starts, (grid, starts)
        start_only = select_regions(scores, grid, region, 1.0, held_frames=frame_flags_of((1, 0, 0), grid[0]))
        assert set(pooling.region_frames(grid, region)[start_only].tolist()) == set(range(2, grid[0] - 1, 2))
    grid = (8, 8, 8)
    n = pooling.region_counts(grid, region)
    scores = torch.arange(n[0] * n[1] * n[2], dtype=torch.float64)
    mid = select_regions(scores, grid, region, 1.0, keep_first_frame=False,
                         held_frames=(False, False, False, True, True, False, False, False))
    assert set(pooling.region_frames(grid, region)[mid].tolist()) == {0, 6}
    with pytest.raises(ValueError, match="image-frame flags"):
        select_regions(scores, grid, region, 1.0, held_frames=(True,) * 7)


def _info():
    return ModelInfo("wan", "wan2.2-a14b-i2v", 2, 2, 4, 36, "fp0")


def test_miss_records_scores_and_hit_reuses_them():
    grid = (4, 8, 8)
    L = 256
    cfg = FeatureReuseConfig(downsample_share=0.25, region=(2, 4, 4), pool=(2, 2, 2), full_layers=0)
    miss = Plan.miss("miss", latent_shape=(16, 4, 16, 16))
    fr = FeatureReuse(miss, cfg, _info())
    fr.begin_run([1.0, 0.5, 0.0])
    # a block whose update is smooth on the right half and rough on the left half
    w = torch.arange(8).repeat(32)
    rough = (w < 4).float().view(1, L, 1)
    def block_fn(x, per_token, layout):
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(x.shape[1]))
        return x + 1.0 + (rough * noise if layout is None else 0)
    x = torch.randn(1, L, 3)
    for sigma in (1.0, 0.5):
        fr.block(block_fn, x, layer=0, sigma=sigma, grid=grid)
    fr.end_run()
    meta = miss.request_meta["feature_reuse"]
    assert meta["token_grid"] == list(grid) and set(meta["scores"]["0"]) == {"1.0", "0.5"}
    scores = torch.tensor(meta["scores"]["0"]["1.0"])
    right = pooling.region_cells(grid, (2, 4, 4), (2, 2, 2))[:, 0, 0] % 8 >= 4
    assert float(scores[right].min()) > 0.99 > float(scores[~right].max())

    info = _info()
    sig = {"token_grid": list(grid), "variant": info.variant, "experts": [info.fingerprint],
           "num_layers": info.num_layers, "num_heads": info.num_heads}
    entry_meta = {"signature": sig, "feature_reuse": meta}
    hit = Plan("hit", masks={(0, 0, 0, 0): torch.ones(1, 2, 2, dtype=torch.bool)}, entry_meta=entry_meta,
               similarity=0.95, entry_id=1)
    fr_hit = FeatureReuse(hit, cfg, _info())
    fr_hit.begin_run([1.0, 0.5, 0.0])
    seen = []
    def block_fn2(x, per_token, layout):
        seen.append(None if layout is None else layout.compact_length)
        return x + 1.0
    y = fr_hit.block(block_fn2, x, layer=0, sigma=1.0, grid=grid)
    assert seen[0] is not None and seen[0] < L
    layout = fr_hit.layout_for(1.0, grid, x.device)
    # only smooth (right-half, not frame-0) regions were pooled; a constant update is reproduced exactly
    cells_w = layout.cell_index % 8
    assert bool((cells_w >= 4).all())
    assert torch.allclose(y, x + 1.0, atol=1e-6)
    assert feature_state(hit).blocks_reduced == 1 and feature_state(hit).blocks_full == 0

    def short_compact_block(x, per_token, layout):  # a compact output one token short cannot be expanded
        return (x + 1.0)[:, :-1] if layout is not None else x + 2.0
    y = fr_hit.block(short_compact_block, x, layer=0, sigma=0.5, grid=grid)
    assert torch.equal(y, x + 2.0), "the call runs in full instead of raising"
    assert "could not be expanded" in fr_hit.full_blocks_reason and any(
        "full blocks from now on" in m for m in hit.stats.messages), hit.stats.messages


def test_compact_per_token_rules():
    layout = pooling.build_layout((2, 2, 2), (2, 2, 2), (2, 2, 2), [0])
    t = torch.randn(1, 8, 3)
    out = compact_per_token({"a": (t, "mean"), "b": (t, "none")}, layout)
    assert out["a"].shape == (1, 1, 3) and out["b"] is t
    with pytest.raises(ValueError, match="rule"):
        compact_per_token({"a": (t, "max")}, layout)


def test_expand_and_compact_on_another_token_dim():
    layout = pooling.build_layout((3, 4, 4), (2, 2, 2), (2, 2, 2), [1, 2])
    q = torch.randn(1, 2, layout.compact_length, 8)  # [B, H, L', D]
    full = pooling.expand_tokens(q, layout, dim=2)
    assert torch.equal(full.transpose(1, 2), pooling.expand_tokens(q.transpose(1, 2), layout))
    assert torch.equal(pooling.compact_rows(full, layout, dim=2), q)
    with pytest.raises(ValueError, match="dim 2"):
        pooling.compact_rows(q, layout, dim=2)


def test_non_finite_scores_are_never_selected_or_recorded():
    grid, region = (6, 8, 8), (2, 4, 4)
    scores = torch.ones(12, dtype=torch.float64)
    scores[4:8] = math.nan  # t-region 1
    picked = select_regions(scores, grid, region, 1.0)
    assert set(picked.tolist()) == set(range(8, 12))
    state = feature_state(Plan.miss("m"))
    state.record(0, 1.0, grid, region, (2, 2, 2), torch.tensor([math.nan] * 12))
    assert state.export() is None
    # a finite call of the same step afterwards is the step's score alone (the non-finite one not counted)
    state.record(0, 1.0, grid, region, (2, 2, 2), torch.full((12,), 0.25, dtype=torch.float64))
    state.record(0, 1.0, grid, region, (2, 2, 2), torch.tensor([1.0] + [math.inf] * 11))
    assert state.export()["scores"] == {"0": {"1.0": [0.25] * 12}}


def test_scores_of_another_grid_of_the_aspect_are_carried_to_the_first_grid_when_exported():
    """Context windows of two lengths: a step whose calls all ran at another grid of the first call's aspect still
    gets scores at the first grid (carried as kernels.resample_region_scores carries them); a step with calls at
    both grids is their mean weighted by call count; another aspect is not recorded."""
    first, longer, region, pool = (4, 8, 8), (6, 8, 8), (2, 4, 4), (2, 2, 2)
    state = feature_state(Plan.miss("m"))
    state.record(0, 1.0, first, region, pool, torch.full((8,), 0.2, dtype=torch.float64))  # 2 x 2 x 2 regions
    longer_scores = torch.linspace(0.0, 1.0, 12, dtype=torch.float64)  # 3 x 2 x 2 regions
    for _ in range(3):
        state.record(0, 1.0, longer, region, pool, longer_scores)
    state.record(0, 0.5, longer, region, pool, longer_scores)  # a step with no call at the first grid
    state.record(0, 0.5, (4, 16, 8), region, pool, torch.ones(16, dtype=torch.float64))  # another aspect
    carried = resample_region_scores(longer_scores, longer, first, region)
    exported = state.export()
    assert exported["token_grid"] == list(first)
    assert exported["scores"]["0"]["0.5"] == [round(float(v), 4) for v in carried]
    assert exported["scores"]["0"]["1.0"] == [round(float(v), 4) for v in (0.2 + 3 * carried) / 4]
