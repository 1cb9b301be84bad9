"""block_mass and select_blocks: semantics, brute-force checks and bad input."""

import math

import pytest
import torch

import chorus.kernels as K
from chorus.kernels.codec import pack_bits_on_device
from testing import make_qkv


def brute_force_mass(q, k, block_size):
    probs = torch.softmax((q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1]), dim=-1)
    qb, kb = -(-q.shape[2] // block_size), -(-k.shape[2] // block_size)
    out = torch.zeros(q.shape[0], q.shape[1], qb, kb, dtype=torch.float64)
    for i in range(qb):
        for j in range(kb):
            rows = probs[:, :, i * block_size:(i + 1) * block_size, j * block_size:(j + 1) * block_size]
            out[:, :, i, j] = rows.sum(-1).mean(-1)
    return out


@pytest.mark.parametrize("seq_len,block_size", [(97, 32), (300, 64), (1025, 128)])
def test_block_mass_exact_matches_brute_force(seq_len, block_size):
    q, k, _ = make_qkv(heads=2, q_len=seq_len, seed=seq_len)
    mass = K.block_mass(q, k, block_size=block_size)
    assert mass.dtype == torch.float32
    torch.testing.assert_close(mass.double(), brute_force_mass(q, k, block_size), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(mass.sum(-1), torch.ones_like(mass.sum(-1)), atol=1e-5, rtol=0)


def test_block_mass_sampled_rows_estimate():
    q, k, _ = make_qkv(heads=2, q_len=1025, seed=1)
    exact = K.block_mass(q, k, block_size=128)
    sampled = K.block_mass(q, k, block_size=128, sample_rows=32)
    torch.testing.assert_close(sampled.sum(-1), torch.ones_like(sampled.sum(-1)), atol=1e-5, rtol=0)
    assert not torch.equal(sampled, exact)
    # A 32-of-128 row sample estimates the block mean; its error is well below the mass itself.
    assert (sampled - exact).abs().max() < 0.1
    assert (sampled - exact).abs().mean() < 0.01
    full_sample = K.block_mass(q, k, block_size=128, sample_rows=128)
    torch.testing.assert_close(full_sample, exact)


def test_select_blocks_top_p_semantics():
    mass = torch.tensor([[[[0.5, 0.3, 0.15, 0.05]]]])
    for top_p, want in [(0.5, [1, 0, 0, 0]), (0.51, [1, 1, 0, 0]), (0.8, [1, 1, 0, 0]),
                        (0.81, [1, 1, 1, 0]), (1.0, [1, 1, 1, 1])]:
        got = K.select_blocks(mass, top_p=top_p, k_min=0, keep_diagonal=False)
        assert got[0, 0, 0].tolist() == [bool(x) for x in want], top_p


def test_select_blocks_floor_and_keep_sets():
    mass = torch.tensor([[0.0, 0.05, 0.9, 0.05], [0.97, 0.01, 0.01, 0.01], [0.1, 0.2, 0.3, 0.4]])[None, None]
    got = K.select_blocks(mass, top_p=0.5, k_min=2, keep_diagonal=False)
    assert got.sum(-1).tolist() == [[[2, 2, 2]]]
    assert got[0, 0, 0].tolist() == [False, True, True, False]  # tie 0.05/0.05 -> lower index
    got = K.select_blocks(mass, top_p=0.5, k_min=0, keep_diagonal=True, keep_first_frame_blocks=1)
    assert got[0, 0, :, 0].all()
    assert got[0, 0, 1, 1] and got[0, 0, 2, 2]
    assert got[0, 0, 2].tolist() == [True, False, True, True]
    got = K.select_blocks(mass, top_p=0.5, k_min=0, keep_diagonal=False, keep_last_frame_blocks=2)
    assert got[0, 0, :, 2:].all()
    assert got[0, 0, 1].tolist() == [True, False, True, True]
    assert K.select_blocks(mass, top_p=0.5, k_min=0, keep_last_frame_blocks=9).all()  # past the row: every block


@pytest.mark.parametrize("tokens,frame,block,want", [(1280, 256, 128, 2), (1300, 256, 128, 3), (1300, 20, 128, 1),
                                                     (1300, 0, 128, 0), (75600, 3600, 128, 29), (100, 100, 128, 1)])
def test_last_frame_blocks_counts_the_blocks_the_suffix_touches(tokens, frame, block, want):
    assert K.last_frame_blocks(tokens, frame, block) == want
    starts = torch.arange(K.num_blocks(tokens, block)) * block  # every block's first token
    ends = torch.clamp(starts + block, max=tokens)
    assert int((ends > tokens - frame).sum()) == want  # blocks holding a token of the last `frame`


def test_last_frame_blocks_refuses_a_frame_longer_than_the_sequence():
    with pytest.raises(ValueError, match="frame of"):
        K.last_frame_blocks(100, 101)


def test_select_blocks_top_p_one_keeps_exactly_nonzero():
    mass = torch.softmax(torch.randn(2, 3, 8, 8), -1)  # no block below the 1e-6 rounding tolerance
    mass[..., 5] = 0
    mass = mass / mass.sum(-1, keepdim=True)
    got = K.select_blocks(mass, top_p=1.0, k_min=0, keep_diagonal=False)
    assert torch.equal(got, mass > 0)


def test_select_blocks_reaches_top_p_minimally():
    gen = torch.Generator().manual_seed(0)
    mass = torch.softmax(torch.randn(1, 4, 16, 16, generator=gen) * 2, -1)
    got = K.select_blocks(mass, top_p=0.8, k_min=0, keep_diagonal=False)
    kept = (mass * got).sum(-1)
    assert (kept >= 0.8 - 1e-6).all()
    # Dropping the smallest kept block of any row falls below top_p (minimality).
    smallest = torch.where(got, mass, torch.full_like(mass, float("inf"))).min(-1).values
    assert (kept - smallest < 0.8).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_blocks_is_the_same_map_whatever_the_float_width(dtype):
    # The selection sorts narrow mass in float32 and sums in float64: the map must be the one the same
    # values select as float64 (ties and near-ties included: equal masses keep key-block order).
    gen = torch.Generator().manual_seed(3)
    mass = torch.softmax(torch.randn(2, 3, 24, 40, generator=gen) * 3, -1).to(dtype)
    mass[..., 7] = mass[..., 3]          # exact ties
    mass[..., 11] = mass[..., 2] * (1 + 2 ** -20) if dtype == torch.float32 else mass[..., 11]  # a near-tie
    for top_p in (0.5, 0.9, 0.99):
        got = K.select_blocks(mass, top_p=top_p, k_min=2, keep_first_frame_blocks=1, keep_last_frame_blocks=2)
        want = K.select_blocks(mass.double(), top_p=top_p, k_min=2, keep_first_frame_blocks=1, keep_last_frame_blocks=2)
        assert torch.equal(got, want)


@pytest.mark.parametrize("bad,match", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=-0.1), "top_p"),
    (dict(k_min=-1), "k_min"), (dict(keep_first_frame_blocks=-2), "keep_first_frame_blocks"),
    (dict(keep_last_frame_blocks=-1), "keep_last_frame_blocks"),
])
def test_select_blocks_bad_arguments(bad, match):
    args = dict(top_p=0.9, k_min=1) | bad
    with pytest.raises(ValueError, match=match):
        K.select_blocks(torch.full((1, 1, 2, 2), 0.5), **args)


