"""ChorusAttention on plain tensors (no host): recorder, hit path, safety fallback, stats, bad input,
and the retrieval/commit round trip through a real cache_store Workspace."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from chorus import kernels
from chorus.cache_store import Workspace
from chorus.engine import (ChorusAttention, Plan, SparseConfig, commit_plan, floor_k_min,
                           latent_compatibility, mask_heatmap, retrieve_plan, token_grid)
from chorus.engine.maps import stored_map, unpacked_map
from chorus.kernels.reference import dense_attention_oracle
from chorus.kernels.tile_order import cached_region_order

from engine_helpers import BS, CFG, GRID, INFO, INFO_LOW, L, LATENT, QB, SIGMAS, hit_plan, qkv, run_steps, sdpa, \
    signature


def test_miss_records_every_key_and_returns_dense_unchanged():
    plan = Plan.miss("test", latent_shape=LATENT, keep_mass=True)
    outs = run_steps(ChorusAttention(plan, CFG, INFO))
    for q, k, v, out in outs:
        torch.testing.assert_close(out, sdpa(q, k, v), rtol=0, atol=0)
    maps = plan.recorder.block_maps()
    assert sorted(maps) == [(0, s, l, 0) for s in range(3) for l in range(2)]
    for key, m in maps.items():
        assert m.shape == (2, QB, QB) and m.dtype == torch.bool
        assert m.diagonal(dim1=-2, dim2=-1).all() and m[..., 0].all()  # diagonal + first-frame block kept
    masses = plan.recorder.masses()
    row_sums = torch.stack([m.sum(-1) for m in masses.values()])
    torch.testing.assert_close(row_sums, torch.ones_like(row_sums), rtol=0, atol=1e-5)
    assert plan.stats.recorded_calls == 6 and plan.stats.dense_calls == 6 and plan.stats.sparse_calls == 0


def test_recorder_uses_only_cond_rows():
    plan = Plan.miss("test", latent_shape=LATENT, keep_mass=True)
    handle = ChorusAttention(plan, CFG, INFO)
    handle.begin_run(SIGMAS)
    q, k, v = qkv(1, batch=2)
    handle.self_attention(q, k, v, layer=0, sigma=1.0, grid=GRID, dense_fn=sdpa, cond_rows=torch.tensor([True, False]))
    handle.self_attention(q[1:], k[1:], v[1:], layer=1, sigma=1.0, grid=GRID, dense_fn=sdpa,
                          cond_rows=torch.tensor([False]))  # an uncond-only chunk records nothing
    from chorus.kernels import block_mass

    mass = plan.recorder.masses()[(0, 0, 0, 0)]
    torch.testing.assert_close(mass, block_mass(q[:1], k[:1], block_size=BS)[0], rtol=1e-5, atol=1e-6)
    assert (0, 0, 1, 0) not in plan.recorder.masses()


def test_positive_rows_are_views_when_they_follow_each_other():
    """A recorded call's positive rows: a run of rows is a view of q and k (no copy per call), rows
    apart are gathered; both hold exactly the positive rows."""
    from chorus.engine.call import AttnCall

    q, k, v = qkv(3, batch=4)
    run = AttnCall(q, k, v, layer=0, sigma=1.0, grid=GRID, cond_rows=torch.tensor([False, True, True, False]))
    qs, ks = run.positive_rows()
    assert qs.data_ptr() == q[1].data_ptr() and ks.data_ptr() == k[1].data_ptr()
    assert torch.equal(qs, q[1:3]) and torch.equal(ks, k[1:3])
    apart = dataclasses.replace(run, cond_rows=torch.tensor([True, False, True, False]))
    qs, ks = apart.positive_rows()
    assert torch.equal(qs, q[[0, 2]]) and torch.equal(ks, k[[0, 2]])
    none = dataclasses.replace(run, cond_rows=torch.tensor([False] * 4))
    assert none.positive_rows() == (None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])  # fp16: what ComfyUI computes Wan in
def test_full_map_hit_matches_the_fp64_oracle_like_dense(dtype):
    masks = {(0, s, l, 0): torch.ones(2, QB, QB, dtype=torch.bool) for s in range(3) for l in range(2)}
    plan = hit_plan(masks)
    handle = ChorusAttention(plan, CFG, INFO)
    handle.begin_run(SIGMAS)
    q, k, v = qkv(3, dtype=dtype)
    out = handle.self_attention(q, k, v, layer=1, sigma=0.5, grid=GRID, dense_fn=sdpa)
    oracle = dense_attention_oracle(q, k, v)
    err = (out.double() - oracle).abs().max().item()
    err_eager = (sdpa(q, k, v).double() - oracle).abs().max().item()
    assert err <= 2 * err_eager + 1e-7
    assert plan.stats.sparse_calls == 1 and plan.stats.density == 1.0


def test_sparse_hit_equals_masked_oracle_and_counts_blocks():
    band = torch.eye(QB, dtype=torch.bool) | torch.eye(QB, dtype=torch.bool).roll(1, 1)
    masks = {(0, 2, 0, 0): band.expand(2, QB, QB).clone()}
    plan = hit_plan(masks)
    handle = ChorusAttention(plan, SparseConfig(top_p=0.9, k_min=1, block_size=BS, pooled_tail=False), INFO)
    handle.begin_run(SIGMAS)
    q, k, v = qkv(4)
    out = handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=GRID, dense_fn=sdpa)
    oracle = dense_attention_oracle(q, k, v, block_map=band[None, None], block_size=BS)
    err_dense_eager = (sdpa(q, k, v).double() - dense_attention_oracle(q, k, v)).abs().max().item()
    assert (out.double() - oracle).abs().max().item() <= 2 * err_dense_eager + 1e-6
    assert (out - sdpa(q, k, v)).abs().max() > 1e-3  # it really is sparse
    assert plan.stats.blocks_computed == 2 * int(band.sum()) and plan.stats.blocks_total == 2 * QB * QB


def test_a_hit_with_the_pooled_tail_equals_the_oracle_with_the_tail():
    """The pooled tail, on by default, reaches the kernel: the hit equals the fp64 oracle with the pooled
    tail (every skipped block one softmax term per row), not the map-only oracle, and is counted."""
    band = torch.eye(QB, dtype=torch.bool) | torch.eye(QB, dtype=torch.bool).roll(1, 1)
    plan = hit_plan({(0, 2, 0, 0): band.expand(2, QB, QB).clone()})
    assert SparseConfig().pooled_tail
    handle = ChorusAttention(plan, SparseConfig(top_p=0.9, k_min=1, block_size=BS), INFO)
    handle.begin_run(SIGMAS)
    q, k, v = qkv(4)
    out = handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=GRID, dense_fn=sdpa).double()
    tail = dense_attention_oracle(q, k, v, block_map=band[None, None], block_size=BS, pooled_tail=True)
    plain = dense_attention_oracle(q, k, v, block_map=band[None, None], block_size=BS)
    err_dense_eager = (sdpa(q, k, v).double() - dense_attention_oracle(q, k, v)).abs().max().item()
    assert (out - tail).abs().max().item() <= 2 * err_dense_eager + 1e-6
    assert (out - plain).abs().max().item() > 1e-3  # the tail acted
    assert plan.stats.tail_calls == 1 and plan.stats.sparse_calls == 1 and "pooled tail on 1" in plan.stats.summary()


def test_auto_asks_for_the_accurate_path_from_top_p_095_and_runs_auto_where_it_cannot_run(monkeypatch):
    """auto's stated rule (engine/config.py): top_p >= 0.95 asks for the INT8 numerics (warp-specialised, then
    portable), below it the fast choice; an explicit backend is never changed. On this CPU neither INT8 kernel can
    run (and the block size is not 128): the hit runs auto (the reference) and still equals the oracle with the
    tail, without a fallback."""
    from chorus.engine.config import ACCURATE_TOP_P

    assert SparseConfig(top_p=ACCURATE_TOP_P).attention_backends == ("triton_int8_ws", "triton_int8", "auto")
    assert SparseConfig(top_p=0.9).attention_backends == ("auto",)
    assert SparseConfig(top_p=0.99, backend="triton_fp8").attention_backends == ("triton_fp8",)
    asked = []
    real = kernels.block_sparse_attention
    monkeypatch.setattr(kernels, "block_sparse_attention", lambda *a, **kw: asked.append(kw["backend"]) or real(*a, **kw))
    band = torch.eye(QB, dtype=torch.bool) | torch.eye(QB, dtype=torch.bool).roll(1, 1)
    plan = hit_plan({(0, 2, 0, 0): band.expand(2, QB, QB).clone()})
    handle = ChorusAttention(plan, SparseConfig(top_p=0.97, k_min=1, block_size=BS), INFO)
    handle.begin_run(SIGMAS)
    q, k, v = qkv(4)
    out = handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=GRID, dense_fn=sdpa).double()
    tail = dense_attention_oracle(q, k, v, block_map=band[None, None], block_size=BS, pooled_tail=True)
    err_dense_eager = (sdpa(q, k, v).double() - dense_attention_oracle(q, k, v)).abs().max().item()
    assert asked == ["auto"] and plan.stats.fallback_calls == 0
    assert (out - tail).abs().max().item() <= 2 * err_dense_eager + 1e-6
    # the run's UI text names the kernel once: what auto resolved to on this CPU, and that auto asked for it
    assert plan.stats.kernels == ["reference (auto)"] and "kernel reference (auto)" in plan.stats.summary()


def test_chorus_changes_nothing_where_only_the_reference_kernel_would_run_on_a_gpu(monkeypatch):
    """Where auto lands on the reference kernel on a device other than the CPU (a GPU without Triton, Apple's
    mps), a hit's calls run the host's dense attention instead, with one note and no sparse call, and a miss
    records nothing (its block mass would run the reference too, for hits that would run dense), with one note;
    an explicit ``backend="reference"`` still runs it. Shown on this CPU with the CPU taken out of the devices
    where the reference serves hits."""
    from chorus.engine import runtime

    monkeypatch.setattr(runtime, "REFERENCE_SERVES_HITS_ON", frozenset())
    asked = []
    real = kernels.block_sparse_attention
    monkeypatch.setattr(kernels, "block_sparse_attention", lambda *a, **kw: asked.append(kw["backend"]) or real(*a, **kw))
    diag = torch.eye(QB, dtype=torch.bool).expand(2, QB, QB).clone()
    masks = {(0, s, l, 0): diag for s in range(3) for l in range(2)}
    plan = hit_plan(masks)
    for q, k, v, out in run_steps(ChorusAttention(plan, CFG, INFO)):
        torch.testing.assert_close(out, sdpa(q, k, v), rtol=0, atol=0)
    assert asked == [] and plan.stats.sparse_calls == 0 and plan.stats.dense_calls == 6
    assert plan.stats.fallback_calls == 0 and plan.stats.kernels == ["dense"]
    notes = [m for m in plan.stats.messages if "no sparse attention kernel faster than dense" in m]
    assert len(notes) == 1 and "runs dense" in notes[0] and "need a CUDA GPU" in notes[0], plan.stats.messages

    explicit = hit_plan(masks)
    outs = run_steps(ChorusAttention(explicit, dataclasses.replace(CFG, backend="reference"), INFO))
    assert explicit.stats.sparse_calls == 6 and asked == ["reference"] * 6 and explicit.stats.kernels == ["reference"]
    q, k, v, out = outs[0]
    assert not torch.equal(out, sdpa(q, k, v))  # the diagonal map ran

    miss = Plan.miss("test", latent_shape=LATENT, keep_mass=True)
    for q, k, v, out in run_steps(ChorusAttention(miss, CFG, INFO)):
        torch.testing.assert_close(out, sdpa(q, k, v), rtol=0, atol=0)
    assert miss.stats.dense_calls == 6 and miss.stats.recorded_calls == 0 and miss.stats.kernels == []
    notes = [m for m in miss.stats.messages if "this miss records nothing" in m]
    assert len(notes) == 1 and "no sparse attention kernel faster than dense" in notes[0], miss.stats.messages
    with pytest.raises(ValueError, match="a hit would run dense here"):  # so no entry is written
        miss.recorder.block_maps()


def test_the_stats_name_each_kernel_once_and_one_that_cannot_run():
    from chorus.engine.state import PlanStats

    stats = PlanStats()
    stats.note_kernel("triton_int8_ws", "triton_int8_ws")
    stats.note_kernel("triton_int8_ws", "triton_int8_ws")  # the second expert's run
    stats.note_kernel("auto", "triton_fp8_ws")
    stats.note_kernel("triton_fp8", None)
    assert stats.kernels == ["triton_int8_ws", "triton_fp8_ws (auto)", "triton_fp8 (cannot run here)"]
    assert "kernel triton_int8_ws, triton_fp8_ws (auto), triton_fp8 (cannot run here)" in stats.summary()


def test_k_min_floor_adds_blocks_nearest_the_diagonal():
    m = torch.zeros(1, 6, 6, dtype=torch.bool)
    m[0, :, 0] = True
    m[0, 3, :] = True
    out = floor_k_min(m, 3)
    assert (out.sum(-1) >= 3).all() and (out | m).equal(out)
    assert out[0, 5, 4] and out[0, 5, 5] and not out[0, 5, 1]
    assert out[0, 3].all()  # a full row is unchanged
    assert floor_k_min(m, 100).all()


def test_visit_refresh_adds_unvisited_pairs_over_steps():
    diag = torch.eye(QB, dtype=torch.bool).expand(2, QB, QB).clone()
    masks = {(0, s, 0, 0): diag for s in range(3)}
    plan = hit_plan(masks)
    handle = ChorusAttention(plan, SparseConfig(k_min=1, refresh_steps=1, block_size=BS), INFO)
    handle.begin_run(SIGMAS)
    visited = torch.zeros(2, QB, QB, dtype=torch.bool)
    for step, s in enumerate(SIGMAS[:-1]):
        handle.self_attention(*qkv(step), layer=0, sigma=s, grid=GRID, dense_fn=sdpa)
        used = handle.used_map(step, 0)[0]
        visited |= used
        assert diag.le(used).all()
    assert visited.all()  # R = 1: every pair computed within two steps
    assert plan.stats.density > diag.float().mean().item()


def test_fallbacks_are_dense_and_noted_never_raised():
    masks = {(0, 0, 0, 0): torch.ones(2, QB, QB, dtype=torch.bool)}
    plan = hit_plan(masks, sig=signature(sigmas=[1.0]))
    handle = ChorusAttention(plan, CFG, INFO)
    handle.begin_run([1.0, 0.0])
    q, k, v = qkv(5)
    dense = sdpa(q, k, v)
    cases = [
        dict(layer=1, sigma=1.0, grid=GRID),               # no map for this key
        dict(layer=0, sigma=1.5, grid=GRID),               # above the schedule: not an entry step
        dict(layer=0, sigma=1.0, grid=(3, 5, 8)),          # grid does not hold the tokens
        dict(layer=9, sigma=1.0, grid=GRID),               # layer outside the model
    ]
    for kw in cases:
        torch.testing.assert_close(handle.self_attention(q, k, v, dense_fn=sdpa, **kw), dense)
    out = handle.self_attention(q[:, :1], k[:, :1], v[:, :1], layer=0, sigma=1.0, grid=GRID, dense_fn=sdpa)
    assert out.shape == (1, 1, L, 64)  # wrong head count: dense
    assert plan.stats.fallback_calls == 5 and plan.stats.sparse_calls == 0
    reasons = ["the entry has no mask for expert 0, step 0, layer 1", "sigma 1.5 is not a step of the entry's schedule",
               "token grid (3, 5, 8) does not hold the 105 tokens", "layer index 9 outside the model's 2 layers",
               "1 heads in the call, the model has 2"]
    assert len(plan.stats.messages) == 5 and all(
        m.startswith(f"sparse attention not used for a call ({why}") and m.endswith("; dense attention instead")
        for m, why in zip(plan.stats.messages, reasons)), plan.stats.messages
    # an explicit backend that cannot run here (no CUDA) is a message and dense attention, not a crash
    if not torch.cuda.is_available():
        plan2 = hit_plan(masks, sig=signature(sigmas=[1.0]))
        h2 = ChorusAttention(plan2, SparseConfig(k_min=1, block_size=BS, backend="triton_fp8"), INFO)
        torch.testing.assert_close(h2.self_attention(q, k, v, layer=0, sigma=1.0, grid=GRID, dense_fn=sdpa), dense)
        assert plan2.stats.fallback_calls == 1 and "BackendUnavailableError" in plan2.stats.messages[0]


def test_a_kernel_error_runs_that_call_dense_and_changes_no_later_choice(monkeypatch):
    """An error while the kernel runs (an out-of-memory here) gives dense attention for that call with a
    note; the next call runs the kernel again and ``auto`` resolves as before (no global demotion)."""
    from chorus.kernels import api

    band = torch.eye(QB, dtype=torch.bool) | torch.eye(QB, dtype=torch.bool).roll(1, 1)
    plan = hit_plan({(0, 2, 0, 0): band.expand(2, QB, QB).clone()})
    handle = ChorusAttention(plan, SparseConfig(top_p=0.9, k_min=1, block_size=BS), INFO)
    handle.begin_run(SIGMAS)
    q, k, v = qkv(4)
    chosen_before = api.resolve_backend("auto", q)
    run_attention = api._run_attention
    failures = iter([True])

    def out_of_memory_once(*args, **kwargs):
        if next(failures, False):
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return run_attention(*args, **kwargs)

    monkeypatch.setattr(api, "_run_attention", out_of_memory_once)
    first = handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=GRID, dense_fn=sdpa)
    torch.testing.assert_close(first, sdpa(q, k, v))
    assert plan.stats.fallback_calls == 1 and "OutOfMemoryError" in plan.stats.messages[0]
    second = handle.self_attention(q, k, v, layer=0, sigma=0.5, grid=GRID, dense_fn=sdpa)
    oracle = dense_attention_oracle(q, k, v, block_map=band[None, None], block_size=BS, pooled_tail=True)
    assert (second.double() - oracle).abs().max().item() < 1e-4
    assert plan.stats.sparse_calls == 1 and api.resolve_backend("auto", q) == chosen_before


def test_a_hit_made_without_a_similarity_is_named_and_committed_without_one(tmp_path):
    """A library caller may make a hit without a similarity (``Plan("hit", ...)``): its repr, a sampled run and
    the commit name the entry without one instead of raising."""
    masks = {(0, s, layer, 0): torch.ones(2, QB, QB, dtype=torch.bool) for s in range(len(SIGMAS) - 1)
             for layer in range(2)}
    plan = Plan("hit", entry_id=7, masks=masks, entry_meta={"signature": signature()}, latent_shape=LATENT)
    assert repr(plan) == "Plan(hit: entry 7)"
    run_steps(ChorusAttention(plan, CFG, INFO))
    msg = commit_plan(Workspace.open(tmp_path / "ws"), plan)
    assert msg.startswith("hit: ") and "entry 7" in msg and "similarity" not in msg, msg


def test_hit_for_another_model_or_schedule_demotes_to_a_recording_miss(monkeypatch):
    masks = {(0, s, l, 0): torch.ones(2, QB, QB, dtype=torch.bool) for s in range(3) for l in range(2)}
    plan = hit_plan(masks)
    run_steps(ChorusAttention(plan, CFG, INFO_LOW))
    assert plan.kind == "miss" and "another model" in plan.message and plan.recorder.complete
    plan = hit_plan(masks)
    run_steps(ChorusAttention(plan, CFG, INFO), sigmas=[1.0, 0.6, 0.0])
    assert plan.kind == "miss" and "schedule differs" in plan.message
    # demoted after sparse calls ran: no partial entry can be written
    plan = hit_plan(masks, sig=signature(experts=("fp-high",)))
    run_steps(ChorusAttention(plan, CFG, INFO), sigmas=[1.0, 0.75, 0.5])
    run_steps(ChorusAttention(plan, CFG, INFO_LOW), sigmas=[0.5, 0.0])
    assert plan.kind == "miss" and not plan.recorder.complete
    assert "not written" in commit_plan(object(), plan)
    # demoted after calls of the hit that fell back to dense (not recorded either): no partial entry
    plan = hit_plan(masks, sig=signature(experts=("fp-high",)))

    def kernel_failure(*args, **kwargs):
        raise RuntimeError("test: the kernel failed")

    with monkeypatch.context() as patch:
        patch.setattr(kernels, "block_sparse_attention", kernel_failure)
        run_steps(ChorusAttention(plan, CFG, INFO), sigmas=[1.0, 0.75, 0.5])
    assert plan.is_hit and plan.stats.sparse_calls == 0 and plan.stats.fallback_calls == 4
    run_steps(ChorusAttention(plan, CFG, INFO_LOW), sigmas=[0.5, 0.0])
    assert plan.kind == "miss" and not plan.recorder.complete and "4 calls of the hit" in plan.recorder.incomplete_reason
    assert "not written" in commit_plan(object(), plan)


def test_two_experts_share_one_plan_and_route_by_sigma():
    plan = Plan.miss("test", latent_shape=LATENT)
    run_steps(ChorusAttention(plan, CFG, INFO), sigmas=SIGMAS[:3])      # high: steps 0, 1
    run_steps(ChorusAttention(plan, CFG, INFO_LOW), sigmas=SIGMAS[2:])  # low: step 2
    assert sorted(plan.recorder.block_maps()) == [(0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 0), (0, 1, 1, 0),
                                                  (1, 2, 0, 0), (1, 2, 1, 0)]
    assert [e.fingerprint for e in plan.experts] == ["fp-high", "fp-low"]


def test_bad_arguments_raise_value_errors():
    for kw, why in ((dict(top_p=0.0), "top_p must be in"), (dict(top_p=1.5), "top_p must be in"),
                    (dict(top_p=float("nan")), "top_p must be in"), (dict(k_min=0), "k_min must be an int"),
                    (dict(refresh_steps=-1), "refresh_steps must be an int"), (dict(backend="cuda"), "backend must be one of"),
                    (dict(sample_rows=0), "sample_rows must be None or an int"),
                    (dict(block_size=100), "block_size must be a positive multiple of 16"),
                    (dict(backend="flex"), "'flex' has no pooled tail"),
                    (dict(backend="fa4_bf16", pooled_tail=True), "'fa4_bf16' has no pooled tail"),
                    (dict(pooled_tail=1), "pooled_tail must be a bool")):
        with pytest.raises(ValueError, match=why):
            SparseConfig(**kw)
    for backend in ("flex", "fa4_bf16"):  # the backends without a pooled tail run with it off
        assert not SparseConfig(backend=backend, pooled_tail=False).pooled_tail
    with pytest.raises(ValueError, match="plan kind must be"):
        Plan("maybe")
    with pytest.raises(ValueError, match="a hit needs masks"):
        Plan("hit", masks={}, entry_meta={"signature": {}})
    with pytest.raises(ValueError, match="plan must be a chorus Plan"):
        ChorusAttention("plan", CFG, INFO)
    with pytest.raises(ValueError, match="latent shape must be"):
        token_grid((16, 3, 10))


def test_workspace_round_trip_resample_and_corruption(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    emb = np.random.default_rng(0).standard_normal(24).astype(np.float32)
    plan = retrieve_plan(ws, emb, LATENT, request_meta={"prompt": "a cat"})
    assert not plan.is_hit
    run_steps(ChorusAttention(plan, CFG, INFO))
    assert commit_plan(ws, plan).startswith("wrote entry 1") and commit_plan(ws, plan).startswith("wrote entry 1")
    assert len(ws) == 1
    _, meta = ws.load(1, touch=False)
    assert meta["prompt"] == "a cat" and meta["signature"]["experts"] == ["fp-high"]

    hit = retrieve_plan(ws, emb * 1.01 + 0.01, LATENT, similarity_threshold=0.9)
    assert hit.is_hit and hit.entry_id == 1 and copy.deepcopy(hit) is hit
    assert retrieve_plan(ws, -emb, LATENT).message.startswith("miss (best similarity")

    # same aspect, more frames: resampled in 3D block coordinates, used sparse
    bigger = (16, 6, 10, 14)
    assert latent_compatibility(meta["signature"], bigger)[0] == "resample"
    hit = retrieve_plan(ws, emb, bigger)
    assert hit.is_hit and hit.resample_to == token_grid(bigger)
    handle = ChorusAttention(hit, CFG, INFO)
    handle.begin_run(SIGMAS)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 210, 64, generator=g) for _ in range(3))
    handle.self_attention(q, k, v, layer=0, sigma=0.75, grid=token_grid(bigger), dense_fn=sdpa)
    assert hit.stats.sparse_calls == 1 and hit.stats.fallback_calls == 0
    # another aspect: a miss that says why
    other = retrieve_plan(ws, emb, (16, 3, 10, 28))
    assert not other.is_hit and "aspect" in other.message

    # heatmap of the reused masks
    image = mask_heatmap(list(hit.masks.values()))
    assert image.shape[0] == 1 and image.shape[-1] == 3 and 0 <= image.min() and image.max() <= 1

    # a corrupt entry file: reported, the request is a miss, nothing raised
    for path in (tmp_path / "ws").rglob("*.safetensors"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    broken = retrieve_plan(ws, emb, LATENT)
    assert not broken.is_hit and "unreadable" in broken.message


def _write_entry(ws, emb, *infos, sigmas=SIGMAS):
    """A miss recorded by these models (one run each, the schedule split between them) and written."""
    plan = Plan.miss("recording", embedding=emb, latent_shape=LATENT)
    cut = len(sigmas) // len(infos)
    for i, info in enumerate(infos):
        part = sigmas[i * cut: len(sigmas) if i == len(infos) - 1 else (i + 1) * cut + 1]
        run_steps(ChorusAttention(plan, CFG, info), sigmas=part)
    assert commit_plan(ws, plan).startswith("wrote entry"), plan.committed
    return len(ws)


def test_a_hit_on_another_models_entry_moves_to_the_entry_made_for_this_model(tmp_path):
    """The same prompt sampled with another LoRA (strength) or step count has an equal embedding:
    retrieval ranks the older entry first, made for other weights or steps. The plan moves, before its
    first sparse call, to the candidate made for the model (for A14B: both experts) and schedule it
    meets; with none, it demotes."""
    ws = Workspace.open(tmp_path / "ws")
    emb = np.random.default_rng(3).standard_normal(24).astype(np.float32)
    lora = dataclasses.replace(INFO, fingerprint="fp-high-lora")
    lora_low = dataclasses.replace(INFO_LOW, fingerprint="fp-low-lora")
    base_id = _write_entry(ws, emb, INFO, INFO_LOW)
    lora_id = _write_entry(ws, emb, lora, lora_low)
    mixed_id = _write_entry(ws, emb, lora, INFO_LOW)  # the LoRA on the high-noise expert only

    plan = retrieve_plan(ws, emb, LATENT)
    assert plan.is_hit and plan.entry_id == base_id  # ties rank the older entry first
    assert [e for e, _ in plan.retrieval.candidates] == [lora_id, mixed_id]
    run_steps(ChorusAttention(plan, CFG, lora), sigmas=SIGMAS[:3])
    run_steps(ChorusAttention(plan, CFG, lora_low), sigmas=SIGMAS[2:])
    assert plan.is_hit and plan.entry_id == lora_id, plan.message
    assert plan.stats.sparse_calls == 6 and plan.stats.dense_calls == 0
    assert any(f"hit moved from entry {base_id}" in m for m in plan.stats.messages), plan.stats.messages
    assert [e.fingerprint for e in plan.experts] == ["fp-high-lora", "fp-low-lora"]
    assert commit_plan(ws, plan).startswith(f"hit: updated stats of entry {lora_id}")

    # both experts met before sampling (ComfyUI patches each model first): nothing moves at patch time;
    # the first sampler run moves to the entry made for both
    plan = retrieve_plan(ws, emb, LATENT)
    plan.expect_model(lora)
    plan.expect_model(INFO_LOW)
    assert plan.entry_id == base_id and "another model" in plan.mismatch(lora) and plan.mismatch(INFO) is None
    assert plan.serve_run(lora) == 0 and plan.entry_id == mixed_id
    assert plan.serve_run(INFO_LOW) == 1 and plan.entry_id == mixed_id  # already served: stays
    assert sum("hit moved" in m for m in plan.stats.messages) == 1

    # no candidate made for this model: demoted (dense + recording), with every candidate's reason
    other = dataclasses.replace(INFO, fingerprint="fp-other")
    plan = retrieve_plan(ws, emb, LATENT)
    plan.serve_run(other)
    reason = plan.demoted_reason
    assert not plan.is_hit and reason and "no other candidate serves it" in reason and plan.recorder is not None
    # a model met after sparse calls ran cannot move the plan: demoted, nothing written
    plan = retrieve_plan(ws, emb, LATENT)
    run_steps(ChorusAttention(plan, CFG, INFO), sigmas=SIGMAS[:3])
    assert plan.is_hit and plan.entry_id == base_id and plan.stats.sparse_calls == 4
    run_steps(ChorusAttention(plan, CFG, lora_low), sigmas=SIGMAS[2:])
    assert not plan.is_hit and "another model" in plan.message

    # the same for the sampler's schedule (another step count on the same prompt): the first run's
    # steps decide, before any sparse call
    steps5 = [1.0, 0.8, 0.6, 0.3, 0.0]
    five_id = _write_entry(ws, emb, INFO, INFO_LOW, sigmas=steps5)
    plan = retrieve_plan(ws, emb, LATENT)
    assert plan.entry_id == base_id
    run_steps(ChorusAttention(plan, CFG, INFO), sigmas=steps5[:3])
    run_steps(ChorusAttention(plan, CFG, INFO_LOW), sigmas=steps5[2:])
    assert plan.is_hit and plan.entry_id == five_id and plan.stats.sparse_calls == 8, plan.message
    assert any("step schedule differs" in m and f"to entry {five_id}" in m for m in plan.stats.messages)
    plan = retrieve_plan(ws, emb, LATENT)  # a schedule no entry has: demoted, every candidate's reason
    run_steps(ChorusAttention(plan, CFG, INFO), sigmas=[1.0, 0.9, 0.0])
    assert not plan.is_hit and "schedule differs" in plan.message and "no other candidate" in plan.message


def test_a_forward_grid_that_is_no_grid_is_a_note_not_a_crash(tmp_path):
    """``serve_grid`` never raises, also where the host's grid is not one (the note shows it as given)."""
    ws = Workspace.open(tmp_path / "ws")
    emb = np.ones(8, np.float32)
    _write_entry(ws, emb, INFO, INFO_LOW)
    plan = retrieve_plan(ws, emb, LATENT)
    handle = ChorusAttention(plan, CFG, INFO)
    handle.begin_run(SIGMAS)
    handle.serve_grid(None)
    assert any("token grid None (TypeError:" in m for m in plan.stats.messages), plan.stats.messages


