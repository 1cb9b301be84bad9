"""Block-sparse attention benchmark on one GPU (Wan 14B shapes), all contenders side by side in one run.

Contenders per sequence length (1 x 40 heads x L x 128, bf16 random inputs):
dense cuDNN SDPA, dense FLASH SDPA, compiled FlexAttention with the same block masks, our Triton kernel
(bf16 and FP8) with a full map and with structured masks (3D-local windows + diagonal + sink column,
see ``masks.py``) at densities 5-50%, the fixed-cost stages of our FP8 path (block index, FP8
pre-pass), variants leaving one stage out (no softmax / no P@V: where the time goes), and the Triton
block_mass (sampled rows) against one dense cuDNN call. Then every peer of ``peers.py`` (one registry:
ours, compiled flex, cuDNN bf16 / FP8 SDPA, cuDNN block-mask SDPA and BSA, SageAttention, FlashInfer,
FlashAttention-4) on the same inputs at a full map and 15% / 5% density (dense peers once per length): the
JSON's ``peers`` table holds name, ran, the exact reason when it did not, ms, TFLOP/s (dense FLOPs for dense
peers, kept-block FLOPs for sparse ones) and the cosine against an fp32 reference on 4 heads.

Times are ``triton.testing.do_bench`` medians (L2 flushed between runs); the peers table times every
peer ``--rounds`` times (3), the peers in turn, and reports the median with each round's ms and the
GPU's SM clock / power while it ran (``gpu_state.py``: the H200 runs these kernels at its power limit,
where its clock moves between calls); TFLOP/s count only kept blocks (4 * kept query-key pairs * D *
heads, partial blocks exact). Writes ``bench_block_sparse.json``,
``bench_block_sparse.png`` (time vs density) and ``bench_block_sparse_peers.png`` (the peers' TFLOP/s
against the FP8 bars; ``--plot-from JSON`` redraws it from a saved run, no GPU needed) into ``--out``.

Usage: ``python benchmarks/kernels/bench_block_sparse.py --out /tmp/bench [--sweep] [--sizes 32760,75600]
[--peers-only] [--peers NAME,...]`` (``--sweep``: the portable kernel's tile configurations on the full map,
for the FP8, bf16 and INT8 paths, each path's fastest then used; ``--mass-sweep --mass-sizes 32760,75600``:
only the block-mass kernel's launch configurations, as a miss records; ``--selection --mass-sizes ...``:
only the miss's block selection, torch against the Triton kernel)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_state import GpuSampler  # noqa: E402
from masks import kept_flops, structured_block_map  # noqa: E402
from peers import PEERS, cosine, make_peer, reference_subset  # noqa: E402

from chorus.kernels.triton import _attention as attn  # noqa: E402
from chorus.kernels.triton import _ptxas  # noqa: E402
from chorus.kernels.triton import block_mass_triton  # noqa: E402

SWEEP_FP8 = [
    attn.TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=False),
    attn.TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=True),
    attn.TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True),
    attn.TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=True),
    attn.TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=True, maxnreg=168),
    attn.TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=4, use_tma=True, maxnreg=168),
]
SWEEP_BF16 = [
    attn.TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=False),
    attn.TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=2, use_tma=True),
    attn.TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=True),
    attn.TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=2, use_tma=True),
    attn.TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=True),
]
SWEEP_INT8 = [  # the accurate path: 128-key tiles only
    attn.TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=True),
    attn.TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=2, use_tma=True),
    attn.TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=4, use_tma=True),
    attn.TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=2, use_tma=True),
    attn.TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=True),
    attn.TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=True, maxnreg=168),
]
# Wan token grids of the benchmark's lengths (81 frames): the tile-order lever uses their TileOrder
GRIDS = {32760: (21, 30, 52), 75600: (21, 45, 80)}


def bench(fn, est_ms: float | None = None) -> float:
    """Median ms; rep scaled so slow calls still get >= ~5 timed runs."""
    rep = 200 if est_ms is None else max(200, int(6 * est_ms))
    return float(do_bench(fn, warmup=max(25, int(2 * (est_ms or 10))), rep=rep, return_mode="median"))


def log(msg: str) -> None:
    print(msg, flush=True)


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    return run


def bench_peer(fn, est_ms: float) -> float:
    """Median ms with a small budget (peers: a few timed runs each, the whole table in about a minute)."""
    return float(do_bench(fn, warmup=max(1, int(est_ms)), rep=max(30, int(3 * est_ms)), return_mode="median"))


def reference_heads(heads: int) -> list[int]:
    """4 heads spread over the range (one of each of the 4 head patterns of ``masks.py`` at 40 heads)."""
    return sorted({round(i * (heads - 1) / 3) for i in range(4)}) if heads >= 4 else list(range(heads))


def run_peers(length: int, q, k, v, args, results: dict) -> None:
    """Every peer of the registry on these inputs: sparse peers at each ``--peer-densities`` map (1.0 =
    full map), dense peers once; appends rows to ``results["peers"]``. Nothing a peer does stops the run.
    Each peer is built, run once (compile, cosine) and then timed ``--rounds`` times, the peers in turn
    (so a drift of the GPU's clock between timings hits them all alike; the median is reported, with
    every round's ms and the GPU's SM clock / power / limit reasons while it ran, ``gpu_state.py``)."""
    heads, dim, bs = q.shape[1], q.shape[3], 128
    dense_flops = 4.0 * heads * dim * length * length
    ref_heads = reference_heads(heads)
    maps = [(d, structured_block_map(length, heads, d, bs, device="cuda", uniform_rows=args.uniform_rows))
            for d in args.peer_densities]
    full = torch.ones(1, 1, -(-length // bs), -(-length // bs), dtype=torch.bool, device="cuda")
    refs: dict = {}

    def reference(density, bm):
        if density not in refs:
            refs[density] = reference_subset(q, k, v, None if density >= 1.0 else bm, bs, ref_heads)
        return refs[density]

    table = results.setdefault("peers", [])
    timed = []  # (entry, fn, est_ms, flops) of the peers that ran once
    for peer in PEERS:
        if args.peers and peer.name not in args.peers:
            continue
        for density, bm in (maps if peer.sparse else [(1.0, full)]):
            entry = {"tokens": length, "uniform_rows": args.uniform_rows, "peer": peer.name, "what": peer.what,
                     "sparse": peer.sparse,
                     "map": ("full" if density >= 1.0 else f"{density:.2f}") if peer.sparse else "dense",
                     "measured_density": bm.double().mean().item() if peer.sparse else 1.0,
                     "flops_counted": "kept blocks" if peer.sparse else "dense", "ran": False, "reason": "",
                     "ms": None, "tflops": None, "cos_vs_fp32_ref": None, "ref_heads": ref_heads}
            fn, reason = make_peer(peer, q, k, v, bm, bs)
            if fn is None:
                entry["reason"] = reason
            else:
                try:
                    out = fn()  # first call: compile / plan build
                    torch.cuda.synchronize()
                    t0 = time.time()
                    out = fn()
                    torch.cuda.synchronize()
                    est = (time.time() - t0) * 1e3
                    if peer.no_reference is None:
                        entry["cos_vs_fp32_ref"] = cosine(out[:, ref_heads], reference(density, bm))
                    else:
                        entry["no_reference"] = peer.no_reference
                    del out
                    flops = kept_flops(bm, length, length, dim, bs, heads=heads) if peer.sparse else dense_flops
                    timed.append((entry, fn, est, flops))
                except Exception as exc:  # noqa: BLE001 - a failing peer is a row of the table, not the end of the run
                    entry["reason"] = f"run failed: {type(exc).__name__}: {str(exc).strip()[:600]}"
                if peer.name.startswith("cudnn_fp8") and entry["cos_vs_fp32_ref"] is not None:
                    entry["cos_ok"] = entry["cos_vs_fp32_ref"] >= 0.99  # issue 14: the FP8 peer must reach 0.99
            fn = None
            table.append(entry)
            if entry["reason"]:  # not run: a peer that ran once is timed below
                torch.cuda.empty_cache()
                log(f"[{length}] peer {peer.name:24s} {entry['map']:>5s}: not run: {entry['reason']}")
    refs.clear()
    sampler = GpuSampler()
    for _ in range(args.rounds):  # the peers in turn
        for entry, fn, est, _flops in timed:
            try:
                with sampler.window() as w:
                    ms = bench_peer(fn, est)
                entry.setdefault("rounds_ms", []).append(ms)
                entry.setdefault("gpu_states", []).append(w.summary())
            except Exception as exc:  # noqa: BLE001
                entry["reason"] = f"run failed: {type(exc).__name__}: {str(exc).strip()[:600]}"
    for entry, fn, est, flops in timed:
        if entry.get("rounds_ms") and not entry["reason"]:
            ms = statistics.median(entry["rounds_ms"])
            clocks = [g["sm_mhz"] for g in entry["gpu_states"] if g.get("available")]
            entry.update(ran=True, ms=ms, tflops=flops / ms / 1e9,
                         sm_mhz=statistics.median(clocks) if clocks else None)
            state = f", SM {entry['sm_mhz']:.0f} MHz" if clocks else ""
            spread = (f", rounds {min(entry['rounds_ms']):.2f}-{max(entry['rounds_ms']):.2f}"
                      if len(entry["rounds_ms"]) > 1 else "")
            log(f"[{length}] peer {entry['peer']:24s} {entry['map']:>5s}: {entry['ms']:9.2f} ms "
                f"({entry['tflops']:4.0f} TFLOP/s, {entry['flops_counted']}{spread}{state}), "
                + (f"cosine vs fp32 {entry['cos_vs_fp32_ref']:.5f}" if entry["cos_vs_fp32_ref"] is not None
                   else f"no cosine ({entry['no_reference']})"))
        else:
            log(f"[{length}] peer {entry['peer']:24s} {entry['map']:>5s}: not run: {entry['reason']}")
    timed.clear()
    torch.cuda.empty_cache()


def levers(length: int, q, k, v, full, cfg, est: float) -> dict:
    """Each lever measured alone, whole FP8 calls (index + pre-pass + kernel), full map and 15%:
    Q quantised in the pre-pass vs on load in the attention kernel (pre-pass reads K and V only); the
    persistent launch;
    the 3D-tile token order fused into the pre-pass / output store vs none vs gather -> run -> scatter."""
    from chorus.kernels.tile_order import TileOrder, to_raster_order, to_tile_order

    heads, dim, bs = q.shape[1], q.shape[3], 128
    scale = dim ** -0.5
    bm15 = structured_block_map(length, heads, 0.15, bs, device="cuda")
    q_kernel = dataclasses.replace(cfg, q_in_kernel=True)
    out = {"prepass_qkv_ms": bench(lambda: attn.quantize_qkv_fp8(q, k, v, scale)),
           "prepass_kv_only_ms": bench(lambda: attn.quantize_qkv_fp8(q, k, v, scale, quantize_q=False))}
    for dname, bm, share in (("full", full, 1.0), ("d15", bm15, 0.15)):
        for name, c in (("q_prepass", cfg), ("q_in_kernel", q_kernel), ("persistent", dataclasses.replace(cfg, persistent=True))):
            out[f"{name}_{dname}_ms"] = bench(
                lambda: attn.block_sparse_attention_triton_impl(q, k, v, bm, bs, scale, True, c), est * share / 2)
    grid = GRIDS.get(length)
    if grid is not None:
        order = TileOrder(grid, block_size=bs)
        perm, inverse = order.perm.cuda(), order.inverse.cuda()
        for name, c in (("q_prepass", cfg), ("q_in_kernel", q_kernel)):
            out[f"tile_fused_{name}_d15_ms"] = bench(
                lambda: attn.block_sparse_attention_triton_impl(q, k, v, bm15, bs, scale, True, c, token_perm=perm),
                est * 0.15 / 2)

        def gathered():
            qt, kt, vt = to_tile_order(perm, q, k, v)
            return to_raster_order(inverse, attn.block_sparse_attention_triton_impl(qt, kt, vt, bm15, bs, scale, True, cfg))
        out["tile_gather_scatter_d15_ms"] = bench(gathered, est * 0.15 / 2)
    return out


MASS_GRIDS = {32760: (21, 30, 52), 75600: (21, 45, 80)}  # Wan's 480p / 720p token grids (81 frames)


def mass_sweep(length: int, args, results: dict) -> None:
    """The block-mass kernel's launch configurations, as a miss records (``sample_rows`` 8, q / k views of
    ComfyUI's ``[B, L, H, D]`` layout, the region tile order of Wan's grid when ``length`` is one of
    ``MASS_GRIDS``), each checked against the default configuration's output and timed beside one dense
    cuDNN call on the same q / k / v. The table goes to the JSON's ``mass_sweep``."""
    import itertools

    from torch.nn.attention import SDPBackend

    from chorus.kernels.tile_order import cached_region_order
    from chorus.kernels.triton._block_mass import block_mass_triton_impl

    heads, dim, bs = args.heads, args.dim, 128
    gen = torch.Generator(device="cuda").manual_seed(length)
    q, k, v = (torch.randn(1, length, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
               for _ in range(3))
    perm = cached_region_order(MASS_GRIDS[length]).perm.cuda() if length in MASS_GRIDS else None
    scale = 1.0 / math.sqrt(dim)
    cudnn = sdpa(SDPBackend.CUDNN_ATTENTION)
    cudnn_ms = bench(lambda: cudnn(q, k, v), 40.0)
    sample = args.mass_rows[0]
    default = block_mass_triton_impl(q, k, bs, sample, scale, token_perm=perm)
    table = []
    for block_n, warps, stages, rows in itertools.product((64, 128), (8, 16), (2, 3), (128, 256, 512)):
        config = {"block_n": block_n, "num_warps": warps, "num_stages": stages, "rows_per_program": rows}
        try:
            got = block_mass_triton_impl(q, k, bs, sample, scale, block_n, warps, stages, perm, rows)
            err = float((got - default).abs().max())
            ms = bench(lambda: block_mass_triton_impl(q, k, bs, sample, scale, block_n, warps, stages, perm, rows),
                       3.0)
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is a row, not a stop
            table.append(dict(config, error=f"{type(exc).__name__}: {str(exc)[:120]}"))
            log(f"[{length}] block_mass {config}: {type(exc).__name__}")
            continue
        table.append(dict(config, ms=ms, share_of_cudnn=ms / cudnn_ms, max_abs_diff_vs_default=err))
        log(f"[{length}] block_mass {config}: {ms:.3f} ms = {100 * ms / cudnn_ms:.2f}% of dense cuDNN "
            f"({cudnn_ms:.2f} ms); max |diff| vs default {err:.2e}")
    results.setdefault("mass_sweep", []).append({"tokens": length, "sample_rows": sample, "cudnn_ms": cudnn_ms,
                                                 "token_order": None if perm is None else "region",
                                                 "configs": table})
    del q, k, v
    torch.cuda.empty_cache()


def selection_timing(length: int, args, results: dict) -> None:
    """The miss's block selection of one call (``select_blocks_packed`` as the recorder runs it: top-p 0.9,
    k_min 4, the diagonal and the first frame's blocks kept) at ``length`` tokens: the torch path (sort,
    gather, cumulative sum, scatter, then packing) against the Triton kernel at 1 / 2 / 4 / 8 warps per
    row, each checked equal to the torch map. The mass: ``heads`` rows of softmax(2.5 x Gaussian) per query
    block (peaked, ~15% of blocks reach 0.9; a sort's time does not depend on the values). The table goes
    to the JSON's ``selection``. Then a hit's map from that packed map (:func:`chorus.kernels.masks.floor_packed_map`:
    the k_min floor of 4, the packed copy and the row counts), torch against the Triton kernel, checked equal:
    the JSON's ``map_floor``."""
    from chorus.kernels.codec import pack_bits_on_device
    from chorus.kernels.masks import select_blocks_torch
    from chorus.kernels.triton._select import select_blocks_triton

    nb = -(-length // 128)
    _, height, width = MASS_GRIDS.get(length, (1, 1, 0))
    first = -(-height * width // 128)  # the first latent frame's key blocks (none off Wan's grids)
    gen = torch.Generator(device="cuda").manual_seed(length)
    mass = torch.softmax(torch.randn(1, args.heads, nb, nb, device="cuda", generator=gen) * 2.5, -1)
    sel = dict(top_p=0.9, k_min=4, keep_diagonal=True, keep_first_frame_blocks=first)
    keep = select_blocks_torch(mass, **sel)
    want = pack_bits_on_device(keep)
    row = {"tokens": length, "key_blocks": nb, "heads": args.heads, **sel, "density": float(keep.float().mean()),
           "torch_ms": bench(lambda: pack_bits_on_device(select_blocks_torch(mass, **sel)), 1.0), "triton": []}
    for warps in (1, 2, 4, 8):
        got = select_blocks_triton(mass, packed=True, num_warps=warps, **sel)
        ms = bench(lambda: select_blocks_triton(mass, packed=True, num_warps=warps, **sel), 0.5)
        row["triton"].append({"num_warps": warps, "ms": ms, "equal_to_torch": bool(torch.equal(got, want))})
        log(f"[{length}] selection: torch {row['torch_ms']:.3f} ms, Triton {warps} warps {ms:.3f} ms "
            f"(equal: {row['triton'][-1]['equal_to_torch']})")
    results.setdefault("selection", []).append(row)
    map_floor_timing(want, nb, args.heads, results)


def map_floor_timing(packed, num_kv: int, heads: int, results: dict) -> None:
    """A hit's map from its entry's packed map ``packed`` (uint8 ``[1, heads, Qb, ceil(Kb / 8)]``), as
    ``engine.maps.RunMaps`` makes it per call: torch's unpack, floor, packing and counts against the one
    Triton kernel, each checked equal (:func:`selection_timing` writes the map)."""
    from chorus.kernels.masks import floor_packed_map_torch
    from chorus.kernels.triton._floor_map import floor_packed_map_triton

    packed = packed.reshape(heads, num_kv, -1)
    want, got = (f(packed, num_kv, heads, 4) for f in (floor_packed_map_torch, floor_packed_map_triton))
    row = {"key_blocks": num_kv, "heads": heads, "k_min": 4,
           "torch_ms": bench(lambda: floor_packed_map_torch(packed, num_kv, heads, 4), 0.5),
           "triton_ms": bench(lambda: floor_packed_map_triton(packed, num_kv, heads, 4), 0.5),
           "equal_to_torch": all(bool(torch.equal(a, b)) for a, b in zip(got, want))}
    log(f"[{num_kv} key blocks] a hit's map: torch {row['torch_ms']:.3f} ms, Triton {row['triton_ms']:.3f} ms "
        f"(equal: {row['equal_to_torch']})")
    results.setdefault("map_floor", []).append(row)


def run_size(length: int, args, results: dict) -> None:
    from torch.nn.attention import SDPBackend

    heads, dim, bs = args.heads, args.dim, 128
    gen = torch.Generator(device="cuda").manual_seed(length)
    q, k, v = (torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    dense_flops = 4.0 * heads * dim * length * length
    row: dict = {"tokens": length, "heads": heads, "head_dim": dim, "dense_flops": dense_flops}
    results["sizes"].append(row)
    if args.peers_only:
        run_peers(length, q, k, v, args, results)
        del q, k, v
        torch.cuda.empty_cache()
        return

    cudnn = sdpa(SDPBackend.CUDNN_ATTENTION)
    flash = sdpa(SDPBackend.FLASH_ATTENTION)
    ref = cudnn(q, k, v)
    torch.cuda.synchronize()
    t0 = time.time()
    cudnn(q, k, v)
    torch.cuda.synchronize()
    est = (time.time() - t0) * 1e3
    row["cudnn_ms"] = bench(lambda: cudnn(q, k, v), est)
    row["flash_ms"] = bench(lambda: flash(q, k, v), est * 1.7)
    log(f"[{length}] dense cuDNN {row['cudnn_ms']:.2f} ms ({dense_flops / row['cudnn_ms'] / 1e9:.0f} TFLOP/s), "
        f"FLASH {row['flash_ms']:.2f} ms ({dense_flops / row['flash_ms'] / 1e9:.0f})")

    full = torch.ones(1, 1, -(-length // bs), -(-length // bs), dtype=torch.bool, device="cuda")
    # config sweep on the full map
    best = dict(attn.DEFAULT_TILES)
    if args.sweep:
        row["sweep"] = {}
        sweeps = {"fp8": SWEEP_FP8, "bf16": SWEEP_BF16, "int8": SWEEP_INT8}
        bm15 = structured_block_map(length, heads, 0.15, bs, device="cuda")
        flops15 = kept_flops(bm15, length, length, dim, bs)
        for path in args.sweep_paths:
            best_ms = math.inf
            for cfg in sweeps[path]:
                try:
                    prep = attn.prepare_attention(q, k, v, full, bs, dim ** -0.5, path == "fp8", cfg,
                                                  int8=path == "int8")
                    ms = bench(lambda: attn.launch_attention(prep), est / 2)
                    prep = attn.prepare_attention(q, k, v, bm15, bs, dim ** -0.5, path == "fp8", cfg,
                                                  int8=path == "int8")
                    ms15 = bench(lambda: attn.launch_attention(prep), est / 8)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    log(f"[{length}] sweep {path} {cfg.name()} FAILED: {type(exc).__name__}: {str(exc)[:200]}")
                    row["sweep"][f"{path}:{cfg.name()}"] = None
                    continue
                row["sweep"][f"{path}:{cfg.name()}"] = ms
                row["sweep"][f"{path}:{cfg.name()}:15%"] = ms15
                log(f"[{length}] sweep {path} {cfg.name()}: kernel {ms:.2f} ms ({dense_flops / ms / 1e9:.0f} TFLOP/s); "
                    f"15% map {ms15:.2f} ms ({flops15 / ms15 / 1e9:.0f} TFLOP/s)")
                if ms < best_ms:
                    best_ms, best[path] = ms, cfg
        row["best_config"] = {p: c.name() for p, c in best.items()}
        results.setdefault("best_configs", {})[str(length)] = best
        if args.sweep_only:
            return

    def ours(bm, fp8):
        return lambda: attn.block_sparse_attention_triton_impl(q, k, v, bm, bs, dim ** -0.5, fp8, best["fp8" if fp8 else "bf16"])

    for fp8 in (False, True):
        key = "fp8" if fp8 else "bf16"
        out = ours(full, fp8)()
        cos = F.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0).item()
        ms = bench(ours(full, fp8), est / 2)
        row[f"full_{key}_ms"] = ms
        row[f"full_{key}_cos_vs_cudnn"] = cos
        log(f"[{length}] ours {key} full map {ms:.2f} ms ({dense_flops / ms / 1e9:.0f} TFLOP/s, "
            f"{row['cudnn_ms'] / ms:.2f}x cuDNN), cosine vs cuDNN {cos:.5f}")

    # stages of the FP8 path at full map (fixed costs) and leave-one-out variants
    prep = attn.prepare_attention(q, k, v, full, bs, dim ** -0.5, True, best["fp8"])
    stages = {
        "index_ms": bench(lambda: (attn.compress_block_map(full), torch.argsort(
            full.sum(-1, dtype=torch.int32), dim=-1, descending=True, stable=True))),
        "quant_ms": bench(lambda: attn.quantize_qkv_fp8(q, k, v, dim ** -0.5)),
        "prepare_ms": bench(lambda: attn.prepare_attention(q, k, v, full, bs, dim ** -0.5, True, best["fp8"])),
        "kernel_ms": bench(lambda: attn.launch_attention(prep), est / 2),
    }
    row["fp8_stages_full"] = stages
    log(f"[{length}] fp8 stages (full map): " + ", ".join(f"{n} {t:.3f}" for n, t in stages.items()))
    row["levers"] = levers(length, q, k, v, full, best["fp8"], est)
    log(f"[{length}] levers (whole calls): " + ", ".join(f"{n} {t:.3f}" for n, t in row["levers"].items()))

    # structured densities: ours fp8/bf16 and compiled flex with the same maps
    flex = None
    if not args.skip_flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            from chorus.kernels.codec import to_flex_block_mask
            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as exc:  # noqa: BLE001
            log(f"flex unavailable: {exc}")
    row["densities"] = []
    for density in args.densities:
        bm = structured_block_map(length, heads, density, bs, device="cuda")
        flops = kept_flops(bm, length, length, dim, bs)
        entry = {"density": density, "kept_flops": flops, "measured_density": bm.double().mean().item()}
        for fp8 in (True, False):
            key = "fp8" if fp8 else "bf16"
            ms = bench(ours(bm, fp8), est * density)
            entry[f"{key}_ms"] = ms
            entry[f"{key}_tflops"] = flops / ms / 1e9
            entry[f"{key}_speedup_vs_cudnn"] = row["cudnn_ms"] / ms
        if flex is not None:
            try:
                block_mask = to_flex_block_mask(bm, block_size=bs, q_len=length, kv_len=length)
                flex(q, k, v, block_mask=block_mask)  # compile once per shape
                ms = bench(lambda: flex(q, k, v, block_mask=block_mask), est * density * 2)
                entry["flex_ms"] = ms
                entry["flex_tflops"] = flops / ms / 1e9
                entry["flex_speedup_vs_cudnn"] = row["cudnn_ms"] / ms
            except Exception as exc:  # noqa: BLE001
                log(f"flex failed: {type(exc).__name__}: {str(exc)[:200]}")
        if density in (0.05, 0.15):
            prep_d = attn.prepare_attention(q, k, v, bm, bs, dim ** -0.5, True, best["fp8"])
            entry["fp8_kernel_only_ms"] = bench(lambda: attn.launch_attention(prep_d), est * density)
            if args.sweep:  # which tile config wins on sparse maps (rows of few blocks)
                entry["fp8_sweep_kernel_ms"] = {}
                for cfg in SWEEP_FP8:
                    try:
                        prep_c = attn.prepare_attention(q, k, v, bm, bs, dim ** -0.5, True, cfg)
                        entry["fp8_sweep_kernel_ms"][cfg.name()] = bench(lambda: attn.launch_attention(prep_c), est * density)
                    except Exception:  # noqa: BLE001
                        entry["fp8_sweep_kernel_ms"][cfg.name()] = None
                log(f"[{length}] density {density:.2f} fp8 kernel-only by config: " + ", ".join(
                    f"{n} {t:.2f}" for n, t in entry["fp8_sweep_kernel_ms"].items() if t))
        row["densities"].append(entry)
        log(f"[{length}] density {density:.2f}: fp8 {entry['fp8_ms']:.2f} ms ({entry['fp8_tflops']:.0f} TFLOP/s, "
            f"{entry['fp8_speedup_vs_cudnn']:.2f}x cuDNN); bf16 {entry['bf16_ms']:.2f} ms ({entry['bf16_tflops']:.0f}, "
            f"{entry['bf16_speedup_vs_cudnn']:.2f}x)" + (
                f"; flex {entry['flex_ms']:.2f} ms ({entry['flex_tflops']:.0f}, {entry['flex_speedup_vs_cudnn']:.2f}x)"
                if "flex_ms" in entry else ""))

    # linear fit of fp8 time vs density (intercept = fixed overhead)
    xs = [e["measured_density"] for e in row["densities"]] + [1.0]
    ys = [e["fp8_ms"] for e in row["densities"]] + [row["full_fp8_ms"]]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    row["fp8_fit"] = {"slope_ms": slope, "intercept_ms": my - slope * mx,
                      "intercept_share_of_dense_fp8": (my - slope * mx) / row["full_fp8_ms"]}
    log(f"[{length}] fp8 time ~ {slope:.2f} ms * density + {my - slope * mx:.3f} ms "
        f"(intercept {100 * row['fp8_fit']['intercept_share_of_dense_fp8']:.1f}% of dense FP8)")

    if length in args.mass_sizes:
        row["block_mass"] = []
        for rows in args.mass_rows:
            sample = None if rows >= bs else rows
            ms = bench(lambda: block_mass_triton(q, k, block_size=bs, sample_rows=sample), est * rows / bs)
            row["block_mass"].append({"sample_rows": rows, "ms": ms, "share_of_cudnn": ms / row["cudnn_ms"]})
            log(f"[{length}] block_mass sample_rows={rows}: {ms:.2f} ms = {100 * ms / row['cudnn_ms']:.1f}% of dense cuDNN")
    del ref
    torch.cuda.empty_cache()
    run_peers(length, q, k, v, args, results)
    del q, k, v
    torch.cuda.empty_cache()


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = results["sizes"]
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.2), squeeze=False)
    for ax, row in zip(axes[0], sizes):
        dens = [e["measured_density"] for e in row["densities"]] + [1.0]
        for key, label, marker in (("fp8", "ours FP8", "o"), ("bf16", "ours bf16", "s"), ("flex", "FlexAttention (compiled)", "^")):
            ys = [e.get(f"{key}_ms") for e in row["densities"]]
            full = row.get(f"full_{key}_ms")
            pts = [(d, y) for d, y in zip(dens, ys + [full]) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
        ax.axhline(row["cudnn_ms"], color="k", ls="--", lw=1, label="dense cuDNN bf16")
        ax.axhline(row["flash_ms"], color="gray", ls=":", lw=1, label="dense FLASH bf16")
        ax.set_title(f"1x{row['heads']}x{row['tokens']}x{row['head_dim']}")
        ax.set_xlabel("kept block density")
        ax.set_ylabel("ms (median)")
        ax.set_xlim(0, 1.02)
        ax.set_ylim(0, None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Block-sparse attention time vs density ({results['gpu']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


# the bars for our FP8 kernel (TFLOP/s on kept blocks): (tokens, map) -> bar
FP8_BARS = {(75600, "full"): 950, (32760, "full"): 900, (75600, "0.15"): 900, (75600, "0.05"): 800}


def plot_peers(results: dict, path: str) -> None:
    """TFLOP/s of every peer that ran, per map and length (the ``peers`` table), with the FP8 bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["peers"] if r["ran"]]
    sizes = sorted({r["tokens"] for r in rows})
    maps = ["full", "0.15", "0.05"]
    names = list(dict.fromkeys(r["peer"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.2), squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, tokens in zip(axes[0], sizes):
        for i, name in enumerate(names):
            ys = []
            for m in maps:
                hit = [r for r in rows if r["tokens"] == tokens and r["peer"] == name
                       and (r["map"] == m or (not r["sparse"] and m == "full"))]
                ys.append(hit[0]["tflops"] if hit else 0.0)
            ax.bar([j + i * width for j in range(len(maps))], ys, width, label=name)
        for j, m in enumerate(maps):
            bar = FP8_BARS.get((tokens, m))
            if bar:
                ax.hlines(bar, j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="--", lw=1)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(maps))], ["full map (dense peers: dense)", "15%", "5%"])
        ax.set_ylabel("TFLOP/s on kept blocks (dashed: the FP8 bar)")
        ax.set_title(f"1x40x{tokens}x128")
        ax.grid(alpha=0.3, axis="y")
        ax.set_ylim(0, 1.3 * max([r["tflops"] for r in rows] + list(FP8_BARS.values())))
        ax.legend(fontsize=8, ncol=2, loc="upper right")
    fig.suptitle(f"Block-sparse attention peers, whole calls ({results['gpu']}, torch {results['torch']}, "
                 f"triton {results['triton']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--sizes", default="32760,75600")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--densities", default="0.05,0.10,0.15,0.20,0.30,0.50")
    ap.add_argument("--mass-rows", default="8,16,32")
    ap.add_argument("--mass-sizes", default="75600")
    ap.add_argument("--mass-sweep", action="store_true",
                    help="only the block-mass kernel's launch configurations at --mass-sizes (first of --mass-rows)")
    ap.add_argument("--selection", action="store_true",
                    help="only time the miss's block selection (torch vs the Triton kernel) at --mass-sizes")
    ap.add_argument("--sweep", action="store_true", help="try tile configs on the full map, then use the fastest")
    ap.add_argument("--sweep-paths", default="fp8,bf16,int8", help="comma list: the paths --sweep tries")
    ap.add_argument("--sweep-only", action="store_true", help="stop after the sweep (its table is in the JSON)")
    ap.add_argument("--skip-flex", action="store_true")
    ap.add_argument("--peers-only", action="store_true", help="run only the peers table (no sweep, densities, stages)")
    ap.add_argument("--peers", default="", help="comma list of peer names (default: every peer of peers.PEERS)")
    ap.add_argument("--peer-densities", default="1.0,0.15,0.05", help="maps for sparse peers (1.0 = full map)")
    ap.add_argument("--rounds", type=int, default=3, help="times each peer is timed, the peers in turn (median)")
    ap.add_argument("--uniform-rows", action="store_true",
                    help="peer maps keep the same number of key blocks in every row (for fixed-count kernels; "
                         "use with --sizes 32768,75648, multiples of 128)")
    ap.add_argument("--plot-from", help="only draw the peers plot of this bench_block_sparse.json into --out")
    args = ap.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            plot_peers(json.load(f), os.path.join(args.out, "bench_block_sparse_peers.png"))
        return
    args.peers = [x for x in args.peers.split(",") if x]
    args.sweep_paths = [x for x in args.sweep_paths.split(",") if x]
    if unknown := set(args.sweep_paths) - {"fp8", "bf16", "int8"}:
        ap.error(f"--sweep-paths: unknown path(s) {sorted(unknown)} (fp8, bf16, int8)")
    args.peer_densities = [float(x) for x in args.peer_densities.split(",") if x]
    args.densities = [float(x) for x in args.densities.split(",") if x]
    args.mass_rows = [int(x) for x in args.mass_rows.split(",") if x]
    args.mass_sizes = [int(x) for x in args.mass_sizes.split(",") if x]
    os.makedirs(args.out, exist_ok=True)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "python": platform.python_version(), "argv": sys.argv, "ws_assembler": _ptxas.describe(), "sizes": []}
    log(f"GPU {results['gpu']}, torch {torch.__version__}, triton {triton.__version__} ({results['ws_assembler']})")
    sizes = args.mass_sizes if args.mass_sweep or args.selection else [int(x) for x in args.sizes.split(",")]
    measure = mass_sweep if args.mass_sweep else selection_timing if args.selection else run_size
    for length in sizes:
        measure(length, args, results)
        with open(os.path.join(args.out, "bench_block_sparse.json"), "w") as f:
            json.dump(results, f, indent=1)
    if any(row.get("densities") for row in results["sizes"]):
        plot(results, os.path.join(args.out, "bench_block_sparse.png"))
    if any(r["ran"] for r in results.get("peers", [])):
        plot_peers(results, os.path.join(args.out, "bench_block_sparse_peers.png"))
    log("done")


if __name__ == "__main__":
    main()
