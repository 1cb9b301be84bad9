"""Another sparse-attention override on the same model, and how Chorus composes with it.

ComfyUI has one attention-override slot, ``transformer_options["optimized_attention_override"]``; overrides
stack by chaining the one they replaced. Recognised here: the override of ComfyUI's core **Model Sparse
Attention** node (node id ``BlockSparseAttention``, ``comfy_extras/nodes_sparse_attention.py`` of ComfyUI
0.38.x, read from source at 01dafad3): a closure ``make_attention_override.<locals>.override`` that keeps
the override it replaced in its ``previous`` cell (a later version, stored at cf3103c5, also marks the
function with ``_block_sparse_attention_patch`` / ``_block_sparse_attention_previous``; either is
recognised) and calls it for every call it declines (cross-attention, masks, sigmas outside its window,
short sequences, non-CUDA tensors...). The node re-installs it ON TOP of whatever override is there at every
step: an ``ON_PREPARE_STATE`` callback under the key ``"block_sparse_attention"`` wraps the current override
again unless it is already one of its own. ComfyUI 0.38.x calls that callback as ``callback(patcher,
timestep, model_options)`` from ``_calc_cond_batch``, before the step's model calls, with the sampler run's
``model_options`` (``model_patcher.py`` at 08d0e510, ``samplers.py`` at 311c0140). So whatever the node
order, the core node is on top in every forward, and without the rule below Chorus would see only the core
node's declined calls.

**The composition rule** (``docs/NODES.md``), enforced per forward by :func:`forward_route`, which
Chorus's ``DIFFUSION_MODEL`` wrapper (host side) applies to its copy of the forward's
``transformer_options`` (that wrapper runs inside each model call, after the step's
``ON_PREPARE_STATE``; the core node re-installs itself into the run's ``model_options``, never into
that copy):

1. When a recognised sparse override is on top, a Chorus override chaining it is put on top of the
   forward's copy: the calls Chorus declines (cross-attention, layouts it does not read, forwards it
   stays out of, and self-attention when the model's Chorus patch has no sparse-sampler part) go to
   the core node, which may run them sparse. Chorus removes its forward's keys from the options of
   every call it hands on, so when the core node calls Chorus's installed override again as its
   ``previous``, that one passes the call down its own chain (no loop).
2. Self-attention Chorus takes is Chorus's: a hit runs Chorus's own map, a miss runs dense attention
   and records it. Chorus's own dense calls (a miss; a call Chorus must not take) go down Chorus's
   chain with recognised sparse overrides skipped (:func:`without_sparse`), so the recording sees dense
   attention; a hit's own fallback runs PyTorch SDPA.
3. An override on top that is not recognised keeps its place (it decides what Chorus sees, as before).

:func:`patch_note` (patch time: an override below the new patch) and :func:`run_note` (each sampler
run: above or below, and the re-install callback; also an unrecognised override applied after the Chorus
nodes, which Chorus cannot see past) give the one line the nodes' UI text and the log show. Nothing here
imports ComfyUI or runs per call.
"""

from __future__ import annotations

from typing import NamedTuple

OVERRIDE = "optimized_attention_override"
CORE_NODE = "Model Sparse Attention"
CORE_MODULE_TAIL = "nodes_sparse_attention"  # ComfyUI loads comfy_extras files under their path as module name
CORE_FACTORY = "make_attention_override."
CORE_MARK = "_block_sparse_attention_patch"         # set on its override by later versions of the node
CORE_MARK_PREVIOUS = "_block_sparse_attention_previous"
CORE_CALLBACK_KEY = "block_sparse_attention"
ON_PREPARE_STATE = "on_prepare_state"  # comfy.patcher_extension.CallbacksMP.ON_PREPARE_STATE
NODES_DOC = "docs/NODES.md, 'ComfyUI's own sparse attention'"
ORDER_DOC = "docs/NODES.md, 'Other attention patches'"


def _module_name(obj) -> str:
    """``obj``'s module name without a file path (ComfyUI loads comfy_extras and custom-node files under
    their path as module name)."""
    return (getattr(obj, "__module__", None) or "").replace("\\", "/").rsplit("/", 1)[-1]


