"""Compile the Triton kernels for sm_90 without a GPU and read what came out (the tests' sm_90 builds; the
portable kernels also for another GPU, ``target=``).

Helpers for the tests: :func:`compile_attn` (the portable Triton kernel), :func:`compile_jit` (any Triton
kernel of ours), :func:`compile_ws` (the warp-specialised Gluon kernel), :func:`sass_of`,
:func:`key_block_loop` (the key-block loop's instructions), :func:`key_block_loop_ops` (their opcode counts),
:func:`summarize`. Needs only Triton (its bundled ptxas and cuobjdump). Also a report: ``python
tests/aot_check.py [--sass]`` (from the pack root, with the pack importable as ``chorus``) prints one line per
variant: the Triton kernel's tile configurations, then the warp-specialised kernel with and without a token
order (its registers are the launch's 168, the consumer warpgroups raise theirs to 240 with ``setmaxnreg``).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from chorus.kernels.triton import _attention as A

TARGET = GPUTarget("cuda", 90, 32)


def attn_signature(fp8: bool, dtype: str, use_tma: bool, block_m: int, block_n: int, head_dim: int,
                   int8: bool = False):
    ed = "i8" if int8 else "fp8e4nv" if fp8 else dtype
    quantized = fp8 or int8
    if use_tma:
        q = f"tensordesc<{ed}[1,1,{block_m},{head_dim}]>"
        k = f"tensordesc<{ed}[1,1,{block_n},{head_dim}]>"
        v = f"tensordesc<{ed}[1,1,{head_dim},{block_n}]>" if quantized else f"tensordesc<{ed}[1,1,{block_n},{head_dim}]>"
    else:
        q = k = v = f"*{ed}"
    pointers = {"Q": q, "K": k, "V": v, "O": f"*{dtype}", "q_scale": "*fp32", "k_scale": "*fp32", "v_scale": "*fp32",
                "kv_num": "*i32", "kv_idx": "*i32", "sched": "*i32", "token_perm": "*i32", "tail_num": "*i32",
                "tail_bias": "*fp32", "v_sums": "*i32", "pool_ratio": "*fp32",
                # the pooled tail's keys / values: 8-bit the pre-pass's copies (K's, V's type), 16-bit own buffers
                "Kp": k if quantized else f"*{ed}", "Vp": v if quantized else f"*{ed}"}
    floats = {"qk_scale", "prefix_bias", "suffix_bias"}
    sig = {}
    for name, param in zip(A._bsa_fwd_kernel.arg_names, A._bsa_fwd_kernel.params):
        if param.is_constexpr:
            continue  # added by compile_attn
        sig[name] = pointers.get(name, "fp32" if name in floats else "i32")
    return sig


def compile_attn(fp8=True, use_tma=False, block_m=128, block_n=128, head_dim=128, num_warps=8, num_stages=3,
                 tail=False, dtype="bf16", has_tail=False, int8=False, target=TARGET, switches=None):
    """The portable Triton kernel compiled for sm_90, or ``target`` (``tail``: a partial last key block;
    ``has_tail``: the pooled tail; ``int8``: the accurate INT8 path, with ``fp8=False``; ``switches``: other
    compile-time switches of the kernel to set, e.g. ``{"HAS_BIAS": True}``, the rest off)."""
    sig = attn_signature(fp8, dtype, use_tma, block_m, block_n, head_dim, int8)
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BS=128, FP8=fp8, USE_TMA=use_tma,
                  TAIL_K=tail, EVEN_Q=not tail, P_SHIFT=A.P_SHIFT_LOG2, SCALE_TILE=128, INTERPRET=False,
                  HAS_BIAS=False, HAS_TAIL=has_tail, POOL_TMA=has_tail and (fp8 or int8) and use_tma,
                  POOL_TILE=A.TAIL_TILE, INT8=int8)
    consts.update(switches or {})
    consts.update({n: False for n, p in zip(A._bsa_fwd_kernel.arg_names, A._bsa_fwd_kernel.params)
                   if p.is_constexpr and n not in consts})  # later compile-time switches, off
    for c in consts:
        sig[c] = "constexpr"
    # in the kernel's parameter order: Triton before 3.4 reads the signature's types by position
    sig = {name: sig[name] for name in A._bsa_fwd_kernel.arg_names}
    # 16-byte divisibility hints like the launcher's specialisation gives for pointers/strides
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if sig[n].startswith("*") or (n.startswith("s_") and n not in ("s_nb", "s_nh", "s_ib", "s_ih"))}
    src = _source(A._bsa_fwd_kernel, sig, consts, attrs)
    return triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))


def _source(fn, signature: dict, constexprs: dict, attrs: dict | None = None) -> ASTSource:
    """``ASTSource`` across Triton releases: before 3.3 it takes ``constants=`` and its divisibility hints as an
    ``AttrsDescriptor`` (left out there: the build is then the launcher's without the 16-byte hints)."""
    if "constexprs" in inspect.signature(ASTSource).parameters:
        return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return ASTSource(fn=fn, signature=signature, constants=constexprs)


def compile_jit(fn, types: dict, constexprs: dict, num_warps: int = 4, num_stages: int | None = None, target=TARGET):
    """Any Triton kernel of ours compiled for sm_90, or ``target``: ``types`` maps parameters to Triton type
    strings (``"*bf16"``, ``"fp32"`` ...; the others are ``i32``), ``constexprs`` gives the compile-time ones."""
    sig = {name: ("constexpr" if param.is_constexpr else types.get(name, "i32"))
           for name, param in zip(fn.arg_names, fn.params)}
    options = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(_source(fn, sig, constexprs), target=target, options=options)


def compile_ws(head_dim=128, tail=True, has_bias=False, has_perm=False, has_suffix=False, q_kernel=None,
               has_tail=False, stages=3, int8=False, assembler="auto"):
    """The warp-specialised Gluon kernel compiled for sm_90 as the launcher builds it for such a call
    (:func:`chorus.kernels.triton._attention_ws.compile_sm90`; ``tail``: a partial last key block; ``int8``: the
    accurate path's numerics; ``assembler``: as ``compile_sm90`` takes it: a ptxas, None, or ``"auto"``, the
    variant's pinned one as the launcher)."""
    from chorus.kernels.triton import _attention_ws as W

    return W.compile_sm90(head_dim, W.WsConfig(stages=stages), tail_k=tail, has_bias=has_bias, has_suffix=has_suffix,
                          has_perm=has_perm, q_kernel=q_kernel, has_tail=has_tail, int8=int8, assembler=assembler)


def cuobjdump(kernel, flag: str) -> str:
    """Triton's bundled ``cuobjdump FLAG`` on the kernel's cubin (``--dump-sass``, ``--dump-resource-usage``)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return subprocess.run([tool, flag, path], capture_output=True, text=True).stdout


def sass_of(kernel) -> str:
    """The kernel's SASS."""
    return cuobjdump(kernel, "--dump-sass")


def wgmma_loops(sass: str) -> list:
    """Every innermost loop that issues a wgmma (``QGMMA``/``HGMMA``/``IGMMA``), in code order, each as
    ``(address, instruction)`` pairs: a consumer's key-block loops (the first consumer's come first)."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;", sass)]
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    loops = []
    for end, (_, text) in enumerate(ins):
        target = re.search(r"BRA 0x([0-9a-f]+)", text)
        start = index.get(int(target.group(1), 16), end) if target else end
        if start < end and any(re.search(r"[QHI]GMMA", t) for _, t in ins[start:end]):
            loops.append((start, end))
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [ins[a:b + 1] for a, b in innermost]


def key_block_loop(sass: str) -> list:
    """The innermost loop that issues a wgmma as ``(address, instruction)`` pairs: the first consumer's (first)
    key-block loop (empty if there is none)."""
    loops = wgmma_loops(sass)
    return loops[0] if loops else []


def key_block_loop_ops(sass: str, kept_blocks_only: bool = False, loop: list | None = None) -> dict:
    """Opcode counts (``FFMA``, ``FMNMX``, ``FSEL`` ...) of the innermost loop that issues a wgmma
    (``QGMMA``/``HGMMA``/``IGMMA``): the first consumer's key-block loop, what runs once per kept key block and
    thread; ``{"total": n}`` holds its instruction count. ``kept_blocks_only``: leave out the instructions
    a forward branch inside the loop skips when they load from global memory (``LDG``: the pooled tail's
    weights, loaded on its pooled tiles only), i.e. count what a kept key block runs. ``loop``: another loop of
    :func:`wgmma_loops` instead."""
    loop = key_block_loop(sass) if loop is None else loop
    if not loop:
        return {"total": 0}
    skipped: set = set()
    for addr, t in loop if kept_blocks_only else ():
        jump = re.search(r"@!?P\d BRA 0x([0-9a-f]+)", t)
        if jump and addr < int(jump.group(1), 16) <= loop[-1][0]:
            body = [(a, x) for a, x in loop if addr < a < int(jump.group(1), 16)]
            if any("LDG" in x for _, x in body):
                skipped.update(a for a, _ in body)
    ops: dict = {"total": len(loop) - len(skipped)}
    for addr, t in loop:
        if addr not in skipped:
            op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
            ops[op] = ops.get(op, 0) + 1
    return ops


def summarize(kernel, sass: bool):
    ptx = kernel.asm["ptx"]
    mma = sorted(set(re.findall(r"wgmma\.mma_async\.[a-z0-9.]+", ptx)))
    line = f"smem={kernel.metadata.shared} wgmma={mma[:3]}"
    m = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(kernel, "--dump-resource-usage"))
    line += f" regs={m.group(1)} stack={m.group(2)}" if m else ""
    if sass:
        out = sass_of(kernel)
        ops = {k: len(re.findall(k, out)) for k in ["QGMMA", "HGMMA", "UTMALDG", "LDG.E.128", "LDGSTS", "MUFU.EX2",
                                                      "SHFL.IDX"]}
        line += f" sass={ops} key_block_loop={key_block_loop_ops(out)}"
    return line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", action="store_true")
    args = ap.parse_args()
    for fp8 in (True, False):
        for use_tma in (False, True):
            for block_n in (64, 128):
                for stages in (2, 3):
                    try:
                        k = compile_attn(fp8=fp8, use_tma=use_tma, block_n=block_n, num_stages=stages)
                        msg = summarize(k, args.sass)
                    except Exception as exc:  # noqa: BLE001
                        msg = f"FAILED {type(exc).__name__}: {str(exc)[:300]}"
                    print(f"fp8={fp8} tma={use_tma} BLOCK_N={block_n} stages={stages}: {msg}", flush=True)
    for head_dim in (128, 64):
        for has_perm in (False, True):
            try:
                msg = summarize(compile_ws(head_dim, has_perm=has_perm), args.sass)
            except Exception as exc:  # noqa: BLE001
                msg = f"FAILED {type(exc).__name__}: {str(exc)[:300]}"
            print(f"warp-specialised D={head_dim} token order={has_perm}: {msg}", flush=True)


if __name__ == "__main__":
    main()
