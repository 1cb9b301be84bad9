"""Which ptxas builds the warp-specialised kernel (``chorus.kernels.triton._attention_ws``) fastest: every assembler
:func:`chorus.kernels.triton._ptxas.candidates` finds, one copy of the kernel module each, every call built by it
(``launch_ws(..., assembler=asm)``) in the form it gets (``kernel_form``: the FP8 pooled tiles in a loop of their own
only where it assembles that right). Wan 14B's 720p shape (1 x 40 heads x 75 600 x 128 bf16) in
ComfyUI's ``[B, L, H, D]`` memory, structured maps (``masks.py``), raster order (Q by TMA) and the tile order an
entry runs in (Q from the pre-pass): FP8 with and without the pooled tail, INT8 with it.

A copy per assembler because Triton's in-memory kernel cache does not key on the assembler: each copy is the same
source loaded as a module of its own (:func:`kernel_copy`), so each builds and keeps its own binaries (on disk in
``chorus-ptxas-<version>``, as the launcher caches them). Whole ``launch_ws`` calls (pre-pass, block lists,
kernel) timed with CUDA events (``benchmarks/timing.py``: the median of 5 calls after 2), every configuration in
turn within a round and the order reversed every other round, the median over ``--rounds``; ``--ncu``: instead
each configuration launched once per round (two rounds) between ``cudaProfilerStart/Stop``, for Nsight Compute to
time the kernel alone::

    ncu --profile-from-start off --clock-control none --kernel-name regex:_bsa_ws --section SpeedOfLight \\
        python -m benchmarks.kernels.bench_ptxas --ncu

Usage (from the pack root, on an sm_90 GPU): ``python -m benchmarks.kernels.bench_ptxas --out /tmp/ptxas``
(about 1.5 minutes on an H200 with three assemblers); ``--densities``, ``--forms``, ``--versions 12.8,13.0``
narrow it. Writes ``bench_ptxas.json``. Measured: ``docs/BENCHMARK_LOG.md``, "One ptxas per kernel variant".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
from types import ModuleType

import torch
import triton

from ..timing import cuda_median_ms
from .bench_tail import call_inputs
from .gpu_state import GpuSampler
from .masks import structured_block_map
from chorus.kernels.triton import _attention_ws, _ptxas

LENGTH, HEADS = 75600, 40
# (variant, input form) -> (int8, pooled_tail); INT8's pre-pass always quantises Q, so it runs the tile order only
VARIANTS = {"fp8": (False, False), "fp8_tail": (False, True), "int8_tail": (True, True)}


def log(msg: str) -> None:
    print(msg, flush=True)


def kernel_copy(asm: _ptxas.Assembler) -> ModuleType:
    """``_attention_ws``'s source loaded as a module of its own (``..._attention_ws_by_<major>_<minor>``): its own
    Gluon kernel object, and so its own in-memory binaries, for the launches ``asm`` builds."""
    name = f"{_attention_ws.__package__}._attention_ws_by_{asm.version[0]}_{asm.version[1]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _attention_ws.__file__)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def assemblers(versions: list[tuple[int, int]] | None) -> list[_ptxas.Assembler]:
    """One assembler per version among the candidates (the first found of each), optionally only ``versions``."""
    chosen: dict[tuple[int, int], _ptxas.Assembler] = {}
    for asm in _ptxas.candidates():
        if versions is None or asm.version in versions:
            chosen.setdefault(asm.version, asm)
    return [chosen[v] for v in sorted(chosen)]


def configs(args) -> list[tuple[dict, callable]]:
    forms = {form: call_inputs(LENGTH, HEADS, form, "blhd")[:4] for form in args.forms}
    maps = {d: structured_block_map(LENGTH, HEADS, d, device="cuda") for d in args.densities}
    scale = 128 ** -0.5
    out = []
    for asm in assemblers(args.versions):
        module = kernel_copy(asm)
        for density in args.densities:
            for form, (q, k, v, perm) in forms.items():
                for variant, (int8, tail) in VARIANTS.items():
                    if int8 and form != "tile":
                        continue
                    entry = {"ptxas": asm.label, "version": ".".join(map(str, asm.version)), "density": density,
                             "form": form, "variant": variant, "pooled_loop": module.kernel_form(tail, int8, asm)[0]}

                    def call(q=q, k=k, v=v, perm=perm, bm=maps[density], module=module, asm=asm, int8=int8,
                             tail=tail):
                        return module.launch_ws(q, k, v, bm, scale, token_perm=perm, pooled_tail=tail, int8=int8,
                                                assembler=asm)

                    out.append((entry, call))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--densities", default="0.15,0.05")
    ap.add_argument("--forms", default="raster,tile", help="raster (Q by TMA) and/or tile (an entry's token order)")
    ap.add_argument("--versions", default="", help="ptxas versions to compare, e.g. 12.8,13.0 (default: all found)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ncu", action="store_true", help="launch each configuration once per round, profiler on")
    args = ap.parse_args(argv)
    args.densities = [float(x) for x in args.densities.split(",") if x]
    args.forms = [x for x in args.forms.split(",") if x]
    args.versions = [tuple(int(p) for p in v.split(".")) for v in args.versions.split(",") if v] or None
    if args.ncu:
        args.densities = args.densities[:1]
    runs = configs(args)
    log(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; assemblers: "
        + ", ".join(sorted({e['ptxas'] for e, _ in runs})))
    for _, fn in runs:  # build every copy's variants first
        fn()
        fn()
    torch.cuda.synchronize()
    if args.ncu:
        log("order: " + json.dumps([e for e, _ in runs] * 2))
        torch.cuda.profiler.start()
        for _ in range(2):
            for _, fn in runs:
                fn()
                torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return 0
    sampler = GpuSampler()
    for r in range(args.rounds):
        for entry, fn in (runs if r % 2 == 0 else runs[::-1]):
            with sampler.window() as window:
                entry.setdefault("rounds_ms", []).append(cuda_median_ms(fn, reps=5, warmup=2))
            entry.setdefault("gpu_states", []).append(window.summary())
    log("| density | form | variant | ptxas | pooled loop | ms (median) | rounds |")
    log("|---|---|---|---|---|---|---|")
    for entry, _ in sorted(runs, key=lambda r: (-r[0]["density"], r[0]["form"], r[0]["variant"], r[0]["version"])):
        entry["ms"] = statistics.median(entry["rounds_ms"])
        log(f"| {entry['density']:.2f} | {entry['form']} | {entry['variant']} | {entry['ptxas']} | "
            f"{'yes' if entry['pooled_loop'] else 'no'} | {entry['ms']:.3f} | "
            f"{min(entry['rounds_ms']):.3f}-{max(entry['rounds_ms']):.3f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_ptxas.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "python": platform.python_version(), "argv": sys.argv, "ws_assembler": _ptxas.describe(),
                   "runs": [e for e, _ in runs]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
