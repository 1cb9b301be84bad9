"""One Wan forward of a Chorus-patched model, on ComfyUI's side: the keys of the forward's options
copy, the host-side :class:`Forward`, and the block patches (:class:`ChorusBlock`; :class:`ReducingBlock`
in a forward whose blocks feature reuse reduces).

The DIFFUSION_MODEL wrapper (``nodes/comfy_patch.py``) hands the model an options copy carrying
constants for the traced code (:data:`MODE_KEY`, :data:`TOKENS_KEY`, :data:`GAIN_KEY`, :data:`REUSE_KEY`,
:data:`DENSE_KEY`) and the :class:`Forward` (:data:`FORWARD_KEY`, read by host-side code only). A compacted block call's
options carry its ``RegionLayout`` (:data:`LAYOUT_KEY`).
"""

from __future__ import annotations

import torch

from ..engine import attend as engine_attend

FORWARD_KEY = "chorus_ii_forward"  # a forward's options copy: its Forward (host-side code only)
MODE_KEY = "chorus_ii_mode"        # a forward's options copy: "attend" | "record" (absent: pass)
TOKENS_KEY = "chorus_ii_tokens"    # a forward's options copy: the token grid's length
GAIN_KEY = "chorus_ii_gain"        # a forward's options copy: guidance's cross-attention gain
REUSE_KEY = "chorus_ii_feature_reuse"  # a forward's options copy: "reduce" (a hit) | "record" (a miss)
LAYOUT_KEY = "chorus_ii_layout"    # a compacted block call's options copy: its RegionLayout
DENSE_KEY = "chorus_ii_dense"      # a forward's options copy: (chain,) for Chorus's own dense calls, when it
                                   # is not the override's own chain (a foreign sparse override skipped)
FORWARD_KEYS = (FORWARD_KEY, MODE_KEY, TOKENS_KEY, GAIN_KEY, REUSE_KEY, LAYOUT_KEY, DENSE_KEY)


class Forward:
    """One diffusion-model call, as the host-side code sees it: the patch that owns it, the engine's
    :class:`~chorus.engine.attend.ForwardContext` (grid, sigma, layer counter, why Chorus stays out),
    and the lengths of its cross-attention contexts."""

    def __init__(self, patch, context: engine_attend.ForwardContext, context_lengths=frozenset()):
        self.patch = patch
        self.context = context
        self.context_lengths = frozenset(context_lengths)

    def __deepcopy__(self, memo):
        return self


