"""One Chorus patch per ComfyUI model: the object ChorusSparseSampler, ChorusFeatureReuse and
ChorusGuidanceBoost all configure, and the hooks that run it.

A :class:`ChorusPatch` holds the request's plan, the model's ``ModelInfo`` and up to three parts (the
engine's ``ChorusAttention``, ``FeatureReuse``, ``GuidanceBoost``) under
``transformer_options["chorus_ii"]`` of a ``model.clone()``. :func:`configure` (what every node calls)
returns a clone whose patch is the old parts + the node's part and (re)installs ComfyUI's supported hooks:
the one ``optimized_attention_override`` (a :class:`ChorusOverride`, the same object for every request,
chaining another node's override), one ``OUTER_SAMPLE`` wrapper (:meth:`ChorusPatch.outer_sample`: each
part's ``begin_run`` / ``end_run``), one ``APPLY_MODEL`` wrapper (:func:`apply_model_wrapper`: a keyword
that keeps a compiled Chorus-patched model's graphs apart from a plain one's) and one ``DIFFUSION_MODEL``
wrapper (:func:`diffusion_model_wrapper`) under the key ``"chorus_ii"``, the block patches
(``nodes/comfy_forward.py``: every block with feature reuse, block 0 with the sparse sampler alone) and,
with ``cfg_strength > 0``, a :class:`CfgCorrection`. Calls are read in ComfyUI 0.3.64's and 0.38.x's
conventions (``nodes/comfy_call.py``: q/k/v containers taken once, ``scale`` honoured); a recognised sparse
override (ComfyUI's Model Sparse Attention node) is skipped by Chorus's own dense calls, and where it has
put itself on top, Chorus takes the top back in each forward (``nodes/override_stack.py``).

Per forward the DIFFUSION_MODEL wrapper runs on the host side of the graph (``torch.compiler.disable``:
under ``TorchCompileModel`` one graph break at the top of the model, none inside a block): it reads the
token grid from the latent and tells it to the parts with the latent frames its input holds images on (a run's
first forward serves a hit's entry at that grid, resampled, or moves or demotes a hit whose maps cannot be or
whose entry was recorded with images on other frames, ``serve_grid``), reads the sigma once, makes the
forward's :class:`~chorus.engine.attend.ForwardContext` current, and hands the model an options copy with constants
only, also published where compiled code is guarded on them (``nodes/comfy_forward.py``). The override
translates each attention call by them: self-attention to ``torch.ops.chorus.attend`` (or, on a recording
miss, the host's attention + ``torch.ops.chorus.record_mass``), cross-attention to the host's attention
times guidance's gain. Everything that changes between steps and requests is read when the ops run
(``engine/attend.py``).
Objects stored in ``model_options`` return themselves from ``__deepcopy__``. Anything unexpected
gives a note in the plan and dense attention / a full block, never a failed prompt.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..engine import ChorusAttention, ModelInfo, Plan, token_grid
from ..engine.model_info import frames_summary, image_frame_flags
from ..engine import attend as engine_attend
from ..engine.feature_reuse import FeatureReuse
from ..engine.guidance import GuidanceBoost
from ..engine.routing import sigma_value
from ..engine.state import failure_text
from . import comfy_call, comfy_forward, host_report, override_stack
from .override_stack import OVERRIDE
from .comfy_adapter import comfy_model_info, request_image_flags
from .comfy_forward import DENSE_KEY, FORWARD_KEYS, GAIN_KEY, MODE_KEY, REDUCE_KEY, REUSE_KEY, \
    TOKENS_KEY, ChorusBlock
from .comfy_override import ChorusOverride

log = logging.getLogger("chorus.nodes")

PATCH_KEY = "chorus_ii"            # transformer_options: the model's ChorusPatch
WRAPPER_KEY = "chorus_ii"          # the keyed OUTER_SAMPLE / APPLY_MODEL / DIFFUSION_MODEL wrappers
MODEL_KWARG = "chorus_ii_model"    # the keyword the APPLY_MODEL wrapper adds to a Chorus-patched model's calls
MULTI_GPU_KEY = "multigpu_thread_device"  # a model call's transformer_options under ComfyUI's multi-GPU split
# transformer_options["patches"] entries that ComfyUI's Wan calls inside every block with that block's tokens
# (0.38.x: attn1_patch / attn2_patch, where its MultiTalk / InfiniteTalk audio sits; earlier MultiTalk
# versions: cross_attn): they may need the whole sequence, as laid out
SEQUENCE_PATCHES = ("attn1_patch", "attn2_patch", "cross_attn")
CLIP_IMAGE_TOKENS = 257
KEEP = object()  # configure(): leave that part as it is


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
        self._guider = None  # the running sampler's CFGGuider (its conditioning: the request's input images)
        self._image_flags: dict | None = None  # a run's forwards' image frames by window (one sync per window a run)

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
        """OUTER_SAMPLE wrapper (args: noise, latent_image, sampler, sigmas, ...): every part's run."""
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        started = []
        self._run_failed = None
        guider = getattr(executor, "class_obj", None)  # another sparse override on this run's model
        self._guider, self._image_flags = guider, {}
        stack_line = override_stack.run_note(getattr(guider, "model_options", None),
                                             getattr(guider, "model_patcher", None),
                                             ChorusOverride.chaining(self.previous_override), self.attention is not None)
        if stack_line is not None:
            self.note(stack_line)
        try:
            for part in (self.attention, self.feature_reuse, self.guidance):
                if part is None:
                    continue
                started.append(part)
                try:
                    part.begin_run(sigmas)
                except Exception as exc:  # noqa: BLE001 - never fail the prompt: the run goes plain
                    self._run_failed = f"could not start the Chorus run ({failure_text(exc)})"
                    self.note(f"{self._run_failed}; dense attention, full blocks")
            try:
                return executor(*args, **kwargs)
            except BaseException as exc:  # one line naming ComfyUI's version when Chorus code failed
                host_report.report_failure(exc)
                raise
        finally:
            engine_attend.activate(None)
            for part in started:
                try:
                    part.end_run()
                except Exception as exc:  # noqa: BLE001
                    self.note(f"ending the Chorus run failed ({failure_text(exc)})")
            self._run_failed = None
            self._guider, self._image_flags = None, None
            if self.plan is not None:
                log.info("Chorus II run: %s; %s%s", self.plan.message, self.plan.stats.summary(),
                         f"; {self.feature_reuse.state.summary()}" if self.feature_reuse is not None else "")

    # -- one forward, host side ----------------------------------------------------------------------
    def _forward_image_flags(self, x: torch.Tensor, timestep, window) -> tuple | None:
        """Per latent frame of this forward's input, whether it holds an input image
        (:func:`~chorus.engine.model_info.image_frame_flags`), kept for the run by window (``window``: the
        video frames of a context window's forward, :func:`~.comfy_forward.window_frames`, or None for the whole
        latent): the mask a window's input carries is its own frames' (its anchor frame, a frame ComfyUI keeps in
        every window included), read once a run (each forward outside a sampler run)."""
        if self._image_flags is None:
            return image_frame_flags(x, self.model_info, timestep)
        key = (window, int(x.shape[2]))
        if key not in self._image_flags:
            self._image_flags[key] = image_frame_flags(x, self.model_info, timestep)
        return self._image_flags[key]

    def _request_image_frames(self, window, forward_flags) -> tuple | None:
        """The request's ``(first, last, other)`` image frames (what the entry records and a hit must match): the
        forward's own outside context windows; in a window (it holds part of the video) from the run's
        conditioning over the whole latent (:func:`~.comfy_adapter.request_image_flags`), else, where that
        cannot be read, the window's own (a start image is in the first window; an end image then goes unseen)."""
        flags = request_image_flags(self._guider, self.model_info) if window is not None else None
        if flags is None:
            flags = forward_flags()
        return None if flags is None else frames_summary(flags)

    def begin_forward(self, x: torch.Tensor, args, kwargs, options: dict) -> dict | None:
        """The options copy for one Wan video forward (see the module docstring), with its context made
        current; None when this call is not a Wan video forward (its options are left as they are)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            return None
        try:
            grid = token_grid(x.shape)
        except ValueError:
            return None
        tokens = grid[0] * grid[1] * grid[2]
        context = args[2] if len(args) > 2 else kwargs.get("context")
        clip_fea = args[3] if len(args) > 3 and not isinstance(args[3], dict) else kwargs.get("clip_fea")
        extra_tokens = comfy_call.extra_token_input(args, kwargs)
        context_lengths = set()
        if isinstance(context, torch.Tensor) and context.dim() == 3:
            context_lengths.add(int(context.shape[1]))
        if clip_fea is not None:
            context_lengths.add(CLIP_IMAGE_TOKENS)
        reason = self._stay_out_reason(tokens, context_lengths, extra_tokens, options)
        window = comfy_forward.window_frames(options)
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep", kwargs.get("t"))
        flags = functools.cache(lambda: self._forward_image_flags(x, timestep, window))  # asked only where needed
        if reason is None:  # the parts' entry must serve the forward's grid and images (Plan.serve_run), first of all
            frames = functools.cache(lambda: self._request_image_frames(window, flags))  # asked at a run's first
            for part in (self.attention, self.feature_reuse):
                if part is not None:
                    part.serve_grid(grid, frames)
        try:
            sigma = sigma_value(options.get("sigmas"))  # the one host sync of the forward
        except (TypeError, ValueError):  # none, or not a finite number: the forward runs without Chorus's parts
            sigma = None
        reduction = None
        if reason is None and sigma is not None:
            end_biased = engine_attend.end_image_bias(self.guidance, sigma, flags) != 0.0
            reduction = self._reduction(sigma, grid, x.device, context_lengths, options, flags, end_biased)
        ctx = engine_attend.begin_forward(self.attention, self.guidance, grid, sigma, options.get("cond_or_uncond"),
                                          self.note, reason, self.feature_reuse, reduction,
                                          comfy_forward.skipped_layers(options), flags,
                                          None if window is None else window[0])
        route = override_stack.forward_route(self.previous_override, options.get(OVERRIDE))
        options = {key: value for key, value in options.items() if key not in FORWARD_KEYS}
        if route.top:  # a foreign sparse override put itself on top: Chorus takes the top back
            options[OVERRIDE] = ChorusOverride.chaining(route.passing)
        if route.dense is not route.passing:
            options[DENSE_KEY] = (route.dense,)
        options[TOKENS_KEY] = tokens
        gain = ctx.cross_attention_gain()
        if gain is not None:
            options[GAIN_KEY] = gain
        if reason is None:
            mode = None
            if self.attention is not None:
                mode = "attend" if self.plan.is_hit else "record"
            elif ctx.first_frame_bias():
                mode = "attend"
            if mode is not None:
                options[MODE_KEY] = mode
            if self.feature_reuse is not None and self.plan is not None and not self.plan.is_hit:
                options[REUSE_KEY] = "record"
            if reduction is not None:
                options[REDUCE_KEY] = (reduction.compact_length, reduction.compact_attention)
        comfy_forward.publish(options)
        return options

    def _stay_out_reason(self, tokens: int, context_lengths: set, extra_tokens, options: dict) -> str | None:
        """Why Chorus stays out of this forward (dense attention, full blocks), or None."""
        if self._run_failed is not None:
            return self._run_failed
        if extra_tokens is not None:
            return f"extra tokens in this model call ({extra_tokens})"
        if tokens in context_lengths:
            return (f"the latent has {tokens} tokens, as many as a cross-attention context: self- and "
                    "cross-attention cannot be told apart")
        if options.get(MULTI_GPU_KEY) is not None:
            return ("ComfyUI's multi-GPU split (its MultiGPU CFG Split node) runs this model's calls on "
                    "several GPUs at once; Chorus's maps and recordings live on one GPU, so it stays out")
        return None

    def _reduction(self, sigma: float, grid, device, context_lengths: set, options: dict, image_flags=None,
                   end_image_biased: bool = False):
        """Feature reuse's reduction of this forward (a hit's; ``image_flags`` / ``end_image_biased`` as
        ``FeatureReuse.reduction`` takes them), or None: none either where another pack's
        patch inside Wan's blocks (:data:`SEQUENCE_PATCHES`) reads the whole sequence, or where the forward's
        self-attention may not reach Chorus (an override on top that Chorus cannot see through,
        ``override_stack.reaches``: a reduced block's attention would run on the compact sequence as if it
        were the whole one) (both noted); layers whose block patch chains another pack's run in full (noted)."""
        if self.feature_reuse is None or self.plan is None or not self.plan.is_hit:
            return None
        top = options.get(OVERRIDE)
        if not override_stack.reaches(top, ChorusOverride.chaining(self.previous_override)):
            self.note(f"feature reuse: {override_stack.unreached_note(top)}")
            return None
        inside = sorted(name for name in SEQUENCE_PATCHES if (options.get("patches") or {}).get(name))
        if inside:
            self.note(f"feature reuse: this model carries other attention patches ({', '.join(inside)}, "
                      "e.g. ComfyUI's MultiTalk / InfiniteTalk audio) that read each block's whole "
                      "sequence: its blocks run in full")
            return None
        reduction = self.feature_reuse.reduction(sigma, grid, device, avoid_lengths=context_lengths,
                                                 image_flags=image_flags, end_image_biased=end_image_biased)
        if reduction is not None:
            chained = sorted(key[1] for key, block in comfy_forward.block_patches(options).items()
                             if isinstance(block, ChorusBlock) and block.previous is not None)
            if chained:
                self.note(f"feature reuse: layers {chained} carry another block patch and run in full")
        return reduction


