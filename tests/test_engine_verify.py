"""Self-verifying hits (engine/verify.py) on plain tensors: the estimate against exact recall
(reference backend, a partial last block, head subsets), the best map at the same density against a
brute-force top-k, the fit ratio (~1 on near-uniform attention, a permuted map caught and a genuine
one passing on the quality harness's synthetic source, the genuine ratio bounded by the entry's
recording precision unless the recorder's verification anchors are exact), the verdict paths (pass; fail at the first expert -> dense + a complete
recording that is written; fail at a later expert -> dense, nothing written), off by default, and no
exception mid-sampling. ComfyUI's tiny WanModel: tests/test_verify_wan.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chorus import kernels
from chorus.cache_store import Workspace
from chorus.engine import ChorusAttention, Plan, SparseConfig, commit_plan
from chorus.engine import verify as verify_mod
from chorus.engine.config import DEFAULT_VERIFY_ROWS, DEFAULT_VERIFY_THRESHOLD, SUGGESTED_VERIFY_THRESHOLD
from chorus.engine.verify import ExpertCheck, fit_ratio, recall_estimate, recall_terms, verify_head_index

from engine_helpers import BS, GRID, INFO, INFO_LOW, L, LATENT, QB, SIGMAS, hit_plan, qkv, run_steps, sdpa, \
    signature

VCFG = SparseConfig(top_p=0.9, k_min=1, block_size=BS, sample_rows=None, verify_threshold=0.5,
                    verify_layers=(0, 1), verify_heads=1, verify_rows=4)
EMB = np.ones(8, dtype=np.float32)


def exact_recall(q, k, block_map, heads=None):
    """fp64 softmax probabilities summed over the kept blocks of each row, mean over rows, then over
    query blocks (each block weighted once, as block_mass does), heads and batch."""
    scale = q.shape[-1] ** -0.5
    p = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, dim=-1)  # [B, H, L, L]
    kept = block_map.bool().repeat_interleave(BS, -1)[..., :L].repeat_interleave(BS, -2)[..., :L, :]
    row = (p * kept.double()).sum(-1)  # [B, H, L]
    blocks = torch.stack([row[..., i * BS:(i + 1) * BS].mean(-1) for i in range(QB)], -1)
    if heads is not None:
        blocks = blocks[:, heads]
    return float(blocks.mean())


def test_head_index_is_evenly_spaced():
    assert verify_head_index(40, 4) == [0, 10, 20, 30]
    assert verify_head_index(2, 4) == [0, 1]
    assert verify_head_index(8, 1) == [0]


@pytest.mark.parametrize("heads", [None, [1], [0, 1]])
def test_estimate_equals_exact_recall_with_all_rows_and_is_close_with_sampled_rows(heads):
    q, k, _ = qkv(5, batch=2)
    q = q * 3  # peaked attention: recall far from density
    gen = torch.Generator().manual_seed(0)
    block_map = torch.rand(1, 2, QB, QB, generator=gen) > 0.6
    block_map[..., 0] = True
    want = exact_recall(q, k, block_map, heads)
    got = float(recall_estimate(q, k, block_map, heads=heads, sample_rows=None, block_size=BS, backend="reference"))
    assert got == pytest.approx(want, abs=1e-5)
    # all 32 rows of a block sampled (the partial last block has 9) = exact
    assert float(recall_estimate(q, k, block_map, heads=heads, sample_rows=BS, block_size=BS)) == \
        pytest.approx(want, abs=1e-5)
    sampled = float(recall_estimate(q, k, block_map, heads=heads, sample_rows=4, block_size=BS))
    assert abs(sampled - want) < 0.1
    two = recall_estimate(q, k, block_map, heads=heads, sample_rows=None, block_size=BS, with_best=True)
    assert two.shape == (2,) and float(two[0]) == pytest.approx(want, abs=1e-5) and float(two[1]) >= float(two[0]) - 1e-6


def _recorded(seed=0, info=INFO):
    plan = Plan.miss("t", embedding=EMB, latent_shape=LATENT)
    run_steps(ChorusAttention(plan, VCFG, info), seed=seed)
    return plan.recorder.block_maps()


def _wrong(maps):
    """Maps keeping only the last key block: far less mass than the request's own."""
    out = {}
    for key, m in maps.items():
        w = torch.zeros_like(m)
        w[..., -1] = True
        out[key] = w
    return out


