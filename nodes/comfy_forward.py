"""One Wan forward of a Chorus-patched model, on ComfyUI's side: the keys of the forward's options
copy, the block patch :class:`ChorusBlock` and :func:`skipped_layers` (blocks another patch skips).

The DIFFUSION_MODEL wrapper (``nodes/comfy_patch.py``) hands the model an options copy carrying
constants for the traced code only (:data:`MODE_KEY`, :data:`TOKENS_KEY`, :data:`GAIN_KEY`,
:data:`REUSE_KEY`, :data:`REDUCE_KEY`, :data:`DENSE_KEY`); what changes between forwards is the
engine's current :class:`~chorus.engine.attend.ForwardContext`, read by the custom ops when they run.

Compiled code must recompile when these constants change, and a compiled model's guards on
``transformer_options`` cannot be relied on: ComfyUI's ``TorchCompileModel`` (since it passes
``guard_filter_fn``, unless its ``mode`` is set) drops every guard whose source mentions
``transformer_options``. Where a block is compiled as a frame of its own (an attention backend dynamo
does not trace breaks it), a graph traced for a miss then ran a later hit densely, a layer's block index
stuck at its first value, and feature reuse's reduction went unseen. So the host also publishes the
forward's constants as one string (:func:`publish`, :data:`FORWARD_KEY`) in a module global, and traced
code reads them through :func:`constants`, which compares that global to the options' copy: dynamo guards
on a global whatever the filter, so a change of constants recompiles. Forwards running at once in one
process (ComfyUI's multi-GPU split of one step) share their constants, so the global is theirs too.
"""

from __future__ import annotations

import dis
import functools
import inspect

import torch

from ..engine import attend as engine_attend

MODE_KEY = "chorus_ii_mode"        # a forward's options copy: "attend" | "record" (absent: pass)
TOKENS_KEY = "chorus_ii_tokens"    # a forward's options copy: the token grid's length
GAIN_KEY = "chorus_ii_gain"        # a forward's options copy: guidance's cross-attention gain
REUSE_KEY = "chorus_ii_feature_reuse"  # a forward's options copy: "record" (a miss records region scores)
REDUCE_KEY = "chorus_ii_reduce"    # a forward's options copy: (compact length, compact attention) of the
                                   # forward's feature-reuse Reduction (a hit whose blocks it reduces)
DENSE_KEY = "chorus_ii_dense"      # a forward's options copy: (chain,) for Chorus's own dense calls, when it
                                   # is not the override's own chain (a foreign sparse override skipped)
FORWARD_KEY = "chorus_ii_forward"  # a forward's options copy: its constants as one string (publish())
FORWARD_KEYS = (MODE_KEY, TOKENS_KEY, GAIN_KEY, REUSE_KEY, REDUCE_KEY, DENSE_KEY, FORWARD_KEY)

_PUBLISHED = {"forward": None}  # the constants of the forward the host began last (see the module docstring)


def publish(options: dict) -> None:
    """Host side, after the forward's constants are in ``options``: their string under
    :data:`FORWARD_KEY`, also made the process's published forward (the guard compiled code reads)."""
    dense = options.get(DENSE_KEY)
    key = repr(tuple(options.get(name) for name in (MODE_KEY, TOKENS_KEY, GAIN_KEY, REUSE_KEY, REDUCE_KEY))
               + (dense is not None,))
    options[FORWARD_KEY] = key
    _PUBLISHED["forward"] = key


def constants(options: dict) -> dict:
    """Traced code's read of a forward's constants: ``options`` itself. Under compilation it first
    compares ``options``' :data:`FORWARD_KEY` to the published forward, so the compiled code is guarded
    on that global (module docstring); eagerly nothing is compared. A forward that published nothing
    (no Chorus forward) has no constants either way."""
    if torch.compiler.is_compiling() and options.get(FORWARD_KEY) != _PUBLISHED["forward"]:
        return {}  # not the published forward (a host forward Chorus did not begin): no constants
    return options


MAX_CHAINED = 16
"""How many patch objects chaining another pack's patch :func:`chained_instance` keeps at once."""


def chained_instance(cache: dict, key, previous, make):
    """The one object of ``cache`` for ``key`` while it chains ``previous`` (another pack's patch, or None),
    else a new one, ``make()``: the same object request after request (what a compiled model's guards
    see). The cache keeps the :data:`MAX_CHAINED` most recently used (each holds its ``previous`` alive:
    a pack that makes a new patch per prompt must not grow it, nor keep every old patch, without bound)."""
    found = cache.pop(key, None)
    if found is None or found.previous is not previous:
        found = make()
    cache[key] = found  # the most recent last
    while len(cache) > MAX_CHAINED:
        cache.pop(next(iter(cache)))
    return found


