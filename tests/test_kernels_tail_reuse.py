"""``benchmarks/kernels/tail_reuse.py --quick`` on the CPU: every family, head set, density and map variant is
measured and recorded (JSON); the request's own oracle map is at least as good as a reused one on average (it
is the top of the request's own block mass); the pooled tail does not make the own map's error worse on the
spread heads; a map reused from the request itself has no gap."""

from __future__ import annotations

import json
import math

import pytest
import torch

VARIANT_KEYS = ("own:no_tail", "own:tail", "reused:no_tail", "reused:tail")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("skimage")
    from chorus.benchmarks.kernels import tail_reuse

    out = tmp_path_factory.mktemp("tailreuse")
    assert tail_reuse.main(["--quick", "--out", str(out)]) == 0
    with open(out / "tail_reuse.json") as f:
        return json.load(f)


def rows_of(quick, head_set=None):
    return [(pair, name, row) for pair in quick["pairs"] for name, entry in pair["head_sets"].items()
            if head_set in (None, name) for row in entry["rows"]]


def test_structure_every_family_head_set_density_and_variant(quick):
    assert quick["command"].startswith("python -m benchmarks.kernels.tail_reuse ") and "--quick" in quick["command"]
    assert quick["tokens"] == math.prod(quick["grid"]) and quick["block_size"] == 128
    assert "fp64 oracle" in quick["numerics"]
    families = [pair["family"] for pair in quick["pairs"]]
    assert len(set(families)) >= 3 and set(quick["summary"]) == set(families)
    blocks = quick["eval_rows"]["num_query_blocks"]
    assert quick["eval_rows"]["query_blocks"][0] == 0 and quick["eval_rows"]["query_blocks"][-1] == blocks - 1
    for pair in quick["pairs"]:
        assert pair["query"] != pair["entry"] and pair["query_seed"] != pair["entry_seed"]
        assert -1.0 <= pair["similarity"] <= 1.0 + 1e-9
        if pair["family"] != "unrelated":  # a derived query reuses the entry it came from ("astronaut/noise")
            assert pair["pairing"] == "the entry it was derived from", pair
            assert pair["query"].split("/")[0] == pair["entry"] or pair["family"] == "template_subject", pair
        assert set(pair["head_sets"]) == {"spread", "sharp"}
        for entry in pair["head_sets"].values():
            assert [row["nominal_density"] for row in entry["rows"]] == quick["densities"] == [0.10, 0.25]
    for pair, name, row in rows_of(quick):
        assert set(row["errors"]) == set(VARIANT_KEYS)
        # own: the per-row count closest to the nominal density; reused: the same count, so within one block
        assert abs(row["own_density"] - row["nominal_density"]) <= 1.0 / blocks + 1e-9, row
        assert abs(row["reused_density"] - row["own_density"]) <= 1.0 / blocks + 1e-9, row
        e = row["errors"]
        assert row["gap_no_tail"] == pytest.approx(e["reused:no_tail"] - e["own:no_tail"], abs=1e-12)
        assert row["gap_tail"] == pytest.approx(e["reused:tail"] - e["own:tail"], abs=1e-12)
        if row["gap_ratio"] is not None:
            assert row["gap_no_tail"] >= quick["min_gap_for_a_ratio"]
            assert row["gap_ratio"] == pytest.approx(row["gap_tail"] / row["gap_no_tail"])


def test_errors_are_finite_and_positive(quick):
    for pair, name, row in rows_of(quick):
        for key in VARIANT_KEYS:
            assert math.isfinite(row["errors"][key]) and 0.0 < row["errors"][key] < 1.0, (pair["query"], name, key)
        assert 0.0 < row["reused_recall"] <= 1.0 + 1e-6 and 0.0 < row["own_recall"] <= 1.0 + 1e-6


def test_own_map_is_at_least_as_good_as_the_reused_map_on_average(quick):
    for pair in quick["pairs"]:
        rows = [row for entry in pair["head_sets"].values() for row in entry["rows"]]
        own = sum(r["errors"]["own:no_tail"] for r in rows) / len(rows)
        reused = sum(r["errors"]["reused:no_tail"] for r in rows) / len(rows)
        assert own <= reused + 0.005, (pair["query"], own, reused)
        # the own map is the top of the request's own mass: it keeps at least as much of it
        own_recall = sum(r["own_recall"] for r in rows) / len(rows)
        assert own_recall >= sum(r["reused_recall"] for r in rows) / len(rows) - 1e-6, pair["query"]


def test_tail_does_not_worsen_the_own_map_on_spread_heads(quick):
    for pair, _, row in rows_of(quick, "spread"):
        assert row["errors"]["own:tail"] <= row["errors"]["own:no_tail"] + 0.002, (pair["query"], row)


def test_a_map_reused_from_the_request_itself_has_no_gap():
    from chorus.benchmarks.kernels import tail_reuse

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 640, 128, generator=gen).to(torch.bfloat16) for _ in range(3))
    q = (q.float() * 0.2).to(torch.bfloat16)
    import chorus.kernels as K

    own_mass = K.block_mass(q, k, block_size=128, scale=1.0)
    entry = tail_reuse.head_set_rows((q, k, v), own_mass, [0.4], tail_reuse.evaluated_blocks(5, 3))
    row = entry["rows"][0]
    assert row["maps_identical_share"] == 1.0
    assert row["gap_no_tail"] == 0.0 and row["gap_tail"] == 0.0 and row["gap_ratio"] is None
    assert row["errors"]["own:tail"] != row["errors"]["own:no_tail"]  # the tail terms enter
    # another request's mass (reversed key blocks) gives another map and a real gap
    other = tail_reuse.head_set_rows((q, k, v), own_mass.flip(-1), [0.4], tail_reuse.evaluated_blocks(5, 3))
    assert other["rows"][0]["maps_identical_share"] < 1.0 and other["rows"][0]["gap_no_tail"] > 0.0


def test_gap_ratio_and_evaluated_blocks():
    from chorus.benchmarks.kernels import tail_reuse

    assert tail_reuse.gap_ratio(0.01, 0.02) == pytest.approx(0.5)
    assert tail_reuse.gap_ratio(0.01, tail_reuse.MIN_GAP / 2) is None and tail_reuse.gap_ratio(0.0, -0.01) is None
    assert tail_reuse.evaluated_blocks(60, 8).tolist()[0] == 0 and tail_reuse.evaluated_blocks(60, 8).tolist()[-1] == 59
    assert len(tail_reuse.evaluated_blocks(60, 8)) == 8 and tail_reuse.evaluated_blocks(5, 0).tolist() == list(range(5))
    assert tail_reuse.block_rows(torch.tensor([0, 2]), 300).tolist() == list(range(128)) + list(range(256, 300))
