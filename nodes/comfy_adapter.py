"""ComfyUI glue: patch a Wan ``ModelPatcher`` so its self-attention goes through the engine.

Uses only ComfyUI's supported hooks (no module globals are touched):

- ``model.clone()``; the original model is never modified.
- ``model_options["transformer_options"]["optimized_attention_override"]`` = a
  :class:`ChorusOverride` (callable ``override(func, *args, **kwargs)``). An override already set
  by another node is chained: every call that Chorus does not handle, and every dense call, goes
  through it. An earlier *Chorus* override on the same model is replaced, not stacked.
- keyed wrappers (key ``"chorus_ii"``): OUTER_SAMPLE brackets each sampler run
  (``ChorusAttention.begin_run(sigmas)`` ... ``end_run()`` in ``finally``), DIFFUSION_MODEL computes
  the token grid from ``x`` ``[B, C, T, H, W]`` (``T' = T``, ``H' = ceil(H/2)``, ``W' = ceil(W/2)``)
  and puts a per-forward :class:`ForwardContext` (layer counter) into a copy of that call's
  ``transformer_options``.

Self-attention is the call whose q and k lengths both equal the token count of the grid; q/k/v
arrive as ``[B, L, heads * head_dim]`` with ``heads``. When ChorusGuidanceBoost is on the model
(``transformer_options[GUIDANCE_KEY]``, in either node order) its first-frame logit bias is applied
here, in the sparse kernel or in a biased dense call, so it is applied exactly once per call. Cross-attention (text, CLIP image) and any
call with a mask or another layout pass through untouched. The layer comes from
``transformer_options["block_index"]`` when ComfyUI provides it (newer versions), else from the
per-forward counter. The step comes from ``transformer_options["sigmas"]`` (see engine routing).
Objects stored in ``model_options`` return themselves from ``__deepcopy__`` (``clone()`` deep-copies
``model_options``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math

import torch

from ..engine import ChorusAttention, ModelInfo, Plan, SparseConfig, wan_model_info
from ..engine.guidance import biased_dense_or_plain

log = logging.getLogger("chorus.nodes")

WRAPPER_KEY = "chorus_ii"
HANDLE_KEY = "chorus_ii_attention"
FORWARD_KEY = "chorus_ii_forward"
CLIP_IMAGE_TOKENS = 257
GUIDANCE_KEY = "chorus_ii_guidance_boost"  # transformer_options: the GuidanceBoost of ChorusGuidanceBoost


class ForwardContext:
    """Per diffusion-model forward: token grid, self-attention counter, and whether Chorus is off."""

    def __init__(self, grid, disabled_reason: str | None = None, sigma: float | None = None):
        self.grid = grid
        self.sigma = sigma  # read once per forward: one device sync per forward, not one per attention call
        self.tokens = grid[0] * grid[1] * grid[2] if grid else -1
        self.layer_counter = 0
        self.disabled_reason = disabled_reason

    def __deepcopy__(self, memo):
        return self


class ChorusOverride:
    """The attention override installed on one patched model (one expert)."""

    def __init__(self, attention: ChorusAttention, previous=None):
        self.attention = attention
        self.previous = previous

    def __deepcopy__(self, memo):
        return self

    def _dense(self, func, args, kwargs):
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    def __call__(self, func, *args, **kwargs):
        options = kwargs.get("transformer_options") or {}
        ctx = options.get(FORWARD_KEY)
        if ctx is None or len(args) < 3:
            return self._dense(func, args, kwargs)
        q, k, v = args[:3]
        heads = kwargs.get("heads", args[3] if len(args) > 3 else None)
        if (not isinstance(q, torch.Tensor) or q.dim() != 3 or not isinstance(k, torch.Tensor) or k.dim() != 3
                or k.shape[1] != q.shape[1] or q.shape[1] != ctx.tokens or kwargs.get("mask") is not None
                or kwargs.get("skip_reshape") or kwargs.get("skip_output_reshape") or not heads):
            return self._dense(func, args, kwargs)  # cross-attention or a layout we do not handle
        plan = self.attention.plan
        layer = options.get("block_index")
        counted = ctx.layer_counter
        ctx.layer_counter += 1
        if layer is None:
            layer = counted
        batch, length, width = q.shape
        heads = int(heads)
        if width % heads:
            plan.note(f"q width {width} is not a multiple of {heads} heads; dense attention")
            plan.stats.fallback_calls += 1
            return self._dense(func, args, kwargs)
        head_dim = width // heads
        sigma = ctx.sigma if ctx.sigma is not None else options.get("sigmas")
        bias = guidance_first_frame_bias(options, sigma)

        def to_bhld(t):
            return t.view(batch, length, heads, head_dim).transpose(1, 2)

        def dense_fn(*_):
            out = self._dense(func, args, kwargs)
            return out.view(batch, length, heads, head_dim).transpose(1, 2)

        if ctx.disabled_reason is not None:
            plan.note(ctx.disabled_reason)
            plan.stats.fallback_calls += 1
            if bias:
                biased = biased_dense_or_plain(dense_fn, ctx.grid[1] * ctx.grid[2], bias, plan.note)
                return biased(to_bhld(q), to_bhld(k), to_bhld(v)).transpose(1, 2).reshape(batch, length, width)
            return self._dense(func, args, kwargs)

        cond_rows = None
        cond_or_uncond = options.get("cond_or_uncond")
        if cond_or_uncond and batch % len(cond_or_uncond) == 0:
            per = batch // len(cond_or_uncond)
            cond_rows = torch.tensor([c == 0 for c in cond_or_uncond], dtype=torch.bool).repeat_interleave(per)
        if sigma is None:
            plan.note("no sigma in transformer_options; dense attention")
            plan.stats.fallback_calls += 1
            return self._dense(func, args, kwargs)
        out = self.attention.self_attention(to_bhld(q), to_bhld(k), to_bhld(v), layer=int(layer), sigma=sigma,
                                            grid=ctx.grid, dense_fn=dense_fn, cond_rows=cond_rows,
                                            first_frame_bias=bias)
        return out.transpose(1, 2).reshape(batch, length, width)


def guidance_first_frame_bias(options: dict, sigma) -> float:
    """The first-frame logit bias ChorusGuidanceBoost asks for in this call (0.0 when no guidance is
    installed on the model, or it does not act at ``sigma``); never raises."""
    boost = options.get(GUIDANCE_KEY)
    if boost is None or sigma is None:
        return 0.0
    try:
        return float(boost.first_frame_bias(sigma))
    except Exception:  # noqa: BLE001 - guidance must never break attention
        return 0.0


def chain_has_chorus_attention(override) -> bool:
    """Whether a :class:`ChorusOverride` is reachable in an attention-override chain (links:
    ``.previous`` / ``.inner``, as Chorus' own overrides name them)."""
    seen = 0
    while override is not None and seen < 64:
        if isinstance(override, ChorusOverride):
            return True
        override = getattr(override, "previous", None) or getattr(override, "inner", None)
        seen += 1
    return False


def latent_token_grid(x) -> tuple[int, int, int] | None:
    """Token grid ``(T, ceil(H/2), ceil(W/2))`` of a Wan latent ``x [B, C, T, H, W]`` (patch 1x2x2), or None."""
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return None
    _, _, t, h, w = x.shape
    return int(t), math.ceil(h / 2), math.ceil(w / 2)


def _find_transformer_options(args, kwargs):
    if isinstance(kwargs.get("transformer_options"), dict):
        return "kw", kwargs["transformer_options"]
    for i in range(len(args) - 1, -1, -1):
        if isinstance(args[i], dict):
            return i, args[i]
    return None, None


def diffusion_model_wrapper(override: ChorusOverride, executor, *args, **kwargs):
    """DIFFUSION_MODEL wrapper: per-forward token grid and layer counter (args: x, timestep, context,
    clip_fea, time_dim_concat, transformer_options, ...)."""
    where, options = _find_transformer_options(args, kwargs)
    grid = latent_token_grid(args[0] if args else kwargs.get("x"))
    if where is None or grid is None:
        return executor(*args, **kwargs)
    tokens = grid[0] * grid[1] * grid[2]
    reason = None
    time_dim_concat = args[4] if len(args) > 4 and not isinstance(args[4], dict) else kwargs.get("time_dim_concat")
    if time_dim_concat is not None or "reference_latent" in kwargs:
        reason = "extra concatenated/reference tokens in this model call; dense attention"
    else:
        context = args[2] if len(args) > 2 else kwargs.get("context")
        clip_fea = args[3] if len(args) > 3 and not isinstance(args[3], dict) else kwargs.get("clip_fea")
        context_lengths = set()
        if isinstance(context, torch.Tensor) and context.dim() == 3:
            context_lengths.add(int(context.shape[1]))
        if clip_fea is not None:
            context_lengths.add(CLIP_IMAGE_TOKENS)
        if tokens in context_lengths:
            reason = (f"the latent has {tokens} tokens, as many as a cross-attention context: self- and "
                      "cross-attention cannot be told apart; dense attention")
    sigma = None
    sigmas = options.get("sigmas")
    if isinstance(sigmas, torch.Tensor) and sigmas.numel() > 0:
        sigma = float(sigmas.reshape(-1)[0].item())
    options = dict(options)
    options[FORWARD_KEY] = ForwardContext(grid, reason, sigma)
    if where == "kw":
        kwargs["transformer_options"] = options
    else:
        args = args[:where] + (options,) + args[where + 1:]
    return executor(*args, **kwargs)


def outer_sample_wrapper(override: ChorusOverride, executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper (args: noise, latent_image, sampler, sigmas, ...): one sampler run."""
    sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
    attention = override.attention
    try:
        attention.begin_run(sample_sigmas=sigmas.detach().float().cpu() if isinstance(sigmas, torch.Tensor) else sigmas)
    except Exception as exc:  # noqa: BLE001 - never fail the prompt: the run goes dense
        attention.plan.note(f"could not start the Chorus run ({type(exc).__name__}: {exc}); dense attention")
        return executor(*args, **kwargs)
    try:
        return executor(*args, **kwargs)
    finally:
        attention.end_run()
        log.info("Chorus II run: %s; %s", attention.plan.message, attention.plan.stats.summary())


def patch_summary(model_patcher) -> str:
    """Description of the weight patches (LoRAs) a ModelPatcher will apply: keys, counts, strengths.

    Part of the weights fingerprint, so a model with other LoRAs (or strengths) is another model.
    """
    patches = getattr(model_patcher, "patches", None) or {}
    h = hashlib.sha256()
    for key in sorted(patches):
        strengths = []
        for p in patches[key]:
            try:
                strengths.append((round(float(p[0]), 6), round(float(p[2]), 6)))
            except (TypeError, ValueError, IndexError):
                strengths.append(None)
        h.update(f"{key}:{strengths};".encode())
    return h.hexdigest()[:16] if patches else ""


def comfy_model_info(model_patcher) -> ModelInfo:
    """:class:`ModelInfo` of the diffusion model inside a ComfyUI ``ModelPatcher`` (never raises)."""
    diffusion_model = getattr(getattr(model_patcher, "model", None), "diffusion_model", None)
    if diffusion_model is None:
        return ModelInfo("unknown", type(model_patcher).__name__, 0, 0, 0, 0, "", False,
                         "the MODEL input holds no diffusion model")
    prefix = "diffusion_model."
    patched_keys = frozenset(k[len(prefix):] for k in (getattr(model_patcher, "patches", None) or {})
                             if isinstance(k, str) and k.startswith(prefix))
    try:
        # weights with patches (LoRAs) are applied in place when ComfyUI loads the model: their values
        # differ between a loaded and an unloaded model, so only the patch description enters the hash
        return wan_model_info(diffusion_model, fingerprint_extra=patch_summary(model_patcher),
                              fingerprint_exclude=patched_keys)
    except Exception as exc:  # noqa: BLE001
        return ModelInfo("unknown", type(diffusion_model).__name__, 0, 0, 0, 0, "", False,
                         f"could not inspect the model ({type(exc).__name__}: {exc})")


def patch_model(model, plan: Plan, config: SparseConfig):
    """Return ``(patched clone, ChorusAttention or None, message)``.

    An unsupported model comes back as an unpatched clone with a message saying why.
    """
    patched = model.clone()
    info = comfy_model_info(patched)
    if not info.supported:
        plan.note(f"unsupported model: {info.reason}; this model runs dense attention")
        return patched, None, f"not patched: {info.reason}"
    import comfy.patcher_extension

    options = patched.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")
    if isinstance(previous, ChorusOverride):
        previous = previous.previous  # re-patching replaces an earlier Chorus patch instead of stacking
    mismatch = plan.model_mismatch(info)
    if mismatch is not None:  # say so now, in this node's UI text, not only after sampling
        plan.demote(mismatch)
    attention = ChorusAttention(plan, config, info)
    override = ChorusOverride(attention, previous)
    options["optimized_attention_override"] = override
    options[HANDLE_KEY] = override
    for wrapper_type, fn in ((comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, outer_sample_wrapper),
                             (comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, diffusion_model_wrapper)):
        patched.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)
        patched.add_wrapper_with_key(wrapper_type, WRAPPER_KEY, functools.partial(fn, override))
    return patched, attention, f"patched {info.variant} ({info.num_layers} layers, {info.num_heads} heads)"