class ChorusBlock:
    """``patches_replace["dit"][("double_block", layer)]`` of Chorus-patched models, traced by a compiled
    model: the residual stream made row-major (ComfyUI's WanModel passes its patch embedding's
    ``transpose(1, 2)`` view to the blocks, whose three layer norms would each copy it: 8% of a 720p
    hit's GPU time per step, docs/BENCHMARK_LOG.md, run 15; a copy only when it is not); a miss's full
    block records its region scores (``torch.ops.chorus.record_block``); in a forward whose blocks
    feature reuse reduces (:data:`REDUCE_KEY`, from its ``from_layer`` on), the block runs on the compact
    sequence: its input, RoPE and per-token modulation through ``torch.ops.chorus.compact_tokens``, its
    self-attention through ``torch.ops.chorus.attend_compact`` (the override, by the compact length),
    its output back through ``torch.ops.chorus.expand_block``, so the reduced block stays one graph.
    ``reducible``: the patch of a layer at or past feature reuse's ``from_layer`` (the only ones a forward
    reduces). ``previous`` = a non-Chorus block patch chained (such a layer runs in full: that patch may need
    the whole sequence). The patch holds no layer index (a region score's layer is the block's own
    self-attention call's, :func:`chorus.engine.attend.record_block`): one object per (reducible,
    previous) (:meth:`at`), shared by the layers and the same for every request, so a compiled model's
    guards see one block patch -- also where the host's attention breaks the graph inside a block, which
    makes each block call a frame of its own (a patch per layer there was a recompile per layer, and past
    dynamo's recompile limit the later layers ran eagerly)."""

    _instances: dict = {}

    def __init__(self, reducible: bool = False, previous=None):
        self.reducible, self.previous = bool(reducible), previous

    @classmethod
    def at(cls, reducible: bool = False, previous=None) -> "ChorusBlock":
        return chained_instance(cls._instances, (bool(reducible), id(previous)), previous,
                                lambda: cls(reducible, previous))

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
        options = constants(args.get("transformer_options") or {})
        reduce = options.get(REDUCE_KEY)
        if reduce is not None and self.reducible and self.previous is None:
            reduced = self._reduced(args, extra, reduce[0])
            if reduced is not None:
                return reduced
        out = self._run(args, extra)
        if options.get(REUSE_KEY) == "record" and isinstance(out, dict) and isinstance(out.get("img"), torch.Tensor):
            engine_attend.record_block(args["img"], out["img"])
        return out

    def _reduced(self, args, extra, length: int):
        """The block on the compact sequence of ``length`` tokens (see the class docstring), or None when
        its arguments are not Wan's (then it runs in full)."""
        x, pe = args.get("img"), args.get("pe")
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or not isinstance(pe, torch.Tensor) or pe.dim() < 3 \
                or pe.shape[1] != x.shape[1] or pe.shape[-2:] != (2, 2):
            return None
        call = dict(args)
        call["img"] = x_c = engine_attend.compact_tokens(x, "mean", length)
        call["pe"] = engine_attend.compact_tokens(pe, "rotation", length)
        vec = compact_per_frame(args.get("vec"), x.shape[1],
                                lambda t: engine_attend.compact_tokens(t, "mean", length))
        if vec is not None:
            call["vec"] = vec
        y_c = self._run(call, extra)["img"]
        return {"img": engine_attend.expand_block(x, x_c, y_c)}


def frame_of_token(frames: int, length: int, device=None) -> torch.Tensor:
    """int64 ``[L]``: the frame of Wan's per-frame modulation each of ``length`` tokens takes, by ComfyUI's
    ``repeat_e`` rule (``L // Tt`` tokens a frame; where that does not divide, ``L // Tt + 1`` and the last
    frame cut short)."""
    repeats = length // frames
    if repeats * frames != length:
        repeats += 1
    return torch.arange(length, device=device) // repeats


