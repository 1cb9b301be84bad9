"""End-to-end deviation from dense through the real engine on a tiny diffusers Wan 2.2 A14B pair.

Two tiny random ``WanTransformer3DModel`` experts (in_dim 36: noise + mask + image latent, like Wan
2.2 A14B I2V) are patched with ``chorus.hosts.diffusers.patch_diffusers_wan`` and sampled with 4 flow-matching
Euler steps (2 on the high-noise expert, 2 on the low-noise one). Random weights give nearly uniform
attention, so the self-attention projections get a *structured init*: RoPE-aligned q/k biases (per
head amplitudes over Wan's rotary pairs: a narrow and a wide 3D-local head, a same-position-in-other-
frames head and a whole-frame head) with per-head sharpness, on top of the random content weights,
and self-attention gates near 1.
The start image is encoded by a tiny random ``AutoencoderKLWan`` (first frame only, the rest zeros,
as Wan I2V conditions), the prompt by hashed n-grams into the text width; decoded frames come from
the same VAE. Labels in reports: ``"tiny diffusers Wan 2.2 A14B-shaped pair, random weights with
RoPE-aligned q/k bias init"``.

With real weights (``transformer_dirs`` = two diffusers Wan transformer folders, high then low, or
one folder for a single-expert model, and optionally ``vae_dir``) the same code runs them instead
and the report says so.

Per request pair (entry, query): the entry runs as a miss (dense + recording through the engine)
and is committed to a workspace; the query runs dense (unpatched) and with the reused masks
(retrieval with ``force`` = threshold 0, so that every family's cost of reuse is measured; whether
it would be a hit at the real threshold is reported beside it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from chorus.cache_store.embedders import hashed_text_vector
from chorus.engine import ChorusAttention, SparseConfig, commit_plan, retrieve_plan, wan_model_info
from chorus.engine.feature_reuse import FeatureReuse
from chorus.engine.guidance import GuidanceBoost
from chorus.hosts.diffusers import patch_diffusers_feature_reuse, patch_diffusers_guidance, patch_diffusers_wan

from .harness import psnr

TINY_LABEL = "tiny diffusers Wan 2.2 A14B-shaped pair, random weights with RoPE-aligned q/k bias init"


@dataclass(frozen=True)
class TinyConfig:
    latent_grid: tuple = (5, 16, 24)     # latent (T, H, W); tokens (T, H/2, W/2)
    heads: int = 4
    head_dim: int = 64
    layers: int = 2
    text_dim: int = 64
    text_tokens: int = 16
    ffn_dim: int = 256
    shift: float = 5.0
    steps: int = 4
    high_steps: int = 2
    block_size: int = 32
    decode: bool = True
    seed: int = 0

    @property
    def sigmas(self) -> list[float]:
        lin = np.linspace(1.0, 0.0, self.steps + 1)
        return [float(self.shift * s / (1 + (self.shift - 1) * s)) for s in lin]


def _rope_amplitudes(head_dim: int, kind: str, width: float) -> torch.Tensor:
    h_dim = w_dim = 2 * (head_dim // 6)
    t_dim = head_dim - h_dim - w_dim
    use = {"local_narrow": (1, 1, 1), "local_wide": (1, 1, 1), "temporal": (0, 1, 1), "frame": (1, 0, 0)}[kind]
    amps = []
    for axis, dim in enumerate((t_dim, h_dim, w_dim)):
        f = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        amps.append(f * torch.exp(-0.5 * (f * width) ** 2) * use[axis])
    a = torch.cat(amps).sqrt()
    return a / a.norm()


def structure_init(model, seed: int = 0, bias_norm: float = 10.0) -> None:
    """RoPE-aligned q/k biases and per-head sharpness on every block's self-attention (in place).

    A pair ``(a, 0)`` rotated by RoPE gives ``q_i . k_j = sum a^2 cos(omega (p_i - p_j))``: a local
    window; heads differ in width and axes (module docstring)."""
    gen = torch.Generator().manual_seed(seed * 7 + 1)
    kinds = ("local_narrow", "local_wide", "temporal", "frame")
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn1
            heads = attn.heads
            head_dim = attn.to_q.out_features // heads
            bias = torch.zeros(heads, head_dim, dtype=torch.float64)
            gain = torch.ones(heads, head_dim, dtype=torch.float64)
            for h in range(heads):
                kind = kinds[h % len(kinds)]
                width = {"local_narrow": 1.2, "local_wide": 3.0, "temporal": 1.0, "frame": 0.8}[kind]
                width *= 0.8 + 0.4 * float(torch.rand((), generator=gen))
                amp = _rope_amplitudes(head_dim, kind, width)
                bias[h, 0::2] = bias_norm * amp          # (a, 0) per rotary pair, interleaved layout
                gain[h] = math.sqrt(1.0 + 1.5 * float(torch.rand((), generator=gen)))
            attn.to_q.bias.copy_(bias.reshape(-1).to(attn.to_q.bias.dtype))
            attn.to_k.bias.copy_(bias.reshape(-1).to(attn.to_k.bias.dtype))
            attn.norm_q.weight.copy_(gain.reshape(-1).to(attn.norm_q.weight.dtype))
            attn.norm_k.weight.copy_(gain.reshape(-1).to(attn.norm_k.weight.dtype))
            # self-attention gate (3rd of the 6 modulation rows) near 1, as in a trained model; the
            # random init leaves it near 0 and attention would barely reach the output
            block.scale_shift_table[:, 2].add_(1.0)


def tiny_models(cfg: TinyConfig):
    """``(experts, vae)``: two structured tiny Wan experts (high, low) and a tiny random Wan VAE."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    experts = []
    for i in range(2):
        torch.manual_seed(cfg.seed * 101 + i)
        m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=cfg.heads, attention_head_dim=cfg.head_dim,
                                  in_channels=36, out_channels=16, text_dim=cfg.text_dim, freq_dim=64,
                                  ffn_dim=cfg.ffn_dim, num_layers=cfg.layers, cross_attn_norm=True,
                                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
        structure_init(m, seed=cfg.seed * 101 + i)
        experts.append(m.eval())
    torch.manual_seed(cfg.seed * 101 + 7)
    vae = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    return experts, vae


