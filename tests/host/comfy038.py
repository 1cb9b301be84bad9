"""Test doubles of ComfyUI 0.38.x's calling conventions, installed on the vendored 0.3.64 host.

ComfyUI 0.38.x cannot be run here (only single files of its source can be read); these doubles give
the 0.3.64 host 0.38.x's conventions where Chorus meets them. Written for these tests from ComfyUI's
public source as read on 2026-12-02 (behaviour described, no code taken), at these commits:

- ``comfy/ldm/modules/attention.py`` @ 05080f6022b2572df36a0aa6bcba413209c3d265:
  ``AttentionTensorContainer`` is single-owner (``peek()``; ``take()`` returns the tensor and empties the
  container; ``peek``/``take`` of an empty one raises RuntimeError). ``wrap_attn``: pops
  ``preferred_attention`` first; q, k, v must all be containers or none; on the outer call it sets
  ``_inside_attn_wrapper`` (removed afterwards); with an override in ``transformer_options``: the
  override's ``container_function(*containers, ...)`` if it has that attribute, else the tensors are
  taken and ``override(func, *tensors, ..., **kwargs)``; without an override: the
  ``preferred_attention.function`` if one is set, else (containers taken) ``func``. Backends honour
  ``scale=`` (default ``1/sqrt(D)``) and ``enable_gqa=`` (K/V heads from their width, repeated).
- ``comfy/ldm/wan/model.py`` @ 0c9a69aefdb1fcf6b9c60478aa9e511b01f8e96f: ``WanSelfAttention`` (RoPE'd,
  normed q/k and v as ``[B, L, H*D]``), ``WanT2VCrossAttention`` and ``WanI2VCrossAttention`` hand q/k/v
  over in containers with ``preferred_attention=self.comfy_attention`` (a ``ComfyAttention`` module,
  ``function`` None unless a checkpoint configures one); the I2V image branch adds
  ``low_precision_attention=False``. ``WanAttentionBlock.forward`` makes ``x`` contiguous first,
  modulates through ``modulate()`` (``addcmul`` on CPU / small inputs, ``comfy_kitchen.adaln`` on large
  CUDA ones: the same math) and runs the FFN as ``linear_input_act(ffn[2], ffn[0](x), "gelu_tanh")``
  (the GELU folded into the down projection: the same math). ``forward_orig`` stores ``grid_sizes``,
  ``total_blocks``, ``block_type="double"`` and, before each block, ``block_index`` in
  ``transformer_options``; the ``("double_block", i)`` patch arguments are unchanged. Other packs' patches
  in ``transformer_options["patches"]``: each ``attn1_patch`` gets ``{"x", "q", "k", "transformer_options"}``
  after self-attention (x ``[B, L, H*D]``, q and k the RoPE'd ``[B, L, H, D]``) and returns x; each
  ``attn2_patch`` gets ``{"x", "transformer_options"}`` after cross-attention and returns x (ComfyUI's
  MultiTalk / InfiniteTalk audio uses both: its attn2 patch reshapes x by ``grid_sizes``); after each block
  (and its replacement) each ``double_block`` patch gets ``{"img", "x", "vec", "block_index",
  "img_offset", "transformer_options"}`` and returns ``{"img": ...}``.
- ``comfy_extras/nodes_torch_compile.py`` (as stored on 2026-12-05 and 2026-12-07; 0.3.64 has no such filter):
  ``TorchCompileModel`` clones with ``disable_dynamic=True`` and always compiles (a version read on 2026-12-05:
  unless its ``mode`` input is set)
  with ``options={"guard_filter_fn": ...}`` keeping only the dynamo guards whose name does not contain
  ``transformer_options`` (:func:`torch_compile_guard_filter`).
- ``comfy/model_patcher.py`` @ 08d0e510f4e539a1db39072589817136ac6cfa7d and ``comfy/samplers.py`` @
  311c01406130b2acbe8ab291043502de26cf3871: ``prepare_state(timestep, model_options)`` calls each
  ``ON_PREPARE_STATE`` callback as ``callback(patcher, timestep, model_options)``; ``_calc_cond_batch``
  calls it with the step's ``model_options`` before the model calls (0.3.64: ``prepare_state(timestep)``
  and ``callback(patcher, timestep)``).
- ``comfy/context_windows.py`` (comfyanonymous/ComfyUI @ 0258521e): ``IndexListContextHandler.get_resized_cond``
  also cuts a model cond whose tensor has the window dimension (``cond.size(dim) == x.size(dim)`` with
  ``dim < cond.ndim``: Wan I2V's ``c_concat``) to the window's frames; 0.3.64 leaves it whole, so an I2V model
  cannot sample in windows there (:func:`install_context_window_conds`).
- ``comfy/context_windows.py`` with Comfy-Org/ComfyUI's causal window fix (its PR 13563, read in the
  drozbay/ComfyUI fork @ 03e034e256a513e838c159dcb638124d7eb70efe): with the handler's ``causal_window_fix``
  on, every window but the first gets ``causal_anchor_index`` (the frame before it), ``get_tensor`` puts that
  frame in front of the window's (x, the timestep's dimension 0 when it is longer than 1, the cut conds), the
  model runs on one frame more, and that frame's output is dropped before the windows are combined
  (:func:`install_context_window_anchor`).

:func:`install` applies all of it but the last two with a pytest ``monkeypatch`` (undone after the test).
"""

