"""benchmarks/kernels/peers.py on the CPU: every peer answers with a callable or a reason (never raises),
the runnable ones match the fp32 reference, and the layout helpers (cuDNN tile mask bits, block index
lists, e4m3 quantisation, the chunked reference) are right. The GPU numbers come from the benchmark."""

from __future__ import annotations

import math

import pytest
import torch

from chorus.benchmarks.kernels import peers

from testing import make_qkv


def _inputs(length=300, heads=4, dim=64, block_size=64, seed=0, dtype=torch.bfloat16):
    q, k, v = make_qkv(heads=heads, q_len=length, head_dim=dim, seed=seed)
    nb = -(-length // block_size)
    gen = torch.Generator().manual_seed(seed)
    bm = torch.rand(1, heads, nb, nb, generator=gen) < 0.4
    bm |= torch.eye(nb, dtype=torch.bool)  # no empty row
    return q.to(dtype), k.to(dtype), v.to(dtype), bm


def test_registry_names_unique_and_complete():
    names = [p.name for p in peers.PEERS]
    assert len(names) == len(set(names))
    for required in ("cudnn_sdpa_bf16", "cudnn_fp8_sdpa", "sageattention", "flashinfer_block_sparse",
                     "fa4_block_sparse", "flex_compiled", "sol_attn_topk", "ours_fp8_ws_tail", "ours_int8",
                     "ours_int8_tail", "ours_int8_ws", "ours_int8_ws_tail"):
        assert required in names
    # the peers that add a pooled tail have no map-masked cosine; every other peer has one
    assert {p.name for p in peers.PEERS if p.no_reference} == {"sol_attn_topk", "ours_fp8_ws_tail", "ours_int8_tail",
                                                             "ours_int8_ws_tail"}
    assert peers.get_peer("flex_compiled").sparse and not peers.get_peer("cudnn_sdpa_bf16").sparse
    with pytest.raises(KeyError):
        peers.get_peer("nope")


@pytest.mark.parametrize("broadcast_heads", [False, True])
def test_every_peer_answers_on_cpu(broadcast_heads):
    q, k, v, bm = _inputs()
    if broadcast_heads:
        bm = bm[:, :1]
    ran = []
    for peer in peers.PEERS:
        fn, reason = peers.make_peer(peer, q, k, v, bm, 64)
        assert (fn is None) != (reason == ""), (peer.name, reason)
        if fn is None:
            assert isinstance(reason, str) and reason.strip(), peer.name
            continue
        out = fn()
        assert out.shape == q.shape, peer.name
        heads = [0, 2]
        ref = peers.reference_subset(q, k, v, bm if peer.sparse else None, 64, heads)
        assert peers.cosine(out[:, heads], ref) > 0.999, peer.name
        ran.append(peer.name)
    assert set(ran) <= {"flex_compiled"}  # nothing else runs without a GPU


def test_cuda_only_peers_name_the_device():
    q, k, v, bm = _inputs()
    for name in ("ours_fp8", "cudnn_sdpa_bf16", "cudnn_fp8_sdpa", "cudnn_bf16_block_mask"):
        fn, reason = peers.make_peer(peers.get_peer(name), q, k, v, bm, 64)
        assert fn is None and ("cuda" in reason.lower() or "not importable" in reason), (name, reason)


def test_uninstalled_peers_report_why():
    q, k, v, bm = _inputs()
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001
        fn, reason = peers.make_peer(peers.get_peer("flashinfer_block_sparse"), q, k, v, bm, 64)
        assert fn is None and reason.startswith(peers.FLASHINFER_NOT_INSTALLED)
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
    except Exception:  # noqa: BLE001
        fn, reason = peers.make_peer(peers.get_peer("fa4_block_sparse"), q, k, v, bm, 64)
        assert fn is None and reason.startswith(peers.FA4_NOT_INSTALLED)


def test_make_peer_turns_a_raise_into_a_reason():
    def boom(*_):
        raise RuntimeError("kaput")

    fn, reason = peers.make_peer(peers.Peer("x", True, boom, ""), None, None, None, None, 128)
    assert fn is None and "kaput" in reason
    fn, reason = peers.make_peer(peers.Peer("y", True, lambda *_: (None, ""), ""), None, None, None, None, 128)
    assert fn is None and reason == "unavailable (no reason given)", reason


def test_tile_mask_bits_lsb_first_and_round_trip():
    bm = torch.zeros(1, 1, 2, 11, dtype=torch.bool)
    bm[0, 0, 0, 0] = True
    bm[0, 0, 1, 9] = True
    bm[0, 0, 1, 2] = True
    packed = peers.pack_tile_mask_lsb(bm)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 1, 2, 2)
    assert packed[0, 0, 0].tolist() == [1, 0]
    assert packed[0, 0, 1].tolist() == [4, 2]
    gen = torch.Generator().manual_seed(3)
    for kb in (1, 8, 13, 256):
        rand = torch.rand(2, 3, 5, kb, generator=gen) < 0.5
        assert torch.equal(peers.unpack_tile_mask_lsb(peers.pack_tile_mask_lsb(rand), kb), rand)