class ChorusBlock:
    """``patches_replace["dit"][("double_block", layer)]`` of Chorus-patched models: the residual stream
    made row-major (ComfyUI's WanModel passes its patch embedding's ``transpose(1, 2)`` view to the
    blocks, whose three layer norms would each copy it: 8% of a 720p hit's GPU time per step,
    docs/BENCHMARKS.md, run 15; a copy only when it is not); a miss's full block records its region
    scores (``torch.ops.chorus.record_block``). In a forward whose blocks feature reuse reduces (a hit),
    the layer's ``reducing`` patch (:class:`ReducingBlock`) takes its place and runs :meth:`feature_reuse`:
    the block through the forward's patch's :meth:`FeatureReuse.block` on the host side (a compacted call
    carries its layout in :data:`LAYOUT_KEY` for the attention override). ``previous`` = a non-Chorus block patch
    chained. One object per (layer, previous) (:meth:`at`), the same for every request, so a compiled
    model's guards see the same block patch."""

    _instances: dict = {}

    def __init__(self, layer: int, previous=None):
        self.layer, self.previous = layer, previous
        self.reducing = ReducingBlock(self)  # this layer's patch in a forward whose blocks feature reuse reduces

    @classmethod
    def at(cls, layer: int, previous=None) -> "ChorusBlock":
        key = (int(layer), id(previous))
        found = cls._instances.get(key)
        if found is None or found.previous is not previous:
            found = cls._instances[key] = cls(int(layer), previous)
        return found

    def __deepcopy__(self, memo):
        return self

    def _run(self, args, extra):
        if self.previous is not None:
            return self.previous(args, extra)
        return extra["original_block"](args)

    def __call__(self, args, extra):
        x = args.get("img")
        if isinstance(x, torch.Tensor) and x.dim() == 3 and not x.is_contiguous():
            args = dict(args, img=x.contiguous())
        options = args.get("transformer_options") or {}
        out = self._run(args, extra)
        if options.get(REUSE_KEY) == "record" and isinstance(out, dict) and isinstance(out.get("img"), torch.Tensor):
            engine_attend.record_block(args["img"], out["img"], self.layer)
        return out

    def feature_reuse(self, args, extra):
        """The block through the forward's :meth:`FeatureReuse.block` (host side; a full block where
        feature reuse does not apply)."""
        x = args.get("img")
        if isinstance(x, torch.Tensor) and x.dim() == 3 and not x.is_contiguous():
            x = x.contiguous()
            args = dict(args, img=x)
        options = args.get("transformer_options") or {}
        forward = options.get(FORWARD_KEY)
        handle = forward.patch.feature_reuse if isinstance(forward, Forward) else None
        if handle is None or forward.context.disabled_reason is not None or not isinstance(x, torch.Tensor) \
                or x.dim() != 3:
            return self._run(args, extra)
        pe = args.get("pe")
        if not isinstance(pe, torch.Tensor) or pe.dim() < 3 or pe.shape[1] != x.shape[1] or pe.shape[-2:] != (2, 2):
            handle.plan.note("feature reuse: unexpected RoPE layout in the block arguments; blocks run in full")
            return self._run(args, extra)
        per_token = {"pe": (pe, "rotation")}
        vec_tok = _per_token_vec(args.get("vec"), x.shape[1])
        if vec_tok is not None:
            per_token["vec"] = (vec_tok, "mean")

        def block_fn(x_in, inputs, layout):
            if layout is None and x_in is x:
                return self._run(args, extra)["img"]
            call = dict(args)
            call["img"] = x_in
            call["pe"] = inputs["pe"]
            if "vec" in inputs:
                call["vec"] = inputs["vec"]
            if layout is not None:
                if layout.compact_length in forward.context_lengths:
                    raise ValueError(f"the compact sequence ({layout.compact_length} tokens) is as long as a "
                                     "cross-attention context")
                opts = dict(options)
                opts[LAYOUT_KEY] = layout
                call["transformer_options"] = opts
            return self._run(call, extra)["img"]

        context = forward.context
        return {"img": handle.block(block_fn, x, layer=self.layer, sigma=context.sigma, grid=context.grid,
                                    per_token=per_token)}


class ReducingBlock:
    """The block patch of one layer in a forward whose blocks feature reuse reduces (a hit with
    ``ChorusFeatureReuse``; the DIFFUSION_MODEL wrapper puts it in that forward's options copy in place
    of the layer's :class:`ChorusBlock`). Its reduced blocks follow each step's redundant regions, so
    the whole call runs on the host side: ``__call__`` is ``torch.compiler.disable``'d, a graph break
    at the call under ``TorchCompileModel`` and no compiled frame of its own. (A traced call that breaks
    inside would be a frame per layer, each guarded on its own block patch: with 40 layers dynamo's
    recompile limit, 8 per code object, would be spent, and later compiled requests in the process --
    a miss -- would run eagerly; docs/BENCHMARKS.md, runs 30 and 32.)"""

    def __init__(self, block: ChorusBlock):
        self.block = block

    def __deepcopy__(self, memo):
        return self

    @torch.compiler.disable
    def __call__(self, args, extra):
        return self.block.feature_reuse(args, extra)


def reducing_blocks(patches_replace) -> dict:
    """A copy of ``transformer_options["patches_replace"]`` whose Chorus block patches are the
    layers' :class:`ReducingBlock` (other patches as they are); the input is not changed."""
    patches = dict(patches_replace or {})
    patches["dit"] = {key: (block.reducing if isinstance(block, ChorusBlock) else block)
                      for key, block in (patches.get("dit") or {}).items()}
    return patches


def _per_token_vec(vec, length: int):
    """Wan time modulation ``[B, Tt, 6, C]`` as per-token ``[B, L, 6, C]`` (ComfyUI's ``repeat_e``), or
    None when it is one vector per sample (``Tt == 1``: nothing to compact)."""
    if not isinstance(vec, torch.Tensor) or vec.dim() != 4 or vec.shape[1] == 1:
        return None
    repeats = length // vec.shape[1]
    if repeats * vec.shape[1] == length:
        return torch.repeat_interleave(vec, repeats, dim=1)
    return torch.repeat_interleave(vec, repeats + 1, dim=1)[:, :length]
