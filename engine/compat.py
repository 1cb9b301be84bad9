"""The compatibility signature of a cache entry: what it is, and why an entry cannot serve a request.

A signature is a plain JSON-able dict (stored in ``meta["signature"]`` of an entry):

``{"format": 1, "family": "wan", "variant": str, "experts": [fingerprint, ...],
"num_layers": int, "num_heads": int, "latent_shape": [C, T, H, W], "token_grid": [T', H', W'],
"block_size": int, "token_order": str, "step_sigmas": [float, ...], "head_groups": 1}``, and where the
request's first forward told it, ``"image_frames": [first, last, other]``: the latent frames that held an
input image (:func:`~chorus.engine.model_info.image_frames`; a hit needs the same, :func:`image_frames_mismatch`).

``token_order`` is the order of the tokens the entry's blocks were cut from: ``"thw"``
(:data:`TOKEN_ORDER`, raster: Wan's frame-major order after the 1x2x2 patchify; an entry without
the field is raster too), the name of a :class:`chorus.kernels.tile_order.TileOrder` of the
entry's token grid and block size (e.g. ``"tile2x8x8-f8x16-s"``) or of a
:class:`~chorus.kernels.tile_order.RegionTileOrder` (``"regions2x8x8"``: what a request with feature
reuse records, so that a hit can run self-attention on the compact sequence; :func:`entry_token_order`).

``experts`` lists the weights fingerprints of the models that sampled the request, in the order
they first sampled (Wan 2.2 A14B: high-noise expert first). ``step_sigmas`` is the sigma at the
start of every step of the whole request the model ran at (descending), so a step is identified by
its sigma. ``sampler_sigmas`` (only when the request's sampler had steps the model was not called
at, e.g. EasyCache skipped them) is the sampler's whole schedule: a hit must match it
(:func:`run_mismatch`), and runs the steps without maps dense.

The model side (``ModelInfo``, weights fingerprint, token grid) is ``model_info.py``.
"""

from __future__ import annotations

import math

from .model_info import ModelInfo, token_grid
from .routing import match_step

SIGNATURE_FORMAT = 1
TOKEN_ORDER = "thw"  # the raster default: Wan's frame-major order after the 1x2x2 patchify
RASTER_ORDER_NAMES = (TOKEN_ORDER, "raster")
MAX_ORDER_TOKENS = 1 << 22  # a tile order is rebuilt from an entry's grid only up to this many tokens


def token_order_name(order) -> str:
    """What a signature records for an order: :data:`TOKEN_ORDER` for raster (None), else the
    order's name."""
    return TOKEN_ORDER if order is None else order.name


def region_order_for(grid, region, block_size: int, last_frame_rim: bool = False):
    """The :class:`~chorus.kernels.tile_order.RegionTileOrder` of a grid whose tiles are feature
    reuse's ``region`` (``rt * rh * rw == block_size``; ``last_frame_rim``: the kind that keeps the last frame
    out of its tiles), or None when the region is not one block."""
    from ..kernels.tile_order import cached_region_order

    region = tuple(int(r) for r in region)
    if len(region) != 3 or math.prod(region) != int(block_size):
        return None
    return cached_region_order(tuple(int(g) for g in grid), region, int(block_size), bool(last_frame_rim))