def test_block_index_lists():
    bm = torch.tensor([[[[False, True, False, True], [True, True, True, True], [False, False, True, False]]]])
    counts, order = peers.block_index_lists(bm)
    assert counts.dtype == torch.int32 and order.dtype == torch.int32
    assert counts[0, 0].tolist() == [2, 4, 1]
    assert order[0, 0, 0, :2].tolist() == [1, 3]
    assert order[0, 0, 1].tolist() == [0, 1, 2, 3]
    assert order[0, 0, 2, :1].tolist() == [2]
    assert sorted(order[0, 0, 0].tolist()) == [0, 1, 2, 3]  # every id in range


def test_quantize_e4m3_power_of_two_and_saturation_free():
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(2, 3, 50, 16, generator=gen) * 7).to(torch.bfloat16)
    t8, descale = peers.quantize_e4m3(t)
    assert t8.dtype == torch.float8_e4m3fn and descale.shape == (1,)
    exponent = math.log2(descale.item())
    assert exponent == round(exponent)
    assert t8.float().abs().max().item() <= peers.E4M3_MAX
    assert t8.float().abs().max().item() >= peers.E4M3_MAX / 2  # the scale uses the top binade
    back = t8.float() * descale
    assert peers.cosine(back, t.float()) > 0.999


@pytest.mark.parametrize("length,block_size", [(300, 64), (256, 128)])
def test_reference_subset_matches_chorus_reference(length, block_size):
    from chorus.kernels import reference

    q, k, v, _ = _inputs(length=length, block_size=block_size, dtype=torch.float32)
    nb = -(-length // block_size)
    bm = (torch.rand(1, 4, nb, nb, generator=torch.Generator().manual_seed(1)) < 0.5) | torch.eye(nb, dtype=torch.bool)
    heads = [1, 3]
    want = reference.block_sparse_attention_reference(q, k, v, bm, block_size, 1.0 / math.sqrt(q.shape[-1]))
    got = peers.reference_subset(q, k, v, bm, block_size, heads, chunk=block_size)  # several chunks
    torch.testing.assert_close(got, want[:, heads].float(), atol=1e-5, rtol=1e-5)
    dense = peers.reference_subset(q, k, v, None, block_size, heads)
    torch.testing.assert_close(dense, torch.softmax(q[:, heads] @ k[:, heads].transpose(-1, -2) / math.sqrt(q.shape[-1]),
                                                    -1) @ v[:, heads], atol=1e-5, rtol=1e-5)


def test_cudnn_graphs_build_their_operation_graph(monkeypatch):
    """The cuDNN frontend graphs (FP8 sdpa_fp8, bf16 sdpa with block_mask) are well formed up to the
    operation graph, which needs no GPU; plans need one."""
    cudnn = pytest.importorskip("cudnn")

    def until_operation_graph(_cudnn, graph):
        graph.validate()
        graph.build_operation_graph()

    monkeypatch.setattr(peers, "_finish_build", until_operation_graph)
    shape = (1, 4, 1000, 128)
    for fp8_output in (False, True):
        for stats in (False, True):
            peers._build_fp8_graph(cudnn, None, shape, 128 ** -0.5, fp8_output, stats)
    peers._build_block_mask_graph(cudnn, None, shape, 8, 1, 128 ** -0.5)


@pytest.mark.parametrize("length", [300, 32768])
@pytest.mark.parametrize("density", [0.05, 0.15, 0.5])
def test_uniform_rows_maps_keep_one_count_and_the_forced_blocks(length, density):
    from chorus.benchmarks.kernels import masks

    bm = masks.structured_block_map(length, 4, density, 128, uniform_rows=True)
    nb = -(-length // 128)
    counts = bm.sum(-1)
    assert (counts == max(1, round(density * nb))).all()
    if counts[0, 0, 0] > 1:
        assert bm[0, :, torch.arange(nb), torch.arange(nb)].all()  # the diagonal comes first
    # the cuDNN fixed-count peer accepts only such maps (and lengths that are multiples of 128)
    assert masks.grid_for(32768) == masks.WAN_GRIDS[32760] and masks.grid_for(75648) == masks.WAN_GRIDS[75600]
    assert masks.grid_for(300) == (1, 1, 300)


def test_the_peers_plot_redraws_a_saved_run_without_a_gpu(tmp_path):
    """``bench_block_sparse.py --plot-from``: the committed peers JSON of the H200 run gives a PNG."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    saved = root / "benchmarks/kernels/results/h200_2026-12-02d_peers.json"
    assert any(r["ran"] and r["peer"] == "ours_fp8_ws" for r in json.loads(saved.read_text())["peers"])
    subprocess.run([sys.executable, str(root / "benchmarks/kernels/bench_block_sparse.py"), "--out", str(tmp_path),
                    "--plot-from", str(saved)], check=True, cwd=root, timeout=300)
    png = tmp_path / "bench_block_sparse_peers.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_comfy_kitchen_without_sol_attn_is_named_not_called(monkeypatch):
    """ComfyUI's requirements pin comfy-kitchen releases that predate ``sol_attn`` (0.2.20 in ComfyUI 0.28.2):
    the sol_attn peer says so instead of failing on the missing attribute."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "comfy_kitchen", types.ModuleType("comfy_kitchen"))
    module, why = peers.comfy_kitchen_with_sol_attn()
    assert module is None and "has no sol_attn" in why and "chorus-ii[peers]" in why
    q, k, v, block_map = _inputs()[:4]
    run, reason = peers.make_sol_attn_topk(q, k, v, block_map, 64)
    assert run is None and reason == why