from __future__ import annotations

import functools

import torch


class AttentionTensorContainer:
    """Single-owner holder of one attention input (see the module docstring)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def peek(self) -> torch.Tensor:
        if self.tensor is None:
            raise RuntimeError("attention tensor container has already been consumed")
        return self.tensor

    def take(self) -> torch.Tensor:
        tensor = self.peek()
        self.tensor = None
        return tensor


def torch_compile_guard_filter(guard_entries) -> list[bool]:
    """0.38.x ``TorchCompileModel``'s ``guard_filter_fn`` (module docstring): keep a guard unless its name
    mentions ``transformer_options``."""
    return ["transformer_options" not in entry.name for entry in guard_entries]


class ComfyAttention(torch.nn.Module):
    """A Wan attention module's ``preferred_attention`` (no parameters; ``function`` None by default)."""

    def __init__(self, function=None):
        super().__init__()
        self.function = function


def wrap_attn(func):
    """0.38.x's decorator of an attention backend (behaviour as in the module docstring)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        preferred = kwargs.pop("preferred_attention", None)
        boxed = len(args) >= 3 and isinstance(args[0], AttentionTensorContainer)
        if boxed and not all(isinstance(a, AttentionTensorContainer) for a in args[1:3]):
            raise TypeError("q, k and v must all be containers")

        def unboxed():
            return tuple(a.take() for a in args[:3]) + tuple(args[3:]) if boxed else args

        outer = "_inside_attn_wrapper" not in kwargs
        if not outer:
            return func(*unboxed(), **kwargs)
        kwargs["_inside_attn_wrapper"] = True
        try:
            options = kwargs.get("transformer_options")
            override = None if options is None else options.get("optimized_attention_override")
            if override is not None:
                if boxed and hasattr(override, "container_function"):
                    return override.container_function(*args, **kwargs)
                return override(func, *unboxed(), **kwargs)
            if preferred is not None and preferred.function is not None:
                return preferred.function(*args, **kwargs)
            return func(*unboxed(), **kwargs)
        finally:
            del kwargs["_inside_attn_wrapper"]

    return wrapper


def sdpa_backend(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
    """A raw 0.38.x-style backend on PyTorch SDPA: ``[B, L, H*D]`` in and out (or ``[B, H, L, D]`` with
    ``skip_reshape``), ``scale=`` and ``enable_gqa=`` honoured, other keyword arguments ignored."""
    if skip_reshape:
        qh, kh, vh = q, k, v
    else:
        batch, _, width = q.shape
        size = width // heads
        qh = q.view(batch, -1, heads, size).transpose(1, 2)
        kh = k.view(batch, -1, k.shape[-1] // size, size).transpose(1, 2)
        vh = v.view(batch, -1, v.shape[-1] // size, size).transpose(1, 2)
    if kwargs.get("enable_gqa", False) and kh.shape[1] != qh.shape[1]:
        repeat = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(repeat, dim=1), vh.repeat_interleave(repeat, dim=1)
    extra = {"scale": kwargs["scale"]} if kwargs.get("scale") is not None else {}
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, **extra)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(out.shape[0], -1, out.shape[1] * out.shape[-1])


optimized_attention = wrap_attn(sdpa_backend)


def _preferred(module):
    preferred = getattr(module, "comfy_attention", None)
    return preferred if preferred is not None else ComfyAttention()


def self_attention_forward(self, x, freqs, transformer_options={}):  # noqa: B006 - ComfyUI's signature
    """WanSelfAttention.forward, 0.38.x convention."""
    from comfy.ldm.flux.math import apply_rope1

    batch, length = x.shape[:2]
    heads, size = self.num_heads, self.head_dim
    q = apply_rope1(self.norm_q(self.q(x)).view(batch, length, heads, size), freqs)
    k = apply_rope1(self.norm_k(self.k(x)).view(batch, length, heads, size), freqs)
    boxed = [AttentionTensorContainer(t.view(batch, length, heads * size)) for t in (q, k, self.v(x))]
    out = optimized_attention(*boxed, heads=heads, preferred_attention=_preferred(self),
                              transformer_options=transformer_options)
    for patch in transformer_options.get("patches", {}).get("attn1_patch", ()):
        out = patch({"x": out, "q": q, "k": k, "transformer_options": transformer_options})
    return self.o(out)


def t2v_cross_attention_forward(self, x, context, transformer_options={}, **kwargs):  # noqa: B006
    """WanT2VCrossAttention.forward, 0.38.x convention."""
    boxed = [AttentionTensorContainer(t) for t in (self.norm_q(self.q(x)), self.norm_k(self.k(context)),
                                                   self.v(context))]
    out = optimized_attention(*boxed, heads=self.num_heads, preferred_attention=_preferred(self),
                              transformer_options=transformer_options)
    return self.o(out)


def i2v_cross_attention_forward(self, x, context, context_img_len, transformer_options={}):  # noqa: B006
    """WanI2VCrossAttention.forward, 0.38.x convention (image branch: low_precision_attention=False)."""
    image, text = context[:, :context_img_len], context[:, context_img_len:]
    q = self.norm_q(self.q(x))
    image_out = optimized_attention(
        AttentionTensorContainer(q), AttentionTensorContainer(self.norm_k_img(self.k_img(image))),
        AttentionTensorContainer(self.v_img(image)), heads=self.num_heads, preferred_attention=_preferred(self),
        transformer_options=transformer_options, low_precision_attention=False)
    text_out = optimized_attention(
        AttentionTensorContainer(q), AttentionTensorContainer(self.norm_k(self.k(text))),
        AttentionTensorContainer(self.v(text)), heads=self.num_heads, preferred_attention=_preferred(self),
        transformer_options=transformer_options)
    return self.o(text_out + image_out)


def block_forward(self, x, e, freqs, context, context_img_len=257, transformer_options={}):  # noqa: B006
    """WanAttentionBlock.forward, 0.38.x convention (CPU path of ``modulate``; FFN with its GELU-tanh
    applied to the up projection's output before the down projection)."""
    from comfy.ldm.wan.model import repeat_e
    from comfy.model_management import cast_to

    modulation = cast_to(self.modulation, dtype=x.dtype, device=x.device)
    e = (modulation + e).chunk(6, dim=1) if e.ndim < 4 else (modulation.unsqueeze(0) + e).unbind(2)

    def modulate(h, norm, shift, scale):
        return torch.addcmul(repeat_e(shift, h), norm(h), 1 + repeat_e(scale, h))

    x = x.contiguous()
    x = torch.addcmul(x, self.self_attn(modulate(x, self.norm1, e[0], e[1]), freqs,
                                        transformer_options=transformer_options), repeat_e(e[2], x))
    x = x + self.cross_attn(self.norm3(x), context, context_img_len=context_img_len,
                            transformer_options=transformer_options)
    for patch in transformer_options.get("patches", {}).get("attn2_patch", ()):
        x = patch({"x": x, "transformer_options": transformer_options})
    hidden = torch.nn.functional.gelu(self.ffn[0](modulate(x, self.norm2, e[3], e[4])), approximate="tanh")
    return torch.addcmul(x, self.ffn[2](hidden), repeat_e(e[5], x))


def forward_orig(self, x, t, context, clip_fea=None, freqs=None, transformer_options={}, **kwargs):  # noqa: B006
    """WanModel.forward_orig, 0.38.x convention, for the plain WanModel (no reference / in-context
    latents): per-block ``block_index`` and the other block keys in ``transformer_options``; after each
    block the ``patches["double_block"]`` patches (module docstring)."""
    from comfy.ldm.wan.model import sinusoidal_embedding_1d

    x_input = x
    x = self.patch_embedding(x.float()).to(x.dtype)
    grid_sizes = x.shape[2:]
    transformer_options["grid_sizes"] = grid_sizes
    x = x.flatten(2).transpose(1, 2)
    e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, t.flatten()).to(dtype=x[0].dtype))
    e = e.reshape(t.shape[0], -1, e.shape[-1])
    e0 = self.time_projection(e).unflatten(2, (6, self.dim))
    context = self.text_embedding(context)
    context_img_len = None
    if clip_fea is not None and self.img_emb is not None:
        context = torch.concat([self.img_emb(clip_fea), context], dim=1)
        context_img_len = clip_fea.shape[-2]
    replace = (transformer_options.get("patches_replace") or {}).get("dit", {})
    transformer_options["total_blocks"] = len(self.blocks)
    transformer_options["block_type"] = "double"
    for index, block in enumerate(self.blocks):
        transformer_options["block_index"] = index

        def original_block(args, block=block):
            return {"img": block(args["img"], context=args["txt"], e=args["vec"], freqs=args["pe"],
                                 context_img_len=context_img_len, transformer_options=args["transformer_options"])}

        args = {"img": x, "txt": context, "vec": e0, "pe": freqs, "transformer_options": transformer_options}
        patch = replace.get(("double_block", index))
        x = patch(args, {"original_block": original_block})["img"] if patch is not None else original_block(args)["img"]
        for after in transformer_options.get("patches", {}).get("double_block", ()):
            x = after({"img": x, "x": x_input, "vec": e, "block_index": index, "img_offset": 0,
                       "transformer_options": transformer_options})["img"]
    x = self.head(x, e)
    return self.unpatchify(x, grid_sizes)


