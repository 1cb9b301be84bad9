"""The benchmark of record's code path (``benchmarks/comfy_e2e``) at toy sizes on the CPU, through
ComfyUI's real loader, sampler and the nodes' ``execute`` (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from host import tiny_wan as tiny  # tests/host (pytest pythonpath)

SKIP_REASON = tiny.import_comfy()
pytestmark = [pytest.mark.host, pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")]


def test_comfy_e2e_benchmark_runs_dense_miss_and_hit(tmp_path, monkeypatch):
    from chorus.benchmarks.comfy_e2e import run

    monkeypatch.setenv("COMFYUI_DIR", str(tiny.find_comfyui_dir()))
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "cache"))  # the benchmark sets its own; restored after
    assert run.main(["--tiny", "--out", str(tmp_path), "--variants", "dense", "miss", "hit15", "hitver",
                     "--hit-backends", "auto", "reference"]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "comfy_e2e.json").read_text())["runs"]}
    assert set(rows) == {"dense", "miss", "hit15", "hit15@reference", "hitver"}
    # --hit-backends: the same hit once more through ChorusSparseSampler's backend input
    assert rows["hit15@reference"]["backend"] == "reference" and rows["hit15@reference"]["plan_kind"] == "hit"
    assert rows["hit15@reference"]["sparse_calls"] == rows["hit15"]["sparse_calls"]
    assert rows["hit15@reference"]["fallback_calls"] == 0
    assert rows["miss"]["plan_kind"] == "miss" and rows["miss"]["write"].startswith("wrote entry")
    assert rows["hit15"]["plan_kind"] == "hit" and rows["hit15"]["sparse_calls"] > 0
    assert rows["hit15"]["fallback_calls"] == 0 and all(r["finite"] for r in rows.values())
    # the verified hit did its check at each expert's first step and stayed a hit
    assert rows["hitver"]["plan_kind"] == "hit" and rows["hitver"]["sparse_calls"] == rows["hit15"]["sparse_calls"]
    verdicts = [v["verdict"] for v in rows["hitver"]["verification"].values()]
    assert verdicts and all(v == "pass" for v in verdicts), rows["hitver"]["verification"]


def test_fp8_linears_benchmark_takes_comfyuis_fp8_path_without_graph_breaks(tmp_path):
    """``fp8_linears`` at toy sizes on the CPU: ComfyUI's ``fp8_ops.Linear`` runs its FP8 matmul
    (``fp8_linear`` returns a result, no logged fallback), compiles without a graph break, and its error
    is that of an e4m3 activation (unit roundoff 2**-4) while bf16's is within bf16's (2**-8)."""
    from chorus.benchmarks.comfy_e2e import fp8_linears

    assert fp8_linears.main(["--tiny", "--out", str(tmp_path), "--comfyui", str(tiny.find_comfyui_dir())]) == 0
    rows = json.loads((tmp_path / "fp8_linears.json").read_text())["rows"]
    assert {r["layer"] for r in rows} == {"bf16", "comfy_fp8"} and len(rows) == 2 * len(fp8_linears.TINY_SHAPES)
    for r in rows:
        assert r["graph_breaks"] == 0 and r["eager_ms"] > 0 and r["compiled_ms"] > 0, r
        if r["layer"] == "comfy_fp8":
            assert r["fp8_path"] and r["fp8_exceptions"] == 0, r
            assert 2 ** -8 < r["rel_err"] <= 2 ** -4, r  # an FP8 activation, not a silent bf16 fallback
        else:
            assert r["rel_err"] <= 2 ** -8, r


def test_compiled_only_runs_the_compiled_rows_beside_compiled_dense(tmp_path, monkeypatch):
    """``--compile --compiled-only``: dense and a miss under ComfyUI's ``TorchCompileModel`` and no eager row; the
    compiled miss runs as a miss (a fresh workspace of its own) with no eager miss before it."""
    from chorus.benchmarks.comfy_e2e import run

    monkeypatch.setenv("COMFYUI_DIR", str(tiny.find_comfyui_dir()))
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(SystemExit):
        run.main(["--tiny", "--out", str(tmp_path), "--compiled-only"])  # needs --compile
    assert run.main(["--tiny", "--out", str(tmp_path), "--variants", "dense", "miss", "--compile",
                     "--compiled-only"]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "comfy_e2e.json").read_text())["runs"]}
    assert set(rows) == {"dense+compile", "miss+compile"}, sorted(rows)
    assert rows["miss+compile"]["plan_kind"] == "miss" and all(r["finite"] for r in rows.values())
    assert rows["miss+compile"]["first_request_s"] > 0 and rows["miss+compile"]["dynamo"]["unique_graphs"] >= 1


def test_compiled_hit_without_the_tail_runs_its_own_compiled_row(tmp_path, monkeypatch):
    """``--compile --compiled-only`` with ``hit15`` and ``hit15_notail``: the eager miss that writes the entry, then
    both hits under ``TorchCompileModel``, the first with the pooled tail on every sparse call, the second with it off
    on every one (the node's option reaches the compiled calls)."""
    from chorus.benchmarks.comfy_e2e import run

    monkeypatch.setenv("COMFYUI_DIR", str(tiny.find_comfyui_dir()))
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "cache"))
    assert run.main(["--tiny", "--out", str(tmp_path), "--variants", "hit15", "hit15_notail", "--compile",
                     "--compiled-only"]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "comfy_e2e.json").read_text())["runs"]}
    assert set(rows) == {"miss", "hit15+compile", "hit15_notail+compile"}, sorted(rows)
    tail, no_tail = rows["hit15+compile"], rows["hit15_notail+compile"]
    assert tail["plan_kind"] == no_tail["plan_kind"] == "hit"
    assert tail["sparse_calls"] > 0 and no_tail["sparse_calls"] > 0
    assert tail["tail_calls"] == tail["sparse_calls"] and no_tail["tail_calls"] == 0, (tail, no_tail)


