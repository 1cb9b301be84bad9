"""benchmarks/quality/verify.py at quick sizes (CPU): it runs, writes its files, and the sampled-row
estimate and the fit ratio the verdict uses stay within 0.02 of the true ones."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("skimage")


def test_quick_run_writes_results_and_the_estimate_is_accurate(tmp_path):
    from chorus.benchmarks.quality import verify

    assert verify.main(["--out", str(tmp_path), "--quick"]) == 0
    res = json.loads((tmp_path / "verify.json").read_text())
    assert res["errors"]["per_expert_max"] <= 0.02
    assert res["errors"]["ratio_max"] <= 0.02 and res["errors"]["n_experts"] > 0
    assert "fit ratio threshold" in (tmp_path / "verify.md").read_text()
    kinds = {c["kind"] for s in res["sources"] for c in s["cases"]}
    assert kinds == {"genuine", "permuted", "other_family"}
    assert "synthetic structured source" in (tmp_path / "verify.md").read_text()
