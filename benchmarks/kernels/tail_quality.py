"""Pooled tail quality: our block-sparse attention with and without the tail against ComfyUI's core sparse
attention (``comfy_kitchen.sol_attn``, top-k routing, tail on / off), at equal *actual* density.

Attention source: the structured source of ``benchmarks/quality/source.py`` (one request of the astronaut
picture; one self-attention call, 8 heads x 128 at the 480p grid by default; the softmax scale is folded
into q, so every method runs with ``scale=1.0``). Two head sets: "spread" (q as the source gives it) and
"sharp" (q x ``--sharpen``, 3 by default); for each, the mean share of the exact attention mass in the top
15% / 5% of key blocks of a query block.

Per nominal density ``d`` (5 / 10 / 15 / 25%):

- sol_attn with ``topk_ratio=d`` (64-token blocks) keeps its top-k blocks *plus* its diagonal +-1, so its
  actual density (computed query-key pairs / all pairs) is above ``d``; it is computed here from a replica
  of its routing rule (:func:`sol_routing`: top-k of the query block's mean score against each key block's
  centred mean key, ties kept, and the three diagonal blocks; checked against sol_attn's own output in
  ``--quick``);
- ours with the request's own oracle map: per 128-token query block the key blocks of most exact attention
  mass plus the diagonal block, with the per-row count chosen so that our actual density is the closest to
  sol's (both reported);
- every backend that runs here, with and without ``pooled_tail`` (CPU: ``reference``; CUDA:
  ``triton_fp8_ws``, ``triton_fp8``, ``triton_bf16`` and ``fa4_bf16`` where installed: it has no tail);
- the relative L2 error (``||out - exact|| / ||exact||`` over all heads) against fp64 exact attention of
  the same bf16 inputs (computed per head in row chunks on the inputs' device).

Also the full-map floors (density 100%: what the numerics alone cost) per backend and sol_attn
(``topk_ratio=1``), on Gaussian q/k/v (``scale = 1/sqrt(128)``) and on the sharp heads.

Writes ``tail_quality.json`` into ``--out`` and prints a table. ``--quick`` runs a toy grid on the CPU
(reference backend, sol_attn's eager reference when ``comfy_kitchen`` imports, and a check that the routing
replica reproduces sol_attn's output; ``tests/test_kernels_tail_quality.py``). From the pack root, on the H200
(480p length, 8 heads): ``python -m benchmarks.kernels.tail_quality --out /tmp/tailq`` (about 2 minutes;
sol_attn needs the ``comfy-kitchen`` wheel's CUDA kernels, else its rows say why they did not run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

import chorus.kernels as K

BLOCK = 128  # our block size
SOL_BLOCK = 64  # sol_attn's block size (a fact of comfy_kitchen 0.2.40)
GPU_BACKENDS = ("triton_fp8_ws", "triton_fp8", "triton_int8_ws", "triton_int8", "triton_bf16", "fa4_bf16")


def log(msg: str) -> None:
    print(msg, flush=True)


def write_results(results: dict, out: str, filename: str) -> None:
    """``results`` as ``out/filename`` (JSON; the folder made if missing), then the run's time logged."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, filename), "w") as f:
        json.dump(results, f, indent=1)
    log(f"done in {results['seconds']:.0f} s")


def astronaut(image_npy: str | None = None):
    """scikit-image's astronaut picture (uint8 ``[512, 512, 3]``), or the same array saved with
    ``numpy.save`` (``--image-npy``: for a machine without scikit-image)."""
    if image_npy:
        import numpy as np

        return np.load(image_npy)
    from skimage import data

    return data.astronaut()


def source_qkv(grid, heads: int, call, device, image_npy: str | None = None):
    """q, k, v bf16 ``[1, H, L, 128]`` of one self-attention call ``(expert, step, layer)`` of the astronaut
    request of the structured source (scale folded into q)."""
    from ..quality.source import SOURCE_LABEL, Request, RequestAttention, SourceConfig, build_model

    cfg = SourceConfig(grid=tuple(grid), heads=heads, layers=call[2] + 1)
    image = astronaut(image_npy)[::2, ::2] / 255.0
    attention = RequestAttention(build_model(cfg), Request("astronaut", image, "", seed=1))
    q, k, v = attention.qkv(*call)
    return [t.to(device=device, dtype=torch.bfloat16).contiguous() for t in (q, k, v)], SOURCE_LABEL


