"""Block-level measurement of feature reuse on a Wan-14B-shaped block (GPU; random weights).

``python -m benchmarks.feature_reuse_bench [--tokens 720p|480p] [--out results.json]`` (from the pack root) or
:func:`measure_block` from another benchmark.

One Wan DiT block as ComfyUI's ``WanAttentionBlock`` computes it (dim 5120, 40 heads x 128, FFN
13 824, adaLN modulation, RMS-normed q/k with RoPE rotations, text cross-attention over 512 tokens,
bf16 linears), on an 81-frame latent's token grid (720p: 21 x 45 x 80 = 75 600 tokens; 480p:
21 x 30 x 52 = 32 760). Variants, side by side in one process (CUDA-event medians):

- ``dense``: cuDNN SDPA self-attention;
- ``sparse``: ``chorus.kernels.block_sparse_attention(backend="auto")`` (Triton FP8 on sm_90) with a
  structured block map (3D-local band + first-frame columns + same position in other frames) of
  the stated density;
- ``sparse+fr`` / ``dense+fr``: feature reuse as the ComfyUI node runs it: the ``share`` most
  redundant regions (2x8x8 tokens, scored by ``region_detail`` of the dense block's update, frame
  0 never pooled) pooled 2x2x2; linears, cross-attention and FFN on the compact sequence;
  self-attention on q/k/v expanded back to the full grid (same sparse map); update upsampled.
- ``fr_record_overhead``: what a miss adds per block (region scores of the update, <= 256 channels).
- guidance (ChorusGuidanceBoost as on a hit's steps): text = cross-attention gain
  ``1 + 0.2 * strength``; image = first-frame logit bias ``log(1 + 0.2 * image_strength)`` in
  self-attention (inside the sparse kernel; a dense call takes it as an SDPA additive mask). Timed:
  the biased sparse and dense attention calls next to the unbiased ones.
- quality proxies vs the dense block output: relative L2 deviation over all tokens and over the
  first frame's tokens ("first-frame consistency"), without guidance and with text, image and both;
  and the first frame's share of the self-attention mass (mean over 512 evenly spaced queries and
  all heads, exact softmax in fp32) for dense, sparse, and sparse + the image bias. Random weights:
  these say how much each approximation moves a block's output, not how a trained model's video looks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from chorus.engine.feature_reuse import RECORD_CHANNELS, select_regions
from chorus.engine.guidance import GAIN_PER_STRENGTH, IMAGE_GAIN_PER_STRENGTH, image_biased_attention
from chorus.kernels import block_sparse_attention, pooling

from .timing import cuda_median_ms

GRIDS = {"720p": (21, 45, 80), "480p": (21, 30, 52)}


def _rope_rotations(grid, head_dim, device):
    """ComfyUI Wan RoPE as rotation matrices ``[1, L, 1, head_dim/2, 2, 2]`` (axes 44/42/42 of 128)."""
    d = head_dim
    axes = [d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)]
    T, H, W = grid
    ids = torch.stack(torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij"), -1)
    ids = ids.reshape(-1, 3).to(device=device, dtype=torch.float64)
    angles = []
    for i, dim in enumerate(axes):
        omega = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))
        angles.append(ids[:, i:i + 1] * omega)
    ang = torch.cat(angles, -1)
    rot = torch.stack([torch.cos(ang), -torch.sin(ang), torch.sin(ang), torch.cos(ang)], -1)
    return rot.view(1, ang.shape[0], 1, ang.shape[1], 2, 2).float()


def _apply_rope(x, rot):
    x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    out = rot[..., 0] * x_[..., 0] + rot[..., 1] * x_[..., 1]
    return out.reshape(*x.shape).type_as(x)


class WanBlock(torch.nn.Module):
    """A Wan DiT block (ComfyUI ``WanAttentionBlock`` math, text cross-attention only)."""

    def __init__(self, dim=5120, heads=40, ffn=13824, dtype=torch.bfloat16, device="cuda", seed=0):
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(seed)

        def lin(i, o):
            layer = torch.nn.Linear(i, o, device=device, dtype=dtype)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(o, i, generator=g) / math.sqrt(i))
                layer.bias.zero_()
            return layer

        self.dim, self.heads = dim, heads
        self.q, self.k, self.v, self.o = (lin(dim, dim) for _ in range(4))
        self.cq, self.ck, self.cv, self.co = (lin(dim, dim) for _ in range(4))
        self.f1, self.f2 = lin(dim, ffn), lin(ffn, dim)
        self.norm_q = torch.nn.RMSNorm(dim, eps=1e-6, device=device, dtype=dtype)
        self.norm_k = torch.nn.RMSNorm(dim, eps=1e-6, device=device, dtype=dtype)
        self.norm_cq = torch.nn.RMSNorm(dim, eps=1e-6, device=device, dtype=dtype)
        self.norm_ck = torch.nn.RMSNorm(dim, eps=1e-6, device=device, dtype=dtype)
        self.norm3 = torch.nn.LayerNorm(dim, eps=1e-6, device=device, dtype=dtype)
        self.modulation = torch.nn.Parameter(
            (torch.randn(1, 6, dim, generator=g) * 0.1).to(device=device, dtype=dtype))

    def forward(self, x, e, rot, context, attention, cross_gain=1.0):
        """``attention(q, k, v)`` on ``[B, L, H*D]`` returns ``[B, L, H*D]`` (the override's layout)."""
        b, s, _ = x.shape
        n, d = self.heads, self.dim // self.heads
        mod = (self.modulation + e).chunk(6, dim=1)
        h = torch.addcmul(mod[0], F.layer_norm(x, (self.dim,), eps=1e-6), 1 + mod[1])
        q = _apply_rope(self.norm_q(self.q(h)).view(b, s, n, d), rot)
        k = _apply_rope(self.norm_k(self.k(h)).view(b, s, n, d), rot)
        y = attention(q.view(b, s, n * d), k.view(b, s, n * d), self.v(h))
        x = torch.addcmul(x, self.o(y), mod[2])
        hc = self.norm3(x)
        cq = self.norm_cq(self.cq(hc))
        ck, cv = self.norm_ck(self.ck(context)), self.cv(context)
        c = _sdpa(cq, ck, cv, n)
        if cross_gain != 1.0:
            c = c * cross_gain
        x = x + self.co(c)
        h = torch.addcmul(mod[3], F.layer_norm(x, (self.dim,), eps=1e-6), 1 + mod[4])
        return torch.addcmul(x, self.f2(F.gelu(self.f1(h), approximate="tanh")), mod[5])


def _sdpa(q, k, v, heads):
    b, lq, w = q.shape
    d = w // heads
    out = F.scaled_dot_product_attention(q.view(b, lq, heads, d).transpose(1, 2),
                                         k.view(b, -1, heads, d).transpose(1, 2),
                                         v.view(b, -1, heads, d).transpose(1, 2))
    return out.transpose(1, 2).reshape(b, lq, w)


def _dense_attention(heads):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            return _sdpa(q, k, v, heads)
    return run


def _sparse_attention(heads, block_map, backend, prefix_len=0, prefix_bias=0.0):
    def run(q, k, v):
        b, s, w = q.shape
        d = w // heads
        t = [u.view(b, s, heads, d).transpose(1, 2) for u in (q, k, v)]
        out = block_sparse_attention(*t, block_map, backend=backend, prefix_len=prefix_len, prefix_bias=prefix_bias)
        return out.transpose(1, 2).reshape(b, s, w)
    return run


def _dense_biased_attention(heads, prefix_len, bias):
    def run(q, k, v):
        b, s, w = q.shape
        d = w // heads
        t = [u.view(b, s, heads, d).transpose(1, 2) for u in (q, k, v)]
        return image_biased_attention(*t, prefix_len, bias).transpose(1, 2).reshape(b, s, w)
    return run


def first_frame_share(q, k, heads, first, block_map=None, bias=0.0, rows=512, block_size=128) -> float:
    """Mean share of the softmax mass on keys ``[0, first)`` over ``rows`` evenly spaced queries and all
    heads (q/k ``[1, L, H*D]``; exact fp32 softmax, optional block map ``[1, 1, Qb, Kb]`` and bias)."""
    b, L, w = q.shape
    d = w // heads
    idx = torch.linspace(0, L - 1, rows, device=q.device).round().long()
    qh = q[0, idx].view(rows, heads, d).transpose(0, 1).float()
    kh = k[0].view(L, heads, d).transpose(0, 1).float()
    keep = None
    if block_map is not None:
        keep = block_map[0, 0][idx // block_size][:, torch.arange(L, device=q.device) // block_size]
    shares = []
    for h0 in range(0, heads, 8):
        logits = qh[h0:h0 + 8] @ kh[h0:h0 + 8].transpose(-1, -2) / math.sqrt(d)
        if bias:
            logits[..., :first] += bias
        if keep is not None:
            logits = logits.masked_fill(~keep, float("-inf"))
        p = torch.softmax(logits, -1)
        shares.append(p[..., :first].sum(-1).flatten())
    return float(torch.cat(shares).mean())


def structured_map(grid, block_size=128, density=0.15, device="cuda"):
    """Bool ``[1, 1, Qb, Kb]``: first-frame key blocks + the same position in other frames (+-1 block)
    + a diagonal band widened until the density is reached (the shapes trained video DiTs show)."""
    T, H, W = grid
    L = T * H * W
    nb = -(-L // block_size)
    per_frame = H * W / block_size
    i = torch.arange(nb, device=device)[:, None]
    j = torch.arange(nb, device=device)[None, :]
    first = j < math.ceil(H * W / block_size)
    phase = ((i - j).abs().float() % per_frame)
    same_pos = (phase <= 1.0) | (phase >= per_frame - 1.0)
    base = first | same_pos
    for width in range(0, nb):
        m = base | ((i - j).abs() <= width)
        if float(m.float().mean()) >= density:
            return m[None, None]
    return torch.ones(1, 1, nb, nb, dtype=torch.bool, device=device)


def _smooth_input(grid, dim, device, dtype, seed=0):
    """Block input with low-frequency content over (t, h, w) plus a textured quarter of the frame."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    T, H, W = grid
    pos = torch.stack(torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).float().to(device)
    freqs = (torch.rand(3, dim, generator=g) * torch.tensor([[0.3], [0.2], [0.2]])).to(device)
    phase = (torch.rand(dim, generator=g) * 6.28).to(device)
    x = torch.sin(pos @ freqs + phase)
    textured = (pos[:, 2] < W / 4)[:, None]
    x = x + textured * torch.randn(x.shape, generator=torch.Generator(device=device).manual_seed(seed), device=device)
    return x[None].to(dtype)


def measure_block(grid=GRIDS["720p"], *, density=0.15, share=0.25, reps=5, backend="auto", strength=0.5,
                  image_strength=0.5, dim=5120, heads=40, ffn=13824, device="cuda", log=print) -> dict:
    """Run the variants of the module docstring on one block; returns a JSON-able dict (times in ms)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    L = grid[0] * grid[1] * grid[2]
    block = WanBlock(dim, heads, ffn, dtype, device)
    x = _smooth_input(grid, dim, device, dtype)
    e = (torch.randn(1, 6, dim, device=device) * 0.1).to(dtype)
    context = torch.randn(1, 512, dim, device=device, dtype=dtype)
    rot = _rope_rotations(grid, dim // heads, device)
    block_map = structured_map(grid, density=density, device=device)
    first = grid[1] * grid[2]
    image_bias = math.log1p(IMAGE_GAIN_PER_STRENGTH * image_strength)
    dense_attn = _dense_attention(heads)
    sparse_attn = _sparse_attention(heads, block_map, backend)
    sparse_attn_biased = _sparse_attention(heads, block_map, backend, first, image_bias)
    dense_attn_biased = _dense_biased_attention(heads, first, image_bias)
    device_name = torch.cuda.get_device_name() if str(device).startswith("cuda") else str(device)
    res = {"grid": list(grid), "tokens": L, "dim": dim, "heads": heads, "ffn": ffn, "share": share,
           "map_density": float(block_map.float().mean()), "device": device_name, "torch": torch.__version__,
           "backend": backend}

    captured = {}

    def capture(q, k, v):
        captured["q"], captured["k"] = q, k
        return dense_attn(q, k, v)

    with torch.no_grad():
        dense_out = block(x, e, rot, context, capture)
        # region scores from the dense run (what a miss records), then the hit's layout
        detail = pooling.region_detail(dense_out - x, grid, (2, 8, 8), (2, 2, 2))
        regions = select_regions(1.0 - detail.cpu(), grid, (2, 8, 8), share)
        layout = pooling.build_layout(grid, (2, 8, 8), (2, 2, 2), regions, device=device)
        rot_c = pooling.pool_rotations(rot, layout)
        res.update(regions=int(regions.numel()), compact_tokens=layout.compact_length,
                   token_ratio=layout.compact_length / L)

        def expanded(attn):
            def run(q, k, v):
                full = [pooling.expand_tokens(t, layout) for t in (q, k, v)]
                return pooling.compact_rows(attn(*full), layout)
            return run

        def with_fr(attn, gain=1.0):
            x_c = pooling.pool_tokens(x, layout)
            y_c = block(x_c, e, rot_c, context, expanded(attn), gain)
            return pooling.unpool_residual(x, x_c, y_c, layout)

        gain = 1.0 + GAIN_PER_STRENGTH * strength
        stride = max(1, dim // RECORD_CHANNELS)
        variants = {
            "dense": lambda: block(x, e, rot, context, dense_attn),
            "sparse": lambda: block(x, e, rot, context, sparse_attn),
            "sparse+fr": lambda: with_fr(sparse_attn),
            "dense+fr": lambda: with_fr(dense_attn),
            "attention_dense": lambda: dense_attn(*(torch.randn(1, L, dim, device=device, dtype=dtype),) * 3),
            "attention_sparse": lambda: sparse_attn(*(torch.randn(1, L, dim, device=device, dtype=dtype),) * 3),
            "attention_sparse_first_frame_bias": lambda: sparse_attn_biased(
                *(torch.randn(1, L, dim, device=device, dtype=dtype),) * 3),
            "attention_dense_first_frame_bias": lambda: dense_attn_biased(
                *(torch.randn(1, L, dim, device=device, dtype=dtype),) * 3),
            "sparse+fr+guidance": lambda: with_fr(sparse_attn_biased, gain),
            "fr_pool_unpool_overhead": lambda: pooling.unpool_residual(x, pooling.pool_tokens(x, layout),
                                                                       pooling.pool_tokens(x, layout), layout),
            # the same with the torch implementation (the fused Triton kernels' reference), side by side
            "fr_pool_unpool_overhead_torch": lambda: pooling.unpool_residual_torch(
                x, pooling.pool_tokens_torch(x, layout), pooling.pool_tokens_torch(x, layout), layout),
            # the miss path's extra work per block: region scores from a <= 256-channel subset
            "fr_record_overhead": lambda: pooling.region_detail(
                dense_out[..., ::stride] - x[..., ::stride], grid, (2, 8, 8), (2, 2, 2)),
        }
        times = {}
        for name, fn in variants.items():
            try:
                times[name] = cuda_median_ms(fn, reps)
                log(f"{name}: {times[name]:.2f} ms")
            except Exception as exc:  # noqa: BLE001 - report what ran
                times[name] = None
                log(f"{name}: failed ({type(exc).__name__}: {exc})")
        res["ms"] = times
        if times.get("dense") and times.get("sparse") and times.get("sparse+fr"):
            res["speedup_sparse_vs_dense"] = times["dense"] / times["sparse"]
            res["speedup_sparse_fr_vs_sparse"] = times["sparse"] / times["sparse+fr"]
            res["speedup_sparse_fr_vs_dense"] = times["dense"] / times["sparse+fr"]

        ref = dense_out.float()
        upd = (dense_out - x).float()

        def quality(out):
            dev = (out.float() - ref)
            return {"rel_dev_update": float(dev.norm() / upd.norm()),
                    "rel_dev_update_first_frame": float(dev[:, :first].norm() / upd[:, :first].norm())}

        q = {}
        for name, fn in (("sparse", lambda: block(x, e, rot, context, sparse_attn)),
                         ("sparse+image", lambda: block(x, e, rot, context, sparse_attn_biased)),
                         ("sparse+fr", lambda: with_fr(sparse_attn)),
                         ("sparse+fr+text", lambda: with_fr(sparse_attn, gain)),
                         ("sparse+fr+image", lambda: with_fr(sparse_attn_biased)),
                         ("sparse+fr+text+image", lambda: with_fr(sparse_attn_biased, gain)),
                         ("dense+fr", lambda: with_fr(dense_attn))):
            try:
                q[name] = quality(fn())
            except Exception as exc:  # noqa: BLE001
                q[name] = f"failed: {type(exc).__name__}: {exc}"
        res["quality"] = q
        qk = captured["q"], captured["k"]
        res["first_frame_attention_share"] = {
            "dense": first_frame_share(*qk, heads, first),
            "sparse": first_frame_share(*qk, heads, first, block_map),
            "sparse+image": first_frame_share(*qk, heads, first, block_map, image_bias),
            "dense+image": first_frame_share(*qk, heads, first, None, image_bias),
        }
        log(f"quality: {json.dumps(q)}; first-frame share: {json.dumps(res['first_frame_attention_share'])}")
        res["guidance_gain"] = gain
        res["image_bias"] = image_bias
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", choices=sorted(GRIDS), nargs="+", default=["720p"])
    p.add_argument("--density", type=float, default=0.15)
    p.add_argument("--share", type=float, default=0.25)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--backend", default="auto")
    p.add_argument("--strength", type=float, default=0.5, help="guidance text strength (cross-attention gain)")
    p.add_argument("--image-strength", type=float, default=0.5, help="guidance image strength (first-frame bias)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for name in a.tokens:
        t0 = time.time()
        r = measure_block(GRIDS[name], density=a.density, share=a.share, reps=a.reps, backend=a.backend,
                          strength=a.strength, image_strength=a.image_strength)
        r["name"], r["wall_s"] = name, time.time() - t0
        print(json.dumps(r, indent=1))
        results.append(r)
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
