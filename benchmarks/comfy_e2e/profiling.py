"""``--profile``: one sampling step of a row under ``torch.profiler``, its top kernels, and the GPU time of the
device work launched inside each ``chorus::`` op's calls (a hit's attention call's kernels, beside its per-call
time in the table)."""

from __future__ import annotations

import bisect

import torch


def profile_step(step, top: int = 40) -> dict:
    """One sampling step (the high expert's step 0 -> 1, after the timed request) under
    ``torch.profiler`` (CPU and, where there is one, CUDA activity): total GPU time, the ``top`` kernels by GPU time,
    ``name -> [ms, calls]`` (names cut at 100 characters), and per ``chorus::`` custom op the GPU time
    of the kernels run inside its calls (``ops``: :func:`chorus_op_times`; ``chorus::attend``: a hit's
    sparse attention calls, pre-pass, block lists and kernel together; empty, with ``ops_error`` saying why, where
    this torch's raw profiler events lack what it reads). Where a request's time goes, not a timing of record (the profiler adds its own host overhead; kernel durations are the GPU's)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    kernels = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CPU:
            continue
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        if us > 0:
            name = event.key[:100]
            ms, calls = kernels.get(name, (0.0, 0))
            kernels[name] = (ms + us / 1000.0, calls + event.count)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    out = {"gpu_ms_total": sum(ms for ms, _ in kernels.values()),
           "kernels": {name: [round(ms, 3), calls] for name, (ms, calls) in ranked[:top]}, "ops": {}}
    try:
        out["ops"] = chorus_op_times(prof.profiler.kineto_results.events())
    except AttributeError as exc:  # a torch whose raw events lack an accessor: the row keeps its other numbers
        out["ops_error"] = f"{type(exc).__name__}: {exc}"
    return out


def chorus_op_times(events) -> dict:
    """Per ``chorus::`` custom op in a profile's raw events (``torch.profiler``'s kineto events, as
    ``prof.profiler.kineto_results.events()`` gives them: ``name()``, ``device_type()``, ``start_ns()``,
    ``duration_ns()``, ``correlation_id()``, ``linked_correlation_id()``): ``name -> [ms, calls, events]``, the GPU time of the
    device work (kernels, copies, memsets) launched inside its calls, how many calls launched any, and every
    event of that name.

    A device activity belongs to the call during which the host launched it: its launch is the host-side
    runtime / driver event of the same correlation id (a host event linked to an op; an op is a host event
    linked to none), and the call is the outermost ``chorus::`` op event
    whose host interval holds that launch's start (the benchmark launches from one thread). The profiler's
    own op-to-kernel link is not used: in a 40-layer step it gave each compiled call the GEMMs of its layer
    (55 ms a call against a 24.5 ms per-call median) and each eager call 1.2 ms too much (H200, 2026-12-04;
    right at 3 layers). A call counts once: an op event inside another ``chorus::`` event (the op's
    implementation dispatched again) is part of it, and one that launched nothing is not a call (dynamo
    tracing the op with fake tensors, in a step that recompiles; on the CPU nothing is launched, so there
    are events and no calls)."""
    cpu = torch.autograd.DeviceType.CPU
    host = [e for e in events if e.device_type() == cpu]
    op_events = sorted((e for e in host if e.linked_correlation_id() == 0 and e.name().startswith("chorus::")),
                       key=lambda e: e.start_ns())
    seen: dict[str, int] = {}
    calls: list[list] = []  # outermost calls in start order: [name, start_ns, end_ns, device ns, launched]
    for event in op_events:
        seen[event.name()] = seen.get(event.name(), 0) + 1
        if calls and event.start_ns() < calls[-1][2]:
            continue  # inside the call before it
        calls.append([event.name(), event.start_ns(), event.start_ns() + event.duration_ns(), 0, False])
    launches = {e.correlation_id(): e.start_ns() for e in host if e.linked_correlation_id() > 0}
    starts = [call[1] for call in calls]
    for activity in events:
        launched = launches.get(activity.correlation_id()) if activity.device_type() != cpu else None
        if launched is None:
            continue
        index = bisect.bisect_right(starts, launched) - 1
        if index >= 0 and launched <= calls[index][2]:
            calls[index][3] += activity.duration_ns()
            calls[index][4] = True
    ops = {name: [0.0, 0, count] for name, count in seen.items()}
    for name, _start, _end, device_ns, launched in calls:
        if launched:
            ops[name][0] += device_ns / 1e6
            ops[name][1] += 1
    return {name: [round(ms, 3), n, count] for name, (ms, n, count) in ops.items()}


def attention_kernels_ms(profile: dict | None) -> float | None:
    """GPU time of one ``chorus::attend`` call's kernels in a profiled step (:func:`profile_step`), or None
    where the step ran none. Beside the row's per-call time (CUDA events in the timed request) it gives what
    a call costs over its kernels, both measured inside the model at the clock it runs at."""
    ms, calls = ((profile or {}).get("ops", {}).get("chorus::attend") or (0.0, 0))[:2]
    return ms / calls if calls else None
