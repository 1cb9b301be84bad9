"""The benchmark of record's code path (``benchmarks/comfy_e2e``) at toy sizes on the CPU, through
ComfyUI's real loader, sampler and the nodes' ``execute`` (no timing is asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from host import tiny_wan as tiny  # tests/host (pytest pythonpath)

SKIP_REASON = tiny.import_comfy()
pytestmark = [pytest.mark.host, pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")]


def tiny_run(tmp_path, monkeypatch, *args: str) -> dict:
    """``run.main(["--tiny", "--out", tmp_path, *args])`` on the test's ComfyUI with the cache under ``tmp_path``
    (the benchmark sets its own ``CHORUS_CACHE_DIR``; monkeypatch restores it after): asserts the run exits 0 and
    returns its ``comfy_e2e.json``."""
    from chorus.benchmarks.comfy_e2e import run

    monkeypatch.setenv("COMFYUI_DIR", str(tiny.find_comfyui_dir()))
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "cache"))
    assert run.main(["--tiny", "--out", str(tmp_path), *args]) == 0
    return json.loads((tmp_path / "comfy_e2e.json").read_text())


def variant_rows(results: dict) -> dict:
    """A run's rows by variant."""
    return {r["variant"]: r for r in results["runs"]}


def test_comfy_e2e_benchmark_runs_dense_miss_and_hit(tmp_path, monkeypatch):
    rows = variant_rows(tiny_run(tmp_path, monkeypatch, "--variants", "dense", "miss", "hit15", "hitver",
                                 "--hit-backends", "auto", "reference"))
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


def test_the_fp8_scaled_rows_load_the_shipped_files_layout_through_comfyuis_loader(tmp_path, monkeypatch):
    """``--weights fp8_scaled``: experts in the layout of the FP8-scaled files the shipped workflows name, loaded
    by ComfyUI as UNETLoader loads them (its scaled FP8 operations), run dense, miss and hit."""
    results = tiny_run(tmp_path, monkeypatch, "--weights", "fp8_scaled", "--variants", "dense", "miss", "hit15")
    rows = variant_rows(results)
    assert set(rows) == {"dense", "miss", "hit15"} and all(r["weights"] == "fp8_scaled" for r in rows.values())
    ops = results["ops"]["fp8_scaled"]  # 0.3.64: scaled_fp8_ops' Linear on e4m3 weights; later: QuantizedTensor
    assert ("scaled_fp8" in ops and "float8_e4m3fn" in ops) or "QuantizedTensor" in ops, ops
    assert rows["miss"]["write"].startswith("wrote entry") and rows["hit15"]["plan_kind"] == "hit"
    assert rows["hit15"]["sparse_calls"] > 0 and rows["hit15"]["fallback_calls"] == 0
    assert all(r["finite"] for r in rows.values())


def test_the_fp16_rows_run_the_dtype_comfyui_computes_wan_in(tmp_path, monkeypatch):
    """``--weights fp16`` (what ComfyUI's loader picks for Wan on a GPU, from an fp16 or bf16 file): the experts
    compute in fp16 (on the CPU too, at toy sizes), and dense, miss, hit and feature reuse run on them."""
    results = tiny_run(tmp_path, monkeypatch, "--weights", "fp16", "--variants", "dense", "miss", "hit15", "hitfr",
                       "--fr-share", "1.0")
    rows = variant_rows(results)
    assert set(rows) == {"dense", "miss", "hit15", "hitfr"} and "torch.float16" in results["ops"]["fp16"]
    assert rows["miss"]["write"].startswith("wrote entry")
    for name in ("hit15", "hitfr"):
        assert rows[name]["plan_kind"] == "hit" and rows[name]["sparse_calls"] > 0, rows[name]
        assert rows[name]["fallback_calls"] == 0, rows[name]["messages"]
    assert rows["hitfr"]["fr_blocks_reduced"] > 0
    assert all(r["finite"] for r in rows.values())


def test_a_compiled_fp8_scaled_hit_with_feature_reuse_compiles_nothing_in_its_second_request(tmp_path, monkeypatch):
    """The shipped feature-reuse workflow's models as users load them (FP8-scaled files) under ComfyUI's
    ``TorchCompileModel``: the hit runs every call sparse and its timed request compiles nothing (ComfyUI's scaled
    FP8 linears recompile per input shape, all in the first request)."""
    rows = variant_rows(tiny_run(tmp_path, monkeypatch, "--weights", "fp8_scaled", "--variants", "hitfr", "--compile",
                                 "--compiled-only"))
    row = rows["hitfr+compile"]
    assert row["plan_kind"] == "hit" and row["sparse_calls"] > 0 and row["fallback_calls"] == 0 and row["finite"]
    assert row["unsteady_requests"] == [] and row["timed_request_frames_compiled"] == 0, row


