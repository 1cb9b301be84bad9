"""ComfyUI's FP8-weights linears at Wan's shapes: does ``comfy.ops.fp8_ops`` take its FP8 path, and
how fast is it, eager and under ``torch.compile``, beside bf16 (issue 31, item 4).

``python -m benchmarks.comfy_e2e.fp8_linears --comfyui DIR --out OUT [--tokens 75600] [--no-compile] [--tiny]``

Per linear shape of a Wan 14B block (``tokens x 5120 -> 5120`` for q/k/v/o and cross-attention,
``5120 -> 13824`` and ``13824 -> 5120`` for the FFN), three layers on one input:

- ``bf16``: the operations ComfyUI picks for bf16 weights (``comfy.ops.pick_operations``), bf16 weights.
- ``comfy_fp8``: the operations ComfyUI picks for ``fp8_e4m3fn_fast`` weights with ``--fast
  fp8_matrix_mult`` on an FP8-capable GPU (``fp8_ops``; ``ops.picked_for_fp8_weights`` records what it
  picked on this device: the activation clamped to +-448 and cast to e4m3 with a unit scale,
  then ``torch._scaled_mm``); ``fp8_path`` says whether ``comfy.ops.fp8_linear`` ran its FP8 matmul
  (``False``: it fell back to casting the weight, e.g. after an exception ComfyUI logs at INFO level,
  counted in ``fp8_exceptions``).
- ``rowwise_fp8``: the same e4m3 weights with the activation quantised per row (absmax / 448) and
  ``torch._scaled_mm`` with row- and column-wise scales: what a fused activation quantisation can give
  (GPU only; the CPU's ``_scaled_mm`` takes tensor-wise scales only).

Each is timed eager and compiled (``torch.compile``, inductor, default mode): median of ``--reps``
calls between CUDA events (the CPU: wall clock). ``rel_err`` = relative L2 error against the fp32
product of the same activation and the layer's own (dequantised) weight, so it measures the activation's
quantisation. ``graph_breaks``: dynamo's graph-break count while compiling the layer. ``--tiny``: toy
sizes on the CPU (the test).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from .experts import FastFp8, import_comfy

WAN_14B_SHAPES = [(5120, 5120), (5120, 13824), (13824, 5120)]  # (in_features, out_features)
TINY_SHAPES = [(256, 512), (512, 256)]
E4M3_MAX = 448.0


class ExceptionCounter(logging.Handler):
    """Counts the ``Exception during fp8 op`` records ComfyUI's ``fp8_ops.Linear`` logs on a fallback."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.count = 0
        self.last = None

    def emit(self, record):
        message = record.getMessage()
        if "Exception during fp8 op" in message:
            self.count += 1
            self.last = message


def median_ms(fn, reps: int, device: torch.device) -> float:
    if device.type == "cuda":
        from ..timing import cuda_median_ms

        return cuda_median_ms(fn, reps, warmup=2)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def make_layer(ops, in_features: int, out_features: int, dtype, device, weight: torch.Tensor):
    layer = ops.Linear(in_features, out_features, bias=True, dtype=dtype, device=device)
    with torch.no_grad():
        layer.weight.copy_(weight.to(dtype))
        layer.bias.zero_()
    return layer.eval()


class RowwiseFp8(torch.nn.Module):
    """e4m3 weights (one scale per output channel) times the activation quantised per row."""

    def __init__(self, weight_e4m3: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight_t = weight_e4m3.t()  # column-major [in, out], as _scaled_mm wants its second operand
        self.scale_b = torch.ones(1, weight_e4m3.shape[0], device=weight_e4m3.device, dtype=torch.float32)
        self.bias = bias

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        scale_a = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
        xq = (rows.float() / scale_a).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(xq, self.weight_t, scale_a=scale_a, scale_b=self.scale_b, bias=self.bias,
                               out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], -1)