def test_a_fitting_hit_passes_and_stays_sparse():
    hit = hit_plan(_recorded(), embedding=EMB)
    run_steps(ChorusAttention(hit, VCFG, INFO))
    assert hit.is_hit and hit.stats.sparse_calls == 6 and hit.stats.dense_calls == 0
    v = hit.stats.verification[0]
    assert v["verdict"] == "pass" and v["layers"] == [0, 1] and v["min_ratio"] <= v["ratio"] + 1e-9
    assert v["recall"] <= v["best"] + 1e-6 and v["ratio"] == pytest.approx(v["recall"] / v["best"]) and v["ratio"] > 0.5
    assert v["threshold"] == 0.5 and "verify expert 0: estimated recall" in hit.stats.summary()
    assert "fit ratio" in hit.stats.summary()
    assert hit.state.verify_recorder is None  # the record-ahead is dropped on a pass


def test_a_wrong_hit_fails_at_the_first_expert_runs_dense_and_writes_a_new_entry(tmp_path):
    maps = _recorded()
    hit = hit_plan(_wrong(maps), embedding=EMB)
    outs = run_steps(ChorusAttention(hit, VCFG, INFO))
    assert not hit.is_hit and "hit verification failed for expert 0" in hit.message
    assert hit.stats.verification[0]["verdict"] == "fail" and hit.stats.verification[0]["ratio"] < 0.5
    assert "fit ratio" in hit.message
    # step 0's two layers ran sparse (recorded ahead), the other 4 calls dense and recorded
    assert hit.stats.sparse_calls == 2 and hit.stats.dense_calls == 4
    for q, k, v, out in outs[2:]:
        torch.testing.assert_close(out, sdpa(q, k, v), rtol=0, atol=0)
    assert hit.recorder.complete and sorted(hit.recorder.block_maps()) == sorted(maps)
    ws = Workspace.open(tmp_path / "ws")
    assert commit_plan(ws, hit).startswith("wrote entry")
    (eid, _), = ws.search(EMB, k=1)
    _, meta = ws.load(eid, touch=False)  # the new entry names its verification anchors
    assert meta[verify_mod.ANCHORS_META_KEY] == {"layers": [0, 1], "heads": 1}


def test_a_hit_that_fails_its_verification_is_written_beside_its_entry_and_serves_the_next_request(tmp_path):
    """As the nodes commit (``add_unique`` at the request's similarity threshold): the entry that failed
    its verification has the request's signature and sits within the threshold, yet it does not count as
    serving the request, so the recording is written beside it (not "written meanwhile by another
    worker"), and the same request next retrieves the new entry."""
    maps = _recorded()
    ws = Workspace.open(tmp_path / "ws")
    near = EMB + 0.05 * np.random.default_rng(5).standard_normal(EMB.shape).astype(np.float32)  # an earlier request's
    failing = ws.add(near, _wrong(maps), {"signature": signature()})
    assert ws.search(EMB, k=1)[0][1] > 0.9
    hit = hit_plan(_wrong(maps), embedding=EMB, entry_id=failing, similarity_threshold=0.9)
    run_steps(ChorusAttention(hit, VCFG, INFO))
    assert not hit.is_hit and hit.recorder.complete
    message = commit_plan(ws, hit)
    assert message.startswith("wrote entry") and f"entry {failing} failed to serve" in message, message
    (best, similarity), = ws.search(EMB, k=1)
    assert best != failing and similarity == pytest.approx(1.0, abs=1e-5) and len(ws) == 2
    loaded, _ = ws.load(best, touch=False)
    assert all(torch.equal(loaded[key], m) for key, m in hit.recorder.block_maps().items())
    assert ws.add_unique(EMB, maps, {"signature": signature()}, min_similarity=0.9) == (best, False)  # dedupe holds
    ws.close()


