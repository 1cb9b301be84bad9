"""``nodes/comfy_call.py`` and the per-call part of ``nodes/override_stack.py``: both ComfyUI calling
conventions read right, containers taken once, the dense call made right, and dynamo traces all of it
in one graph (the override runs inside ``TorchCompileModel``'s compiled region).

CPU only. ``chorus.nodes`` imports ComfyUI's ``comfy_api``, so these skip without a ComfyUI checkout.
"""

from __future__ import annotations

import functools

import pytest
import torch

from host import comfy038  # tests/host (pytest pythonpath)
from host import tiny_wan as tiny

SKIP_REASON = tiny.import_comfy()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=f"ComfyUI not available: {SKIP_REASON}")

Container = comfy038.AttentionTensorContainer


@pytest.fixture(scope="module")
def cc():
    from chorus.nodes import comfy_call

    return comfy_call


@pytest.fixture(scope="module")
def stack():
    from chorus.nodes import override_stack

    return override_stack


def _qkv(length=12, heads=2, size=8, kv_heads=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, heads * size, generator=gen)
    k = torch.randn(1, length, (kv_heads or heads) * size, generator=gen)
    v = torch.randn(1, length, (kv_heads or heads) * size, generator=gen)
    return q, k, v


def test_read_call_takes_each_container_once_and_reads_both_conventions(cc):
    q, k, v = _qkv()
    boxes = [Container(t) for t in (q, k, v)]
    call = cc.read_call(tuple(boxes), {"heads": 2, "scale": 0.25, "enable_gqa": True,
                                       "preferred_attention": "p", "transformer_options": {}, "odd": 1})
    assert call.q is q and call.k is k and call.v is v
    assert all(b.tensor is None for b in boxes)  # taken, so a second take raises
    with pytest.raises(RuntimeError, match="consumed"):
        boxes[0].take()
    fields = (call.heads, call.scale, call.enable_gqa, call.low_precision, call.unknown)
    assert fields == (2, 0.25, True, True, ("odd",))
    assert call.kwargs["preferred_attention"] == "p"  # handed on unchanged
    # 0.3.64: tensors, heads and a mask positionally (as a masked CrossAttention call passes them)
    mask = torch.zeros(12, 12)
    old = cc.read_call((q, k, v, 2, mask), {"transformer_options": {}, "_inside_attn_wrapper": True})
    assert old.heads == 2 and old.mask is mask and old.scale is None and old.unknown == ()
    assert cc.layout_refusal(old) == "the call has an attention mask"
    assert cc.read_call((q, k), {}) is None
    flux = cc.read_call((q.view(1, 12, 2, 8).transpose(1, 2),) * 3, {"heads": 2, "skip_reshape": True})
    assert cc.layout_refusal(flux) == "q/k/v are not [B, L, heads*head_dim] tensors"
    for flag in ("skip_reshape", "skip_output_reshape"):  # [B, L, H*D] tensors whose layout flag says otherwise
        flagged = cc.read_call((q, k, v), {"heads": 2, flag: True})
        assert cc.layout_refusal(flagged) == "the call is in [B, heads, L, head_dim] layout", flag


def test_sparse_refusal_names_what_chorus_cannot_take(cc):
    q, k, v = _qkv()
    assert cc.sparse_refusal(cc.read_call((q, k, v), {"heads": 2})) is None
    assert cc.sparse_refusal(cc.read_call((q, k, v), {"heads": 2, "enable_gqa": True})) is None  # as many heads
    q1, k1, v1 = _qkv(kv_heads=1)
    assert "grouped-query" in cc.sparse_refusal(cc.read_call((q1, k1, v1), {"heads": 2, "enable_gqa": True}))
    assert "low_precision_attention=False" in cc.sparse_refusal(
        cc.read_call((q, k, v), {"heads": 2, "low_precision_attention": False}))
    assert "window_size" in cc.sparse_refusal(cc.read_call((q, k, v), {"heads": 2, "window_size": 4}))
    assert "not a multiple of 5 heads" in cc.sparse_refusal(cc.read_call((q, k, v), {"heads": 5}))


def test_scaled_query_gives_default_scale_attention_the_callers_scale(cc):
    q, k, v = _qkv(heads=1, size=16)
    qh, kh, vh = (t.unsqueeze(1) for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=0.1)
    got = torch.nn.functional.scaled_dot_product_attention(cc.scaled_query(qh, 0.1, 16), kh, vh)
    torch.testing.assert_close(got, want)
    assert cc.scaled_query(q, None, 16) is q and cc.scaled_query(q, 16 ** -0.5, 16) is q


