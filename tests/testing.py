"""Shared oracles and input builders for the Chorus II tests."""

from __future__ import annotations

import torch

from chorus.kernels.masks import num_blocks
from chorus.kernels.reference import dense_attention_oracle, masked_attention_eager


def make_qkv(batch=1, heads=2, q_len=300, kv_len=None, head_dim=64, dtype=torch.float32, seed=0, device="cpu"):
    """Seeded q, k, v ``[B, H, L, D]``; q/k scaled so the softmax is peaked (like trained models)."""
    gen = torch.Generator().manual_seed(seed)
    kv_len = q_len if kv_len is None else kv_len
    q = torch.randn(batch, heads, q_len, head_dim, generator=gen) * 1.5
    k = torch.randn(batch, heads, kv_len, head_dim, generator=gen) * 1.5
    v = torch.randn(batch, heads, kv_len, head_dim, generator=gen)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def cuda_qkv(batch, heads, length, dim, seed, comfy_layout=False, dtype=torch.bfloat16):
    """Seeded q, k, v ``[B, H, L, D]`` of ``dtype`` (bf16 unless told; fp16 is what ComfyUI computes Wan in on a
    GPU) on the GPU: unit Gaussians, K with a shared +0.5 offset (what K smoothing removes); ``comfy_layout``:
    head-transposed views of ``[B, L, H, D]`` memory."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (batch, length, heads, dim) if comfy_layout else (batch, heads, length, dim)
    q, k, v = (torch.randn(*shape, device="cuda", generator=gen) for _ in range(3))
    k = k + 0.5
    ts = [t.to(dtype) for t in (q, k, v)]
    return [t.transpose(1, 2) for t in ts] if comfy_layout else ts


def random_block_map(batch, heads, q_len, kv_len, block_size, density=0.5, seed=0):
    """Random bool map with the diagonal kept, so no row is empty."""
    gen = torch.Generator().manual_seed(seed)
    qb, kb = num_blocks(q_len, block_size), num_blocks(kv_len, block_size)
    keep = torch.rand(batch, heads, qb, kb, generator=gen) < density
    diag = torch.arange(min(qb, kb))
    keep[..., diag, diag] = True
    keep[..., :, 0] |= ~keep.any(-1)
    return keep


def assert_matches_oracle(out, q, k, v, block_map, block_size, factor=2.0, prefix_len=0, prefix_bias=0.0,
                          **options):
    """Error of ``out`` vs the fp64 oracle is at most ``factor`` x the error of eager attention at
    the inputs' dtype (plus a small absolute floor of a few output ulps for exact-in-fp32 paths);
    ``options``: the oracle's other keywords (``suffix_len``, ``suffix_bias``, ``pooled_tail``)."""
    oracle = dense_attention_oracle(q, k, v, block_map, block_size, prefix_len=prefix_len, prefix_bias=prefix_bias,
                                    **options)
    eager = masked_attention_eager(q, k, v, block_map, block_size, prefix_len=prefix_len,
                                   prefix_bias=prefix_bias, **options).double()
    err = (out.double() - oracle).abs().max().item()
    err_eager = (eager - oracle).abs().max().item()
    floor = 4 * torch.finfo(q.dtype).eps * oracle.abs().max().item()
    assert err <= factor * err_eager + floor, f"error {err:.3e} > {factor} x eager {err_eager:.3e} + {floor:.1e}"
    return err, err_eager


def tiny_diffusers_wan(num_layers: int = 2, dtype=torch.float32, seed: int = 0):
    """A tiny diffusers ``WanTransformer3DModel`` (Wan 2.2 A14B I2V layout: 36 input channels, 2 heads
    x 64, text width 64), random weights from ``seed``, in eval mode. Needs diffusers."""
    import diffusers

    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=36, out_channels=16,
        text_dim=64, freq_dim=32, ffn_dim=128, num_layers=num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, rope_max_seq_len=1024)
    return model.to(dtype).eval()


def full_map_hit(miss, token_order=None):
    """A hit on a recorded miss's own entry with every block kept (sparse attention computes dense
    attention), carrying the miss's feature-reuse region scores the way ``commit_plan`` writes them;
    ``token_order`` relabels the entry's order (full maps are the same in every order)."""
    import numpy as np

    from chorus.engine import Plan, build_signature

    sig = build_signature(miss)
    if token_order is not None:
        sig["token_order"] = token_order
    grid, block = sig["token_grid"], sig["block_size"]
    blocks = num_blocks(grid[0] * grid[1] * grid[2], block)
    masks = {key: torch.ones(sig["num_heads"], blocks, blocks, dtype=torch.bool)
             for key in miss.recorder.block_maps()}
    meta = {"signature": sig}
    if "feature_reuse" in miss.request_meta:
        meta["feature_reuse"] = miss.request_meta["feature_reuse"]
    return Plan("hit", entry_id=1, similarity=1.0, masks=masks, entry_meta=meta, latent_shape=miss.latent_shape,
                embedding=np.ones(4, np.float32))