def test_a_later_expert_failing_runs_dense_but_writes_nothing(tmp_path):
    high = _recorded(info=INFO)
    sig = signature(experts=("fp-high", "fp-low"))
    masks = dict(high)
    for key, m in _wrong(high).items():  # expert 1 gets wrong maps for steps 1-2
        if key[1] >= 1:
            masks[(1, key[1], key[2], 0)] = m
    masks = {k: v for k, v in masks.items() if not (k[0] == 0 and k[1] >= 1)}
    hit = hit_plan(masks, embedding=EMB, sig=sig)
    h = ChorusAttention(hit, VCFG, INFO)
    low = ChorusAttention(hit, VCFG, INFO_LOW)
    h.begin_run(SIGMAS[:2] + [SIGMAS[1]])  # step 0 on the high-noise expert
    for layer in range(2):
        q, k, v = qkv(layer)
        h.self_attention(q, k, v, layer=layer, sigma=SIGMAS[0], grid=GRID, dense_fn=sdpa)
    h.end_run()
    assert hit.is_hit and hit.stats.verification[0]["verdict"] == "pass"
    low.begin_run(SIGMAS[1:])
    for i, s in enumerate(SIGMAS[1:-1]):
        for layer in range(2):
            q, k, v = qkv(10 * (i + 1) + layer)
            low.self_attention(q, k, v, layer=layer, sigma=s, grid=GRID, dense_fn=sdpa)
    low.end_run()
    assert not hit.is_hit and hit.stats.verification[1]["verdict"] == "fail"
    assert hit.recorder.incomplete_reason is not None
    assert "not written" in commit_plan(Workspace.open(tmp_path / "ws"), hit)
    assert any("nothing will be written" in m for m in hit.stats.messages)


def test_verification_off_and_layers_outside_the_model():
    maps = _wrong(_recorded())
    hit = hit_plan(maps, embedding=EMB)
    run_steps(ChorusAttention(hit, SparseConfig(top_p=0.9, k_min=1, block_size=BS, verify_threshold=0.0), INFO))
    assert hit.is_hit and hit.stats.sparse_calls == 6 and hit.stats.verification == {}
    hit = hit_plan(maps, embedding=EMB)
    cfg = SparseConfig(top_p=0.9, k_min=1, block_size=BS, verify_threshold=0.5, verify_layers=(7,))
    run_steps(ChorusAttention(hit, cfg, INFO))
    assert hit.is_hit and hit.stats.verification[0]["verdict"] == "no verdict"


@pytest.mark.parametrize("failure", ["raise", "nan"])
def test_a_failing_estimate_gives_no_verdict_never_an_exception(monkeypatch, failure):
    def broken(q, k, block_map, **kw):
        if failure == "raise":
            raise RuntimeError("kernel exploded")
        return torch.full((2, 1), float("nan"))

    monkeypatch.setattr("chorus.engine.verify.recall_terms", broken)
    hit = hit_plan(_wrong(_recorded()), embedding=EMB)
    run_steps(ChorusAttention(hit, VCFG, INFO))
    assert hit.is_hit and hit.stats.sparse_calls == 6 and hit.stats.fallback_calls == 0
    assert hit.stats.verification[0]["verdict"] == "no verdict"
    assert any("no verdict" in m for m in hit.stats.messages)
    assert hit.state.verify_recorder is None


