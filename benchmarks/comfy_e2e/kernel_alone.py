"""A hit's sparse-attention kernel timed by itself, beside the hit's per-call time in the model: on an idle GPU,
and each call between the GEMMs of one Wan block's linears, at the clock such a load holds (GPU only)."""

from __future__ import annotations

import contextlib
import math

import torch


def kernel_alone_ms(plan, shape, sampler=None, reps: int = 10, backend: str = "auto",
                    portable_parts: bool = True) -> dict:
    """The kernel a hit runs by itself: ``block_sparse_attention(backend=backend)`` at the hit's token grid and in
    the entry's token order, as the hit runs it (key ``backend``'s name, e.g. ``"auto"``: its median ms, with the
    pooled tail as the node's default runs it; ``"<name>_no_tail"``: without; ``"backend"``: what it resolved to) on
    random q/k/v in ComfyUI's layout with the map the hit computes for layer 0 of step 0 (entry map + k_min
    floor); for ``"auto"`` with ``portable_parts`` also the portable Triton FP8 kernel whole and in its two parts
    (pre-pass + index, attention), without the tail (what no row's compiling changes: a compiled row whose eager
    twin timed them passes False). ``backend``: the one the row's hit runs (a ``--hit-backends`` row names its
    own). ``sampler`` (a ``GpuSampler``): ``"gpu_<name>"`` = the GPU's clock and power while the hit's kernel
    was timed, to set beside the row's ``"gpu"`` (the same kernel inside the model runs at the model's clock).
    ``"<name>_under_load"``: the hit's kernel again, each call queued between the GEMMs of one block's linears
    (:func:`block_linears`; ``"under_load_gemms"`` of them) and timed as the model's calls are timed (events, no
    synchronize; :func:`~chorus.benchmarks.timing.cuda_median_ms_between`), so at the clock such a load holds
    (``"gpu_<name>_under_load"``): the kernel alone at the model's clock, what a call in the model is set beside
    to read the integration's own cost."""
    from chorus import kernels
    from chorus.engine.maps import floor_k_min, stored_map
    from chorus.kernels.api import resolve_backend
    from chorus.kernels.triton._attention import launch_attention, prepare_attention

    from ..timing import cuda_median_ms, cuda_median_ms_between

    t, h, w = plan.token_grid
    length, heads, dim = t * h * w, shape["num_heads"], shape["dim"] // shape["num_heads"]
    stored = stored_map(plan, 0, 0, 0, block_size=128, top_p=0.9, k_min=4, device="cuda")
    block_map = floor_k_min(stored, 4)[None]
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = [torch.randn(1, length, heads * dim, device="cuda", dtype=torch.bfloat16, generator=gen)
           .view(1, length, heads, dim).transpose(1, 2) for _ in range(3)]
    scale = 1.0 / math.sqrt(dim)
    parts = ("triton_fp8", "prepass_and_index", "attention_kernel") if backend == "auto" and portable_parts else ()
    prep = prepare_attention(*qkv, block_map, 128, scale, True) if parts else None
    out = {"backend": resolve_backend(backend, qkv[0]).value}
    no_tail = f"{backend}_no_tail"

    def timed_call(name):
        def call():
            if name == "prepass_and_index":
                return prepare_attention(*qkv, block_map, 128, scale, True)
            if name == "attention_kernel":
                return launch_attention(prep)
            hit_like = name in (backend, no_tail)
            o = kernels.block_sparse_attention(*qkv, block_map, backend=backend if hit_like else name,
                                               rows_checked=True, token_perm=plan.entry_order if hit_like else None,
                                               pooled_tail=name == backend)
            return o.transpose(1, 2).reshape(1, length, heads * dim)
        return call

    for name in (backend, no_tail) + parts:
        if name == backend and sampler is not None:
            with sampler.window() as window:
                out[name] = cuda_median_ms(timed_call(name), reps, warmup=2)
            out[f"gpu_{backend}"] = window.summary()
        else:
            out[name] = cuda_median_ms(timed_call(name), reps, warmup=2)
    linears, gemms = block_linears(length, shape["dim"], shape["ffn_dim"])
    with (sampler.window() if sampler is not None else contextlib.nullcontext()) as window:
        out[f"{backend}_under_load"] = cuda_median_ms_between(timed_call(backend), linears, reps=2 * reps)
    out["under_load_gemms"] = gemms
    if window is not None:
        out[f"gpu_{backend}_under_load"] = window.summary()
    out["density"] = float(block_map.float().mean())
    return out


def block_linears(length: int, dim: int, ffn_dim: int):
    """``(run, n)``: ``run()`` queues the GEMM work of one Wan block's linear layers at ``length`` tokens --
    self-attention's q, k, v, o and cross-attention's q, o (``dim x dim`` each) and the feed-forward's
    ``dim x ffn_dim`` pair -- as ``n`` bf16 GEMMs ``[length, dim] @ [dim, dim]`` of the same total FLOPs
    (``n = round((6 dim + 2 ffn_dim) / dim)``, 11 for Wan 14B), on random data (the same input each
    time: a chained product would drift to inf). The load that holds the GPU's clock near where the model
    holds it around an attention call (:func:`chorus.benchmarks.timing.cuda_median_ms_between`; measured a
    little lower, as the model's elementwise work draws less power); 2 ``length x dim`` buffers."""
    gemms = max(1, round((6 * dim + 2 * ffn_dim) / dim))
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(length, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(dim)
    y = torch.empty_like(x)

    def run():
        for _ in range(gemms):
            torch.matmul(x, weight, out=y)

    return run, gemms