def _name(override) -> str:
    """A readable name of an override (module and qualified name), for the notes."""
    target = getattr(override, "func", override)  # a functools.partial: its function
    module = _module_name(target)
    qualname = getattr(target, "__qualname__", None) or type(target).__name__
    return f"{module}.{qualname}" if module else qualname


def is_foreign_sparse(override) -> bool:
    """Whether ``override`` is a recognised sparse-attention override of another node (the core
    Model Sparse Attention node's closure, by its mark or by module and factory name)."""
    if getattr(override, CORE_MARK, None) is not None:
        return True
    qualname = getattr(override, "__qualname__", None) or ""
    tail = _module_name(override).rsplit(".", 1)[-1]
    return tail == CORE_MODULE_TAIL and qualname.startswith(CORE_FACTORY)


def previous_of(override):
    """``(known, previous)``: the override a recognised sparse override (its ``previous`` cell) or an
    override object exposing ``previous_override`` (a Chorus override) chains; ``(False, None)`` for one
    whose chain cannot be seen."""
    if is_foreign_sparse(override):
        if hasattr(override, CORE_MARK_PREVIOUS):
            return True, getattr(override, CORE_MARK_PREVIOUS)
        code, cells = getattr(override, "__code__", None), getattr(override, "__closure__", None) or ()
        names = getattr(code, "co_freevars", ())
        if "previous" in names and len(cells) == len(names):
            return True, cells[names.index("previous")].cell_contents
        return False, None
    if hasattr(override, "previous_override"):
        return True, override.previous_override
    return False, None


def without_sparse(override):
    """``override`` with the recognised sparse overrides at the head of its chain skipped (None = the
    backend itself): where Chorus's own dense calls go. One below an override whose chain cannot be
    seen stays (that override calls it)."""
    while override is not None and is_foreign_sparse(override):
        known, override = previous_of(override)
        if not known:
            return None
    return override


class Stack(NamedTuple):
    """Where Chorus's patch sits in an override chain: ``above`` / ``below`` = the recognised sparse
    overrides met above / below it; ``found``: whether the chain from the top reaches the patch;
    ``opaque_above``: an unrecognised override sits above it."""

    above: tuple
    below: tuple
    found: bool
    opaque_above: bool


def locate(top, patch) -> Stack:
    """Walk the chain from ``top`` (the slot's override) to Chorus's installed override ``patch`` and
    below it."""
    above, below, found, opaque = [], [], False, False
    node, seen = top, set()
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if node is patch:
            found = True
        elif is_foreign_sparse(node):
            (below if found else above).append(node)
        elif not found and not hasattr(node, "previous_override"):
            opaque = True
        known, node = previous_of(node)
        if not known:
            break
    if not found:  # the patch's own chain (it was not reached from the top)
        node = patch.previous_override
        while node is not None and id(node) not in seen:
            seen.add(id(node))
            if is_foreign_sparse(node):
                below.append(node)
            known, node = previous_of(node)
            if not known:
                break
    return Stack(tuple(above), tuple(below), found, opaque)


class Route(NamedTuple):
    """A Chorus forward's override routing (made once per forward by :func:`forward_route`).

    ``top``: whether Chorus must take the top of the forward's options back (a recognised sparse
    override is there); ``passing``: where the calls Chorus declines go (None = the backend);
    ``dense``: where Chorus's own dense calls go."""

    top: bool
    passing: object
    dense: object


def forward_route(previous_override, top) -> Route:
    """The :class:`Route` of a Chorus forward (rules 1-3 of the module docstring): ``previous_override``
    = what the model's Chorus override chains, ``top`` = the override ComfyUI gave that forward.
    Host side: called from the DIFFUSION_MODEL wrapper, once per forward."""
    dense = without_sparse(previous_override)
    if is_foreign_sparse(top):
        return Route(top=True, passing=top, dense=dense)
    return Route(top=False, passing=previous_override, dense=dense)