def compact_per_frame(vec, length: int, compact):
    """Wan time modulation ``[B, Tt, 6, C]`` (Wan 2.2 TI2V 5B: one per latent frame) on a reduced block's compact
    sequence, ``[B, L', 6, C]``: what ``compact`` (``[1, L, n] -> [1, L', n]``, the block's ``"mean"``
    compaction) makes of the per-token modulation ComfyUI's ``repeat_e`` would give ``length`` tokens, computed as
    each compact token's share of tokens in each frame (the frames' one-hot rows, compacted) times ``vec``,
    without that ``[B, L, 6, C]`` copy (2 GB a block and batch of two at 720p, which made feature reuse slower than
    none on the 5B). None when ``vec`` is one vector per sample (``Tt == 1``: nothing to compact) or not Wan's."""
    if not isinstance(vec, torch.Tensor) or vec.dim() != 4 or vec.shape[1] == 1:
        return None
    frames = vec.shape[1]
    one_hot = torch.nn.functional.one_hot(frame_of_token(frames, length, vec.device), frames)
    shares = compact(one_hot.to(torch.float32)[None])[0]                       # [L', Tt], rows summing to 1
    # in vec's dtype: a 16-bit product runs on the tensor cores (in fp32 it took ~2 ms a block at 720p on an
    # H100); a full cell's shares (k / 8, k / 4, k / 2) are exact in bf16, and the product rounds once
    return torch.einsum("lt,btkc->blkc", shares.to(vec.dtype), vec)


def block_patches(options: dict) -> dict:
    """The block patches of a model's (or a forward's) ``transformer_options``: its ``patches_replace["dit"]``,
    keyed ``("double_block", i)`` for Wan (an empty dict when there are none; never created here)."""
    return (options.get("patches_replace") or {}).get("dit") or {}


def skipped_layers(options: dict) -> frozenset:
    """Layers whose ``("double_block", i)`` patch in ``options["patches_replace"]["dit"]`` never runs the block
    (:func:`never_runs_block`; a Chorus block patch chaining one counts as that one): no self-attention call
    comes from them in this forward, so the engine's layer count passes over them. ComfyUI's Skip Layer
    Guidance makes such forwards (an extra one per step in its window, its layers replaced by a patch that
    returns its arguments); without this, every later call of such a forward took the map of a layer below
    its own where the layer is counted (ComfyUI 0.3.64; compiled code on any version)."""
    skipped = set()
    for key, patch in block_patches(options).items():
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] == "double_block" and isinstance(key[1], int)):
            continue
        if isinstance(patch, ChorusBlock):
            patch = patch.previous
        if patch is not None and never_runs_block(patch):
            skipped.add(key[1])
    return frozenset(skipped)


def window_frames(options: dict) -> tuple[int, ...] | None:
    """The latent frames of the whole video this forward's frames are, in order, when ComfyUI runs the forward
    in a context window (``options["context_window"]``, set by its context handler before each window's call:
    the window's ``index_list``, and from 0.28.2 on its ``causal_anchor_index``, the frame before the window
    that the causal window fix puts in front of it), else None (a whole-latent forward, or a window of another
    kind). Host side, no sync (the index list is a list of ints; a tensor one is read as it is)."""
    window = options.get("context_window")
    index_list = getattr(window, "index_list", None)
    try:
        if index_list is None or len(index_list) == 0:
            return None
        frames = tuple(int(i) for i in index_list)
        anchor = getattr(window, "causal_anchor_index", None)
        return (int(anchor),) + frames if anchor is not None and int(anchor) >= 0 else frames
    except (TypeError, ValueError, RuntimeError):  # a window of another shape: read as no window
        return None


def never_runs_block(patch) -> bool:
    """True when a block patch (called as ``patch(args, extra)``) can never run the block it replaces: its
    code never reads ``extra``, the only way to the block (``extra["original_block"]``, made per call). False
    where that cannot be told (a builtin, ``*args``, ``extra`` captured by an inner function)."""
    function, bound = patch, 0
    if not inspect.isfunction(function) and not inspect.ismethod(function):
        function = getattr(type(patch), "__call__", None)
        bound = 1  # the instance
    if inspect.ismethod(function):
        function, bound = function.__func__, 1
    code = getattr(function, "__code__", None)
    if code is None or code.co_flags & inspect.CO_VARARGS or code.co_argcount < bound + 2:
        return False
    return _never_reads(code, bound + 1)


@functools.lru_cache(maxsize=256)
def _never_reads(code, position: int) -> bool:
    """Whether ``code`` never reads its parameter at ``position`` (per code object: the host side calls
    :func:`skipped_layers` every forward)."""
    name = code.co_varnames[position]
    if name in code.co_cellvars:
        return False
    for instruction in dis.get_instructions(code):
        if instruction.opname.startswith(("LOAD_FAST", "DELETE_FAST", "STORE_FAST_LOAD_FAST")):
            names = instruction.argval if isinstance(instruction.argval, tuple) else (instruction.argval,)
            if name in names:
                return False
    return True