def test_comfy_e2e_benchmark_runs_the_ti2v_5b_workflow(tmp_path, monkeypatch):
    """``--model ti2v5b``: one Wan 2.2 TI2V 5B-shaped model (48 latent channels, the start image in the latent's
    first frame with its noise mask) through one uni_pc request at cfg 5 (20 steps; ``--tiny``, on the CPU, 4 of
    them); the miss records every step and the hit runs each of them sparse."""
    from chorus.benchmarks.comfy_e2e import run

    results = tiny_run(tmp_path, monkeypatch, "--model", "ti2v5b", "--variants", "dense", "dense_rowmajor", "miss",
                       "hit15")
    assert results["workflow"] == run.WORKFLOWS["ti2v5b"].label
    assert results["shape"]["in_dim"] == results["shape"]["out_dim"] == 48
    rows = variant_rows(results)
    assert set(rows) == {"dense", "dense_rowmajor", "miss", "hit15"} and all(r["finite"] for r in rows.values())
    assert all(len(r["comfy_loading"]) == 1 for r in rows.values())  # one model, no second expert
    assert rows["miss"]["plan_kind"] == "miss" and rows["miss"]["write"].startswith("wrote entry")
    hit = rows["hit15"]
    steps, layers = results["steps"], results["shape"]["num_layers"]
    assert steps == run.TINY_MAX_STEPS < run.WORKFLOWS["ti2v5b"].steps
    assert hit["plan_kind"] == "hit" and hit["fallback_calls"] == 0
    assert hit["sparse_calls"] >= steps * layers and hit["tail_calls"] == hit["sparse_calls"], hit


def test_comfy_e2e_benchmark_runs_a_first_last_frame_request(tmp_path, monkeypatch, capsys):
    """``--end-image``: conditioned as WanFirstLastFrameToVideo, the miss's entry records image frames [1, 1, 0]
    and the hit (on that signature) runs every call sparse, demoted by nothing; a model that takes its image in the
    latent (TI2V 5B) is refused."""
    from chorus.benchmarks.comfy_e2e import run

    results = tiny_run(tmp_path, monkeypatch, "--variants", "dense", "miss", "hit15", "--end-image")
    assert "an end image (WanFirstLastFrameToVideo)" in results["workflow"]
    rows = variant_rows(results)
    hit = rows["hit15"]
    assert hit["plan_kind"] == "hit" and hit["sparse_calls"] > 0 and hit["fallback_calls"] == 0, hit
    assert not any("demoted" in m for m in hit["messages"]), hit["messages"]
    assert rows["miss"]["image_frames"] == hit["image_frames"] == [1, 1, 0]  # what the miss recorded, the hit read
    with pytest.raises(SystemExit) as refused:
        run.main(["--model", "ti2v5b", "--tiny", "--end-image", "--out", str(tmp_path)])
    assert refused.value.code == 2 and "--end-image needs a Wan I2V model" in capsys.readouterr().err


def test_the_row_major_block_patch_hands_the_block_a_row_major_copy():
    from chorus.benchmarks.comfy_e2e import host_attention

    x = torch.randn(2, 8, 5).transpose(1, 2)  # the patch embedding's transposed view, [B, L, C]
    seen = []
    out = host_attention.row_major_block({"img": x, "vec": None},
                                         {"original_block": lambda a: seen.append(a["img"]) or {"img": 1}})
    assert out == {"img": 1} and seen[0].is_contiguous() and torch.equal(seen[0], x)
    host_attention.row_major_block({"img": seen[0]}, {"original_block": lambda a: seen.append(a["img"])})
    assert seen[1] is seen[0]  # a row-major input is handed on as it is


def test_the_benchmark_refuses_a_resolution_its_model_does_not_run(tmp_path, capsys):
    from chorus.benchmarks.comfy_e2e import run

    with pytest.raises(SystemExit) as refused:
        run.main(["--model", "ti2v5b", "--res", "480p", "--out", str(tmp_path)])
    assert refused.value.code == 2 and "--model ti2v5b runs at 720p, tiny; got 480p" in capsys.readouterr().err


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


