"""GPU timing shared by the benchmarks: CUDA events around one call, median of several."""

from __future__ import annotations

import statistics

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
