"""Reference numerics in plain torch (any device): the oracle and the ``reference`` backend.

Shapes: q ``[B, H, Lq, D]``, k/v ``[B, H, Lk, D]``; a block map is bool
``[B or 1, H or 1, ceil(Lq/bs), ceil(Lk/bs)]``. Query block ``i`` covers tokens
``[i*bs, min((i+1)*bs, Lq))``; the last block may be partial.

- :func:`dense_attention_oracle` is fp64 dense attention with the block map expanded to tokens:
  the accuracy oracle every backend is tested against.
- :func:`block_sparse_attention_reference` is the ``reference`` backend: exact masked softmax
  in fp32, one query block at a time (memory O(B*H*bs*Lk)), result cast to q's dtype.
- :func:`block_mass_reference` computes exact or row-sampled block attention mass in fp32.

Key biases (all attention functions here; ``suffix_bias`` on the last ``suffix_len`` keys likewise:
the weight of keys that each stand for several tokens, feature reuse's pooled cells on the compact
sequence): ``prefix_bias`` is added to the logits (after the
softmax scale, natural-log units) of the keys ``[0, prefix_len)`` for every query; with Wan's
``(t, h, w)`` token order those are the first latent frame (the image of an I2V request), so a
positive bias multiplies their softmax weights by ``exp(prefix_bias)`` before renormalisation.

Inputs are assumed validated by :mod:`chorus.kernels.api`.
"""

from __future__ import annotations

import math

import torch


def expand_block_map(block_map: torch.Tensor, q_len: int, kv_len: int, block_size: int) -> torch.Tensor:
    """Bool block map ``[..., Qb, Kb]`` -> token mask ``[..., q_len, kv_len]`` (True = attend)."""
    rows = torch.arange(q_len, device=block_map.device) // block_size
    cols = torch.arange(kv_len, device=block_map.device) // block_size
    return block_map[..., rows, :][..., cols]


def sample_row_offsets(rows_in_block: int, sample_rows: int | None, device=None) -> torch.Tensor:
    """Deterministic, evenly strided row offsets inside one query block (all rows when ``None``)."""
    if sample_rows is None or sample_rows >= rows_in_block:
        return torch.arange(rows_in_block, device=device)
    return torch.linspace(0, rows_in_block - 1, sample_rows, device=device).round().long().unique()


def add_key_biases(scores: torch.Tensor, prefix_len: int, prefix_bias: float, suffix_len: int = 0,
                    suffix_bias: float = 0.0) -> torch.Tensor:
    """``scores [..., Lk]`` with ``prefix_bias`` added to the first ``prefix_len`` keys and
    ``suffix_bias`` to the last ``suffix_len`` keys (in place)."""
    if prefix_len > 0 and prefix_bias != 0.0:
        scores[..., :prefix_len] += prefix_bias
    if suffix_len > 0 and suffix_bias != 0.0:
        scores[..., scores.shape[-1] - suffix_len:] += suffix_bias
    return scores


def dense_attention_oracle(q, k, v, block_map=None, block_size: int = 128, scale: float | None = None,
                           prefix_len: int = 0, prefix_bias: float = 0.0, suffix_len: int = 0,
                           suffix_bias: float = 0.0):
    """fp64 dense attention, optionally restricted by a block map and with a prefix bias (module
    docstring); returns fp64 ``[B, H, Lq, D]``.

    Rows whose token mask keeps no key would be NaN; callers validate maps before use.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q64, k64, v64 = q.double(), k.double(), v.double()
    scores = add_key_biases(torch.matmul(q64, k64.transpose(-1, -2)) * scale, prefix_len, prefix_bias, suffix_len,
                             suffix_bias)
    if block_map is not None:
        mask = expand_block_map(block_map.to(q.device), q.shape[-2], k.shape[-2], block_size)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v64)


def masked_attention_eager(q, k, v, block_map=None, block_size: int = 128, scale: float | None = None,
                           prefix_len: int = 0, prefix_bias: float = 0.0, suffix_len: int = 0,
                           suffix_bias: float = 0.0):
    """The same computation done naively in the inputs' dtype (the error yardstick for tolerances)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = add_key_biases(torch.matmul(q, k.transpose(-1, -2)) * scale, prefix_len, prefix_bias, suffix_len,
                             suffix_bias)
    if block_map is not None:
        mask = expand_block_map(block_map.to(q.device), q.shape[-2], k.shape[-2], block_size)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def block_sparse_attention_reference(q, k, v, block_map, block_size: int, scale: float, prefix_len: int = 0,
                                     prefix_bias: float = 0.0, suffix_len: int = 0, suffix_bias: float = 0.0):
    """``reference`` backend: fp32 masked attention per query block, with optional prefix / suffix
    biases; returns q's dtype."""
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[-2]
    out = torch.empty_like(q)
    k32 = k.float().transpose(-1, -2)
    v32 = v.float()
    col_block = torch.arange(kv_len, device=q.device) // block_size
    block_map = block_map.to(q.device)
    for qb in range(block_map.shape[-2]):
        start, stop = qb * block_size, min((qb + 1) * block_size, q_len)
        scores = torch.matmul(q[:, :, start:stop].float(), k32) * scale  # [B, H, bs, Lk]
        add_key_biases(scores, prefix_len, prefix_bias, suffix_len, suffix_bias)
        keep = block_map[:, :, qb][..., col_block]  # [B|1, H|1, Lk]
        scores = scores.masked_fill(~keep.unsqueeze(-2), float("-inf"))
        out[:, :, start:stop] = torch.matmul(torch.softmax(scores, dim=-1), v32).to(q.dtype)
    return out


def block_mass_reference(q, k, block_size: int, sample_rows: int | None, scale: float):
    """Block attention mass ``[B, H, Qb, Kb]`` (fp32): per query block, the mean over its (sampled)
    query rows of the softmax probability falling in each key block; every row sums to 1."""
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[-2]
    num_q_blocks = -(-q_len // block_size)
    num_kv_blocks = -(-kv_len // block_size)
    pad = num_kv_blocks * block_size - kv_len
    k32 = k.float().transpose(-1, -2)
    mass = torch.empty(batch, heads, num_q_blocks, num_kv_blocks, dtype=torch.float32, device=q.device)
    for qb in range(num_q_blocks):
        start, stop = qb * block_size, min((qb + 1) * block_size, q_len)
        rows = start + sample_row_offsets(stop - start, sample_rows, device=q.device)
        probs = torch.softmax(torch.matmul(q[:, :, rows].float(), k32) * scale, dim=-1)
        probs = torch.nn.functional.pad(probs, (0, pad))
        mass[:, :, qb] = probs.view(batch, heads, rows.numel(), num_kv_blocks, block_size).sum(-1).mean(-2)
    return mass
