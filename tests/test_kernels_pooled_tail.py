"""The pooled tail (``pooled_tail=True``) on the CPU: the fp64 oracle against its definition, the
``reference`` backend against the oracle (2 x the eager yardstick's error, awkward sizes, key biases,
token orders, broadcast maps, rows that keep every block), and the API's routing of tail calls.

The Triton kernels' tail: ``test_triton_interpret_cases.py`` (interpreter), ``test_triton_gpu.py`` and
``test_kernels_ws_gpu.py`` (GPU); the warp-specialised kernel's build with it: ``test_kernels_ws.py``."""

from __future__ import annotations

import math

import pytest
import torch

import chorus.kernels as K
from chorus.kernels import api
from chorus.kernels.reference import dense_attention_oracle, pooled_key_blocks, pooled_log_weights
from testing import assert_matches_oracle, make_qkv, random_block_map


def _definition(q, k, v, block_map, bs, scale, prefix_len=0, prefix_bias=0.0, suffix_len=0, suffix_bias=0.0):
    """The tail's definition, one query row and one key block at a time, in fp64 (no shared helpers)."""
    q, k, v = q.double(), k.double(), v.double()
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    bias = torch.zeros(kv_len, dtype=torch.float64)
    bias[:prefix_len] += prefix_bias
    if suffix_len:
        bias[kv_len - suffix_len:] += suffix_bias
    out = torch.empty_like(q)
    for b in range(batch):
        for h in range(heads):
            bm = block_map[min(b, block_map.shape[0] - 1), min(h, block_map.shape[1] - 1)]
            for i in range(q_len):
                logits, values = [], []
                for j in range(bm.shape[1]):
                    keys = range(j * bs, min((j + 1) * bs, kv_len))
                    if bm[i // bs, j]:
                        for t in keys:
                            logits.append(scale * float(q[b, h, i] @ k[b, h, t]) + float(bias[t]))
                            values.append(v[b, h, t])
                    else:
                        idx = list(keys)
                        kbar, vbar = k[b, h, idx].mean(0), v[b, h, idx].mean(0)
                        logits.append(scale * float(q[b, h, i] @ kbar) + math.log(float(bias[idx].exp().sum())))
                        values.append(vbar)
                p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                out[b, h, i] = p @ torch.stack(values)
    return out


@pytest.mark.parametrize("biases", [{}, dict(prefix_len=21, prefix_bias=1.2),
                                    dict(prefix_len=40, prefix_bias=-0.5, suffix_len=17, suffix_bias=math.log(8))])
def test_oracle_tail_is_its_definition(biases):
    q, k, v = make_qkv(batch=2, heads=2, q_len=37, kv_len=45, head_dim=16, seed=3)
    bm = random_block_map(1, 2, 37, 45, 8, density=0.4, seed=1)
    bm[0, 1, 2] = True  # a row that keeps every block: no tail term
    oracle = dense_attention_oracle(q, k, v, bm, 8, scale=0.3, pooled_tail=True, **biases)
    torch.testing.assert_close(oracle, _definition(q, k, v, bm, 8, 0.3, **biases), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kv_len,bs", [(300, 64), (97, 32), (256, 128)])
def test_the_tail_is_exact_on_blocks_of_identical_keys(kv_len, bs):
    """A skipped block whose tokens share one key and one value is exactly its pooled term (n_j copies of
    the mean key, weight log n_j plus the biases' log-sum-exp): any map with the tail equals dense
    attention, partial last block and key biases included; without the tail it does not."""
    q, k, v = make_qkv(heads=2, q_len=150, kv_len=kv_len, head_dim=32, seed=kv_len)
    blocks = torch.arange(kv_len) // bs
    k, v = k[:, :, blocks * bs], v[:, :, blocks * bs]  # every token of a block holds the block's first row
    bm = random_block_map(1, 2, 150, kv_len, bs, density=0.3, seed=2)
    biases = dict(prefix_len=bs // 2 + 3, prefix_bias=0.9, suffix_len=bs + 5, suffix_bias=-0.4)
    dense = dense_attention_oracle(q, k, v, None, bs, **biases)
    torch.testing.assert_close(dense_attention_oracle(q, k, v, bm, bs, pooled_tail=True, **biases), dense,
                               rtol=1e-9, atol=1e-11)
    out = K.block_sparse_attention(q, k, v, bm, block_size=bs, backend="reference", pooled_tail=True, **biases)
    torch.testing.assert_close(out.double(), dense, rtol=1e-5, atol=1e-5)
    assert (dense_attention_oracle(q, k, v, bm, bs, **biases) - dense).abs().max() > 1e-2


def test_pooled_helpers_count_real_tokens_only():
    k = torch.arange(2 * 130, dtype=torch.float64).view(1, 1, 130, 2)
    kbar, vbar = pooled_key_blocks(k, -k, 64)
    assert kbar.shape == (1, 1, 3, 2)
    torch.testing.assert_close(kbar[0, 0, 2], k[0, 0, 128:].mean(0))  # the partial last block: 2 tokens
    torch.testing.assert_close(vbar, -kbar)
    w = pooled_log_weights(130, 64)
    torch.testing.assert_close(w, torch.tensor([math.log(64), math.log(64), math.log(2)], dtype=torch.float64))
    # prefix [0, 100) with bias a, suffix [70, 130) with b: block 1 (keys 64-127) holds 6 keys of the prefix
    # only, 30 of both, 28 of the suffix only
    a, b = 0.7, -1.1
    w = pooled_log_weights(130, 64, 100, a, 60, b)
    want = [math.log(64 * math.exp(a)), math.log(6 * math.exp(a) + 30 * math.exp(a + b) + 28 * math.exp(b)),
            math.log(2 * math.exp(b))]
    torch.testing.assert_close(w, torch.tensor(want, dtype=torch.float64))


@pytest.mark.parametrize("seq_len,kv_len", [(97, 97), (300, 300), (513, 513), (150, 260)])
@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_with_tail_matches_oracle(seq_len, kv_len, block_size, dtype):
    q, k, v = make_qkv(heads=3, q_len=seq_len, kv_len=kv_len, head_dim=64, dtype=dtype, seed=seq_len + block_size)
    bm = random_block_map(1, 3, seq_len, kv_len, block_size, density=0.3, seed=block_size)
    bm[..., 0, :] = True  # a row that keeps every block
    out = K.block_sparse_attention(q, k, v, bm, block_size=block_size, backend="reference", pooled_tail=True)
    assert out.dtype == dtype and out.shape == q.shape
    assert_matches_oracle(out, q, k, v, bm, block_size, pooled_tail=True)
    plain = dense_attention_oracle(q, k, v, bm, block_size)
    if bm.shape[-1] > 1:
        assert (out.double() - plain).abs().max() > 1e-3  # the tail acted
    full_row = slice(0, min(block_size, seq_len))  # ... except on the row that keeps every block
    assert_matches_oracle(out[:, :, full_row], q[:, :, full_row], k, v, bm[:, :, :1], block_size)


@pytest.mark.parametrize("biases", [dict(prefix_len=130, prefix_bias=1.5), dict(suffix_len=90, suffix_bias=math.log(8)),
                                    dict(prefix_len=70, prefix_bias=-0.7, suffix_len=200, suffix_bias=0.6)])
def test_reference_with_tail_and_key_biases_matches_oracle(biases):
    q, k, v = make_qkv(batch=2, heads=2, q_len=300, head_dim=64, seed=11)
    bm = random_block_map(2, 2, 300, 300, 64, density=0.35, seed=4)
    out = K.block_sparse_attention(q, k, v, bm, block_size=64, backend="reference", pooled_tail=True, **biases)
    assert_matches_oracle(out, q, k, v, bm, 64, pooled_tail=True, **biases)


def test_reference_with_tail_in_a_token_order():
    """Blocks of the permuted order: the call equals the tail call on the reordered inputs, back in raster order."""
    from chorus.kernels.tile_order import TileOrder

    order = TileOrder((3, 5, 12), block_size=32)
    q, k, v = make_qkv(heads=2, q_len=order.length, head_dim=64, seed=31)
    bm = random_block_map(1, 2, order.length, order.length, 32, density=0.3, seed=3)
    out = K.block_sparse_attention(q, k, v, bm, block_size=32, backend="reference", token_perm=order,
                                   pooled_tail=True, prefix_len=60, prefix_bias=0.5)
    perm = order.perm
    qp, kp, vp = (t[:, :, perm] for t in (q, k, v))
    assert_matches_oracle(out[:, :, perm], qp, kp, vp, bm, 32, prefix_len=60, prefix_bias=0.5, pooled_tail=True)


def test_a_full_map_has_no_tail():
    q, k, v = make_qkv(heads=2, q_len=200, seed=5)
    full = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    with_tail = K.block_sparse_attention(q, k, v, full, block_size=64, backend="reference", pooled_tail=True)
    plain = K.block_sparse_attention(q, k, v, full, block_size=64, backend="reference")
    torch.testing.assert_close(with_tail, plain, rtol=1e-6, atol=1e-6)


def test_tail_calls_skip_backends_without_one():
    q = torch.zeros(1, 1, 8, 128)
    for backend in (api.Backend.FLEX, api.Backend.FA4_BF16):
        assert api._for_call_options(backend, False, q, 128, 0, 0, True) == api.Backend.REFERENCE
        with pytest.raises(api.BackendUnavailableError, match="no pooled tail"):
            api._for_call_options(backend, True, q, 128, 0, 0, True)
    assert api._for_call_options(api.Backend.FLEX, True, q, 128, 0, 0, False) == api.Backend.FLEX
    for backend in (api.Backend.TRITON_FP8_WS, api.Backend.TRITON_FP8, api.Backend.TRITON_BF16, api.Backend.REFERENCE):
        assert api._for_call_options(backend, True, q, 128, 0, 0, True) == backend
    q, k, v = make_qkv(heads=1, q_len=100, seed=0)
    bm = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with pytest.raises(api.BackendUnavailableError, match="no pooled tail"):
        K.block_sparse_attention(q, k, v, bm, block_size=64, backend="flex", pooled_tail=True)
    with pytest.raises(ValueError, match="pooled_tail must be a bool"):
        K.block_sparse_attention(q, k, v, bm, block_size=64, pooled_tail=1)