def prepare_state(self, timestep, model_options=None):
    """ModelPatcher.prepare_state, 0.38.x convention. The 0.3.64 call site (no ``model_options``) is a
    no-op: :func:`install` makes ``_calc_cond_batch`` call this with the step's ``model_options`` first."""
    if model_options is None:
        return
    import comfy.patcher_extension

    for callback in self.get_all_callbacks(comfy.patcher_extension.CallbacksMP.ON_PREPARE_STATE):
        callback(self, timestep, model_options)


def install(monkeypatch) -> None:
    """Give the imported 0.3.64 host 0.38.x's conventions (module docstring) until the test ends."""
    import comfy.ldm.wan.model as wan
    import comfy.model_patcher
    import comfy.samplers

    monkeypatch.setattr(wan.WanSelfAttention, "forward", self_attention_forward)
    monkeypatch.setattr(wan.WanT2VCrossAttention, "forward", t2v_cross_attention_forward)
    monkeypatch.setattr(wan.WanI2VCrossAttention, "forward", i2v_cross_attention_forward)
    monkeypatch.setattr(wan.WanAttentionBlock, "forward", block_forward)
    monkeypatch.setattr(wan.WanModel, "forward_orig", forward_orig)
    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "prepare_state", prepare_state)
    calc = comfy.samplers._calc_cond_batch

    def calc_cond_batch(model, conds, x_in, timestep, model_options):
        model.current_patcher.prepare_state(timestep, model_options)
        return calc(model, conds, x_in, timestep, model_options)

    monkeypatch.setattr(comfy.samplers, "_calc_cond_batch", calc_cond_batch)