def test_compiled_only_runs_the_compiled_rows_beside_compiled_dense(tmp_path, monkeypatch, capsys):
    """``--compile --compiled-only``: dense and a miss under ComfyUI's ``TorchCompileModel`` and no eager row; the
    compiled miss runs as a miss (a fresh workspace of its own) with no eager miss before it."""
    from chorus.benchmarks.comfy_e2e import report, run

    with pytest.raises(SystemExit) as refused:
        run.main(["--tiny", "--out", str(tmp_path), "--compiled-only"])
    assert refused.value.code == 2 and "--compiled-only needs --compile" in capsys.readouterr().err
    rows = variant_rows(tiny_run(tmp_path, monkeypatch, "--variants", "dense", "miss", "--compile", "--compiled-only"))
    assert set(rows) == {"dense+compile", "miss+compile"}, sorted(rows)
    assert rows["miss+compile"]["plan_kind"] == "miss" and all(r["finite"] for r in rows.values())
    assert rows["miss+compile"]["first_request_s"] > 0 and rows["miss+compile"]["dynamo"]["unique_graphs"] >= 1
    for row in rows.values():
        # what compiling took in the first request: part of it; dynamo's holds the backend's
        spent = row["first_request_compile"]
        assert 0 < spent["backend_s"] <= spent["dynamo_s"] <= row["first_request_s"], row
        assert spent["triton_builds"] == 0 and spent["triton_build_s_by_kernel"] == {}, spent  # CPU: inductor's C++
        # both experts loaded whole (the CPU has room); each recompile with its reason (on the CPU ComfyUI's
        # sub-quadratic attention breaks the graph, and the frames after a break recompile per shape)
        assert [e["partial"] for e in row["comfy_loading"]] == [False, False], row["comfy_loading"]
        assert all(0 < e["loaded_gib"] <= e["size_gib"] for e in row["comfy_loading"]), row["comfy_loading"]
        reasons = row["dynamo"]["recompile_reasons"]
        assert len(reasons) == min(row["dynamo"]["recompiles"], 4), row["dynamo"]
        assert all(r.startswith("Recompiling function") and " - " in r for r in reasons), reasons
    row = dict(rows["dense+compile"], first_request_s=76.74, first_request_compile=dict(spent, dynamo_s=62.31,
                                                                                          triton_build_s=5.66))
    row["dynamo"] = dict(row["dynamo"], recompiles=0)
    assert "| dense+compile | " in report.table({"runs": [row]})
    assert "| 76.7 (compile 62.3, Triton builds 5.7) |" in report.table({"runs": [row]})
    row["comfy_loading"][1] = dict(row["comfy_loading"][1], partial=True)
    row["dynamo"] = dict(row["dynamo"], recompiles=2)
    assert "| dense+compile (experts loaded partially) (2 recompiles) | " in report.table({"runs": [row]})


def test_a_compiled_row_times_a_request_that_compiles_nothing(tmp_path, monkeypatch):
    """A compiled row's timed request is one in which dynamo compiled nothing: where the second request compiles
    again (on a GPU, ComfyUI's loading can change what the graph guards between requests), the row runs a further
    request and times that one, recording the one that compiled (``unsteady_requests``). Here dynamo's caches are
    emptied before the second request's models compile, so it really recompiles every frame; the third does not."""
    import torch

    from chorus.benchmarks.comfy_e2e import report, run

    compile_model, calls = run.torch_compile_model, []

    def compile_and_forget_before_the_second_request(model, guard_filter=False):
        calls.append(model)
        if len(calls) == 3:  # the second request's first expert: requests 1 and 2 have two experts each
            torch._dynamo.reset()
        return compile_model(model, guard_filter)

    monkeypatch.setattr(run, "torch_compile_model", compile_and_forget_before_the_second_request)
    results = tiny_run(tmp_path, monkeypatch, "--variants", "dense", "--compile", "--compiled-only")
    row = variant_rows(results)["dense+compile"]
    assert len(calls) == 6, len(calls)  # three requests of two experts
    assert len(row["unsteady_requests"]) == 1 and row["unsteady_requests"][0]["frames_compiled"] > 0, row
    assert row["timed_request_frames_compiled"] == 0 and row["finite"], row
    line = next(x for x in report.table(results).splitlines() if "| dense+compile" in x)
    before = row["unsteady_requests"][0]["seconds"]
    assert f"(timed: request 3, the first that compiled nothing; before it {before:.2f} s)" in line, line
    assert line.split(" | ")[4] == "1.00x", line
    # had every try compiled, the row would time the compiler: the table gives no ratio to it
    recompiling = dict(row, timed_request_frames_compiled=5, variant="dense+compile")
    hit = dict(row, variant="hit15+compile", seconds=row["seconds"] / 3, timed_request_frames_compiled=0)
    lines = report.table({"runs": [recompiling, hit]}).splitlines()
    assert "(the timed request compiled 5 frames)" in lines[2] and lines[3].split(" | ")[4] == "-", lines
    assert report.table({"runs": [row, hit]}).splitlines()[3].split(" | ")[4] == "3.00x"


def test_recompile_log_keeps_each_recompile_s_guard_failure_and_leaves_torch_logging_as_it_was(monkeypatch):
    """``RecompileLog`` (a compiled row's ``dynamo.recompile_reasons``): a function compiled for float32 and called
    with float64 recompiles once, and the reason names the guard that failed; afterwards the ``recompiles`` artifact
    is off again and no handler is left behind."""
    import logging

    from chorus.benchmarks.comfy_e2e import compiling

    monkeypatch.delenv("TORCH_LOGS", raising=False)
    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2, backend="eager")
    with compiling.RecompileLog() as log:
        double(torch.ones(3))
        double(torch.ones(3, dtype=torch.float64))
        double(torch.ones(3, dtype=torch.float64))
    assert len(log.reasons) == 1 and "dtype mismatch" in log.reasons[0], log.reasons
    (reason,) = log.summary()
    assert reason.startswith("Recompiling function") and "expected Float, actual Double" in reason, reason
    assert log not in logging.getLogger(compiling.RecompileLog.LOGGER).handlers
    torch._dynamo.reset()
    double(torch.ones(3))
    with compiling.RecompileLog() as quiet:
        pass
    double(torch.ones(3, dtype=torch.float64))  # a recompile after the window: not logged anywhere it would count
    assert quiet.reasons == []


