"""Region scores travel with a cache entry: a miss writes them (commit_plan), a hit reads them back."""

import numpy as np
import torch

from chorus.cache_store import Workspace
from chorus.engine import SparseConfig, commit_plan, retrieve_plan
from chorus.engine.feature_reuse import FeatureReuse, FeatureReuseConfig, feature_state
from chorus.engine.runtime import ChorusAttention
from chorus.engine.model_info import ModelInfo

GRID = (4, 8, 8)
LATENT = (16, 4, 16, 16)
INFO = ModelInfo("wan", "wan2.2-a14b-i2v", 2, 2, 32, 36, "fp-test")
SIGMAS = [1.0, 0.5, 0.0]


def _run(plan, share=0.25, channel_strided=False):
    """Two steps of a 2-layer toy 'model': self-attention through ChorusAttention, the block through
    FeatureReuse (what the ComfyUI nodes do per block). ``channel_strided``: the stream starts as a
    transposed view, as ComfyUI's WanModel hands it to its blocks."""
    attn = ChorusAttention(plan, SparseConfig(block_size=32, k_min=1), INFO)
    fr = FeatureReuse(plan, FeatureReuseConfig(downsample_share=share, region=(2, 4, 4)), INFO)
    attn.begin_run(SIGMAS)
    fr.begin_run(SIGMAS)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, 64, generator=g)
    if channel_strided:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    for sigma in SIGMAS[:-1]:
        for layer in range(2):
            def block_fn(h, per_token, layout, layer=layer, sigma=sigma):
                if layout is None:  # the full sequence: self-attention through the sparse runtime
                    q = h.view(1, h.shape[1], 2, 32).transpose(1, 2)
                    a = attn.self_attention(q, q, q, layer=layer, sigma=sigma, grid=GRID,
                                            dense_fn=torch.nn.functional.scaled_dot_product_attention)
                    h = h + 0.1 * a.transpose(1, 2).reshape(h.shape)
                return h + 0.5 + 0.1 * torch.sin(h)
            x = fr.block(block_fn, x, layer=layer, sigma=sigma, grid=GRID)
    fr.end_run()
    attn.end_run()
    return x


def test_scores_are_written_with_the_entry_and_found_on_a_hit(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    emb = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    miss = retrieve_plan(ws, emb, LATENT, similarity_threshold=0.9)
    assert not miss.is_hit
    _run(miss)
    assert "feature_reuse" in miss.request_meta
    assert "wrote entry" in commit_plan(ws, miss)
    _, meta = ws.load(1, touch=False)
    assert meta["feature_reuse"] == miss.request_meta["feature_reuse"]
    hit = retrieve_plan(ws, emb, LATENT, similarity_threshold=0.9)
    assert hit.is_hit and hit.entry_meta["feature_reuse"]["token_grid"] == list(GRID)
    _run(hit)
    state = feature_state(hit)
    assert state.blocks_reduced == 2 and state.blocks_full == 2  # layer 0 always full; layer 1 reduced
    assert hit.stats.fallback_calls == 0


def test_a_channel_strided_stream_gives_the_same_row_major_output(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    emb = np.random.default_rng(1).standard_normal(16).astype(np.float32)
    miss = retrieve_plan(ws, emb, LATENT, similarity_threshold=0.9)
    _run(miss)
    commit_plan(ws, miss)
    outs = []
    for strided in (False, True):
        hit = retrieve_plan(ws, emb, LATENT, similarity_threshold=0.9)
        assert hit.is_hit
        outs.append(_run(hit, channel_strided=strided))
        assert feature_state(hit).blocks_reduced == 2
    assert outs[1].is_contiguous()  # the reduced block's output is row-major
    # the same values up to the last bits: the pooled tail (on by default) averages every key block, and a
    # strided stream's pooled cells are summed in another order
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)


def test_the_host_s_own_block_error_propagates_once_and_is_not_a_feature_reuse_note():
    """A miss's full block runs once, outside feature reuse's own guard: an error of the host's block (out of
    memory) leaves once, with no note blaming feature reuse and no second run of the block (a second run
    recorded the layer's attention mass twice)."""
    import pytest

    from chorus.engine import Plan

    plan = Plan.miss("t", latent_shape=LATENT)
    fr = FeatureReuse(plan, FeatureReuseConfig(region=(2, 4, 4)), INFO)
    fr.begin_run(SIGMAS)
    calls = []

    def block_fn(h, per_token, layout):
        calls.append(layout)
        raise torch.OutOfMemoryError("test: the host's block ran out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        fr.block(block_fn, torch.randn(1, 256, 64), layer=1, sigma=0.5, grid=GRID)
    assert calls == [None] and not any("feature reuse" in m for m in plan.stats.messages), plan.stats.messages