def install_context_window_conds(monkeypatch) -> None:
    """Give 0.3.64's context windows the later cutting of model conds to each window (module docstring)."""
    import comfy.context_windows as context_windows

    resized = context_windows.IndexListContextHandler.get_resized_cond

    def get_resized_cond(self, cond_in, x_in, window, device=None):
        conds = resized(self, cond_in, x_in, window, device)
        for cond in conds or ():
            model_conds = cond.get("model_conds")
            for key, value in (model_conds or {}).items():
                tensor = getattr(value, "cond", None)
                if isinstance(tensor, torch.Tensor) and self.dim < tensor.ndim \
                        and tensor.size(self.dim) == x_in.size(self.dim):
                    model_conds[key] = value._copy_with(window.get_tensor(tensor, device))
        return conds

    monkeypatch.setattr(context_windows.IndexListContextHandler, "get_resized_cond", get_resized_cond)


def install_context_window_anchor(monkeypatch) -> None:
    """Give 0.3.64's context windows the later causal window fix, on (module docstring)."""
    import comfy.context_windows as context_windows

    window_class = context_windows.IndexListContextWindow
    get_tensor = window_class.get_tensor
    evaluate = context_windows.IndexListContextHandler.evaluate_context_windows

    def anchored_get_tensor(self, full, device=None, dim=None):
        anchor = getattr(self, "causal_anchor_index", None)
        if anchor is None:
            return get_tensor(self, full, device, dim)
        dim = self.dim if dim is None else dim
        if dim == 0 and full.shape[dim] == 1:
            return full
        return full[tuple([slice(None)] * dim + [[anchor] + list(self.index_list)])].to(device)

    def evaluate_context_windows(self, calc_cond_batch, model, x_in, conds, timestep, enumerated_windows,
                                 model_options, device=None, first_device=None):
        anchored = set()
        for _, window in enumerated_windows:
            anchor = window.index_list[0] - 1
            if 0 <= anchor < x_in.size(self.dim):
                window.causal_anchor_index = anchor
                anchored.add(id(window))
        results = evaluate(self, calc_cond_batch, model, x_in, conds, timestep, enumerated_windows, model_options,
                           device, first_device)
        return [result._replace(sub_conds_out=[out.narrow(self.dim, 1, out.shape[self.dim] - 1)
                                               for out in result.sub_conds_out])
                if id(result.window) in anchored else result for result in results]

    monkeypatch.setattr(window_class, "get_tensor", anchored_get_tensor)
    monkeypatch.setattr(context_windows.IndexListContextHandler, "evaluate_context_windows", evaluate_context_windows)
