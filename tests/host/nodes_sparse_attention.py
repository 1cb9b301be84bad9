"""Stand-in for ComfyUI 0.38.x's core "Model Sparse Attention" node (``comfy_extras/
nodes_sparse_attention.py``, read from source at 01dafad3aa6ccf46e7b6f8b7b61a8138cd8b0261; behaviour
described, no code taken), for the tests of ``nodes/override_stack.py``.

What it shares with the core node — what Chorus's detection and composition rely on:

- the module name ends in ``nodes_sparse_attention`` and the override is a closure made by
  ``make_attention_override(patch, previous)``, holding the override it replaced in ``previous``;
- declined calls (masks, cross-attention — q/k/v shapes differ —, short sequences) go to ``previous``
  (``previous(func, q, k, v, heads, mask=..., attn_precision=..., skip_reshape=..., skip_output_reshape=...,
  **kwargs)``) or, without one, to ``func``; its own calls read ``scale=`` from the kwargs;
- :func:`install_override` puts a new closure on top of the current override unless the current one
  is already one of this patch's (``patch.installed``); :func:`apply` calls it at patch time and adds an
  ``ON_PREPARE_STATE`` callback under the key ``"block_sparse_attention"`` that calls it on the step's
  ``model_options["transformer_options"]`` (0.38.x signature ``(patcher, timestep, model_options)``:
  ``tests/host/comfy038.py`` gives the 0.3.64 host that signature) — so it is on top at every step.

Its "sparse attention" is a stand-in too: each query attends only to the first half of the keys
(CPU, any dtype), clearly different from dense attention; ``patch.sparse_calls`` / ``declined_calls``
count what it did.
"""

from __future__ import annotations

import torch

CALLBACK_KEY = "block_sparse_attention"


class SparseAttnPatch:
    def __init__(self, min_tokens: int = 0):
        self.min_tokens = min_tokens
        self.installed = set()
        self.sparse_calls = 0
        self.declined_calls = 0
        self.installs = 0


def _half_keys_attention(q, k, v, heads, scale):
    batch, length, width = q.shape
    size = width // heads
    qh, kh, vh = (t.view(batch, -1, heads, size).transpose(1, 2) for t in (q, k, v))
    keep = max(1, kh.shape[2] // 2)
    extra = {} if scale is None else {"scale": scale}
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh[:, :, :keep], vh[:, :, :keep], **extra)
    return out.transpose(1, 2).reshape(batch, length, width)


def make_attention_override(patch: SparseAttnPatch, previous):
    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        def declined():
            patch.declined_calls += 1
            rest = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)
            if previous is None:
                return func(q, k, v, heads, **rest)
            return previous(func, q, k, v, heads, **rest)

        if mask is not None or skip_reshape or skip_output_reshape or q.shape != k.shape or q.shape != v.shape:
            return declined()
        if q.shape[1] < patch.min_tokens:
            return declined()
        patch.sparse_calls += 1
        return _half_keys_attention(q, k, v, heads, kwargs.get("scale"))

    return override


def install_override(patch: SparseAttnPatch, transformer_options: dict) -> None:
    current = transformer_options.get("optimized_attention_override")
    if current in patch.installed:
        return
    override = make_attention_override(patch, current)
    patch.installed.add(override)
    patch.installs += 1
    transformer_options["optimized_attention_override"] = override


def apply(model, patch: SparseAttnPatch):
    """The node's execute: a clone with the override on top and the per-step re-install callback."""
    import comfy.patcher_extension

    m = model.clone()
    install_override(patch, m.model_options["transformer_options"])
    m.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_PREPARE_STATE, CALLBACK_KEY,
                            lambda patcher, timestep, model_options:
                            install_override(patch, model_options["transformer_options"]))
    return m