def _run_forwards(handle, grid, sigmas=SIGMAS, layers=2):
    """A sampler run whose forwards all have token grid ``grid`` (a host tells the part each forward's grid
    before its calls, ``serve_grid``); q/k/v of that many tokens."""
    handle.begin_run(sigmas)
    tokens = grid[0] * grid[1] * grid[2]
    for i, s in enumerate(sigmas[:-1]):
        handle.serve_grid(grid)
        for layer in range(layers):
            q, k, v = (t[:, :, :tokens] for t in qkv(10 * i + layer))
            handle.self_attention(q, k, v, layer=layer, sigma=s, grid=grid, dense_fn=sdpa)
    handle.end_run()


def test_the_grid_a_run_s_forwards_have_decides_how_a_hit_serves_its_entry(tmp_path):
    """ComfyUI's context windows run the model on windows of the latent's frames: an entry recorded so has the
    whole latent's shape and the window's grid, which retrieval (it sees the latent only) cannot tell from one
    recorded on the whole latent. The run's first forward tells the grid, and the rule retrieval applies to
    latents decides: a windowed request of another length serves the entry at its own grid (retrieval had it
    resampled to the whole latent's), a request on the whole latent serves the entry resampled (in a token order,
    to the order of its kind at that grid). A grid of another aspect cannot be served: before the first sparse
    call the hit moves to a candidate made for the grid, or is demoted (a miss that records, so the request is
    written); such a grid met after sparse calls ran demotes the plan and nothing is written."""
    window, whole = (2, 5, 7), GRID
    ws = Workspace.open(tmp_path / "ws")
    emb = np.random.default_rng(4).standard_normal(24).astype(np.float32)
    recording = Plan.miss("recording", embedding=emb, latent_shape=LATENT)
    _run_forwards(ChorusAttention(recording, CFG, INFO), window)
    assert recording.recorder.grid == window and commit_plan(ws, recording).startswith("wrote entry 1")

    plan = retrieve_plan(ws, emb, (16, 5, 10, 14))  # windows of the same length on a longer latent
    assert plan.is_hit and plan.resample_to is None and "recorded in context windows" in plan.message
    _run_forwards(ChorusAttention(plan, CFG, INFO), window)
    assert plan.is_hit and plan.token_grid == window
    assert plan.stats.sparse_calls == 6 and plan.stats.fallback_calls == 0, plan.stats.messages

    # an entry recorded without windows on a 2-frame latent; a 3-frame request in windows of 2 frames: retrieval
    # resamples to the latent's grid, the first forward serves the entry at its own instead
    short = Workspace.open(tmp_path / "short")
    recording = Plan.miss("recording", embedding=emb, latent_shape=(16, 2, 10, 14))
    _run_forwards(ChorusAttention(recording, CFG, INFO), window)
    assert commit_plan(short, recording).startswith("wrote entry 1")
    plan = retrieve_plan(short, emb, LATENT)
    assert plan.is_hit and plan.resample_to == whole
    _run_forwards(ChorusAttention(plan, CFG, INFO), window)
    assert plan.is_hit and plan.resample_to is None and plan.token_grid == window
    assert plan.stats.sparse_calls == 6 and plan.stats.fallback_calls == 0, plan.stats.messages
    assert any("served at this run's token grid (2, 5, 7) (the entry's own)" in m for m in plan.stats.messages)

    plan = retrieve_plan(ws, emb, LATENT)  # the whole latent, no windows: the window's maps resampled
    assert plan.is_hit and plan.token_grid == window  # the latent is the entry's: retrieval cannot tell
    _run_forwards(ChorusAttention(plan, CFG, INFO), whole)
    assert plan.is_hit and plan.resample_to == whole and plan.stats.sparse_calls == 6, plan.stats.messages
    assert any("served at this run's token grid (3, 5, 7) (token grid (3, 5, 7) differs from the entry's (2, 5, 7)"
               in m for m in plan.stats.messages), plan.stats.messages

    # entries in feature reuse's region order (1, 4, 8), one 32-token block: resampled in the order of its kind
    window, whole, latent, region = (2, 4, 8), (3, 4, 8), (16, 3, 8, 16), (1, 4, 8)
    ws = Workspace.open(tmp_path / "regions")
    recording = Plan.miss("recording", embedding=emb, latent_shape=latent)
    _run_forwards(ChorusAttention(recording, CFG, INFO, record_region=region), window)
    assert recording.recorder.token_order is not None and commit_plan(ws, recording).startswith("wrote entry 1")
    plan = retrieve_plan(ws, emb, (16, 5, 8, 16))  # windows of the same length on a longer latent: exact
    assert plan.is_hit and plan.resample_to is None and "recorded in context windows" in plan.message
    _run_forwards(ChorusAttention(plan, CFG, INFO, record_region=region), window)
    assert plan.is_hit and plan.stats.sparse_calls == 6 and plan.stats.fallback_calls == 0, plan.stats.messages
    plan = retrieve_plan(ws, emb, latent)  # the whole latent: the window's maps resampled to its region order
    _run_forwards(ChorusAttention(plan, CFG, INFO, record_region=region), whole)
    assert plan.is_hit and plan.resample_to == whole and plan.stats.sparse_calls == 6, plan.stats.messages
    assert any("(3, 4, 8) differs from the entry's (2, 4, 8) with the same aspect: masks resampled (token order "
               "regions1x4x8)" in m for m in plan.stats.messages), plan.stats.messages

    # a grid of another aspect (as many tokens): demoted at its first forward, records, writes; from then on each
    # kind of request moves to the entry made for its grid
    other = (2, 8, 4)
    plan = retrieve_plan(ws, emb, latent)
    _run_forwards(ChorusAttention(plan, CFG, INFO, record_region=region), other)
    assert not plan.is_hit and "token grid (2, 8, 4) has another aspect than the entry's (2, 4, 8)" in plan.message
    assert plan.stats.sparse_calls == 0 and plan.stats.fallback_calls == 0 and plan.stats.recorded_calls == 6
    assert commit_plan(ws, plan).startswith("wrote entry 2"), plan.committed
    for grid, own in ((other, 2), (window, 1)):  # equal embeddings (ties rank the older first): each to its own
        plan = retrieve_plan(ws, emb, latent)
        _run_forwards(ChorusAttention(plan, CFG, INFO, record_region=region), grid)
        assert plan.is_hit and plan.entry_id == own and plan.token_grid == grid, plan.message
        assert plan.stats.sparse_calls == 6 and plan.stats.fallback_calls == 0, plan.stats.messages
        assert sum("hit moved" in m for m in plan.stats.messages) == (own != 1)

    # a grid met after sparse calls ran (a later sampler run) cannot move the plan: demoted, not written
    plan = retrieve_plan(ws, emb, latent)
    handle = ChorusAttention(plan, CFG, INFO, record_region=region)
    _run_forwards(handle, window, sigmas=SIGMAS[:3])
    assert plan.is_hit and plan.entry_id == 1 and plan.stats.sparse_calls == 4
    _run_forwards(handle, other, sigmas=SIGMAS[2:])
    assert not plan.is_hit and "another aspect" in plan.message and plan.recorder.incomplete_reason is not None