def order_of_kind(name, grid, block_size: int):
    """The token order of the kind ``name`` names at token ``grid`` cut into ``block_size`` blocks: None for a
    raster name (``"thw"``, ``"raster"``, None), the :class:`~chorus.kernels.tile_order.RegionTileOrder` of a
    ``"regions<rt>x<rh>x<rw>"`` name's region (``"...-last"``: the kind whose last frame is rim), or the default
    :class:`~chorus.kernels.tile_order.TileOrder` of ``grid`` for a ``"tile..."`` name (its tile chosen for that
    grid; serpentine where the name ends ``-s``). What carries a map in a token order to another grid: the same
    kind of order there. Raises ``ValueError`` for any other name, a region that is not one block, or a grid out
    of range (past :data:`MAX_ORDER_TOKENS`: a hostile grid is never allocated)."""
    from ..kernels.tile_order import cached_tile_order

    if name is None or (isinstance(name, str) and name in RASTER_ORDER_NAMES):
        return None
    if not isinstance(name, str) or not name.startswith(("tile", "regions")):
        raise ValueError(f"unknown token order {name!r}")
    grid = tuple(int(g) for g in grid)
    block_size = int(block_size)
    if len(grid) != 3 or min(grid) < 1 or math.prod(grid) > MAX_ORDER_TOKENS or block_size < 1:
        raise ValueError(f"token grid {grid} / block size {block_size} of a tile-order entry is out of range")
    if name.startswith("tile"):
        return cached_tile_order(grid, block_size, name.endswith("-s"))
    shape, last_frame_rim = name[len("regions"):], name.endswith("-last")
    try:
        region = tuple(int(r) for r in shape.removesuffix("-last").split("x"))
    except ValueError:
        raise ValueError(f"unknown token order {name!r}") from None
    order = region_order_for(grid, region, block_size, last_frame_rim) \
        if len(region) == 3 and min(region) >= 1 else None
    if order is None or order.name != name:
        raise ValueError(f"token order {name!r} does not fit block size {block_size}")
    return order


def order_at(order, grid):
    """``order`` (a token order, None: raster) carried to token ``grid``: itself where ``grid`` is its own, else
    the order of its kind there (:func:`order_of_kind`): what a hit of an entry in that order runs a call of
    that grid in. Raises ``ValueError`` as :func:`order_of_kind`."""
    grid = tuple(int(g) for g in grid)
    if order is None or tuple(order.grid) == grid:
        return order
    return order_of_kind(order.name, grid, order.block_size)


def entry_token_order(entry_signature: dict):
    """The order an entry's blocks are in: None (raster: ``"thw"``, ``"raster"`` or no field), or the
    :class:`~chorus.kernels.tile_order.TileOrder` / :class:`~chorus.kernels.tile_order.RegionTileOrder`
    of the entry's token grid and block size whose name the entry records. Raises ``ValueError`` for
    any other value (an order this code cannot rebuild is never guessed: the entry is unusable rather
    than misread)."""
    name = entry_signature.get("token_order", TOKEN_ORDER)
    if isinstance(name, str) and name in RASTER_ORDER_NAMES:
        return None
    order = order_of_kind(name, entry_signature["token_grid"], entry_signature["block_size"])
    if order.name != name:  # a tile order other than the one this version chooses for the grid
        raise ValueError(f"token order {name!r} is not the tile order this version builds for grid {order.grid} "
                         f"and block size {order.block_size}")
    return order


def model_mismatch(entry_signature, info: ModelInfo) -> str | None:
    """Why an entry (its signature) cannot serve this model, or None: another variant, other layer /
    head counts, or weights whose fingerprint is not among the entry's experts. A damaged signature
    is a reason too (never raises)."""
    try:
        if entry_signature.get("variant") != info.variant:
            return f"entry made for {entry_signature.get('variant')}, this model is {info.variant}"
        if int(entry_signature.get("num_layers", -1)) != info.num_layers \
                or int(entry_signature.get("num_heads", -1)) != info.num_heads:
            return "entry made for a model with other layer/head counts"
        experts = entry_signature.get("experts")
        if not isinstance(experts, list) or info.fingerprint not in experts:
            return f"plan made for another model (weights fingerprint {info.fingerprint} not in the entry)"
    except (TypeError, ValueError, AttributeError) as exc:  # a hostile or damaged signature
        return f"entry signature unreadable ({type(exc).__name__}: {exc})"
    return None


def entry_sampler_sigmas(entry_signature) -> list[float]:
    """The sampler schedule an entry serves: its ``sampler_sigmas`` when its request skipped steps (a
    step cache such as EasyCache), else its ``step_sigmas``. Raises ``TypeError`` / ``ValueError`` /
    ``AttributeError`` for a damaged signature."""
    return [float(s) for s in entry_signature.get("sampler_sigmas", entry_signature.get("step_sigmas", []))]


