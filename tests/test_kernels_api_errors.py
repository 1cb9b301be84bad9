"""Bad input to the public kernel API raises ValueError naming the problem."""

import pytest
import torch

import chorus.kernels as K
from testing import make_qkv


def _full(qb, kb):
    return torch.ones(1, 1, qb, kb, dtype=torch.bool)


def test_mismatched_shapes():
    q, k, v = make_qkv(q_len=100)
    with pytest.raises(ValueError, match="share B, H and D"):
        K.block_sparse_attention(q, k[..., :32], v[..., :32], _full(2, 2), block_size=64)
    with pytest.raises(ValueError, match="v .* must have k's shape"):
        K.block_sparse_attention(q, k, v[:, :, :50], _full(2, 2), block_size=64)
    with pytest.raises(ValueError, match=r"\[B, H, L, D\]"):
        K.block_sparse_attention(q[0], k[0], v[0], _full(2, 2), block_size=64)


def test_wrong_block_grid():
    q, k, v = make_qkv(q_len=100)
    with pytest.raises(ValueError, match="does not match the block grid"):
        K.block_sparse_attention(q, k, v, _full(1, 1), block_size=64)
    with pytest.raises(ValueError, match="does not match the block grid"):
        K.block_sparse_attention(q, k, v, _full(2, 2), block_size=32)


def test_empty_row():
    q, k, v = make_qkv(q_len=100)
    block_map = _full(2, 2).clone()
    block_map[0, 0, 1] = False
    with pytest.raises(ValueError, match="keeps no key block"):
        K.block_sparse_attention(q, k, v, block_map, block_size=64)


def test_map_dtype_and_broadcast_dims():
    q, k, v = make_qkv(batch=2, heads=2, q_len=64)
    with pytest.raises(ValueError, match="bool"):
        K.block_sparse_attention(q, k, v, torch.ones(1, 1, 1, 1), block_size=64)
    with pytest.raises(ValueError, match="head dim"):
        K.block_sparse_attention(q, k, v, torch.ones(1, 3, 1, 1, dtype=torch.bool), block_size=64)
    with pytest.raises(ValueError, match="batch dim"):
        K.block_sparse_attention(q, k, v, torch.ones(3, 1, 1, 1, dtype=torch.bool), block_size=64)