@torch.compiler.disable
def _begin_forward(args, kwargs, note: str | None = None):
    """``(args, kwargs)`` of one DIFFUSION_MODEL call with the options copy of
    :meth:`ChorusPatch.begin_forward` in place; unchanged when the call is not a Chorus-patched Wan
    video forward. ``note``: a message for the run's notes (kept once) when the call is Chorus-patched.
    Host side: dynamo never traces it (the sigma read would specialise the graph)."""
    where, options = _find_transformer_options(args, kwargs)
    if where is None:
        return args, kwargs
    patch = options.get(PATCH_KEY)
    if not isinstance(patch, ChorusPatch):
        return args, kwargs
    if note is not None:
        patch.note(note)
    x = args[0] if args else kwargs.get("x")
    new = patch.begin_forward(x, args, kwargs, options)
    if new is None:
        return args, kwargs
    if where == "kw":
        kwargs = dict(kwargs, transformer_options=new)
    else:
        args = args[:where] + (new,) + args[where + 1:]
    return args, kwargs


# Before torch 2.10 dynamo's resume frame after :func:`_begin_forward`'s graph break guards the identity of
# ComfyUI's per-forward executor's bound ``_forward`` (``L['executor'].original``), a new object every forward:
# every forward recompiled the whole model until dynamo's recompile limit (8) and ran eagerly after (measured on
# torch 2.8 and 2.9 with the tiny Wan; 2.10 compiles once). There a Chorus-patched forward runs outside dynamo.
DYNAMO_KEEPS_THE_FORWARD_COMPILED = torch.__version__ >= (2, 10)
EAGER_FORWARD_NOTE = (f"TorchCompileModel: torch {torch.__version__} recompiles a Chorus-patched Wan forward at "
                      "every step (fixed in torch 2.10), so Chorus runs it eagerly: the speed-up of its kernels "
                      "stays, compile's own does not (docs/NODES.md, \"With TorchCompileModel\")")


