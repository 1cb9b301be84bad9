"""Mask codec: lossless both ways (bits, bytes, FlexAttention BlockMask) and clear errors."""

import warnings

import pytest
import torch

import chorus.kernels as K
from testing import make_qkv


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 11), (1, 40, 256, 256), (4, 9, 17)])
def test_bits_and_bytes_roundtrip(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    block_map = torch.rand(*shape, generator=gen) < 0.3
    packed = K.pack_bits(block_map)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == (shape[-1] + 7) // 8
    assert torch.equal(K.unpack_bits(packed, shape[-1]), block_map)
    assert torch.equal(K.decode_block_map(K.encode_block_map(block_map)), block_map)


def test_packed_size_for_wan_480p_step():
    """40 layers x 40 heads x 256^2 bits per step = 12.5 MiB (DESIGN.md's sizing)."""
    one_layer = torch.zeros(40, 256, 256, dtype=torch.bool)
    assert K.pack_bits(one_layer).numel() * 40 == 40 * 40 * 256 * 256 // 8


@pytest.mark.parametrize("q_len,kv_len,block_size", [(97, 97, 32), (300, 260, 64), (1025, 1025, 128)])
def test_flex_block_mask_roundtrip_and_semantics(q_len, kv_len, block_size):
    qb, kb = -(-q_len // block_size), -(-kv_len // block_size)
    block_map = torch.rand(1, 2, qb, kb, generator=torch.Generator().manual_seed(q_len)) < 0.5
    block_map[..., 0] = True
    block_mask = K.to_flex_block_mask(block_map, block_size=block_size, q_len=q_len, kv_len=kv_len)
    assert torch.equal(K.from_flex_block_mask(block_mask), block_map)
    # The BlockMask selects the same attention as the reference backend.
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = make_qkv(heads=2, q_len=q_len, kv_len=kv_len)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = flex_attention(q, k, v, block_mask=block_mask)
    ref = K.block_sparse_attention(q, k, v, block_map, block_size=block_size, backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_codec_errors():
    with pytest.raises(ValueError, match="bool"):
        K.pack_bits(torch.ones(2, 2))
    with pytest.raises(ValueError, match="key blocks"):
        K.unpack_bits(torch.zeros(2, 1, dtype=torch.uint8), 9)
    data = K.encode_block_map(torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="magic"):
        K.decode_block_map(b"XXXX" + data[4:])
    with pytest.raises(ValueError, match="payload"):
        K.decode_block_map(data[:-1])
    with pytest.raises(ValueError, match="does not match lengths"):
        K.to_flex_block_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool), block_size=64, q_len=200, kv_len=100)