def exact_attention(q, k, v, scale: float, chunk_rows: int = 4096) -> torch.Tensor:
    """fp64 dense attention ``[B, H, L, D]`` of the given (bf16) inputs, per head in row chunks (memory
    ``chunk_rows x Lk`` fp64 at a time) on their device."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            kh, vh = k[b, h].double(), v[b, h].double()
            for start in range(0, q.shape[2], chunk_rows):
                rows = q[b, h, start:start + chunk_rows].double()
                out[b, h, start:start + chunk_rows] = torch.softmax(rows @ kh.T * scale, dim=-1) @ vh
    return out


def rel_l2(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(out.double() - exact) / torch.linalg.vector_norm(exact))


def mass_shares(mass: torch.Tensor, fractions=(0.15, 0.05)) -> dict:
    """Mean over (head, query block) of the share of the exact mass in the top ``f`` of key blocks."""
    ranked = mass.sort(dim=-1, descending=True).values
    kb = mass.shape[-1]
    return {f"top{round(100 * f)}": float(ranked[..., :max(1, round(f * kb))].sum(-1).mean()) for f in fractions}


def block_sizes(length: int, block: int, device) -> torch.Tensor:
    n = -(-length // block)
    sizes = torch.full((n,), float(block), dtype=torch.float64, device=device)
    sizes[-1] = length - (n - 1) * block
    return sizes


def actual_density(keep: torch.Tensor, length: int, block: int) -> float:
    """Computed query-key pairs / all pairs of a bool block map ``[B, H, n, n]`` (partial blocks exact)."""
    sizes = block_sizes(length, block, keep.device)
    pairs = torch.einsum("bhij,i,j->", keep.double(), sizes, sizes)
    return float(pairs / (keep.shape[0] * keep.shape[1] * length * length))


def oracle_map(mass: torch.Tensor, count: int) -> torch.Tensor:
    """Per query block the ``count`` key blocks of most exact mass, plus the diagonal block."""
    keep = torch.zeros(mass.shape, dtype=torch.bool, device=mass.device)
    keep.scatter_(-1, mass.topk(min(count, mass.shape[-1]), dim=-1).indices, True)
    n = min(mass.shape[-2], mass.shape[-1])
    keep[..., torch.arange(n), torch.arange(n)] = True
    return keep


def matching_count(mass: torch.Tensor, length: int, target: float) -> int:
    """The per-row count whose :func:`oracle_map` density is the closest to ``target`` (density grows with it)."""
    lo, hi = 1, mass.shape[-1]
    while lo < hi:  # smallest count reaching the target
        mid = (lo + hi) // 2
        if actual_density(oracle_map(mass, mid), length, BLOCK) < target:
            lo = mid + 1
        else:
            hi = mid
    candidates = {max(1, lo - 1), lo}
    return min(candidates, key=lambda c: abs(actual_density(oracle_map(mass, c), length, BLOCK) - target))


def sol_routing(q: torch.Tensor, k: torch.Tensor, ratio: float) -> torch.Tensor:
    """sol_attn's top-k routing as documented in comfy_kitchen 0.2.40 (our own code of its rule): bool
    ``[B, H, n, n]`` over 64-token blocks; query block ``I`` keeps the ``max(1, min(n - 1, round(ratio * n)))``
    key blocks ``j`` of the highest mean over its rows of ``q_i . (kbar_j - mean_j kbar_j)`` (ties at the
    threshold kept) and the blocks ``|I - j| <= 1``. q/k ``[B, H, L, D]``; no sinks."""
    length = q.shape[2]
    n = -(-length // SOL_BLOCK)
    sizes = block_sizes(length, SOL_BLOCK, q.device).float()

    def block_means(x):
        x = torch.nn.functional.pad(x.float(), (0, 0, 0, n * SOL_BLOCK - length))
        return x.view(*x.shape[:2], n, SOL_BLOCK, x.shape[-1]).sum(3) / sizes[:, None]

    kbar = block_means(k)
    kbar = kbar - kbar.mean(dim=2, keepdim=True)
    score = block_means(q) @ kbar.transpose(-1, -2)  # the mean over a block's rows of q_i . kbar_j
    count = max(0, min(n - 1, max(1, round(ratio * n)))) if n > 1 else 0
    keep = torch.zeros(score.shape, dtype=torch.bool, device=q.device)
    if count:
        keep = score >= score.topk(count, dim=-1).values[..., -1:]
    idx = torch.arange(n, device=q.device)
    return keep | ((idx[:, None] - idx[None, :]).abs() <= 1)


def attention_with_blocks(q, k, v, keep, block, scale, tail):
    """fp64 attention restricted to ``keep`` (blocks of ``block`` tokens), optionally with a pooled tail in
    sol_attn's form (each skipped block: the query block's mean score against the block's mean key, weight
    = its token count, value = its mean; the keys centred by the mean of the block means first, which this
    form, unlike a per-row score, is not invariant to; used only to check :func:`sol_routing` against
    sol_attn)."""
    from chorus.kernels.reference import dense_attention_oracle, expand_block_map, pooled_key_blocks

    if not tail:
        return dense_attention_oracle(q, k, v, keep, block, scale=scale)
    q64, k64, v64 = q.double(), k.double(), v.double()
    length = q.shape[2]
    kbar, vbar = pooled_key_blocks(k64, v64, block)
    centre = kbar.mean(dim=2, keepdim=True)
    k64, kbar = k64 - centre, kbar - centre
    scores = (q64 @ k64.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~expand_block_map(keep, length, length, block), float("-inf"))
    rows = torch.arange(length, device=q.device) // block
    n = keep.shape[-1]
    sizes = block_sizes(length, block, q.device)
    qbar = torch.nn.functional.pad(q64, (0, 0, 0, n * block - length)).view(*q.shape[:2], n, block, -1).sum(3)
    qbar = qbar / sizes[:, None]
    pooled = (qbar @ kbar.transpose(-1, -2)) * scale + sizes.log()  # [B, H, n, n], per query block
    pooled = pooled.masked_fill(keep, float("-inf"))[..., rows, :]
    probs = torch.softmax(torch.cat([scores, pooled], dim=-1), dim=-1)
    return probs[..., :length] @ v64 + probs[..., length:] @ vbar


def load_sol(device):
    """``(sol_attn, how)`` or ``(None, reason)``: comfy_kitchen's sol_attn, its CUDA kernels on a GPU (the eager
    reference is O(L^2) in memory), its eager reference on the CPU."""
    from .peers import comfy_kitchen_with_sol_attn

    comfy_kitchen, why = comfy_kitchen_with_sol_attn()
    if comfy_kitchen is None:
        return None, why
    if device.type == "cuda":
        if not comfy_kitchen.sol_attn_is_available(device):
            return None, "comfy_kitchen's CUDA sol_attn kernels are not available on this GPU / build"
        return comfy_kitchen.sol_attn, "cuda kernels"
    return comfy_kitchen.sol_attn, "eager reference (CPU)"


def run_sol(sol, q, k, v, scale, ratio, tail):
    """sol_attn on our ``[B, H, L, D]`` tensors (it takes ``[B, L, H, D]``), back in our layout; ``ratio`` >= 1:
    every block exact (its threshold routing at ``tau = -1e9``: top-k takes ratios below 1 only)."""
    routing = dict(topk_ratio=ratio) if ratio < 1 else dict(tau=-1e9)
    out = sol(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
              scale=scale, tail=tail, **routing)
    return out.transpose(1, 2)


def run_ours(backend, q, k, v, keep, scale, tail):
    """``(output, None)`` or ``(None, reason)``."""
    try:
        return K.block_sparse_attention(q, k, v, keep, block_size=BLOCK, scale=scale, backend=backend,
                                        pooled_tail=tail, rows_checked=True), None
    except Exception as exc:  # noqa: BLE001 - a backend that fails is a row of the table, not the end of the run
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"


def head_set_rows(name, q, k, v, backends, sol, densities, results):
    """The table of one head set: every density, every method; appends to ``results``."""
    length = q.shape[2]
    exact = exact_attention(q, k, v, 1.0)
    mass = K.block_mass(q, k, block_size=BLOCK, scale=1.0)
    entry = {"mass_shares": mass_shares(mass), "rows": []}
    log(f"[{name}] mean share of the exact mass in the top 15% / 5% of key blocks: "
        f"{entry['mass_shares']['top15']:.3f} / {entry['mass_shares']['top5']:.3f}")
    for d in densities:
        sol_keep = sol_routing(q, k, d)
        row = {"nominal_density": d, "sol_density": actual_density(sol_keep, length, SOL_BLOCK), "errors": {},
               "not_run": {}}
        count = matching_count(mass, length, row["sol_density"])
        keep = oracle_map(mass, count)
        row.update(ours_blocks_per_row=count, ours_density=actual_density(keep, length, BLOCK))
        for backend in backends:
            for tail in (True, False):
                key = f"ours:{backend}:{'tail' if tail else 'no_tail'}"
                out, reason = run_ours(backend, q, k, v, keep, 1.0, tail)
                if out is None:
                    row["not_run"][key] = reason
                else:
                    row["errors"][key] = rel_l2(out, exact)
        for tail in (True, False):
            key = f"sol:{'tail' if tail else 'no_tail'}"
            if sol is None:
                row["not_run"][key] = results["sol"]
                continue
            try:
                row["errors"][key] = rel_l2(run_sol(sol, q, k, v, 1.0, d, tail), exact)
            except Exception as exc:  # noqa: BLE001 - as for our backends
                row["not_run"][key] = f"{type(exc).__name__}: {str(exc)[:300]}"
        entry["rows"].append(row)
        log(f"[{name}] d={d:.2f}: sol actual {row['sol_density']:.4f}, ours {count} blocks/row = "
            f"{row['ours_density']:.4f}; " + ", ".join(f"{k_} {e:.4f}" for k_, e in row["errors"].items()))
    results["head_sets"][name] = entry


def floors(q, k, v, scale, backends, sol, label, results):
    """Full-map relative L2 per backend and sol_attn (every block exact) on these inputs."""
    exact = exact_attention(q, k, v, scale)
    nb = -(-q.shape[2] // BLOCK)
    full = torch.ones(1, 1, nb, nb, dtype=torch.bool, device=q.device)
    entry = {}
    for backend in backends:
        out, reason = run_ours(backend, q, k, v, full, scale, False)
        entry[backend] = rel_l2(out, exact) if out is not None else f"not run: {reason}"
    if sol is not None:
        try:
            entry["sol_attn"] = rel_l2(run_sol(sol, q, k, v, scale, 1.0, True), exact)
        except Exception as exc:  # noqa: BLE001 - as for our backends
            entry["sol_attn"] = f"not run: {type(exc).__name__}: {str(exc)[:300]}"
    results["floors"][label] = entry
    log(f"[floors {label}] " + ", ".join(f"{n} {e if isinstance(e, str) else f'{e:.4f}'}" for n, e in entry.items()))


def sol_replica_check(q, k, v, sol, ratio: float) -> dict:
    """How close :func:`sol_routing` (and the tail in sol's form) reproduce sol_attn's own output (small
    inputs: the fp64 reimplementation is dense): relative L2 of sol_attn against each."""
    keep = sol_routing(q, k, ratio)
    out = {}
    for tail in (False, True):
        mine = attention_with_blocks(q, k, v, keep, SOL_BLOCK, 1.0, tail)
        out["tail" if tail else "no_tail"] = rel_l2(run_sol(sol, q, k, v, 1.0, ratio, tail), mine)
    return out


def print_table(results: dict) -> None:
    for name, entry in results["head_sets"].items():
        keys = sorted({k for row in entry["rows"] for k in row["errors"]})
        log(f"\n{name} heads (top 15% / 5% of blocks hold {entry['mass_shares']['top15']:.3f} / "
            f"{entry['mass_shares']['top5']:.3f} of the mass); relative L2 vs fp64 exact attention")
        log("| nominal | sol actual density | ours actual density (blocks/row) | " + " | ".join(keys) + " |")
        log("|---" * (3 + len(keys)) + "|")
        for row in entry["rows"]:
            cells = [f"{row['errors'][k]:.4f}" if k in row["errors"] else "-" for k in keys]
            log(f"| {row['nominal_density']:.2f} | {row['sol_density']:.4f} | {row['ours_density']:.4f} "
                f"({row['ours_blocks_per_row']}) | " + " | ".join(cells) + " |")
    for label, entry in results["floors"].items():
        log(f"\nfull-map floor, {label}: " + ", ".join(
            f"{n} {e if isinstance(e, str) else f'{e:.4f}'}" for n, e in entry.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="toy grid on the CPU (the CPU test's mode)")
    ap.add_argument("--grid", nargs=3, type=int, default=[21, 30, 52], help="token grid T H W (480p: 21 30 52)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--call", nargs=3, type=int, default=[0, 0, 0], help="expert step layer of the source")
    ap.add_argument("--sharpen", type=float, default=3.0, help="q scale of the sharp head set")
    ap.add_argument("--image-npy", default=None,
                    help="the astronaut picture as a numpy .npy file (where scikit-image is not installed)")
    ap.add_argument("--densities", default="0.05,0.10,0.15,0.25")
    ap.add_argument("--backends", default="", help="comma list (default: reference on CPU, "
                                                   f"{','.join(GPU_BACKENDS)} on CUDA)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if args.quick:
        args.grid, args.heads, args.densities = [4, 16, 20], 2, "0.10,0.25"
    densities = [float(x) for x in args.densities.split(",") if x]
    backends = [b for b in args.backends.split(",") if b] or (list(GPU_BACKENDS) if device.type == "cuda"
                                                            else ["reference"])
    t0 = time.time()
    (q, k, v), label = source_qkv(args.grid, args.heads, tuple(args.call), device, args.image_npy)
    sol, how = load_sol(device)
    results = {"source": f"{label}; request 'astronaut', call (expert, step, layer) {tuple(args.call)}",
               "grid": args.grid, "tokens": q.shape[2], "heads": args.heads, "head_dim": q.shape[3],
               "sharpen": args.sharpen, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "python": platform.python_version(), "argv": sys.argv,
               "sol": how, "sol_ran": sol is not None, "backends": backends, "head_sets": {}, "floors": {}}
    log(f"source ready in {time.time() - t0:.1f} s: {results['source']}, {q.shape[2]} tokens, {args.heads} heads; "
        f"sol_attn: {how}")
    sharp = (q.float() * args.sharpen).to(q.dtype)
    head_set_rows("spread", q, k, v, backends, sol, densities, results)
    head_set_rows("sharp", sharp, k, v, backends, sol, densities, results)
    gen = torch.Generator(device=device).manual_seed(0)
    gq, gk, gv = (torch.randn(q.shape, generator=gen, device=device).to(torch.bfloat16) for _ in range(3))
    floors(gq, gk, gv, q.shape[3] ** -0.5, backends, sol, "gaussian", results)
    floors(sharp, k, v, 1.0, backends, sol, "sharp heads", results)
    if sol is not None and args.quick:
        results["sol_replica_rel_l2"] = {name: sol_replica_check(x, k, v, sol, densities[0])
                                         for name, x in (("spread", q), ("sharp", sharp))}
        log(f"sol_attn against our replica of its routing (relative L2): {results['sol_replica_rel_l2']}")
    results["seconds"] = time.time() - t0
    print_table(results)
    write_results(results, args.out, "tail_quality.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
