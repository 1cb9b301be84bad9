"""Tensors kept for the process: made with inference mode off, whatever mode first asks for them.

ComfyUI runs its nodes under ``torch.inference_mode``, so a cache the pack keeps across calls (token orders and
their device copies, the carry's count matrices, the INT8 pre-pass's Hadamard matrix, the engine's recording
counter) is often first filled there. Made there, its tensors would be inference tensors: a later grad-enabled
call (a diffusers pipeline run without ``no_grad``) cannot save them for backward (``index_select`` saves its
index) and cannot update them in place. Made outside inference mode they are ordinary tensors and serve both."""

from __future__ import annotations

import functools

import torch


def outside_inference_mode(build):
    """``build`` run with inference mode off (a decorator). Tensors the caller passes in are read as they are."""

    @functools.wraps(build)
    def built(*args, **kwargs):
        with torch.inference_mode(False):
            return build(*args, **kwargs)

    return built