def load_real_models(transformer_dirs, vae_dir=None):
    """Real diffusers Wan transformers (local folders; nothing is downloaded) and an optional VAE,
    in bf16 on the GPU when there is one (the VAE in fp32)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    experts = [WanTransformer3DModel.from_pretrained(d, local_files_only=True, torch_dtype=dtype).to(device).eval()
               for d in transformer_dirs]
    vae = AutoencoderKLWan.from_pretrained(vae_dir, local_files_only=True).to(device).eval() if vae_dir else None
    return experts, vae


class TinyRunner:
    """Samples one request (dense or through the engine) and decodes it."""

    def __init__(self, cfg: TinyConfig, experts, vae, label: str = TINY_LABEL):
        self.cfg, self.experts, self.vae, self.label = cfg, experts, vae, label
        self.text_dim = experts[0].config.text_dim
        self.sigmas = cfg.sigmas
        param = next(experts[0].parameters())
        self.device, self.dtype = param.device, param.dtype

    def _condition(self, request):
        cfg = self.cfg
        t, h, w = cfg.latent_grid
        img = torch.as_tensor(np.ascontiguousarray(request.image), dtype=torch.float32).permute(2, 0, 1)[None]
        img = img.to(self.device)
        img = torch.nn.functional.interpolate(img, size=(h * 8, w * 8), mode="bilinear", antialias=True,
                                              align_corners=False) * 2 - 1
        with torch.no_grad():
            if self.vae is not None:
                lat0 = self.vae.encode(img[:, :, None]).latent_dist.mode()          # [1, 16, 1, h, w]
            else:
                lat0 = torch.nn.functional.adaptive_avg_pool2d(img, (h, w))[:, :, None].repeat(1, 6, 1, 1, 1)[:, :16]
        image_latent = torch.zeros(1, 16, t, h, w, device=self.device)
        image_latent[:, :, :1] = lat0
        mask = torch.zeros(1, 4, t, h, w, device=self.device)
        mask[:, :, 0] = 1.0
        y = torch.cat([mask, image_latent], dim=1)
        text = torch.from_numpy(hashed_text_vector(request.prompt, cfg.text_tokens * self.text_dim)).float()
        text = (text / text.norm().clamp_min(1e-9) * math.sqrt(text.numel())).reshape(1, cfg.text_tokens, self.text_dim)
        noise = torch.randn(1, 16, t, h, w, generator=torch.Generator().manual_seed(int(request.seed))).to(self.device)
        return noise, y, text.to(self.device)

    def sample(self, request, handles=None):
        """Latent ``[1, 16, T, H, W]``; with ``handles`` (one per expert: an object with ``begin_run`` /
        ``end_run``, or a tuple of them) the engine is bracketed per expert."""
        x, y, text = self._condition(request)
        cfg, sig = self.cfg, self.sigmas
        single = len(self.experts) == 1
        spans = [(0, cfg.steps)] if single else [(0, cfg.high_steps), (cfg.high_steps, cfg.steps)]
        with torch.no_grad():
            for e, (a, b) in enumerate(spans):
                model = self.experts[e]
                group = () if handles is None else (handles[e] if isinstance(handles[e], tuple) else (handles[e],))
                for h in group:
                    h.begin_run(sample_sigmas=sig[a:b + 1])
                try:
                    for i in range(a, b):
                        inp = torch.cat([x, y], dim=1).to(self.dtype)
                        vel = model(hidden_states=inp, timestep=torch.tensor([1000.0 * sig[i]], device=self.device),
                                    encoder_hidden_states=text.to(self.dtype), return_dict=False)[0]
                        x = x + (sig[i + 1] - sig[i]) * vel.float()
                finally:
                    for h in reversed(group):
                        h.end_run()
        return x

    def decode(self, latent):
        if self.vae is None or not self.cfg.decode:
            return None
        with torch.no_grad():
            return self.vae.decode(latent.to(next(self.vae.parameters()).dtype)).sample.clamp(-1, 1).float().cpu()

    def run_engine(self, workspace, request, embedding, threshold: float, feature_reuse=None, guidance=None):
        """Sample through the engine: retrieve a plan, patch both experts, sample, commit.

        ``feature_reuse``: a :class:`FeatureReuseConfig` (a miss records region scores, a hit
        downsamples); ``guidance``: ``(strength, image_strength)`` of a :class:`GuidanceBoost`."""
        t, h, w = self.cfg.latent_grid
        plan = retrieve_plan(workspace, embedding, latent_shape=(16, t, h, w), similarity_threshold=threshold,
                             request_meta={"prompt": request.prompt, "name": request.name})
        sc = SparseConfig(block_size=self.cfg.block_size, backend="auto" if self.device.type == "cuda" else "reference")
        handles, patches = [], []
        try:
            for m in self.experts:
                info = wan_model_info(m)
                group = [ChorusAttention(plan, sc, info)]
                patches.append(patch_diffusers_wan(m, group[0]))
                if feature_reuse is not None:
                    group.append(FeatureReuse(plan, feature_reuse, info))
                    patches.append(patch_diffusers_feature_reuse(m, group[-1]))
                if guidance is not None:
                    patches.append(patch_diffusers_guidance(m, GuidanceBoost(plan, *guidance)))
                handles.append(tuple(group))
            latent = self.sample(request, handles)
        finally:
            for p in reversed(patches):
                p.remove()
        message = commit_plan(workspace, plan)
        return latent, plan, message


def run_pairs(pairs, embedder, workspace, cfg: TinyConfig, experts, vae, threshold: float, label=TINY_LABEL,
              clip=None, lpips_model=None):
    """``pairs``: ``[(family, entry_request, query_request)]``. Returns one row per pair.

    ``clip``: an ``OpenClipEmbedder`` (local weights) for the CLIP text-video score (mean over frames
    of the frame/prompt cosine) and first-frame identity similarity (frame 0 vs the start image), each
    for the dense and the reused video; ``lpips_model``: an ``lpips.LPIPS`` instance (local weights)."""
    runner = TinyRunner(cfg, experts, vae, label)
    written = {}
    rows = []
    for family, entry, query in pairs:
        t0 = time.perf_counter()
        if entry.name not in written:
            _, plan, msg = runner.run_engine(workspace, entry, embedder.embed(image=entry.image, text=entry.prompt), 1.0)
            written[entry.name] = msg
        emb = embedder.embed(image=query.image, text=query.prompt)
        dense = runner.sample(query)
        reused, plan, _ = runner.run_engine(workspace, query, emb, 0.0)
        row = {"family": family, "entry": entry.name, "query": query.name, "plan": plan.kind,
               "similarity": plan.similarity, "hit_at_threshold": bool(plan.is_hit and plan.similarity is not None
                                                                     and plan.similarity >= threshold),
               "density": plan.stats.density, "fallback_calls": plan.stats.fallback_calls,
               "latent_psnr": psnr(reused.cpu(), dense.cpu()),
               "latent_rel_l2": float((reused - dense).norm() / dense.norm())}
        frames_dense, frames_reused = runner.decode(dense), runner.decode(reused)
        if frames_dense is not None:
            row["frames_psnr"] = psnr(frames_reused, frames_dense, data_range=2.0)
            row.update(_optional_image_metrics(frames_reused, frames_dense))
            if clip is not None:
                for tag, frames in (("dense", frames_dense), ("reused", frames_reused)):
                    row.update({f"{k}_{tag}": v for k, v in clip_scores(clip, frames, query).items()})
            if lpips_model is not None:
                with torch.no_grad():
                    a = frames_reused[0].permute(1, 0, 2, 3)
                    b = frames_dense[0].permute(1, 0, 2, 3)
                    row["frames_lpips"] = float(lpips_model(a, b).mean())
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
    return rows


def clip_scores(clip, frames, request) -> dict:
    """CLIP text-video score and first-frame identity similarity of frames ``[1, 3, F, H, W]`` in [-1, 1]."""
    def unit(v):
        v = np.asarray(v, dtype=np.float64)
        return v / max(np.linalg.norm(v), 1e-12)

    imgs = ((frames[0].permute(1, 2, 3, 0) + 1) / 2).clamp(0, 1)          # [F, H, W, 3]
    text = unit(clip.text_features(request.prompt))
    feats = [unit(clip.image_features(img)) for img in imgs]
    start = unit(clip.image_features(torch.as_tensor(np.ascontiguousarray(request.image), dtype=torch.float32)))
    return {"clip_text_video": float(np.mean([f @ text for f in feats])), "identity_first_frame": float(feats[0] @ start)}


def _optional_image_metrics(frames, ref) -> dict:
    """SSIM (scikit-image) and LPIPS (the ``lpips`` package, only with its weights present locally)
    of decoded frames ``[1, 3, F, H, W]`` in [-1, 1]; missing libraries are skipped silently."""
    out = {}
    try:
        from skimage.metrics import structural_similarity

        a = ((frames[0].permute(1, 2, 3, 0).numpy() + 1) / 2).astype(np.float64)
        b = ((ref[0].permute(1, 2, 3, 0).numpy() + 1) / 2).astype(np.float64)
        if min(a.shape[1:3]) >= 7:
            out["frames_ssim"] = float(np.mean([structural_similarity(x, y, channel_axis=-1, data_range=1.0)
                                                for x, y in zip(a, b)]))
    except ImportError:
        pass
    return out
