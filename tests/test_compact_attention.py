"""Compact self-attention of feature reuse (issue 17, part 2): the region-aligned tile order
(``RegionTileOrder``: every tile is one of feature reuse's regions and exactly one block), a layout
built in it (kept tokens in that order: every kept tile stays one whole block of the compact
sequence), the compact block map, and ``ChorusAttention.compact_self_attention`` against the fp64
oracle of the full-grid computation it stands for: every cell's key repeated over its tokens' places
in the order, the token mask the compact map implies."""

from __future__ import annotations

import pytest
import torch

from chorus import kernels
from chorus.engine import ChorusAttention, ModelInfo, Plan, SparseConfig
from chorus.engine.feature_reuse import select_regions
from chorus.kernels import pooling
from chorus.kernels.tile_order import RegionTileOrder, cached_region_order

# awkward grids: ragged rims, an odd frame count, token counts not multiples of the block
GRIDS = [((5, 8, 8), (2, 4, 4)), ((7, 9, 13), (2, 4, 4)), ((6, 12, 10), (2, 4, 4)), ((5, 16, 16), (2, 8, 8)),
         ((3, 17, 19), (1, 4, 8))]


@pytest.mark.parametrize("grid,region", GRIDS)
def test_region_order_is_a_permutation_with_each_tile_one_block(grid, region):
    bs = region[0] * region[1] * region[2]
    order = RegionTileOrder(grid, region, bs)
    length = grid[0] * grid[1] * grid[2]
    assert torch.equal(order.perm.sort().values, torch.arange(length))
    assert torch.equal(order.perm[order.inverse], torch.arange(length))
    assert torch.equal(order.perm[: grid[1] * grid[2]], torch.arange(grid[1] * grid[2]))  # frame 0 = the prefix
    cells = pooling.region_cells(grid, region, (1, 1, 1))  # [R, tokens, 1]: each region's tokens
    p0 = order.first_tile_block
    assert p0 * bs >= grid[1] * grid[2]
    for i, r in enumerate(order.tile_regions.tolist()):
        block = order.perm[(p0 + i) * bs:(p0 + i + 1) * bs]
        assert torch.equal(block.sort().values, cells[r, :, 0].sort().values)  # tile i is block P0 + i
    frames = pooling.region_frames(grid, region)
    assert bool((frames[order.tile_regions] > 0).all())  # regions holding frame 0 are never tiles
    assert order.name == "regions{}x{}x{}".format(*region)
    with pytest.raises(ValueError, match="must hold"):
        RegionTileOrder(grid, region, bs * 2)


def _layout(grid, region, share=0.5, seed=0, order=None, end_image_leads=False):
    counts = pooling.region_counts(grid, region)
    scores = torch.rand(counts[0] * counts[1] * counts[2], generator=torch.Generator().manual_seed(seed))
    held = (False,) * (grid[0] - 1) + (True,) if getattr(order, "last_frame_rim", False) else None  # as feature reuse
    regions = select_regions(scores, grid, region, share, held_frames=held)
    return pooling.build_layout(grid, region, (1, 2, 2), regions, order=order, end_image_leads=end_image_leads), regions