def _run_windows(handle, grids, sigmas=SIGMAS, layers=2):
    """A sampler run whose every step runs one forward per grid of ``grids`` (context windows)."""
    handle.begin_run(sigmas)
    for i, s in enumerate(sigmas[:-1]):
        for w, grid in enumerate(grids):
            handle.serve_grid(grid)
            tokens = grid[0] * grid[1] * grid[2]
            for layer in range(layers):
                q, k, v = (t[:, :, :tokens] for t in qkv(100 * w + 10 * i + layer))
                handle.self_attention(q, k, v, layer=layer, sigma=s, grid=grid, dense_fn=sdpa)
    handle.end_run()


def test_windows_of_two_lengths_in_one_run_are_recorded_and_served_at_the_first_window_s_grid(tmp_path):
    """Later ComfyUI's context windows put one anchor frame in front of every window but the first (its causal
    window fix), and a batched schedule's last window is shorter: one run, forwards of two grids. A miss records
    every call at the first forward's grid (another grid's mass carried there, ``kernels.resample_block_map``); a
    hit of that entry resamples its maps to such a call's grid, every call sparse. In a token order (feature
    reuse's regions) the same, in the order of its kind at each grid."""
    window, anchored = (2, 5, 7), (3, 5, 7)
    ws = Workspace.open(tmp_path / "ws")
    emb = np.random.default_rng(6).standard_normal(24).astype(np.float32)
    miss = Plan.miss("recording", embedding=emb, latent_shape=LATENT)
    _run_windows(ChorusAttention(miss, CFG, INFO), [window, anchored, anchored])
    assert miss.recorder.grid == window and miss.stats.recorded_calls == 18 and not miss.stats.messages
    assert commit_plan(ws, miss).startswith("wrote entry 1")

    hit = retrieve_plan(ws, emb, LATENT)
    handle = ChorusAttention(hit, CFG, INFO)
    _run_windows(handle, [window, anchored])
    assert hit.is_hit and hit.stats.sparse_calls == 12 and hit.stats.fallback_calls == 0, hit.stats.messages

    # in a token order (feature reuse's regions): the same, from the order at one grid to the order of its kind
    # at the other
    window, anchored = (2, 4, 8), (3, 4, 8)  # feature reuse's region (1, 4, 8) is one 32-token block
    regions = Plan.miss("recording", embedding=emb, latent_shape=(16, 2, 8, 16))
    _run_windows(ChorusAttention(regions, CFG, INFO, record_region=(1, 4, 8)), [window, anchored])
    assert regions.recorder.token_order == "regions1x4x8" and regions.recorder.grid == window
    assert regions.stats.recorded_calls == 12 and not regions.stats.messages, regions.stats.messages
    ws2 = Workspace.open(tmp_path / "ws2")
    assert commit_plan(ws2, regions).startswith("wrote entry 1")
    hit = retrieve_plan(ws2, emb, (16, 2, 8, 16))
    handle = ChorusAttention(hit, CFG, INFO)
    _run_windows(handle, [window, anchored])
    assert hit.is_hit and hit.stats.sparse_calls == 12 and hit.stats.fallback_calls == 0, hit.stats.messages
    at_window, at_anchored = (cached_region_order(g, (1, 4, 8), BS) for g in (window, anchored))
    assert hit.entry_order is at_window and handle.token_order(anchored) is at_anchored
    entry_map = unpacked_map(hit.masks[(0, 0, 1, 0)])
    served = stored_map(hit, 0, 0, 1, block_size=BS, top_p=CFG.top_p, k_min=CFG.k_min, grid=anchored)
    assert torch.equal(served, kernels.resample_block_map(entry_map, window, anchored, block_size=BS,
                                                          src_order=at_window, dst_order=at_anchored))


