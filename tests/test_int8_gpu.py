"""The accurate INT8 numerics on a CUDA GPU: the portable kernel (backend ``triton_int8``; the same kernel runs
under the CPU interpreter in ``test_triton_interpret_cases.py``) and the warp-specialised one (``triton_int8_ws``,
sm_90; its sm_90 build is checked on the CPU in ``test_kernels_ws.py``). Skipped without a GPU (the
warp-specialised cases without Hopper).

Tolerances, all from higher-precision yardsticks on the same inputs:
- the pre-pass against its fp64 twin (:func:`quantize_int8_reference`): every int8 code within 1 (fp32 vs
  fp64 rounding at a tie), scales to 1e-5 relative, the V sums exactly those of its own codes;
- the kernel's relative L2 error against the fp64 oracle <= 1.25 x that of the fp64 emulation of the same
  numerics (:func:`int8_attention_emulation`: per-row Q and per-tile K scales, P on each tile's row
  maximum as uint8 levels, per-channel V) + 0.002, and < half the FP8 path's error on the same call;
- the issue's floor: a full map of Gaussian q/k/v (head dim 128) within 0.02 relative L2 of exact attention;
- the two kernels agree: the same numerics, P's levels rounded from differently ordered fp32 ops, so their
  outputs differ by far less than either's error (relative L2 < 0.1 x the emulation's error).
Only whole query blocks (first, middle, last) are compared, so the 75 600-token cases stay cheap."""

from __future__ import annotations

import os

import pytest
import torch

from testing import query_block_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only"),
]


def _qkv(heads, length, dim=128, seed=0, layout="bhld", dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, heads, length, dim, device="cuda", generator=gen) for _ in range(3))
    k = k + 0.5  # a shared K offset: smoothing matters
    if layout == "blhd":  # ComfyUI's [B, L, H, D] memory viewed as [B, H, L, D]
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _map(heads, length, density, seed=7):
    nb = -(-length // 128)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bm = torch.rand(1, heads, nb, nb, device="cuda", generator=gen) < density
    bm[..., torch.arange(nb), torch.arange(nb)] = True
    return bm


def _rel(x, oracle):
    return ((x.double() - oracle).norm() / oracle.norm()).item()


SM90_ONLY = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                               reason="sm_90 only")
INT8_BACKENDS = ["triton_int8", pytest.param("triton_int8_ws", marks=SM90_ONLY)]


@pytest.mark.parametrize("length", [300, 4097])
@pytest.mark.parametrize("pooled_tail", [False, True])
@pytest.mark.parametrize("v_key_order", ["natural", "wgmma"])
def test_int8_prepass_matches_its_fp64_twin(length, pooled_tail, v_key_order):
    from chorus.kernels.triton._quant_int8 import quantize_int8_reference, quantize_qkv_int8

    q, k, v = _qkv(2, length, seed=length)
    pool_block = 128 if pooled_tail else None
    ours = quantize_qkv_int8(q, k, v, 0.088, pool_block=pool_block, v_key_order=v_key_order)
    ref = quantize_int8_reference(q, k, v, 0.088, pool_block=pool_block, v_key_order=v_key_order)
    names = ("q8", "k8", "v8t", "q_scale", "k_scale", "v_scale", "v_sums", "pool_ratio")
    for name, a, b in zip(names, ours, ref):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.dtype == torch.int8:
            diff = (a.int() - b.int()).abs()
            assert diff.max().item() <= 1 and diff.float().mean().item() < 0.01, name
        elif a.dtype == torch.float32:
            assert torch.allclose(a, b, rtol=1e-5, atol=0), name
    v8t, v_sums = ours[2], ours[6]  # the V sums are those of the kernel's own codes, exactly
    assert torch.equal(v_sums, v8t.int().view(*v8t.shape[:3], -1, 128).sum(-1).transpose(-1, -2))


@pytest.mark.parametrize("length,density", [(300, 0.5), (4097, 1.0), (4097, 0.3), (32760, 0.15), (75600, 0.05)])
@pytest.mark.parametrize("pooled_tail", [False, True])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("backend", INT8_BACKENDS)
def test_int8_kernel_against_oracle_and_emulation(length, density, pooled_tail, layout, backend):
    if density == 1.0 and pooled_tail:
        pytest.skip("a full map has no tail")
    _against_oracle_and_emulation(length, density, pooled_tail, layout, backend, torch.bfloat16)