def diffusion_model_wrapper(executor, *args, **kwargs):
    """The DIFFUSION_MODEL wrapper of every Chorus-patched model (Wan args: x, timestep, context,
    clip_fea, time_dim_concat, transformer_options, ...): one module-level function, so a compiled
    model's guards see the same wrapper for every request. It takes :func:`apply_model_wrapper`'s keyword
    back out: the model never sees it. Before torch 2.10 a Chorus-patched forward runs eagerly under
    ``TorchCompileModel`` (:func:`_eager_forward`)."""
    kwargs.pop(MODEL_KWARG, None)
    if not DYNAMO_KEEPS_THE_FORWARD_COMPILED and torch.compiler.is_compiling():
        return _eager_forward(executor, args, kwargs)
    args, kwargs = _begin_forward(tuple(args), kwargs)
    return executor(*args, **kwargs)


@torch.compiler.disable
def _eager_forward(executor, args, kwargs):
    """A Chorus-patched forward outside dynamo (torch < 2.10 under ``TorchCompileModel``: see
    :data:`DYNAMO_KEEPS_THE_FORWARD_COMPILED`): the hit's kernels still run, compile's fusion does not, and no
    forward pays a recompile. The run's notes say so once."""
    args, kwargs = _begin_forward(tuple(args), kwargs, EAGER_FORWARD_NOTE)
    return executor(*args, **kwargs)


