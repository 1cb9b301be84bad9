"""The Triton kernels a GPU other than Hopper runs, built for it without a GPU (CPU, Triton's bundled ptxas).

Most ComfyUI users run Wan on an RTX 30xx / 40xx / 50xx card or an A100, where ``auto`` takes the portable
16-bit kernel (``triton_bf16``), the accurate path takes ``triton_int8`` (sm_80+) and ``triton_fp8`` can be
chosen by name (sm_89+); a miss records with the block-mass kernel, a hit builds its map with the map-floor
kernel, feature reuse pools with its own kernels. None of these GPUs is on the device machine, so this file
builds each of those kernels as the launchers configure it for sm_86 (RTX 30xx), sm_89 (RTX 40xx, L40) and sm_120
(RTX 50xx), and checks that its shared memory fits the GPU's per-block limit (Triton refuses to launch a kernel
that asks for more). Below sm_90 Triton turns the TMA descriptors into pointer loads; sm_120 keeps them. An A100
(sm_80) takes Triton's code path of sm_86 with more shared memory (163 KB; built by hand on 2026-12-05, not
here, to keep the suite short). Building is what this shows: speed and numerics on these GPUs are not measured
(docs/INSTALL.md).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

from aot_check import compile_attn, compile_jit  # noqa: E402
from chorus.kernels.triton import _attention as A  # noqa: E402

# (compute capability, opt-in shared memory per block in bytes: CUDA's programming guide, per architecture)
GPUS = [pytest.param(86, 101376, id="sm86-RTX30"), pytest.param(89, 101376, id="sm89-RTX40"),
        pytest.param(120, 101376, id="sm120-RTX50")]
FP32 = "*fp32"


def _target(cc: int) -> GPUTarget:
    """Triton's target for ``cc``; an RTX 50xx (sm_120) only with a Triton that builds for it (>= 3.3: torch >=
    2.7, the first release for those GPUs; Triton 3.2's compiler aborts on that target)."""
    if cc >= 120 and tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 3):
        pytest.skip(f"Triton {triton.__version__} does not build for sm_{cc} (RTX 50xx needs Triton >= 3.3)")
    return GPUTarget("cuda", cc, 32)


def _fits(kernel, limit: int, what: str):
    shared = kernel.metadata.shared
    assert shared <= limit, f"{what}: {shared} bytes of shared memory, the GPU allows {limit} per block"


def _portable(path: str, cc: int, use_tma: bool, has_tail: bool, switches=None):
    """The portable attention kernel as the launcher tiles it for ``path`` (``DEFAULT_TILES``), a partial last
    key block included. ``use_tma`` where this Triton has host-side descriptors (>= 3.4; the launcher takes
    pointers on an older one, :func:`~chorus.kernels.triton._attention.tma_available`)."""
    if use_tma and not A.tma_available():
        pytest.skip(f"Triton {triton.__version__} has no host-side TMA descriptors: the launcher takes pointers")
    tiles = A.DEFAULT_TILES[path]
    return compile_attn(fp8=path == "fp8", int8=path == "int8", use_tma=use_tma, block_m=tiles.block_m,
                        block_n=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages, tail=True,
                        has_tail=has_tail, target=_target(cc), switches=switches)


@pytest.mark.parametrize("cc,limit", GPUS)
@pytest.mark.parametrize("use_tma,switches", [(True, None), (False, None), (True, {"HAS_BIAS": True, "HAS_PERM": True})])
def test_the_16bit_kernel_auto_takes_there_builds_within_its_shared_memory(cc, limit, use_tma, switches):
    """``triton_bf16`` with the pooled tail (on by default): TMA descriptors (where a call's strides allow
    them) and the pointer fallback; with key biases (guidance's first frame, feature reuse's compact keys) and
    a token order."""
    _fits(_portable("bf16", cc, use_tma, True, switches), limit, f"triton_bf16 on sm_{cc}")


