"""Test-only ComfyUI custom node: CONDITIONING without a text encoder (copied into a temporary
custom_nodes folder by the host tests; never part of the pack).

ChorusTestConditioning(seed, noise, noise_seed) -> (positive, negative): positive is
``randn(1, 512, 4096)`` from ``seed`` plus ``noise * randn`` from ``noise_seed`` (a "similar" request
uses the same seed with a little noise); negative comes from ``seed + 1``.
"""

import torch


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


NODE_CLASS_MAPPINGS = {"ChorusTestConditioning": ChorusTestConditioning}
