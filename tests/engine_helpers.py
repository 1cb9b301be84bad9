"""Shared by the engine tests on plain tensors (``test_engine_runtime.py``, ``test_engine_verify.py``): a
two-layer, two-head Wan model description, a 105-token grid (not a multiple of the 32-token blocks), q/k/v,
an entry signature, a hit plan and a loop of attention calls over a schedule."""

from __future__ import annotations

import torch

from chorus.engine import ModelInfo, Plan, SparseConfig

BS = 32
GRID = (3, 5, 7)            # 105 tokens: not a multiple of the block size (4 blocks, last one partial)
LATENT = (16, 3, 10, 14)
L = 105
QB = 4
INFO = ModelInfo("wan", "wan2.2-a14b-i2v", 2, 2, 64, 36, "fp-high")
INFO_LOW = ModelInfo("wan", "wan2.2-a14b-i2v", 2, 2, 64, 36, "fp-low")
SIGMAS = [1.0, 0.75, 0.5, 0.0]
CFG = SparseConfig(top_p=0.9, k_min=1, block_size=BS, sample_rows=None)


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def qkv(seed, batch=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 2, L, 64, generator=g, dtype=dtype) for _ in range(3)]


def signature(experts=("fp-high",), sigmas=SIGMAS[:-1], grid=GRID, latent=LATENT):
    return {"format": 1, "family": "wan", "variant": "wan2.2-a14b-i2v", "experts": list(experts), "num_layers": 2,
            "num_heads": 2, "latent_shape": list(latent), "token_grid": list(grid), "block_size": BS,
            "token_order": "thw", "step_sigmas": list(sigmas), "head_groups": 1}


def hit_plan(masks, **kw):
    kw.setdefault("entry_id", 7)
    return Plan("hit", similarity=0.95, masks=masks, entry_meta={"signature": kw.pop("sig", signature())},
                latent_shape=LATENT, **kw)


def run_steps(handle, seed=0, sigmas=SIGMAS, layers=2, batch=1, cond_rows=None):
    outs = []
    handle.begin_run(sigmas)
    for i, s in enumerate(sigmas[:-1]):
        for layer in range(layers):
            q, k, v = qkv(seed + 10 * i + layer, batch)
            outs.append((q, k, v, handle.self_attention(q, k, v, layer=layer, sigma=s, grid=GRID, dense_fn=sdpa,
                                                        cond_rows=cond_rows)))
    handle.end_run()
    return outs
