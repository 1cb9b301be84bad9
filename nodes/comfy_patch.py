"""One Chorus patch per ComfyUI model: the object ChorusSparseSampler, ChorusFeatureReuse and
ChorusGuidanceBoost all configure.

A :class:`ChorusPatch` holds the request's plan, the model's ``ModelInfo`` and up to three parts
(the engine's ``ChorusAttention`` from a ``SparseConfig``, ``FeatureReuse`` from a
``FeatureReuseConfig``, ``GuidanceBoost``). It lives under ONE key, ``transformer_options["chorus_ii"]``,
of a ``model.clone()``; :func:`configure` (what every node calls) reads the model's patch, if any,
and returns a clone with a new patch = the old parts + the node's part (configuring a part again
replaces it; the order of the nodes does not matter), then (re)installs with ComfyUI's supported hooks:

- ``optimized_attention_override`` = the patch itself (an override already set by another node is
  chained: everything Chorus does not handle, and every dense call, goes through it; a recognised
  sparse override such as ComfyUI's Model Sparse Attention node is skipped by Chorus's own dense calls,
  and where it has put itself on top the patch takes the top back in each forward:
  ``nodes/override_stack.py``). Calls are read in ComfyUI 0.3.64's and 0.38.x's conventions
  (``nodes/comfy_call.py``: q/k/v containers taken once, ``scale`` honoured);
- one ``OUTER_SAMPLE`` and one ``DIFFUSION_MODEL`` wrapper under the key ``"chorus_ii"`` (the old
  per-node keys ``"chorus_ii_feature_reuse"`` / ``"chorus_ii_guidance"`` are removed);
- with feature reuse, ``patches_replace["dit"][("double_block", i)]`` = a :class:`ChorusBlock` per block
  (a patch already at the key is chained and receives the compacted arguments); with the sparse
  sampler alone, one at block 0. Every ChorusBlock hands its block a row-major residual stream:
  ComfyUI's WanModel passes the patch embedding's ``transpose(1, 2)`` view (channel stride = L) on
  to its blocks, so without this each block's three layer norms copy the stream and its elementwise
  ops run strided (8% of a 720p hit's GPU time per step; docs/BENCHMARKS.md, run 15). The values are unchanged;
  every later block inherits the layout;
- with ``cfg_strength > 0``, a :class:`CfgCorrection` post-CFG function (an earlier one replaced).

Per sampler run (``OUTER_SAMPLE``): every part's ``begin_run(sigmas)``, and every reset in ``finally``.
Per diffusion-model forward (``DIFFUSION_MODEL``): the sigma is read once (one ``.item()``) and the
token grid comes from ``engine.token_grid`` of the latent's shape; both go, with a layer counter, into
a :class:`Forward` in a copy of that call's ``transformer_options``. Per attention call (the override):

- self-attention = q, k and v lengths equal the grid's token count (one test; inside a feature-reuse
  compacted block, the compact length: expanded back first, or run on the compact sequence, below);
  everything else with another k length
  is cross-attention (text, CLIP image tokens), which gets guidance's gain;
- self-attention runs, in this fixed order: expand (compacted block) -> first-frame bias + sparse (a
  hit) or dense (+ recording on a miss), through ``ChorusAttention``; or, without the sparse sampler,
  a biased dense call (``biased_dense_or_plain``) -> compact. So the bias is applied exactly once.
  A compacted block whose layout is in the hit's region order (feature reuse + an entry recorded with
  feature reuse, ``RegionTileOrder``) skips expand and compact: it attends on the compact sequence,
  each cell's key weighted as its tokens (``ChorusAttention.compact_self_attention``);
- a sparse sampler configured together with feature reuse (share > 0, regions of one block's tokens,
  frame 0 never pooled) records a miss in that region order, so the entry it writes serves such hits.

A Chorus patch that is not the one of the current forward (e.g. an old one another pack's override
chained before the model was re-patched) passes every call through. Objects stored in
``model_options`` return themselves from ``__deepcopy__`` (``clone()`` deep-copies ``model_options``).
Anything unexpected gives a note in the plan and dense attention / a full block, never a failed prompt.
"""

from __future__ import annotations

import logging

import torch