@pytest.mark.parametrize("grid,region", GRIDS[:4])
def test_a_layout_in_the_order_keeps_tiles_whole_and_pools_exactly_as_before(grid, region):
    bs = region[0] * region[1] * region[2]
    order = cached_region_order(grid, region, bs)
    plain, regions = _layout(grid, region)
    ordered, _ = _layout(grid, region, order=order)
    assert regions.numel() > 0
    x = torch.randn(2, order.length, 5, generator=torch.Generator().manual_seed(1))
    # the same compact tokens, kept ones in the order: pooling and unpooling are unchanged
    pos = order.inverse[plain.keep_index]
    assert torch.equal(ordered.keep_index, plain.keep_index[pos.argsort()])
    assert torch.equal(ordered.cell_index.sort(0).values, plain.cell_index.sort(0).values)
    y_plain, y_ordered = pooling.pool_tokens(x, plain), pooling.pool_tokens(x, ordered)
    # compact position in the plain layout of each compact token of the ordered one (same tokens, same cells)
    where = plain.expand_index[ordered.rep_index]
    torch.testing.assert_close(y_ordered, y_plain[:, where])
    upd = torch.randn_like(y_plain)
    torch.testing.assert_close(pooling.unpool_residual(x, y_ordered, (y_plain + upd)[:, where], ordered),
                               pooling.unpool_residual(x, y_plain, y_plain + upd, plain))
    # every kept tile is one whole block of the compact sequence, with that tile's block as its only source
    src = ordered.block_sources
    p0 = order.first_tile_block
    kept_tiles = [i for i, r in enumerate(order.tile_regions.tolist()) if r not in set(regions.tolist())]
    for rank, i in enumerate(kept_tiles):
        row = p0 + rank
        assert src[row].nonzero().flatten().tolist() == [p0 + i]
    assert bool(src.any(1).all())  # every compact block has a source
    assert ordered.cell_size == 4 and ordered.num_cells * 4 == ordered.pooled_tokens


@pytest.mark.parametrize("grid,region,last_frame_rim", [
    ((5, 8, 8), (2, 4, 4), False), ((7, 9, 13), (2, 4, 4), False), ((5, 16, 16), (2, 8, 8), False),
    ((6, 8, 8), (2, 4, 4), True), ((8, 9, 13), (2, 4, 4), True)])  # even counts: a first-last-frame entry's kind