def test_config_validation():
    for bad in (dict(verify_threshold=1.5), dict(verify_threshold=-0.1), dict(verify_threshold=float("nan")),
                dict(verify_threshold=True), dict(verify_layers=()), dict(verify_layers=(-1,)),
                dict(verify_layers=(0.5,)), dict(verify_heads=0), dict(verify_rows=0)):
        with pytest.raises(ValueError):
            SparseConfig(**bad)
    assert SparseConfig(verify_layers=[3, 1, 1]).verify_layers == (1, 3)
    # off by default (engine/config.py says why); the estimate's rows per block
    assert SparseConfig().verify_threshold == DEFAULT_VERIFY_THRESHOLD == 0.0
    assert SparseConfig().verify_rows == DEFAULT_VERIFY_ROWS == 64 and SUGGESTED_VERIFY_THRESHOLD == 0.95


def test_module_docstring_names_the_choice():
    assert "demotes the plan" in verify_mod.__doc__ and "Re-selecting" in verify_mod.__doc__


def test_best_is_the_top_blocks_map_and_bounds_the_recall():
    q, k, _ = qkv(7, batch=2)
    q = q * 3
    gen = torch.Generator().manual_seed(1)
    block_map = torch.rand(1, 2, QB, QB, generator=gen) > 0.5
    block_map[..., 0] = True
    terms = recall_terms(q, k, block_map, heads=None, sample_rows=None, block_size=BS, backend="reference")
    assert terms.shape == (2, 2)
    mass = kernels.block_mass(q, k, block_size=BS, backend="reference")          # [B, H, Qb, Kb]
    count = block_map.sum(-1)
    for h in range(2):
        want = []
        for b in range(2):
            for i in range(QB):
                want.append(float(mass[b, h, i].sort(descending=True).values[:int(count[0, h, i])].sum()))
        assert float(terms[1, h]) == pytest.approx(sum(want) / len(want), abs=1e-5)
        assert float(terms[0, h]) == pytest.approx(exact_recall(q, k, block_map, heads=[h]), abs=1e-5)
        assert float(terms[0, h]) <= float(terms[1, h]) + 1e-6
    assert fit_ratio(0.5, 0.0) == 1.0 and fit_ratio(0.45, 0.9) == pytest.approx(0.5)
    check = ExpertCheck(0, (0, 1), values={0: (0.9, 1.0), 1: (0.5, 1.0)})
    assert check.ratio == pytest.approx(0.7) and check.summary()["min_ratio"] == pytest.approx(0.5)


def test_near_uniform_attention_keeps_a_ratio_near_one_whatever_the_map():
    """Random weights (i.i.d. unit q/k, logits ~N(0, 1) as in a random Wan after its q/k norms): a sparse
    map keeps about its density of the mass (any absolute threshold fails it) but is as good as any map
    that sparse, so the fit ratio passes -- with the default rows per block; with 8 the in-sample best's
    noise bias alone pushes it below the suggested threshold."""
    g = torch.Generator().manual_seed(3)
    length, bs = 4096, 128
    q, k = (torch.randn(1, 4, length, 128, generator=g) for _ in range(2))
    nb = length // bs
    band = ((torch.arange(nb)[:, None] - torch.arange(nb)[None, :]).abs() <= 1)[None, None].expand(1, 4, nb, nb)
    recall, best = recall_terms(q, k, band, heads=None, sample_rows=DEFAULT_VERIFY_ROWS, block_size=bs).mean(-1).tolist()
    assert recall < 0.1  # the band keeps 3 of 32 blocks
    assert fit_ratio(recall, best) > SUGGESTED_VERIFY_THRESHOLD + 0.015
    recall, best = recall_terms(q, k, band, heads=None, sample_rows=8, block_size=bs).mean(-1).tolist()
    assert fit_ratio(recall, best) < SUGGESTED_VERIFY_THRESHOLD


# the quality harness's synthetic source (structured attention: positional + image content), small
SRC_GRID = (6, 8, 12)


