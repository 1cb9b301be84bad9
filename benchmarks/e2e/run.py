"""End-to-end Wan 2.2 A14B request latency on one GPU: dense vs Chorus miss vs Chorus hit.

``python -m benchmarks.e2e.run --out DIR [--res 480p 720p] [--layers 3] [--precisions bf16 fp8]``
(``--tiny`` runs the same code at toy sizes on the CPU, for tests).

A request is Wan 2.2 A14B I2V, 81 frames, 4 steps: 2 on the high-noise expert, 2 on the low-noise
expert, cfg 1 (batch 1), with two random-weight experts of the full shape (dim 5120, 40 layers, 40
heads, FFN 13 824, in_dim 36; :mod:`.wan_model`) made on the GPU. Variants, side by side in one
process, each with bf16 linears and again with FP8 linears:

* ``dense_cudnn``: dense self-attention, cuDNN SDPA (bf16);
* ``dense_fp8``: dense FP8 attention, ``chorus.kernels.block_sparse_attention(backend="triton_fp8")``
  with a full map;
* ``miss``: the engine's miss path (``ChorusAttention`` on a miss plan): cuDNN dense + block-mass
  recording (``block_mass`` with the engine's sampled rows, ``select_blocks``, bit-packing);
* ``hit@D``: the engine's hit path with a stored bank of structured masks of density D (per head a
  3D-local window of head-specific anisotropy around each query block, exactly D of the key blocks
  per row): bit-packed maps on the CPU -> device, ``floor_k_min``, FP8 block-sparse kernel;
* ``hit@D+fr``: ``hit@D`` plus feature reuse as ChorusFeatureReuse runs it (``--feature-reuse SHARE``):
  the SHARE most redundant complete 2x8x8-token regions (scored by ``region_detail`` of a dense
  block's update on this request; frame 0 never pooled) pooled 2x2x2; linears, cross-attention and
  FFN on the compact sequence; self-attention on q/k/v expanded back to the full grid (same maps);
  the update unpooled onto the tokens' own inputs. The first of the 40 layers runs in full (as the
  engine does), so its latency is ``embed + head + block 0 + 39 * mean(compact blocks)``.

Timing: CUDA events around the embeddings, every measured block, its self-attention, and the head.
Each expert has all 40 blocks' weights on the GPU, but per step only the first ``--layers`` blocks
run timed; since all 40 blocks have the same shapes, a step's latency is
``embed + head + (40 / layers) * sum(measured blocks)`` -- the report says so, and one full 40-block
step checks the extrapolation. Mask-load overhead (the whole request's bank, 160 maps, bit-packed on
the host -> device maps) and peak memory are measured too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from chorus import kernels
from chorus.engine import ChorusAttention, ModelInfo, Plan, SparseConfig
from chorus.engine.feature_reuse import select_regions
from chorus.kernels import pooling

from .wan_model import A14B, WanExpert, WanShape, patchify, rope_tables

RESOLUTIONS = {"480p": (21, 30, 52), "720p": (21, 45, 80), "tiny": (3, 8, 12)}
SIGMAS = [1.0, 0.9375, 0.8333333, 0.625, 0.0]   # 4 steps, flow shift 5
HIGH_STEPS = 2


class PackedBits:
    """A bit-packed bool map on the host (what a workspace entry loads as), unpacked on the device."""

    def __init__(self, block_map: torch.Tensor):
        self.shape = tuple(block_map.shape)
        self.bits = kernels.pack_bits(block_map.cpu()).pin_memory() if torch.cuda.is_available() else \
            kernels.pack_bits(block_map.cpu())

    def unpack(self, device=None):
        bits = self.bits if device is None else self.bits.to(device, non_blocking=True)
        shifts = torch.arange(7, -1, -1, device=bits.device, dtype=torch.uint8)
        return ((bits.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., : self.shape[-1]].bool().reshape(self.shape)


def structured_map(grid, heads: int, density: float, block_size: int, device, seed: int, order=None) -> torch.Tensor:
    """Bool ``[H, Qb, Kb]``: per head, each query block keeps the ``round(density * Kb)`` key blocks
    nearest to it in 3D (block centroids in (t, h, w) token units, head-specific anisotropy, e.g.
    temporal heads that reach other frames at the same place), always including itself. ``order``: the
    token order the blocks are cut from (a ``chorus.kernels.tile_order`` order; None = raster)."""
    t, h, w = grid
    L = t * h * w
    nb = -(-L // block_size)
    idx = torch.arange(L, device=device)
    tok = idx if order is None else order.perm.to(device)  # the raster token at each position
    coords = torch.stack([tok // (h * w), (tok // w) % h, tok % w], -1).float()
    blk = torch.zeros(nb, 3, device=device).index_add_(0, idx // block_size, coords)
    blk /= torch.bincount(idx // block_size, minlength=nb).float()[:, None]
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = torch.rand(heads, 3, device=device, generator=gen) * torch.tensor([4.0, 1.0, 1.0], device=device) + 0.05
    diff = (blk[:, None, :] - blk[None, :, :]) ** 2                      # [Qb, Kb, 3]
    dist = torch.einsum("qkc,hc->hqk", diff, weights)
    dist += 1e-3 * torch.rand(dist.shape, device=device, generator=gen)
    keep = max(1, round(density * nb))
    order = dist.topk(keep, dim=-1, largest=False).indices
    out = torch.zeros(heads, nb, nb, dtype=torch.bool, device=device)
    out.scatter_(-1, order, True)
    diag = torch.arange(nb, device=device)
    out[:, diag, diag] = True
    return out


def cudnn_sdpa(q, k, v):
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)


class Request:
    """One timed request over both experts with a given self-attention variant."""

    def __init__(self, experts, grid, precision, layers: int, device, shape: WanShape):
        self.experts, self.grid, self.precision, self.layers = experts, grid, precision, layers
        self.device, self.shape = device, shape
        t, h, w = grid
        gen = torch.Generator(device=device).manual_seed(1234)
        self.latent_tokens = patchify(torch.randn(shape.in_dim, t, 2 * h, 2 * w, device=device, generator=gen,
                                                  dtype=torch.bfloat16))
        self.text = torch.randn(shape.text_len, shape.text_dim, device=device, generator=gen, dtype=torch.bfloat16)
        self.rope = rope_tables(grid, shape.head_dim, device)

    def feature_reuse_layout(self, share: float):
        """Regions to pool for this request: the ``share`` most redundant complete 2x8x8 regions by
        ``region_detail`` of one dense block's update (high-noise expert, first step), frame 0 kept."""
        expert = self.experts[0]
        x, e6, _, ctx = expert.embed(self.latent_tokens, SIGMAS[0], self.text)
        out = expert.block(1, x, e6, ctx, self.rope, lambda q, k, v, layer: cudnn_sdpa(q, k, v), self.precision)
        detail = pooling.region_detail((out.float() - x.float())[None], self.grid, (2, 8, 8), (2, 2, 2))
        regions = select_regions(1.0 - detail.cpu(), self.grid, (2, 8, 8), share)
        layout = pooling.build_layout(self.grid, (2, 8, 8), (2, 2, 2), regions, device=self.device)
        cos, sin = self.rope
        cos_c, sin_c = pooling.pool_cos_sin(cos[None], sin[None], layout)
        return layout, (cos_c[0], sin_c[0])

    def _compact_block(self, expert, i, x, e6, ctx, attn, timer, reuse):
        layout, rope_compact = reuse

        def attn_full_grid(q, k, v, layer):
            full = [pooling.expand_tokens(t, layout, dim=2) for t in (q, k, v)]
            return pooling.compact_rows(attn(*full, layer), layout, dim=2)

        x_c = pooling.pool_tokens(x[None], layout)[0]
        y_c = expert.block(i, x_c, e6, ctx, rope_compact, attn_full_grid, self.precision, timer=timer)
        return pooling.unpool_residual(x[None], x_c[None], y_c[None], layout)[0]

    def run(self, attn_for_expert, handles=None, layers: int | None = None, reuse=None) -> dict:
        """``attn_for_expert(e) -> attn(q, k, v, layer, sigma)``; ``handles``: engine handles per expert
        (bracketed with begin_run/end_run); ``reuse``: a :meth:`feature_reuse_layout` result to run
        every block but the first on the compact sequence. Returns per-step event timings in ms."""
        layers = self.layers if layers is None else layers
        cuda = self.device.type == "cuda"
        ev = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else None
        steps = []
        for step in range(len(SIGMAS) - 1):
            e = 0 if step < HIGH_STEPS else 1
            if handles is not None and step in (0, HIGH_STEPS):
                handles[e].begin_run(sample_sigmas=SIGMAS[0:HIGH_STEPS + 1] if e == 0 else SIGMAS[HIGH_STEPS:])
            sigma = SIGMAS[step]
            expert = self.experts[e]
            attn = attn_for_expert(e)
            marks = {}
            t0 = time.perf_counter()
            if cuda:
                marks["start"], marks["embedded"] = ev(), ev()
                marks["start"].record()
            x, e6, temb, ctx = expert.embed(self.latent_tokens, sigma, self.text)
            if cuda:
                marks["embedded"].record()
            blocks = []
            for i in range(layers):
                b = (ev(), ev(), ev(), ev()) if cuda else None
                if cuda:
                    b[0].record()
                attn_i = lambda q, k, v, layer: attn(q, k, v, layer, sigma)  # noqa: E731
                timer = (b[1], b[2]) if cuda else None
                if reuse is not None and i > 0:
                    x = self._compact_block(expert, i, x, e6, ctx, attn_i, timer, reuse)
                else:
                    x = expert.block(i, x, e6, ctx, self.rope, attn_i, self.precision, timer=timer)
                if cuda:
                    b[3].record()
                blocks.append(b)
            if cuda:
                marks["head0"], marks["end"] = ev(), ev()
                marks["head0"].record()
            expert.head_out(x, temb)
            if cuda:
                marks["end"].record()
                torch.cuda.synchronize()
                steps.append({"embed_ms": marks["start"].elapsed_time(marks["embedded"]),
                              "head_ms": marks["head0"].elapsed_time(marks["end"]),
                              "block_ms": [b[0].elapsed_time(b[3]) for b in blocks],
                              "attn_ms": [b[1].elapsed_time(b[2]) for b in blocks]})
            else:
                dt = (time.perf_counter() - t0) * 1e3
                steps.append({"embed_ms": 0.0, "head_ms": 0.0, "block_ms": [dt / layers] * layers,
                              "attn_ms": [0.0] * layers})
            if handles is not None and step in (HIGH_STEPS - 1, len(SIGMAS) - 2):
                handles[e].end_run()
        return {"steps": steps}