from ..engine import ChorusAttention, ModelInfo, Plan, token_grid
from ..engine.feature_reuse import FeatureReuse
from ..engine.guidance import GuidanceBoost, biased_dense_or_plain
from ..kernels import pooling
from . import comfy_call, host_report, override_stack
from .comfy_adapter import comfy_model_info

log = logging.getLogger("chorus.nodes")

PATCH_KEY = "chorus_ii"            # transformer_options: the model's ChorusPatch
WRAPPER_KEY = "chorus_ii"          # the keyed OUTER_SAMPLE / DIFFUSION_MODEL wrappers
FORWARD_KEY = "chorus_ii_forward"  # a forward's transformer_options copy: its Forward
LAYOUT_KEY = "chorus_ii_layout"    # a compacted block call's transformer_options copy: its RegionLayout
OVERRIDE = "optimized_attention_override"
LEGACY_OPTION_KEYS = ("chorus_ii_attention", "chorus_ii_guidance_boost")  # before one patch per model
LEGACY_WRAPPER_KEYS = ("chorus_ii_feature_reuse", "chorus_ii_guidance")
CLIP_IMAGE_TOKENS = 257
KEEP = object()  # configure(): leave that part as it is


class Forward:
    """One diffusion-model call: the patch that owns it, token grid, sigma (read once), layer counter,
    and why Chorus stays out of it (None: it does not)."""

    def __init__(self, patch: "ChorusPatch", grid, sigma: float | None, disabled_reason: str | None,
                 context_lengths=frozenset(), cond_or_uncond=None, route=None):
        self.patch = patch
        self.route = route  # issue 33: override_stack.Route of this forward (None: the patch's own chain)
        self.grid = grid
        self.tokens = grid[0] * grid[1] * grid[2]
        self.sigma = sigma
        self.disabled_reason = disabled_reason
        self.context_lengths = frozenset(context_lengths)
        self.cond_or_uncond = cond_or_uncond
        self.layer_counter = 0
        self._cond_rows: dict[int, torch.Tensor | None] = {}

    def __deepcopy__(self, memo):
        return self

    def next_layer(self) -> int:
        layer = self.layer_counter
        self.layer_counter += 1
        return layer

    def cond_rows(self, batch: int):
        """Bool ``[batch]`` marking positive-conditioning rows (from ``cond_or_uncond``), or None."""
        if batch not in self._cond_rows:
            rows = None
            cond = self.cond_or_uncond
            if cond and batch % len(cond) == 0:
                rows = torch.tensor([c == 0 for c in cond], dtype=torch.bool).repeat_interleave(batch // len(cond))
            self._cond_rows[batch] = rows
        return self._cond_rows[batch]


class ChorusPatch:
    """The one Chorus object of a patched model (see the module docstring). Its parts are not changed
    once it is installed: :func:`configure` makes a new one. ``plan`` may be None only for guidance
    without a plan. ``previous_override``: a non-Chorus override it chains (or None)."""

    def __init__(self, plan: Plan | None, model_info: ModelInfo, *, attention: ChorusAttention | None = None,
                 feature_reuse: FeatureReuse | None = None, guidance: GuidanceBoost | None = None,
                 previous_override=None):
        self.plan = plan
        self.model_info = model_info
        self.attention = attention
        self.feature_reuse = feature_reuse
        self.guidance = guidance
        self.previous_override = previous_override
        self._run_failed: str | None = None
        self._warned: set[str] = set()

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        parts = [n for n in ("attention", "feature_reuse", "guidance") if getattr(self, n) is not None]
        return f"ChorusPatch({self.model_info.variant}: {', '.join(parts) or 'no parts'}; {self.plan!r})"

    @property
    def is_empty(self) -> bool:
        return self.attention is None and self.feature_reuse is None and self.guidance is None

    def note(self, message: str) -> None:
        if self.plan is not None:
            self.plan.note(message)
        elif message not in self._warned:
            self._warned.add(message)
            log.warning("Chorus II: %s", message)

    # -- OUTER_SAMPLE: one sampler run ---------------------------------------------------------------
    def outer_sample(self, executor, *args, **kwargs):
        """OUTER_SAMPLE wrapper (args: noise, latent_image, sampler, sigmas, ...)."""
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        schedule = sigmas.detach().float().cpu() if isinstance(sigmas, torch.Tensor) else sigmas
        started = []
        self._run_failed = None
        # --- issue 33: another sparse override on this run's model (nodes/override_stack.py) ---
        guider = getattr(executor, "class_obj", None)
        stack_line = override_stack.run_note(getattr(guider, "model_options", None),
                                             getattr(guider, "model_patcher", None), self)
        if stack_line is not None:
            self.note(stack_line)
        # --- end issue 33 ---
        try:
            for part in (self.attention, self.feature_reuse):
                if part is None:
                    continue
                started.append(part)
                try:
                    part.begin_run(schedule)
                except Exception as exc:  # noqa: BLE001 - never fail the prompt: the run goes plain
                    self._run_failed = f"could not start the Chorus run ({type(exc).__name__}: {exc})"
                    self.note(f"{self._run_failed}; dense attention, full blocks")
            if self.guidance is not None:
                try:
                    self.guidance.sample_sigmas = (None if schedule is None else
                                                   [float(s) for s in (schedule.tolist() if hasattr(schedule, "tolist")
                                                                       else schedule)])
                except (TypeError, ValueError):
                    self.guidance.sample_sigmas = None
            try:
                return executor(*args, **kwargs)
            except BaseException as exc:  # issue 33: one line naming ComfyUI's version if Chorus code failed
                host_report.report_failure(exc)
                raise
        finally:
            for part in started:
                try:
                    part.end_run()
                except Exception as exc:  # noqa: BLE001
                    self.note(f"ending the Chorus run failed ({type(exc).__name__}: {exc})")
            if self.guidance is not None:
                self.guidance.sample_sigmas = None
            self._run_failed = None
            if self.plan is not None:
                log.info("Chorus II run: %s; %s%s", self.plan.message, self.plan.stats.summary(),
                         f"; {self.feature_reuse.state.summary()}" if self.feature_reuse is not None else "")

    # -- DIFFUSION_MODEL: one forward ----------------------------------------------------------------
    def diffusion_model(self, executor, *args, **kwargs):
        """DIFFUSION_MODEL wrapper (Wan args: x, timestep, context, clip_fea, time_dim_concat,
        transformer_options, ...): the per-forward :class:`Forward` into a copy of the options."""
        where, options = self._forward_options(args, kwargs)
        if where is None:
            return executor(*args, **kwargs)
        if where == "kw":
            kwargs["transformer_options"] = options
        else:
            args = args[:where] + (options,) + args[where + 1:]
        return executor(*args, **kwargs)

    # Under TorchCompileModel the model forward around this wrapper is compiled: reading sigma and
    # building the Forward run eagerly, so dynamo never sees sigma as a Python float (it specialised
    # on its value and recompiled the model at every step) and only passes the options dict through.
    @torch.compiler.disable
    def _forward_options(self, args, kwargs):
        """``(where, options)``: where the call's transformer_options are (``"kw"`` or an arg index) and
        a copy of them holding this forward's :class:`Forward`; ``(None, None)`` when this call is not a
        Wan video forward (the options are then left as they are)."""
        where, options = _find_transformer_options(args, kwargs)
        x = args[0] if args else kwargs.get("x")
        if where is None or not isinstance(x, torch.Tensor) or x.dim() != 5:
            return None, None
        try:
            grid = token_grid(x.shape)
        except ValueError:
            return None, None
        tokens = grid[0] * grid[1] * grid[2]
        context = args[2] if len(args) > 2 else kwargs.get("context")
        clip_fea = args[3] if len(args) > 3 and not isinstance(args[3], dict) else kwargs.get("clip_fea")
        extra_tokens = comfy_call.extra_token_input(args, kwargs)  # issue 33: + 0.38's context_latents
        context_lengths = set()
        if isinstance(context, torch.Tensor) and context.dim() == 3:
            context_lengths.add(int(context.shape[1]))
        if clip_fea is not None:
            context_lengths.add(CLIP_IMAGE_TOKENS)
        reason = None
        if self._run_failed is not None:
            reason = self._run_failed
        elif extra_tokens is not None:
            reason = f"extra tokens in this model call ({extra_tokens})"
        elif tokens in context_lengths:
            reason = (f"the latent has {tokens} tokens, as many as a cross-attention context: self- and "
                      "cross-attention cannot be told apart")
        sigma = None
        sigmas = options.get("sigmas")
        if isinstance(sigmas, torch.Tensor) and sigmas.numel() > 0:
            sigma = float(sigmas.reshape(-1)[0].item())  # the one host sync of the forward
        elif isinstance(sigmas, (int, float)):
            sigma = float(sigmas)
        route = override_stack.forward_route(self, options)  # issue 33: Chorus on top of a foreign sparse override
        options = dict(options)
        if route.top is not None:
            options[OVERRIDE] = route.top  # issue 33
        options[FORWARD_KEY] = Forward(self, grid, sigma, reason, context_lengths, options.get("cond_or_uncond"),
                                       route=route)
        return where, options

    # -- the attention override ----------------------------------------------------------------------
    def _pass(self, func, args, kwargs, own=False):
        """Hand a call on: ``own`` = Chorus's own dense call (a miss, a hit's fallback), else a call
        Chorus declines. In a Chorus forward, along that forward's ``override_stack.Route``."""
        # --- issue 33: route through the forward's override stack ---
        ctx = (kwargs.get("transformer_options") or {}).get(FORWARD_KEY)
        if ctx is not None and ctx.patch is self and ctx.route is not None:
            return override_stack.route_call(ctx.route, func, args, kwargs, own=own, forward_key=FORWARD_KEY)
        # --- end issue 33 ---
        if self.previous_override is not None:
            return self.previous_override(func, *args, **kwargs)
        return func(*args, **kwargs)

    # Under torch.compile (ComfyUI's TorchCompileModel compiles the diffusion model, this override
    # inside it) the override runs eagerly: dynamo tracing the plan's Python state (maps, refresh,
    # recorder) took minutes and its guards on the unpacked maps failed, so hits fell back to dense.
    @torch.compiler.disable
    def __call__(self, func, *args, **kwargs):
        # --- issue 33: both calling conventions (nodes/comfy_call.py): q/k/v containers taken once ---
        call = comfy_call.read_call(args, kwargs)
        if call is None:
            return self._pass(func, args, kwargs)
        args = call.args  # plain tensors from here on, to func and any chained override alike
        # --- end issue 33 ---
        options = kwargs.get("transformer_options") or {}
        ctx = options.get(FORWARD_KEY)
        if ctx is None or ctx.patch is not self:
            return self._pass(func, args, kwargs)
        q, k, v = args[:3]
        if comfy_call.layout_refusal(call) is not None:  # issue 33 (also a positional mask)
            return self._pass(func, args, kwargs)  # a layout we do not handle
        if k.shape[1] != q.shape[1]:  # cross-attention: text, CLIP image tokens
            out = self._pass(func, args, kwargs)
            guidance = self.guidance
            if guidance is not None and guidance.strength and ctx.sigma is not None and isinstance(out, torch.Tensor):
                return guidance.cross_attention(out, ctx.sigma)
            return out
        layout = options.get(LAYOUT_KEY)
        if layout is not None and q.shape[1] == v.shape[1] == layout.compact_length and layout.length == ctx.tokens:
            if layout.order is not None and self.attention is not None:  # self-attention on the compact sequence
                return self._self_attention(func, args, kwargs, ctx, options, layout)
            full = tuple(pooling.expand_tokens(t, layout) for t in (q, k, v))  # expand
            out = self._self_attention(func, full + tuple(args[3:]), kwargs, ctx, options)
            return pooling.compact_rows(out, layout)  # compact
        if q.shape[1] == v.shape[1] == ctx.tokens:
            return self._self_attention(func, args, kwargs, ctx, options)
        return self._pass(func, args, kwargs)

    def _self_attention(self, func, args, kwargs, ctx: Forward, options, layout=None):
        """(bias +) sparse or dense (+ recording) on the full grid; q/k/v ``[B, L, H*D]``. With a
        ``layout`` (a compacted block's, built in a token order): q/k/v ``[B, L', H*D]``, the compact
        sequence (``ChorusAttention.compact_self_attention``)."""
        attention, guidance = self.attention, self.guidance
        if ctx.disabled_reason is not None:
            if attention is not None or guidance is not None:
                self.note(f"{ctx.disabled_reason}; dense attention")
                if attention is not None:
                    attention.plan.stats.fallback_calls += 1
            return self._pass(func, args, kwargs)
        q, k, v = args[:3]
        # --- issue 33: heads, enable_gqa, low_precision_attention, unknown kwargs; scale honoured ---
        call = comfy_call.read_call(args, kwargs)
        refusal = comfy_call.sparse_refusal(call)
        batch, length, width = q.shape
        if refusal is not None:
            self.note(f"{refusal}; dense attention")
            if attention is not None:
                attention.plan.stats.fallback_calls += 1
            return self._pass(func, args, kwargs)
        heads = int(call.heads)
        head_dim = width // heads
        q = comfy_call.scaled_query(q, call.scale, head_dim)
        # --- end issue 33 ---
        sigma = ctx.sigma
        bias = 0.0
        if guidance is not None and guidance.image_strength and sigma is not None:
            try:
                bias = float(guidance.first_frame_bias(sigma))
            except Exception:  # noqa: BLE001 - guidance must never break attention
                bias = 0.0

        def to_bhld(t):
            return t.view(batch, t.shape[1], heads, head_dim).transpose(1, 2)

        def dense_fn(*_):  # issue 33: own=... (Chorus's own dense call skips a foreign sparse override)
            return self._pass(func, args, kwargs, own=attention is not None).view(
                batch, length, heads, head_dim).transpose(1, 2)

        if attention is not None:
            layer = options.get("block_index")  # newer ComfyUI; else the per-forward counter
            counted = ctx.next_layer()
            layer = counted if layer is None else layer
            if sigma is None:
                self.note("no sigma in transformer_options; dense attention")
                attention.plan.stats.fallback_calls += 1
                return self._pass(func, args, kwargs)
            if layout is not None:
                out = attention.compact_self_attention(to_bhld(q), to_bhld(k), to_bhld(v), layout=layout,
                                                       layer=int(layer), sigma=sigma, dense_fn=dense_fn,
                                                       cond_rows=ctx.cond_rows(batch), first_frame_bias=bias)
            else:
                out = attention.self_attention(to_bhld(q), to_bhld(k), to_bhld(v), layer=int(layer), sigma=sigma,
                                               grid=ctx.grid, dense_fn=dense_fn, cond_rows=ctx.cond_rows(batch),
                                               first_frame_bias=bias)
            return out.transpose(1, 2).reshape(batch, length, width)
        if bias:
            out = biased_dense_or_plain(dense_fn, ctx.grid[1] * ctx.grid[2], bias, self.note)(
                to_bhld(q), to_bhld(k), to_bhld(v))
            return out.transpose(1, 2).reshape(batch, length, width)
        return self._pass(func, args, kwargs)


class ChorusBlock:
    """``patches_replace["dit"][("double_block", layer)]`` of a Chorus patch: the residual stream made
    row-major (a copy only when it is not: see the module docstring), then, with feature reuse, the
    block through :meth:`FeatureReuse.block` (a compacted call carries its layout in ``LAYOUT_KEY``
    for the attention override); ``previous`` = a non-Chorus patch chained."""

    def __init__(self, patch: ChorusPatch, layer: int, previous=None):
        self.patch, self.layer, self.previous = patch, layer, previous

    def __deepcopy__(self, memo):
        return self

    def _run(self, args, extra):
        if self.previous is not None:
            return self.previous(args, extra)
        return extra["original_block"](args)

    def __call__(self, args, extra):
        x = args.get("img")
        if isinstance(x, torch.Tensor) and x.dim() == 3 and not x.is_contiguous():
            x = x.contiguous()
            args = dict(args, img=x)
        options = args.get("transformer_options") or {}
        ctx = options.get(FORWARD_KEY)
        handle = self.patch.feature_reuse
        if (handle is None or ctx is None or ctx.patch is not self.patch or ctx.disabled_reason is not None
                or not isinstance(x, torch.Tensor) or x.dim() != 3):
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
                if layout.compact_length in ctx.context_lengths:
                    raise ValueError(f"the compact sequence ({layout.compact_length} tokens) is as long as a "
                                     "cross-attention context")
                opts = dict(options)
                opts[LAYOUT_KEY] = layout
                call["transformer_options"] = opts
            return self._run(call, extra)["img"]

        return {"img": handle.block(block_fn, x, layer=self.layer, sigma=ctx.sigma, grid=ctx.grid,
                                    per_token=per_token)}


class CfgCorrection:
    """ComfyUI post-CFG function applying :meth:`GuidanceBoost.cfg_correction` (never raises)."""

    def __init__(self, boost: GuidanceBoost):
        self.boost = boost

    def __deepcopy__(self, memo):
        return self

    def __call__(self, args):
        denoised = args["denoised"]
        try:
            return self.boost.cfg_correction(denoised, args.get("cond_denoised"), args.get("uncond_denoised"),
                                             args.get("cond_scale"), args.get("sigma"))
        except Exception:  # noqa: BLE001 - guidance must never fail a prompt
            return denoised


def _per_token_vec(vec, length: int):
    """Wan time modulation ``[B, Tt, 6, C]`` as per-token ``[B, L, 6, C]`` (ComfyUI's ``repeat_e``), or
    None when it is one vector per sample (``Tt == 1``: nothing to compact)."""
    if not isinstance(vec, torch.Tensor) or vec.dim() != 4 or vec.shape[1] == 1:
        return None
    repeats = length // vec.shape[1]
    if repeats * vec.shape[1] == length:
        return torch.repeat_interleave(vec, repeats, dim=1)
    return torch.repeat_interleave(vec, repeats + 1, dim=1)[:, :length]


def _find_transformer_options(args, kwargs):
    if isinstance(kwargs.get("transformer_options"), dict):
        return "kw", kwargs["transformer_options"]
    for i in range(len(args) - 1, -1, -1):
        if isinstance(args[i], dict):
            return i, args[i]
    return None, None


# -- configuring a model ------------------------------------------------------------------------------

def get_patch(model) -> ChorusPatch | None:
    """The :class:`ChorusPatch` of a ModelPatcher, or None."""
    options = (getattr(model, "model_options", None) or {}).get("transformer_options") or {}
    patch = options.get(PATCH_KEY)
    return patch if isinstance(patch, ChorusPatch) else None


def configure(model, plan: Plan | None, *, sparse=KEEP, feature_reuse=KEEP, guidance=KEEP):
    """Return ``(clone, ChorusPatch or None, ModelInfo)``: a clone of ``model`` whose Chorus patch is
    the model's current one (if any) with the given parts set.

    ``sparse``: a ``SparseConfig``, ``feature_reuse``: a ``FeatureReuseConfig``, ``guidance``: a
    ``GuidanceBoost``; each may be ``KEEP`` (default: unchanged) or None (removed). ``plan``: the
    request's plan (None keeps the patch's plan). Every part is (re)built on that plan and the model's
    ``ModelInfo``; the sparse and feature-reuse parts only for a supported model. A patch with no parts
    left is uninstalled. The input model is never modified.
    """
    patched = model.clone()
    info = comfy_model_info(patched)
    old = get_patch(patched)
    if plan is None and old is not None:
        plan = old.plan
    if old is not None and plan is not None and old.plan is not None and old.plan is not plan:
        plan.note("the model was patched by Chorus nodes for another plan; this plan replaces it on that model")

    def keep(value, current):
        return current if value is KEEP else value

    sparse_config = keep(sparse, old.attention.config if old is not None and old.attention is not None else None)
    fr_config = keep(feature_reuse, old.feature_reuse.config if old is not None and old.feature_reuse is not None
                     else None)
    boost = keep(guidance, old.guidance if old is not None else None)

    attention = fr = None
    if plan is not None and info.supported:
        if sparse_config is not None:
            plan.serve_model(info)  # another model's entry: move to one made for this model, or demote, now
            attention = ChorusAttention(plan, sparse_config, info,
                                        record_region=_record_region(fr_config))
        if fr_config is not None:
            fr = FeatureReuse(plan, fr_config, info)
    if boost is not None and old is not None and boost is old.guidance and boost.plan is not None \
            and plan is not None and boost.plan is not plan:
        boost = GuidanceBoost(plan, boost.strength, boost.image_strength, boost.cfg_strength)  # follow the plan
    options = patched.model_options.setdefault("transformer_options", {})
    previous = options.get(OVERRIDE)
    if isinstance(previous, ChorusPatch):
        previous = previous.previous_override  # re-patching replaces the Chorus patch, never stacks
    # else: None, or another pack's override (one that chains an older Chorus patch: that one passes through)
    patch = ChorusPatch(plan if plan is not None else (boost.plan if boost is not None else None), info,
                        attention=attention, feature_reuse=fr, guidance=boost, previous_override=previous)
    _install(patched, patch)
    # --- issue 33: a foreign sparse override below this patch (nodes/override_stack.py) ---
    stack_line = None if patch.is_empty else override_stack.patch_note(previous, patch.attention is not None)
    if stack_line is not None:
        patch.note(stack_line)
    # --- end issue 33 ---
    return patched, (None if patch.is_empty else patch), info


def _record_region(fr_config):
    """Feature reuse's region when a miss should record in its region order (see the module
    docstring), else None (raster). A region that is not one block's tokens records raster too
    (``engine.signature.region_order_for`` decides)."""
    if fr_config is None or fr_config.downsample_share <= 0 or not fr_config.keep_first_frame:
        return None
    return tuple(fr_config.region)


def _install(patched, patch: ChorusPatch) -> None:
    import comfy.patcher_extension

    options = patched.model_options["transformer_options"]
    previous = patch.previous_override
    for key in LEGACY_OPTION_KEYS:
        options.pop(key, None)
    wrappers_mp = comfy.patcher_extension.WrappersMP
    wrapper_types = (wrappers_mp.OUTER_SAMPLE, wrappers_mp.DIFFUSION_MODEL)
    for wrapper_type in wrapper_types:
        for key in (WRAPPER_KEY,) + LEGACY_WRAPPER_KEYS:
            patched.remove_wrappers_with_key(wrapper_type, key)
    post_cfg = [fn for fn in patched.model_options.get("sampler_post_cfg_function", [])
                if not isinstance(fn, CfgCorrection)]
    dit = (options.get("patches_replace") or {}).get("dit") or {}
    for key in [k for k, v in dit.items() if isinstance(v, ChorusBlock)]:
        if dit[key].previous is None:
            del dit[key]
        else:
            dit[key] = dit[key].previous
    if patch.is_empty:  # nothing left to do: uninstall
        options.pop(PATCH_KEY, None)
        if previous is None:
            options.pop(OVERRIDE, None)
        else:
            options[OVERRIDE] = previous
    else:
        options[PATCH_KEY] = patch
        options[OVERRIDE] = patch
        patched.add_wrapper_with_key(wrapper_types[0], WRAPPER_KEY, patch.outer_sample)
        patched.add_wrapper_with_key(wrapper_types[1], WRAPPER_KEY, patch.diffusion_model)
        block_layers = (range(patch.model_info.num_layers) if patch.feature_reuse is not None
                        else range(1) if patch.attention is not None else ())
        if block_layers:
            dit = options.setdefault("patches_replace", {}).setdefault("dit", {})
            for layer in block_layers:
                dit[("double_block", layer)] = ChorusBlock(patch, layer, dit.get(("double_block", layer)))
        if patch.guidance is not None and patch.guidance.cfg_strength:
            post_cfg.append(CfgCorrection(patch.guidance))
    if post_cfg or "sampler_post_cfg_function" in patched.model_options:
        patched.model_options["sampler_post_cfg_function"] = post_cfg


def describe(patch: ChorusPatch | None) -> str:
    """One line naming the parts of a model's patch (for the nodes' UI text)."""
    if patch is None:
        return "no Chorus parts on this model"
    parts = []
    if patch.attention is not None:
        parts.append("sparse sampler")
    if patch.feature_reuse is not None:
        parts.append("feature reuse")
    if patch.guidance is not None:
        parts.append("guidance")
    stack_line = override_stack.patch_note(patch.previous_override, patch.attention is not None)  # issue 33
    return "Chorus patch: " + " + ".join(parts) + (f" | {stack_line}" if stack_line else "")