def apply_model_wrapper(executor, *args, **kwargs):
    """The APPLY_MODEL wrapper of every Chorus-patched model: its one job is to pass the diffusion model
    the keyword :data:`MODEL_KWARG` (ComfyUI hands ``apply_model``'s extra keywords on to it), so that a
    compiled model tells a Chorus-patched call from a plain one by a guard on its keyword arguments.
    ComfyUI's ``TorchCompileModel`` keeps no guard on ``transformer_options`` (where the wrappers, the
    override and the block patches live), so without it a graph compiled for the same diffusion model
    without Chorus, earlier in the process, ran Chorus-patched requests with no Chorus at all.
    Host side: ComfyUI compiles the diffusion model only, inside this wrapper. Installed on supported
    models only (ComfyUI's ``WanModel``, whose forward hands its keywords to :func:`diffusion_model_wrapper`,
    which takes this one out): a guidance-only patch on another model leaves that model's calls as they are."""
    kwargs[MODEL_KWARG] = True
    return executor(*args, **kwargs)


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
    ``ModelInfo``; the sparse and feature-reuse parts only for a supported model, guidance for any Wan
    ``WanModel`` (a text-to-video one too; never another class, e.g. ComfyUI's Wan Animate 2 or SCAIL models,
    whose self-attention can take keys of another length than its queries). A patch with no parts left is
    uninstalled. The input model is never modified.
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
    if info.family != "wan":  # guidance reads Wan's attention calls (cross-attention: another key length)
        boost = None

    attention = fr = None
    if plan is not None and info.supported:
        if sparse_config is not None or fr_config is not None:
            plan.expect_model(info)  # the sampler runs' check wants an entry made for this model too
        if sparse_config is not None:
            attention = ChorusAttention(plan, sparse_config, info,
                                        record_region=_record_region(fr_config))
        if fr_config is not None:
            fr = FeatureReuse(plan, fr_config, info)
    if boost is not None and old is not None and boost is old.guidance and boost.plan is not None \
            and plan is not None and boost.plan is not plan:
        boost = GuidanceBoost(plan, boost.strength, boost.image_strength, boost.cfg_strength)  # follow the plan
    options = patched.model_options.setdefault("transformer_options", {})
    previous = options.get(OVERRIDE)
    if isinstance(previous, ChorusOverride):
        previous = previous.previous  # re-patching replaces the Chorus override, never stacks
    # else: None, or another pack's override (one that chains an older Chorus override: that one passes
    # through, as its forward's keys are removed before a call goes down the chain)
    patch = ChorusPatch(plan if plan is not None else (boost.plan if boost is not None else None), info,
                        attention=attention, feature_reuse=fr, guidance=boost, previous_override=previous)
    _install(patched, patch)
    stack_line = None if patch.is_empty else override_stack.patch_note(previous, patch.attention is not None)
    if stack_line is not None:  # a foreign sparse override below this patch
        patch.note(stack_line)
    return patched, (None if patch.is_empty else patch), info


