"""A faithful Wan 2.2 A14B expert (the DiT of Wan 2.1/2.2 14B) for speed measurements, random weights.

Per block, the computation of ComfyUI's ``WanAttentionBlock`` / diffusers' ``WanTransformerBlock``:
AdaLN modulation from 6 rows (``scale_shift_table + time embedding``); self-attention with fused
q/k/v projections, RMS norm across heads on q and k, Wan's 3-axis RoPE (head dim 128 split 44/42/42)
and the output projection, added through the gate; cross-attention on 512 text tokens (affine
LayerNorm, q/k/v/o projections, RMS norms); a GELU(tanh) feed-forward of width 13 824 added through
its gate. Every linear has a bias. Around the blocks: the patch embedding (1x2x2 patches of the
36-channel I2V input), time embedding + its 6-row projection, text embedding, and the head.

Two precisions for the linears:

* ``bf16``: ``torch.nn.functional.linear`` on bf16 weights (cuBLAS);
* ``fp8``: weights quantised once to e4m3 with one scale per output channel, activations quantised
  per token by fused Triton kernels (LayerNorm + modulation + quantise in one pass; GELU + quantise
  in one pass; plain quantise), then ``torch._scaled_mm`` with row-wise scales, bf16 output. On a
  CPU (tests) the same quantisation is emulated in torch.

Self-attention is a callable ``attn(q, k, v, layer) -> o`` with ``[1, H, L, D]`` tensors (views of
the ``[1, L, H, D]`` projections, as ComfyUI passes them), so that the benchmark can route it
through the engine. Weights are created directly on the target device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class WanShape:
    dim: int = 5120
    heads: int = 40
    ffn: int = 13824
    layers: int = 40
    in_dim: int = 36
    out_dim: int = 16
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


A14B = WanShape()


# ---------------------------------------------------------------------------------------------
# FP8 quantisation (fused Triton kernels on CUDA, torch emulation elsewhere)
# ---------------------------------------------------------------------------------------------
_TRITON = None


def _triton_kernels():
    global _TRITON
    if _TRITON is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _row_quant(x_ptr, y_ptr, s_ptr, shift_ptr, scale_ptr, n_cols, eps,
                       MODE: tl.constexpr, BLOCK: tl.constexpr, OUT_FP8: tl.constexpr):
            # MODE 0: quantise; 1: LayerNorm (no affine) * (1 + scale) + shift, then quantise;
            # 2: GELU(tanh), then quantise. One program per row; fp32 math; e4m3 out + row scale.
            row = tl.program_id(0).to(tl.int64)
            offs = tl.arange(0, BLOCK)
            mask = offs < n_cols
            x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
            if MODE == 1:
                mean = tl.sum(x, axis=0) / n_cols
                xc = tl.where(mask, x - mean, 0.0)
                var = tl.sum(xc * xc, axis=0) / n_cols
                sc = tl.load(scale_ptr + offs, mask=mask, other=0.0)
                sh = tl.load(shift_ptr + offs, mask=mask, other=0.0)
                x = xc * tl.rsqrt(var + eps) * (1.0 + sc) + sh
            if MODE == 2:
                inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
                x = 0.5 * x * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
            x = tl.where(mask, x, 0.0)
            if OUT_FP8:
                amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)
                s = amax / 448.0
                tl.store(y_ptr + row * n_cols + offs, (x / s).to(tl.float8e4nv), mask=mask)
                tl.store(s_ptr + row, s)
            else:
                tl.store(y_ptr + row * n_cols + offs, x.to(tl.bfloat16), mask=mask)

        @triton.jit
        def _rms_rope(x_ptr, y_ptr, w_ptr, cos_ptr, sin_ptr, x_stride, n_cols, eps,
                      HALF_D: tl.constexpr, BLOCK: tl.constexpr):
            # One token row of q or k: RMS norm across all heads (weight), then Wan's interleaved
            # RoPE per head (pair p of head h uses angle index p); bf16 out [L, H*D] contiguous.
            row = tl.program_id(0).to(tl.int64)
            pair = tl.arange(0, BLOCK)
            mask = pair < n_cols // 2
            xe = tl.load(x_ptr + row * x_stride + 2 * pair, mask=mask, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + row * x_stride + 2 * pair + 1, mask=mask, other=0.0).to(tl.float32)
            r = tl.rsqrt((tl.sum(xe * xe, axis=0) + tl.sum(xo * xo, axis=0)) / n_cols + eps)
            xe = xe * r * tl.load(w_ptr + 2 * pair, mask=mask, other=0.0)
            xo = xo * r * tl.load(w_ptr + 2 * pair + 1, mask=mask, other=0.0)
            idx = pair % HALF_D
            c = tl.load(cos_ptr + row * HALF_D + idx, mask=mask, other=0.0)
            sn = tl.load(sin_ptr + row * HALF_D + idx, mask=mask, other=0.0)
            tl.store(y_ptr + row * n_cols + 2 * pair, (xe * c - xo * sn).to(tl.bfloat16), mask=mask)
            tl.store(y_ptr + row * n_cols + 2 * pair + 1, (xe * sn + xo * c).to(tl.bfloat16), mask=mask)

        @triton.jit
        def _gated_add(x_ptr, y_ptr, g_ptr, out_ptr, n_cols, y_stride, BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            offs = tl.arange(0, BLOCK)
            mask = offs < n_cols
            x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + row * y_stride + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0)
            tl.store(out_ptr + row * n_cols + offs, (x + y * g).to(tl.bfloat16), mask=mask)

        _TRITON = {"row": _row_quant, "rms_rope": _rms_rope, "gated_add": _gated_add}
    return _TRITON


def quantize_rows(x: torch.Tensor, mode: int = 0, shift=None, scale=None, eps: float = 1e-6):
    """``x`` bf16 ``[M, N]`` -> (e4m3 ``[M16, N]``, fp32 ``[M16, 1]`` scales, ``M``) after ``mode`` (see
    the kernel). ``M16`` is ``M`` rounded up to a multiple of 16 (``torch._scaled_mm`` needs it; 480p
    has 32 760 tokens): the pad rows are zeros with scale 1 and are sliced off after the GEMM."""
    m, n = x.shape
    m16 = -(-m // 16) * 16
    if x.is_cuda:
        import triton

        y = torch.empty(m16, n, device=x.device, dtype=FP8)
        s = torch.empty(m16, 1, device=x.device, dtype=torch.float32)
        if m16 > m:
            y[m:].zero_()
            s[m:].fill_(1.0)
        block = triton.next_power_of_2(n)
        _triton_kernels()["row"][(m,)](x.contiguous(), y, s, shift if shift is not None else s,
                                       scale if scale is not None else s, n, eps, MODE=mode, BLOCK=block,
                                       OUT_FP8=True, num_warps=16 if block >= 8192 else 8)
        return y, s, m
    xf = x.float()
    if mode == 1:
        xf = F.layer_norm(xf, (n,), eps=eps) * (1 + scale) + shift
    elif mode == 2:
        xf = F.gelu(xf, approximate="tanh")
    s = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (xf / s).to(FP8), s, m


def layer_norm_mod(x: torch.Tensor, shift, scale, eps: float, fused: bool) -> torch.Tensor:
    """bf16 ``LayerNorm(x) * (1 + scale) + shift`` (fp32 math), one Triton pass when ``fused``."""
    if fused and x.is_cuda:
        import triton

        m, n = x.shape
        y = torch.empty_like(x)
        block = triton.next_power_of_2(n)
        _triton_kernels()["row"][(m,)](x, y, shift, shift, scale, n, eps, MODE=1, BLOCK=block, OUT_FP8=False,
                                       num_warps=16 if block >= 8192 else 8)
        return y
    return (F.layer_norm(x.float(), (x.shape[1],), eps=eps) * (1 + scale) + shift).to(torch.bfloat16)


def rms_rope(x: torch.Tensor, weight, rope, heads: int, eps: float, fused: bool) -> torch.Tensor:
    """``x`` ``[L, H*D]`` (a view with any row stride) -> RMS norm across heads, Wan RoPE -> ``[L, H, D]``."""
    L, n = x.shape
    if fused and x.is_cuda:
        import triton

        y = torch.empty(L, n, device=x.device, dtype=torch.bfloat16)
        half = rope[0].shape[-1]
        block = triton.next_power_of_2(n // 2)
        _triton_kernels()["rms_rope"][(L,)](x, y, weight, rope[0], rope[1], x.stride(0), n, eps, HALF_D=half,
                                            BLOCK=block, num_warps=8)
        return y.view(L, heads, -1)
    return apply_rope(rms_norm(x, weight, eps).view(L, heads, -1), *rope)


def gated_add(x: torch.Tensor, y: torch.Tensor, gate, fused: bool) -> torch.Tensor:
    """bf16 ``x + y * gate`` computed in fp32 (Wan's residual); one Triton pass when ``fused``."""
    if fused and x.is_cuda:
        import triton

        m, n = x.shape
        out = torch.empty_like(x)
        _triton_kernels()["gated_add"][(m,)](x, y, gate, out, n, y.stride(0), BLOCK=triton.next_power_of_2(n),
                                             num_warps=8)
        return out
    return (x.float() + y.float() * gate).to(torch.bfloat16)


_BIAS_IN_SCALED_MM = True


class Linear:
    """A linear layer in bf16 or FP8 (``[out, in]`` weight, bias) created on ``device``."""

    def __init__(self, n_in: int, n_out: int, device, gen=None):
        std = 1.0 / math.sqrt(n_in)
        self.weight = (torch.randn(n_out, n_in, device=device, dtype=torch.bfloat16, generator=gen) * std)
        self.bias = (torch.randn(n_out, device=device, dtype=torch.bfloat16, generator=gen) * 0.02)
        self.w8 = self.w_scale = None

    def to_fp8(self, drop_bf16: bool = False) -> None:
        w = self.weight.float()
        self.w_scale = (w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX).t().contiguous()  # [1, out]
        self.w8 = (w / self.w_scale.t()).to(FP8)
        del w
        if drop_bf16:
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def fp8(self, x8: torch.Tensor, s: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """``x8`` e4m3 ``[M16, in]`` with row scales ``s`` ``[M16, 1]`` -> bf16 ``[rows, out]``."""
        if x8.is_cuda:
            return self._fp8_cuda(x8, s)[:rows]
        y = (x8.float() * s) @ (self.w8.float() * self.w_scale.t()).t()
        return (y + self.bias.float()).to(torch.bfloat16)[:rows]

    def _fp8_cuda(self, x8, s):
        global _BIAS_IN_SCALED_MM
        if _BIAS_IN_SCALED_MM:
            try:
                return torch._scaled_mm(x8, self.w8.t(), scale_a=s, scale_b=self.w_scale, bias=self.bias,
                                        out_dtype=torch.bfloat16)
            except RuntimeError:  # a build without bias support for row-wise scales
                _BIAS_IN_SCALED_MM = False
        return torch._scaled_mm(x8, self.w8.t(), scale_a=s, scale_b=self.w_scale, out_dtype=torch.bfloat16) + self.bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def rope_tables(grid, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan RoPE cos/sin ``[L, 1, head_dim/2]`` (fp32) for a token grid (t, h, w)."""
    d_t = head_dim - 4 * (head_dim // 6)
    d_h = d_w = 2 * (head_dim // 6)
    t, h, w = grid
    parts = []
    for n, d in ((t, d_t), (h, d_h), (w, d_w)):
        freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float64) / d))
        parts.append(torch.outer(torch.arange(n, device=device, dtype=torch.float64), freqs))
    ang = torch.cat([parts[0][:, None, None].expand(t, h, w, -1), parts[1][None, :, None].expand(t, h, w, -1),
                     parts[2][None, None, :].expand(t, h, w, -1)], dim=-1).reshape(t * h * w, 1, -1)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[L, H, D]`` (interleaved pairs, Wan convention) rotated; returns x's dtype."""
    xf = x.float().unflatten(-1, (-1, 2))
    x1, x2 = xf[..., 0], xf[..., 1]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(x.dtype)


class WanBlockWeights:
    def __init__(self, s: WanShape, device, gen=None):
        d = s.dim
        self.qkv = Linear(d, 3 * d, device, gen)
        self.o = Linear(d, d, device, gen)
        self.cq, self.ck, self.cv, self.co = (Linear(d, d, device, gen) for _ in range(4))
        self.f1 = Linear(d, s.ffn, device, gen)
        self.f2 = Linear(s.ffn, d, device, gen)
        ones = lambda: torch.ones(d, device=device, dtype=torch.float32)  # noqa: E731
        self.norm_q, self.norm_k, self.norm_cq, self.norm_ck = ones(), ones(), ones(), ones()
        self.norm2_w, self.norm2_b = ones(), torch.zeros(d, device=device, dtype=torch.float32)
        self.table = torch.randn(6, d, device=device, dtype=torch.float32, generator=gen) / math.sqrt(d)

    def linears(self):
        return (self.qkv, self.o, self.cq, self.ck, self.cv, self.co, self.f1, self.f2)


class WanExpert:
    """One A14B expert: ``layers`` blocks plus embeddings and head; weights made on ``device``."""

    def __init__(self, s: WanShape, device, seed: int = 0, layers: int | None = None):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.s = s
        self.patch = Linear(s.in_dim * 4, s.dim, device, gen)
        self.time1, self.time2 = Linear(s.freq_dim, s.dim, device, gen), Linear(s.dim, s.dim, device, gen)
        self.time_proj = Linear(s.dim, 6 * s.dim, device, gen)
        self.text1, self.text2 = Linear(s.text_dim, s.dim, device, gen), Linear(s.dim, s.dim, device, gen)
        self.head = Linear(s.dim, s.out_dim * 4, device, gen)
        self.head_table = torch.randn(2, s.dim, device=device, dtype=torch.float32, generator=gen) / math.sqrt(s.dim)
        self.blocks = [WanBlockWeights(s, device, gen) for _ in range(s.layers if layers is None else layers)]
        self._ones = torch.ones(s.dim, device=device, dtype=torch.float32)
        self.fused = False   # True: fused Triton kernels for the norm/RoPE/residual elementwise work

    def to_fp8(self, drop_bf16: bool = False) -> None:
        for b in self.blocks:
            for lin in b.linears():
                lin.to_fp8(drop_bf16)

    # -- pieces ------------------------------------------------------------------------------
    def embed(self, latent_tokens: torch.Tensor, sigma: float, text: torch.Tensor):
        """Patch tokens ``[L, 144]`` bf16, sigma, text ``[512, 4096]`` -> (x, e6 ``[6, dim]`` fp32, ctx)."""
        s = self.s
        x = self.patch(latent_tokens)
        half = s.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device, dtype=torch.float64) / half)
        t = 1000.0 * sigma * freqs
        temb = torch.cat([t.cos(), t.sin()]).to(torch.bfloat16)[None]
        temb = self.time2(F.silu(self.time1(temb)))
        e6 = self.time_proj(F.silu(temb)).float().view(6, s.dim)
        ctx = self.text2(F.gelu(self.text1(text), approximate="tanh"))
        return x, e6, temb.float()[0], ctx

    def head_out(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.head_table + temb[None]).unbind(0)
        h = (F.layer_norm(x.float(), (self.s.dim,), eps=self.s.eps) * (1 + scale) + shift).to(torch.bfloat16)
        return self.head(h)

    def block(self, i: int, x: torch.Tensor, e6: torch.Tensor, ctx: torch.Tensor, rope, attn, precision: str,
              timer=None) -> torch.Tensor:
        """One block on ``x`` ``[L, dim]`` bf16. ``attn(q, k, v, layer)`` on ``[1, H, L, D]`` views;
        ``timer``: optional ``(start_event, end_event)`` recorded around self-attention."""
        s, w = self.s, self.blocks[i]
        L, d, H, D = x.shape[0], s.dim, s.heads, s.head_dim
        shift, scale, gate, c_shift, c_scale, c_gate = (w.table + e6).unbind(0)
        fp8 = precision == "fp8"
        fz = self.fused
        qkv = w.qkv.fp8(*quantize_rows(x, 1, shift, scale, s.eps)) if fp8 else \
            w.qkv(layer_norm_mod(x, shift, scale, s.eps, fz))
        q, k, v = qkv.view(L, 3, d).unbind(1)
        q = rms_rope(q, w.norm_q, rope, H, s.eps, fz)
        k = rms_rope(k, w.norm_k, rope, H, s.eps, fz)
        v = v.view(L, H, D)
        if timer is not None:
            timer[0].record()
        o = attn(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2), i)
        if timer is not None:
            timer[1].record()
        o = o.transpose(1, 2).reshape(L, d)
        y = w.o.fp8(*quantize_rows(o)) if fp8 else w.o(o)
        x = gated_add(x, y, gate, fz)
        # cross-attention on the text tokens (affine LayerNorm = LN * (1 + (w - 1)) + b)
        cq = w.cq.fp8(*quantize_rows(x, 1, w.norm2_b, w.norm2_w - 1.0, s.eps)) if fp8 else \
            w.cq(layer_norm_mod(x, w.norm2_b, w.norm2_w - 1.0, s.eps, fz))
        cq = rms_norm(cq, w.norm_cq, s.eps).view(1, L, H, D).transpose(1, 2)
        ck = rms_norm(w.ck(ctx), w.norm_ck, s.eps).view(1, -1, H, D).transpose(1, 2)
        cv = w.cv(ctx).view(1, -1, H, D).transpose(1, 2)
        co = F.scaled_dot_product_attention(cq, ck, cv).transpose(1, 2).reshape(L, d)
        x = gated_add(x, w.co.fp8(*quantize_rows(co)) if fp8 else w.co(co), self._ones, fz)
        # feed-forward
        if fp8:
            f = w.f1.fp8(*quantize_rows(x, 1, c_shift, c_scale, s.eps))
            y = w.f2.fp8(*quantize_rows(f, 2))
        else:
            y = w.f2(F.gelu(w.f1(layer_norm_mod(x, c_shift, c_scale, s.eps, fz)), approximate="tanh"))
        return gated_add(x, y, c_gate, fz)


def patchify(latent: torch.Tensor) -> torch.Tensor:
    """``[C, T, H, W]`` -> ``[T*(H/2)*(W/2), C*4]`` (1x2x2 patches, frame-major token order)."""
    c, t, h, w = latent.shape
    return latent.view(c, t, h // 2, 2, w // 2, 2).permute(1, 2, 4, 0, 3, 5).reshape(t * (h // 2) * (w // 2), c * 4)
