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

import torch

from ..reference import add_key_biases, pooled_key_blocks, pooled_log_weights, softmax_scale

E4M3_MAX = 448.0
_FP8 = torch.float8_e4m3fn


def e4m3_fake(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 under an absmax scale (``amax / 448``), fp64."""
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX).float().to(_FP8).double() * s


def _per_token_tiles(x: torch.Tensor, tile: int, fake) -> torch.Tensor:
    """``fake(tiles, absmax)`` of ``x [B, H, L, D]`` with one absmax scale per ``tile`` tokens (the last tile
    zero-padded), back in ``x``'s shape."""
    length = x.shape[2]
    xp = torch.nn.functional.pad(x, (0, 0, 0, (-length) % tile))
    xb = xp.reshape(x.shape[0], x.shape[1], -1, tile, x.shape[3])
    return fake(xb, xb.abs().amax(dim=(-1, -2), keepdim=True)).reshape(xp.shape)[:, :, :length]


def e4m3_token_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Fake-quantise ``x [B, H, L, D]`` (fp64) to e4m3 with one absmax scale per ``block`` tokens."""
    return _per_token_tiles(x, block, e4m3_fake)


def sage_fp8_attention_emulation(q, k, v, block_map=None, block_size: int = 128, scale: float | None = None,
                                 quant_block: int = 128, prefix_len: int = 0, prefix_bias: float = 0.0,
                                 suffix_len: int = 0, suffix_bias: float = 0.0,
                                 pooled_tail: bool = False) -> torch.Tensor:
    """SageAttention-style FP8 attention in fp64 (see module docstring); ``prefix_bias`` is added to
    the (quantised) logits of keys ``[0, prefix_len)``, ``suffix_bias`` to the last ``suffix_len``;
    ``pooled_tail``: the skipped blocks' pooled terms (module docstring)."""
    scale = softmax_scale(q.shape[-1], scale)
    q64, k64, v64 = q.double(), k.double(), v.double()
    k64 = k64 - k64.mean(dim=2, keepdim=True)
    qq = e4m3_token_blocks(q64 * scale, quant_block)
    kq = e4m3_token_blocks(k64, quant_block)
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
        pooled = (qq @ e4m3_token_blocks(kbar, quant_block).transpose(-1, -2) + weights).masked_fill(
            block_map.to(q.device)[..., rows, :], float("-inf"))
        scores = torch.cat([scores.expand(*pooled.shape[:2], -1, -1), pooled], dim=-1)
        values = torch.cat([v64, vbar], dim=2)
    probs = torch.softmax(scores, dim=-1)
    p8 = (probs * E4M3_MAX).float().to(_FP8).double()
    vmax = v64.abs().amax(dim=2, keepdim=True)
    vs = torch.where(vmax > 0, vmax / E4M3_MAX, torch.ones_like(vmax))
    v8 = (values / vs).clamp(-E4M3_MAX, E4M3_MAX).float().to(_FP8).double()
    return (p8 @ v8) * vs / E4M3_MAX


INT8_MAX = 127.0


def _sylvester(dim: int, device=None) -> torch.Tensor:
    """The ``dim x dim`` Sylvester-Hadamard matrix (+-1 entries, fp64; ``dim`` a power of two)."""
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < dim:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64, device=device), h)
    return h


