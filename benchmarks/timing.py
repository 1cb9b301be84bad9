"""GPU timing shared by the benchmarks: CUDA events around one call, median of several."""

from __future__ import annotations

import statistics
import time

import torch


def cuda_median_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls, each between two CUDA events and followed
    by a synchronize (so a call's own launch latency counts), after ``warmup`` untimed calls
    (kernel compilation)."""
    torch.cuda.synchronize()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_median_ms_between(fn, between, reps: int, settle_s: float = 2.0) -> float:
    """Median milliseconds of ``fn()`` on a GPU kept busy by ``between()``, as an attention call sits
    between a transformer block's linears in a model: each timed call is queued right after one
    ``between()``, with CUDA events around ``fn()`` alone and no synchronize until all ``reps`` are queued
    (as a model's timer records them). First ``settle_s`` seconds of the same alternation run untimed (warm-up
    and compilation, and the GPU's clock and power settle where that load holds them: a power-capped GPU runs
    a lower SM clock under a model's GEMMs than it gives a kernel timed alone in a loop)."""
    torch.cuda.synchronize()
    settle_until = time.perf_counter() + settle_s
    while True:
        between()
        fn()
        torch.cuda.synchronize()
        if time.perf_counter() >= settle_until:
            break
    pairs = []
    for _ in range(reps):
        between()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)