@pytest.mark.parametrize("cc,limit", GPUS)
def test_the_16bit_tail_s_own_kernels_and_the_block_lists_build(cc, limit):
    """The 16-bit path's pooled keys and values (sums, then means) and the block lists with the tail."""
    from chorus.kernels.triton import _quant as Q

    target = _target(cc)
    sums = compile_jit(Q._kv_block_sums_kernel, dict(K="*bf16", V="*bf16", pool_sums=FP32),
                       dict(HEAD_DIM=128, TILE=Q.QUANT_TILE, POOL_CHUNK=128), num_warps=8, target=target)
    means = compile_jit(Q._pooled_finalize_kernel, dict(pool_sums=FP32, k_out="*bf16", v_out="*bf16", k_scale=FP32,
                                                        v_stats=FP32),
                        dict(HEAD_DIM=128, TILE=Q.QUANT_TILE, BS=128, POOL_CHUNK=128, FP8=False, INTERPRET=False,
                             V_WGMMA_ORDER=False), num_warps=8, target=target)
    lists = compile_jit(A._compress_map_kernel, dict(block_map="*u8", kv_num="*i32", kv_idx="*i32", tail_num="*i32",
                                                     tail_bias=FP32, prefix_bias="fp32", suffix_bias="fp32"),
                        dict(CHUNK=1024, TAIL=True, TAIL_TILE=A.TAIL_TILE), target=target)
    for kernel, what in ((sums, "pooled sums"), (means, "pooled means"), (lists, "block lists")):
        _fits(kernel, limit, f"{what} on sm_{cc}")


@pytest.mark.parametrize("cc,limit", GPUS)
def test_the_accurate_int8_path_and_its_prepass_build(cc, limit):
    """``triton_int8`` (what ``top_p >= 0.95`` runs off Hopper): the attention kernel with the tail, the INT8
    pre-pass (V^T in natural key order, as the portable kernel reads it) and the pooled values' finalisation."""
    from chorus.kernels.triton import _quant_int8 as Q8

    target = _target(cc)
    _fits(_portable("int8", cc, A.tma_available(), True), limit, f"triton_int8 on sm_{cc}")
    prepass = compile_jit(Q8._quant_int8_kernel, dict(Q="*bf16", K="*bf16", V="*bf16", q8="*i8", k8="*i8", v8t="*i8",
                                                      q_scale=FP32, k_scale=FP32, v_sums="*i32", k_smooth_rot=FP32,
                                                      v_absmax=FP32, hmat="*bf16", token_perm="*i32", pool_sums=FP32,
                                                      q_mult="fp32"),
                          dict(HEAD_DIM=128, TILE=128, INTERPRET=False, HAS_PERM=False, POOL_CHUNK=128,
                               V_WGMMA_ORDER=False), num_warps=4, target=target)
    means = compile_jit(Q8._pooled_finalize_int8_kernel, dict(pool_sums=FP32, k8="*i8", v8t="*i8", k_scale=FP32,
                                                              v_sums="*i32", v_pool_absmax=FP32),
                        dict(HEAD_DIM=128, TILE=128, BS=128, POOL_CHUNK=128, V_WGMMA_ORDER=False), num_warps=8,
                        target=target)
    _fits(prepass, limit, f"the INT8 pre-pass on sm_{cc}")
    _fits(means, limit, f"the INT8 pooled values on sm_{cc}")


@pytest.mark.parametrize("cc,limit", [p for p in GPUS if p.values[0] >= 89])
def test_the_portable_fp8_kernel_builds_where_fp8_tensor_cores_exist(cc, limit):
    """``triton_fp8`` (by name on sm_89+; ``auto`` takes it on Hopper only, where it was measured) with the
    pooled tail, through descriptors and through pointers, and its pre-pass (V's channel maxima, the e4m3
    copies with the pooled sums, the pooled means; V^T in natural key order, as the portable kernel reads it)."""
    from chorus.kernels.triton import _quant as Q

    target = _target(cc)
    for use_tma in (True, False) if A.tma_available() else (False,):
        _fits(_portable("fp8", cc, use_tma, True), limit, f"triton_fp8 on sm_{cc}")
    stats = compile_jit(Q._v_stats_kernel, dict(V="*bf16", v_part=FP32),
                        dict(HEAD_DIM=128, TILE=Q.QUANT_TILE, CHUNK=Q.STATS_CHUNK), num_warps=8, target=target)
    prepass = compile_jit(Q._quant_kernel, dict(Q="*bf16", K="*bf16", V="*bf16", q8="*fp8e4nv", k8="*fp8e4nv",
                                                v8t="*fp8e4nv", q_scale=FP32, k_scale=FP32, k_smooth=FP32,
                                                v_stats=FP32, token_perm="*i32", pool_sums=FP32, q_mult="fp32"),
                          dict(HEAD_DIM=128, TILE=Q.QUANT_TILE, INTERPRET=False, QUANT_Q=True, HAS_PERM=False,
                               V_WGMMA_ORDER=False, POOL_CHUNK=128), num_warps=4, target=target)
    means = compile_jit(Q._pooled_finalize_kernel, dict(pool_sums=FP32, k_out="*fp8e4nv", v_out="*fp8e4nv",
                                                        k_scale=FP32, v_stats=FP32),
                        dict(HEAD_DIM=128, TILE=Q.QUANT_TILE, BS=128, POOL_CHUNK=128, FP8=True, INTERPRET=False,
                             V_WGMMA_ORDER=False), num_warps=8, target=target)
    for kernel, what in ((stats, "V's channel maxima"), (prepass, "the FP8 pre-pass"), (means, "the pooled means")):
        _fits(kernel, limit, f"{what} on sm_{cc}")


