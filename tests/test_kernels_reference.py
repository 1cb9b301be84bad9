"""The ``reference`` and ``flex`` backends against the fp64 oracle (block map expanded to tokens)."""

import math
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


def test_the_build_probe_answers_once_per_key_and_ignores_out_of_memory():
    """auto's resolution asks a kernel (the Triton kernels, compiled flex) to build and run once per key (on a
    GPU): a failure is a remembered reason, success is remembered too, an out-of-memory is neither."""
    from chorus.kernels import probe

    calls = []

    def broken():
        calls.append("broken")
        raise RuntimeError("PassManager::run failed\nmore lines")

    def out_of_memory():
        calls.append("oom")
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    key = ("test-probe", id(calls))
    assert probe.build_probe(key + ("oom",), "the test kernel", out_of_memory) is None
    assert probe.build_probe(key + ("oom",), "the test kernel", out_of_memory) is None
    reason = probe.build_probe(key + ("broken",), "the test kernel", broken)
    assert reason is not None and "the test kernel does not build or run here (RuntimeError: PassManager::run failed)" in reason and "more lines" not in reason
    assert probe.build_probe(key + ("broken",), "the test kernel", broken) == reason
    assert probe.build_probe(key + ("fine",), "the test kernel", lambda: calls.append("fine")) is None
    assert probe.build_probe(key + ("fine",), "the test kernel", broken) is None
    assert calls == ["oom", "oom", "broken", "fine"]


def test_auto_on_cpu_resolves_to_reference():
    q, k, v = make_qkv(q_len=64)
    assert K.resolve_backend("auto", q) == K.Backend.REFERENCE
    with pytest.raises(K.BackendUnavailableError, match="CUDA"):
        K.block_sparse_attention(q, k, v, torch.ones(1, 1, 1, 1, dtype=torch.bool), block_size=64,
                                 backend="triton_fp8")


@pytest.mark.parametrize("seq_len,prefix_len", [(97, 40), (300, 130), (1025, 257)])
@pytest.mark.parametrize("bias", [1.5, -0.7])
@pytest.mark.parametrize("backend", ["reference", "flex"])
def test_prefix_bias_matches_oracle(seq_len, prefix_len, bias, backend):
    """The first-frame logit bias (guidance) on a prefix that does not end on a block boundary."""
    q, k, v = make_qkv(heads=2, q_len=seq_len, seed=seq_len + prefix_len)
    block_map = random_block_map(1, 2, seq_len, seq_len, 64, density=0.4, seed=3)
    block_map[..., 0] = True  # the engine always keeps the first frame's key blocks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = K.block_sparse_attention(q, k, v, block_map, block_size=64, backend=backend, prefix_len=prefix_len,
                                       prefix_bias=bias)
    assert_matches_oracle(out, q, k, v, block_map, 64, prefix_len=prefix_len, prefix_bias=bias)
    unbiased = dense_attention_oracle(q, k, v, block_map, 64)
    assert (out.double() - unbiased).abs().max() > 0.01  # the bias is not ignored


def test_prefix_bias_scales_the_prefix_weights_by_exp_bias():
    """Independent of any kernel: with v = 1 on the prefix keys and 0 elsewhere the output is the
    prefix's attention mass m; a bias b turns it into e^b m / (e^b m + 1 - m)."""
    q, k, _ = make_qkv(heads=2, q_len=200, seed=21)
    prefix, bias = 70, 0.8
    v = torch.zeros_like(q)
    v[:, :, :prefix] = 1.0
    mass = dense_attention_oracle(q, k, v)[..., 0]
    biased = K.block_sparse_attention(q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool), block_size=64,
                                      backend="reference", prefix_len=prefix, prefix_bias=bias)[..., 0].double()
    want = math.exp(bias) * mass / (math.exp(bias) * mass + 1 - mass)
    torch.testing.assert_close(biased, want, atol=1e-6, rtol=1e-5)
    assert (biased > mass).all()


@pytest.mark.parametrize("prefix_len,bias", [(0, 2.0), (50, 0.0), (50, 0)])
def test_no_prefix_bias_is_bit_identical(prefix_len, bias):
    q, k, v = make_qkv(heads=2, q_len=150, seed=4)
    block_map = random_block_map(1, 2, 150, 150, 64, density=0.5, seed=4)
    plain = K.block_sparse_attention(q, k, v, block_map, block_size=64, backend="reference")
    same = K.block_sparse_attention(q, k, v, block_map, block_size=64, backend="reference", prefix_len=prefix_len,
                                    prefix_bias=bias)
    assert torch.equal(plain, same)


@pytest.mark.parametrize("prefix_len,bias,match", [(-1, 1.0, "prefix_len"), (151, 1.0, "prefix_len"),
                                                   (2.5, 1.0, "prefix_len"), (True, 1.0, "prefix_len"),
                                                   (10, math.nan, "prefix_bias"), (10, math.inf, "prefix_bias"),
                                                   (10, 21.0, "prefix_bias"), (10, "1", "prefix_bias")])
def test_bad_prefix_arguments_raise(prefix_len, bias, match):
    q, k, v = make_qkv(heads=1, q_len=150, seed=1)
    with pytest.raises(ValueError, match=match):
        K.block_sparse_attention(q, k, v, torch.ones(1, 1, 3, 3, dtype=torch.bool), block_size=64,
                                 prefix_len=prefix_len, prefix_bias=bias)