def test_compile_log_names_each_triton_build_and_tells_a_build_from_a_cache_hit(tmp_path, monkeypatch):
    """``CompileLog`` (a compiled row's ``first_request_compile``): a Triton build of one of the pack's kernels (for
    sm_90, no GPU needed) is counted under the kernel's name with its time, the same build again is a disk-cache hit,
    dynamo's compile time is counted, and Triton's listener is given back afterwards."""
    import triton
    from aot_check import compile_jit  # tests/ (pytest pythonpath)

    from chorus.benchmarks.comfy_e2e import compiling
    from chorus.kernels.triton._quant import _v_stats_kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    before = triton.knobs.compilation.listener
    with compiling.CompileLog() as log:
        for _ in range(2):
            compile_jit(_v_stats_kernel, {"V": "*bf16", "v_part": "*fp32"}, dict(HEAD_DIM=128, TILE=128, CHUNK=2048))
        torch._dynamo.reset()
        assert torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3)).sum() == 9
    spent = log.summary()
    assert spent["triton_builds"] == 1 and spent["triton_cache_hits"] == 1, spent
    assert list(spent["triton_build_s_by_kernel"]) == ["_v_stats_kernel"] and spent["triton_build_s"] > 0, spent
    built, cached = spent["triton_builds_detail"]  # the specialisation each was built for
    assert not built["cache_hit"] and cached["cache_hit"] and built["constants"] == cached["constants"]
    assert built["constants"]["CHUNK"] == "2048" and built["signature"]["V"] == "*bf16", built
    assert spent["dynamo_s"] > 0 and 0 <= spent["backend_s"] <= spent["dynamo_s"], spent
    assert triton.knobs.compilation.listener is before


def test_compile_log_records_an_event_it_cannot_read_instead_of_failing_the_build():
    """The listener runs inside Triton's compile: an event of another shape (a Triton whose listener passes other
    keywords, a source without the fields read) is recorded with its error, never raised into the build."""
    from chorus.benchmarks.comfy_e2e import compiling

    with compiling.CompileLog() as log:
        log._on_build(src=None, metadata={"name": "k"}, metadata_group={}, times=None, cache_hit=False)
        log._on_build(cache_hit=True, fn_name="from another Triton")
    first, second = log.summary()["triton_builds_detail"]
    assert first["kernel"] == second["kernel"] == "?" and "AttributeError" in first["error"], first
    assert second["cache_hit"] and "TypeError" in second["error"], second