def _record_region(fr_config):
    """Feature reuse's region when a miss should record in its region order (see the module
    docstring), else None (raster). A region that is not one block's tokens records raster too
    (``engine.compat.region_order_for`` decides)."""
    if fr_config is None or fr_config.downsample_share <= 0 or not fr_config.keep_first_frame:
        return None
    return tuple(fr_config.region)


def _install(patched, patch: ChorusPatch) -> None:
    import comfy.patcher_extension

    options = patched.model_options["transformer_options"]
    previous = patch.previous_override
    wrappers_mp = comfy.patcher_extension.WrappersMP
    wrapper_types = (wrappers_mp.OUTER_SAMPLE, wrappers_mp.DIFFUSION_MODEL, wrappers_mp.APPLY_MODEL)
    for wrapper_type in wrapper_types:
        patched.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)
    post_cfg = [fn for fn in patched.model_options.get("sampler_post_cfg_function", [])
                if not isinstance(fn, CfgCorrection)]
    dit = comfy_forward.block_patches(options)
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
        options[OVERRIDE] = ChorusOverride.chaining(previous)
        patched.add_wrapper_with_key(wrapper_types[0], WRAPPER_KEY, patch.outer_sample)
        patched.add_wrapper_with_key(wrapper_types[1], WRAPPER_KEY, diffusion_model_wrapper)
        if patch.model_info.supported:  # a WanModel: its DIFFUSION_MODEL wrapper takes the keyword out
            patched.add_wrapper_with_key(wrapper_types[2], WRAPPER_KEY, apply_model_wrapper)
        block_layers = (range(patch.model_info.num_layers) if patch.feature_reuse is not None
                        else range(1) if patch.attention is not None else ())
        from_layer = patch.feature_reuse.from_layer if patch.feature_reuse is not None else None
        if block_layers:
            dit = options.setdefault("patches_replace", {}).setdefault("dit", {})
            for layer in block_layers:
                dit[("double_block", layer)] = ChorusBlock.at(from_layer is not None and layer >= from_layer,
                                                              dit.get(("double_block", layer)))
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
    stack_line = override_stack.patch_note(patch.previous_override, patch.attention is not None)
    return "Chorus patch: " + " + ".join(parts) + (f" | {stack_line}" if stack_line else "")