def reaches(top, ours) -> bool:
    """Whether a forward's self-attention calls reach Chorus: ``top`` (the override ComfyUI gave the forward)
    is a recognised sparse override (Chorus takes the top back from it, :func:`forward_route`), or the chain
    from ``top`` leads to ``ours`` (the model's installed Chorus override) through links that can be seen
    (Chorus overrides, recognised sparse overrides, any override exposing ``previous_override``). An
    unrecognised override on top (applied after the Chorus nodes; ComfyUI's Model Attention Backend node
    and SageAttention patch nodes replace the override instead of chaining it), or none, may run a call
    itself."""
    return is_foreign_sparse(top) or locate(top, ours).found


# -- what the user is told --------------------------------------------------------------------------

def _rule(has_sparse_part: bool) -> str:
    if has_sparse_part:
        return ("Chorus runs the self-attention it takes (a hit with its own map, a miss dense and recorded) "
                f"and the {CORE_NODE} node only the calls Chorus declines (cross-attention, forwards Chorus "
                "stays out of)")
    return (f"this model has no Chorus Sparse Sampler, so the {CORE_NODE} node runs its sparse "
            "self-attention and Chorus's feature reuse / guidance work around it")


def patch_note(previous_override, has_sparse_part: bool = True) -> str | None:
    """The patch-time line (UI text and log) when a recognised sparse override is chained below a new
    Chorus patch (the core node was applied before the Chorus node), else None."""
    node, seen = previous_override, set()
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if is_foreign_sparse(node):
            return (f"ComfyUI's {CORE_NODE} node is also on this model (applied before this node; it puts "
                    f"itself on top at every step): {_rule(has_sparse_part)}; node order does not matter "
                    f"({NODES_DOC})")
        known, node = previous_of(node)
        if not known:
            return None
    return None


def unreached_note(top) -> str:
    """The line for a forward whose self-attention may not reach Chorus (:func:`reaches`)."""
    what = "no attention override" if top is None else f"another attention override ({_name(top)})"
    return (f"{what} is on top of this model's, applied after the Chorus nodes, and Chorus cannot see that it "
            "hands self-attention on to Chorus's: feature reuse runs every block in full (a reduced block's "
            f"attention needs Chorus); apply that node before the Chorus nodes ({ORDER_DOC})")


def run_note(model_options: dict | None, patcher, ours, has_sparse: bool) -> str | None:
    """The line for one sampler run (log and the plan's notes): where a recognised sparse override sits
    relative to ``ours`` (the model's installed Chorus override) in the run's ``model_options`` and
    whether ``patcher`` (the run's ModelPatcher) carries the core node's re-install callback; None when
    neither is there. ``has_sparse``: the model's Chorus patch has a sparse-sampler part."""
    options = (model_options or {}).get("transformer_options") or {}
    stack = locate(options.get(OVERRIDE), ours)
    get_callbacks = getattr(patcher, "get_callbacks", None)
    reinstalls = bool(get_callbacks(ON_PREPARE_STATE, CORE_CALLBACK_KEY)) if callable(get_callbacks) else False
    if not (stack.above or stack.below or reinstalls):
        if stack.opaque_above and not stack.found:
            return (f"another attention override ({_name(options.get(OVERRIDE))}) is on this model above Chorus's, "
                    "applied after the Chorus nodes: Chorus sees only the calls it hands on, none when it does not "
                    "chain the override it replaced (a SageAttention patch node, for one); apply it before the "
                    f"Chorus nodes, which chain it ({ORDER_DOC})")
        return None
    where = ("applied after the Chorus nodes: above Chorus's override" if stack.above
             else "applied before the Chorus nodes: below Chorus's override" if stack.below
             else "its re-install callback without its override")
    if reinstalls:
        where += "; it puts itself on top at every step and Chorus takes the top back in each forward"
    line = f"ComfyUI's {CORE_NODE} node is on this model ({where}): {_rule(has_sparse)} ({NODES_DOC})"
    if stack.opaque_above:
        line += "; another attention override above Chorus's keeps its place and decides what Chorus sees"
    return line
