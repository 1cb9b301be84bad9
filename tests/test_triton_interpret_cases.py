"""Triton kernels on CPU under the Triton interpreter, against the fp64 oracle.

These cases run only when ``TRITON_INTERPRET=1`` is set before Triton is imported (Triton decides
interpreted vs compiled when a kernel is defined); ``test_triton_cpu.py`` runs this file in a
subprocess with that variable, so a plain ``pytest`` covers them. Run directly:
``TRITON_INTERPRET=1 pytest tests/test_triton_interpret_cases.py``.

Tolerances (all derived, none guessed):
- bf16/fp16 path: max error vs the fp64 oracle <= 2 x that of eager masked attention in the same dtype
  (+ 4 ulp of the output scale).
- FP8 path: relative L1 error <= 2 x, and cosine deficit (1 - cos) <= 2 x, those of a SageAttention-style
  FP8 emulation in torch (:mod:`chorus.kernels.triton.emulation`) on the same inputs. The interpreter's
  own fp32->e4m3 cast mis-rounds, so under the interpreter the kernels pre-round to the e4m3 grid
  (exact); on the GPU the hardware cast is used (tested in ``test_triton_gpu.py``).
- block mass: exact and sampled results match ``block_mass_reference`` to 1e-5 absolute.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs under TRITON_INTERPRET=1 (test_triton_cpu.py starts it in a subprocess)")

if os.environ.get("TRITON_INTERPRET") == "1":
    from chorus.kernels.reference import (block_mass_reference, dense_attention_oracle, masked_attention_eager)
    from chorus.kernels.triton import block_mass_triton, block_sparse_attention_triton
    from chorus.kernels.triton.emulation import error_stats, sage_fp8_attention_emulation


def make_inputs(batch, heads, length, dim, dtype, seed, kv_len=None, layout="bhld"):
    gen = torch.Generator().manual_seed(seed)
    kv_len = length if kv_len is None else kv_len
    q = torch.randn(batch, heads, length, dim, generator=gen) * 1.5
    k = torch.randn(batch, heads, kv_len, dim, generator=gen) * 1.5 + 0.5  # a shared K offset (smoothing matters)
    v = torch.randn(batch, heads, kv_len, dim, generator=gen)
    if layout == "blhd":  # [B, L, H, D] storage viewed as [B, H, L, D] (what attention modules pass)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return tuple(t.to(dtype) for t in (q, k, v))


def random_map(batch, heads, q_len, kv_len, bs, density, seed):
    gen = torch.Generator().manual_seed(seed)
    qb, kb = -(-q_len // bs), -(-kv_len // bs)
    keep = torch.rand(batch, heads, qb, kb, generator=gen) < density
    keep[..., torch.arange(min(qb, kb)), torch.arange(min(qb, kb))] = True
    keep[..., -1, -1] = True  # the partial last key block is exercised
    return keep


def check_16bit(out, q, k, v, bm, bs, prefix_len=0, prefix_bias=0.0, **options):
    oracle = dense_attention_oracle(q, k, v, bm, bs, prefix_len=prefix_len, prefix_bias=prefix_bias, **options)
    eager = masked_attention_eager(q, k, v, bm, bs, prefix_len=prefix_len, prefix_bias=prefix_bias, **options).double()
    err = (out.double() - oracle).abs().max().item()
    err_eager = (eager - oracle).abs().max().item()
    floor = 4 * torch.finfo(q.dtype).eps * oracle.abs().max().item()
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert err <= 2 * err_eager + floor, f"error {err:.3e} > 2 x eager {err_eager:.3e} + {floor:.1e}"


def check_fp8(out, q, k, v, bm, bs, prefix_len=0, prefix_bias=0.0, **options):
    oracle = dense_attention_oracle(q, k, v, bm, bs, prefix_len=prefix_len, prefix_bias=prefix_bias, **options)
    ours = error_stats(out, oracle)
    sage = error_stats(sage_fp8_attention_emulation(q, k, v, bm, bs, prefix_len=prefix_len,
                                                    prefix_bias=prefix_bias, **options), oracle)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert ours["rel_l1"] <= 2 * sage["rel_l1"], (ours, sage)
    assert 1 - ours["cosine"] <= 2 * (1 - sage["cosine"]), (ours, sage)
    return ours, sage


CASES = [  # (batch, heads, length, dim, block_size, density, map broadcast)
    (1, 2, 97, 64, 32, 0.5, False),
    (1, 2, 300, 128, 64, 0.4, False),
    (2, 2, 300, 64, 128, 1.0, False),
    (1, 3, 300, 64, 32, 0.2, True),
    (1, 1, 128, 128, 128, 1.0, False),
]


@pytest.mark.parametrize("batch,heads,length,dim,bs,density,broadcast", CASES)
def test_bf16_kernel_matches_oracle(batch, heads, length, dim, bs, density, broadcast):
    q, k, v = make_inputs(batch, heads, length, dim, torch.bfloat16, seed=length + dim)
    bm = random_map(1 if broadcast else batch, 1 if broadcast else heads, length, length, bs, density, seed=bs)
    out = block_sparse_attention_triton(q, k, v, bm, block_size=bs, fp8=False)
    check_16bit(out, q, k, v, bm, bs)


def test_fp16_and_strided_inputs_and_cross_lengths():
    q, k, v = make_inputs(1, 2, 150, 64, torch.float16, seed=3, kv_len=260, layout="blhd")
    assert not q.is_contiguous()
    bm = random_map(1, 2, 150, 260, 64, 0.5, seed=4)
    out = block_sparse_attention_triton(q, k, v, bm, block_size=64, fp8=False, scale=0.2)
    oracle = dense_attention_oracle(q, k, v, bm, 64, scale=0.2)
    eager = masked_attention_eager(q, k, v, bm, 64, scale=0.2).double()
    assert (out.double() - oracle).abs().max() <= 2 * (eager - oracle).abs().max() + 1e-3


@pytest.mark.parametrize("batch,heads,length,dim,bs,density,broadcast", CASES[:4])
def test_fp8_kernel_within_sage_emulation_bound(batch, heads, length, dim, bs, density, broadcast):
    q, k, v = make_inputs(batch, heads, length, dim, torch.bfloat16, seed=7 * length + dim)
    bm = random_map(1 if broadcast else batch, 1 if broadcast else heads, length, length, bs, density, seed=bs + 1)
    out = block_sparse_attention_triton(q, k, v, bm, block_size=bs, fp8=True)
    check_fp8(out, q, k, v, bm, bs)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("length,prefix_len,bs", [(300, 130, 64), (97, 97, 32)])
def test_prefix_bias_matches_oracle(fp8, length, prefix_len, bs):
    """The first-frame logit bias, on a prefix that ends inside a block (and one covering all keys)."""
    q, k, v = make_inputs(1, 2, length, 64, torch.bfloat16, seed=length + prefix_len)
    bm = random_map(1, 2, length, length, bs, 0.4, seed=5)
    bm[..., 0] = True
    out = block_sparse_attention_triton(q, k, v, bm, block_size=bs, fp8=fp8, prefix_len=prefix_len, prefix_bias=1.3)
    (check_fp8 if fp8 else check_16bit)(out, q, k, v, bm, bs, prefix_len=prefix_len, prefix_bias=1.3)
    plain = block_sparse_attention_triton(q, k, v, bm, block_size=bs, fp8=fp8)
    if prefix_len < length:  # (a bias on every key cancels in the softmax)
        assert (out.float() - plain.float()).abs().max() > 0.02


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("length,suffix_len,bs", [(300, 100, 64), (300, 40, 64), (97, 97, 32)])
def test_suffix_bias_matches_oracle(fp8, length, suffix_len, bs):
    """The pooled cells' weight (log 8 on the last keys of the compact sequence), from inside a block,
    on whole blocks, and with the first-frame prefix bias at once."""
    q, k, v = make_inputs(1, 2, length, 64, torch.bfloat16, seed=length + suffix_len)
    bm = random_map(1, 2, length, length, bs, 0.4, seed=6)
    bm[..., 0] = True
    for prefix_len, prefix_bias in ((0, 0.0), (70, 0.5)):
        biases = dict(prefix_len=prefix_len, prefix_bias=prefix_bias, suffix_len=suffix_len, suffix_bias=math.log(8))
        out = block_sparse_attention_triton(q, k, v, bm, block_size=bs, fp8=fp8, **biases)
        (check_fp8 if fp8 else check_16bit)(out, q, k, v, bm, bs, **biases)
        plain = block_sparse_attention_triton(q, k, v, bm, block_size=bs, fp8=fp8, prefix_len=prefix_len,
                                              prefix_bias=prefix_bias)
        if suffix_len < length:
            assert (out.float() - plain.float()).abs().max() > 0.02


@pytest.mark.parametrize("grid,region,pool,channels", [((3, 6, 10), (2, 2, 4), (1, 2, 2), 1100),
                                                       ((5, 9, 13), (2, 4, 4), (2, 2, 2), 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_pooling_matches_the_loop_references(grid, region, pool, channels, dtype):
    """Feature reuse's fused pool / unpool kernels (ragged grids, channels not a multiple of the
    kernel's 1024-channel block) against the fp64 loop references, with the torch path's bounds;
    kept tokens are exact copies."""
    from chorus.kernels import pooling
    from chorus.kernels.triton._pooling import pool_tokens_triton, unpool_residual_triton

    length = grid[0] * grid[1] * grid[2]
    gen = torch.Generator().manual_seed(channels)
    x = torch.randn(2, length, channels, generator=gen).to(dtype)
    n = pooling.region_counts(grid, region)
    regions = torch.randperm(n[0] * n[1] * n[2], generator=gen)[: max(1, n[0] * n[1] * n[2] // 2)]
    layout = pooling.build_layout(grid, region, pool, regions)
    pooled = pool_tokens_triton(x, layout)
    ref = pooling.pool_tokens_reference(x, grid, region, pool, regions)
    assert pooled.shape == ref.shape and pooled.dtype == dtype
    assert float((pooled.double() - ref).abs().max()) <= 2 * torch.finfo(dtype).eps * float(ref.abs().max())
    n_keep = layout.keep_index.numel()
    assert torch.equal(pooled[:, :n_keep], x[:, layout.keep_index])
    y_c = torch.randn(pooled.shape, generator=gen).to(dtype)
    out = unpool_residual_triton(x, pooled, y_c, layout)
    ref_out = pooling.unpool_residual_reference(x, y_c, grid, region, pool, regions)
    tol = 4 * torch.finfo(dtype).eps * float(ref_out.abs().max() + x.double().abs().max())
    assert float((out.double() - ref_out).abs().max()) <= tol
    assert torch.equal(out[:, layout.keep_index], y_c[:, :n_keep])
    torch.testing.assert_close(out, pooling.unpool_residual_torch(x, pooled, y_c, layout), rtol=0,
                               atol=2 * tol)


def _selection_mass(shape, seed, dtype):
    """Peaked random rows with the awkward cases the selection must order like torch: exact ties (a
    whole row of one value, a repeated column), zero mass, a row of a few equal large blocks."""
    gen = torch.Generator().manual_seed(seed)
    mass = torch.rand(shape, generator=gen, dtype=torch.float64) ** 8
    if shape[-1] > 3:
        mass[..., 3] = 0.0
        mass[..., -1] = mass[..., 1]
    mass[0, 0] = 1.0
    mass[..., -1, ::2] = 0.25
    return (mass / mass.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("shape,dtype", [((1, 3, 1), torch.float32), ((2, 3, 9), torch.float32),
                                         ((1, 5, 37), torch.bfloat16), ((1, 3, 130), torch.float32),
                                         ((1, 2, 300), torch.float32)])
def test_triton_selection_is_the_torch_map(shape, dtype):
    """The miss's Triton top-p selection (values sorted, ties by key order, keep-sets, the k_min floor)
    against select_blocks_torch, bool and packed, at key-block counts that are not powers of two or
    multiples of 8; k_min past the row width is the whole row."""
    from chorus.kernels.codec import pack_bits_on_device
    from chorus.kernels.masks import select_blocks_torch
    from chorus.kernels.triton._select import select_blocks_triton

    mass = _selection_mass(shape, shape[-1], dtype)
    for top_p, k_min, first, last, diagonal in [(0.3, 0, 0, 0, False), (0.9, 2, 1, 1, True), (1.0, 0, 2, 0, True),
                                                (0.5, shape[-1] + 5, 0, 2, True), (0.999, 1, shape[-1] + 3, 0, False),
                                                (0.4, 1, 0, shape[-1] + 1, True)]:
        args = dict(top_p=top_p, k_min=k_min, keep_diagonal=diagonal, keep_first_frame_blocks=first,
                    keep_last_frame_blocks=last)
        want = select_blocks_torch(mass, **args)
        got = select_blocks_triton(mass, **args)
        assert got.dtype == torch.bool and torch.equal(got, want), args
        assert torch.equal(select_blocks_triton(mass, packed=True, **args), pack_bits_on_device(want)), args


@pytest.mark.parametrize("src_heads,heads,num_q,num_kv", [(1, 3, 5, 5), (2, 2, 7, 13), (1, 4, 9, 37),
                                                           (3, 3, 4, 64), (1, 2, 6, 130), (2, 4, 3, 591)])
def test_triton_map_floor_is_the_torch_map(src_heads, heads, num_q, num_kv):
    """A hit's map from its entry's packed map in one kernel (the k_min floor from the nearest blocks, a map
    shared by every head or one per head, the packed copy and the row counts) against floor_packed_map_torch,
    at key-block counts that are not powers of two or multiples of 8 (720p's 591), with the floor off, reaching
    some rows, every row, and past the row width."""
    from chorus.kernels.codec import pack_bits_on_device
    from chorus.kernels.masks import floor_packed_map_torch
    from chorus.kernels.triton._floor_map import floor_packed_map_triton

    gen = torch.Generator().manual_seed(num_kv)
    stored = torch.rand(src_heads, num_q, num_kv, generator=gen) < torch.rand(src_heads, num_q, 1, generator=gen) * 0.3
    packed = pack_bits_on_device(stored)
    for k in (0, 2, num_kv // 2, num_kv + 3):
        want = floor_packed_map_torch(packed, num_kv, heads, k)
        got = floor_packed_map_triton(packed, num_kv, heads, k)
        assert got[0].dtype == torch.bool and got[2].dtype == torch.int32
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a, b), k
        assert torch.equal(got[1], pack_bits_on_device(got[0])) and torch.equal(got[2], got[0].sum(-1).int())


def test_triton_selection_of_bad_mass_stays_in_its_rows():
    """NaN / inf / negative mass (what a recorder flags and never writes) gives some map of the right
    shape with every row keeping a block, and writes nothing into the other rows: the clean rows between
    and after the bad ones get torch's map for them alone."""
    from chorus.kernels.codec import pack_bits_on_device
    from chorus.kernels.masks import select_blocks_torch
    from chorus.kernels.triton._select import select_blocks_triton

    mass = torch.softmax(torch.randn(1, 6, 21, generator=torch.Generator().manual_seed(9)) * 3, -1)
    clean = mass[:, [1, 3, 5]].clone()
    mass[0, 0, 3], mass[0, 2, 5], mass[0, 4, 7] = float("nan"), float("inf"), -2.0
    mass[0, 4, 8] = -0.0
    args = dict(top_p=0.9, k_min=1, keep_diagonal=False)
    for packed in (False, True):
        got = select_blocks_triton(mass, packed=packed, **args)
        assert got.shape == ((1, 6, 3) if packed else (1, 6, 21))
        want = select_blocks_torch(clean, **args)
        assert torch.equal(got[:, [1, 3, 5]], pack_bits_on_device(want) if packed else want)
        assert (got != 0).any(-1).all()


def test_fp8_prepass_matches_torch_quantisation():
    from chorus.kernels.triton._quant import quantize_qkv_fp8, quantize_reference

    q, k, v = make_inputs(1, 2, 200, 64, torch.bfloat16, seed=11)
    got = quantize_qkv_fp8(q, k, v, 0.125)
    want = quantize_reference(q, k, v, 0.125)
    for name, a, b in zip(("q8", "k8", "v8t", "q_scale", "k_scale", "v_scale"), got, want):
        assert a.shape == b.shape, name
        diff = (a.float() - b.float()).abs()
        # e4m3 values may differ by one step where fp32 division rounds differently (|x| < 448 -> 32)
        tol = 1e-6 if a.dtype == torch.float32 else 32.0
        assert diff.max().item() <= tol, (name, diff.max().item())
        if a.dtype != torch.float32:
            assert (diff > 0).float().mean().item() < 0.01, name
    assert got[1][:, :, 200:].float().abs().max() == 0 and got[2][..., 200:].float().abs().max() == 0


def test_fp8_prepass_wgmma_key_order_permutes_v_within_16_keys():
    from chorus.kernels.triton._quant import quantize_qkv_fp8, quantize_reference, wgmma_key_order_torch

    q, k, v = make_inputs(1, 2, 200, 64, torch.bfloat16, seed=12)
    natural = quantize_qkv_fp8(q, k, v, 0.125)
    ordered = quantize_qkv_fp8(q, k, v, 0.125, v_key_order="wgmma")
    cols = wgmma_key_order_torch(torch.arange(natural[2].shape[-1]))
    assert sorted(cols.tolist()) == list(range(natural[2].shape[-1]))  # a permutation ...
    assert torch.equal(cols // 16, torch.arange(cols.numel()) // 16)  # ... within each 16 keys
    assert torch.equal(ordered[2][..., cols].view(torch.uint8), natural[2].view(torch.uint8))
    for a, b in zip(ordered[:2] + ordered[3:], natural[:2] + natural[3:]):  # everything else unchanged
        assert torch.equal(a.float(), b.float())
    want = quantize_reference(q, k, v, 0.125, v_key_order="wgmma")[2]
    assert (ordered[2].float() - want.float()).abs().max().item() <= 32.0
    with pytest.raises(ValueError, match="v_key_order"):
        quantize_qkv_fp8(q, k, v, 0.125, v_key_order="tiles")


@pytest.mark.parametrize("length,bs,sample_rows", [(97, 32, None), (300, 64, 5), (300, 128, 16), (128, 128, 200)])
def test_block_mass_matches_reference(length, bs, sample_rows):
    q, k, _ = make_inputs(1, 2, length, 64, torch.bfloat16, seed=length)
    got = block_mass_triton(q, k, block_size=bs, sample_rows=sample_rows)
    want = block_mass_reference(q, k, bs, sample_rows, 1 / math.sqrt(64))
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.allclose(got.sum(-1), torch.ones_like(got.sum(-1)), atol=1e-5)


@pytest.mark.parametrize("length,bs,sample_rows", [(300, 64, 8), (97, 32, None)])
def test_block_mass_in_a_token_order_matches_the_reordered_reference(length, bs, sample_rows):
    """A miss with feature reuse records in the region order: the order fused into the kernel's loads."""
    q, k, _ = make_inputs(1, 2, length, 64, torch.bfloat16, seed=length + 3)
    perm = torch.randperm(length, generator=torch.Generator().manual_seed(4))
    got = block_mass_triton(q, k, block_size=bs, sample_rows=sample_rows, scale=0.125, token_perm=perm)
    want = block_mass_reference(q[:, :, perm], k[:, :, perm], bs, sample_rows, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    plain = block_mass_triton(q, k, block_size=bs, sample_rows=sample_rows, scale=0.125)
    assert not torch.allclose(got, plain, atol=1e-3)


def test_bad_inputs_raise_value_error():
    q, k, v = make_inputs(1, 2, 100, 64, torch.bfloat16, seed=0)
    good = torch.ones(1, 2, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="block_map shape"):
        block_sparse_attention_triton(q, k, v, torch.ones(1, 2, 3, 4, dtype=torch.bool), block_size=32)
    with pytest.raises(ValueError, match="bool"):
        block_sparse_attention_triton(q, k, v, good.int(), block_size=32)
    with pytest.raises(ValueError, match="head dims"):
        block_sparse_attention_triton(q[..., :32], k[..., :32], v[..., :32], good, block_size=32)
    with pytest.raises(ValueError, match="block_size"):
        block_sparse_attention_triton(q, k, v, good, block_size=48)
    with pytest.raises(ValueError, match="fp16/bf16"):
        block_sparse_attention_triton(q.float(), k.float(), v.float(), good, block_size=32)
    with pytest.raises(ValueError, match="sample_rows"):
        block_mass_triton(q, k, block_size=32, sample_rows=0)


def test_custom_ops_trace_with_fake_tensors():
    """The ops have fake implementations: a function calling them compiles (graph capture only here;
    the GPU test compiles with Inductor)."""
    q, k, v = make_inputs(1, 2, 64, 64, torch.bfloat16, seed=1)
    bm = torch.ones(1, 1, 2, 2, dtype=torch.bool)

    def fn(q, k, v, bm):
        return block_sparse_attention_triton(q, k, v, bm, block_size=32, fp8=False) * 2, \
            block_mass_triton(q, k, block_size=32, sample_rows=4)

    out, mass = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, bm)
    ref_out, ref_mass = fn(q, k, v, bm)
    assert torch.equal(out, ref_out) and torch.equal(mass, ref_mass)
    torch.library.opcheck(torch.ops.chorus.block_sparse_attention_triton, (q, k, v, bm, 32, 0.125, False),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.chorus.block_sparse_attention_triton, (q, k, v, bm, 32, 0.125, False, 40, 0.5),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.chorus.block_mass_triton, (q, k, 32, 4, 0.125),
                          test_utils=("test_schema", "test_faketensor"))
    q2, k2, v2 = make_inputs(1, 2, 200, 64, torch.bfloat16, seed=2)
    torch.library.opcheck(torch.ops.chorus.block_sparse_attention_int8,
                          (q2, k2, v2, torch.ones(1, 1, 2, 2, dtype=torch.bool), 0.125, 0, 0.0, None, 0, 0.0, True),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("fp8", [False, True])
def test_int32_chunked_launches_match_one_launch(fp8, monkeypatch):
    """Inputs whose offsets would pass int32 run in (batch, head) chunks; forcing tiny chunks (a low
    limit) on small inputs gives the same result as one launch, for both broadcast and full maps."""
    from chorus.kernels.triton import _attention

    q, k, v = make_inputs(2, 3, 150, 64, torch.bfloat16, seed=31)
    full_map = random_map(2, 3, 150, 150, 64, 0.5, seed=3)
    shared_map = random_map(1, 1, 150, 150, 64, 0.5, seed=4)
    want = [block_sparse_attention_triton(q, k, v, m, block_size=64, fp8=fp8) for m in (full_map, shared_map)]
    want_mass = block_mass_triton(q, k, block_size=64, sample_rows=4)
    per_head = 256 * 64  # the padded FP8 copy of one (b, h)
    for limit in (2 * 3 * per_head - 1, 2 * per_head, per_head):  # batch chunks, then head chunks
        monkeypatch.setattr(_attention, "INT32_LIMIT", limit)
        chunks = _attention.int32_chunks((q, k, v), per_head)
        assert len(chunks) > 1
        for m, w in zip((full_map, shared_map), want):
            assert torch.equal(block_sparse_attention_triton(q, k, v, m, block_size=64, fp8=fp8), w)
        assert torch.equal(block_mass_triton(q, k, block_size=64, sample_rows=4), want_mass)
    monkeypatch.setattr(_attention, "INT32_LIMIT", 100)
    with pytest.raises(ValueError, match="32-bit"):
        _attention.int32_chunks((q, k, v), per_head)


@pytest.mark.parametrize("fp8", [False, True])
def test_output_is_written_in_the_callers_layout(fp8):
    """q/k/v as ComfyUI passes them ([B, L, H * D] viewed as [B, H, L, D]): the output lives in
    [B, L, H, D] memory, so the host's ``transpose(1, 2).reshape(B, L, H * D)`` is a view, not a copy;
    contiguous inputs get a contiguous output. Both equal the same computation."""
    bm = random_map(2, 3, 200, 200, 64, 0.5, seed=5)
    q, k, v = make_inputs(2, 3, 200, 64, torch.bfloat16, seed=6, layout="blhd")
    out = block_sparse_attention_triton(q, k, v, bm, block_size=64, fp8=fp8)
    flat = out.transpose(1, 2).reshape(2, 200, 3 * 64)
    assert flat.data_ptr() == out.data_ptr() and flat.is_contiguous()
    contiguous = block_sparse_attention_triton(*(t.contiguous() for t in (q, k, v)), bm, block_size=64, fp8=fp8)
    assert contiguous.is_contiguous()
    torch.testing.assert_close(out, contiguous, rtol=0, atol=0)


@pytest.mark.parametrize("fp8,q_in_kernel", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("length,bs,layout", [(300, 64, "blhd"), (97, 32, "bhld")])
def test_token_perm_runs_the_reordered_sequence(fp8, q_in_kernel, length, bs, layout):
    """``token_perm``: the kernel computes attention of the reordered sequence with the map in that
    order and writes rows back in input order -- i.e. ``out[:, :, perm]`` is the attention of
    ``(q, k, v)[:, :, perm]``, held to the same bound as an unpermuted call."""
    from chorus.kernels.triton._attention import DEFAULT_TILES, block_sparse_attention_triton_impl

    q, k, v = make_inputs(1, 2, length, 64, torch.bfloat16, seed=length + bs, layout=layout)
    perm = torch.randperm(length, generator=torch.Generator().manual_seed(bs))
    bm = random_map(1, 2, length, length, bs, 0.4, seed=length)
    config = dataclasses.replace(DEFAULT_TILES["fp8" if fp8 else "bf16"], q_in_kernel=q_in_kernel)
    out = block_sparse_attention_triton_impl(q, k, v, bm, bs, 1 / math.sqrt(64), fp8, config=config, token_perm=perm)
    assert out.shape == q.shape
    qp, kp, vp = (t[:, :, perm] for t in (q, k, v))
    (check_fp8 if fp8 else check_16bit)(out[:, :, perm], qp, kp, vp, bm, bs)
    # exactly the call on the reordered sequence (FP8: K's smoothing rows are taken in that order too)
    plain = block_sparse_attention_triton_impl(qp, kp, vp, bm, bs, 1 / math.sqrt(64), fp8, config=config)
    torch.testing.assert_close(out[:, :, perm], plain, rtol=0, atol=0)


@pytest.mark.parametrize("length,bs", [(300, 64), (97, 32), (256, 128)])
def test_fp8_q_quantised_in_the_kernel(length, bs):
    """Q quantised on load by the attention kernel (per query tile) instead of the pre-pass: the same
    FP8 error bound."""
    from chorus.kernels.triton._attention import DEFAULT_TILES, block_sparse_attention_triton_impl

    q, k, v = make_inputs(1, 2, length, 64, torch.bfloat16, seed=3 * length, layout="blhd")
    bm = random_map(1, 2, length, length, bs, 0.5, seed=bs + 2)
    config = dataclasses.replace(DEFAULT_TILES["fp8"], q_in_kernel=True)
    out = block_sparse_attention_triton_impl(q, k, v, bm, bs, 1 / math.sqrt(64), True, config=config)
    check_fp8(out, q, k, v, bm, bs)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batch,heads,length,bs,broadcast", [(1, 3, 300, 64, False), (2, 2, 97, 32, True)])
def test_persistent_grid_walks_every_tile(fp8, batch, heads, length, bs, broadcast):
    """The persistent launch (a fixed grid striding over (batch, head)-major tiles; 4 programs under the
    interpreter, fewer than the tiles) computes the same function as one program per tile."""
    from chorus.kernels.triton._attention import DEFAULT_TILES, block_sparse_attention_triton_impl

    q, k, v = make_inputs(batch, heads, length, 64, torch.bfloat16, seed=length + bs, layout="blhd")
    bm = random_map(1 if broadcast else batch, 1 if broadcast else heads, length, length, bs, 0.4, seed=bs)
    config = dataclasses.replace(DEFAULT_TILES["fp8" if fp8 else "bf16"], persistent=True)
    out = block_sparse_attention_triton_impl(q, k, v, bm, bs, 1 / math.sqrt(64), fp8, config=config)
    full = bm.expand(batch, heads, *bm.shape[-2:])
    (check_fp8 if fp8 else check_16bit)(out, q, k, v, full, bs)
    plain = block_sparse_attention_triton_impl(q, k, v, bm, bs, 1 / math.sqrt(64), fp8)
    assert torch.equal(out, plain)


def test_token_perm_bad_input_raises():
    from chorus.kernels.triton._attention import block_sparse_attention_triton_impl

    q, k, v = make_inputs(1, 2, 100, 64, torch.bfloat16, seed=0)
    bm = torch.ones(1, 2, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="token_perm"):
        block_sparse_attention_triton_impl(q, k, v, bm, 32, 0.125, True, token_perm=torch.arange(99))
    with pytest.raises(ValueError, match="token_perm"):
        block_sparse_attention_triton_impl(q, k, v, bm, 32, 0.125, True, token_perm=torch.arange(100.0))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("suffix_len", [0, 60])
def test_token_perm_with_prefix_bias(fp8, suffix_len):
    """With ``token_perm`` the prefix (and the suffix) count positions of the reordered sequence (a tile order
    puts the first frame first; a region order of an odd frame count the last frame last): the same as the
    biased call on the reordered inputs."""
    from chorus.kernels.triton._attention import block_sparse_attention_triton_impl

    q, k, v = make_inputs(1, 2, 200, 64, torch.bfloat16, seed=21)
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(5))
    bm = random_map(1, 2, 200, 200, 64, 0.5, seed=9)
    biases = dict(prefix_len=70, prefix_bias=1.3, suffix_len=suffix_len, suffix_bias=0.9 if suffix_len else 0.0)
    out = block_sparse_attention_triton_impl(q, k, v, bm, 64, 0.125, fp8, token_perm=perm, **biases)
    qp, kp, vp = (t[:, :, perm] for t in (q, k, v))
    (check_fp8 if fp8 else check_16bit)(out[:, :, perm], qp, kp, vp, bm, 64, **biases)


@pytest.mark.parametrize("backend", ["triton_fp8", "triton_bf16"])
def test_api_tile_order_on_triton_matches_reference(backend):
    """The API's routing with a ``TileOrder``: the Triton backends (order fused into the kernels) agree
    with the reference backend (gather, run, scatter) on the same map of the tile order. (The public
    function refuses CPU tensors for Triton backends, so its backend call is made directly.)"""
    from chorus import kernels
    from chorus.kernels.api import Backend, _run_attention
    from chorus.kernels.tile_order import TileOrder, resolve_token_perm

    order = TileOrder((3, 5, 12), block_size=32)  # 180 tokens: partial tiles at every edge
    q, k, v = make_inputs(1, 2, order.length, 64, torch.bfloat16, seed=31, layout="blhd")
    bm = random_map(1, 2, order.length, order.length, 32, 0.5, seed=3)
    ref = kernels.block_sparse_attention(q, k, v, bm, block_size=32, backend="reference", token_perm=order)
    out = _run_attention(Backend(backend), q, k, v, bm, 32, 1 / math.sqrt(64), 0, 0.0,
                         resolve_token_perm(order, order.length, q.device))
    perm = order.perm
    qp, kp, vp = (t[:, :, perm] for t in (q, k, v))
    check_16bit(ref[:, :, perm], qp, kp, vp, bm, 32)
    (check_fp8 if backend == "triton_fp8" else check_16bit)(out[:, :, perm], qp, kp, vp, bm, 32)


@pytest.mark.parametrize("shape,density", [((1, 3, 591, 591), 0.05), ((1, 1, 591, 591), 1.0), ((2, 2, 37, 3), 0.5),
                                           ((1, 2, 24, 1500), 0.1), ((1, 1, 5, 5), 0.0)])
def test_block_lists_and_their_lpt_order_match_torch(shape, density):
    """``lpt_block_lists``: per map row the kept key blocks in ascending order and their count, and per
    map (b, h) the query blocks by count, most first, ties in block order (torch's stable argsort);
    partial chunks, broadcast dims, empty rows."""
    from chorus.kernels.triton._attention import lpt_block_lists

    gen = torch.Generator().manual_seed(sum(shape))
    bm = torch.rand(*shape, generator=gen) < density
    kv_num, kv_idx, sched, _ = lpt_block_lists(bm)
    assert torch.equal(kv_num.long(), bm.sum(-1))
    for row in zip(*[i.flatten() for i in torch.meshgrid(*[torch.arange(n) for n in shape[:3]], indexing="ij")]):
        n = int(kv_num[row])
        assert torch.equal(kv_idx[row][:n].long(), torch.nonzero(bm[row]).flatten())
    assert torch.equal(sched.long(), torch.argsort(bm.sum(-1), dim=-1, descending=True, stable=True))


# ---- the pooled tail (pooled_tail=True): every key block a row skips enters its softmax as one pooled term

TAIL_CASES = [  # (fp8, batch, heads, q_len, kv_len, block_size, map broadcast)
    (False, 1, 2, 300, 300, 64, False), (True, 1, 2, 300, 300, 64, False),  # partial last block, 64-key tiles
    (True, 1, 2, 97, 97, 32, False),      # 4 blocks, the last of 1 key
    (False, 2, 2, 300, 300, 128, True), (True, 2, 2, 300, 300, 128, True),  # batch 2 with a broadcast map
    (True, 1, 1, 600, 600, 256, False),   # blocks of two 128-key tiles
    (False, 1, 2, 150, 260, 64, False),   # cross-attention lengths
]


def _tail_map(batch, heads, q_len, kv_len, bs, seed):
    bm = random_map(batch, heads, q_len, kv_len, bs, 0.3, seed)
    bm[..., 0, :] = True  # a row that keeps every block (no tail term)
    return bm


@pytest.mark.parametrize("fp8,batch,heads,q_len,kv_len,bs,broadcast", TAIL_CASES)
def test_pooled_tail_matches_oracle(fp8, batch, heads, q_len, kv_len, bs, broadcast):
    """The tail against the fp64 oracle: bf16 within 2 x eager bf16's error, FP8 within the FP8 bounds;
    the tail acts (the output moves away from the map-only oracle)."""
    q, k, v = make_inputs(batch, heads, q_len, 64, torch.bfloat16, seed=q_len + bs, kv_len=kv_len)
    bm = _tail_map(1 if broadcast else batch, 1 if broadcast else heads, q_len, kv_len, bs, seed=bs)
    out = block_sparse_attention_triton(q, k, v, bm, block_size=bs, fp8=fp8, pooled_tail=True)
    (check_fp8 if fp8 else check_16bit)(out, q, k, v, bm, bs, pooled_tail=True)
    plain = dense_attention_oracle(q, k, v, bm, bs)
    assert (out.double() - plain).abs().max() > 0.05


@pytest.mark.parametrize("fp8", [False, True])
def test_pooled_tail_with_key_biases_matches_oracle(fp8):
    """The key biases enter each pooled block's weight (log-sum-exp of its keys' biases), prefix and suffix
    overlapping inside one block."""
    q, k, v = make_inputs(1, 2, 300, 64, torch.bfloat16, seed=41)
    bm = _tail_map(1, 2, 300, 300, 64, seed=7)
    biases = dict(prefix_len=150, prefix_bias=1.3, suffix_len=170, suffix_bias=math.log(8))
    out = block_sparse_attention_triton(q, k, v, bm, block_size=64, fp8=fp8, pooled_tail=True, **biases)
    (check_fp8 if fp8 else check_16bit)(out, q, k, v, bm, 64, pooled_tail=True, **biases)
    unbiased_tail = dense_attention_oracle(q, k, v, bm, 64, pooled_tail=True)
    assert (out.double() - unbiased_tail).abs().max() > 0.05


@pytest.mark.parametrize("fp8,q_in_kernel", [(False, False), (True, False), (True, True)])
def test_pooled_tail_in_a_token_order_is_the_reordered_call(fp8, q_in_kernel):
    """With ``token_perm`` the pooled blocks are those of the permuted order (FP8: the pre-pass's fused
    gather; bf16: the gathered copies): exactly the tail call on the reordered inputs."""
    from chorus.kernels.triton._attention import DEFAULT_TILES, block_sparse_attention_triton_impl

    q, k, v = make_inputs(1, 2, 300, 64, torch.bfloat16, seed=43, layout="blhd")
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(3))
    bm = _tail_map(1, 2, 300, 300, 64, seed=9)
    config = dataclasses.replace(DEFAULT_TILES["fp8" if fp8 else "bf16"], q_in_kernel=q_in_kernel)
    out = block_sparse_attention_triton_impl(q, k, v, bm, 64, 0.125, fp8, config=config, token_perm=perm,
                                             pooled_tail=True)
    qp, kp, vp = (t[:, :, perm] for t in (q, k, v))
    (check_fp8 if fp8 else check_16bit)(out[:, :, perm], qp, kp, vp, bm, 64, scale=0.125, pooled_tail=True)
    plain = block_sparse_attention_triton_impl(qp, kp, vp, bm, 64, 0.125, fp8, config=config, pooled_tail=True)
    torch.testing.assert_close(out[:, :, perm], plain, rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [True])
def test_pooled_tail_on_the_persistent_grid_and_rows_that_keep_nothing(fp8):
    """The persistent launch walks the tiles with their pooled blocks counted; a row that keeps no block
    attends to its pooled terms only (the oracle's value: the public API rejects such maps unless
    ``rows_checked``)."""
    from chorus.kernels.triton._attention import DEFAULT_TILES, block_sparse_attention_triton_impl

    q, k, v = make_inputs(2, 2, 300, 64, torch.bfloat16, seed=47, layout="blhd")
    bm = _tail_map(2, 2, 300, 300, 64, seed=11)
    bm[1, 0, 2] = False  # a row that keeps nothing
    config = dataclasses.replace(DEFAULT_TILES["fp8" if fp8 else "bf16"], persistent=True)
    out = block_sparse_attention_triton_impl(q, k, v, bm, 64, 0.125, fp8, config=config, pooled_tail=True)
    (check_fp8 if fp8 else check_16bit)(out, q, k, v, bm, 64, scale=0.125, pooled_tail=True)
    plain = block_sparse_attention_triton_impl(q, k, v, bm, 64, 0.125, fp8, pooled_tail=True)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("fp8", [True])
def test_pooled_tail_in_int32_chunks_matches_one_launch(fp8, monkeypatch):
    """(batch, head) chunks count the pooled rows too and build each chunk's lists and bias table."""
    from chorus.kernels.triton import _attention

    q, k, v = make_inputs(2, 3, 150, 64, torch.bfloat16, seed=53)
    bm = random_map(2, 3, 150, 150, 64, 0.4, seed=3)
    want = block_sparse_attention_triton(q, k, v, bm, block_size=64, fp8=fp8, pooled_tail=True)
    monkeypatch.setattr(_attention, "INT32_LIMIT", (256 + 128) * 64)  # one (b, h) with its pooled rows
    assert torch.equal(block_sparse_attention_triton(q, k, v, bm, block_size=64, fp8=fp8, pooled_tail=True), want)


@pytest.mark.parametrize("v_key_order", ["natural", "wgmma"])
@pytest.mark.parametrize("length,bs", [(300, 128), (300, 64), (600, 256)])
def test_fp8_prepass_writes_the_pooled_rows(v_key_order, length, bs):
    """The pre-pass's pooled rows (block means of smoothed K and of V after ``Lpad_k``, quantised with their
    own K tile scale and V's per-channel scales, in V's key order) against the torch twin; the real rows unchanged."""
    from chorus.kernels.triton._quant import quantize_qkv_fp8, quantize_reference, tail_rows

    q, k, v = make_inputs(1, 2, length, 64, torch.bfloat16, seed=length + bs)
    got = quantize_qkv_fp8(q, k, v, 0.125, v_key_order=v_key_order, pool_block=bs)
    want = quantize_reference(q, k, v, 0.125, v_key_order=v_key_order, pool_block=bs)
    plain = quantize_qkv_fp8(q, k, v, 0.125, v_key_order=v_key_order)
    lpad = plain[1].shape[2]
    assert got[1].shape[2] == lpad + tail_rows(length, bs) and got[2].shape[-1] == got[1].shape[2]
    for name, a, b in zip(("q8", "k8", "v8t", "q_scale", "k_scale", "v_scale"), got, want):
        assert a.shape == b.shape, name
        diff = (a.float() - b.float()).abs()
        tol = 1e-5 * max(1.0, b.float().abs().max().item()) if a.dtype == torch.float32 else 32.0
        assert diff.max().item() <= tol, (name, diff.max().item())
        if a.dtype != torch.float32:
            assert (diff > 0).float().mean().item() < 0.01, name
    assert torch.equal(got[1][:, :, :lpad].view(torch.uint8), plain[1].view(torch.uint8))
    assert torch.equal(got[2][..., :lpad].view(torch.uint8), plain[2].view(torch.uint8))
    blocks = -(-length // bs)
    assert got[1][:, :, lpad + blocks:].float().abs().max() == 0  # past the last block: zeros


@pytest.mark.parametrize("length,bs,layout", [(300, 64, "blhd"), (97, 32, "bhld"), (600, 256, "bhld")])
def test_16bit_pooled_keys_and_values_are_block_means(length, bs, layout):
    from chorus.kernels.reference import pooled_key_blocks
    from chorus.kernels.triton._quant import pooled_kv_16bit, tail_rows

    _, k, v = make_inputs(1, 2, length, 64, torch.bfloat16, seed=length, layout=layout)
    kp, vp = pooled_kv_16bit(k, v, bs)
    kbar, vbar = pooled_key_blocks(k.double(), v.double(), bs)
    blocks = kbar.shape[2]
    assert kp.shape == (1, 2, tail_rows(length, bs), 64) and kp.dtype == torch.bfloat16
    for got, want in ((kp, kbar), (vp, vbar)):
        err = (got[:, :, :blocks].double() - want).abs().max().item()
        assert err <= torch.finfo(torch.bfloat16).eps * want.abs().max().item(), err
        assert got[:, :, blocks:].abs().max() == 0


@pytest.mark.parametrize("shape,density,kv_len,bs", [((1, 3, 20, 300), 0.1, 38400, 128), ((2, 2, 37, 3), 0.5, 300, 128),
                                                      ((1, 1, 5, 5), 1.0, 600, 128), ((1, 2, 9, 10), 0.3, 300, 32)])
def test_tail_block_lists_and_bias_table_match_torch(shape, density, kv_len, bs):
    """``lpt_block_lists`` with the tail: after each row's kept blocks, ``pool_first + p`` for every pooled
    tile ``p`` (128 blocks) holding a block the row skips; the bias table = the block's weight in log2 units
    (:func:`~chorus.kernels.reference.pooled_log_weights`, prefix and suffix biases) where skipped, -inf where
    kept and past the last block; the LPT order counts the pooled tiles."""
    from chorus.kernels.reference import pooled_log_weights
    from chorus.kernels.triton._attention import lpt_block_lists, tail_spec

    gen = torch.Generator().manual_seed(sum(shape))
    bm = torch.rand(*shape, generator=gen) < density
    prefix_len, prefix_bias, suffix_len, suffix_bias = 200, 0.8, 150, -0.5
    tail = tail_spec(kv_len, bs, 77, prefix_len, prefix_bias, kv_len - suffix_len, suffix_bias)
    kv_num, kv_idx, sched, strides, lists = lpt_block_lists(bm, tail)
    kb = shape[3]
    tiles = -(-kb // 128)
    assert lists.tiles == tiles and kv_idx.shape[-1] == kb + tiles and strides[-1] == kb + tiles
    weights = pooled_log_weights(kv_len, bs, prefix_len, prefix_bias, suffix_len, suffix_bias) / math.log(2)
    want_bias = torch.full((*shape[:3], tiles * 128), float("-inf"), dtype=torch.float64)
    want_bias[..., :kb] = torch.where(bm, float("-inf"), weights[:kb])
    torch.testing.assert_close(lists.bias.double(), want_bias, rtol=1e-6, atol=1e-6)
    skipped_tiles = torch.nn.functional.pad(~bm, (0, tiles * 128 - kb)).view(*shape[:3], tiles, 128).any(-1)
    assert torch.equal(kv_num.long(), bm.sum(-1)) and torch.equal(lists.tail_num.long(), skipped_tiles.sum(-1))
    for row in zip(*[i.flatten() for i in torch.meshgrid(*[torch.arange(n) for n in shape[:3]], indexing="ij")]):
        n, m = int(kv_num[row]), int(lists.tail_num[row])
        assert torch.equal(kv_idx[row][:n].long(), torch.nonzero(bm[row]).flatten())
        assert torch.equal(kv_idx[row][n:n + m].long(), 77 + torch.nonzero(skipped_tiles[row]).flatten())
    cost = bm.sum(-1) + skipped_tiles.sum(-1)
    assert torch.equal(sched.long(), torch.argsort(cost, dim=-1, descending=True, stable=True))


def test_tail_op_traces_with_fake_tensors():
    q, k, v = make_inputs(1, 2, 64, 64, torch.bfloat16, seed=1)
    bm = torch.tensor([[True, False], [False, True]]).view(1, 1, 2, 2)
    torch.library.opcheck(torch.ops.chorus.block_sparse_attention_triton,
                          (q, k, v, bm, 32, 0.125, False, 0, 0.0, None, 0, 0.0, True),
                          test_utils=("test_schema", "test_faketensor"))

    def fn(q, k, v, bm):
        return block_sparse_attention_triton(q, k, v, bm, block_size=32, fp8=True, pooled_tail=True)

    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, bm)
    assert torch.equal(out, fn(q, k, v, bm))


@pytest.mark.parametrize("length,biases", [(600, dict(prefix_len=200, prefix_bias=0.9, suffix_len=150,
                                                      suffix_bias=math.log(8)))])
def test_warp_specialised_tail_inputs_walked_like_the_kernel_give_the_oracle(length, biases):
    """What ``launch_ws`` hands the Gluon kernel with the tail (its pre-pass with V in the wgmma key order
    and the pooled rows, its block lists with pooled tile ``p`` listed as key block ``Lpad / 128 + p``, the
    bias table), consumed in torch the way the kernel does per tile -- K rows / scale of block ``kb``, V^T
    columns ``kb * 128 + wgmma order``, the table's ``bias / sc`` added to ``S`` on pooled tiles only, the
    prefix / suffix biases on the others, the partial last block masked -- is the tail's attention within
    the FP8 bounds of the oracle (the Gluon kernel itself: ``test_kernels_ws_gpu.py``)."""
    from chorus.kernels.triton._attention import lpt_block_lists, tail_spec
    from chorus.kernels.triton._quant import LOG2E, padded_len, quantize_qkv_fp8, wgmma_key_order_torch

    q, k, v = make_inputs(1, 2, length, 64, torch.bfloat16, seed=length + len(biases))
    bm = _tail_map(1, 2, length, length, 128, seed=13)
    scale = 0.125
    prefix_len, prefix_bias = biases.get("prefix_len", 0), biases.get("prefix_bias", 0.0)
    suffix_start = length - biases.get("suffix_len", 0)
    suffix_bias = biases.get("suffix_bias", 0.0)
    _, k8, v8t, _, k_scale, v_scale = quantize_qkv_fp8(q, k, v, scale, quantize_q=False, v_key_order="wgmma",
                                                       pool_block=128)
    pool_first = padded_len(length) // 128
    kv_num, kv_idx, sched, strides, lists = lpt_block_lists(
        bm, tail_spec(length, 128, pool_first, prefix_len, prefix_bias, suffix_start, suffix_bias))
    key_bias = torch.zeros(padded_len(length))
    key_bias[:prefix_len] += prefix_bias
    key_bias[suffix_start:length] += suffix_bias
    cols = wgmma_key_order_torch(torch.arange(128))
    out = torch.empty(1, 2, length, 64, dtype=torch.float64)
    for h in range(2):
        v_unit = v_scale[0, h]  # per-channel scale
        for qb in range(bm.shape[2]):
            rows = slice(qb * 128, min((qb + 1) * 128, length))
            s_parts, v_parts = [], []
            n = int(kv_num[0, h, qb]) + int(lists.tail_num[0, h, qb])
            for kb in kv_idx[0, h, qb, :n].tolist():
                sk = k_scale[0, h, kb]
                s_blk = q[0, h, rows].float() * (scale * LOG2E) @ (k8[0, h, kb * 128:(kb + 1) * 128].float() * sk).T
                if kb >= pool_first:  # a pooled tile: its keys' terms from the bias table
                    p = kb - pool_first
                    s_blk = s_blk + lists.bias[0, h, qb, p * 128:(p + 1) * 128]
                else:
                    s_blk = s_blk + key_bias[kb * 128:(kb + 1) * 128] * LOG2E
                    s_blk[:, (kb * 128 + torch.arange(128)) >= length] = float("-inf")
                vt = v8t[0, h, :, kb * 128:(kb + 1) * 128].float()[:, cols]  # key n at column wgmma_order(n)
                s_parts.append(s_blk)
                v_parts.append(vt.T * v_unit)
            probs = torch.softmax(torch.cat(s_parts, 1).double() / LOG2E, dim=1)
            out[0, h, rows] = probs @ torch.cat(v_parts).double()
    check_fp8(out.to(q.dtype), q, k, v, bm, 128, scale=scale, pooled_tail=True, **biases)
    assert torch.equal(sched.long(), torch.argsort(kv_num + lists.tail_num, dim=-1, descending=True, stable=True))


# ------------------------------------------------------------------------------ the accurate INT8 path
# Yardstick: the fp64 emulation of the same numerics (chorus.kernels.triton.emulation.int8_attention_emulation);
# the kernel's relative L2 error against the fp64 oracle <= 1.25 x the emulation's + 0.002, and below half the
# FP8 emulation's. The pre-pass against its fp64 twin: codes and V sums within 1 (fp32 vs fp64 at a tie).

INT8_CASES = [  # (heads, q_len, kv_len, dim, density, pooled_tail, biases, layout)
    (2, 300, 300, 64, 0.5, False, {}, "bhld"),
    (2, 300, 300, 128, 0.5, True, dict(prefix_len=100, prefix_bias=1.2), "blhd"),
    (1, 97, 260, 64, 1.0, False, dict(suffix_len=40, suffix_bias=0.8), "bhld"),
    (2, 256, 256, 64, 0.3, True, dict(prefix_len=130, prefix_bias=-0.6, suffix_len=60, suffix_bias=0.5), "bhld"),
]


@pytest.mark.parametrize("heads,q_len,kv_len,dim,density,pooled_tail,biases,layout", INT8_CASES)
def test_int8_kernel_within_its_emulation_bound(heads, q_len, kv_len, dim, density, pooled_tail, biases, layout):
    from chorus.kernels.triton._attention import block_sparse_attention_triton_impl
    from chorus.kernels.triton.emulation import int8_attention_emulation

    q, k, v = make_inputs(1, heads, q_len, dim, torch.bfloat16, seed=q_len + dim, kv_len=kv_len, layout=layout)
    bm = random_map(1, heads, q_len, kv_len, 128, density, seed=3)
    scale = 1 / math.sqrt(dim)
    out = block_sparse_attention_triton_impl(q, k, v, bm, 128, scale, False, pooled_tail=pooled_tail, int8=True,
                                             **biases)
    oracle = dense_attention_oracle(q, k, v, bm, 128, pooled_tail=pooled_tail, **biases)

    def rel(x):
        return ((x.double() - oracle).norm() / oracle.norm()).item()

    ours = rel(out)
    yardstick = rel(int8_attention_emulation(q, k, v, bm, 128, pooled_tail=pooled_tail, **biases))
    fp8 = rel(sage_fp8_attention_emulation(q, k, v, bm, 128, pooled_tail=pooled_tail, **biases))
    assert out.dtype == q.dtype and out.shape == q.shape and torch.isfinite(out).all()
    assert ours <= 1.25 * yardstick + 0.002, (ours, yardstick)
    assert ours < 0.5 * fp8, (ours, fp8)


@pytest.mark.parametrize("length,pool_block,v_key_order", [(300, None, "natural"), (300, 128, "natural"),
                                                           (260, 128, "natural"), (260, 128, "wgmma"),
                                                           (300, None, "wgmma")])
def test_int8_prepass_matches_its_fp64_twin(length, pool_block, v_key_order):
    from chorus.kernels.triton._quant_int8 import quantize_int8_reference, quantize_qkv_int8

    q, k, v = make_inputs(1, 2, length, 64, torch.bfloat16, seed=length)
    ours = quantize_qkv_int8(q, k, v, 0.125, pool_block=pool_block, v_key_order=v_key_order)
    ref = quantize_int8_reference(q, k, v, 0.125, pool_block=pool_block, v_key_order=v_key_order)
    for a, b in zip(ours, ref):
        if b is None:
            assert a is None
        elif a.dtype == torch.int8:
            assert a.shape == b.shape and (a.int() - b.int()).abs().max().item() <= 1
        elif a.dtype == torch.float32:
            assert torch.allclose(a, b, rtol=1e-5, atol=0)
    v8t, v_sums = ours[2], ours[6]  # the V sums are those of the kernel's own codes, exactly
    assert torch.equal(v_sums, v8t.int().view(*v8t.shape[:3], -1, 128).sum(-1).transpose(-1, -2))


def test_int8_token_order_runs_the_reordered_sequence():
    from chorus.kernels.triton._attention import block_sparse_attention_triton_impl

    q, k, v = make_inputs(1, 2, 300, 64, torch.bfloat16, seed=11)
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(2))
    bm = random_map(1, 2, 300, 300, 128, 0.5, seed=4)
    out = block_sparse_attention_triton_impl(q, k, v, bm, 128, 0.125, False, token_perm=perm, pooled_tail=True,
                                             int8=True)
    qp, kp, vp = (t[:, :, perm] for t in (q, k, v))
    plain = block_sparse_attention_triton_impl(qp, kp, vp, bm, 128, 0.125, False, pooled_tail=True, int8=True)
    back = torch.empty_like(plain)
    back[:, :, perm] = plain
    # the same numerics on the same sequence; only the K smoothing rows differ with the order (<= 300 rows: none)
    assert torch.allclose(out.float(), back.float(), atol=2e-2, rtol=0)


def test_int8_rejects_other_block_sizes_and_fp8_together():
    from chorus.kernels.triton._attention import block_sparse_attention_triton_impl

    q, k, v = make_inputs(1, 1, 128, 64, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="128-token blocks"):
        block_sparse_attention_triton_impl(q, k, v, torch.ones(1, 1, 2, 2, dtype=torch.bool), 64, 0.125, False,
                                           int8=True)
    with pytest.raises(ValueError, match="128-token blocks"):
        block_sparse_attention_triton_impl(q, k, v, torch.ones(1, 1, 1, 1, dtype=torch.bool), 128, 0.125, True,
                                           int8=True)


@pytest.mark.parametrize("numerics,floor", [("16-bit", 0.002), ("fp8", 0.03), ("int8", 0.008)])
def test_the_portable_kernels_first_use_probe_passes_each_numerics(numerics, floor):
    """What auto's resolution runs once per (device, dtype, head dim, numerics) before it takes a portable
    Triton backend on a GPU: the kernel on Gaussian inputs, its error under the numerics' ceiling (and not
    suspiciously low: each numerics' own rounding shows)."""
    from chorus.kernels.reference import NUMERICS_CEILINGS
    from chorus.kernels.triton import check_portable_kernel

    like = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    error = check_portable_kernel(like, numerics)
    assert floor < error <= NUMERICS_CEILINGS[numerics], (numerics, error)


def _swap_rows_of(module, name, monkeypatch) -> list:
    """Make ``module.name`` a kernel that computes wrong (its output's rows in reverse order) and forget earlier
    probes; returns the list each call of it appends to."""
    real, calls = getattr(module, name), []

    def wrong(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs).flip(2)

    from chorus.kernels import probe

    monkeypatch.setattr(probe, "_PROBED", {})
    monkeypatch.setattr(module, name, wrong)
    return calls


def test_a_portable_kernel_that_computes_wrong_is_a_reason_found_once(monkeypatch):
    """A kernel that builds and runs but computes wrong (here: each row another's output) is unavailable, with
    the error in the reason, asked once per key; a kernel that raises likewise."""
    import chorus.kernels.triton as T

    calls = _swap_rows_of(T, "block_sparse_attention_triton", monkeypatch)
    like = torch.empty(1, 1, 1, 64, dtype=torch.float16)
    reason = T.portable_unavailable(like, "16-bit")
    assert reason is not None and "the Triton 16-bit kernel" in reason and "computes wrong: relative error" in reason
    assert T.portable_unavailable(like, "16-bit") == reason and len(calls) == 1

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(T, "block_sparse_attention_triton", broken)
    reason = T.portable_unavailable(like, "fp8")
    assert "does not build or run here (RuntimeError: no kernel image" in reason


def test_the_block_mass_kernels_first_use_probe_passes_and_a_wrong_one_is_a_reason(monkeypatch):
    """What a miss's first block-mass resolution on a GPU runs (a kernel that computes wrong would write wrong
    maps into the cache): the kernel's masses match the reference's far under the ceiling; a kernel that computes
    wrong (each query block's row another's) is unavailable with the difference in the reason, asked once."""
    import chorus.kernels.triton as T
    from chorus.kernels.reference import BLOCK_MASS_CEILING

    like = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    assert T.check_block_mass_kernel(like) <= BLOCK_MASS_CEILING / 100
    calls = _swap_rows_of(T, "block_mass_triton", monkeypatch)
    reason = T.block_mass_unavailable(like)
    assert reason is not None and "the Triton block-mass kernel" in reason and "computes wrong: block masses" in reason
    assert T.block_mass_unavailable(like) == reason and len(calls) == 1