def _run_some_steps(handle, sigmas, steps, layers=2):
    """A sampler run over ``sigmas`` whose model is called at the step indices ``steps`` only (what a
    step cache such as ComfyUI's EasyCache does: it skips the model on the others)."""
    handle.begin_run(sigmas)
    for i in steps:
        for layer in range(layers):
            q, k, v = qkv(10 * i + layer)
            handle.self_attention(q, k, v, layer=layer, sigma=sigmas[i], grid=GRID, dense_fn=sdpa)
    handle.end_run()


def test_an_entry_of_a_request_that_skipped_steps_serves_its_schedule(tmp_path):
    """EasyCache skips the model on some steps: the miss records fewer steps than its sampler ran. The
    entry keeps the sampler's schedule (``sampler_sigmas``), so a request with that schedule hits
    (sparse where maps exist, dense on a skipped step the model is called at) instead of being
    demoted; another schedule still is."""
    ws = Workspace.open(tmp_path / "ws")
    emb = np.random.default_rng(5).standard_normal(24).astype(np.float32)
    miss = Plan.miss("recording", embedding=emb, latent_shape=LATENT)
    _run_some_steps(ChorusAttention(miss, CFG, INFO), SIGMAS, steps=(0, 2))  # step 1 skipped
    assert commit_plan(ws, miss).startswith("wrote entry")
    _, meta = ws.load(1, touch=False)
    assert meta["signature"]["step_sigmas"] == [1.0, 0.5] and meta["signature"]["sampler_sigmas"] == [1.0, 0.75, 0.5]

    hit = retrieve_plan(ws, emb, LATENT)
    _run_some_steps(ChorusAttention(hit, CFG, INFO), SIGMAS, steps=(0, 1, 2))
    assert hit.is_hit and hit.stats.sparse_calls == 4 and hit.stats.fallback_calls == 2, hit.stats
    assert any("no map for the step at sigma 0.75" in m for m in hit.stats.messages), hit.stats.messages
    other = retrieve_plan(ws, emb, LATENT)
    _run_some_steps(ChorusAttention(other, CFG, INFO), [1.0, 0.6, 0.0], steps=(0, 1))
    assert not other.is_hit and "schedule differs" in other.message
    # a request that ran every step writes no sampler_sigmas: its signature is as before
    full = Plan.miss("recording", embedding=emb + 1, latent_shape=LATENT)
    run_steps(ChorusAttention(full, CFG, INFO))
    commit_plan(ws, full)
    assert "sampler_sigmas" not in ws.load(2, touch=False)[1]["signature"]