@pytest.mark.parametrize("cc,limit", GPUS)
def test_a_miss_s_and_a_hit_s_map_kernels_and_feature_reuse_s_pooling_build(cc, limit):
    """The block-mass kernel (a miss's recording, its default launch: 8 sampled rows per block, 128 rows per
    program), the block selection and the hit's map floor at 720p's width, feature reuse's pool / unpool."""
    from chorus.kernels.triton import _block_mass as M
    from chorus.kernels.triton import _floor_map as F
    from chorus.kernels.triton import _pooling as P
    from chorus.kernels.triton import _select as S

    target = _target(cc)
    sampled = 8
    mass = compile_jit(M._block_mass_kernel, dict(Q="*bf16", K="*bf16", Out=FP32, Scratch=FP32, row_off="*i32",
                                                  token_perm="*i32", qk_scale="fp32"),
                       dict(HEAD_DIM=128, BS=128, S=sampled, G=M.MASS_ROWS // sampled, BLOCK_N=128, TAIL_K=True,
                            INTERPRET=False, HAS_PERM=False), num_warps=8, num_stages=3, target=target)
    select = compile_jit(S._select_kernel, dict(mass_ptr=FP32, out_ptr="*u8", top_p_bits="i64", tol_bits="i64"),
                         dict(KEEP_DIAG=True, PACKED=True, BLOCK=1024), num_warps=S.SELECT_WARPS, target=target)
    floor = compile_jit(F._floor_map_kernel, dict(packed_ptr="*u8", near_ptr="*u8", map_ptr="*u8",
                                                  out_packed_ptr="*u8", count_ptr="*i32"),
                        dict(HAS_FLOOR=True, BITS=1024, ROWS=F.rows_per_program_for(1024)), target=target)
    pool = compile_jit(P._pool_kernel, dict(X="*bf16", OUT="*bf16", keep_index="*i64", cell_index="*i64"),
                       dict(P=4, BLOCK=P.BLOCK_C), target=target)
    unpool = compile_jit(P._unpool_kernel, dict(X="*bf16", XC="*bf16", YC="*bf16", OUT="*bf16", expand_index="*i64"),
                         dict(BLOCK=P.BLOCK_C), target=target)
    for kernel, what in ((mass, "block mass"), (select, "block selection"), (floor, "map floor"), (pool, "pool"),
                         (unpool, "unpool")):
        _fits(kernel, limit, f"{what} on sm_{cc}")


def _jit_functions(tree):
    """The ``@triton.jit`` functions of a module's AST (Gluon's are built by Triton >= 3.6 alone)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
            yield node


def test_the_triton_kernels_use_nothing_an_older_triton_refuses():
    """Users run the Triton their torch pins (torch 2.7: Triton 3.3; 2.6: 3.2). Those compilers refuse a boolean
    chain of three or more operands (``a and b and c``) inside a kernel, where Triton >= 3.4 (this machine's)
    accepts it: one such line made every portable kernel fail to build there, so such a GPU ran dense. The
    builds above under Triton 3.1-3.7 were checked by hand (docs/INSTALL.md); this keeps the sources free of
    that construct whatever Triton CI has."""
    found, kernels = [], 0
    for path in sorted(pathlib.Path(A.__file__).parent.glob("*.py")):
        for fn in _jit_functions(ast.parse(path.read_text())):
            kernels += 1
            for node in ast.walk(fn):
                if isinstance(node, ast.BoolOp) and len(node.values) > 2:
                    found.append(f"{path.name}:{node.lineno} in {fn.name}: {ast.unparse(node)}")
    assert kernels >= 20, kernels  # the walk sees the kernels (32 @triton.jit functions today)
    assert not found, "boolean chains Triton < 3.4 refuses (split them with parentheses):\n" + "\n".join(found)