@pytest.mark.parametrize("value,match", [(float("nan"), "NaN"), (float("inf"), "inf"), (-0.5, "negative")])
def test_select_blocks_bad_mass(value, match):
    mass = torch.full((1, 1, 3, 3), 1 / 3)
    mass[0, 0, 1, 2] = value
    with pytest.raises(ValueError, match=match):
        K.select_blocks(mass, top_p=0.9, k_min=1)


def test_select_blocks_rejects_non_float():
    with pytest.raises(ValueError, match="floating"):
        K.select_blocks(torch.ones(1, 1, 2, 2, dtype=torch.bool), top_p=0.9, k_min=1)


def test_select_blocks_packed_is_the_packed_map():
    # The recorder keeps select_blocks_packed's bytes: the packed form of select_blocks' map, padding bits zero.
    from chorus.kernels.codec import unpack_bits

    gen = torch.Generator().manual_seed(5)
    mass = torch.softmax(torch.randn(2, 3, 11, 13, generator=gen) * 3, -1)
    args = dict(top_p=0.8, k_min=2, keep_first_frame_blocks=1, keep_last_frame_blocks=1)
    packed = K.select_blocks_packed(mass, **args)
    want = K.select_blocks(mass, **args)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 11, 2)
    assert torch.equal(packed, pack_bits_on_device(want))
    assert torch.equal(unpack_bits(packed, 13), want)
    assert int(packed[..., -1].bitwise_and(0b111).max()) == 0  # 13 blocks: the last byte's 3 low bits pad
    with pytest.raises(ValueError, match="top_p"):
        K.select_blocks_packed(mass, top_p=0.0, k_min=1)