def measure(layer, x, reference, reps, device, compile_it, fp8_counter=None) -> dict:
    from torch._dynamo.utils import counters

    row = {}
    with torch.no_grad():
        if fp8_counter is not None:
            import comfy.ops

            fp8_counter.count = 0
            row["fp8_path"] = comfy.ops.fp8_linear(layer, x.clone()) is not None
        out = layer(x.clone())
        row["rel_err"] = float((out.float() - reference).norm() / reference.norm())
        row["eager_ms"] = median_ms(lambda: layer(x), reps, device)
        if fp8_counter is not None:
            row["fp8_exceptions"], row["fp8_exception_last"] = fp8_counter.count, fp8_counter.last
        if compile_it:
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(layer)
            t0 = time.perf_counter()
            compiled(x)
            row["compile_s"] = time.perf_counter() - t0
            row["graph_breaks"] = sum(counters["graph_break"].values())
            row["compiled_ms"] = median_ms(lambda: compiled(x), reps, device)
    return row


def run(args) -> dict:
    cpu = args.tiny or not torch.cuda.is_available()
    import_comfy(Path(args.comfyui or os.environ.get("COMFYUI_DIR", "")), cpu)
    import comfy.model_management
    import comfy.ops

    device = torch.device("cpu" if cpu else "cuda")
    tokens = 300 if args.tiny else args.tokens
    shapes = TINY_SHAPES if args.tiny else WAN_14B_SHAPES
    compute = torch.bfloat16
    counter = ExceptionCounter()
    logging.getLogger().addHandler(counter)
    if logging.getLogger().level > logging.INFO:
        logging.getLogger().setLevel(logging.INFO)
    with FastFp8():
        picked = comfy.ops.pick_operations(torch.float8_e4m3fn, compute, load_device=device, fp8_optimizations=True)
    fp8_ops = comfy.ops.fp8_ops  # what ComfyUI picks where the device computes in FP8 (``picked``: what it did here)
    bf16_ops = comfy.ops.pick_operations(compute, compute, load_device=device)
    results = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if not cpu else "cpu",
               "torch": torch.__version__, "tokens": tokens,
               "ops": {"bf16": f"{bf16_ops.__module__}.{bf16_ops.__qualname__}",
                       "comfy_fp8": f"{fp8_ops.__module__}.{fp8_ops.__qualname__}",
                       "picked_for_fp8_weights": f"{picked.__module__}.{picked.__qualname__}"},
               "supports_fp8_compute": bool(comfy.model_management.supports_fp8_compute(device)), "rows": []}
    gen = torch.Generator(device=device).manual_seed(0)
    for in_f, out_f in shapes:
        flops = 2 * tokens * in_f * out_f
        weight = (torch.randn(out_f, in_f, device=device, generator=gen) * 0.02)
        x = torch.randn(1, tokens, in_f, device=device, generator=gen).to(compute)
        layers = {"bf16": make_layer(bf16_ops, in_f, out_f, compute, device, weight),
                  "comfy_fp8": make_layer(fp8_ops, in_f, out_f, torch.float8_e4m3fn, device, weight)}
        if not cpu:
            w8 = layers["comfy_fp8"].weight.detach()
            layers["rowwise_fp8"] = RowwiseFp8(w8, torch.zeros(out_f, device=device, dtype=compute))
        for name, layer in layers.items():
            w = layer.weight if name != "rowwise_fp8" else layer.weight_t.t()
            reference = x.float().reshape(-1, in_f) @ w.detach().float().t()
            row = {"in": in_f, "out": out_f, "layer": name,
                   **measure(layer, x, reference.reshape(1, tokens, out_f), args.reps, device,
                             not args.no_compile, counter if name == "comfy_fp8" else None)}
            for key in ("eager", "compiled"):
                if f"{key}_ms" in row:
                    row[f"{key}_tflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    logging.getLogger().removeHandler(counter)
    return results


def table(results: dict) -> str:
    lines = ["| in -> out | layer | FP8 path | eager ms | eager TFLOP/s | compiled ms | compiled TFLOP/s | rel err |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        def cell(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "-"

        lines.append(f"| {r['in']} -> {r['out']} | {r['layer']} | {r.get('fp8_path', '-')} | {cell('eager_ms', '.3f')} | "
                     f"{cell('eager_tflops', '.0f')} | {cell('compiled_ms', '.3f')} | {cell('compiled_tflops', '.0f')} | "
                     f"{cell('rel_err', '.4f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comfyui", help="ComfyUI checkout (default: $COMFYUI_DIR)")
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=75600, help="rows of the activation (720p: 75 600)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (tests)")
    args = p.parse_args(argv)
    results = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_linears.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
