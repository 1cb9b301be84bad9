"""``python -m chorus check`` (``kernels/selfcheck.py``): the report, the numerics check and the speed row on
the CPU (the reference kernel), a kernel that computes wrong failing the check (exit 1), bad arguments (exit 2);
on a GPU the same command with auto's kernel (skips without CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from chorus.__main__ import main as chorus_main
from chorus.kernels import selfcheck


def test_the_report_names_the_kernel_auto_runs_and_why_the_others_cannot(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert selfcheck.main(["--device", "cpu", "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    assert info["auto"] == "reference" and info["accurate"] is None and info["block_mass"] == "reference"
    assert [row["backend"] for row in info["chain"]] == ["reference"]
    assert all("CUDA" in why for why in info["accurate_reasons"].values())
    text = capsys.readouterr().out
    assert "<- auto's choice" in text and "not faster than dense" in text and "block mass" in text
    assert "numerics" not in info and "speed" not in info  # nothing ran without --run


def test_a_gpu_without_a_triton_kernel_is_a_warning(capsys):
    """On a CUDA device where no Triton kernel runs (no Triton: Windows without triton-windows), a hit runs
    ComfyUI's dense attention (the engine's rule; flex only with the pooled tail off): the report says so."""
    info = selfcheck.report(torch.device("cpu"))
    info["device"] = {"device": "cuda:0", "name": "a GPU", "capability": "sm_89", "memory_gib": 24.0}
    info["chain"] = [{"backend": "triton_bf16", "reason": "triton is not importable: No module named 'triton'"},
                     {"backend": "flex", "reason": "flex runs compiled on a CUDA GPU (torch.compile), which needs "
                                                   "Triton: triton is not installed"},
                     {"backend": "reference", "reason": None}]
    info["auto"] = "reference"
    selfcheck._print_report(info)
    text = capsys.readouterr().out
    assert "WARNING: no Triton kernel runs on this GPU" in text and "triton is not importable" in text
    assert "a hit runs ComfyUI's own dense attention (no speed-up" in text
    info["auto"] = "flex"  # Triton there, but none of Chorus's Triton kernels passes its first-use check
    selfcheck._print_report(info)
    assert "FlexAttention with it off" in capsys.readouterr().out


def test_run_checks_the_numerics_against_exact_attention_and_times_both(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert selfcheck.main(["--device", "cpu", "--run", "--tokens", "300", "--heads", "2", "--reps", "2",
                           "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    torch_row, ours = info["numerics"]
    assert torch_row["backend"] == "torch dense" and 0 < torch_row["rel_l2"] < 0.01
    assert info["dtype"] == info["speed"]["dtype"] == "fp16" and torch_row["numerics"] == "fp16"
    assert ours["backend"] == "reference" and ours["passed"] and ours["rel_l2"] <= ours["ceiling"]
    speed = info["speed"]
    assert speed["tokens"] == 300 and speed["heads"] == 2 and speed["pooled_tail"]
    assert speed["chorus_ms"] > 0 and speed["torch_dense_ms"] > 0
    assert speed["speedup"] == pytest.approx(speed["torch_dense_ms"] / speed["chorus_ms"])
    assert "ok" in capsys.readouterr().out


def test_the_by_name_option_is_checked_and_timed_beside_auto_s_kernel_and_never_fails_the_check(monkeypatch,
                                                                                                 capsys, tmp_path):
    """Off Hopper, where auto takes triton_bf16 and triton_fp8 runs too, --run checks the option's numerics and
    times it beside auto's kernel; an option that computes wrong is reported (keep auto), the check still passes.
    On this CPU the option is played by flex (it runs here, uncompiled, without a pooled tail)."""
    real_report, real_attention = selfcheck.report, selfcheck.block_sparse_attention

    def with_option(device, dtype):
        return {**real_report(device, dtype), "option": "flex"}

    monkeypatch.setattr(selfcheck, "report", with_option)
    args = ["--device", "cpu", "--run", "--tokens", "300", "--heads", "2", "--reps", "2"]
    info = _run_json(args, tmp_path / "check.json")
    option_row = next(row for row in info["numerics"] if row["backend"] == "flex")
    assert option_row["passed"] and option_row["ceiling"] == 0.02
    speed = info["speed_option"]
    assert speed["backend"] == "flex" and not speed["pooled_tail"] and speed["chorus_ms"] > 0
    assert speed["vs_auto"] == pytest.approx(info["speed"]["chorus_ms"] / speed["chorus_ms"])
    text = capsys.readouterr().out
    assert "by name: flex runs here too" in text and "by name in Chorus Sparse Sampler's backend input" in text

    def wrong_option(q, k, v, block_map, **kwargs):
        out = real_attention(q, k, v, block_map, **kwargs)
        return out.flip(2) if kwargs.get("backend") == "flex" else out

    monkeypatch.setattr(selfcheck, "block_sparse_attention", wrong_option)
    info = _run_json(args, tmp_path / "check_wrong_option.json")
    assert "speed_option" not in info and info["speed"]["chorus_ms"] > 0
    assert "flex did not pass its numerics check on this device: keep backend auto" in capsys.readouterr().out


def _run_json(args, out) -> dict:
    """``chorus check ARGS --json OUT``, asserting it passed; the JSON it wrote."""
    assert selfcheck.main([*args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("dtype,expected", [(None, torch.float16), ("fp16", torch.float16),
                                            ("bf16", torch.bfloat16)])
def test_every_q_k_v_of_the_check_is_in_the_dtype_comfyui_computes_wan_in(dtype, expected, monkeypatch, tmp_path,
                                                                         capsys):
    """fp16 by default (ComfyUI's loader computes Wan in fp16 on a GPU), bf16 with ``--dtype bf16`` (a user's
    ``--bf16-unet``): the report's probe, the numerics rows and the speed row all see that dtype."""
    seen, real = set(), selfcheck.block_sparse_attention

    def recording(q, k, v, block_map, **kwargs):
        seen.add(q.dtype)
        return real(q, k, v, block_map, **kwargs)

    monkeypatch.setattr(selfcheck, "block_sparse_attention", recording)
    args = ["--device", "cpu", "--run", "--tokens", "300", "--heads", "1", "--reps", "1"]
    info = _run_json(args + ([] if dtype is None else ["--dtype", dtype]), tmp_path / "check.json")
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[expected]
    assert seen == {expected} and info["dtype"] == info["speed"]["dtype"] == name
    assert info["numerics"][0]["numerics"] == name  # the torch dense row names its dtype as the header does
    assert f"attention ({name}, head dim 128)" in capsys.readouterr().out
    assert selfcheck.main(["--device", "cpu", "--dtype", "fp32"]) == 2


