"""The warp-specialised Gluon FP8 kernel on an sm_90 GPU (skipped elsewhere): the bounds of the Triton
FP8 path (``test_triton_gpu.py``) against the fp64 oracle on whole query blocks (first, middle, partial
last): relative L1 and cosine deficit <= 2 x those of the SageAttention-style FP8 emulation, cosine
>= 0.998; at awkward lengths, head dims 64 / 128, densities 3-100%, Q from its input rows (the default)
and from the pre-pass (a q no TMA descriptor can address), ComfyUI's [B, L, H, D] memory with a
broadcast map and batch 2, rows that keep no block, the prefix bias (ChorusGuidanceBoost's first-frame
weight, Wan's frame sizes as prefixes, not multiples of 128), agreement with the Triton FP8 kernel
(same pre-pass, same scales, with and without the bias), and the public API (auto's choice on sm_90, a
prefix-bias call taken by this kernel, torch.compile); the pooled tail (``-k tail``: both Q sources,
structured maps at Wan lengths, spread and sharp attention, key biases, layouts, token order, the API), in
both of the kernel's forms where a test takes ``tail_form``: the pooled tiles in the kept blocks' loop
(Triton's own ptxas) and in a loop of their own (the fixed ptxas ``chorus.kernels.triton._ptxas`` finds;
skipped where there is none)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from testing import check_pooled_tail, cuda_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                       reason="the warp-specialised kernel is built for sm_90"),
]

SCALE = 128 ** -0.5
# cosine floor of this kernel against triton_fp8: the two round P and Q's scales their own way, each within
# the FP8 bounds of the oracle (_check)
AGREEMENT_FLOOR = 0.998
Q_SOURCES = ("kernel", "prepass")


def _q_from(q, source):
    """``q`` as the kernel takes it from ``source``: ``"kernel"`` as it is (its input rows by TMA), ``"prepass"``
    the same values in a view no TMA descriptor can address (rows 8 bytes longer), so the pre-pass
    quantises Q."""
    if source == "kernel":
        return q
    wide = torch.zeros(*q.shape[:-1], q.shape[-1] + 4, dtype=q.dtype, device=q.device)
    wide[..., :q.shape[-1]] = q
    return wide[..., :q.shape[-1]]


@pytest.fixture(params=["one_loop", "pooled_loop"])
def tail_form(request, monkeypatch):
    """The FP8 kernel's form with the tail for this test: ``one_loop`` (``CHORUS_PTXAS=triton``) or
    ``pooled_loop`` (the fixed ptxas's; skipped without one). The choice is made again on entry and on exit."""
    from chorus.kernels.triton import _ptxas

    if request.param == "one_loop":
        monkeypatch.setenv(_ptxas.ENV_PTXAS, "triton")
    else:
        monkeypatch.delenv(_ptxas.ENV_PTXAS, raising=False)
    _ptxas.reset()
    if request.param == "pooled_loop" and _ptxas.fixed_ptxas() is None:
        pytest.skip(_ptxas.describe())
    if request.param == "one_loop" and _ptxas.pooled_loop_right(_ptxas.triton_ptxas()):
        pytest.skip(f"Triton's own ptxas builds the pooled loop too: {_ptxas.describe()}")
    yield request.param
    _ptxas.reset()


def _random_map(batch, heads, length, density, seed):
    nb = -(-length // 128)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bm = torch.rand(batch, heads, nb, nb, device="cuda", generator=gen) < density
    bm[..., torch.arange(nb), torch.arange(nb)] = True
    return bm


def _check(out, q, k, v, bm, prefix_len=0, prefix_bias=0.0, suffix_len=0, suffix_bias=0.0):
    from chorus.kernels.reference import dense_attention_oracle
    from chorus.kernels.triton.emulation import error_stats, sage_fp8_attention_emulation

    nqb = bm.shape[2]
    blocks = sorted({0, nqb // 2, nqb - 1})
    rows = torch.cat([torch.arange(b * 128, min((b + 1) * 128, q.shape[2]), device="cuda") for b in blocks])
    sub_map = bm[:, :, blocks]
    q_sub = q[:, :, rows]
    biases = dict(prefix_len=prefix_len, prefix_bias=prefix_bias, suffix_len=suffix_len, suffix_bias=suffix_bias)
    oracle = dense_attention_oracle(q_sub, k, v, sub_map, 128, **biases)
    ours = error_stats(out[:, :, rows], oracle)
    sage = error_stats(sage_fp8_attention_emulation(q_sub, k, v, sub_map, 128, **biases), oracle)
    assert torch.isfinite(out).all()
    assert ours["rel_l1"] <= 2 * sage["rel_l1"], (ours, sage)
    assert 1 - ours["cosine"] <= 2 * (1 - sage["cosine"]), (ours, sage)
    assert ours["cosine"] >= 0.998, ours


@pytest.mark.parametrize("length,dim", [(1000, 128), (4097, 128), (4097, 64), (32760, 128)])
@pytest.mark.parametrize("density", [0.03, 0.3, 1.0])
@pytest.mark.parametrize("q_source", Q_SOURCES)
def test_ws_matches_oracle(length, dim, density, q_source):
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(1, 4, length, dim, seed=length + dim)
    bm = _random_map(1, 4, length, density, seed=length)
    out = block_sparse_attention_ws(_q_from(q, q_source), k, v, bm, dim ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, q, k, v, bm)


@pytest.mark.parametrize("length,density", [(4097, 0.3), (32760, 0.15)])
@pytest.mark.parametrize("pooled_tail", [False, True])
def test_fp16_inputs_the_dtype_comfyui_computes_wan_in(length, density, pooled_tail):
    """ComfyUI computes a Wan model in fp16 on a GPU (its loader's choice, whatever the file): fp16 q / k / v in
    ComfyUI's ``[B, L, H, D]`` memory with the first-frame prefix bias, within the FP8 bounds of the oracle with
    and without the tail; the output is fp16."""
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(1, 4, length, 128, seed=length + 3, comfy_layout=True, dtype=torch.float16)
    bm = _random_map(1, 4, length, density, seed=length + 3)
    biases = dict(prefix_len=300, prefix_bias=0.9)
    out = block_sparse_attention_ws(q, k, v, bm, SCALE, pooled_tail=pooled_tail, **biases)
    assert out.shape == q.shape and out.dtype == torch.float16
    if pooled_tail:
        check_pooled_tail(out, q, k, v, bm, fp8=True, label=f"ws fp16 L={length} density={density}", **biases)
    else:
        _check(out, q, k, v, bm, **biases)


def test_ws_comfy_layout_broadcast_map_batch2():
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(2, 3, 2000, 128, seed=7, comfy_layout=True)
    bm = _random_map(1, 1, 2000, 0.4, seed=3)
    out = block_sparse_attention_ws(q, k, v, bm, SCALE)
    for b in range(2):
        _check(out[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], bm)


def test_a_q_no_tma_descriptor_can_address_takes_the_pre_pass_q():
    """q with a 264-byte row stride (a slice of wider rows): Q from the pre-pass, the same computation as
    the contiguous q under the identity token order (which takes the pre-pass's Q too, and stores its
    rows without TMA)."""
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(1, 2, 3000, 128, seed=13)
    wide = torch.zeros(1, 2, 3000, 132, dtype=q.dtype, device=q.device)
    wide[..., :128] = q
    bm = _random_map(1, 2, 3000, 0.3, seed=4)
    out = block_sparse_attention_ws(q, k, v, bm, SCALE)
    sliced = block_sparse_attention_ws(wide[..., :128], k, v, bm, SCALE)
    _check(sliced, q, k, v, bm)
    identity = torch.arange(3000, device="cuda")
    ordered = block_sparse_attention_ws(q, k, v, bm, SCALE, token_perm=identity)
    cos = torch.nn.functional.cosine_similarity(sliced.double().flatten(), ordered.double().flatten(), dim=0)
    assert cos.item() > 0.99999, cos.item()
    assert not torch.equal(sliced, out)  # the default took Q into the kernel


def test_ws_agrees_with_triton_fp8_and_empty_rows_are_zero():
    from chorus.kernels.triton import block_sparse_attention_triton
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(1, 2, 3000, 128, seed=11)
    bm = _random_map(1, 2, 3000, 0.2, seed=5)
    ref = block_sparse_attention_triton(q, k, v, bm, block_size=128, fp8=True)
    for source in Q_SOURCES:
        out = block_sparse_attention_ws(_q_from(q, source), k, v, bm, SCALE)
        cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()
        assert cos > AGREEMENT_FLOOR, (source, cos)
    empty = bm.clone()
    empty[:, :, 3] = False
    for source in Q_SOURCES:
        out = block_sparse_attention_ws(_q_from(q, source), k, v, empty, SCALE)
        assert torch.equal(out[:, :, 3 * 128:4 * 128], torch.zeros_like(out[:, :, 3 * 128:4 * 128]))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("length,prefix_len", [(4097, 300), (32760, 30 * 52), (3600 * 2 + 77, 3600)])
@pytest.mark.parametrize("prefix_bias", [1.5, -0.7])
@pytest.mark.parametrize("q_source", Q_SOURCES)
def test_prefix_bias_matches_oracle_and_the_triton_kernel(length, prefix_len, prefix_bias, q_source):
    from chorus.kernels.triton import block_sparse_attention_triton
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(1, 3, length, 128, seed=length + prefix_len)
    bm = _random_map(1, 3, length, 0.25, seed=prefix_len)
    bm[..., : -(-prefix_len // 128)] = True  # every row sees the whole prefix (Chorus's first-frame keep-set)
    out = block_sparse_attention_ws(_q_from(q, q_source), k, v, bm, SCALE, prefix_len=prefix_len,
                                    prefix_bias=prefix_bias)
    _check(out, q, k, v, bm, prefix_len, prefix_bias)
    ref = block_sparse_attention_triton(q, k, v, bm, block_size=128, fp8=True, prefix_len=prefix_len,
                                        prefix_bias=prefix_bias)
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()
    assert cos > AGREEMENT_FLOOR, cos
    unbiased = block_sparse_attention_ws(_q_from(q, q_source), k, v, bm, SCALE)
    assert not torch.equal(out, unbiased)  # the bias acted
    assert torch.equal(block_sparse_attention_ws(q, k, v, bm, SCALE, prefix_len=prefix_len, prefix_bias=0.0),
                       block_sparse_attention_ws(q, k, v, bm, SCALE))  # a zero bias is the unbiased kernel


@pytest.mark.parametrize("length", [4097, 32760])
def test_a_token_order_is_fused_into_the_pre_pass_and_the_output_store(length):
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(1, 3, length, 128, seed=length + 5)
    perm = torch.randperm(length, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    bm = _random_map(1, 3, length, 0.3, seed=7)
    out = block_sparse_attention_ws(q, k, v, bm, SCALE, token_perm=perm)
    qt, kt, vt = (t[:, :, perm] for t in (q, k, v))
    _check(out[:, :, perm], qt, kt, vt, bm)  # the oracle of the permuted sequence, back in input order
    # the same computation (the K smoothing rows too are taken in the permuted order; a token order
    # quantises Q in the pre-pass and stores 16 bytes per thread: the gathered rows, the scattered stores)
    ref = block_sparse_attention_ws(_q_from(qt, "prepass"), kt, vt, bm, SCALE)
    cos = torch.nn.functional.cosine_similarity(out[:, :, perm].double().flatten(), ref.double().flatten(), dim=0)
    assert cos.item() > 0.99999, cos.item()


def test_the_public_api_runs_a_region_order_on_it():
    import chorus.kernels as K
    from chorus.kernels.tile_order import RegionTileOrder

    order = RegionTileOrder((21, 30, 52))  # 480p's grid: 32 760 tokens
    q, k, v = cuda_qkv(1, 2, order.length, 128, seed=21)
    bm = _random_map(1, 2, order.length, 0.2, seed=8)
    out = K.block_sparse_attention(q, k, v, bm, block_size=128, token_perm=order, backend="triton_fp8_ws",
                                   prefix_len=30 * 52, prefix_bias=0.4)
    qt, kt, vt = (order.to_tile(t) for t in (q, k, v))
    _check(order.to_tile(out), qt, kt, vt, bm, 30 * 52, 0.4)


@pytest.mark.parametrize("backend", ["triton_fp8_ws", "triton_int8_ws", "triton_fp8", "triton_int8", "triton_bf16"])
@pytest.mark.parametrize("pooled_tail", [False, True])
def test_a_region_order_takes_the_end_images_suffix_bias(backend, pooled_tail):
    """A first-last-frame hit in a region order (480p's 21 frames: the last frame is the order's suffix): the first
    and the last frame's keys biased through ``token_perm`` equal the biased call on the reordered inputs, within
    the kernel's numerics of the fp64 oracle (every kernel that takes a token order)."""
    import chorus.kernels as K
    from chorus.kernels.tile_order import RegionTileOrder

    order = RegionTileOrder((21, 30, 52))
    hw = 30 * 52
    assert order.last_frame_is_suffix
    q, k, v = cuda_qkv(1, 2, order.length, 128, seed=23)
    bm = _random_map(1, 2, order.length, 0.2, seed=9)
    biases = dict(prefix_len=hw, prefix_bias=0.4, suffix_len=hw, suffix_bias=0.4)
    out = K.block_sparse_attention(q, k, v, bm, block_size=128, token_perm=order, backend=backend,
                                   pooled_tail=pooled_tail, **biases)
    plain = K.block_sparse_attention(q, k, v, bm, block_size=128, token_perm=order, backend=backend,
                                     pooled_tail=pooled_tail, prefix_len=hw, prefix_bias=0.4)
    assert not torch.equal(out, plain)  # the suffix bias acted
    qt, kt, vt = (order.to_tile(t) for t in (q, k, v))
    want = K.block_sparse_attention(qt, kt, vt, bm, block_size=128, backend=backend, pooled_tail=pooled_tail,
                                    **biases)
    ceiling = {"triton_bf16": 0.02, "triton_int8": 0.03, "triton_int8_ws": 0.03}.get(backend, 0.08)
    got = order.to_tile(out).double()
    # two runs within their numerics' ceiling: with a token order triton_fp8_ws's Q comes from the FP8 pre-pass,
    # without one the kernel converts its rows itself (0.038 apart on the H100, 2026-12-06)
    assert float((got - want.double()).norm() / want.double().norm()) < ceiling
    if not pooled_tail:
        _check(order.to_tile(out), qt, kt, vt, bm, **biases)


@pytest.mark.parametrize("backend", ["triton_fp8_ws", "triton_int8_ws", "triton_fp8", "triton_int8", "triton_bf16"])
@pytest.mark.parametrize("pooled_tail", [False, True])
def test_a_compact_call_that_leads_with_the_end_image_biases_both_image_frames(backend, pooled_tail):
    """Feature reuse's compact call of a first-last-frame hit (480p's grid, a quarter of the regions pooled, the
    layout leading with the last frame: ``RegionLayout.end_image_leads``): both image frames' keys, the prefix
    ``[0, 2 * H * W)``, biased and the cells' keys weighted log(8), as the engine calls it; the kernel's output
    within its numerics' ceiling of the fp64 oracle (with the tail where it is on), unlike the call that biases
    the first ``H * W`` keys alone."""
    import chorus.kernels as K
    from chorus.engine.feature_reuse import select_regions
    from chorus.kernels import pooling
    from chorus.kernels.reference import dense_attention_oracle
    from chorus.kernels.tile_order import cached_region_order
    from testing import query_block_rows

    grid, region, hw = (21, 30, 52), (2, 8, 8), 30 * 52
    order = cached_region_order(grid, region, 128)
    counts = pooling.region_counts(grid, region)
    scores = torch.rand(counts[0] * counts[1] * counts[2], generator=torch.Generator().manual_seed(3))
    regions = select_regions(scores, grid, region, 0.25)
    layout = pooling.build_layout(grid, region, (2, 2, 2), regions, device="cuda", order=order, end_image_leads=True)
    cmap = pooling.compact_block_map(_random_map(1, 2, order.length, 0.2, seed=10), layout.block_sources)
    q, k, v = cuda_qkv(1, 2, layout.compact_length, 128, seed=29)
    biases = dict(prefix_len=2 * hw, prefix_bias=0.4, suffix_len=layout.num_cells, suffix_bias=math.log(8))

    def attend(**options):
        return K.block_sparse_attention(q, k, v, cmap, block_size=128, backend=backend, pooled_tail=pooled_tail,
                                        **options)

    out = attend(**biases)
    blocks, rows = query_block_rows(q.shape[2], cmap.shape[2])
    oracle = dense_attention_oracle(q[:, :, rows], k, v, cmap[:, :, blocks], 128, pooled_tail=pooled_tail, **biases)
    ceiling = {"triton_bf16": 0.02, "triton_int8": 0.03, "triton_int8_ws": 0.03}.get(backend, 0.08)
    got = out[:, :, rows].double()
    assert torch.isfinite(out).all()
    assert float((got - oracle).norm() / oracle.norm()) < ceiling
    first_only = attend(**dict(biases, prefix_len=hw))
    assert not torch.equal(out, first_only)  # the end image's keys took the bias


@pytest.mark.parametrize("q_len,suffix_len", [(4097, 300), (3000, 2000), (61600, 2000)])
@pytest.mark.parametrize("backend", ["triton_fp8_ws", "triton_fp8"])
def test_a_suffix_bias_matches_the_oracle(q_len, suffix_len, backend):
    """Feature reuse's compact sequence: its last keys (the pooled cells) weighted log(8), with and
    without the first frame's prefix bias; both FP8 kernels within the FP8 bounds of the fp64 oracle."""
    import chorus.kernels as K

    def attend(**biases):
        return K.block_sparse_attention(q, k, v, bm, block_size=128, backend=backend, **biases)

    q, k, v = cuda_qkv(1, 3, q_len, 128, seed=q_len + suffix_len)
    bm = _random_map(1, 3, q_len, 0.3, seed=suffix_len)
    for prefix_len, prefix_bias in ((0, 0.0), (1000, 0.4)):
        biases = dict(prefix_len=prefix_len, prefix_bias=prefix_bias, suffix_len=suffix_len, suffix_bias=math.log(8))
        out = attend(**biases)
        _check(out, q, k, v, bm, **biases)
        plain = attend(prefix_len=prefix_len, prefix_bias=prefix_bias)
        assert not torch.equal(out, plain)  # the suffix weight acted
        if backend == "triton_fp8_ws":
            # whole blocks' biases in the row terms, the edge blocks' per key: the Triton kernel's per-key
            # biases, each kernel with its own rounding of P
            other = K.block_sparse_attention(q, k, v, bm, block_size=128, backend="triton_fp8", **biases)
            cos = torch.nn.functional.cosine_similarity(out.double().flatten(), other.double().flatten(), dim=0)
            assert cos.item() > AGREEMENT_FLOOR, cos.item()


def test_public_api_auto_takes_it_with_and_without_a_prefix_bias():
    import chorus.kernels as K
    from chorus.kernels import api

    q, k, v = cuda_qkv(1, 2, 2000, 128, seed=13)
    bm = _random_map(1, 2, 2000, 0.3, seed=2)
    assert api.resolve_backend("auto", q) == api.Backend.TRITON_FP8_WS
    out = K.block_sparse_attention(q, k, v, bm, block_size=128)
    _check(out, q, k, v, bm)
    assert api._for_call_options(api.Backend.TRITON_FP8_WS, False, q, 128, 300) == api.Backend.TRITON_FP8_WS
    biased = K.block_sparse_attention(q, k, v, bm, block_size=128, prefix_len=300, prefix_bias=1.5)
    want = K.block_sparse_attention(q, k, v, bm, block_size=128, prefix_len=300, prefix_bias=1.5,
                                    backend="triton_fp8_ws")
    assert torch.equal(biased, want)
    _check(biased, q, k, v, bm, 300, 1.5)


def test_torch_compile_of_a_module_calling_it():
    import chorus.kernels as K

    q, k, v = cuda_qkv(1, 2, 1000, 128, seed=17)
    bm = _random_map(1, 2, 1000, 0.5, seed=4)

    def attend(q, k, v, bm):
        return K.block_sparse_attention(q * 1.0, k, v, bm, block_size=128, backend="triton_fp8_ws",
                                        rows_checked=True, prefix_len=100, prefix_bias=0.5)

    eager = attend(q, k, v, bm)
    compiled = torch.compile(attend, fullgraph=False)(q, k, v, bm)
    assert torch.equal(eager, compiled)


# ---- the pooled tail (pooled_tail=True); `pytest tests/test_triton_gpu.py tests/test_kernels_ws_gpu.py -k tail`
# (the pre-pass's pooled rows and the block lists / bias table alone: test_triton_gpu.py's tail parts 1 and 2).

def _structured(length, heads, density):
    from chorus.benchmarks.kernels.masks import grid_for, structured_block_map

    grid = None if length in (32760, 75600) else grid_for(length)
    return structured_block_map(length, heads, density, 128, device="cuda", grid=grid)


@pytest.mark.parametrize("q_source", Q_SOURCES)
@pytest.mark.parametrize("length,dim,density", [(4097, 128, 0.3), (1000, 64, 0.03)])
def test_tail_ws_both_q_sources_match_oracle(q_source, length, dim, density, tail_form):
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(1, 4, length, dim, seed=length + dim + 1)
    bm = _random_map(1, 4, length, density, seed=length + 1)
    bm[:, 1, 0] = True  # a row that keeps every block
    out = block_sparse_attention_ws(_q_from(q, q_source), k, v, bm, dim ** -0.5, pooled_tail=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    check_pooled_tail(out, q, k, v, bm, fp8=True, label=f"ws Q {q_source} L={length} D={dim} density={density}")
    plain = block_sparse_attention_ws(_q_from(q, q_source), k, v, bm, dim ** -0.5)
    tol = 2 * torch.finfo(q.dtype).eps * plain[:, 1, :128].float().abs().max().item()
    torch.testing.assert_close(out[:, 1, :128].float(), plain[:, 1, :128].float(), rtol=0, atol=tol,
                               msg=f"ws Q {q_source}: a row that keeps every block changed with the tail")


@pytest.mark.parametrize("length,dim", [(1000, 128), (4097, 64), (32760, 128), (75600, 128)])
@pytest.mark.parametrize("density", [0.03, 0.15, 0.5, 1.0])
@pytest.mark.parametrize("sharp", [False, True])
def test_tail_ws_structured_maps_match_oracle(length, dim, density, sharp):
    """The default config on structured maps at Wan lengths, spread (unit Gaussian q) and sharp (q x 4)
    attention; a full map lists no pooled tile and gives what the call without the tail gives."""
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(1, 4, length, dim, seed=length + dim + 2 * int(sharp))
    if sharp:
        q = (q.float() * 4).to(q.dtype)
    bm = _structured(length, 4, density)
    out = block_sparse_attention_ws(q, k, v, bm, dim ** -0.5, pooled_tail=True)
    check_pooled_tail(out, q, k, v, bm, fp8=True, cos_floor=0.99 if sharp else 0.998,
                      label=f"ws default L={length} D={dim} density={density} sharp={sharp}")
    if density >= 1.0:
        plain = block_sparse_attention_ws(q, k, v, bm, dim ** -0.5)
        tol = 2 * torch.finfo(q.dtype).eps * plain.float().abs().max().item()
        torch.testing.assert_close(out.float(), plain.float(), rtol=0, atol=tol,
                                   msg="ws: a full map changed with the tail")


def test_tail_ws_agrees_with_triton_fp8_and_rows_that_keep_nothing(tail_form):
    """Same pre-pass, lists and table: the two FP8 kernels agree with the tail too, each with its own rounding
    of P; a row that keeps nothing attends to its pooled terms only."""
    from chorus.kernels.triton import block_sparse_attention_triton
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(1, 3, 3000, 128, seed=41)
    bm = _random_map(1, 3, 3000, 0.2, seed=6)
    bm[:, 2, 4] = False
    ref = block_sparse_attention_triton(q, k, v, bm, block_size=128, fp8=True, pooled_tail=True)
    check_pooled_tail(ref, q, k, v, bm, fp8=True, label="triton_fp8 reference of the agreement test")
    for name in Q_SOURCES:
        out = block_sparse_attention_ws(_q_from(q, name), k, v, bm, SCALE, pooled_tail=True)
        cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()
        assert cos > AGREEMENT_FLOOR, f"ws Q {name} vs triton_fp8 with the tail: cosine {cos:.6f} <= {AGREEMENT_FLOOR}"
        rows = slice(4 * 128, 5 * 128)
        check_pooled_tail(out[:, :, rows], q[:, :, rows], k, v, bm[:, :, 4:5], fp8=True,
                          label=f"ws {name}: the rows of a query block that keeps nothing (head 2)")


@pytest.mark.parametrize("q_source", Q_SOURCES)
def test_tail_ws_a_block_that_keeps_nothing_is_right_in_both_warpgroups(q_source, tail_form):
    """A query block whose map row keeps nothing runs its pooled tiles alone: each consumer warpgroup's 64 rows
    within the FP8 bound of the oracle, checked apart (one warpgroup's fault hides in a whole-tensor cosine). 64
    heads, so the tile is not its CTA's first and a miscompile shows on every run: ptxas 12 assembles the first
    warpgroup's rows of the ``pooled_loop`` form wrong (cosine 0.994; docs/BENCHMARK_LOG.md, "Where the pooled
    tail's extra cost comes from ..."), which is why that form is built only by the fixed ptxas."""
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    heads, length, empty_head, empty_block = 64, 3000, 40, 4
    q, k, v = cuda_qkv(1, heads, length, 128, seed=41)
    bm = _random_map(1, heads, length, 0.2, seed=6)
    bm[:, empty_head, empty_block] = False
    out = block_sparse_attention_ws(_q_from(q, q_source), k, v, bm, SCALE, pooled_tail=True)
    head = slice(empty_head, empty_head + 1)
    for warpgroup in (0, 1):
        rows = slice(empty_block * 128 + 64 * warpgroup, empty_block * 128 + 64 * warpgroup + 64)
        check_pooled_tail(out[:, head, rows], q[:, head, rows], k[:, head], v[:, head],
                          bm[:, head, empty_block:empty_block + 1], fp8=True,
                          label=f"ws Q {q_source}: warpgroup {warpgroup}'s rows of a block that keeps nothing")


@pytest.mark.parametrize("length,prefix_len,suffix_len", [(4097, 300, 0), (32760, 30 * 52, 2000), (7277, 3600, 500)])
def test_tail_ws_with_key_biases_matches_oracle(length, prefix_len, suffix_len, tail_form):
    """The first-frame prefix and the suffix weight enter the pooled blocks' weights (table) and stay off the
    pooled tiles' keys (every pooled tile lies past the last key, where a suffix bias would otherwise apply)."""
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(1, 3, length, 128, seed=length + prefix_len)
    bm = _random_map(1, 3, length, 0.2, seed=prefix_len)
    biases = dict(prefix_len=prefix_len, prefix_bias=0.9, suffix_len=suffix_len, suffix_bias=math.log(8))
    for name in Q_SOURCES:
        out = block_sparse_attention_ws(_q_from(q, name), k, v, bm, SCALE, pooled_tail=True, **biases)
        check_pooled_tail(out, q, k, v, bm, fp8=True, label=f"ws {name} biases L={length}", **biases)


def test_tail_ws_layouts_and_token_order(tail_form):
    """ComfyUI's [B, L, H, D] memory with a broadcast map and batch 2; a token order (the pre-pass's fused
    gather: pooled blocks of the permuted order)."""
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws

    q, k, v = cuda_qkv(2, 3, 2000, 128, seed=7, comfy_layout=True)
    bm = _random_map(1, 1, 2000, 0.3, seed=3)
    out = block_sparse_attention_ws(q, k, v, bm, SCALE, pooled_tail=True)
    for b in range(2):
        check_pooled_tail(out[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], bm, fp8=True,
                          label=f"ws comfy layout batch row {b}")
    q, k, v = cuda_qkv(1, 3, 4097, 128, seed=19)
    perm = torch.randperm(4097, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    bm = _random_map(1, 3, 4097, 0.3, seed=7)
    out = block_sparse_attention_ws(q, k, v, bm, SCALE, token_perm=perm, pooled_tail=True)
    qt, kt, vt = (t[:, :, perm] for t in (q, k, v))
    check_pooled_tail(out[:, :, perm], qt, kt, vt, bm, fp8=True, label="ws token order")


def test_tail_public_api_auto_takes_it_and_compiles():
    import chorus.kernels as K
    from chorus.kernels import api

    q, k, v = cuda_qkv(1, 2, 2000, 128, seed=23)
    bm = _random_map(1, 2, 2000, 0.3, seed=2)
    assert api._for_call_options(api.resolve_backend("auto", q), False, q, 128, 0, 0, True) == api.Backend.TRITON_FP8_WS
    out = K.block_sparse_attention(q, k, v, bm, block_size=128, pooled_tail=True)
    want = K.block_sparse_attention(q, k, v, bm, block_size=128, pooled_tail=True, backend="triton_fp8_ws")
    assert torch.equal(out, want)
    check_pooled_tail(out, q, k, v, bm, fp8=True, label="public API auto")
    with pytest.raises(api.BackendUnavailableError, match="no pooled tail"):
        K.block_sparse_attention(q, k, v, bm, block_size=128, pooled_tail=True, backend="flex")

    def attend(q, k, v, bm):
        return K.block_sparse_attention(q * 1.0, k, v, bm, block_size=128, backend="triton_fp8_ws",
                                        rows_checked=True, pooled_tail=True, prefix_len=100, prefix_bias=0.5)

    assert torch.equal(attend(q, k, v, bm), torch.compile(attend, fullgraph=False)(q, k, v, bm))
