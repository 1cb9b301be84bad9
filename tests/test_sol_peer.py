"""ComfyUI's core sparse attention rebuilt as a benchmark peer (``benchmarks/comfy_e2e/sol_peer.py``), on the
CPU with ``comfy_kitchen.sol_attn``'s eager reference: the override's sparse calls are sol_attn's own output,
the calls the core node keeps dense go to the function it wraps, and the benchmark of record's ``sol`` rows
run through ComfyUI's sampler. Needs ComfyUI (the tiny real WanModel) and ``comfy-kitchen`` (extra ``peers``)."""

from __future__ import annotations

import json

import pytest
import torch

from chorus.benchmarks.kernels import peers
from host import tiny_wan as tiny  # tests/host (pytest pythonpath)

SKIP_REASON = tiny.import_comfy()
pytestmark = [pytest.mark.host, pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")]
comfy_kitchen, NO_SOL_ATTN = peers.comfy_kitchen_with_sol_attn()
if comfy_kitchen is None:  # optional extra 'peers'; ComfyUI's own requirements pin releases without sol_attn
    pytest.skip(NO_SOL_ATTN, allow_module_level=True)

HEADS, TOKENS = 2, 320  # head dim 128, as sol_attn requires; 320 tokens = 5 of its 64-token blocks


def _override(model, **options):
    from chorus.benchmarks.comfy_e2e.sol_peer import sol_patched

    patched, counts = sol_patched(model, cuda_only=False, **options)
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert "optimized_attention_override" not in model.model_options["transformer_options"]  # a clone was patched
    return override, counts


def _qkv(seed, tokens=TOKENS, width=HEADS * 128):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, tokens, width, generator=gen) for _ in range(3)]


class DenseCalls:
    """The wrapped attention function: counts what it was handed, returns a recognisable tensor."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, heads, **kwargs):
        self.calls.append(kwargs)
        return torch.full_like(q, 7.0)


def test_sparse_calls_are_sol_attn_and_the_rest_stays_dense():
    model = tiny.load_tiny_wan(tiny.tiny_wan_state_dict(seed=0))
    sampling = model.get_model_object("model_sampling")
    in_window = {"sigmas": torch.tensor([float(sampling.percent_to_sigma(0.5))])}
    override, counts = _override(model, min_tokens=256)
    q, k, v = _qkv(1)
    dense = DenseCalls()
    out = override(dense, q, k, v, HEADS, transformer_options=in_window)
    expected = comfy_kitchen.sol_attn(*(t.view(1, TOKENS, HEADS, 128).bfloat16() for t in (q, k, v)), tau=1.3,
                                      token_aug=256).float().reshape(1, TOKENS, HEADS * 128)
    assert torch.equal(out, expected) and not dense.calls and counts.sparse_calls == 1
    # [B, H, T, D] in and out (skip_reshape / skip_output_reshape)
    qh, kh, vh = (t.view(1, TOKENS, HEADS, 128).transpose(1, 2) for t in (q, k, v))
    out_h = override(dense, qh, kh, vh, HEADS, skip_reshape=True, skip_output_reshape=True,
                     transformer_options=in_window)
    assert torch.equal(out_h.transpose(1, 2).reshape(1, TOKENS, HEADS * 128), expected)

    early = {"sigmas": torch.tensor([float(sampling.percent_to_sigma(0.05))])}  # the first 20%: dense
    kept_dense = [  # (q, k, v, heads, keyword arguments)
        (q, k, v, HEADS, dict(mask=torch.ones(TOKENS, TOKENS, dtype=torch.bool), transformer_options=in_window)),
        (q, k, v, HEADS, dict(transformer_options=early)),
        (q[:, :200], k[:, :200], v[:, :200], HEADS, dict(transformer_options=in_window)),  # < min_tokens
        (q, k[:, :64], v[:, :64], HEADS, dict(transformer_options=in_window)),  # cross-attention
        (*_qkv(2, width=4 * 64), 4, dict(transformer_options=in_window)),  # head dim 64
    ]
    for cq, ck, cv, heads, kwargs in kept_dense:
        assert torch.equal(override(dense, cq, ck, cv, heads, **kwargs), torch.full_like(cq, 7.0))
    assert len(dense.calls) == len(kept_dense) and counts.dense_calls == len(kept_dense)
    assert counts.dense_reasons == {"mask": 1, "sigma outside the start/end window": 1,
                                    "fewer tokens than min_tokens": 1, "cross-attention or mixed dtypes": 1,
                                    "head dim 64 != 128": 1}
    assert counts.sparse_calls == 2
    assert "transformer_options" in dense.calls[1]  # every argument is handed on


def test_the_benchmark_of_record_runs_the_sol_rows(tmp_path, monkeypatch):
    from chorus.benchmarks.comfy_e2e import run

    monkeypatch.setenv("COMFYUI_DIR", str(tiny.find_comfyui_dir()))
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "cache"))
    assert run.main(["--tiny", "--out", str(tmp_path), "--variants", "sol", "sol_every"]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "comfy_e2e.json").read_text())["runs"]}
    assert set(rows) == {"sol", "sol_every"} and all(r["finite"] for r in rows.values())
    assert rows["sol"]["sol_options"]["start_percent"] == 0.2 and rows["sol_every"]["sol_options"]["start_percent"] == 0
    # every step sparse against the core node's window (its first 20% of the schedule dense)
    assert rows["sol_every"]["sol_sparse_calls"] > rows["sol"]["sol_sparse_calls"] > 0
    # the core node's window kept the early steps dense; cross-attention always is
    assert "sigma outside the start/end window" in rows["sol"]["sol_dense_reasons"][0]
    assert "sigma outside the start/end window" not in rows["sol_every"]["sol_dense_reasons"][0]
    assert rows["sol_every"]["sol_dense_reasons"][0]["cross-attention or mixed dtypes"] > 0