def test_plan_is_an_immutable_retrieval_plus_one_request_state(tmp_path):
    """The retrieval result cannot change; everything that does is a declared field of plan.state."""
    import dataclasses

    from chorus.engine.plan import Retrieval
    from chorus.engine.state import RequestState

    masks = {(0, s, l, 0): torch.ones(2, QB, QB, dtype=torch.bool) for s in range(3) for l in range(2)}
    plan = hit_plan(masks, request_meta={"prompt": "p"})
    assert isinstance(plan.retrieval, Retrieval) and isinstance(plan.state, RequestState)
    for name in ("kind", "similarity_threshold", "_chorus_feature_reuse_typo", "recorder"):
        with pytest.raises(AttributeError):
            setattr(plan, name, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.retrieval.kind = "miss"
    with pytest.raises(TypeError):
        plan.retrieval.request_meta["x"] = 1
    with pytest.raises(TypeError):
        plan.masks[(9, 9, 9, 0)] = None
    assert copy.deepcopy(plan) is plan and copy.copy(plan) is plan and copy.deepcopy(plan.state) is plan.state
    # demotion is state: the retrieval still says hit, the plan says miss (with the reason)
    plan.demote("test reason")
    assert plan.retrieval.kind == "hit" and plan.kind == "miss" and not plan.is_hit
    assert plan.demoted_reason == "test reason" and "test reason" in plan.message and plan.recorder is not None
    # what a new entry's metadata gets = the request's fields + state.entry_extras, retrieval untouched
    plan.state.entry_extras["feature_reuse"] = {"version": 1}
    assert plan.request_meta == {"prompt": "p", "feature_reuse": {"version": 1}}
    assert dict(plan.retrieval.request_meta) == {"prompt": "p"}
    # retrieve_plan hands the threshold to the constructor; commit_plan writes the extras
    ws = Workspace.open(tmp_path / "ws")
    emb = np.random.default_rng(1).standard_normal(24).astype(np.float32)
    miss = retrieve_plan(ws, emb, LATENT, similarity_threshold=0.8, request_meta={"prompt": "q"})
    assert miss.similarity_threshold == 0.8 and miss.retrieval.similarity_threshold == 0.8
    run_steps(ChorusAttention(miss, CFG, INFO))
    miss.state.entry_extras["extra"] = [1, 2]
    assert commit_plan(ws, miss).startswith("wrote entry 1") and miss.committed.startswith("wrote entry 1")
    _, meta = ws.load(1, touch=False)
    assert meta["prompt"] == "q" and meta["extra"] == [1, 2]
    assert Plan.from_retrieval(miss.retrieval).state is not miss.state


def test_messages_are_logged_once_and_capped():
    plan = Plan.miss("test")
    for _ in range(3):
        plan.note("same")
    for i in range(50):
        plan.note(f"distinct {i}")
    assert plan.stats.messages.count("same") == 1
    assert len(plan.stats.messages) == Plan.MAX_MESSAGES and plan.stats.suppressed_messages == 50 + 1 - Plan.MAX_MESSAGES


@pytest.mark.parametrize("kb", [1, 7, 8, 9, 61, 256])
def test_device_bit_packing_matches_the_codec(kb):
    from chorus.kernels.codec import pack_bits_on_device
    from chorus.kernels.codec import pack_bits, unpack_bits

    m = torch.rand(3, 5, kb, generator=torch.Generator().manual_seed(kb)) < 0.4
    packed = pack_bits_on_device(m)
    assert packed.dtype == torch.uint8 and torch.equal(packed, pack_bits(m))
    assert torch.equal(unpack_bits(packed, kb), m)


@pytest.mark.parametrize("kb", [1, 9, 61])
def test_device_unpack_inverts_device_pack(kb):
    from chorus.kernels.codec import pack_bits_on_device, unpack_bits_on_device

    m = torch.rand(2, 4, kb, generator=torch.Generator().manual_seed(kb)) < 0.5
    assert torch.equal(unpack_bits_on_device(pack_bits_on_device(m), kb), m)


def test_the_recording_ops_take_calls_outside_inference_mode_when_first_imported_inside_it():
    """ComfyUI runs its nodes under ``torch.inference_mode``, so the engine's ops may be imported there first; their
    call counter must still take calls outside it (a benchmark, a script, another host), as it does inside."""
    code = ("import torch\n"
            "with torch.inference_mode():\n"
            "    from chorus.engine import attend\n"
            "q = torch.randn(1, 2, 8, 16)\n"
            "with torch.inference_mode():\n"
            "    torch.ops.chorus.record_mass(q, q, -1, attend._RECORD_TOKEN)\n"
            "torch.ops.chorus.record_mass(q, q, -1, attend._RECORD_TOKEN)\n"
            "print('calls', int(attend._RECORD_TOKEN))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["calls", "2"], done.stdout