def summarize(timing: dict, total_layers: int, first_layer_apart: bool = False) -> dict:
    """Per-request latency extrapolated from the measured blocks to ``total_layers`` per step
    (``first_layer_apart``: block 0 counted once and the mean of the others ``total_layers - 1`` times)."""
    lat = attn = embed_head = 0.0

    def extrapolate(values):
        if first_layer_apart and len(values) > 1:
            return values[0] + (total_layers - 1) / (len(values) - 1) * sum(values[1:])
        return total_layers / len(values) * sum(values)

    for s in timing["steps"]:
        lat += s["embed_ms"] + s["head_ms"] + extrapolate(s["block_ms"])
        attn += extrapolate(s["attn_ms"])
        embed_head += s["embed_ms"] + s["head_ms"]
    blocks = [b for s in timing["steps"] for b in s["block_ms"]]
    return {"latency_s": lat / 1e3, "attention_s": attn / 1e3, "attention_share": attn / lat if lat else None,
            "embed_head_s": embed_head / 1e3, "block_ms_mean": sum(blocks) / len(blocks),
            "block_ms_min": min(blocks), "block_ms_max": max(blocks)}


def model_info(expert_index: int, shape: WanShape) -> ModelInfo:
    return ModelInfo("wan", "wan2.2-a14b-i2v", shape.layers, shape.heads, shape.head_dim, shape.in_dim,
                     f"bench-expert-{expert_index}")


