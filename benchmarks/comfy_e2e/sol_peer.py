"""ComfyUI's own sparse attention as a peer in the benchmark of record.

ComfyUI 0.38.x ships a core node, "Model Sparse Attention" (``comfy_extras/nodes_sparse_attention.py``,
read at 01dafad3aa6ccf46e7b6f8b7b61a8138cd8b0261), that puts ``comfy_kitchen.sol_attn`` (PyPI
``comfy-kitchen`` 0.2.40, optional extra ``peers``) on a model as an attention override. The benchmark of
record runs on ComfyUI 0.3.64, which has neither the node nor the package, so this module rebuilds the
node's behaviour for its method ``sol-attn`` on the same override hook (our code, from the behaviour
described there; nothing of it is copied):

- the override replaces ``optimized_attention_override`` in a clone's ``transformer_options`` (the node also
  re-installs itself at every step, which matters only when another node patches the same hook; none does
  in these rows);
- a call runs dense (the function it wraps) when it has a mask, when the step's sigma
  (``transformer_options["sigmas"][0]``) is above ``percent_to_sigma(start_percent)`` or below
  ``percent_to_sigma(end_percent)`` of the model's own sampling, when it has fewer than ``min_tokens``
  tokens, or when its tensors are not eligible (not CUDA, no compiled kernel, head dim != 128, q/k/v of
  different shapes or dtypes: cross-attention);
- otherwise ``sol_attn(q, k, v, tau=tau, scale=kwargs["scale"], token_aug=extra_tokens)`` on the
  ``[B, T, H, 128]`` views (fp32 inputs in bf16), its output reshaped back.

Defaults are the node's (:data:`CORE_NODE_DEFAULTS`): tau 1.3, start_percent 0.2 (the first 20% of the
schedule dense), end_percent 1.0, min_tokens 12 288, extra_tokens 256. ``cuda_only=False`` lets the
eager reference of ``sol_attn`` run on the CPU (toy sizes, for tests); the real node never does that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

HEAD_DIM = 128
CORE_NODE_DEFAULTS = dict(tau=1.3, start_percent=0.2, end_percent=1.0, min_tokens=12288, extra_tokens=256)


@dataclass
class SolCounts:
    """What the override did in a run: calls through ``sol_attn``, calls it handed to dense attention, and
    why (``dense_reasons``: reason -> calls)."""

    sparse_calls: int = 0
    dense_calls: int = 0
    dense_reasons: dict = field(default_factory=dict)


def _ineligible(q, k, v, dim_head: int, cuda_only: bool):
    """Why ``q``/``k``/``v`` (``[B, T, H, D]``) cannot go through ``sol_attn``, or None."""
    import comfy_kitchen

    if q.device.type != "cuda":
        if cuda_only:
            return "not on CUDA"
    elif not comfy_kitchen.sol_attn_is_available(q.device):
        return "no compiled sol_attn kernel for this GPU"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q.dtype}"
    if dim_head != HEAD_DIM:
        return f"head dim {dim_head} != {HEAD_DIM}"
    if q.shape != k.shape or q.shape != v.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        return "cross-attention or mixed dtypes"
    return None


def sol_patched(model, *, tau: float = 1.3, start_percent: float = 0.2, end_percent: float = 1.0,
                min_tokens: int = 12288, extra_tokens: int = 256, cuda_only: bool = True):
    """``(patched clone of the ModelPatcher model, SolCounts)``: the core node's sol-attn patch (module
    docstring). ``start_percent=0`` runs ``sol_attn`` at every step. Raises ``ImportError`` when
    ``comfy_kitchen`` is not installed or has no ``sol_attn`` (the benchmark reports it as the row's reason)."""
    from ..kernels.peers import comfy_kitchen_with_sol_attn

    comfy_kitchen, why = comfy_kitchen_with_sol_attn()
    if comfy_kitchen is None:
        raise ImportError(why)

    sampling = model.get_model_object("model_sampling")
    sigma_start = float(sampling.percent_to_sigma(start_percent))
    sigma_end = float(sampling.percent_to_sigma(end_percent))
    counts = SolCounts()

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        options = kwargs.get("transformer_options") or {}

        def dense(reason: str):
            counts.dense_calls += 1
            counts.dense_reasons[reason] = counts.dense_reasons.get(reason, 0) + 1
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)

        if mask is not None:
            return dense("mask")
        sigmas = options.get("sigmas")
        if sigmas is not None:
            sigma = float(sigmas[0])
            if sigma > sigma_start or sigma < sigma_end:
                return dense("sigma outside the start/end window")
        if (q.shape[2] if skip_reshape else q.shape[1]) < min_tokens:
            return dense("fewer tokens than min_tokens")
        if skip_reshape:  # [B, H, T, D]
            batch, dim_head = q.shape[0], q.shape[-1]
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        else:  # [B, T, H * D]
            batch, dim_head = q.shape[0], q.shape[-1] // heads
            qs, ks, vs = (t.view(batch, -1, heads, dim_head) for t in (q, k, v))
        reason = _ineligible(qs, ks, vs, dim_head, cuda_only)
        if reason is not None:
            return dense(reason)
        if q.dtype == torch.float32:
            qs, ks, vs = (t.to(torch.bfloat16) for t in (qs, ks, vs))
        out = comfy_kitchen.sol_attn(qs, ks, vs, tau=tau, scale=kwargs.get("scale"),
                                     token_aug=extra_tokens).to(q.dtype)
        counts.sparse_calls += 1
        if skip_output_reshape:
            return out.transpose(1, 2)
        return out.reshape(batch, -1, heads * dim_head)

    patched = model.clone()
    patched.model_options["transformer_options"]["optimized_attention_override"] = override
    return patched, counts
