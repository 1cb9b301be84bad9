"""The engine's hit and miss paths on a CUDA GPU with the Triton backends (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from chorus.engine import ChorusAttention, ModelInfo, Plan, SparseConfig
from chorus.kernels.reference import dense_attention_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GRID = (5, 30, 52)          # 7 800 tokens (not a multiple of 128): 61 blocks
L = GRID[0] * GRID[1] * GRID[2]
QB = -(-L // 128)
INFO = ModelInfo("wan", "wan2.2-a14b-i2v", 1, 4, 128, 36, "fp")


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _qkv(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(2, 4, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def _hit(block_map, token_order=None):
    sig = {"format": 1, "family": "wan", "variant": INFO.variant, "experts": ["fp"], "num_layers": 1, "num_heads": 4,
           "latent_shape": [16, 5, 60, 104], "token_grid": list(GRID), "block_size": 128,
           "token_order": token_order or "thw", "step_sigmas": [0.9], "head_groups": 1}
    return Plan("hit", entry_id=1, similarity=1.0, masks={(0, 0, 0, 0): block_map}, entry_meta={"signature": sig})


@pytest.mark.parametrize("backend", ["auto", "triton_bf16", "triton_fp8", "reference"])
def test_hit_on_gpu_matches_the_masked_oracle(backend):
    gen = torch.Generator().manual_seed(0)
    block_map = torch.rand(4, QB, QB, generator=gen) < 0.3
    block_map |= torch.eye(QB, dtype=torch.bool)
    plan = _hit(block_map)
    handle = ChorusAttention(plan, SparseConfig(k_min=4, backend=backend, pooled_tail=False), INFO)
    handle.begin_run([0.9, 0.0])
    q, k, v = _qkv(1)
    out = handle.self_attention(q, k, v, layer=0, sigma=torch.tensor([0.9], device="cuda"), grid=GRID, dense_fn=sdpa)
    assert plan.stats.sparse_calls == 1 and plan.stats.fallback_calls == 0, plan.stats.messages
    used = handle.used_map(0, 0)
    assert used.device.type == "cuda" and (used.sum(-1) >= 4).all()
    oracle = dense_attention_oracle(q, k, v, block_map=used, block_size=128)
    err = (out.double() - oracle).abs().max().item()
    eager = dense_attention_oracle(q.double(), k.double(), v.double(), block_map=used, block_size=128)
    bf16_eager = (eager.to(torch.bfloat16).double() - oracle).abs().max().item()  # rounding of the output alone
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), oracle.flatten(), dim=0).item()
    if backend == "triton_fp8" or (backend == "auto" and torch.cuda.get_device_capability() == (9, 0)):
        # the FP8 bound of the kernel tests: cosine deficit <= 2x a SageAttention-style FP8 emulation's,
        # and cosine >= 0.998 (0.999 is out of reach for e4m3 P and V on flat-softmax random inputs)
        from chorus.kernels.triton.emulation import error_stats, sage_fp8_attention_emulation

        sage = error_stats(sage_fp8_attention_emulation(q, k, v, used, 128), oracle)
        assert 1 - cos <= 2 * (1 - sage["cosine"]) and cos >= 0.998, (cos, sage)
    else:
        assert err <= 4 * max(bf16_eager, 1e-3), (err, bf16_eager)


def test_miss_on_gpu_records_cond_rows_and_returns_dense():
    plan = Plan.miss("gpu", latent_shape=(16, 5, 60, 104))
    handle = ChorusAttention(plan, SparseConfig(), INFO)
    handle.begin_run([0.9, 0.0])
    q, k, v = _qkv(2)
    out = handle.self_attention(q, k, v, layer=0, sigma=0.9, grid=GRID, dense_fn=sdpa,
                                cond_rows=torch.tensor([True, False]))
    torch.testing.assert_close(out, sdpa(q, k, v), rtol=0, atol=0)
    maps = plan.recorder.block_maps()
    assert list(maps) == [(0, 0, 0, 0)] and maps[(0, 0, 0, 0)].shape == (4, QB, QB)
    assert plan.stats.recorded_calls == 1 and not plan.stats.messages


@pytest.mark.parametrize("backend", ["triton_fp8", "triton_bf16"])
def test_first_frame_bias_on_gpu(backend):
    """Guidance's first-frame bias through the engine on the GPU: the sparse kernel against the biased
    oracle (the first frame, 1 560 tokens, ends inside block 12), and a dense call through the biased
    SDPA path; both move the output away from the unbiased one."""
    import math

    if backend == "triton_fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")
    bias = math.log(1.3)
    block_map = torch.rand(4, QB, QB, generator=torch.Generator().manual_seed(3)) < 0.3
    block_map |= torch.eye(QB, dtype=torch.bool)
    block_map[:, :, :13] = True  # the recorder's first-frame keep-set
    plan = _hit(block_map)
    handle = ChorusAttention(plan, SparseConfig(k_min=4, backend=backend, pooled_tail=False), INFO)
    handle.begin_run([0.9, 0.0])
    q, k, v = _qkv(4)
    out = handle.self_attention(q, k, v, layer=0, sigma=0.9, grid=GRID, dense_fn=sdpa, first_frame_bias=bias)
    assert plan.stats.sparse_calls == 1 and plan.stats.fallback_calls == 0, plan.stats.messages
    used = handle.used_map(0, 0)
    oracle = dense_attention_oracle(q, k, v, block_map=used, block_size=128, prefix_len=1560, prefix_bias=bias)
    plain = dense_attention_oracle(q, k, v, block_map=used, block_size=128)
    err = (out.double() - oracle).abs().max().item()
    moved = (oracle - plain).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), oracle.flatten(), dim=0).item()
    assert cos >= 0.998 and moved > 1e-3, (cos, moved)
    if backend == "triton_bf16":
        assert err < 0.1 * moved, (err, moved)

    miss = Plan.miss("gpu", latent_shape=(16, 5, 60, 104))
    dense_handle = ChorusAttention(miss, SparseConfig(), INFO)
    dense_handle.begin_run([0.9, 0.0])
    out = dense_handle.self_attention(q, k, v, layer=0, sigma=0.9, grid=GRID, dense_fn=sdpa, first_frame_bias=bias)
    want = dense_attention_oracle(q, k, v, prefix_len=1560, prefix_bias=bias)
    assert (out.double() - want).abs().max().item() < 0.1 * (want - dense_attention_oracle(q, k, v)).abs().max().item()


@pytest.mark.parametrize("region", [None, (2, 8, 8)])
def test_windows_of_two_lengths_on_gpu_are_recorded_and_served(region):
    """Context windows of two lengths in one run (later ComfyUI's causal anchor frame): the miss carries the
    longer window's block mass to the first window's grid on the GPU, and the hit runs the longer window's call
    sparse on its maps resampled to that grid (on the GPU, as on the CPU), against the masked oracle of the map it
    used. ``region``: the miss records in feature reuse's region order, and the longer call runs in the region
    order of its own grid."""
    from chorus.engine.compat import order_at
    from chorus.engine.maps import stored_map

    longer = (GRID[0] + 1, GRID[1], GRID[2])
    tokens = longer[0] * longer[1] * longer[2]
    g = torch.Generator(device="cuda").manual_seed(5)
    q2, k2, v2 = (torch.randn(1, 4, tokens, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q1, k1, v1 = (t[:, :, :L].contiguous() for t in (q2, k2, v2))
    miss = Plan.miss("gpu", latent_shape=(16, 7, 60, 104))
    recording = ChorusAttention(miss, SparseConfig(), INFO, record_region=region)
    recording.begin_run([0.9, 0.0])
    for q, k, v, grid in ((q1, k1, v1, GRID), (q2, k2, v2, longer)):
        recording.self_attention(q, k, v, layer=0, sigma=0.9, grid=grid, dense_fn=sdpa)
    assert miss.stats.recorded_calls == 2 and miss.recorder.grid == GRID and not miss.stats.messages
    entry_map = miss.recorder.block_maps()[(0, 0, 0, 0)]

    plan = _hit(entry_map, None if region is None else recording.token_order(GRID).name)
    handle = ChorusAttention(plan, SparseConfig(k_min=4, backend="triton_bf16", pooled_tail=False), INFO)
    handle.begin_run([0.9, 0.0])
    handle.self_attention(q1, k1, v1, layer=0, sigma=0.9, grid=GRID, dense_fn=sdpa)
    out = handle.self_attention(q2, k2, v2, layer=0, sigma=0.9, grid=longer, dense_fn=sdpa)
    assert plan.stats.sparse_calls == 2 and plan.stats.fallback_calls == 0, plan.stats.messages
    on_gpu = stored_map(plan, 0, 0, 0, block_size=128, top_p=0.9, k_min=4, device="cuda", grid=longer)
    assert torch.equal(on_gpu.cpu(), stored_map(plan, 0, 0, 0, block_size=128, top_p=0.9, k_min=4, grid=longer))
    used, _ = handle.run.maps.map_for(0, 0, q2, None, longer)  # the call's map (built once, cached)
    assert used.shape[-1] == -(-tokens // 128) and used.device.type == "cuda"
    order = order_at(plan.entry_order, longer)
    assert (order is None) == (region is None) and handle.token_order(longer) is order
    q, k, v = (t if order is None else order.to_tile(t, dim=2) for t in (q2, k2, v2))
    oracle = dense_attention_oracle(q, k, v, block_map=used, block_size=128)
    eager = dense_attention_oracle(q.double(), k.double(), v.double(), block_map=used, block_size=128)
    if order is not None:
        oracle, eager = (order.to_raster(t, dim=2) for t in (oracle, eager))
    bf16_eager = (eager.to(torch.bfloat16).double() - oracle).abs().max().item()
    assert (out.double() - oracle).abs().max().item() <= 4 * max(bf16_eager, 1e-3)


def test_without_triton_a_hit_on_gpu_runs_dense_and_a_miss_records_nothing(monkeypatch):
    """This GPU as one without Triton (Windows' portable ComfyUI without triton-windows: ``import triton`` fails):
    auto finds no Triton kernel and no flex (it runs compiled, which needs Triton), only the reference, so a hit's
    call runs the host's dense attention with one note, and a miss records nothing (its block mass would be the
    reference's, for hits that run dense), with one note."""
    import sys

    from chorus.kernels import api

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises; find_spec("triton") is None
    monkeypatch.setattr(api, "_auto_choice", {})
    gen = torch.Generator().manual_seed(0)
    block_map = (torch.rand(4, QB, QB, generator=gen) < 0.3) | torch.eye(QB, dtype=torch.bool)
    plan = _hit(block_map)
    handle = ChorusAttention(plan, SparseConfig(k_min=4), INFO)
    handle.begin_run([0.9, 0.0])
    q, k, v = _qkv(1)
    out = handle.self_attention(q, k, v, layer=0, sigma=torch.tensor([0.9], device="cuda"), grid=GRID, dense_fn=sdpa)
    torch.testing.assert_close(out, sdpa(q, k, v), rtol=0, atol=0)
    assert plan.stats.sparse_calls == 0 and plan.stats.dense_calls == 1 and plan.stats.kernels == ["dense"]
    assert any("triton" in m and "runs dense" in m for m in plan.stats.messages), plan.stats.messages

    miss = Plan.miss("test", latent_shape=(16, 5, 60, 104), keep_mass=True)
    handle = ChorusAttention(miss, SparseConfig(k_min=4), INFO)
    handle.begin_run([0.9, 0.0])
    out = handle.self_attention(q, k, v, layer=0, sigma=torch.tensor([0.9], device="cuda"), grid=GRID, dense_fn=sdpa)
    handle.end_run()
    torch.testing.assert_close(out, sdpa(q, k, v), rtol=0, atol=0)
    assert miss.stats.recorded_calls == 0 and not miss.recorder.masses(), miss.stats.messages
    assert any("this miss records nothing" in m for m in miss.stats.messages), miss.stats.messages