def hit_plan(grid, shape: WanShape, density: float, layers: int, device, block_size: int = 128) -> Plan:
    masks = {}
    for step in range(len(SIGMAS) - 1):
        e = 0 if step < HIGH_STEPS else 1
        for layer in range(layers):
            m = structured_map(grid, shape.heads, density, block_size, device, seed=step * 1000 + layer)
            masks[(e, step, layer, 0)] = PackedBits(m)
    sig = {"format": 1, "family": "wan", "variant": "wan2.2-a14b-i2v",
           "experts": [model_info(0, shape).fingerprint, model_info(1, shape).fingerprint],
           "num_layers": shape.layers, "num_heads": shape.heads, "latent_shape": [16, *grid],
           "token_grid": list(grid), "block_size": block_size, "token_order": "thw",
           "step_sigmas": SIGMAS[:-1], "head_groups": 1}
    return Plan("hit", message="benchmark bank", entry_id=0, similarity=1.0, masks=masks, entry_meta={"signature": sig})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--res", nargs="+", default=["480p", "720p"])
    ap.add_argument("--layers", type=int, default=3, help="timed blocks per step (of 40)")
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--densities", nargs="+", type=float, default=[0.15, 0.05])
    ap.add_argument("--skip", nargs="*", default=[], help="variant names to leave out (dense_fp8, miss)")
    ap.add_argument("--sample-rows", nargs="+", type=int, default=None,
                    help="miss variants to run, one per value of the recorder's sampled query rows per block "
                         "(default: one miss with the engine's default)")
    ap.add_argument("--no-hits", action="store_true", help="leave out the hit variants")
    ap.add_argument("--feature-reuse", type=float, default=None, metavar="SHARE",
                    help="also run each hit with feature reuse pooling this share of the regions (e.g. 0.25)")
    ap.add_argument("--check-full-step", action="store_true", help="also time one full 40-block step (480p)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (tests)")
    ap.add_argument("--elementwise", choices=["eager", "fused"], default="fused",
                    help="norms/RoPE/residuals: eager torch (fp32 temporaries, as ComfyUI runs them) or fused "
                         "Triton kernels (one pass each)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    shape = WanShape(dim=256, heads=2, ffn=512, layers=4, text_dim=64, text_len=16) if args.tiny else A14B
    res_names = ["tiny"] if args.tiny else args.res
    attn_backend = "triton_fp8" if cuda else "reference"
    log = lambda m: print(m, flush=True)  # noqa: E731
    info = {"command": "python -m benchmarks.e2e.run " + " ".join(argv if argv is not None else sys.argv[1:]),
            "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "shape": shape.__dict__, "timed_layers_per_step": args.layers, "sigmas": SIGMAS,
            "attention_backend_sparse": attn_backend, "results": {}}
    t0 = time.perf_counter()
    experts = [WanExpert(shape, device, seed=11 + e) for e in range(2)]
    for ex in experts:
        ex.fused = args.elementwise == "fused"
    info["elementwise"] = args.elementwise
    if "fp8" in args.precisions:
        for ex in experts:
            ex.to_fp8()
    if cuda:
        torch.cuda.synchronize()
        info["weights_gib"] = torch.cuda.memory_allocated() / 2**30
    log(f"experts ready in {time.perf_counter() - t0:.1f} s on {info['device']}")

    for res in res_names:
        grid = RESOLUTIONS[res]
        L = grid[0] * grid[1] * grid[2]
        nb = -(-L // 128)
        full = torch.ones(1, shape.heads, nb, nb, dtype=torch.bool, device=device)
        hit_densities = [] if args.no_hits else args.densities
        plans = {d: hit_plan(grid, shape, d, args.layers, device) for d in hit_densities}
        out = info["results"].setdefault(res, {"tokens": L, "blocks": nb})
        if "fp8" in args.precisions:
            out["fp8_block_check"] = fp8_block_check(experts[0], grid, device, shape)
            log(f"{res} fp8 vs bf16 linears, one block: {out['fp8_block_check']}")
        for precision in args.precisions:
            req = Request(experts, grid, precision, args.layers, device, shape)

            def fixed(fn):
                return lambda e: (lambda q, k, v, layer, sigma: fn(q, k, v))

            variants = {"dense_cudnn": (fixed(cudnn_sdpa), None),
                        "dense_fp8": (fixed(lambda q, k, v: kernels.block_sparse_attention(
                            q, k, v, full, backend=attn_backend)), None)}
            if args.sample_rows is None:
                variants["miss"] = ("miss", SparseConfig().sample_rows)
            else:
                variants.update({f"miss@{r}rows": ("miss", r) for r in args.sample_rows})
            for name in args.skip:
                variants.pop(name, None)
            for d in hit_densities:
                variants[f"hit@{d:g}"] = ("hit", d)
                if args.feature_reuse:
                    variants[f"hit@{d:g}+fr"] = ("hit", d)
            reuse = req.feature_reuse_layout(args.feature_reuse) if args.feature_reuse and hit_densities else None
            for name, spec in variants.items():
                handles = None
                if isinstance(spec, tuple) and spec[0] in ("miss", "hit"):
                    cfg = (SparseConfig(backend=attn_backend, sample_rows=spec[1]) if spec[0] == "miss"
                           else SparseConfig(backend=attn_backend))

                    def make(plan_factory):
                        plan = plan_factory()
                        hs = [ChorusAttention(plan, cfg, model_info(e, shape)) for e in range(2)]
                        fn = lambda e: (lambda q, k, v, layer, sigma: hs[e].self_attention(  # noqa: E731
                            q, k, v, layer=layer, sigma=sigma, grid=grid, dense_fn=cudnn_sdpa))
                        return plan, hs, fn

                    factory = (lambda: Plan.miss("benchmark miss", latent_shape=(16, *grid))) if spec[0] == "miss" \
                        else (lambda d=spec[1]: _fresh_hit(plans[d]))
                    _, hs, fn = make(factory)
                    req.run(fn, hs, layers=2 if name.endswith("+fr") else 1,      # warm-up (compiles, autotunes)
                            reuse=reuse if name.endswith("+fr") else None)
                    plan, handles, attn_fn = make(factory)
                else:
                    attn_fn = spec[0]
                    req.run(attn_fn, None, layers=1)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base_mem = torch.cuda.memory_allocated()
                with_fr = name.endswith("+fr")
                timing = req.run(attn_fn, handles, reuse=reuse if with_fr else None)
                row = summarize(timing, shape.layers, first_layer_apart=with_fr)
                if with_fr:
                    layout = reuse[0]
                    row["compact_tokens"] = int(layout.compact_length)
                    row["pooled_share_of_tokens"] = 1.0 - layout.compact_length / (grid[0] * grid[1] * grid[2])
                if cuda:
                    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                    row["peak_over_static_gib"] = (torch.cuda.max_memory_allocated() - base_mem) / 2**30
                if handles is not None:
                    row["density"] = plan.stats.density
                    row["fallback_calls"] = plan.stats.fallback_calls
                    row["messages"] = plan.stats.messages[:3]
                    if plan.recorder is not None:
                        row["recorded_calls"] = plan.stats.recorded_calls
                row["timing"] = timing
                out.setdefault(precision, {})[name] = row
                (args.out / "e2e_results.json").write_text(json.dumps(info, indent=1, default=str))
                log(f"{res} {precision:4s} {name:12s} latency {row['latency_s']:.2f} s  attention "
                    f"{row['attention_share']:.0%}  block {row['block_ms_mean']:.1f} ms  "
                    f"peak {row.get('peak_gib', 0):.1f} GiB  density {row.get('density')}")
        if cuda:
            out["miss_breakdown"] = miss_breakdown(grid, shape, device)
            log(f"{res} miss path pieces per call (ms): {out['miss_breakdown']}")
        # mask-load overhead: the whole request's bank (4 steps x 40 layers) host -> device maps
        if hit_densities:
            out["mask_load"] = mask_load(grid, shape, args.densities[0], device)
            log(f"{res} mask load of a full request bank: {out['mask_load']}")
        if args.check_full_step and res == "480p" and cuda:
            req = Request(experts, grid, "bf16", shape.layers, device, shape)
            t = req.run(fixed(cudnn_sdpa), None, layers=shape.layers)["steps"][0]
            out["full_step_check"] = {"measured_step_s": (t["embed_ms"] + t["head_ms"] + sum(t["block_ms"])) / 1e3,
                                      "block_ms_mean_all40": sum(t["block_ms"]) / len(t["block_ms"])}
            log(f"full 40-block step check: {out['full_step_check']}")
    info["seconds"] = time.perf_counter() - t0
    (args.out / "e2e_results.json").write_text(json.dumps(info, indent=1, default=str))
    log(markdown(info))
    return 0


def fp8_block_check(expert: WanExpert, grid, device, shape: WanShape) -> dict:
    """Error of one block with FP8 linears against the same block with bf16 linears (same input):
    relative L2 of the difference over the block's update ``y - x``."""
    req = Request([expert, expert], grid, "bf16", 1, device, shape)
    with torch.no_grad():
        x, e6, _, ctx = expert.embed(req.latent_tokens, SIGMAS[0], req.text)
        attn = lambda q, k, v, layer: cudnn_sdpa(q, k, v)  # noqa: E731
        y16 = expert.block(0, x, e6, ctx, req.rope, attn, "bf16").float()
        y8 = expert.block(0, x, e6, ctx, req.rope, attn, "fp8").float()
        upd = y16 - x.float()
        return {"rel_l2_of_update": float((y8 - y16).norm() / upd.norm()),
                "cosine_of_update": float(F.cosine_similarity((y8 - x.float()).flatten(), upd.flatten(), dim=0))}


def miss_breakdown(grid, shape: WanShape, device, sample_rows: int | None = None) -> dict:
    """Per self-attention call of a miss, median ms of: dense cuDNN, ``block_mass`` (engine default
    sampled rows), ``select_blocks`` of that mass, and bit-packing it to the host (``pack_bits``)."""
    from chorus.engine.config import SparseConfig as _SC

    L = grid[0] * grid[1] * grid[2]
    gen = torch.Generator(device=device).manual_seed(5)
    q, k, v = (torch.randn(1, shape.heads, L, shape.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    rows = _SC().sample_rows if sample_rows is None else sample_rows

    def timed(fn, reps=3):
        times = []
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            r = fn()
            b.record()
            torch.cuda.synchronize()
            times.append((a.elapsed_time(b), (time.perf_counter() - t0) * 1e3))
        times = sorted(times[1:])
        return r, times[len(times) // 2]

    _, dense = timed(lambda: cudnn_sdpa(q, k, v))
    mass, bm = timed(lambda: kernels.block_mass(q, k, sample_rows=rows))
    first = kernels.first_frame_blocks(grid[1] * grid[2], 128)
    sel, sb = timed(lambda: kernels.select_blocks(mass, top_p=0.9, k_min=4, keep_first_frame_blocks=first))
    _, pk = timed(lambda: kernels.pack_bits(sel[0]))
    return {"dense_cudnn_ms": dense[0], "block_mass_ms": bm[0], "select_blocks_ms": sb[0],
            "pack_bits_host_ms": pk[1], "sample_rows": rows}


def _fresh_hit(template: Plan) -> Plan:
    """A new hit plan (fresh stats and device caches) sharing ``template``'s host-side bank."""
    return Plan("hit", message=template.message, entry_id=0, similarity=1.0, masks=template.masks,
                entry_meta=template.entry_meta)


def mask_load(grid, shape: WanShape, density: float, device, block_size: int = 128) -> dict:
    """Host -> device cost of one request's whole bank: 4 steps x ``shape.layers`` maps, bit-packed
    on the host; per map the engine's work (unpack on the device + ``floor_k_min``)."""
    from chorus.engine.runtime import floor_k_min

    one = PackedBits(structured_map(grid, shape.heads, density, block_size, device, seed=7))
    bank = [one] * ((len(SIGMAS) - 1) * shape.layers)   # same bytes per map; distinct maps cost the same
    nbytes = sum(m.bits.numel() for m in bank)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for m in bank:
        floor_k_min(m.unpack(device), 4)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"maps": len(bank), "packed_mib": nbytes / 2**20, "seconds": time.perf_counter() - t0}


def markdown(info: dict) -> str:
    lines = []
    for res, r in info["results"].items():
        lines.append(f"\n{res}: {r['tokens']} tokens, {r['blocks']} blocks of 128; latency = 4 steps x (embed + head + "
                     f"40 x measured block mean), {info['timed_layers_per_step']} blocks timed per step")
        lines.append("| linears | variant | latency s | speedup vs dense_cudnn | speedup vs dense_fp8 | attention share "
                     "| block ms | peak GiB | peak over static GiB | density |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for precision in ("bf16", "fp8"):
            rows = r.get(precision)
            if not rows:
                continue
            base, fp8b = rows["dense_cudnn"]["latency_s"], rows.get("dense_fp8", {}).get("latency_s")
            for name, row in rows.items():
                dens = row.get("density")
                lines.append(f"| {precision} | {name} | {row['latency_s']:.2f} | {base / row['latency_s']:.2f}x | "
                             f"{(fp8b / row['latency_s']) if fp8b else math.nan:.2f}x | {row['attention_share']:.0%} | "
                             f"{row['block_ms_mean']:.1f} | {row.get('peak_gib', math.nan):.1f} | "
                             f"{row.get('peak_over_static_gib', math.nan):.2f} | {'-' if dens is None else f'{dens:.1%}'} |")
            if not any(name.endswith("+fr") for name in rows):
                lines.append(f"| {precision} | hit+feature_reuse | not measured (run with --feature-reuse) | | | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