def test_profile_counts_the_hit_s_attention_calls_and_puts_their_kernels_beside_the_per_call_time(tmp_path,
                                                                                                  monkeypatch):
    """``--profile``: one more step of each row under ``torch.profiler``, whose ``chorus::attend`` events (the hit's
    sparse attention: one per layer of the profiled step) are recorded; a call's kernels' GPU time goes beside the
    row's per-call median in the table. On the CPU no call runs a kernel: events, no calls, no per-call time."""
    from chorus.benchmarks.comfy_e2e import run

    monkeypatch.setenv("COMFYUI_DIR", str(tiny.find_comfyui_dir()))
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "cache"))
    assert run.main(["--tiny", "--out", str(tmp_path), "--variants", "hit15", "--profile"]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "comfy_e2e.json").read_text())["runs"]}
    hit, miss = rows["hit15"], rows["miss"]
    assert hit["profile_step0"]["ops"]["chorus::attend"] == [0.0, 0, hit["sparse_calls"] // 4]  # one step of four
    assert hit["attn_kernels_ms_per_call"] is None
    assert "chorus::attend" not in miss["profile_step0"]["ops"]  # a miss answers densely: no sparse call
    hit = dict(hit, attn_ms_per_layer=2.5, attn_ms_median=2.0, attn_kernels_ms_per_call=1.5)
    assert "| 2.50 (median 2.00, its kernels 1.50) |" in run.table({"runs": [hit]})
    assert run.attention_kernels_ms({"ops": {"chorus::attend": [46.0, 40, 80]}}) == pytest.approx(1.15)
    assert run.attention_kernels_ms(None) is None and run.attention_kernels_ms({"ops": {}}) is None


class _Event:
    """A profiler event as :func:`chorus_op_times` reads one: name, enclosing CPU event, GPU time (us) inside."""

    def __init__(self, name, parent=None, device_us=0.0):
        self.name, self.cpu_parent, self.device_time_total = name, parent, device_us


def test_an_attention_call_counts_once_and_a_traced_one_not_at_all():
    """A call whose implementation dispatches the op again is one call (its kernels counted once, through the
    outer event); dynamo tracing the op (no kernel) adds an event and no call."""
    from chorus.benchmarks.comfy_e2e import run

    region = _Event("Torch-Compiled Region")
    outer = _Event("chorus::attend", region, 1500.0)
    inner = _Event("chorus::attend", _Event("PythonDispatchMode", outer), 1400.0)
    plain = _Event("chorus::attend", region, 1700.0)
    traced = _Event("chorus::attend", _Event("bytecode_tracing"), 0.0)
    other = _Event("aten::mm", region, 900.0)
    ops = run.chorus_op_times([outer, inner, plain, traced, other, _Event("chorus::record_mass", None, 300.0)])
    assert ops == {"chorus::attend": [3.2, 2, 4], "chorus::record_mass": [0.3, 1, 1]}
    assert run.attention_kernels_ms({"ops": ops}) == pytest.approx(1.6)
