"""Test-only ComfyUI custom node: CONDITIONING without a text encoder (copied into a temporary
custom_nodes folder by the host tests; never part of the pack).

ChorusTestConditioning(seed, noise, noise_seed) -> (positive, negative): positive is
``randn(1, 512, 4096)`` from ``seed`` plus ``noise * randn`` from ``noise_seed`` (a "similar" request
uses the same seed with a little noise); negative comes from ``seed + 1``.

ChorusTestSageCalls(latent) -> UI text ``"sage calls N"``: how many times ComfyUI's
``attention_sage`` called ``sageattention.sageattn`` since the last report (then the count restarts).
Counted only when the server runs with env ``CHORUS_TEST_COUNT_SAGE=1``: the test wraps
``comfy.ldm.modules.attention.sageattn`` (the name ``attention_sage`` calls) at import time; the
``latent`` input only orders the node after sampling.

With env ``CHORUS_TEST_WINDOW_CONDS=1`` (the run server's), ComfyUI's context windows cut Wan I2V's image
conditioning to each window as ComfyUI 0.28.2 and later do (``comfy038.install_context_window_conds``, copied
beside this file; a no-op where the host cuts it itself), so a long-video workflow samples on 0.3.64 too.
"""

import os
import types

import torch

SAGE_CALLS = {"n": 0, "wrapped": False}


def _wrap_sage():
    import comfy.ldm.modules.attention as attention

    inner = getattr(attention, "sageattn", None)
    if inner is None:
        return

    def counting_sageattn(*args, **kwargs):
        SAGE_CALLS["n"] += 1
        return inner(*args, **kwargs)

    attention.sageattn = counting_sageattn
    SAGE_CALLS["wrapped"] = True


if os.environ.get("CHORUS_TEST_COUNT_SAGE") == "1":
    _wrap_sage()

if os.environ.get("CHORUS_TEST_WINDOW_CONDS") == "1":
    from . import comfy038  # noqa: E402 (tests/host/comfy038.py, copied into this test-only node's folder)

    comfy038.install_context_window_conds(types.SimpleNamespace(setattr=setattr))  # for good: one server process


class ChorusTestConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1, "tooltip": "seed of the positive tensor"}),
            "noise": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 10.0, "step": 0.01, "tooltip": "added noise"}),
            "noise_seed": ("INT", {"default": 1, "min": 0, "max": 2**31 - 1, "tooltip": "seed of the noise"}),
        }}

    RETURN_TYPES = ("CONDITIONING", "CONDITIONING")
    RETURN_NAMES = ("positive", "negative")
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed, noise, noise_seed):
        positive = torch.randn(1, 512, 4096, generator=torch.Generator().manual_seed(seed))
        if noise:
            positive = positive + noise * torch.randn(1, 512, 4096, generator=torch.Generator().manual_seed(noise_seed))
        negative = torch.randn(1, 512, 4096, generator=torch.Generator().manual_seed(seed + 1))
        return ([[positive, {}]], [[negative, {}]])


class ChorusTestSageCalls:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latent": ("LATENT", {"tooltip": "the sampled latent (orders this node after sampling)"})}}

    RETURN_TYPES = ()
    FUNCTION = "report"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    @classmethod
    def IS_CHANGED(cls, latent):
        return float("nan")  # report every run

    def report(self, latent):
        n, SAGE_CALLS["n"] = SAGE_CALLS["n"], 0
        text = f"sage calls {n}" if SAGE_CALLS["wrapped"] else "sage calls not counted"
        return {"ui": {"text": [text]}}


NODE_CLASS_MAPPINGS = {"ChorusTestConditioning": ChorusTestConditioning, "ChorusTestSageCalls": ChorusTestSageCalls}