def test_compiled_hit_without_the_tail_runs_its_own_compiled_row(tmp_path, monkeypatch):
    """``--compile --compiled-only`` with ``hit15`` and ``hit15_notail``: the eager miss that writes the entry, then
    both hits under ``TorchCompileModel``, the first with the pooled tail on every sparse call, the second with it off
    on every one (the node's option reaches the compiled calls)."""
    rows = variant_rows(tiny_run(tmp_path, monkeypatch, "--variants", "hit15", "hit15_notail", "--compile",
                                 "--compiled-only"))
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
    from chorus.benchmarks.comfy_e2e import profiling, report

    rows = variant_rows(tiny_run(tmp_path, monkeypatch, "--variants", "hit15", "--profile"))
    hit, miss = rows["hit15"], rows["miss"]
    assert hit["profile_step0"]["ops"]["chorus::attend"] == [0.0, 0, hit["sparse_calls"] // 4]  # one step of four
    assert hit["attn_kernels_ms_per_call"] is None
    assert "chorus::attend" not in miss["profile_step0"]["ops"]  # a miss answers densely: no sparse call
    hit = dict(hit, attn_ms_per_layer=2.5, attn_ms_median=2.0, attn_kernels_ms_per_call=1.5)
    assert "| 2.50 (median 2.00, its kernels 1.50) |" in report.table({"runs": [hit]})
    assert profiling.attention_kernels_ms({"ops": {"chorus::attend": [46.0, 40, 80]}}) == pytest.approx(1.15)
    assert profiling.attention_kernels_ms(None) is None and profiling.attention_kernels_ms({"ops": {}}) is None


def test_a_compiled_row_s_dynamo_counts_its_requests_and_its_profiled_step_counts_its_own(tmp_path, monkeypatch):
    """With ``--profile`` a compiled row's ``dynamo`` is counted before its profiled step: a one-step request has
    a shorter sigma schedule, which dynamo guards, so what that step compiles is the row's
    ``profile_step_frames_compiled``, not a recompile of the row's requests. Together they are every frame the
    process compiled since the row cleared dynamo's counters."""
    from torch._dynamo.utils import counters

    rows = variant_rows(tiny_run(tmp_path, monkeypatch, "--variants", "hit15", "--compile", "--compiled-only",
                                 "--guard-filter", "--profile"))
    row = rows["hit15+compile"]
    assert row["plan_kind"] == "hit" and row["timed_request_frames_compiled"] == 0, row
    assert row["profile_step0"]["ops"]["chorus::attend"][2] > 0, row["profile_step0"]["ops"]
    profiled = row["profile_step_frames_compiled"]
    assert profiled > 0 and row["dynamo"]["frames"]["total"] + profiled == counters["frames"]["total"], \
        (row["dynamo"], profiled, dict(counters["frames"]))
    assert "profile_step_frames_compiled" not in rows["miss"]  # an eager row's profiled step compiles nothing


def test_the_table_puts_each_hit_s_own_kernel_alone_beside_its_per_call_time():
    """A hit row's "alone" is the kernel it ran, timed by itself: ``auto``'s for the plain row, the named backend's
    for a ``--hit-backends`` row (whose ``kernel_alone_ms`` also holds nothing of ``auto``); where the row also timed
    it between a block's GEMMs, that time follows."""
    from chorus.benchmarks.comfy_e2e import report

    base = {"weights": "fp16", "res": "720p", "seconds": 16.0, "attn_ms_per_layer": 24.5, "density": 0.15,
            "gpu": {"available": False}}
    plain = dict(base, variant="hit15", kernel_alone_ms={"backend": "triton_fp8_ws", "auto": 21.75,
                                                         "auto_no_tail": 20.28})
    named = dict(base, variant="hit15@triton_int8_ws", backend="triton_int8_ws", attn_ms_per_layer=36.6,
                 kernel_alone_ms={"backend": "triton_int8_ws", "triton_int8_ws": 30.96,
                                  "triton_int8_ws_no_tail": 29.63})
    lines = report.table({"runs": [plain, named]}).splitlines()
    assert "| 24.50 (alone 21.75) |" in lines[2] and "| 36.60 (alone 30.96) |" in lines[3], lines
    assert "alone" not in report.table({"runs": [dict(base, variant="hit15")]})
    loaded = dict(plain, kernel_alone_ms=dict(plain["kernel_alone_ms"], auto_under_load=23.9))
    assert "| 24.50 (alone 21.75, between GEMMs 23.90) |" in report.table({"runs": [loaded]})


class _Raw:
    """A raw profiler event as :func:`chorus_op_times` reads one (kineto's): name, device, host or GPU interval
    (ns), correlation id and the op id a host-side runtime event is linked to (0 for an op)."""

    def __init__(self, name, start, end, correlation=0, linked=0, device="cpu"):
        self._values = name, start, end, correlation, linked
        self._device = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU

    def name(self):
        return self._values[0]

    def start_ns(self):
        return self._values[1]

    def duration_ns(self):
        return self._values[2] - self._values[1]

    def correlation_id(self):
        return self._values[3]

    def linked_correlation_id(self):
        return self._values[4]

    def device_type(self):
        return self._device


def _launch(correlation, at, kernel_ms, name="k", linked=7):
    """A kernel of ``kernel_ms`` launched at host time ``at``: its runtime event (linked to op ``linked``, as the
    profiler links it, rightly or not) and its GPU event."""
    return [_Raw("cudaLaunchKernel", at, at + 5, correlation, linked),
            _Raw(name, 10_000_000 + at, 10_000_000 + at + int(kernel_ms * 1e6), correlation, linked, "cuda")]


def test_a_call_s_kernels_are_those_launched_inside_it_counted_once_and_a_traced_call_not_at_all():
    """Device work belongs to the outermost ``chorus::`` call whose host interval holds its launch: a call whose
    implementation dispatches the op again is one call; a GEMM launched between calls is not a call's, whatever
    op id the profiler links it to; dynamo tracing the op (nothing launched) adds an event and no call; a kernel
    whose launch is not in the profile is no one's."""
    from chorus.benchmarks.comfy_e2e import profiling

    events = [
        _Raw("chorus::attend", 0, 100_000, 7),  # a call ...
        _Raw("chorus::attend", 10_000, 90_000, 8),  # ... dispatching the op again
        *_launch(1, 20_000, 1.5, linked=8), *_launch(2, 95_000, 0.5, "Memcpy HtoD"),
        *_launch(3, 150_000, 30.0, "nvjet_gemm", linked=7),  # between calls, linked to the call before
        _Raw("chorus::attend", 200_000, 300_000, 9), *_launch(4, 250_000, 1.7, linked=9),
        _Raw("chorus::attend", 400_000, 450_000, 10),  # traced with fake tensors
        _Raw("aten::mm", 460_000, 470_000, 11), *_launch(5, 465_000, 9.0, "nvjet_gemm", linked=11),
        _Raw("chorus::record_mass", 500_000, 600_000, 12), *_launch(6, 550_000, 0.3, linked=12),
        _Raw("orphan", 0, 2_000_000, 99, 0, "cuda"),
    ]
    ops = profiling.chorus_op_times(events)
    assert ops == {"chorus::attend": [3.7, 2, 4], "chorus::record_mass": [0.3, 1, 1]}
    assert profiling.attention_kernels_ms({"ops": ops}) == pytest.approx(1.85)


def test_a_profile_whose_raw_events_cannot_be_read_keeps_its_kernel_table(monkeypatch):
    """Where this torch's raw profiler events lack an accessor :func:`chorus_op_times` reads, the profiled step
    keeps its totals and kernel table and says why its per-op times are missing (no lost benchmark row)."""
    from chorus.benchmarks.comfy_e2e import profiling

    def unreadable(events):
        raise AttributeError("'_KinetoEvent' object has no attribute 'duration_ns'")

    monkeypatch.setattr(profiling, "chorus_op_times", unreadable)
    profile = profiling.profile_step(lambda: torch.ones(64).sum())
    assert profile["ops"] == {} and "duration_ns" in profile["ops_error"]
    assert set(profile) == {"gpu_ms_total", "kernels", "ops", "ops_error"}
    assert profiling.attention_kernels_ms(profile) is None


def test_the_benchmark_compiles_through_the_host_s_own_node_in_either_signature(monkeypatch, capsys):
    """``torch_compile_model`` drives the host's ``TorchCompileModel``: 0.3.64's ``execute(model, backend)``
    (a clone carrying ComfyUI's compile wrapper, no compile options; 0.28.2 and 0.33.0's the same signature,
    always with their guard filter), and 0.38.x's ``execute(model, backend, mode)`` with the mode left empty,
    as a graph that leaves the node's default does; ``guard_filter`` on a host that compiles without options:
    the host's compile wrapper with later ComfyUI's guard filter."""
    import comfy_extras.nodes_torch_compile as host_node

    from chorus.benchmarks.comfy_e2e import compiling, run

    model = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0))
    compiled = compiling.torch_compile_model(model)
    assert compiled is not model and compiled.model_options["torch_compile_kwargs"]["backend"] == "inductor"
    if not compiling.host_compiles_with_guard_filter(compiled):  # 0.3.64: no filter unless --guard-filter asks for it
        assert compiled.model_options["torch_compile_kwargs"]["options"] is None
        compile_calls, torch_compile = [], torch.compile

        def recording_compile(model, **kwargs):
            compile_calls.append(dict(kwargs, options=dict(kwargs["options"] or {})))  # torch.compile pops from it
            return torch_compile(model, **kwargs)

        monkeypatch.setattr(torch, "compile", recording_compile)
        filtered = compiling.torch_compile_model(model, guard_filter=True)
        assert filtered is not model and filtered.model_options["torch_compile_kwargs"]["backend"] == "inductor"
        assert "torch_compile_kwargs" not in model.model_options
        kwargs = compile_calls[-1]  # after the host node's own compile (no options): the host's wrapper, filtered
        assert len(compile_calls) == 2 and compile_calls[0]["options"] == {}
        names = ["L['kwargs']['transformer_options']['patches']", "L['x'].size()[2]"]
        entries = [type("Guard", (), {"name": n})() for n in names]
        assert kwargs["backend"] == "inductor" and kwargs["options"]["guard_filter_fn"](entries) == [False, True]
    with pytest.raises(SystemExit) as refused:
        run.main(["--tiny", "--out", "unused", "--guard-filter"])
    assert refused.value.code == 2 and "--guard-filter needs --compile" in capsys.readouterr().err

    calls = []

    class LaterTorchCompileModel:
        @classmethod
        def execute(cls, model, backend, mode):
            calls.append((model, backend, mode))
            compiled = model.clone()
            compiled.model_options["torch_compile_kwargs"] = {"backend": backend, "options": {}}  # its filter, popped
            return type("Output", (), {"result": (compiled,)})()

    monkeypatch.setattr(host_node, "TorchCompileModel", LaterTorchCompileModel)
    compiled = compiling.torch_compile_model(model)
    assert calls == [(model, "inductor", "")] and compiling.host_compiles_with_guard_filter(compiled)
    assert compiling.torch_compile_model(model, guard_filter=True) is not model and calls[-1] == (model, "inductor", "")
    assert len(calls) == 2  # the host's own filter: not compiled a second time


