"""Reference numerics in plain torch (any device): the oracle and the ``reference`` backend.

Shapes: q ``[B, H, Lq, D]``, k/v ``[B, H, Lk, D]``; a block map is bool
``[B or 1, H or 1, ceil(Lq/bs), ceil(Lk/bs)]``. Query block ``i`` covers tokens
``[i*bs, min((i+1)*bs, Lq))``; the last block may be partial.

- :func:`dense_attention_oracle` is fp64 dense attention with the block map expanded to tokens:
  the accuracy oracle every backend is tested against.
- :func:`block_sparse_attention_reference` is the ``reference`` backend: exact masked softmax
  in fp32, one query block at a time (memory O(B*H*bs*Lk)), result cast to q's dtype.
- :func:`block_mass_reference` computes exact or row-sampled block attention mass in fp32.

Pooled tail (``pooled_tail=True``, every attention function here): for each query row ``i`` (query
block ``I``) and each key block ``j`` the map does not keep for ``(I, head)``, one extra term enters row
``i``'s softmax: logit ``scale * q_i . kbar_j + w_j``, value ``vbar_j``, with ``kbar_j`` / ``vbar_j`` the
means of K / V over block ``j``'s real tokens (:func:`pooled_key_blocks`) and ``w_j = log(sum_t
exp(bias_t))`` over those tokens (:func:`pooled_log_weights`: ``log(n_j)`` without key biases). A row
that keeps every block has no tail term; kept blocks are attended exactly as without the tail.

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


def pooled_key_blocks(k: torch.Tensor, v: torch.Tensor, block_size: int):
    """Per key block, the means of K and V over its real tokens (a partial last block: its real tokens
    only): ``(kbar, vbar)``, each ``[B, H, Kb, D]`` in k's dtype (sums accumulated by torch)."""
    batch, heads, kv_len, head_dim = k.shape
    blocks = -(-kv_len // block_size)
    pad = blocks * block_size - kv_len
    counts = torch.full((blocks, 1), float(block_size), dtype=k.dtype, device=k.device)
    counts[-1] = kv_len - (blocks - 1) * block_size

    def means(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(batch, heads, blocks, block_size, head_dim)
        return x.sum(dim=3) / counts

    return means(k), means(v)


def pooled_log_weights(kv_len: int, block_size: int, prefix_len: int = 0, prefix_bias: float = 0.0,
                       suffix_len: int = 0, suffix_bias: float = 0.0, dtype=torch.float64, device=None):
    """``w [Kb]``: per key block, ``log(sum over its real tokens t of exp(bias_t))`` with ``bias_t`` the key
    bias of token t (``prefix_bias`` on keys ``[0, prefix_len)`` plus ``suffix_bias`` on the last
    ``suffix_len``; 0 elsewhere): ``log(n_j)`` without biases. The pooled tail's weight of block j."""
    blocks = -(-kv_len // block_size)
    bias = add_key_biases(torch.zeros(kv_len, dtype=dtype, device=device), prefix_len, prefix_bias, suffix_len,
                          suffix_bias)
    padded = torch.nn.functional.pad(bias, (0, blocks * block_size - kv_len), value=float("-inf"))
    return torch.logsumexp(padded.view(blocks, block_size), dim=1)


def _pooled_terms(q, k, v, block_map, block_size, scale, biases):
    """The pooled tail of query rows ``q`` (module docstring), in q's dtype: ``(logits [B, H, Lq, Kb],
    vbar [B, H, Kb, D])``, logits ``-inf`` where the map keeps the block."""
    kbar, vbar = pooled_key_blocks(k, v, block_size)
    weights = pooled_log_weights(k.shape[-2], block_size, **biases, dtype=q.dtype, device=q.device)
    logits = torch.matmul(q, kbar.transpose(-1, -2)) * scale + weights
    rows = torch.arange(q.shape[-2], device=q.device) // block_size
    kept = block_map.to(q.device)[..., rows, :]
    return logits.masked_fill(kept, float("-inf")), vbar


def _attend(q, k, v, block_map, block_size, scale, biases, pooled_tail):
    """Masked softmax attention of ``q`` over ``k, v`` in q's dtype (with the pooled tail when asked)."""
    scores = add_key_biases(torch.matmul(q, k.transpose(-1, -2)) * scale, **biases)
    if block_map is not None:
        mask = expand_block_map(block_map.to(q.device), q.shape[-2], k.shape[-2], block_size)
        scores = scores.masked_fill(~mask, float("-inf"))
    if not pooled_tail or block_map is None:  # a full map skips nothing: no tail
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    logits, vbar = _pooled_terms(q, k, v, block_map, block_size, scale, biases)
    probs = torch.softmax(torch.cat([scores, logits], dim=-1), dim=-1)
    kv_len = k.shape[-2]
    return torch.matmul(probs[..., :kv_len], v) + torch.matmul(probs[..., kv_len:], vbar)


# Relative L2 against exact attention that each numerics family stays under on a full map of unit Gaussian
# q / k / v (measured, docs/BENCHMARK_LOG.md: FP8 0.051-0.056, INT8 0.014-0.017, bf16 0.002-0.006 from 200 to
# 32 760 tokens, fp16 ~0.0003): a kernel past its ceiling computes wrong (one row's output in another's gives
# ~1.4). Used by the portable Triton backends' first-use probe and ``python -m chorus check``.
NUMERICS_CEILINGS = {"fp8": 0.08, "int8": 0.03, "16-bit": 0.02}
# The largest absolute difference of a block mass (each row sums to 1) from block_mass_reference's that a kernel
# computing right stays under (the Triton kernel: <= 1e-4 on the H200's tests, 1e-5 under the interpreter).
BLOCK_MASS_CEILING = 1e-2


def relative_l2(out: torch.Tensor, exact: torch.Tensor) -> float:
    """``||out - exact|| / ||exact||`` in fp64 (``exact`` fp64, as the oracle gives it); ``inf`` when ``out`` is
    not finite."""
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - exact).norm() / exact.norm()).item()


def softmax_scale(head_dim: int, scale: float | None = None) -> float:
    """The logits' scale of attention over ``head_dim``-wide heads: ``scale`` when given, else
    ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def dense_attention_oracle(q, k, v, block_map=None, block_size: int = 128, scale: float | None = None,
                           prefix_len: int = 0, prefix_bias: float = 0.0, suffix_len: int = 0,
                           suffix_bias: float = 0.0, pooled_tail: bool = False):
    """fp64 dense attention, optionally restricted by a block map, with the key biases and the pooled
    tail (module docstring); returns fp64 ``[B, H, Lq, D]``.

    Rows whose token mask keeps no key would be NaN (without the tail); callers validate maps before use.
    """
    scale = softmax_scale(q.shape[-1], scale)
    biases = dict(prefix_len=prefix_len, prefix_bias=prefix_bias, suffix_len=suffix_len, suffix_bias=suffix_bias)
    return _attend(q.double(), k.double(), v.double(), block_map, block_size, scale, biases, pooled_tail)


def masked_attention_eager(q, k, v, block_map=None, block_size: int = 128, scale: float | None = None,
                           prefix_len: int = 0, prefix_bias: float = 0.0, suffix_len: int = 0,
                           suffix_bias: float = 0.0, pooled_tail: bool = False):
    """The same computation done naively in the inputs' dtype (the error yardstick for tolerances)."""
    scale = softmax_scale(q.shape[-1], scale)
    biases = dict(prefix_len=prefix_len, prefix_bias=prefix_bias, suffix_len=suffix_len, suffix_bias=suffix_bias)
    return _attend(q, k, v, block_map, block_size, scale, biases, pooled_tail)


def block_sparse_attention_reference(q, k, v, block_map, block_size: int, scale: float, prefix_len: int = 0,
                                     prefix_bias: float = 0.0, suffix_len: int = 0, suffix_bias: float = 0.0,
                                     pooled_tail: bool = False):
    """``reference`` backend: fp32 masked attention per query block, with optional prefix / suffix
    biases and the pooled tail (module docstring); returns q's dtype."""
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[-2]
    out = torch.empty_like(q)
    k32, v32 = k.float(), v.float()
    col_block = torch.arange(kv_len, device=q.device) // block_size
    block_map = block_map.to(q.device)
    if pooled_tail:
        kbar, vbar = pooled_key_blocks(k32, v32, block_size)
        weights = pooled_log_weights(kv_len, block_size, prefix_len, prefix_bias, suffix_len, suffix_bias,
                                     dtype=torch.float32, device=q.device)
        v32 = torch.cat([v32.expand(batch, heads, -1, -1), vbar], dim=2)  # the pooled values after the keys
    for qb in range(block_map.shape[-2]):
        start, stop = qb * block_size, min((qb + 1) * block_size, q_len)
        rows = q[:, :, start:stop].float()
        scores = torch.matmul(rows, k32.transpose(-1, -2)) * scale  # [B, H, bs, Lk]
        add_key_biases(scores, prefix_len, prefix_bias, suffix_len, suffix_bias)
        keep = block_map[:, :, qb][..., col_block]  # [B|1, H|1, Lk]
        scores = scores.masked_fill(~keep.unsqueeze(-2), float("-inf"))
        if pooled_tail:
            pooled = (torch.matmul(rows, kbar.transpose(-1, -2)) * scale + weights).masked_fill(
                block_map[:, :, qb].unsqueeze(-2), float("-inf"))  # [B, H, bs, Kb]
            scores = torch.cat([scores, pooled], dim=-1)
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