@pytest.mark.parametrize("length,density", [(4097, 0.3), (32760, 0.15)])
@pytest.mark.parametrize("pooled_tail", [False, True])
@pytest.mark.parametrize("backend", INT8_BACKENDS)
def test_int8_kernel_takes_fp16_the_dtype_comfyui_computes_wan_in(length, density, pooled_tail, backend):
    """ComfyUI computes a Wan model in fp16 on a GPU: fp16 q / k / v in its ``[B, L, H, D]`` memory, the same
    bounds as bf16's."""
    _against_oracle_and_emulation(length, density, pooled_tail, "blhd", backend, torch.float16)


def _against_oracle_and_emulation(length, density, pooled_tail, layout, backend, dtype):
    """``backend`` on 4 heads of ``dtype`` q / k / v in ``layout`` with the first-frame prefix bias: relative L2
    against the fp64 oracle <= 1.25 x the INT8 emulation's + 0.002, and below half the FP8 kernel's."""
    from chorus.kernels import block_sparse_attention
    from chorus.kernels.reference import dense_attention_oracle
    from chorus.kernels.triton.emulation import int8_attention_emulation

    heads = 4
    q, k, v = _qkv(heads, length, seed=length, layout=layout, dtype=dtype)
    bm = _map(heads, length, density)
    biases = dict(prefix_len=min(1560, length // 3), prefix_bias=0.7)
    out = block_sparse_attention(q, k, v, bm, backend=backend, pooled_tail=pooled_tail, **biases)
    fp8 = block_sparse_attention(q, k, v, bm, backend="triton_fp8", pooled_tail=pooled_tail, **biases)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    blocks, rows = query_block_rows(length, bm.shape[-1])
    oracle = dense_attention_oracle(q[:, :, rows], k, v, bm[:, :, blocks], 128, pooled_tail=pooled_tail, **biases)
    emul = int8_attention_emulation(q[:, :, rows], k, v, bm[:, :, blocks], 128, pooled_tail=pooled_tail, **biases)
    ours, yardstick, fast = _rel(out[:, :, rows], oracle), _rel(emul, oracle), _rel(fp8[:, :, rows], oracle)
    print(f"L={length} density={density} tail={pooled_tail} {layout} {dtype} {backend}: {ours:.4f} (emulation "
          f"{yardstick:.4f}), fp8 {fast:.4f}")
    assert ours <= 1.25 * yardstick + 0.002, (ours, yardstick)
    assert ours < 0.5 * fast, (ours, fast)


@pytest.mark.parametrize("length", [32760, 75600])
@pytest.mark.parametrize("backend", INT8_BACKENDS)
def test_int8_full_map_floor_on_gaussian_inputs(length, backend):
    """Issue 30's floor: relative L2 <= 0.02 (cosine >= 0.9998) against exact attention, full map."""
    from chorus.kernels import block_sparse_attention
    from chorus.kernels.reference import dense_attention_oracle

    q, k, v = _qkv(4, length, seed=1)
    k = (k.float() - 0.5).bfloat16()  # plain Gaussian q/k/v
    bm = torch.ones(1, 1, -(-length // 128), -(-length // 128), dtype=torch.bool, device="cuda")
    out = block_sparse_attention(q, k, v, bm, backend=backend)
    blocks, rows = query_block_rows(length, bm.shape[-1])
    oracle = dense_attention_oracle(q[:, :, rows], k, v, None, 128)
    err = _rel(out[:, :, rows], oracle)
    cos = torch.nn.functional.cosine_similarity(out[:, :, rows].double().flatten(), oracle.flatten(), dim=0).item()
    print(f"L={length} {backend}: full-map error {err:.4f}, cosine {cos:.6f}")
    assert err <= 0.02 and cos >= 0.9998, (err, cos)


@pytest.mark.parametrize("backend", INT8_BACKENDS)
def test_int8_token_order_is_the_reordered_call(backend):
    from chorus.kernels import block_sparse_attention

    length, heads = 4097, 2
    q, k, v = _qkv(heads, length, seed=3)
    perm = torch.randperm(length, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    bm = _map(heads, length, 0.3)
    out = block_sparse_attention(q, k, v, bm, backend=backend, token_perm=perm, pooled_tail=True)
    qp, kp, vp = (t[:, :, perm] for t in (q, k, v))
    plain = block_sparse_attention(qp, kp, vp, bm, backend=backend, pooled_tail=True)
    # the same numerics on the same sequence, up to the smoothing rows (the strided rows of each order)
    back = torch.empty_like(plain)
    back[:, :, perm] = plain
    assert _rel(out, back.double()) < 0.02


def test_int8_rejects_other_block_sizes():
    from chorus.kernels import BackendUnavailableError, block_sparse_attention

    q, k, v = _qkv(1, 300)
    bm = torch.ones(1, 1, 5, 5, dtype=torch.bool, device="cuda")
    with pytest.raises(BackendUnavailableError):
        block_sparse_attention(q, k, v, bm, block_size=64, backend="triton_int8")


@pytest.mark.parametrize("backend", INT8_BACKENDS)
def test_int8_backends_resolve_only_with_their_block_size(backend):
    """``resolve_backend(..., block_size=)``: the INT8 kernels run 128-token blocks only, so asked for another
    size they are unavailable (what the engine's accurate choice asks before it falls back to ``auto``), and
    auto moves on to a backend that runs it."""
    from chorus.kernels import Backend, BackendUnavailableError, resolve_backend
    from chorus.engine.config import ACCURATE_TOP_P, SparseConfig

    q = _qkv(1, 300)[0]
    assert resolve_backend(backend, q, block_size=128) == Backend(backend)
    with pytest.raises(BackendUnavailableError, match="128"):
        resolve_backend(backend, q, block_size=64)
    assert resolve_backend("auto", q, block_size=64) not in (Backend.TRITON_INT8, Backend.TRITON_INT8_WS)
    wanted = SparseConfig(top_p=ACCURATE_TOP_P, block_size=64).attention_backends

    def runs(name):  # what the engine's accurate choice asks of each backend it would take, in order
        try:
            resolve_backend(name, q, block_size=64)
        except BackendUnavailableError:
            return False
        return True

    assert [runs(name) for name in wanted] == [False, False, True]


@SM90_ONLY
@pytest.mark.parametrize("length,dim,density,pooled_tail,suffix", [
    (300, 128, 0.5, True, False), (4097, 64, 0.3, True, False), (4097, 128, 0.3, False, True),
    (32760, 128, 0.15, True, True), (75600, 128, 0.05, True, False)])
def test_int8_warp_specialised_agrees_with_the_portable_kernel(length, dim, density, pooled_tail, suffix):
    """The same numerics in both kernels (head dims 64 / 128, a suffix bias as feature reuse's compact attention
    has, the tail): outputs within a tenth of the emulation's own error of each other, and the warp-specialised
    one within the emulation's bound of the oracle."""
    from chorus.kernels import block_sparse_attention
    from chorus.kernels.reference import dense_attention_oracle
    from chorus.kernels.triton.emulation import int8_attention_emulation

    heads = 4
    q, k, v = _qkv(heads, length, dim=dim, seed=length + dim)
    bm = _map(heads, length, density)
    biases = dict(prefix_len=min(1560, length // 3), prefix_bias=0.7)
    if suffix:
        biases.update(suffix_len=min(640, length // 4), suffix_bias=1.1)
    ws = block_sparse_attention(q, k, v, bm, backend="triton_int8_ws", pooled_tail=pooled_tail, **biases)
    portable = block_sparse_attention(q, k, v, bm, backend="triton_int8", pooled_tail=pooled_tail, **biases)
    blocks, rows = query_block_rows(length, bm.shape[-1])
    oracle = dense_attention_oracle(q[:, :, rows], k, v, bm[:, :, blocks], 128, pooled_tail=pooled_tail, **biases)
    emul = int8_attention_emulation(q[:, :, rows], k, v, bm[:, :, blocks], 128, pooled_tail=pooled_tail, **biases)
    yardstick = _rel(emul, oracle)
    apart = _rel(ws[:, :, rows], portable[:, :, rows].double())
    ours = _rel(ws[:, :, rows], oracle)
    print(f"L={length} D={dim} density={density} tail={pooled_tail} suffix={suffix}: ws {ours:.4f}, emulation "
          f"{yardstick:.4f}, ws vs portable {apart:.5f}")
    assert torch.isfinite(ws).all() and ws.shape == q.shape and ws.dtype == q.dtype
    assert apart < 0.1 * yardstick, (apart, yardstick)
    assert ours <= 1.25 * yardstick + 0.002, (ours, yardstick)


@pytest.mark.parametrize("backend", INT8_BACKENDS)
def test_int8_strong_negative_key_bias_on_tiny_logits(backend):
    """Tiny logits (q x 1e-4) and the strongest negative prefix bias over every key, the partial last block
    included: in the warp-specialised kernel that block's logits, offset by 1.5 x 2^23 in the dot's units, go
    below zero, and its P must still be taken relative to its own maximum (else its keys drop out)."""
    from chorus.kernels import block_sparse_attention
    from chorus.kernels.reference import dense_attention_oracle
    from chorus.kernels.triton.emulation import int8_attention_emulation

    length, heads = 300, 2
    q, k, v = _qkv(heads, length, seed=21)
    q = (q.float() * 1e-4).bfloat16()
    bm = torch.ones(1, 1, 3, 3, dtype=torch.bool, device="cuda")
    biases = dict(prefix_len=length, prefix_bias=-20.0)
    out = block_sparse_attention(q, k, v, bm, backend=backend, **biases)
    oracle = dense_attention_oracle(q, k, v, bm, 128, **biases)
    yardstick = _rel(int8_attention_emulation(q, k, v, bm, 128, **biases), oracle)
    ours = _rel(out, oracle)
    print(f"{backend}: tiny logits, prefix bias -20 on every key: {ours:.4f} (emulation {yardstick:.4f})")
    assert torch.isfinite(out).all() and ours <= 1.25 * yardstick + 0.002, (ours, yardstick)


def _ptxas_version():
    """(major, minor) of the ptxas that builds the INT8 kernel (:func:`chorus.kernels.triton._ptxas.kernel_ptxas`:
    Triton's own for sm_90, pinned), or None where it cannot be found."""
    from chorus.kernels.triton import _ptxas

    asm = _ptxas.kernel_ptxas(int8=True)
    return asm.version if asm is not None else None


PTXAS_FIXED = (13, 0)  # the oldest ptxas measured to assemble the case below right (12.8 and 12.9 do not)


@SM90_ONLY
def test_int8_ws_query_block_that_keeps_nothing_attends_to_its_pooled_terms(request):
    """A query block whose map row keeps no key block runs only the pooled tiles' loop of ``triton_int8_ws`` (its kept
    blocks' loop is empty): both consumer warpgroups' 64 rows within the emulation's bound of the oracle. ptxas
    12.x (what Triton bundles for sm_90) assembles that case wrongly for the first warpgroup: on the H200 its rows
    came out at cosine 0.9944 against the oracle, the second's at 0.99998, with ptxas 13.3 (``TRITON_PTXAS_PATH``)
    both 0.99998, and with 13.0 both within the bound (0.0057 against the emulation's 0.0054). So with an older
    ptxas this is an expected failure (strict: a fixed ptxas turns it into a pass that asks for the marker's
    removal). That ptxas is Triton's own, pinned for the INT8 variant (TorchInductor's switch of
    ``TRITON_PTXAS_PATH`` to torch's bundled 13.0 does not reach it: :mod:`chorus.kernels.triton._ptxas`). No
    caller of ours reaches the case: the public API rejects a map with an empty row unless ``rows_checked``, and
    the engine's maps keep at least one block per row. 64 heads, so the tile is not its CTA's first (the
    miscompiled result is then the same on every run)."""
    from chorus.kernels.reference import dense_attention_oracle
    from chorus.kernels.triton._attention_ws import block_sparse_attention_ws
    from chorus.kernels.triton.emulation import int8_attention_emulation

    version = _ptxas_version()
    if version is None:  # cannot tell: the failure is expected unless this Triton's ptxas is a fixed one
        request.applymarker(pytest.mark.xfail(strict=False, reason="ptxas version unknown: maybe older than 13.0"))
    elif version < PTXAS_FIXED:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"ptxas {version} < {PTXAS_FIXED}: the first "
                                              "consumer's pooled-only tile is miscompiled"))
    heads, length, empty_head, empty_block = 64, 3000, 40, 4
    q, k, v = _qkv(heads, length, seed=41)
    bm = _map(heads, length, 0.2, seed=6)
    bm[:, empty_head, empty_block] = False
    out = block_sparse_attention_ws(q, k, v, bm, 128 ** -0.5, pooled_tail=True, int8=True)
    rows = slice(empty_block * 128, empty_block * 128 + 128)
    head = slice(empty_head, empty_head + 1)
    inputs = (q[:, head, rows], k[:, head], v[:, head], bm[:, head, empty_block:empty_block + 1], 128)
    oracle = dense_attention_oracle(*inputs, pooled_tail=True)
    emul = int8_attention_emulation(*inputs, pooled_tail=True)
    got = out[:, head, rows]
    for half in (slice(0, 64), slice(64, 128)):
        ours, yardstick = _rel(got[:, :, half], oracle[:, :, half]), _rel(emul[:, :, half], oracle[:, :, half])
        print(f"ptxas {version}, rows {half.start}-{half.stop - 1} of a block that keeps nothing: {ours:.4f} "
              f"(emulation {yardstick:.4f})")
        assert torch.isfinite(got).all() and ours <= 1.25 * yardstick + 0.002, (half, ours, yardstick)