def int8_fake(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the int8 grid of an absmax scale (``amax / 127``; nearest, ties to even), fp64."""
    s = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    return torch.round(x / s).clamp(-INT8_MAX, INT8_MAX) * s


def int8_key_tiles(x: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """``x [B, H, L, D]`` fake-quantised to int8 with one absmax scale per ``tile`` rows."""
    return _per_token_tiles(x, tile, int8_fake)


def int8_attention_emulation(q, k, v, block_map=None, block_size: int = 128, scale: float | None = None,
                             prefix_len: int = 0, prefix_bias: float = 0.0, suffix_len: int = 0,
                             suffix_bias: float = 0.0, pooled_tail: bool = False) -> torch.Tensor:
    """The accurate path's numerics (backend ``triton_int8``) in fp64, the yardstick of its error:

    - K smoothing (``k - mean_t(k)`` per (b, h)); Q and K times the ``D x D`` Sylvester-Hadamard matrix
      (``Hd Hd^T = D I``, so the logits are unchanged in exact math);
    - Q to int8 with one absmax scale per row, K with one per 128 keys (nearest, ties to even: ties rounded
      one way would bias each channel, see ``_quant_int8.round_int8``);
    - per key tile of 128 keys (the pooled tail's pooled keys: tiles of 128 pooled keys after the real
      ones), ``P`` relative to the tile's own row maximum as uint8 levels ``round(255 * exp(s - m_tile))``; V to int8 with one absmax scale per channel; each tile's ``P8 @ V8`` and level sum weighted by
      ``exp(m_tile - m_row)``, ``O = sum / sum * v_scale``. The pooled tail's mean values get their own
      per-channel scale (a block mean is far smaller than V's extremes).

    Block size 128 (the kernel's). Independent of the Triton code (no shared helpers; the pooled tail's
    block means and weights are the reference module's). Shapes as :func:`sage_fp8_attention_emulation`."""
    if block_size != 128:
        raise ValueError(f"the INT8 path runs 128-token blocks, got block_size={block_size}")
    scale = softmax_scale(q.shape[-1], scale)
    dim, kv_len = q.shape[-1], k.shape[2]
    hmat = _sylvester(dim, q.device)
    q64, k64, v64 = q.double(), k.double(), v.double()
    k64 = k64 - k64.mean(dim=2, keepdim=True)
    qr = q64 @ hmat * (scale / dim)
    qq = int8_fake(qr, qr.abs().amax(dim=-1, keepdim=True))
    kq = int8_key_tiles(k64 @ hmat)
    scores = qq @ kq.transpose(-1, -2)
    add_key_biases(scores, prefix_len, prefix_bias, suffix_len, suffix_bias)
    rows = torch.arange(q.shape[2], device=q.device) // block_size
    if block_map is not None:
        cols = torch.arange(kv_len, device=q.device) // block_size
        scores = scores.masked_fill(~block_map.to(q.device)[..., rows, :][..., cols], float("-inf"))
    vmax = v64.abs().amax(dim=2, keepdim=True)
    vs = torch.where(vmax > 0, vmax / INT8_MAX, torch.ones_like(vmax))

    def tiles(s, x):  # pad the key axis to whole tiles of 128 (-inf logits, zero values)
        pad = (-s.shape[-1]) % 128
        return (torch.nn.functional.pad(s, (0, pad), value=float("-inf")),
                torch.nn.functional.pad(x, (0, 0, 0, pad)))

    v8 = torch.round(v64 / vs).clamp(-INT8_MAX, INT8_MAX)                # V in units of its scale
    scores, v8 = tiles(scores, v8)
    if pooled_tail and block_map is not None:
        kbar, vbar = pooled_key_blocks(k64, v64, block_size)
        weights = pooled_log_weights(kv_len, block_size, prefix_len, prefix_bias, suffix_len, suffix_bias,
                                     device=q.device)
        pooled = (qq @ int8_key_tiles(kbar @ hmat).transpose(-1, -2) + weights).masked_fill(
            block_map.to(q.device)[..., rows, :], float("-inf"))
        # the block means are far smaller than V's extremes: they get their own per-channel scale
        pooled, vbar = tiles(pooled, int8_fake(vbar, vbar.abs().amax(dim=2, keepdim=True)) / vs)
        scores = torch.cat([scores.expand(*pooled.shape[:2], -1, -1), pooled], dim=-1)
        v8 = torch.cat([v8, vbar], dim=2)
    st = scores.reshape(*scores.shape[:-1], -1, 128)                       # [B, H, Lq, T, 128]
    m_tile = st.amax(dim=-1, keepdim=True)
    levels = torch.round(torch.exp(st - m_tile.clamp_min(-1e300)) * 255.0)
    m_row = m_tile.amax(dim=-2, keepdim=True)
    weight = torch.exp(m_tile - m_row).nan_to_num(0.0)                     # a tile with no key: 0
    vt = v8.reshape(v8.shape[0], v8.shape[1], -1, 128, v8.shape[-1])      # [B, H, T, 128, D]
    acc = torch.einsum("bhqtk,bhtkd->bhqd", levels * weight, vt)
    return acc / (levels * weight).sum(dim=(-1, -2))[..., None] * vs


def error_stats(out: torch.Tensor, oracle: torch.Tensor) -> dict:
    """``{"cosine", "rel_l1", "max_abs"}`` of ``out`` against ``oracle`` (flattened, fp64)."""
    a, b = out.double().flatten(), oracle.double().flatten()
    return {
        "cosine": torch.nn.functional.cosine_similarity(a, b, dim=0).item(),
        "rel_l1": ((a - b).abs().sum() / b.abs().sum()).item(),
        "max_abs": (a - b).abs().max().item(),
    }
