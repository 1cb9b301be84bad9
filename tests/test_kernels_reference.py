"""The ``reference`` and ``flex`` backends against the fp64 oracle (block map expanded to tokens)."""

import warnings

import pytest
import torch

import chorus.kernels as K
from chorus.kernels.reference import dense_attention_oracle
from testing import assert_matches_oracle, make_qkv, random_block_map

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("seq_len", [97, 300, 1025])
@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_oracle(seq_len, block_size, heads, dtype):
    q, k, v = make_qkv(heads=heads, q_len=seq_len, head_dim=64, dtype=dtype, seed=seq_len + heads)
    block_map = random_block_map(1, heads, seq_len, seq_len, block_size, density=0.4, seed=block_size)
    out = K.block_sparse_attention(q, k, v, block_map, block_size=block_size, backend="reference")
    assert out.dtype == dtype and out.shape == q.shape
    assert_matches_oracle(out, q, k, v, block_map, block_size)


@pytest.mark.parametrize("seq_len", [97, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_map_equals_dense(seq_len, dtype):
    q, k, v = make_qkv(heads=2, q_len=seq_len, dtype=dtype, seed=3)
    full = torch.ones(1, 1, -(-seq_len // 64), -(-seq_len // 64), dtype=torch.bool)
    out = K.block_sparse_attention(q, k, v, full, block_size=64, backend="reference")
    dense = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(dtype)
    assert_matches_oracle(out, q, k, v, None, 64)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), dense.float(), atol=tol, rtol=tol)


def test_cross_lengths_and_broadcast_batch():
    q, k, v = make_qkv(batch=2, heads=3, q_len=150, kv_len=260, seed=5)
    block_map = random_block_map(1, 3, 150, 260, 64, density=0.5, seed=1)
    out = K.block_sparse_attention(q, k, v, block_map, block_size=64, backend="reference")
    assert_matches_oracle(out, q, k, v, block_map, 64)


@pytest.mark.parametrize("seq_len", [97, 300, 1025])
@pytest.mark.parametrize("block_size", [64, 128])
def test_flex_backend_matches_oracle(seq_len, block_size):
    """FlexAttention is the second oracle; on CPU it runs unfused (eager)."""
    q, k, v = make_qkv(heads=2, q_len=seq_len, seed=11)
    block_map = random_block_map(1, 2, seq_len, seq_len, block_size, density=0.3, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "flex_attention called without torch.compile"
        out = K.block_sparse_attention(q, k, v, block_map, block_size=block_size, backend="flex")
    ref = K.block_sparse_attention(q, k, v, block_map, block_size=block_size, backend="reference")
    assert_matches_oracle(out, q, k, v, block_map, block_size)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sparse_output_differs_from_dense():
    """A sparse map must actually restrict attention (guards against a backend ignoring the map)."""
    q, k, v = make_qkv(heads=1, q_len=256, seed=7)
    block_map = torch.eye(4, dtype=torch.bool)[None, None]
    out = K.block_sparse_attention(q, k, v, block_map, block_size=64, backend="reference")
    dense = dense_attention_oracle(q, k, v)
    assert (out.double() - dense).abs().max() > 0.05
    blockwise = torch.cat([dense_attention_oracle(q[:, :, i:i + 64], k[:, :, i:i + 64], v[:, :, i:i + 64])
                           for i in range(0, 256, 64)], dim=2)
    torch.testing.assert_close(out.double(), blockwise, atol=1e-5, rtol=1e-5)


def test_auto_on_cpu_resolves_to_reference():
    q, k, v = make_qkv(q_len=64)
    assert K.resolve_backend("auto", q) == K.Backend.REFERENCE
    with pytest.raises(K.BackendUnavailableError, match="CUDA"):
        K.block_sparse_attention(q, k, v, torch.ones(1, 1, 1, 1, dtype=torch.bool), block_size=64,
                                 backend="triton_fp8")