def test_bad_arguments_and_a_json_path_that_cannot_be_written_are_one_line_before_any_check(tmp_path, capsys,
                                                                                            monkeypatch):
    monkeypatch.setattr(selfcheck, "_check", lambda *a: pytest.fail("the check ran"))
    for args in (["--tokens", "0"], ["--json", str(tmp_path / "missing" / "x.json")], ["--json", str(tmp_path)]):
        capsys.readouterr()
        assert selfcheck.main(["--device", "cpu", *args]) == 2, args
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error: "), (args, err)


def test_a_kernel_that_computes_wrong_fails_the_check(monkeypatch, capsys):
    real = selfcheck.block_sparse_attention

    def wrong(q, k, v, block_map, **kwargs):
        return real(q, k, v, block_map, **kwargs).flip(2)  # every row another row's output

    monkeypatch.setattr(selfcheck, "block_sparse_attention", wrong)
    assert selfcheck.main(["--device", "cpu", "--run", "--tokens", "256", "--heads", "1", "--reps", "1"]) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "CHECK FAILED for reference" in text


def test_a_kernel_that_raises_fails_the_check_with_its_error(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(selfcheck, "block_sparse_attention", broken)
    assert selfcheck.main(["--device", "cpu", "--run", "--tokens", "256", "--heads", "1", "--reps", "1"]) == 1
    text = capsys.readouterr().out
    assert "RuntimeError: no kernel image" in text and "speed: FAILED" in text


@pytest.mark.parametrize("argv,message", [
    (["--density", "0"], "must be in (0, 1]"), (["--tokens", "0"], "must be >= 1"),
    (["--device", "cuda:7"], "CUDA device"), (["--device", "nonsense"], "--device")])
def test_bad_arguments_are_a_clear_error_and_exit_2(argv, message, capsys):
    if argv[:2] == ["--device", "cuda:7"] and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert selfcheck.main(argv) == 2
    assert message in capsys.readouterr().err


def test_each_kernel_has_the_numerics_its_ceiling_is_keyed_by():
    from chorus.kernels.api import Backend, numerics_of
    from chorus.kernels.reference import NUMERICS_CEILINGS

    families = {b.value: numerics_of(b) for b in Backend if b != Backend.AUTO}
    assert set(families.values()) == set(NUMERICS_CEILINGS)
    assert families["triton_fp8_ws"] == families["triton_fp8"] == "fp8"
    assert families["triton_int8_ws"] == families["triton_int8"] == "int8"
    assert families["triton_bf16"] == families["reference"] == "16-bit"
    with pytest.raises(ValueError, match="resolve it first"):
        numerics_of("auto")


def test_the_pack_s_command_line_runs_it(capsys):
    assert chorus_main(["check", "--device", "cpu"]) == 0
    assert "auto's chain" in capsys.readouterr().out
    assert chorus_main(["-h"]) == 0
    assert "check" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_on_a_gpu_auto_s_kernel_passes_its_numerics_check(dtype, tmp_path):
    out = tmp_path / "check.json"
    assert selfcheck.main(["--run", "--dtype", dtype, "--tokens", "4096", "--heads", "4", "--reps", "3",
                           "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    assert info["dtype"] == dtype
    if torch.cuda.get_device_capability()[0] == 9:
        assert info["auto"] == "triton_fp8_ws" and info["accurate"] == "triton_int8_ws" and "ptxas" in info
        assert info["option"] is None  # (auto runs FP8 here already)
    assert all(row["passed"] for row in info["numerics"]) and info["speed"]["chorus_ms"] > 0