@pytest.fixture(scope="module")
def source():
    from chorus.benchmarks.quality.source import SourceConfig, build_model

    cfg = SourceConfig(grid=SRC_GRID, heads=4, layers=2, step_sigmas=(0.9, 0.45), high_steps=2, patch=4)
    return build_model(cfg)


def _blocky_image(seed):
    return np.kron(np.random.default_rng(seed).random((6, 9, 3)), np.ones((16, 16, 1)))


def _source_run(handle, model, image, seed):
    from chorus.benchmarks.quality.source import Request, RequestAttention

    att = RequestAttention(model, Request("r", image, "a prompt", seed))
    handle.begin_run([0.9, 0.45, 0.0])
    for step, sigma in enumerate((0.9, 0.45)):
        for layer in range(2):
            q, k, v = att.qkv(0, step, layer)
            q = q * q.shape[-1] ** 0.5  # the source folds the softmax scale into q
            handle.self_attention(q, k, v, layer=layer, sigma=sigma, grid=SRC_GRID, dense_fn=sdpa)
    handle.end_run()


def _source_info(model):
    from chorus.engine.model_info import ModelInfo

    return ModelInfo("wan", "wan2.2-a14b-i2v", 2, 4, model.cfg.head_dim, 36, "fp-high")


def _source_record(model, image, seed, rows, verify_layers=(0, 1, 2, 3)):
    plan = Plan.miss("t", embedding=EMB, latent_shape=(16, 6, 16, 24))
    cfg = SparseConfig(block_size=16, sample_rows=rows, verify_layers=verify_layers)
    _source_run(ChorusAttention(plan, cfg, _source_info(model)), model, image, seed)
    return plan


def _source_hit(model, miss, masks, image, seed):
    from chorus.engine import build_signature

    meta = {"signature": build_signature(miss), **miss.state.entry_extras}  # what commit_plan writes
    hit = Plan("hit", entry_id=1, similarity=0.99, masks=masks, entry_meta=meta,
               latent_shape=(16, 6, 16, 24), embedding=EMB)
    cfg = SparseConfig(block_size=16, verify_threshold=SUGGESTED_VERIFY_THRESHOLD, verify_rows=8)  # 8 of 16 = 64 of 128
    _source_run(ChorusAttention(hit, cfg, _source_info(model)), model, image, seed)
    return hit


def test_structured_source_genuine_passes_permuted_is_caught_and_recording_noise_lowers_the_ratio(source):
    image = _blocky_image(0)
    near = image + np.random.default_rng(9).normal(0, 0.02, image.shape)  # a near-duplicate request
    miss = _source_record(source, image, 1, rows=None)                    # the entry, from exact mass
    genuine = _source_hit(source, miss, miss.recorder.block_maps(), near, 3)
    v = genuine.stats.verification[0]
    assert genuine.is_hit and v["verdict"] == "pass" and v["ratio"] >= SUGGESTED_VERIFY_THRESHOLD, v

    other = _source_record(source, _blocky_image(5), 2, rows=None).recorder.block_maps()
    gen = torch.Generator().manual_seed(0)
    keys = sorted(other)  # another request's maps, moved to another (step, layer) and shuffled across heads
    permuted = {key: other[keys[(i + 1) % len(keys)]][torch.randperm(4, generator=gen)] for i, key in enumerate(keys)}
    wrong = _source_hit(source, miss, permuted, near, 3)
    w = wrong.stats.verification[0]
    assert not wrong.is_hit and w["verdict"] == "fail" and w["ratio"] < v["ratio"] - 0.02, w
    assert wrong.recorder.complete  # the first expert failed: the request can write its own entry

    # the same genuine entry recorded from 1 sampled row per block of 16 (the recorder's default share, 8 of
    # 128): its verification anchors (exact mass where a hit checks) keep the genuine hit passing ...
    noisy = _source_record(source, image, 1, rows=1)
    anchored = _source_hit(source, noisy, noisy.recorder.block_maps(), near, 3)
    a = anchored.stats.verification[0]
    assert anchored.is_hit and a["verdict"] == "pass" and a["ratio"] == pytest.approx(v["ratio"], abs=1e-6), a
    # ... without them (anchor layers off the checked ones) the fitting map's ratio falls below the
    # threshold: the recording's row-sampling noise, not the request, would demote it
    plain = _source_record(source, image, 1, rows=1, verify_layers=(7,))
    coarse = _source_hit(source, plain, plain.recorder.block_maps(), near, 3)
    c = coarse.stats.verification[0]
    assert c["verdict"] == "fail" and c["ratio"] < v["ratio"] - 0.03, c


