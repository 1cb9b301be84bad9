"""``python -m chorus check``: which attention kernel Chorus runs on this machine and, with ``--run``, whether it
computes right here and how fast it is beside PyTorch's dense attention on the same device.

The report (nothing runs but ``auto``'s resolution, which runs each kernel it considers once on a small input:
:func:`~chorus.kernels.triton.portable_unavailable`): Python, torch (and its CUDA), Triton; the device (name,
compute capability, memory); ``auto``'s chain for a Wan self-attention call (``--dtype``, head dim 128), with the reason
each backend cannot run here; the kernel a miss records its block mass with; the accurate 8-bit numerics (what the
engine runs for masks that keep >= 95% of the attention mass); on Hopper, which ptxas builds the warp-specialised
kernel; off Hopper, where auto takes the 16-bit ``triton_bf16`` and the portable FP8 kernel runs too (sm_89+: Ada,
Blackwell; its first-use check runs), that option.

``--dtype`` (default ``fp16``): the dtype of every q / k / v the check makes. ComfyUI computes a Wan model in fp16 on
a GPU (its loader takes the first of Wan's inference dtypes the device supports: fp16 on the GPUs the Chorus kernels
are built for, sm_80 and later), from an fp16, bf16 or FP8-scaled file; ``bf16`` is what a user who starts ComfyUI
with ``--bf16-unet`` runs. (Named ``triton_bf16``, the 16-bit kernel computes in the inputs' dtype, fp16 included.)

``--run`` (a GPU's first run builds the kernels: up to a minute):

1. Numerics, the check: a full map on Gaussian q/k/v (4 heads x 4 097 tokens, a partial last block; 1 000 on the
   CPU) through ``auto``'s choice and the accurate backend, relative L2 against the fp64 oracle on every 8th
   query row, PyTorch's dense attention in the inputs' dtype beside them. A result that is not finite or exceeds
   its numerics' ceiling (:data:`~chorus.kernels.reference.NUMERICS_CEILINGS`: FP8 0.08, INT8 0.03, 16-bit and
   fp32 0.02, where the measured errors are 0.051-0.056, 0.014-0.017 and 0.002-0.006) fails: exit 1, with the
   backend to choose instead.
2. Speed, a report: ``--heads`` x ``--tokens`` (40 x 32 760, Wan 14B at 480p; 2 x 2 048 on the CPU) in ``--dtype``, a
   random map keeping ``--density`` of the key blocks (and the diagonal), the pooled tail on (the node's default):
   the median of ``--reps`` calls after two warm-up calls, beside ``torch.nn.functional.scaled_dot_product_attention``
   on the same q/k/v (CUDA events; the wall clock on the CPU). Never judged: a random map is not a Wan map, and a
   request also runs its linears (on Hopper a 720p hit at 15% is ~2.9x a dense request: docs/BENCHMARKS.md).
3. The option (``triton_fp8`` off Hopper, where it runs): its numerics row in step 1 and, where it passed, its
   speed as in step 2 beside auto's, for a user choosing it by name (FP8 numerics: ~0.055 against ~0.004); its
   failure is reported, never the check's (auto does not run it).

Exit codes: 0 (report, or every check passed), 1 (a numerics check failed or a kernel raised), 2 (bad arguments).
``--json PATH`` also writes everything as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time

import torch

from .api import (ACCURATE_CHAIN, Backend, auto_chain, block_sparse_attention, has_pooled_tail, numerics_of,
                  resolve_backend, why_unavailable)
from .reference import NUMERICS_CEILINGS, dense_attention_oracle, relative_l2

HEAD_DIM = 128
ORACLE_ROW_STRIDE = 8
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _versions() -> dict:
    try:
        import triton  # noqa: PLC0415 - optional: the report says when it is missing

        triton_version = triton.__version__
    except Exception as exc:  # noqa: BLE001 - any import failure is the answer
        triton_version = f"not importable ({type(exc).__name__}: {exc})"
    return {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "triton": triton_version}


def _device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"device": str(device), "name": platform.processor() or "CPU"}
    props = torch.cuda.get_device_properties(device)
    return {"device": str(device), "name": props.name, "capability": f"sm_{props.major}{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1)}


def report(device: torch.device, dtype: torch.dtype = torch.float16) -> dict:
    """What runs here for q / k / v of ``dtype``, without running attention (see the module docstring)."""
    probe = torch.empty(1, 1, 1, HEAD_DIM, dtype=dtype, device=device)
    chain = [{"backend": b.value, "reason": why} for b, why in auto_chain(probe)]
    choice = resolve_backend("auto", probe)
    accurate_reasons = {b.value: why_unavailable(b, probe) for b in ACCURATE_CHAIN}
    accurate = next((name for name, why in accurate_reasons.items() if why is None), None)
    mass_chain = [{"backend": b.value, "reason": why} for b, why in auto_chain(probe, "block_mass")]
    out = {"versions": _versions(), "device": _device_info(device), "dtype": _dtype_name(dtype), "chain": chain,
           "auto": choice.value, "block_mass_chain": mass_chain,
           "block_mass": resolve_backend("auto", probe, "block_mass").value, "accurate": accurate,
           "accurate_reasons": accurate_reasons}
    # off Hopper auto takes the 16-bit kernel; where the portable FP8 one runs too (sm_89+: Ada, Blackwell), --run
    # also checks and times it: a choice by name whose speed on such GPUs the project has not measured
    out["option"] = None
    if choice == Backend.TRITON_BF16 and why_unavailable(Backend.TRITON_FP8, probe) is None:
        out["option"] = Backend.TRITON_FP8.value
    if choice == Backend.TRITON_FP8_WS:
        from .triton import _ptxas  # noqa: PLC0415 - Triton is importable once the Gluon kernel was chosen

        out["ptxas"] = _ptxas.describe()
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def _gaussian(heads: int, tokens: int, device: torch.device, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(1, heads, tokens, HEAD_DIM, generator=gen, device=device).to(dtype) for _ in range(3)]


def _full_map(tokens: int, device: torch.device) -> torch.Tensor:
    blocks = -(-tokens // 128)
    return torch.ones(1, 1, blocks, blocks, dtype=torch.bool, device=device)


def check_numerics(device: torch.device, backends: list[Backend], dtype: torch.dtype = torch.float16) -> list[dict]:
    """Step 1 of ``--run``: one row per backend (and PyTorch's dense attention) on q / k / v of ``dtype``: relative
    L2 against the fp64 oracle, its ceiling, whether it passed; a backend that raises is a failed row with the
    error."""
    tokens = 4097 if device.type == "cuda" else 1000
    q, k, v = _gaussian(4, tokens, device, dtype, seed=1)
    rows = torch.arange(0, tokens, ORACLE_ROW_STRIDE, device=device)
    exact = dense_attention_oracle(q[:, :, rows], k, v)
    torch_error = relative_l2(torch.nn.functional.scaled_dot_product_attention(q, k, v)[:, :, rows], exact)
    results = [{"backend": "torch dense", "numerics": _dtype_name(dtype),
                "rel_l2": torch_error, "ceiling": None, "passed": True}]
    for backend in backends:
        numerics = numerics_of(backend)
        ceiling = NUMERICS_CEILINGS[numerics]
        row = {"backend": backend.value, "numerics": numerics, "ceiling": ceiling}
        try:
            out = block_sparse_attention(q, k, v, _full_map(tokens, device), backend=backend.value)
            row["rel_l2"] = relative_l2(out[:, :, rows], exact)
            row["passed"] = row["rel_l2"] <= ceiling
        except Exception as exc:  # noqa: BLE001 - the check reports whatever the kernel raised
            row.update(rel_l2=None, passed=False, error=f"{type(exc).__name__}: {exc}")
        results.append(row)
    return results


def _timer(device: torch.device):
    """``timed(fn) -> ms`` of one call: CUDA events on a GPU (the current device's stream), the wall clock on the
    CPU."""
    if device.type == "cuda":
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
    else:
        def timed(fn):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
    return timed


def measure_speed(device: torch.device, backend: Backend, heads: int, tokens: int, density: float,
                  reps: int, dtype: torch.dtype = torch.float16) -> dict:
    """Step 2 of ``--run``: ``backend`` on q / k / v of ``dtype`` and a random map of ``density`` (the diagonal
    kept, the pooled tail on where the backend has one) beside PyTorch's dense attention, medians of ``reps`` calls
    after two warm-up calls; the first call's time (which builds the kernel on a fresh machine) apart."""
    q, k, v = _gaussian(heads, tokens, device, dtype, seed=2)
    blocks = -(-tokens // 128)
    gen = torch.Generator(device=device).manual_seed(3)
    block_map = torch.rand(1, heads, blocks, blocks, generator=gen, device=device) < density
    block_map |= torch.eye(blocks, dtype=torch.bool, device=device)
    timed = _timer(device)
    tail = has_pooled_tail(backend)

    def sparse():
        return block_sparse_attention(q, k, v, block_map, backend=backend.value, pooled_tail=tail)

    def dense():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    first_s = timed(sparse) / 1e3
    medians = {}
    for name, fn in (("chorus", sparse), ("torch_dense", dense)):
        for _ in range(2):
            fn()
        medians[name] = statistics.median(timed(fn) for _ in range(reps))
    return {"backend": backend.value, "heads": heads, "tokens": tokens, "dtype": _dtype_name(dtype),
            "density": block_map.float().mean().item(),
            "pooled_tail": tail,
            "first_call_s": first_s, "chorus_ms": medians["chorus"], "torch_dense_ms": medians["torch_dense"],
            "speedup": medians["torch_dense"] / medians["chorus"]}


def _print_report(info: dict) -> None:
    ver, dev = info["versions"], info["device"]
    cuda = f" (CUDA {ver['torch_cuda']})" if ver["torch_cuda"] else " (no CUDA)"
    print(f"Chorus II check\n  python {ver['python']}, torch {ver['torch']}{cuda}, triton {ver['triton']}")
    extra = f", {dev['capability']}, {dev['memory_gib']} GiB" if "capability" in dev else ""
    print(f"  device {dev['device']}: {dev['name']}{extra}")
    print(f"  attention ({info['dtype']}, head dim 128), auto's chain:")
    for row in info["chain"]:
        mark = "<- auto's choice" if row["backend"] == info["auto"] else (row["reason"] or "runs here")
        print(f"    {row['backend']:<15} {mark}")
    if info["block_mass"] != "reference":
        mass = "the Triton kernel"
    else:
        reasons = [f"{row['backend']}: {row['reason']}" for row in info["block_mass_chain"] if row["reason"]]
        mass = "the reference (plain torch)" + (f" ({'; '.join(reasons)})" if reasons else "")
    print(f"  block mass (what a miss records): {mass}")
    if info["accurate"]:
        print(f"  accurate numerics (masks keeping >= 95% of the mass): {info['accurate']}")
    else:
        reasons = "; ".join(f"{b}: {why}" for b, why in info["accurate_reasons"].items())
        print(f"  accurate numerics: none here ({reasons}); such masks run auto's choice")
    if info.get("option"):
        print(f"  by name: {info['option']} runs here too (FP8 numerics, where auto keeps 16-bit ones; its speed on "
              "this kind of GPU is not measured by the project: --run checks and times it)")
    if "ptxas" in info:
        print(f"  warp-specialised kernel: {info['ptxas']}")
    if dev["device"] == "cpu":
        print("  no CUDA device: every call runs the reference kernel (plain torch), for trying the nodes, "
              "not faster than dense")
    elif info["auto"] in (Backend.FLEX.value, Backend.REFERENCE.value):
        runs = ("ComfyUI's own dense attention (no speed-up: the reference kernel would be slower) and a miss "
                "records nothing"
                if info["auto"] == Backend.REFERENCE.value else
                "ComfyUI's own dense attention with the pooled tail on (the default; no speed-up), FlexAttention "
                "with it off")
        print(f"  WARNING: no Triton kernel runs on this GPU (the reasons above), so a hit runs {runs}: install a "
              "Triton that matches this torch (on Windows, triton-windows), or leave the Chorus nodes out")


def _print_numerics(rows: list[dict]) -> None:
    print("  numerics (full map, Gaussian q/k/v, relative L2 against exact attention in fp64):")
    for row in rows:
        if row.get("error"):
            print(f"    {row['backend']:<15} FAILED: {row['error']}")
            continue
        ceiling = "" if row["ceiling"] is None else f" (ceiling {row['ceiling']:.4f})"
        verdict = "" if row["ceiling"] is None else ("  ok" if row["passed"] else "  FAILED")
        print(f"    {row['backend']:<15} {row['rel_l2']:.4f}{ceiling}{verdict}")


def _print_speed(row: dict) -> None:
    tail = "pooled tail on" if row["pooled_tail"] else "no pooled tail (this backend has none)"
    print(f"  speed ({row['heads']} heads x {row['tokens']} tokens, {row['dtype']}, {row['density']:.1%} of the key "
          f"blocks, {tail}; a random map, not a Wan map):")
    print(f"    {row['backend']}: {row['chorus_ms']:.2f} ms a call (first call {row['first_call_s']:.1f} s); "
          f"torch dense: {row['torch_dense_ms']:.2f} ms; {row['speedup']:.2f}x")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _density(text: str) -> float:
    value = float(text)
    if not (0.0 < value <= 1.0):
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    from ..cache_store.cli import OneLineErrorParser  # errors as one line, as every command says them

    ap = OneLineErrorParser(prog="python -m chorus check", description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--run", action="store_true", help="also run the numerics check and the speed comparison")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16",
                    help="q / k / v dtype: fp16 (default) is what ComfyUI computes Wan in on a GPU; bf16 if you "
                         "start ComfyUI with --bf16-unet")
    ap.add_argument("--tokens", type=_positive_int, default=None,
                    help="speed: tokens per call (default 32760, Wan 14B at 480p; 2048 on the CPU)")
    ap.add_argument("--heads", type=_positive_int, default=None, help="speed: heads (default 40; 2 on the CPU)")
    ap.add_argument("--density", type=_density, default=0.15, help="speed: share of key blocks kept (0.15)")
    ap.add_argument("--reps", type=_positive_int, default=10, help="speed: timed calls (10)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    return ap


def main(argv=None) -> int:
    """The command (module docstring); returns its exit code."""
    ap = _parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:  # argparse's own exit: -h (0) or a bad argument (2)
        return int(exc.code or 0)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as exc:
        print(f"error: --device {args.device!r}: {exc}", file=sys.stderr)
        return 2
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        print(f"error: --device {device}: this torch sees {torch.cuda.device_count()} CUDA device(s)", file=sys.stderr)
        return 2
    if device.type not in ("cuda", "cpu"):
        print(f"error: --device {device}: Chorus runs on CUDA GPUs or the CPU", file=sys.stderr)
        return 2
    json_out = None
    if args.json is not None:  # opened before the check runs: a path that cannot be written is said at once
        try:
            json_out = open(args.json, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as exc:
            print(f"error: --json {args.json!r}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            info, status = _check(device, args)
        if json_out is not None:
            json.dump(info, json_out, indent=1)
    finally:
        if json_out is not None:
            json_out.close()
    return status


def _check(device: torch.device, args) -> tuple[dict, int]:
    """The report, and with ``args.run`` the numerics check and the speed row, printed; ``(results, exit code)``."""
    dtype = DTYPES[args.dtype]
    info = report(device, dtype)
    _print_report(info)
    status = 0
    if args.run:
        choice = Backend(info["auto"])
        judged = [choice] + ([Backend(info["accurate"])] if info["accurate"] else [])
        option = Backend(info["option"]) if info.get("option") else None
        info["numerics"] = check_numerics(device, judged + ([option] if option else []), dtype)
        _print_numerics(info["numerics"])
        failed = [row["backend"] for row in info["numerics"]
                  if not row["passed"] and row["backend"] in {b.value for b in judged}]
        if failed:
            status = 1
            print(f"  CHECK FAILED for {', '.join(failed)} on this device: choose another backend in "
                  "ChorusSparseSampler's backend input (triton_bf16) or leave the Chorus nodes out, and report "
                  "this output")
        tokens = args.tokens or (32760 if device.type == "cuda" else 2048)
        heads = args.heads or (40 if device.type == "cuda" else 2)
        try:
            info["speed"] = measure_speed(device, choice, heads, tokens, args.density, args.reps, dtype)
            _print_speed(info["speed"])
        except Exception as exc:  # noqa: BLE001 - an out-of-memory at this size, or a kernel failure: reported
            info["speed"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  speed: FAILED ({info['speed']['error']}); a smaller --tokens / --heads may fit")
            status = 1
        if option is not None:
            _check_option(device, info, option, heads, tokens, args)
    return info, status


def _check_option(device: torch.device, info: dict, option: Backend, heads: int, tokens: int, args) -> None:
    """The by-name option of the report (``info["option"]``): its speed beside auto's, where its numerics passed;
    a failure here is reported, never the check's (auto does not run it)."""
    row = next(row for row in info["numerics"] if row["backend"] == option.value)
    if not row["passed"]:
        print(f"  {option.value} did not pass its numerics check on this device: keep backend auto")
        return
    try:
        info["speed_option"] = measure_speed(device, option, heads, tokens, args.density, args.reps,
                                             DTYPES[args.dtype])
    except Exception as exc:  # noqa: BLE001 - reported, not judged
        info["speed_option"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"  {option.value}: speed FAILED ({info['speed_option']['error']}): keep backend auto")
        return
    speed = info["speed_option"]
    versus = ""
    if "chorus_ms" in info.get("speed", {}):
        speed["vs_auto"] = info["speed"]["chorus_ms"] / speed["chorus_ms"]
        versus = f", {speed['vs_auto']:.2f}x auto's {info['auto']}"
    print(f"    {option.value} ({row['numerics']} numerics, error above; by name in Chorus Sparse Sampler's backend "
          f"input): {speed['chorus_ms']:.2f} ms a call (first call {speed['first_call_s']:.1f} s); torch dense: "
          f"{speed['torch_dense_ms']:.2f} ms; {speed['speedup']:.2f}x{versus}")