def test_the_dense_cudnn_row_moves_cudnn_attention_first_and_restores_the_host_s_order(monkeypatch):
    """``dense_cudnn``: ComfyUI 0.33.0 and 0.38.x put SDPA's flash attention before cuDNN attention (0.3.64 and
    0.28.2 cuDNN first); the row runs the host's dense attention with cuDNN moved first, the rest in the host's
    order, and puts the host's list back after (also when the row fails). Where the host sets no order (its CPU
    build) the row says so."""
    import comfy.ops
    from torch.nn.attention import SDPBackend

    from chorus.benchmarks.comfy_e2e import host_attention

    host_order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                  SDPBackend.MATH]
    listed = list(host_order)
    monkeypatch.setattr(comfy.ops, "SDPA_BACKEND_PRIORITY", listed, raising=False)
    assert host_attention.sdpa_order() == ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    with pytest.raises(ValueError), host_attention.sdpa_cudnn_first():
        assert comfy.ops.SDPA_BACKEND_PRIORITY is listed  # reordered in place: the host's wrapper reads this list
        assert host_attention.sdpa_order() == ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
        raise ValueError("the row failed")
    assert listed == host_order
    monkeypatch.delattr(comfy.ops, "SDPA_BACKEND_PRIORITY")
    assert host_attention.sdpa_order() is None
    with pytest.raises(RuntimeError, match="no SDPA backend order"), host_attention.sdpa_cudnn_first():
        pass


