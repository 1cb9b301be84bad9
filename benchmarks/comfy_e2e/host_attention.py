"""The host's own dense attention in the benchmark's reference rows: its SDPA backend order (``dense_cudnn``),
comfy-kitchen's INT8 attention through the core Model Attention Backend node (``dense_ck``), and its blocks on
a row-major residual stream as Chorus's block patch runs them (``dense_rowmajor``)."""

from __future__ import annotations

import contextlib


def sdpa_order() -> list[str] | None:
    """The host's SDPA backend order (``comfy.ops.SDPA_BACKEND_PRIORITY``), or None where it sets none."""
    import comfy.ops

    order = getattr(comfy.ops, "SDPA_BACKEND_PRIORITY", None)
    return None if order is None else [backend.name for backend in order]


@contextlib.contextmanager
def sdpa_cudnn_first():
    """The ``dense_cudnn`` row: the host's SDPA backend order with cuDNN attention first and the others in the
    host's order (0.3.64 and 0.28.2 put it first, 0.33.0 and 0.38.x second after flash), restored after. A
    benchmark's reference row: it reorders ComfyUI's module-level order list in place, which its SDPA wrapper
    reads at every call. Raises ``RuntimeError`` where the host sets no order or has no cuDNN entry in it."""
    import comfy.ops
    from torch.nn.attention import SDPBackend

    order = getattr(comfy.ops, "SDPA_BACKEND_PRIORITY", None)
    if order is None or SDPBackend.CUDNN_ATTENTION not in order:
        raise RuntimeError("this ComfyUI sets no SDPA backend order with cuDNN attention in it")
    before = list(order)
    order.sort(key=lambda backend: backend != SDPBackend.CUDNN_ATTENTION)  # stable: the rest keep their order
    try:
        yield
    finally:
        order[:] = before


def comfy_kitchen_attention_models(models):
    """The ``dense_ck`` row's models: each through ComfyUI's core "Model Attention Backend" node
    (``ModelAttentionBackend`` of ``comfy_extras/nodes_model_advanced.py``: a V1 node with ``patch`` in 0.33.0, a V3
    node with ``execute`` in 0.38.x; not in 0.3.64) at "comfy kitchen attention", which puts comfy-kitchen's INT8
    attention (``attention_comfy_kitchen_int8``, dense: INT8 Q.K and P.V) on the clone for every attention call.
    Raises ``RuntimeError`` where the host has no such node, or where comfy-kitchen has no INT8 attention kernel
    for this device (the node itself would fall back to PyTorch's attention with a warning: a row of that would be
    a second dense row under another name)."""
    try:
        from comfy_extras.nodes_model_advanced import ModelAttentionBackend
    except ImportError as exc:
        raise RuntimeError(f"this ComfyUI has no Model Attention Backend node ({exc})") from None
    import comfy.ldm.modules.attention as attention

    if not getattr(attention, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", False):
        raise RuntimeError("comfy-kitchen has no INT8 attention kernel for this device (its is_available() is False)")
    if hasattr(ModelAttentionBackend, "define_schema"):  # the V3 node
        return tuple(ModelAttentionBackend.execute(model, "comfy kitchen attention").result[0] for model in models)
    return tuple(ModelAttentionBackend().patch(model, "comfy kitchen attention")[0] for model in models)


def row_major_block(args, extra):
    """A Wan block patch that runs the block on a row-major copy of its input, as Chorus's block patch does
    (``nodes/comfy_forward.ChorusBlock``): ComfyUI hands the blocks the patch embedding's transposed view, and
    its elementwise ops and layer norms run strided on it."""
    x = args["img"]
    return extra["original_block"](dict(args, img=x.contiguous()) if not x.is_contiguous() else args)


def row_major_models(models):
    """Clones of ``models`` whose every block runs through :func:`row_major_block`: dense attention with the
    residual stream Chorus's patch gives every forward, to tell that part of a Chorus row's time from its
    attention's (the ``dense_rowmajor`` row)."""
    out = []
    for model in models:
        clone = model.clone()
        for layer in range(len(clone.model.diffusion_model.blocks)):
            clone.set_model_patch_replace(row_major_block, "dit", "double_block", layer)
        out.append(clone)
    return tuple(out)
