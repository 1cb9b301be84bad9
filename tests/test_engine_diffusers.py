"""The engine in a diffusers ``WanTransformer3DModel`` (tiny, random weights, CPU): the library path."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from chorus.engine import ChorusAttention, Plan, SparseConfig, build_signature, wan_model_info  # noqa: E402
from chorus.hosts.diffusers import patch_diffusers_wan  # noqa: E402
from testing import tiny_diffusers_wan  # noqa: E402

BS = 32
SHAPE = (1, 36, 3, 10, 14)   # -> token grid (3, 5, 7) = 105 tokens, 4 blocks of 32
GRID = (3, 5, 7)
CFG = SparseConfig(top_p=0.9, k_min=1, block_size=BS, sample_rows=None)


def tiny_transformer(dtype=torch.float32):
    return tiny_diffusers_wan(num_layers=2, dtype=dtype)


def inputs(sigma, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*SHAPE, generator=g)
    x[:, 16:20] = 0.0
    x[:, 16:20, 0] = 1.0  # the mask channels as diffusers' I2V pipeline lays them: a start image on frame 0
    x = x.to(dtype)
    context = torch.randn(1, 8, 64, generator=g).to(dtype)
    return dict(hidden_states=x, timestep=torch.tensor([sigma * 1000.0]), encoder_hidden_states=context,
                return_dict=False)


def test_model_info_of_a_diffusers_wan():
    info = wan_model_info(tiny_transformer())
    assert info.supported and info.variant == "wan2.2-a14b-i2v" and info.num_layers == 2 and info.num_heads == 2


def test_miss_records_cond_calls_and_keeps_the_dense_output():
    model = tiny_transformer()
    plan = Plan.miss("test", latent_shape=SHAPE)
    handle = ChorusAttention(plan, CFG, wan_model_info(model))
    with torch.no_grad():
        reference = [model(**inputs(s, seed=i))[0] for i, s in enumerate((0.9, 0.9, 0.5, 0.5))]
        patch = patch_diffusers_wan(model, handle)
        handle.begin_run()
        outs = [model(**inputs(s, seed=i))[0] for i, s in enumerate((0.9, 0.9, 0.5, 0.5))]  # cond, uncond per step
        handle.end_run()
        patch.remove()
    for out, ref in zip(outs, reference):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert plan.stats.recorded_calls == 2 * 2 and plan.stats.dense_calls == 4 * 2
    assert sorted(plan.recorder.block_maps()) == [(0, s, l, 0) for s in range(2) for l in range(2)]
    assert build_signature(plan)["token_grid"] == list(GRID)
    assert build_signature(plan)["image_frames"] == [1, 0, 0]  # read from the first forward's input
    assert all(type(b.attn1.processor).__name__ != "ChorusWanSelfAttnProcessor" for b in model.blocks)


def test_full_map_hit_matches_dense_within_the_fp64_oracle_tolerance():
    model = tiny_transformer()
    info = wan_model_info(model)
    recorded = Plan.miss("test", latent_shape=SHAPE)
    rec_handle = ChorusAttention(recorded, CFG, info)
    patch = patch_diffusers_wan(model, rec_handle)
    with torch.no_grad():
        model(**inputs(0.5))
    patch.remove()
    sig = build_signature(recorded)
    masks = {k: torch.ones_like(v) for k, v in recorded.recorder.block_maps().items()}
    hit = Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta={"signature": sig})
    handle = ChorusAttention(hit, CFG, info)
    with torch.no_grad():
        dense32 = model(**inputs(0.5))[0].double()
        patch = patch_diffusers_wan(model, handle)
        sparse32 = model(**inputs(0.5))[0].double()
        patch.remove()
        oracle = tiny_transformer(torch.float64)(**inputs(0.5, dtype=torch.float64))[0]
    assert hit.stats.sparse_calls == 2 and hit.stats.fallback_calls == 0, hit.stats.messages
    err_dense = (dense32 - oracle).abs().max().item()
    err_sparse = (sparse32 - oracle).abs().max().item()
    assert 0 < err_dense and err_sparse <= 2 * err_dense, (err_sparse, err_dense)


def test_not_a_wan_transformer_is_refused():
    with pytest.raises(ValueError):
        patch_diffusers_wan(torch.nn.Linear(2, 2), None)
