"""Token order in signatures, retrieval and the plan (issue 17, part 2): an entry records its order
(raster ``"thw"``: tile order measured no fewer blocks at equal recall, so this version records and
runs raster only); entries without the field are raster; a tile-order entry, or an order that
cannot be rebuilt, is a miss, never misread."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chorus.cache_store import Workspace
from chorus.engine import ModelInfo, Plan, build_signature, latent_compatibility, retrieve_plan
from chorus.engine.signature import TOKEN_ORDER, entry_token_order, token_order_name
from chorus.kernels.tile_order import TileOrder, cached_tile_order

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


def test_entry_token_order_reads_raster_and_tile_and_refuses_the_rest():
    assert TOKEN_ORDER == "thw"
    assert entry_token_order(signature("thw")) is None
    assert entry_token_order(signature("raster")) is None
    assert entry_token_order(signature(None)) is None  # entries without the field are raster
    tile = TileOrder(GRID, BS)
    assert entry_token_order(signature(tile.name)) == tile
    plain = TileOrder(GRID, BS, serpentine=False)
    assert entry_token_order(signature(plain.name)) == plain
    for bad in ("hwt", "tile9x9x9", 3, ["thw"], {"a": 1}):
        with pytest.raises(ValueError):
            entry_token_order(signature(bad))
    with pytest.raises(ValueError, match="out of range"):  # a hostile grid is not allocated
        entry_token_order(signature(tile.name, grid=(10**6, 10**4, 10**4)))
    assert token_order_name(None) == "thw" and token_order_name(tile) == tile.name
    assert cached_tile_order(GRID, BS) is cached_tile_order(GRID, BS)


def test_latent_compatibility_by_order():
    tile = TileOrder(GRID, BS).name
    assert latent_compatibility(signature(None), LATENT)[0] == "same"
    assert latent_compatibility(signature("raster"), LATENT)[0] == "same"
    assert latent_compatibility(signature("thw"), (16, 3, 20, 28))[0] == "resample"
    verdict, why = latent_compatibility(signature(tile), LATENT)
    assert verdict == "incompatible" and "raster order only" in why
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
                                            ("tile", False), ("tile1x2x3", False)])
def test_retrieval_serves_raster_entries_and_misses_the_others(tmp_path, order_name, hit):
    if order_name == "tile":
        order_name = TileOrder(GRID, BS).name
    ws, emb = _ws_with(tmp_path / "ws", order_name)
    plan = retrieve_plan(ws, emb, LATENT, similarity_threshold=0.9)
    assert plan.is_hit == hit, plan.message
    if not hit:
        assert "token order" in plan.message


def test_a_hit_plan_refuses_a_tile_order_entry():
    masks = {(0, 0, 0, 0): torch.ones(2, QB, QB, dtype=torch.bool)}
    with pytest.raises(ValueError, match="raster-order entry"):
        Plan("hit", entry_id=1, similarity=1.0, masks=masks,
             entry_meta={"signature": signature(TileOrder(GRID, BS).name)})
    with pytest.raises(ValueError, match="unreadable token order"):
        Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": signature("zigzag")})
    assert Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": signature(None)}).is_hit


def test_new_entries_record_raster():
    plan = Plan.miss("test", latent_shape=LATENT)
    plan.register_expert(ModelInfo("wan", "wan2.2-a14b-i2v", 2, 2, 64, 36, "fp"))
    plan.recorder.add(0, 1.0, 0, torch.full((1, 2, QB, QB), 1.0 / QB), grid=GRID, top_p=0.9, k_min=1, block_size=BS)
    assert build_signature(plan)["token_order"] == "thw"
