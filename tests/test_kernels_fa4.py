"""The fa4_bf16 backend (FlashAttention-4's CuTe DSL kernel) on the CPU: where auto may take it, what an
explicit request says where it cannot run, how a call with options it lacks is routed, and the shape
and layout its torch.compile stand-in promises. Its numerics are checked on the GPU
(``test_kernels_fa4_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import chorus.kernels as K
from chorus.kernels import api, fa4
from testing import make_qkv


def test_auto_chain_takes_fa4_on_hopper_only_and_after_fp8():
    assert api._AUTO_CHAIN.index(api.Backend.FA4_BF16) == api._AUTO_CHAIN.index(api.Backend.TRITON_FP8) + 1
    assert api.Backend.FA4_BF16 in api._SM90_ONLY
    q = torch.zeros(1, 1, 4, 64)
    assert api._candidates(q, "attention") == [api.Backend.REFERENCE]  # CPU


def test_call_options_outside_fa4_go_down_the_chain_for_auto_and_raise_for_explicit():
    q = torch.zeros(1, 1, 4, 64)
    assert api._for_call_options(api.Backend.FA4_BF16, False, q, 128, 0) == api.Backend.FA4_BF16
    assert api._for_call_options(api.Backend.FA4_BF16, False, q, 128, 16) == api.Backend.REFERENCE
    assert api._for_call_options(api.Backend.FA4_BF16, False, q, 32, 0) == api.Backend.REFERENCE
    assert api._for_call_options(api.Backend.TRITON_BF16, True, q, 32, 16) == api.Backend.TRITON_BF16
    with pytest.raises(K.BackendUnavailableError, match="prefix bias"):
        api._for_call_options(api.Backend.FA4_BF16, True, q, 128, 16)
    with pytest.raises(K.BackendUnavailableError, match="block size 64 or 128"):
        api._for_call_options(api.Backend.FA4_BF16, True, q, 256, 0)


def test_unavailable_reason_on_cpu_and_call_reasons():
    assert "CUDA tensor" in fa4.fa4_unavailable(torch.zeros(1, 1, 4, 64))
    assert fa4.check_call(128, 0) is None and fa4.check_call(64, 0) is None
    assert "block size" in fa4.check_call(32, 0) and "prefix bias" in fa4.check_call(128, 1)


def test_direct_call_rejects_what_fa4_cannot_take():
    q, k, v = make_qkv(q_len=200, head_dim=32)
    bm = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="block size 64 or 128"):
        fa4.block_sparse_attention_fa4(q, k, v, bm, block_size=32)
    with pytest.raises(ValueError, match="unit stride on D and D in"):
        fa4.block_sparse_attention_fa4(q, k, v, bm, block_size=128)


@pytest.mark.parametrize("comfy_layout", [False, True])
def test_fake_output_is_a_head_transposed_view_like_the_kernel_returns(comfy_layout):
    with FakeTensorMode():
        b, h, length, d = 2, 4, 300, 128
        if comfy_layout:
            q = torch.empty(b, length, h, d, dtype=torch.bfloat16).transpose(1, 2)
        else:
            q = torch.empty(b, h, length, d, dtype=torch.bfloat16)
        bm = torch.ones(1, h, 3, 3, dtype=torch.bool)
        out = torch.ops.chorus.block_sparse_attention_fa4(q, q, q, bm, 128, 0.1)
        assert out.shape == (b, h, length, d) and out.dtype == torch.bfloat16
        assert out.transpose(1, 2).is_contiguous()  # FA4 writes [B, L, H, D]


def test_each_step_down_the_chain_meets_the_call_s_options(monkeypatch):
    """Auto's step down past a backend that cannot take a call's options checks the next one too: on Hopper's
    chain with ``triton_fp8`` (and then fa4) unavailable, a call with the pooled tail, a key bias or a block size
    the warp-specialised kernel does not run lands where those options run (never on fa4 or flex, which would drop
    the tail or the bias), and the portable Triton kernels take power-of-two blocks in [16, 256] only. End to end
    on the CPU, such a call keeps its pooled tail (the fp64 oracle's result with it, not without it)."""
    from chorus.kernels.reference import dense_attention_oracle

    unavailable = {api.Backend.TRITON_FP8}
    monkeypatch.setattr(api, "_auto_choice", {})  # auto's choice under this mock stays in this test
    monkeypatch.setattr(api, "_candidates", lambda q, op: list(api._AUTO_CHAIN))
    monkeypatch.setattr(api, "why_unavailable", lambda b, q, op="attention": "test" if b in unavailable else None)

    from chorus.kernels.triton import portable_block_size as portable_rule

    class Hopper:  # the warp-specialised kernel's own rule: 128-token blocks; the portable kernels' as they are
        ws_call_unsupported = staticmethod(lambda head_dim, block_size: None if block_size == 128 else "128 only")
        portable_block_size = staticmethod(portable_rule)

    monkeypatch.setattr(api, "_triton_module", lambda: Hopper)
    q = torch.zeros(1, 1, 4, 64)
    ws = api.Backend.TRITON_FP8_WS
    assert api._for_call_options(ws, False, q, 64, 0, pooled_tail=True) == api.Backend.TRITON_BF16
    assert api._for_call_options(ws, False, q, 64, 5) == api.Backend.TRITON_BF16
    assert api._for_call_options(ws, False, q, 64, 0) == api.Backend.FA4_BF16  # nothing fa4 lacks
    assert api._for_call_options(ws, False, q, 96, 0) == api.Backend.FLEX  # no Triton kernel runs 96
    assert api._for_call_options(ws, False, q, 96, 0, pooled_tail=True) == api.Backend.REFERENCE
    with pytest.raises(K.BackendUnavailableError, match="power-of-two blocks"):
        api._for_call_options(api.Backend.TRITON_BF16, True, q, 96, 0)
    unavailable |= {api.Backend.FA4_BF16, api.Backend.TRITON_BF16}
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    block_map = torch.eye(5, dtype=torch.bool)[None, None].clone()
    block_map[..., 0] = True
    out = K.block_sparse_attention(q, k, v, block_map, block_size=8, pooled_tail=True)
    with_tail = dense_attention_oracle(q, k, v, block_map, block_size=8, pooled_tail=True)
    without = dense_attention_oracle(q, k, v, block_map, block_size=8)
    torch.testing.assert_close(out.double(), with_tail, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.double(), without, atol=1e-3)
