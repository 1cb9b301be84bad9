"""Token order in signatures, retrieval, the plan and the runtime (issue 17, part 2): an entry records
the order its blocks were cut from (raster ``"thw"`` by default; entries without the field are raster;
``"regions..."`` when the request ran feature reuse, ``RegionTileOrder``); a hit runs in its entry's
order, exactly (at another grid of the same aspect, resampled to the order of its kind there); an order
that cannot be rebuilt is a miss, never misread."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chorus import kernels
from chorus.cache_store import Workspace
from chorus.engine import ModelInfo, Plan, build_signature, latent_compatibility, retrieve_plan
from chorus.engine.compat import TOKEN_ORDER, entry_token_order, grid_carry, order_at, order_of_kind, token_order_name
from chorus.kernels import pooling
from chorus.kernels.tile_order import RegionTileOrder, TileOrder, cached_region_order, cached_tile_order

BS = 32
GRID = (3, 5, 7)
LATENT = (16, 3, 10, 14)
QB = 4


def signature(order=TOKEN_ORDER, grid=GRID, latent=LATENT):
    sig = {"format": 1, "family": "wan", "variant": "wan2.2-a14b-i2v", "experts": ["fp"], "num_layers": 2,
           "num_heads": 2, "latent_shape": list(latent), "token_grid": list(grid), "block_size": BS,
           "step_sigmas": [1.0, 0.5], "head_groups": 1}
    if order is not None:
        sig["token_order"] = order
    return sig


def test_entry_token_order_reads_raster_tile_and_region_orders_and_refuses_the_rest():
    assert TOKEN_ORDER == "thw"
    assert entry_token_order(signature("thw")) is None
    assert entry_token_order(signature("raster")) is None
    assert entry_token_order(signature(None)) is None  # entries without the field are raster
    tile = TileOrder(GRID, BS)
    assert entry_token_order(signature(tile.name)) == tile
    plain = TileOrder(GRID, BS, serpentine=False)
    assert entry_token_order(signature(plain.name)) == plain
    regions = entry_token_order(signature("regions2x4x4", grid=RGRID))
    assert isinstance(regions, RegionTileOrder) and regions is cached_region_order(RGRID, (2, 4, 4), BS)
    last = entry_token_order(signature("regions2x4x4-last", grid=RGRID))  # a first-last-frame entry's kind
    assert last is cached_region_order(RGRID, (2, 4, 4), BS, last_frame_rim=True) and last.name == "regions2x4x4-last"
    for bad in ("hwt", "tile9x9x9", "regions2x8x8", "regions2x4", "regionsaxbxc", "regions2x4x4-first",
                "regions2x4x4-last-last", 3, ["thw"], {"a": 1}):
        with pytest.raises(ValueError):
            entry_token_order(signature(bad))  # (regions2x8x8 holds 128 tokens, not a 32-token block)
    with pytest.raises(ValueError, match="out of range"):  # a hostile grid is not allocated
        entry_token_order(signature(tile.name, grid=(10**6, 10**4, 10**4)))
    assert token_order_name(None) == "thw" and token_order_name(tile) == tile.name
    assert cached_tile_order(GRID, BS) is cached_tile_order(GRID, BS)


def test_latent_compatibility_by_order():
    tile = TileOrder(GRID, BS).name
    assert latent_compatibility(signature(None), LATENT)[0] == "same"
    assert latent_compatibility(signature("raster"), LATENT)[0] == "same"
    assert latent_compatibility(signature("thw"), (16, 3, 20, 28))[0] == "resample"
    assert latent_compatibility(signature(tile), LATENT)[0] == "same"  # served in its own order
    verdict, why = latent_compatibility(signature(tile), (16, 3, 20, 28))
    assert verdict == "resample" and f"(token order {tile})" in why  # to the tile order of that grid
    verdict, why = latent_compatibility(signature(tile), (16, 3, 28, 20))
    assert verdict == "incompatible" and "another aspect" in why
    verdict, why = latent_compatibility(signature("zigzag"), LATENT)
    assert verdict == "incompatible" and "unknown token order" in why
    assert latent_compatibility(signature({"a": 1}), LATENT)[0] == "incompatible"


def _ws_with(path, order_name):
    ws = Workspace.open(path)
    emb = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    masks = {(0, s, l, 0): torch.ones(2, QB, QB, dtype=torch.bool) for s in range(2) for l in range(2)}
    ws.add(emb, masks, {"signature": signature(order_name)})
    return ws, emb


@pytest.mark.parametrize("order_name,hit", [(None, True), ("thw", True), ("raster", True),
                                            ("tile", True), ("tile1x2x3", False), ("zigzag", False)])
def test_retrieval_serves_every_rebuildable_order_and_misses_the_others(tmp_path, order_name, hit):
    if order_name == "tile":
        order_name = TileOrder(GRID, BS).name
    ws, emb = _ws_with(tmp_path / "ws", order_name)
    plan = retrieve_plan(ws, emb, LATENT, similarity_threshold=0.9)
    assert plan.is_hit == hit, plan.message
    if not hit:
        assert "token order" in plan.message


def test_a_hit_plan_takes_a_token_order_entry_and_serves_it_at_another_grid_in_the_order_of_its_kind_there():
    masks = {(0, 0, 0, 0): torch.ones(2, QB, QB, dtype=torch.bool)}
    tile = signature(TileOrder(GRID, BS).name)
    assert Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": tile}).is_hit
    resampled = Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": tile},
                     resample_to=(3, 10, 14))
    assert resampled.entry_order == TileOrder(GRID, BS) and resampled.token_grid == (3, 10, 14)
    assert order_at(resampled.entry_order, (3, 10, 14)) == cached_tile_order((3, 10, 14), BS)
    assert order_at(resampled.entry_order, GRID) is resampled.entry_order and order_at(None, GRID) is None
    regions = cached_region_order(RGRID, (2, 4, 4), BS)
    assert order_at(regions, (5, 4, 8)) is cached_region_order((5, 4, 8), (2, 4, 4), BS)
    assert order_of_kind("regions2x4x4", (5, 4, 8), BS) is cached_region_order((5, 4, 8), (2, 4, 4), BS)
    assert order_of_kind("tile1x4x8-f4x8", (5, 4, 8), BS) == TileOrder((5, 4, 8), BS, serpentine=False)
    for bad in ("zigzag", "regions2x8x8"):
        with pytest.raises(ValueError):
            order_of_kind(bad, (5, 4, 8), BS)
    with pytest.raises(ValueError, match="out of range"):
        order_at(regions, (10**6, 10**4, 10**4))
    assert grid_carry(RGRID, (10**6, 10**3, 2 * 10**3), "regions2x4x4")[0] == "incompatible"
    with pytest.raises(ValueError, match="unreadable token order"):
        Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": signature("zigzag")})
    assert Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": signature(None)}).is_hit


def test_new_entries_record_raster_or_the_recorders_order():
    plan = Plan.miss("test", latent_shape=LATENT)
    plan.serve_run(ModelInfo("wan", "wan2.2-a14b-i2v", 2, 2, 64, 36, "fp"))
    mass = torch.full((1, 2, QB, QB), 1.0 / QB)
    plan.recorder.add(0, 1.0, 0, mass, grid=GRID, top_p=0.9, k_min=1, block_size=BS)
    assert build_signature(plan)["token_order"] == "thw"
    plan = Plan.miss("test", latent_shape=LATENT)
    plan.serve_run(ModelInfo("wan", "wan2.2-a14b-i2v", 2, 2, 64, 36, "fp"))
    plan.recorder.add(0, 1.0, 0, mass, grid=GRID, top_p=0.9, k_min=1, block_size=BS, token_order="regions2x4x4")
    assert build_signature(plan)["token_order"] == "regions2x4x4"
    with pytest.raises(ValueError, match="token order changed"):
        plan.recorder.add(0, 1.0, 1, mass, grid=GRID, top_p=0.9, k_min=1, block_size=BS)


# -- the runtime: a region-order request records and runs in that order ---------------------------
RGRID = (5, 8, 8)  # regions 2x4x4 = one 32-token block; frame 0 = 2 blocks; slab 1 = 4 tiles
INFO = ModelInfo("wan", "wan2.2-a14b-i2v", 2, 2, 64, 36, "fp")


def _qkv(seed=0, length=5 * 8 * 8):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, length, 32, generator=gen) for _ in range(3))


def _dense(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_a_miss_with_record_region_records_block_mass_in_the_region_order():
    from chorus import kernels
    from chorus.engine import ChorusAttention, SparseConfig

    order = cached_region_order(RGRID, (2, 4, 4), BS)
    cfg = SparseConfig(block_size=BS, sample_rows=None, backend="reference", verify_threshold=0.0)
    q, k, v = _qkv()
    plan = Plan.miss("test", latent_shape=(16, 5, 16, 16), keep_mass=True)
    handle = ChorusAttention(plan, cfg, INFO, record_region=(2, 4, 4))
    out = handle.self_attention(q, k, v, layer=0, sigma=1.0, grid=RGRID, dense_fn=_dense)
    assert torch.equal(out, _dense(q, k, v))  # a miss returns the host's dense result
    mass = plan.recorder.masses()[(0, 0, 0, 0)]
    want = kernels.block_mass(q, k, block_size=BS, sample_rows=None, token_perm=order)[0]
    torch.testing.assert_close(mass, want)
    raster = kernels.block_mass(q, k, block_size=BS, sample_rows=None)[0]
    assert not torch.allclose(mass, raster)  # really another order
    assert build_signature(plan)["token_order"] == order.name == "regions2x4x4"


@pytest.mark.parametrize("frames", [4, 5, 6])
def test_the_region_order_of_a_first_last_frame_entry_ends_with_the_last_frame_at_every_frame_count(frames):
    """``last_frame_rim``: regions holding the last frame are rim, so the last frame ends the order (its keys the
    kernels' suffix, its blocks the trailing keep-set) at an even frame count too, e.g. an anchored context window
    of 22 latent frames, where the plain kind tiles it with the frame before; at an odd count the two kinds are one
    permutation. A miss of a first-last-frame request records in it; a start-image request in the plain kind."""
    from chorus.engine import ChorusAttention, SparseConfig

    grid, region = (frames, 8, 12), (2, 4, 4)
    plain, last = (cached_region_order(grid, region, BS, last_frame_rim=rim) for rim in (False, True))
    assert last.last_frame_is_suffix and plain.last_frame_is_suffix == (frames % 2 == 1)
    assert torch.equal(plain.perm, last.perm) == (frames % 2 == 1)
    starts = pooling.region_frames(grid, region)
    assert bool((starts[last.tile_regions] + region[0] < frames).all())  # no tile holds the last frame
    for i, r in enumerate(last.tile_regions.tolist()):  # each tile still one whole block
        block = last.perm[(last.first_tile_block + i) * BS:(last.first_tile_block + i + 1) * BS]
        assert torch.equal(block.sort().values, pooling.region_cells(grid, region, (1, 1, 1))[r, :, 0].sort().values)
    assert last.name == "regions2x4x4-last" and plain.name == "regions2x4x4"

    cfg = SparseConfig(block_size=BS, sample_rows=None, backend="reference", verify_threshold=0.0)
    for images, order in (((1, 1, 0), last), ((1, 0, 0), plain)):
        plan = Plan.miss("test", latent_shape=(16, frames, 16, 24), keep_mass=True)
        handle = ChorusAttention(plan, cfg, INFO, record_region=region)
        handle.serve_grid(grid, lambda images=images: images)
        assert handle.token_order(grid) is order
        nb = -(-order.length // BS)
        q, k = (torch.randn(1, INFO.num_heads, order.length, 16, generator=torch.Generator().manual_seed(s))
                for s in (1, 2))
        handle.self_attention(q, k, k, layer=0, sigma=1.0, grid=grid, dense_fn=_dense)
        mass = plan.recorder.masses()[(0, 0, 0, 0)]
        torch.testing.assert_close(mass, kernels.block_mass(q, k, block_size=BS, sample_rows=None,
                                                            token_perm=order)[0])
        assert mass.shape[-1] == nb and build_signature(plan)["token_order"] == order.name


def test_a_hit_runs_in_its_entrys_order_exactly():
    from chorus import kernels
    from chorus.engine import ChorusAttention, SparseConfig

    order = cached_region_order(RGRID, (2, 4, 4), BS)
    nb = order.length // BS
    gen = torch.Generator().manual_seed(3)
    stored = torch.rand(2, nb, nb, generator=gen) < 0.4
    stored |= torch.eye(nb, dtype=torch.bool)
    sig = signature(order.name, grid=RGRID, latent=(16, 5, 16, 16))
    sig["step_sigmas"] = [1.0]
    plan = Plan("hit", entry_id=1, similarity=1.0, masks={(0, 0, 0, 0): stored},
                entry_meta={"signature": sig}, latent_shape=(16, 5, 16, 16))
    cfg = SparseConfig(block_size=BS, k_min=1, backend="reference", verify_threshold=0.0)
    handle = ChorusAttention(plan, cfg, INFO)
    q, k, v = _qkv(seed=1)
    out = handle.self_attention(q, k, v, layer=0, sigma=1.0, grid=RGRID, dense_fn=_dense)
    assert plan.stats.sparse_calls == 1 and plan.stats.fallback_calls == 0, plan.stats.messages
    qt, kt, vt = (order.to_tile(t) for t in (q, k, v))
    # the pooled tail (on by default) pools the blocks of the entry's order too
    want = order.to_raster(kernels.block_sparse_attention(qt, kt, vt, stored[None], block_size=BS,
                                                          backend="reference", pooled_tail=True))
    torch.testing.assert_close(out, want)
    raster = kernels.block_sparse_attention(q, k, v, stored[None], block_size=BS, backend="reference",
                                            pooled_tail=True)
    assert not torch.allclose(out, raster, atol=1e-4)


@pytest.mark.parametrize("keep_last_frame", [False, True])
def test_a_call_carried_to_the_recorders_grid_keeps_the_end_image_only_where_it_is_the_suffix_there(keep_last_frame):
    """A first-last-frame request in context windows with feature reuse: the caller checked the end image's frame
    at the call's grid (5 frames: the region order's suffix), but the recording is at 4 frames, where that
    order does not end with the last frame: the carried map keeps no trailing blocks for it."""
    from chorus.engine.recorder import MassRecorder

    window, anchored, bs = (4, 8, 8), (5, 8, 8), 32
    assert cached_region_order(anchored, (2, 4, 4), bs).last_frame_is_suffix
    assert not cached_region_order(window, (2, 4, 4), bs).last_frame_is_suffix
    recorder = MassRecorder()
    diagonal = lambda nb: torch.eye(nb)[None, None].expand(1, 2, nb, nb)  # noqa: E731
    recorder.add(0, 1.0, 0, diagonal(8), grid=window, top_p=0.5, k_min=1, block_size=bs, token_order="regions2x4x4")
    recorder.add(0, 1.0, 1, diagonal(10), grid=anchored, top_p=0.5, k_min=1, block_size=bs,
                 token_order="regions2x4x4", keep_last_frame=keep_last_frame)
    carried = recorder.block_maps()[(0, 0, 1, 0)]
    plain = kernels.select_blocks(kernels.resample_block_map(diagonal(10), anchored, window, block_size=bs,
                                                             src_order=cached_region_order(anchored, (2, 4, 4), bs),
                                                             dst_order=cached_region_order(window, (2, 4, 4), bs)),
                                  top_p=0.5, k_min=1, keep_diagonal=True)[0]
    assert torch.equal(carried.reshape(plain.shape), plain)