def _host_has_attention_backend_node() -> bool:
    try:
        from comfy_extras.nodes_model_advanced import ModelAttentionBackend  # noqa: F401 - ComfyUI 0.33.0, 0.38.x
    except ImportError:
        return False
    return True


def test_the_benchmark_records_the_host_and_skips_the_dense_rows_it_cannot_run(tmp_path, monkeypatch):
    """``dense_cudnn`` where the host sets no SDPA order (its CPU build), ``dense_ck`` where the host has no Model
    Attention Backend node (0.3.64) or comfy-kitchen no INT8 attention kernel for the device (the CPU): each
    a row with the reason, the rest of the run goes on."""
    from chorus.nodes.host_report import comfyui_version

    results = tiny_run(tmp_path, monkeypatch, "--variants", "dense", "dense_cudnn", "dense_ck")
    assert results["comfyui"] == comfyui_version() != "unknown" and results["sdpa_order"] is None  # CPU: no order
    rows = variant_rows(results)
    assert rows["dense"]["finite"] and "no SDPA backend order" in rows["dense_cudnn"]["skipped"]
    why = "no INT8 attention kernel" if _host_has_attention_backend_node() else "no Model Attention Backend node"
    assert why in rows["dense_ck"]["skipped"]


def test_the_dense_ck_row_runs_comfyui_s_own_attention_backend_node_on_clones(monkeypatch):
    """``dense_ck``: each model through ComfyUI's core Model Attention Backend node at "comfy kitchen attention"
    (0.33.0's V1 node, 0.38.x's V3 one): a clone whose attention override calls what ComfyUI registered as
    ``comfy_kitchen_int8`` (its ``attention_comfy_kitchen_int8``), the model handed in untouched. Where the kernel
    is missing the row is refused rather than run as the node's silent PyTorch fallback."""
    from chorus.benchmarks.comfy_e2e import host_attention

    model = tiny.load_tiny_wan(tiny.tiny_wan_state_dict())
    if not _host_has_attention_backend_node():
        with pytest.raises(RuntimeError, match="no Model Attention Backend node"):
            host_attention.comfy_kitchen_attention_models([model])
        return
    import comfy.ldm.modules.attention as attention

    monkeypatch.setattr(attention, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", False)
    with pytest.raises(RuntimeError, match="no INT8 attention kernel"):
        host_attention.comfy_kitchen_attention_models([model])
    monkeypatch.setattr(attention, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", True)
    seen = []  # ComfyUI registers its INT8 attention at import only where the kernel is: a recording stand-in here
    monkeypatch.setitem(attention.REGISTERED_ATTENTION_FUNCTIONS, "comfy_kitchen_int8",
                        lambda *a, **k: seen.append(a) or a[0])
    (patched,) = host_attention.comfy_kitchen_attention_models([model])
    assert patched is not model and "optimized_attention_override" not in model.model_options["transformer_options"]
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    q = torch.randn(1, 8, 16)
    assert override(None, q, q, q, 2) is q and len(seen) == 1


def test_the_guided_feature_reuse_row_runs_the_shipped_workflow_s_node_chain(tmp_path, monkeypatch):
    """``hitfr_gb``: the feature-reuse hit with Chorus Guidance Boost at its defaults after it, as the shipped
    feature-reuse workflow chains them: the same sparse calls and downsampled blocks as ``hitfr``, every
    self-attention call biased toward the start image and every forward's cross-attention outputs boosted (the
    row's ``guidance`` counts, warm-up step and request; one self-attention call a layer and forward)."""
    rows = variant_rows(tiny_run(tmp_path, monkeypatch, "--variants", "miss", "hitfr", "hitfr_gb", "--fr-share", "1.0"))
    plain, guided = rows["hitfr"], rows["hitfr_gb"]
    assert guided["plan_kind"] == "hit" and guided["fallback_calls"] == 0 and guided["finite"], guided
    assert guided["sparse_calls"] == plain["sparse_calls"] > 0
    assert guided["fr_blocks_reduced"] == plain["fr_blocks_reduced"] > 0
    assert guided["guidance"] == {"biased_calls": guided["sparse_calls"],
                                  "boosted_forwards": guided["sparse_calls"] // tiny.TINY_LAYERS}
    assert "guidance" not in plain


def test_the_guided_feature_reuse_row_compiles(tmp_path, monkeypatch):
    """``hitfr_gb --compile --compiled-only``: the workflow's chain under ``TorchCompileModel`` runs every call sparse
    with feature reuse and its timed request compiles nothing; the row's ``guidance`` counts that request's calls,
    every one biased."""
    rows = variant_rows(tiny_run(tmp_path, monkeypatch, "--variants", "hitfr_gb", "--fr-share", "1.0", "--compile",
                                 "--compiled-only"))
    assert set(rows) == {"miss", "hitfr_gb+compile"}, sorted(rows)
    guided = rows["hitfr_gb+compile"]
    assert guided["plan_kind"] == "hit" and guided["sparse_calls"] > 0 and guided["fallback_calls"] == 0, guided
    assert guided["fr_blocks_reduced"] > 0 and guided["timed_request_frames_compiled"] == 0, guided
    assert guided["guidance"] == {"biased_calls": guided["sparse_calls"],
                                  "boosted_forwards": guided["sparse_calls"] // tiny.TINY_LAYERS}, guided


@pytest.mark.parametrize("schedule", ["standard_static", "standard_uniform"])
def test_comfy_e2e_benchmark_runs_a_request_in_context_windows(tmp_path, monkeypatch, schedule):
    """``--frames 21 --windows 9 4``: every row's models in the core context-windows node (later ComfyUI's causal
    window fix: the host's own from 0.28.2, a test double on 0.3.64), three windows, the later ones one anchor frame
    longer, in the static schedule and in the node's later default, whose windows move from step to step
    (``--window-schedule``). The miss records them all at the first window's grid; the hit with feature reuse runs
    every call sparse and downsamples in the longer windows, its region scores carried to their grid."""
    from chorus.benchmarks.comfy_e2e import run, windows
    from host import comfy038

    if not windows.host_runs_i2v_in_windows():  # 0.3.64: the later host's behaviour, as the windows' host test has it
        comfy038.install_context_window_conds(monkeypatch)
        comfy038.install_context_window_anchor(monkeypatch)
        monkeypatch.setattr(run, "host_runs_i2v_in_windows", lambda: True)
    results = tiny_run(tmp_path, monkeypatch, "--variants", "miss", "hitfr", "--fr-share", "1.0", "--frames", "21",
                       "--windows", "9", "4", "--window-schedule", schedule)
    assert results["windows"]["latent_frames"] == 6 and len(results["windows"]["windows"]) == 3, results["windows"]
    assert results["windows"]["context_schedule"] == schedule
    rows = variant_rows(results)
    assert rows["miss"]["write"].startswith("wrote entry") and rows["miss"]["tokens"] == 6 * 8 * 14
    hit = rows["hitfr"]
    assert hit["plan_kind"] == "hit" and hit["sparse_calls"] > 0 and hit["fallback_calls"] == 0, hit
    assert hit["fr_blocks_reduced"] > 0 and all(r["finite"] for r in rows.values()), hit
    assert any("carried to grid (4, 8, 14)" in m for m in hit["messages"]), hit["messages"]


def test_the_benchmark_refuses_frames_that_are_not_4n_plus_1(tmp_path, capsys):
    from chorus.benchmarks.comfy_e2e import run

    with pytest.raises(SystemExit) as refused:
        run.main(["--tiny", "--frames", "20", "--out", str(tmp_path)])
    assert refused.value.code == 2 and "--frames must be 4n + 1, got 20" in capsys.readouterr().err


def test_a_compiled_row_that_raises_is_recorded_as_failed_and_the_rows_after_it_still_run(tmp_path, monkeypatch,
                                                                                          capsys):
    """ComfyUI 0.33.0's own compiled FP8-scaled linears raise inside dynamo on a GPU (docs/BENCHMARK_LOG.md, run 120):
    a compiled row that raises is a ``failed`` row with the error's first line, the table says FAILED, the next
    compiled row runs, and the command exits 1. Here the first compiled request's models raise as that one did."""
    import comfy.patcher_extension

    from chorus.benchmarks.comfy_e2e import run

    monkeypatch.setenv("COMFYUI_DIR", str(tiny.find_comfyui_dir()))
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "cache"))
    real, compiled = run.torch_compile_model, []

    def raises(executor, *args, **kwargs):
        raise RuntimeError("Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor).\nmore")

    def first_two_raise(model, guard_filter=False):  # the dense row's first request: both experts
        out = real(model, guard_filter)
        compiled.append(out)
        if len(compiled) <= 2:
            out = out.clone()
            out.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, "test_raises", raises)
        return out

    monkeypatch.setattr(run, "torch_compile_model", first_two_raise)
    assert run.main(["--tiny", "--out", str(tmp_path), "--variants", "dense", "miss", "--compile",
                     "--compiled-only"]) == 1
    rows = variant_rows(json.loads((tmp_path / "comfy_e2e.json").read_text()))
    assert rows["dense+compile"] == {"weights": "bf16", "res": "tiny", "variant": "dense+compile",
                                     "failed": "RuntimeError: Cannot access data pointer of Tensor (e.g. FakeTensor, "
                                               "FunctionalTensor)."}
    assert rows["miss+compile"]["finite"] and rows["miss+compile"]["plan_kind"] == "miss"
    out = capsys.readouterr()
    assert "| bf16 | tiny | dense+compile | FAILED: RuntimeError: Cannot access data pointer" in out.out
    assert "failed rows: dense+compile" in out.err
