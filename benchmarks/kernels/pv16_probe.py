"""Probe (issue 30 item 2): the warp-specialised kernel's INT8 ``Q @ K^T`` with ``P @ V`` in V's 16-bit type
(``pv16=True``), beside ``triton_int8_ws`` and ``triton_fp8_ws`` in one process on an sm_90 GPU: full-map
error floors against the fp64 oracle (Gaussian q/k/v and q x 3, 4 heads at 32 760 tokens), sparse calls of
awkward lengths (ComfyUI's [B, L, H, D] memory, D 64 / 128), and 720p speed (1 x 40 x 75 600 x 128, full map
and structured 15% / 5% maps, two rounds, ``do_bench`` medians, kept-block TFLOP/s).

Usage (repository root, ``chorus`` importable): ``OUT=/tmp python benchmarks/kernels/pv16_probe.py``.
"""
import json, math, os, sys, time
import torch
from triton.testing import do_bench
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks", "kernels"))
from masks import kept_flops, structured_block_map
from chorus.kernels.triton._attention_ws import block_sparse_attention_ws
from chorus.kernels.reference import dense_attention_oracle
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from testing import query_block_rows

OUT = os.environ.get("OUT", "/tmp")
res = {"device": torch.cuda.get_device_name(), "rows": []}
def log(m):
    print(m, flush=True)

def run(name, q, k, v, bm, scale, **kw):
    if name == "fp8_ws":
        return block_sparse_attention_ws(q, k, v, bm, scale, **kw)
    if name == "int8_ws":
        return block_sparse_attention_ws(q, k, v, bm, scale, int8=True, **kw)
    return block_sparse_attention_ws(q, k, v, bm, scale, int8=True, pv16=True, **kw)

NAMES = ["pv16", "int8_ws", "fp8_ws"]
scale = 1 / math.sqrt(128)
def rel(x, o):
    return ((x.double() - o).norm() / o.norm()).item()

# 1. floors, full map, Gaussian and sharp (q x 3), 4 heads at 32 760
for label, qmul in (("gaussian", 1.0), ("sharp", 3.0)):
    g = torch.Generator(device="cuda").manual_seed(1)
    L = 32760
    q, k, v = (torch.randn(1, 4, L, 128, device="cuda", generator=g) for _ in range(3))
    q = (q * qmul).bfloat16(); k = k.bfloat16(); v = v.bfloat16()
    nb = -(-L // 128)
    bm = torch.ones(1, 1, nb, nb, dtype=torch.bool, device="cuda")
    blocks, rows = query_block_rows(L, nb)
    oracle = dense_attention_oracle(q[:, :, rows], k, v, None, 128)
    for n in NAMES:
        out = run(n, q, k, v, bm, scale)
        e = rel(out[:, :, rows], oracle)
        res["rows"].append(dict(kind="floor", source=label, name=n, err=e)); log(f"floor {label} {n}: {e:.4f}")

# 2. sparse, awkward lengths, D 64/128, ComfyUI layout
for L, D, dens in ((4097, 128, 0.15), (4097, 64, 0.3), (1000, 128, 1.0), (300, 64, 0.5)):
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(1, L, 3, D, device="cuda", generator=g).bfloat16().transpose(1, 2) for _ in range(3))
    k = k + 0.5
    nb = -(-L // 128)
    bm = torch.rand(1, 3, nb, nb, device="cuda", generator=g) < dens
    bm[..., torch.arange(nb), torch.arange(nb)] = True
    o = dense_attention_oracle(q, k, v, bm, 128, 1 / math.sqrt(D))
    for n in NAMES:
        e = rel(run(n, q, k, v, bm, 1 / math.sqrt(D)), o)
        res["rows"].append(dict(kind="sparse", L=L, D=D, density=dens, name=n, err=e)); log(f"sparse L={L} D={D} d={dens} {n}: {e:.4f}")

# 3. speed at 720p, 40 heads
L = 75600
g = torch.Generator(device="cuda").manual_seed(3)
q, k, v = (torch.randn(1, 40, L, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
maps = {"full": torch.ones(1, 1, -(-L // 128), -(-L // 128), dtype=torch.bool, device="cuda")}
for d in (0.15, 0.05):
    maps[f"{int(d*100)}%"] = structured_block_map(L, 40, d).cuda()
for rnd in range(2):
    for mname, bm in maps.items():
        fl = kept_flops(bm, L, L, 128, heads=40)
        for n in NAMES:
            ms = do_bench(lambda: run(n, q, k, v, bm, scale), warmup=50, rep=300)
            tf = fl / ms / 1e9
            res["rows"].append(dict(kind="speed", map=mname, name=n, ms=ms, tflops=tf, round=rnd))
            log(f"speed r{rnd} {mname} {n}: {ms:.2f} ms {tf:.0f} TFLOP/s")
json.dump(res, open(os.path.join(OUT, "probe_pv16.json"), "w"), indent=1)
