"""``benchmarks/kernels/bench_tail.py``'s inputs on the CPU: the timed calls see q/k/v as a hit's calls do (the token
order of an entry of the grid, ComfyUI's memory layout) and the pre-pass quantises Q exactly when the
warp-specialised call would (a token order, or Q rows no TMA descriptor takes). The timing itself needs a GPU."""

from __future__ import annotations

import pytest
import torch

from chorus.benchmarks.kernels.bench_tail import call_inputs
from chorus.benchmarks.kernels.masks import grid_for
from chorus.kernels.tile_order import cached_tile_order

LENGTH = 32760  # Wan's 480p latent grid, 21 x 30 x 52


def test_raster_inputs_leave_q_to_the_kernel():
    q, k, v, perm, quantize_q = call_inputs(LENGTH, 1, device="cpu")
    assert perm is None and not quantize_q
    assert q.shape == k.shape == v.shape == (1, 1, LENGTH, 128) and q.dtype == torch.bfloat16 and q.is_contiguous()


def test_comfyui_layout_is_the_per_head_view_of_token_major_memory():
    heads = 2
    q, k, v, perm, quantize_q = call_inputs(LENGTH, heads, layout="blhd", device="cpu")
    assert perm is None and not quantize_q
    for t in (q, k, v):
        assert t.shape == (1, heads, LENGTH, 128) and t.stride() == (LENGTH * heads * 128, 128, heads * 128, 1)


def test_unaligned_q_rows_move_q_to_the_prepass():
    q, _, _, perm, quantize_q = call_inputs(LENGTH, 1, q_unaligned=True, device="cpu")
    assert perm is None and quantize_q
    assert q.shape[-1] == 128 and q.stride(2) == 132 and (q.stride(2) * q.element_size()) % 16 != 0
    plain = call_inputs(LENGTH, 1, device="cpu")[0]
    assert torch.equal(q, plain)  # the same values, only their memory differs


def test_tile_order_is_the_entries_order_of_the_grid():
    _, _, _, perm, quantize_q = call_inputs(LENGTH, 1, order="tile", device="cpu")
    assert quantize_q and perm.dtype == torch.int32
    assert torch.equal(perm.long(), cached_tile_order(grid_for(LENGTH)).perm)
    assert torch.equal(perm.sort().values.long(), torch.arange(LENGTH))
    with pytest.raises(ValueError, match="grid"):
        call_inputs(32768, 1, order="tile", device="cpu")  # 480p padded to a multiple of 128
