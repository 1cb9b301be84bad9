"""Plain-torch emulation of SageAttention-style FP8 attention: the yardstick for the FP8 kernel's error.

:func:`sage_fp8_attention_emulation` quantises exactly like a SageAttention2-style FP8 kernel
would, but computes everything else in fp64 with an exact (not online) softmax:

- K smoothing: ``k - mean_t(k)`` per (b, h) (softmax-invariant);
- Q and K to e4m3 with one absmax scale per 128-token block per (b, h);
- ``P = softmax(S)`` over the kept keys, quantised to e4m3 as ``P * 448`` (static per-block scale,
  P <= 1), V to e4m3 with a per-(b, h, channel) absmax scale;
- ``O = (P8 @ V8) * v_scale / 448``.
- Pooled tail (``pooled_tail=True``): each key block's mean of smoothed K is quantised like K (one absmax
  scale per 128 pooled keys), its logit gets the block's weight (:func:`~chorus.kernels.reference.pooled_log_weights`)
  where the map skips the block, and its mean V is quantised with V's per-channel scale; the pooled terms
  share the softmax, P's quantisation and ``P8 @ V8`` with the keys.

It is independent of the Triton code (no shared helpers; the pooled tail's block means and weights
are the reference module's) so the kernel cannot hide a mistake by sharing it. Shapes as the kernel:
q ``[B, H, Lq, D]``, k/v ``[B, H, Lk, D]``, block map bool ``[B|1, H|1, Qb, Kb]``; returns fp64
``[B, H, Lq, D]``. Memory O(B*H*Lq*Lk): small shapes only.
"""

from __future__ import annotations

import math

import torch

from ..reference import add_key_biases, pooled_key_blocks, pooled_log_weights

E4M3_MAX = 448.0
_FP8 = torch.float8_e4m3fn


def _quant_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Fake-quantise ``x [B, H, L, D]`` (fp64) to e4m3 with one absmax scale per ``block`` tokens."""
    length = x.shape[2]
    pad = (-length) % block
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad))
    xb = xp.reshape(x.shape[0], x.shape[1], -1, block, x.shape[3])
    amax = xb.abs().amax(dim=(-1, -2), keepdim=True)
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    xq = (xb / s).clamp(-E4M3_MAX, E4M3_MAX).float().to(_FP8).double() * s
    return xq.reshape(xp.shape)[:, :, :length]


def sage_fp8_attention_emulation(q, k, v, block_map=None, block_size: int = 128, scale: float | None = None,
                                 quant_block: int = 128, prefix_len: int = 0, prefix_bias: float = 0.0,
                                 suffix_len: int = 0, suffix_bias: float = 0.0,
                                 pooled_tail: bool = False) -> torch.Tensor:
    """SageAttention-style FP8 attention in fp64 (see module docstring); ``prefix_bias`` is added to
    the (quantised) logits of keys ``[0, prefix_len)``, ``suffix_bias`` to the last ``suffix_len``;
    ``pooled_tail``: the skipped blocks' pooled terms (module docstring)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q64, k64, v64 = q.double(), k.double(), v.double()
    k64 = k64 - k64.mean(dim=2, keepdim=True)
    qq = _quant_blocks(q64 * scale, quant_block)
    kq = _quant_blocks(k64, quant_block)
    scores = qq @ kq.transpose(-1, -2)
    add_key_biases(scores, prefix_len, prefix_bias, suffix_len, suffix_bias)
    rows = torch.arange(q.shape[2], device=q.device) // block_size
    if block_map is not None:
        cols = torch.arange(k.shape[2], device=q.device) // block_size
        keep = block_map.to(q.device)[..., rows, :][..., cols]
        scores = scores.masked_fill(~keep, float("-inf"))
    values = v64
    if pooled_tail and block_map is not None:
        kbar, vbar = pooled_key_blocks(k64, v64, block_size)
        weights = pooled_log_weights(k.shape[2], block_size, prefix_len, prefix_bias, suffix_len, suffix_bias,
                                     device=q.device)
        pooled = (qq @ _quant_blocks(kbar, quant_block).transpose(-1, -2) + weights).masked_fill(
            block_map.to(q.device)[..., rows, :], float("-inf"))
        scores = torch.cat([scores.expand(*pooled.shape[:2], -1, -1), pooled], dim=-1)
        values = torch.cat([v64, vbar], dim=2)
    probs = torch.softmax(scores, dim=-1)
    p8 = (probs * E4M3_MAX).float().to(_FP8).double()
    vmax = v64.abs().amax(dim=2, keepdim=True)
    vs = torch.where(vmax > 0, vmax / E4M3_MAX, torch.ones_like(vmax))
    v8 = (values / vs).clamp(-E4M3_MAX, E4M3_MAX).float().to(_FP8).double()
    return (p8 @ v8) * vs / E4M3_MAX


def error_stats(out: torch.Tensor, oracle: torch.Tensor) -> dict:
    """``{"cosine", "rel_l1", "max_abs"}`` of ``out`` against ``oracle`` (flattened, fp64)."""
    a, b = out.double().flatten(), oracle.double().flatten()
    return {
        "cosine": torch.nn.functional.cosine_similarity(a, b, dim=0).item(),
        "rel_l1": ((a - b).abs().sum() / b.abs().sum()).item(),
        "max_abs": (a - b).abs().max().item(),
    }