def test_dense_call_hands_on_plain_tensors_and_every_kwarg(cc):
    seen = []

    def func(*args, **kwargs):
        seen.append(("func", args, kwargs))
        return args[0]

    def previous(func_, *args, **kwargs):
        seen.append(("previous", args, kwargs))
        return func_(*args, **kwargs)

    q, k, v = _qkv()
    boxes = [Container(t) for t in (q, k, v)]
    kwargs = {"heads": 2, "scale": 0.5, "preferred_attention": "p", "transformer_options": {"a": 1}}
    call = cc.read_call(tuple(boxes), kwargs)
    cc.dense_call(func, previous, call.args, call.kwargs, options={"b": 2})
    (who1, args1, kw1), (who2, args2, kw2) = seen
    assert (who1, who2) == ("previous", "func")
    assert args1 == (q, k, v) and all(isinstance(a, torch.Tensor) for a in args2)
    assert kw2["scale"] == 0.5 and kw2["preferred_attention"] == "p" and kw2["transformer_options"] == {"b": 2}
    assert kwargs["transformer_options"] == {"a": 1}  # the caller's dict is not changed


def test_extra_token_inputs_of_a_wan_forward(cc):
    x = torch.zeros(1)
    assert cc.extra_token_input((x, x, x, None, None, {}), {}) is None
    assert cc.extra_token_input((x, x, x, None, x, {}), {}) == "time_dim_concat"
    assert cc.extra_token_input((x, x, x, None, None, {}), {"reference_latent": None}) == "reference_latent"
    assert cc.extra_token_input((x, x, x), {"context_latents": [x]}) == "context_latents"
    assert cc.extra_token_input((x, x, x), {"context_latents": None}) is None


def test_dynamo_traces_the_call_translation_in_one_graph(cc, stack):
    """read_call (containers taken inside the graph), both refusals, scaled_query and dense_call
    (directly and through a chained override), compiled with fullgraph=True: any graph break fails
    the compile."""
    import torch._dynamo
    import torch._dynamo.testing

    def backend(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                **kwargs):
        return comfy038.sdpa_backend(q, k, v, heads, **kwargs)

    def chained(func, *args, **kwargs):
        return func(*args, **kwargs) * 2.0

    def translate(q, k, v):
        boxes = (Container(q), Container(k), Container(v))
        call = cc.read_call(boxes, {"heads": 2, "scale": 0.3, "enable_gqa": False, "transformer_options": {"x": 1}})
        assert cc.layout_refusal(call) is None and cc.sparse_refusal(call) is None
        size = cc.head_dim(call)
        scaled = cc.scaled_query(call.q, call.scale, size)
        own = cc.dense_call(backend, None, call.args, call.kwargs)
        passed = cc.dense_call(backend, chained, call.args, call.kwargs, {"x": 2})
        return own, passed, scaled

    q, k, v = _qkv(length=16, heads=2, size=8)
    eager = translate(q, k, v)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(translate, backend=counter, fullgraph=True)
    out = compiled(q, k, v)
    assert counter.frame_count == 1
    for got, want in zip(out, eager):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(out[1], 2.0 * out[0])
    torch._dynamo.reset()


def test_recognises_the_core_node_by_module_and_factory(stack):
    from host import nodes_sparse_attention as core

    patch = core.SparseAttnPatch()
    inner = core.make_attention_override(patch, None)
    outer = core.make_attention_override(patch, inner)
    assert stack.is_foreign_sparse(outer) and stack.previous_of(outer) == (True, inner)
    assert stack.without_sparse(outer) is None
    # ComfyUI loads comfy_extras files under their path as module name
    loaded = core.make_attention_override(patch, None)
    loaded.__module__ = "/opt/ComfyUI/comfy_extras/nodes_sparse_attention"
    assert stack.is_foreign_sparse(loaded)

    def plain(func, *args, **kwargs):
        return func(*args, **kwargs)

    assert not stack.is_foreign_sparse(plain) and stack.previous_of(plain) == (False, None)
    assert stack.without_sparse(core.make_attention_override(patch, plain)) is plain
    # a later version of the node marks its override (the function, its patch and the override it chains)
    marked = functools.partial(plain)
    marked._block_sparse_attention_patch, marked._block_sparse_attention_previous = patch, inner
    assert stack.is_foreign_sparse(marked) and stack.previous_of(marked) == (True, inner)
    assert stack.without_sparse(marked) is None