def test_select_blocks_takes_the_torch_path_when_the_kernel_fails(monkeypatch):
    # A kernel that raises: the call returns torch's map; out of memory is tried again, a build failure
    # turns the kernel off for the process (kernels/fused.py).
    from chorus.kernels import masks
    from chorus.kernels.fused import FusedSwitch

    mass = torch.softmax(torch.randn(1, 2, 5, 7, generator=torch.Generator().manual_seed(2)), -1)
    want = masks.select_blocks_torch(mass, top_p=0.9, k_min=1)
    errors = iter([torch.OutOfMemoryError("CUDA out of memory (test)"), RuntimeError("cannot build (test)")])
    tried = []

    class FailingKernel:
        @staticmethod
        def select_blocks_triton(mass, **kwargs):
            tried.append(1)
            raise next(errors)

    monkeypatch.setattr(masks, "_FUSED", FusedSwitch("test"))
    monkeypatch.setattr(masks, "_fused_kernel", lambda mass: FailingKernel if masks._FUSED.on else None)
    assert torch.equal(K.select_blocks(mass, top_p=0.9, k_min=1), want)
    assert torch.equal(K.select_blocks_packed(mass, top_p=0.9, k_min=1), pack_bits_on_device(want))
    assert torch.equal(K.select_blocks(mass, top_p=0.9, k_min=1), want)
    assert len(tried) == 2 and not masks._FUSED.on


def _entry_map(heads, num_q, num_kv, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(heads, num_q, num_kv, generator=gen) < torch.rand(heads, num_q, 1, generator=gen) * 0.4


@pytest.mark.parametrize("src_heads,heads,num_kv,k", [(1, 4, 13, 3), (3, 3, 9, 0), (2, 4, 37, 40), (1, 1, 8, 2)])
def test_floor_packed_map_is_the_floored_entry_map(src_heads, heads, num_kv, k):
    """A hit's map from its entry's packed one (what RunMaps computes with): the entry's map with the k_min floor
    of floor_k_min, on every head, its packed copy and its row counts (the torch path here, the Triton kernel's
    reference; the kernel against it: tests/test_triton_interpret_cases.py)."""
    stored = _entry_map(src_heads, num_kv, num_kv, seed=num_kv)
    block_map, packed, kept = K.masks.floor_packed_map(pack_bits_on_device(stored), num_kv, heads, k)
    want = K.masks.floor_k_min(stored, k).repeat(heads // src_heads, 1, 1)
    assert block_map.dtype == torch.bool and torch.equal(block_map, want)
    assert torch.equal(packed, pack_bits_on_device(want)) and torch.equal(kept, want.sum(-1, dtype=torch.int32))
    if k:
        assert int(kept.min()) >= min(k, num_kv)


def test_floor_packed_map_rejects_what_does_not_fit():
    packed = pack_bits_on_device(_entry_map(2, 5, 11, seed=1))
    with pytest.raises(ValueError, match="ceil"):
        K.masks.floor_packed_map(packed, 17, 2, 1)
    with pytest.raises(ValueError, match="multiple"):
        K.masks.floor_packed_map(packed, 11, 3, 1)


def test_floor_packed_map_takes_the_torch_path_when_the_kernel_fails(monkeypatch):
    """A kernel that raises: torch's map; out of memory is tried again, a build failure turns it off."""
    from chorus.kernels import masks
    from chorus.kernels.fused import FusedSwitch

    stored = _entry_map(1, 6, 6, seed=3)
    packed = pack_bits_on_device(stored)
    want = masks.floor_packed_map_torch(packed, 6, 2, 1)
    errors = iter([torch.OutOfMemoryError("CUDA out of memory (test)"), RuntimeError("cannot build (test)")])
    tried = []

    class FailingKernel:
        @staticmethod
        def floor_packed_map_triton(*args):
            tried.append(1)
            raise next(errors)

    monkeypatch.setattr(masks, "_FUSED_FLOOR", FusedSwitch("test"))
    monkeypatch.setattr(masks, "_floor_kernel", lambda packed, num_kv: FailingKernel if masks._FUSED_FLOOR.on else None)
    for _ in range(3):
        got = masks.floor_packed_map(packed, 6, 2, 1)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(tried) == 2 and not masks._FUSED_FLOOR.on