def run_mismatch(entry_signature, run_starts=None, block_size: int | None = None) -> str | None:
    """Why an entry (its signature) cannot serve a sampler run, or None: another block size, or a step
    of the run (``run_starts``: the sigmas its steps start at) that is not one of the entry's sampler
    steps (matched by value, :func:`~chorus.engine.routing.match_step`; :func:`entry_sampler_sigmas`:
    a step the entry's request skipped then runs dense). Never raises."""
    try:
        if block_size is not None and entry_signature.get("block_size") != block_size:
            return f"entry block size {entry_signature.get('block_size')} differs from {block_size}"
        if run_starts:
            schedule = entry_sampler_sigmas(entry_signature)
            missing = [s for s in run_starts if match_step(s, schedule) is None]
            if missing:
                return (f"step schedule differs from the entry's (sigma {missing[0]:.4g} not in "
                        f"{[round(s, 4) for s in schedule]})")
    except (TypeError, ValueError, AttributeError) as exc:  # a hostile or damaged signature
        return f"entry signature unreadable ({type(exc).__name__}: {exc})"
    return None


def serve_mismatch(entry_signature, models=(), run_starts=None, block_size: int | None = None,
                   image_frames=None) -> str | None:
    """Why an entry (its signature) cannot serve every model of ``models`` (:class:`ModelInfo`), a sampler
    run and a request with input images on ``image_frames`` (:func:`model_mismatch` for each, then
    :func:`run_mismatch`, then :func:`image_frames_mismatch`), or None: what retrieval's candidate loader and a
    plan moving its hit both ask. Never raises."""
    for info in models:
        reason = model_mismatch(entry_signature, info)
        if reason is not None:
            return reason
    return run_mismatch(entry_signature, run_starts, block_size) or image_frames_mismatch(entry_signature,
                                                                                          image_frames)


def describe_image_frames(frames) -> str:
    """Words for an :func:`~chorus.engine.model_info.image_frames` triple ``(first, last, other)``."""
    first, last, other = (int(f) for f in frames)
    named = {(0, 0, 0): "no input image", (1, 0, 0): "a start image", (1, 1, 0): "a start and an end image",
             (0, 1, 0): "an end image"}.get((first, last, other))
    counts = f"{first} first, {last} last, {other} other latent frames"
    return f"{named} ({counts})" if named else f"images on {counts}"


def image_frames_mismatch(entry_signature, frames) -> str | None:
    """Why an entry cannot serve a request whose forwards hold input images on ``frames`` (``(first, last,
    other)``, :func:`~chorus.engine.model_info.image_frames`), or None: it can, or either side does not tell
    (an entry written before entries recorded it, a model it cannot be read from). Never raises."""
    recorded = entry_signature.get("image_frames") if isinstance(entry_signature, dict) else None
    if frames is None or recorded is None:
        return None
    try:
        recorded, frames = tuple(int(f) for f in recorded), tuple(int(f) for f in frames)
        if recorded == frames:
            return None
        return (f"the entry was recorded with {describe_image_frames(recorded)}, this request has "
                f"{describe_image_frames(frames)}")
    except (TypeError, ValueError) as exc:
        return f"entry signature unreadable ({type(exc).__name__}: {exc})"


def grid_compatibility(entry_signature, grid) -> tuple[str, str]:
    """Can an entry's maps serve forwards of token grid ``grid`` (``(T', H', W')``)?

    Returns ``("same", "")`` (the entry's own grid), ``("resample", why)`` (another grid of the same aspect: its
    maps are resampled in 3D block coordinates, an entry in a token order to the order of its kind at that grid)
    or ``("incompatible", why)`` (another aspect, an order that cannot be rebuilt, a damaged signature). The
    latent alone does not tell a forward's grid: ComfyUI's context windows, for one, run the model on windows of
    the latent's frames. Never raises."""
    try:
        order = entry_token_order(entry_signature)
        return grid_carry(entry_signature["token_grid"], grid, None if order is None else order.name)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return "incompatible", f"entry signature unreadable ({type(e).__name__}: {e})"