def query_block_rows(q_len: int, num_q_blocks: int, block_size: int = 128, device="cuda"):
    """``(blocks, rows)``: the first, middle and last (partial) query block and their token rows -- what the
    GPU tests check against the oracle, so 75 600-token cases stay cheap."""
    blocks = sorted({0, num_q_blocks // 2, num_q_blocks - 1})
    rows = torch.cat([torch.arange(b * block_size, min((b + 1) * block_size, q_len), device=device) for b in blocks])
    return blocks, rows


def check_pooled_tail(out, q, k, v, block_map, *, fp8: bool, label: str, block_size: int = 128,
                      cos_floor: float = 0.998, **biases) -> dict:
    """A ``pooled_tail=True`` output on whole query blocks (first, middle, last) against the fp64 oracle with
    the tail: bf16 max error <= 2 x eager bf16's (+ 4 ulp); FP8 relative L1 and cosine deficit <= 2 x the
    SageAttention-style emulation's (with the tail) and cosine >= ``cos_floor``. Prints, and a failure
    reports, the error against the oracle *without* the tail and per query block, so a failure reads as
    "the tail was ignored" (close to the map-only oracle: block lists / bias table / ``HAS_TAIL``), "one
    query block is wrong" or "everything is off" (the kernel)."""
    from chorus.kernels.triton.emulation import error_stats, sage_fp8_attention_emulation

    blocks, rows = query_block_rows(q.shape[2], block_map.shape[2], block_size, q.device)
    sub_map, q_sub, got = block_map[:, :, blocks], q[:, :, rows], out[:, :, rows]
    oracle = dense_attention_oracle(q_sub, k, v, sub_map, block_size, pooled_tail=True, **biases)
    plain = dense_attention_oracle(q_sub, k, v, sub_map, block_size, **biases)
    ours, vs_plain = error_stats(got, oracle), error_stats(got, plain)
    tail_share = error_stats(plain, oracle)["rel_l1"]  # how far the tail moves the exact answer
    per_block, start = [], 0
    for b in blocks:
        n = min((b + 1) * block_size, q.shape[2]) - b * block_size
        rel = error_stats(got[:, :, start:start + n], oracle[:, :, start:start + n])["rel_l1"]
        per_block.append((b, round(rel, 5)))
        start += n
    info = dict(label=label, ours=ours, ours_vs_map_only_oracle=vs_plain["rel_l1"], tail_moves_oracle=tail_share,
                per_query_block_rel_l1=per_block)
    assert torch.isfinite(out).all(), f"{label}: non-finite output {info}"
    if fp8:
        sage = error_stats(sage_fp8_attention_emulation(q_sub, k, v, sub_map, block_size, pooled_tail=True, **biases),
                           oracle)
        info["emulation"] = sage
        print(f"pooled tail {info}")
        ok = ours["rel_l1"] <= 2 * sage["rel_l1"] and 1 - ours["cosine"] <= 2 * (1 - sage["cosine"]) \
            and ours["cosine"] >= cos_floor
    else:
        eager = masked_attention_eager(q_sub, k, v, sub_map, block_size, pooled_tail=True, **biases).double()
        err, err_eager = (got.double() - oracle).abs().max().item(), (eager - oracle).abs().max().item()
        info.update(max_err=err, eager_max_err=err_eager)
        print(f"pooled tail {info}")
        ok = err <= 2 * err_eager + 4 * torch.finfo(q.dtype).eps * oracle.abs().max().item()
    if not ok:
        hint = ("closer to the map-only oracle than to the tail's: the tail was ignored or mis-weighted (block lists, "
                "bias table, HAS_TAIL)" if vs_plain["rel_l1"] < ours["rel_l1"] else
                "off on some query blocks only (per_query_block_rel_l1)" if max(e for _, e in per_block) > 3 * min(
                    e for _, e in per_block) + 1e-3 else "off everywhere (pooled means / scales or the kernel)")
        raise AssertionError(f"{label}: outside the bound, {hint}: {info}")
    return info


def add_same_requests(store, barrier, results, rounds: int) -> None:
    """The body of the dedupe tests' child processes (one-host workspace, fleet store): ``store.add_unique``
    of the same ``rounds`` requests (seeded embeddings), each after ``barrier`` (shared with the other
    writers, so all write the same request at the same moment); closes ``store`` and puts
    ``[(round, entry_id, created), ...]`` on ``results``."""
    import numpy as np

    masks = {(0, 0, 0, 0): torch.ones(2, 3, 3, dtype=torch.bool)}
    embeddings = np.random.default_rng(0).normal(size=(rounds, 16)).astype(np.float32)
    created = []
    for round_, emb in enumerate(embeddings):
        barrier.wait(60)
        entry_id, new = store.add_unique(emb, masks, {"signature": {"s": 1}, "round": round_}, min_similarity=0.9)
        created.append((round_, int(entry_id), bool(new)))
    store.close()
    results.put(created)