def test_bad_backend_and_block_size():
    q, k, v = make_qkv(q_len=64)
    with pytest.raises(ValueError, match="unknown backend"):
        K.block_sparse_attention(q, k, v, _full(1, 1), block_size=64, backend="cuda_magic")
    with pytest.raises(ValueError, match="block_size"):
        K.block_sparse_attention(q, k, v, _full(1, 1), block_size=0)
    with pytest.raises(ValueError, match="sample_rows"):
        K.block_mass(q, k, block_size=64, sample_rows=0)
    for scale in (0.0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite scale"):
            K.block_mass(q, k, block_size=64, scale=scale)
    with pytest.raises(K.BackendUnavailableError, match="flex has no block_mass"):
        K.block_mass(q, k, block_size=64, backend="flex")


@pytest.mark.parametrize("backend", ["triton_fp8_ws", "fa4_bf16"])
def test_an_explicit_gpu_only_backend_on_cpu_names_the_device(backend):
    q, k, v = make_qkv(q_len=200, head_dim=128)
    with pytest.raises(K.BackendUnavailableError, match=f"{backend} needs a CUDA tensor"):
        K.block_sparse_attention(q, k, v, _full(2, 2), block_size=128, backend=backend)
    with pytest.raises(K.BackendUnavailableError, match=f"{backend}.*no block_mass|no block_mass.*{backend}"):
        K.block_mass(q, k, block_size=128, backend=backend)


def test_flex_on_a_cuda_gpu_without_triton_names_the_missing_triton(monkeypatch):
    """On a CUDA GPU flex runs compiled, and torch.compile needs Triton: where it is not installed (Windows'
    portable ComfyUI without triton-windows) flex cannot run, so auto moves on instead of failing every call.
    (Only the device's type is read: a CUDA device object needs no GPU.)"""
    import importlib.util
    from types import SimpleNamespace

    from chorus.kernels.api import why_unavailable

    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert "needs Triton: triton is not installed" in why_unavailable(K.Backend.FLEX, on_gpu)
    assert why_unavailable(K.Backend.FLEX, make_qkv(q_len=64)[0]) is None  # on the CPU flex runs uncompiled


def test_flex_on_a_cuda_gpu_is_built_once_and_a_triton_that_cannot_build_it_is_a_reason(monkeypatch):
    """Triton installed but unable to build (a triton-windows of another torch release): flex's first question
    on a CUDA device compiles it once on a small input (``check_flex``), and the failure is the reason, asked
    once per (device, dtype, head dim), so auto moves past flex instead of every call failing its compile. (A
    CUDA device object needs no GPU; ``check_flex`` itself is tested below on the CPU.)"""
    from types import SimpleNamespace

    from chorus.kernels import api, probe

    monkeypatch.setattr(probe, "_PROBED", {})
    calls = []

    def cannot_build(q):
        calls.append(q)
        raise RuntimeError("PassManager::run failed\n(the rest of the compiler's log)")

    monkeypatch.setattr(api, "check_flex", cannot_build)
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, shape=(1, 40, 75600, 128))
    reason = api.why_unavailable(K.Backend.FLEX, on_gpu)
    assert reason == "compiled FlexAttention does not build or run here (RuntimeError: PassManager::run failed)"
    assert api.why_unavailable(K.Backend.FLEX, on_gpu) == reason and len(calls) == 1
    monkeypatch.setattr(api, "check_flex", lambda q: calls.append(q))
    other_head_dim = SimpleNamespace(device=on_gpu.device, dtype=torch.bfloat16, shape=(1, 40, 75600, 64))
    assert api.why_unavailable(K.Backend.FLEX, other_head_dim) is None and len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_flex_check_passes_flex_and_names_a_flex_that_computes_wrong(monkeypatch, dtype):
    from chorus.kernels import api
    from chorus.kernels.reference import NUMERICS_CEILINGS

    like = torch.empty(1, 1, 1, 64, dtype=dtype)
    assert api.check_flex(like) <= NUMERICS_CEILINGS["16-bit"]
    real = api._flex_attention
    monkeypatch.setattr(api, "_flex_attention", lambda *args: real(*args).flip(2))  # each row another's output
    with pytest.raises(RuntimeError, match="computes wrong: relative error"):
        api.check_flex(like)


def test_resolving_with_a_pooled_tail_moves_past_a_backend_without_one():
    """``pooled_tail=True``: auto resolves as a call with the tail does (past flex and fa4_bf16); an explicit
    backend without one raises."""
    q = make_qkv(q_len=64)[0]
    assert K.resolve_backend("flex", q, block_size=64) == K.Backend.FLEX
    with pytest.raises(K.BackendUnavailableError, match="flex has no pooled tail"):
        K.resolve_backend("flex", q, block_size=64, pooled_tail=True)
    assert K.resolve_backend("auto", q, block_size=64, pooled_tail=True) == K.Backend.REFERENCE


def test_a_scale_a_bool_or_an_empty_head_dim_is_a_clear_error():
    """A NaN, infinite, zero or non-numeric softmax scale (attention and block mass alike), a bool where an int
    is asked for (``block_size``, ``sample_rows``: True is not 1) and a head dim of 0 are ValueErrors naming the
    problem, not an all-NaN output or a ZeroDivisionError."""
    q, k, v = make_qkv(q_len=100)
    for scale in (float("nan"), float("inf"), 0.0, -1.0, "0.5", True):
        with pytest.raises(ValueError, match="scale"):
            K.block_sparse_attention(q, k, v, _full(2, 2), block_size=64, scale=scale)
    with pytest.raises(ValueError, match="positive finite scale"):
        K.block_mass(q, k, block_size=64, scale=float("nan"))
    with pytest.raises(ValueError, match="block_size"):
        K.block_sparse_attention(q, k, v, torch.ones(1, 1, 100, 100, dtype=torch.bool), block_size=True)
    with pytest.raises(ValueError, match="sample_rows"):
        K.block_mass(q, k, block_size=64, sample_rows=True)
    empty = q[..., :0]
    with pytest.raises(ValueError, match="D >= 1"):
        K.block_sparse_attention(empty, empty, empty, _full(2, 2), block_size=64)
    with pytest.raises(ValueError, match="D >= 1"):
        K.block_mass(empty, empty, block_size=64)
