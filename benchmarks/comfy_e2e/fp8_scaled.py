"""The layout of ComfyUI's FP8-scaled Wan files (``wan2.2_i2v_*_14B_fp8_scaled.safetensors``, the files the
shipped A14B workflows name), for state dicts made here: the benchmark's random 14B experts
(``run.py --weights fp8_scaled``) and the tests' tiny Wan stand-ins (``tests/host/tiny_wan.py``).

As the header of Comfy-Org's ``wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors`` lists its keys: every linear
weight (a 2-dim ``*.weight``: the blocks' linears and the text / time embeddings', the time projection's and the
head's) is stored as ``float8_e4m3fn`` after dividing by a per-tensor ``*.scale_weight`` (float32, 0-dim: here the
weight's absolute maximum over 448, e4m3's largest finite value), beside a 0-dim float32 ``*.scale_input``; every
other floating tensor is fp16; the ``scaled_fp8`` marker (an empty e4m3 tensor) makes ComfyUI load the file with
its scaled FP8 operations (0.3.64: ``comfy.ops.scaled_fp8_ops``, weights cast back per call; 0.28.2 on:
``convert_old_quants`` turns the file into its mixed-precision operations, each weight a ``QuantizedTensor``,
which on a GPU with FP8 matmuls quantize the input and run an FP8 GEMM). The files' input scales are not known
here: this layout writes 1.0, which ComfyUI reads as no input scale (each call quantizes its input with a scale of
its own).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

E4M3_MAX = 448.0
MARKER = "scaled_fp8"


def fp8_scaled_entries(key: str, value: torch.Tensor) -> dict:
    """``{key: stored}`` for one tensor of a Wan state dict in the FP8-scaled layout (module docstring), with its
    ``scale_weight`` and ``scale_input`` beside a linear weight. The tensors stay on ``value``'s device."""
    if key.endswith(".weight") and value.ndim == 2:
        scale = value.detach().abs().amax().float().clamp_min(1e-12) / E4M3_MAX
        layer = key[: -len("weight")]
        return {key: (value.detach().float() / scale).to(torch.float8_e4m3fn), layer + "scale_weight": scale,
                layer + "scale_input": torch.ones((), dtype=torch.float32, device=value.device)}
    return {key: value.detach().to(torch.float16) if value.is_floating_point() else value.detach()}


def fp8_scaled_state_dict(items: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """A whole state dict (``(key, tensor)`` pairs, e.g. ``state_dict.items()`` or a generator that makes each
    tensor when asked, so that one full-precision tensor at a time is alive) in the FP8-scaled layout, with the
    ``scaled_fp8`` marker."""
    out = {}
    for key, value in items:
        out.update(fp8_scaled_entries(key, value))
    out[MARKER] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out