def test_entries_say_where_their_anchors_are_and_a_hit_without_them_says_so(source):
    image = _blocky_image(3)
    anchored = _source_record(source, image, 1, rows=1)
    assert anchored.state.entry_extras[verify_mod.ANCHORS_META_KEY] == {"layers": [0, 1, 2, 3], "heads": 4}
    exact = _source_record(source, image, 1, rows=None)  # exact everywhere: the anchors are too
    assert exact.state.entry_extras[verify_mod.ANCHORS_META_KEY] == {"layers": [0, 1, 2, 3], "heads": 4}
    note = "recorded without exact mass where this check looks"
    hit = _source_hit(source, anchored, anchored.recorder.block_maps(), image, 3)
    assert hit.is_hit and not any(note in m for m in hit.stats.messages), hit.stats.messages
    plain = _source_record(source, image, 1, rows=1, verify_layers=(7,))
    hit = _source_hit(source, plain, plain.recorder.block_maps(), image, 3)
    assert any(note in m for m in hit.stats.messages), hit.stats.messages
    assert verify_mod.anchors_cover({verify_mod.ANCHORS_META_KEY: {"layers": [0, 1], "heads": 4}}, (0, 1), 4)
    assert not verify_mod.anchors_cover({verify_mod.ANCHORS_META_KEY: {"layers": [0], "heads": 4}}, (0, 1), 4)
    assert not verify_mod.anchors_cover({verify_mod.ANCHORS_META_KEY: "junk"}, (0,), 4)
    assert not verify_mod.anchors_cover(None, (0,), 4)


def test_recorder_anchors_are_exact_where_a_hit_checks_and_sampled_elsewhere(source):
    """At the first step of each expert, on verify_layers x verify_heads, a sampled recording holds the
    maps an exact one selects; elsewhere (the second step here) it keeps its own sampled maps."""
    image = _blocky_image(2)
    exact = _source_record(source, image, 4, rows=None).recorder.block_maps()
    anchored = _source_record(source, image, 4, rows=1, verify_layers=(1,)).recorder.block_maps()
    plain = _source_record(source, image, 4, rows=1, verify_layers=(7,)).recorder.block_maps()
    heads = verify_head_index(4, SparseConfig().verify_heads)
    assert torch.equal(anchored[(0, 0, 1, 0)][heads], exact[(0, 0, 1, 0)][heads])   # the anchor
    assert not torch.equal(plain[(0, 0, 1, 0)], exact[(0, 0, 1, 0)])                # sampling noise shows
    for key in ((0, 0, 0, 0), (0, 1, 0, 0), (0, 1, 1, 0)):                         # not anchors: as sampled
        assert torch.equal(anchored[key], plain[key]), key


def test_default_config_runs_no_verification():
    """As documented (engine/config.py): off by default, so even a wrong entry stays a sparse hit."""
    hit = hit_plan(_wrong(_recorded()), embedding=EMB)
    run_steps(ChorusAttention(hit, SparseConfig(top_p=0.9, k_min=1, block_size=BS), INFO))
    assert hit.is_hit and hit.stats.sparse_calls == 6 and hit.stats.verification == {}