def grid_carry(src_grid, dst_grid, token_order: str | None) -> tuple[str, str]:
    """The rule behind :func:`grid_compatibility`, for block maps (or block mass) of token grid ``src_grid``
    in token order ``token_order`` (a name; None = raster) and a call of grid ``dst_grid``: ``("same", "")``,
    ``("resample", why)`` (the same aspect: :func:`chorus.kernels.resample_block_map` carries them, from the
    order at ``src_grid`` to the order of its kind at ``dst_grid``, :func:`order_at`) or ``("incompatible",
    why)`` (another aspect; a token order at a grid past :data:`MAX_ORDER_TOKENS`). The recorder carries a
    call's mass to its recording's grid by it. Raises ``ValueError`` / ``TypeError`` for grids of non-integers,
    and for two different grids that are not three positive ints each (the aspect check's)."""
    from ..kernels import aspect_matches

    src, dst = tuple(int(g) for g in src_grid), tuple(int(g) for g in dst_grid)
    if src == dst:
        return "same", ""
    if not aspect_matches(src, dst):
        return "incompatible", f"token grid {dst} has another aspect than the entry's {src}"
    ordered = token_order is not None and token_order not in RASTER_ORDER_NAMES
    if ordered and math.prod(dst) > MAX_ORDER_TOKENS:
        return "incompatible", f"token grid {dst} is too large to rebuild token order {token_order} at"
    in_order = f" (token order {token_order})" if ordered else ""
    return "resample", (f"token grid {dst} differs from the entry's {src} with the same aspect: masks "
                        f"resampled{in_order}")


def latent_compatibility(entry_signature: dict, latent_shape) -> tuple[str, str]:
    """Can an entry's masks serve a latent of this shape?

    Returns ``("same", "")`` (the entry's latent, or another one of the same token grid), ``("same", why)``
    (an entry recorded in context windows -- its grid is not its latent's -- and a latent of the same frame
    size: served at the entry's grid, which the request's first forward confirms or not,
    ``Plan.serve_run``), ``("resample", why)`` (same channels and aspect, another token grid: masks are
    resampled in 3D block coordinates) or ``("incompatible", why)``: the latent's token grid by
    :func:`grid_compatibility`, after the signature's format and the channels.

    Token order (:func:`entry_token_order`): an entry in any order this version rebuilds is served
    in its own order (the engine runs attention on the tokens in that order: exact); at another grid in the
    order of its kind there (:func:`order_at`); an order that cannot be rebuilt is incompatible (a miss, never
    misread).
    """
    try:
        if int(entry_signature.get("format", -1)) != SIGNATURE_FORMAT:
            return "incompatible", f"entry signature format {entry_signature.get('format')!r} is not {SIGNATURE_FORMAT}"
        entry_token_order(entry_signature)  # an order this version cannot rebuild: never served
        shape = tuple(int(s) for s in latent_shape)[-4:]
        e_shape = tuple(int(s) for s in entry_signature["latent_shape"])
        if shape == e_shape:
            return "same", ""
        if shape[0] != e_shape[0]:
            return "incompatible", f"latent has {shape[0]} channels, entry {e_shape[0]} (another model family)"
        e_grid, grid = tuple(int(g) for g in entry_signature["token_grid"]), token_grid(shape)
        if e_grid != token_grid(e_shape) and e_grid[1:] == grid[1:]:
            return "same", (f"the entry was recorded in context windows of token grid {e_grid}: served at it where "
                            "this request's windows are the same (its first forward tells)")
        return grid_compatibility(entry_signature, grid)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return "incompatible", f"entry signature unreadable ({type(e).__name__}: {e})"