def test_a_layout_that_leads_with_the_end_image_keeps_the_same_tokens_and_its_tiles_whole(grid, region,
                                                                                         last_frame_rim):
    """``end_image_leads``: the compact sequence is the last frame's tokens, then frame 0's, then rim padding to
    whole blocks; the kept tiles stay one whole block each (with their own tile as the only source), and the
    compact tokens, cells and pooling are the order's own layout's, rearranged. At an even frame count, in the
    region order kind that keeps the last frame rim."""
    bs = region[0] * region[1] * region[2]
    order = cached_region_order(grid, region, bs, last_frame_rim=last_frame_rim)
    assert order.last_frame_is_suffix
    ordered, regions = _layout(grid, region, share=0.25, order=order)
    leads, _ = _layout(grid, region, share=0.25, order=order, end_image_leads=True)
    assert leads.end_image_leads and not ordered.end_image_leads and regions.numel() > 0
    hw, length = grid[1] * grid[2], order.length
    assert torch.equal(leads.keep_index[:hw], torch.arange(length - hw, length))  # the last frame, raster
    assert torch.equal(leads.keep_index[hw:2 * hw], torch.arange(hw))  # then frame 0
    assert torch.equal(leads.keep_index.sort().values, ordered.keep_index.sort().values)
    assert torch.equal(leads.cell_index, ordered.cell_index)
    x = torch.randn(2, length, 5, generator=torch.Generator().manual_seed(1))
    where = ordered.expand_index[leads.rep_index]  # each compact token's place in the order's own layout
    y_ordered = pooling.pool_tokens(x, ordered)
    torch.testing.assert_close(pooling.pool_tokens(x, leads), y_ordered[:, where])
    upd = torch.randn_like(y_ordered)
    torch.testing.assert_close(pooling.unpool_residual(x, y_ordered[:, where], (y_ordered + upd)[:, where], leads),
                               pooling.unpool_residual(x, y_ordered, y_ordered + upd, ordered))
    lead_blocks = -(-2 * hw // bs)  # the two frames and their padding
    src, p0 = leads.block_sources, order.first_tile_block
    kept_tiles = [i for i, r in enumerate(order.tile_regions.tolist()) if r not in set(regions.tolist())]
    assert kept_tiles
    for rank, i in enumerate(kept_tiles):
        assert src[lead_blocks + rank].nonzero().flatten().tolist() == [p0 + i]
    assert bool(src.any(1).all())
    with pytest.raises(ValueError, match="region tile order"):
        pooling.build_layout(grid, region, (1, 2, 2), regions, end_image_leads=True)
    other = grid if grid[0] % 2 == 0 else (grid[0] + 1,) + grid[1:]  # the plain kind at an even count: the last
    # frame in a complete region
    with pytest.raises(ValueError, match="last frame is its suffix"):
        pooling.build_layout(other, region, (1, 2, 2), regions, order=cached_region_order(other, region, bs),
                             end_image_leads=True)
    if last_frame_rim:  # a region on the last frame pooled (feature reuse never pools one in this kind)
        on_last = torch.nonzero(pooling.region_frames(grid, region) + region[0] == grid[0]).reshape(-1)[:1]
        with pytest.raises(ValueError, match="kept whole"):
            pooling.build_layout(grid, region, (1, 2, 2), on_last, order=order, end_image_leads=True)


def test_a_grid_with_too_little_rim_to_lead_with_the_end_image_keeps_the_order_s_own_layout():
    """(5, 8, 9) in 2 x 8 x 8 regions: 88 rim tokens, 112 needed to pad the two 72-token frames to whole blocks.
    ``build_layout`` refuses; a hit's feature reuse for a forward whose self-attention biases its end image then
    builds the order's own layout (its compact calls bias the start image alone, with the runtime's note); on a grid
    with the rim for it, the layout that leads."""
    from chorus.engine.feature_reuse import META_VERSION, FeatureReuse, FeatureReuseConfig

    region = (2, 8, 8)
    small = cached_region_order((5, 8, 9), region, 128)
    assert small.last_frame_is_suffix and small.tile_regions.numel() == 1
    with pytest.raises(ValueError, match="88 rim tokens, 112 needed"):
        pooling.build_layout((5, 8, 9), region, (2, 2, 2), small.tile_regions, order=small, end_image_leads=True)

    for grid, leads in (((5, 8, 9), False), ((5, 16, 16), True)):
        order = cached_region_order(grid, region, 128)
        regions = pooling.region_counts(grid, region)
        scores = [1.0] * (regions[0] * regions[1] * regions[2])
        sig = {"format": 1, "family": "wan", "variant": INFO.variant, "experts": [INFO.fingerprint], "num_layers": 2,
               "num_heads": 2, "latent_shape": [16, grid[0], 2 * grid[1], 2 * grid[2]], "token_grid": list(grid),
               "block_size": 128, "token_order": order.name, "step_sigmas": [1.0], "head_groups": 1}
        meta = {"version": META_VERSION, "token_grid": list(grid), "region": list(region), "pool": [2, 2, 2],
                "scores": {"0": {"1.0": scores}}}
        nb = -(-order.length // 128)
        hit = Plan("hit", entry_id=1, similarity=1.0, masks={(0, 0, 0, 0): torch.ones(2, nb, nb, dtype=torch.bool)},
                   entry_meta={"signature": sig, "feature_reuse": meta}, latent_shape=tuple(sig["latent_shape"]))
        fr = FeatureReuse(hit, FeatureReuseConfig(downsample_share=1.0, region=region, pool=(2, 2, 2)), INFO)
        fr.begin_run([1.0, 0.0])
        flags = (True, False, False, False, True)
        layout = fr.layout_for(1.0, grid, "cpu", image_flags=lambda: flags, end_image_biased=True)
        assert layout is not None and layout.order is order and layout.end_image_leads == leads, hit.stats.messages
        # no lead where the forward's last frame holds no image, or where its self-attention does not bias it
        assert not fr.layout_for(1.0, grid, "cpu", image_flags=lambda: flags[:-1] + (False,),
                                 end_image_biased=True).end_image_leads
        assert not fr.layout_for(1.0, grid, "cpu", image_flags=lambda: flags).end_image_leads


@pytest.mark.parametrize("rows_agree,most", [(8, 1.02), (1, 1.06)])
def test_leading_with_the_end_image_widens_few_compact_blocks_at_wan_s_480p_grid(rows_agree, most):
    """The cost of leading with the end image: its frame and frame 0 sit off their blocks' places in the order, so
    their compact blocks draw on two blocks each (the tiles and the rest of the rim keep theirs). On Wan's 480p
    grid, 30% of the regions pooled, a map of 15% plus both image frames' keys: at most 2% more compact blocks
    where neighbouring query blocks keep the same keys (as attention maps do), 6% where every row is random."""
    grid, region, bs = (21, 30, 52), (2, 8, 8), 128
    order = cached_region_order(grid, region, bs)
    ordered, _ = _layout(grid, region, share=0.3, order=order)
    leads, _ = _layout(grid, region, share=0.3, order=order, end_image_leads=True)
    nb, hw = -(-order.length // bs), grid[1] * grid[2]
    gen = torch.Generator().manual_seed(5)
    block_map = (torch.rand(-(-nb // rows_agree), nb, generator=gen) < 0.15).repeat_interleave(rows_agree, 0)[:nb]
    block_map |= torch.eye(nb, dtype=torch.bool)
    block_map[:, : -(-hw // bs)] = True
    block_map[:, (order.length - hw) // bs:] = True
    plain, led = (int(pooling.compact_block_map(block_map, layout.block_sources).sum()) for layout in (ordered, leads))
    assert plain <= led <= most * plain, (plain, led)


def test_compact_block_map_is_the_union_over_the_source_pairs():
    gen = torch.Generator().manual_seed(2)
    block_map = torch.rand(3, 7, 7, generator=gen) < 0.2
    sources = torch.rand(5, 7, generator=gen) < 0.3
    sources[:, 0] |= ~sources.any(1)
    got = pooling.compact_block_map(block_map, sources)
    want = torch.zeros(3, 5, 5, dtype=torch.bool)
    for h in range(3):
        for i in range(5):
            for j in range(5):
                want[h, i, j] = bool(block_map[h][sources[i]][:, sources[j]].any())
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="do not fit"):
        pooling.compact_block_map(block_map, sources[:, :6])


INFO = ModelInfo("wan", "wan2.2-a14b-i2v", 2, 2, 64, 36, "fp")


# (first-frame bias, last-frame bias, layout leads with the end image): none; a start image; a first-last-frame
# request (Guidance Boost's one value on both); a window that ends the video without a start image; a layout
# that does not lead (the end image's bias not applied, with a note)
BIASES = [(0.0, 0.0, False), (0.7, 0.0, False), (0.7, 0.7, True), (0.0, 0.7, True), (0.7, 0.7, False)]


@pytest.mark.parametrize("grid,region,rim", [((5, 8, 8), (2, 4, 4), False), ((7, 9, 13), (2, 4, 4), False),
                                             ((6, 8, 8), (2, 4, 4), True)])
@pytest.mark.parametrize("first,last,leads", BIASES)
@pytest.mark.parametrize("entry_frames", [0, -1])
def test_compact_self_attention_matches_the_full_grid_computation(grid, region, rim, first, last, leads, entry_frames):
    """``entry_frames`` -1: the entry was recorded at a grid one frame shorter (the first of context windows whose
    later windows get an anchor frame): its map is resampled to the call's grid in the region order there.
    The image biases as the full grid takes them: the first frame's keys and the last frame's (the order's suffix:
    at an odd frame count, and in a first-last-frame entry's kind, ``rim``, at any), on the compact sequence through
    the key prefix where the layout leads with the last frame."""
    bs = region[0] * region[1] * region[2]
    order = cached_region_order(grid, region, bs, last_frame_rim=rim)
    layout, regions = _layout(grid, region, share=0.5, seed=3, order=order, end_image_leads=leads)
    entry_grid = (grid[0] + entry_frames,) + grid[1:]
    entry_order = cached_region_order(entry_grid, region, bs, last_frame_rim=rim)
    nb = -(-entry_order.length // bs)
    gen = torch.Generator().manual_seed(4)
    stored = (torch.rand(2, nb, nb, generator=gen) < 0.35) | torch.eye(nb, dtype=torch.bool)
    sig = {"format": 1, "family": "wan", "variant": "wan2.2-a14b-i2v", "experts": ["fp"], "num_layers": 2,
           "num_heads": 2, "latent_shape": [16, entry_grid[0], 2 * grid[1], 2 * grid[2]],
           "token_grid": list(entry_grid), "block_size": bs, "token_order": order.name, "step_sigmas": [1.0],
           "head_groups": 1}
    plan = Plan("hit", entry_id=1, similarity=1.0, masks={(0, 0, 1, 0): stored}, entry_meta={"signature": sig},
                latent_shape=tuple(sig["latent_shape"]))
    # the compact computation itself (the pooled tail with a suffix bias: tests/test_kernels_pooled_tail.py)
    handle = ChorusAttention(plan, SparseConfig(block_size=bs, k_min=1, backend="reference", verify_threshold=0.0,
                                                pooled_tail=False), INFO)
    q, k, v = (torch.randn(1, 2, layout.compact_length, 32, generator=gen) for _ in range(3))
    out = handle.compact_self_attention(q, k, v, layout=layout, layer=1, sigma=1.0, first_frame_bias=first,
                                        last_frame_bias=last, dense_fn=lambda *a: pytest.fail("fell back to dense"))
    assert plan.stats.sparse_calls == 1 and plan.stats.fallback_calls == 0, plan.stats.messages
    unbiased_end = last and not leads
    noted = [m for m in plan.stats.messages if "end-image bias is not applied" in m]
    assert len(noted) == (1 if unbiased_end else 0), plan.stats.messages
    # the oracle: the compact queries over the full grid's keys in the order, each cell's key repeated
    # over its tokens, with the token mask the compact map implies; fp64
    served = kernels.resample_block_map(stored, entry_grid, grid, block_size=bs, src_order=entry_order,
                                        dst_order=order)  # the entry's own where entry_grid is grid
    assert torch.equal(served, stored) or entry_frames
    cmap = pooling.compact_block_map(served[None], layout.block_sources)[0]  # [H, C, C]
    key_pos = layout.expand_index[order.perm]  # compact position of the token at each place of the order
    k_full, v_full = (t.index_select(2, key_pos).double() for t in (k, v))
    rows = torch.arange(layout.compact_length) // bs
    mask = cmap[:, rows][:, :, key_pos // bs]  # [H, L', L]
    scores = (q.double() @ k_full.transpose(-1, -2)) / 32 ** 0.5
    hw = grid[1] * grid[2]
    scores[..., :hw] += first
    if not unbiased_end:
        scores[..., order.length - hw:] += last  # the last frame: the order's suffix
    scores = scores.masked_fill(~mask[None], float("-inf"))
    oracle = torch.softmax(scores, -1) @ v_full
    torch.testing.assert_close(out.double(), oracle, atol=2e-5, rtol=1e-4)
    # the same computation without the cells' weight differs: the suffix bias acts
    prefix = dict(prefix_len=hw * (bool(first) + bool(last)), prefix_bias=last) if leads else \
        dict(prefix_len=hw if first else 0, prefix_bias=first)
    plain = kernels.block_sparse_attention(q, k, v, cmap[None], block_size=bs, backend="reference", **prefix)
    assert not torch.allclose(plain.double(), oracle, atol=1e-3)
    # the blocks of the compact map, fewer than the full grid would compute (a layout that leads with the end image
    # draws its image frames' rows on two blocks each: on a grid this small, more)
    assert plan.stats.blocks_computed == int(cmap.sum())
    assert leads or plan.stats.blocks_computed < int(served.sum())


def test_compact_self_attention_falls_back_to_dense_when_the_orders_differ():
    """The fallback of a compact call is the dense attention of its full grid read on its rows: each
    pooled key weighs the tokens it stands for (fp64 oracle of the expanded call), not one token."""
    grid, region, bs = (5, 8, 8), (2, 4, 4), 32
    order = cached_region_order(grid, region, bs)
    layout, _ = _layout(grid, region, order=order)
    nb = -(-order.length // bs)
    sig = {"format": 1, "family": "wan", "variant": "wan2.2-a14b-i2v", "experts": ["fp"], "num_layers": 2,
           "num_heads": 2, "latent_shape": [16, 5, 16, 16], "token_grid": list(grid), "block_size": bs,
           "token_order": "thw", "step_sigmas": [1.0], "head_groups": 1}
    plan = Plan("hit", entry_id=1, similarity=1.0, masks={(0, 0, 0, 0): torch.ones(2, nb, nb, dtype=torch.bool)},
                entry_meta={"signature": sig}, latent_shape=(16, 5, 16, 16))
    handle = ChorusAttention(plan, SparseConfig(block_size=bs, k_min=1, backend="reference"), INFO)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, layout.compact_length, 32, generator=gen) for _ in range(3))
    out = handle.compact_self_attention(q, k, v, layout=layout, layer=0, sigma=1.0,
                                        dense_fn=lambda *a: pytest.fail("a compact call's dense is the weighted one"))
    assert plan.stats.fallback_calls == 1 and any("token order" in m for m in plan.stats.messages)
    k_full, v_full = (t.index_select(2, layout.expand_index).double() for t in (k, v))  # every token its cell's k/v
    oracle = torch.softmax(q.double() @ k_full.transpose(-1, -2) / 32 ** 0.5, -1) @ v_full
    torch.testing.assert_close(out.double(), oracle, atol=2e-5, rtol=1e-4)
    unweighted = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert not torch.allclose(unweighted.double(), oracle, atol=1e-3)


@pytest.mark.parametrize("first,last,leads,ordered", [(0.6, 0.0, False, False), (0.0, 0.6, False, False),
                                                      (0.6, 0.6, False, True), (0.6, 0.0, False, True),
                                                      (0.6, 0.6, True, True), (0.4, 0.9, True, True)])
def test_a_compact_call_s_dense_attention_is_its_full_grid_s_with_every_image_bias(first, last, leads, ordered):
    """``AttnCall.dense`` of a compact call (a fallback, a device without a fast kernel, guidance alone) equals
    the dense attention of its full grid read on its rows, with the first- and last-frame biases where the full
    grid takes them: through the cells' weight and the key prefix where the biases ride on it, through the
    expansion where they do not (a raster layout; an end image in a layout that does not lead with it)."""
    from chorus.engine.call import AttnCall

    grid, region = (6, 8, 8), (2, 4, 4)
    order = cached_region_order(grid, region, 32, last_frame_rim=True) if ordered else None
    layout, _ = _layout(grid, region, share=0.5, seed=5, order=order, end_image_leads=leads)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, layout.compact_length, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    call = AttnCall(q, k, v, layer=0, sigma=1.0, grid=grid, layout=layout, first_frame_bias=first,
                    last_frame_bias=last)
    out = call.dense()
    full = [pooling.expand_tokens(t, layout, dim=2) for t in (q, k, v)]  # raster order, every token its cell's
    hw = grid[1] * grid[2]
    bias = torch.zeros(full[1].shape[2], dtype=torch.float64)
    bias[:hw] += first
    bias[-hw:] += last
    scores = full[0] @ full[1].transpose(-1, -2) / 16 ** 0.5 + bias
    oracle = pooling.compact_rows(torch.softmax(scores, -1) @ full[2], layout, dim=2)
    torch.testing.assert_close(out, oracle, atol=1e-9, rtol=1e-9)
