"""The fa4_bf16 backend on a CUDA GPU (skipped without one, or without flash-attn-4): FlashAttention-4's
block-sparse kernel against the fp64 oracle on whole query blocks (first, middle, partial last), with
the bound the Triton bf16 path meets (error <= 2 x eager bf16 masked attention's error + 4 ulp), at
awkward lengths, both block sizes, head dims 64 / 128, ComfyUI's [B, L, H, D] memory with a broadcast
map and batch 2, and the public API's routing of a prefix-bias call."""

from __future__ import annotations

import os

import pytest
import torch

from testing import cuda_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only"),
]


@pytest.fixture(scope="module", autouse=True)
def _fa4_runs_here():
    from chorus.kernels.fa4 import fa4_unavailable

    reason = fa4_unavailable(torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16))
    if reason:
        pytest.skip(reason)


def _rows(length, bs, blocks):
    return torch.cat([torch.arange(b * bs, min((b + 1) * bs, length), device="cuda") for b in blocks])


def _random_map(heads, length, bs, density, seed, batch=1):
    nb = -(-length // bs)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bm = torch.rand(batch, heads, nb, nb, device="cuda", generator=gen) < density
    bm[..., torch.arange(nb), torch.arange(nb)] = True
    return bm


def _check_against_oracle(out, q, k, v, bm, bs, **key_bias):
    """``out`` within 2x eager bf16's error of the fp64 oracle on three query blocks; ``key_bias``:
    ``prefix_len`` / ``prefix_bias`` given to the oracle and to eager alike. Returns the oracle's rows."""
    from chorus.kernels.reference import dense_attention_oracle, masked_attention_eager

    nqb = bm.shape[2]
    blocks = sorted({0, nqb // 2, nqb - 1})
    rows = _rows(q.shape[2], bs, blocks)
    sub_map = bm[:, :, blocks]
    q_sub = q[:, :, rows]
    oracle = dense_attention_oracle(q_sub, k, v, sub_map, bs, **key_bias)
    eager = masked_attention_eager(q_sub, k, v, sub_map, bs, **key_bias).double()
    err = (out[:, :, rows].double() - oracle).abs().max().item()
    err_eager = (eager - oracle).abs().max().item()
    floor = 4 * torch.finfo(torch.bfloat16).eps * oracle.abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= 2 * err_eager + floor, f"error {err:.3e} vs eager bf16 {err_eager:.3e}"
    return oracle, rows


@pytest.mark.parametrize("length,dim,bs", [(1000, 128, 128), (4097, 128, 128), (4097, 64, 128), (3000, 128, 64),
                                           (32760, 128, 128)])
@pytest.mark.parametrize("density", [0.05, 0.3, 1.0])
def test_fa4_matches_oracle(length, dim, bs, density):
    import chorus.kernels as K

    q, k, v = cuda_qkv(1, 4, length, dim, seed=length + dim)
    bm = _random_map(4, length, bs, density, seed=length)
    out = K.block_sparse_attention(q, k, v, bm, block_size=bs, backend="fa4_bf16")
    assert out.shape == q.shape and out.dtype == q.dtype
    _check_against_oracle(out, q, k, v, bm, bs)


def test_fa4_comfy_layout_broadcast_map_batch_two():
    import chorus.kernels as K

    q, k, v = cuda_qkv(2, 8, 2000, 128, seed=3, comfy_layout=True)
    bm = _random_map(8, 2000, 128, 0.2, seed=4)  # [1, H, ...]: one map for both batch rows (cond / uncond)
    out = K.block_sparse_attention(q, k, v, bm, block_size=128, backend="fa4_bf16", rows_checked=True)
    assert out.transpose(1, 2).is_contiguous()  # handed back to ComfyUI without a copy
    _check_against_oracle(out, q, k, v, bm.expand(2, -1, -1, -1), 128)
    triton = K.block_sparse_attention(q, k, v, bm, block_size=128, backend="triton_bf16")
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), triton.double().flatten(), dim=0)
    assert cos > 0.9999


def test_prefix_bias_call_routes_to_triton_under_auto_and_raises_explicit():
    import chorus.kernels as K
    from chorus.kernels import api

    q, k, v = cuda_qkv(1, 4, 1500, 128, seed=9)
    bm = _random_map(4, 1500, 128, 0.4, seed=10)
    with pytest.raises(K.BackendUnavailableError, match="prefix bias"):
        K.block_sparse_attention(q, k, v, bm, block_size=128, backend="fa4_bf16", prefix_len=300, prefix_bias=1.0)
    routed = api._for_call_options(api.Backend.FA4_BF16, False, q, 128, 300)
    assert routed == api.Backend.TRITON_BF16
    # the backend the call is routed to keeps the bias: its output is the biased oracle's, not the plain one's
    biased = K.block_sparse_attention(q, k, v, bm, block_size=128, backend=routed.value, prefix_len=300,
                                      prefix_bias=1.0)
    oracle, rows = _check_against_oracle(biased, q, k, v, bm, 128, prefix_len=300, prefix_bias=1.0)
    plain_oracle, _ = _check_against_oracle(K.block_sparse_attention(q, k, v, bm, block_size=128,
                                                                      backend="fa4_bf16"), q, k, v, bm, 128)
    bias_effect = (oracle - plain_oracle).abs().max().item()
    assert bias_effect > 1e-2
    assert (biased[:, :, rows].double() - oracle).abs().max().item() < bias_effect / 10


def test_fa4_under_torch_compile():
    import chorus.kernels as K

    q, k, v = cuda_qkv(1, 4, 1000, 128, seed=12, comfy_layout=True)
    bm = _random_map(4, 1000, 128, 0.3, seed=13)

    def attend(q, k, v):
        return K.block_sparse_attention(q, k, v, bm, block_size=128, backend="fa4_bf16", rows_checked=True) * 2

    eager = attend(q, k, v)
    compiled = torch.compile(attend)(q, k, v)
    assert torch.equal(eager, compiled)
