"""Feature reuse: redundant spatiotemporal regions computed at a downsampled resolution on a hit.

Method (DESIGN.md point 3), host-agnostic, at the level of one Wan transformer block:

- **Miss (the dense run that becomes an entry)**: for every block call, the block's update
  ``r = block(x) - x`` (on a strided subset of at most 256 channels) is measured per complete region of ``region`` tokens (default 2x8x8 over
  t, h, w): ``detail = |r - cellmean(r)|^2 / |r|^2`` with cells of ``pool`` tokens (default 2x2x2),
  i.e. how much of the update varies across neighbouring frames and pixels inside the region —
  exactly the part a downsampled computation of the region would lose. ``redundancy = 1 - detail``
  is averaged over the layers per (expert, step) and written with the entry, in its metadata under
  ``"feature_reuse"`` (``plan.state.entry_extras``, which ``commit_plan`` writes; a few thousand floats).
- **Hit**: per (expert, step) the ``downsample_share`` most redundant regions (share of all complete
  regions; never a region holding the first frame, which carries the image condition) are pooled,
  cell by cell, into one token each; the block runs once on the compact sequence (kept tokens at
  full resolution + pooled tokens), so the pooled tokens take part in attention and in the block's
  feed-forward at the reduced resolution; the block's update of a pooled token is then upsampled
  back onto the cell's tokens, each of which keeps its own input (``kernels.pooling.unpool_residual``).
  Nothing is skipped, so no seam appears at region boundaries (``tests/test_feature_reuse_wan.py``).
- The first ``full_layers`` layers always run in full; steps or grids with no recorded scores run in
  full. Anything unexpected runs the block in full, with a note in the plan (never raises mid-sampling).

Hosts give :meth:`FeatureReuse.block` a ``block_fn(x, per_token, layout) -> y`` that runs their block on
``x`` ``[B, L or L', C]`` with the per-token inputs (RoPE, per-token modulation) already compacted, and
``layout`` (a :class:`chorus.kernels.pooling.RegionLayout`, or None for the full sequence). A host whose
self-attention can be intercepted hands that call to the engine as a compact call
(:meth:`ChorusAttention.compact_self_attention`, ``torch.ops.chorus.attend_compact``: the ComfyUI
override's path, ``nodes/comfy_override.py``), so each pooled key counts as the tokens it stands for and
the attention mass stays right: in raster order by expanding the call to the full sequence and
compacting its output, in a region order on the compact sequence itself with a ``log(P)`` bias on each
cell's key (:meth:`ChorusAttention.attend`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import aspect_matches, pooling, resample_region_scores
from .compat import order_at
from .plan import Plan, grid_unchecked
from .routing import match_step, sigma_schedule, sigma_value, step_sigma
from .model_info import ModelInfo, frame_flags_of
from .state import FEATURE_REUSE_META_VERSION, FeatureReuseState, failure_text

META_KEY = "feature_reuse"
META_VERSION = FEATURE_REUSE_META_VERSION
POOL_RULES = ("mean", "rotation", "none")
MODES = ("downsample", "skip")
RECORD_CHANNELS = 256
PROPAGATE = ("InterruptProcessingException", "KeyboardInterrupt", "OutOfMemoryError")


@dataclass(frozen=True)
class FeatureReuseConfig:
    """Settings of feature reuse. Bad values raise ``ValueError``.

    - ``downsample_share`` in [0, 1]: share of complete regions downsampled on a hit (0 = off).
    - ``region`` / ``pool``: region and cell sizes in tokens (t, h, w); ``pool`` divides ``region``, each extent at
      most ``pooling.MAX_ROTATION_POOL`` (6: a cell's RoPE is its rotations' mean).
    - ``full_layers`` >= 0: leading layers always computed in full.
    - ``keep_first_frame``: never downsample a region that holds frame 0 (the image condition).
    - ``mode``: ``"downsample"`` (the method) or ``"skip"`` (ablation for tests and benchmarks: the
      same regions are left out of the block and keep their input, as feature *skipping* would).
    """

    downsample_share: float = 0.25
    region: tuple = (2, 8, 8)
    pool: tuple = (2, 2, 2)
    full_layers: int = 1
    keep_first_frame: bool = True
    mode: str = "downsample"

    def __post_init__(self):
        share = self.downsample_share
        if not (isinstance(share, (int, float)) and math.isfinite(share) and 0.0 <= share <= 1.0):
            raise ValueError(f"downsample_share must be in [0, 1], got {share!r}")
        pooling.check_geometry((1, 1, 1), self.region, self.pool)
        if max(int(v) for v in self.pool) > pooling.MAX_ROTATION_POOL:  # cells' RoPE is their rotations' mean
            raise ValueError(f"pool extents must be at most {pooling.MAX_ROTATION_POOL}, got {tuple(self.pool)}")
        object.__setattr__(self, "region", tuple(int(v) for v in self.region))
        object.__setattr__(self, "pool", tuple(int(v) for v in self.pool))
        if not isinstance(self.full_layers, int) or self.full_layers < 0:
            raise ValueError(f"full_layers must be an int >= 0, got {self.full_layers!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


@dataclass(frozen=True)
class Reduction:
    """One forward's feature reuse on a hit (:meth:`FeatureReuse.reduction`): the step's ``layout``
    (a :class:`~chorus.kernels.pooling.RegionLayout` on the forward's device), the step's ``sigma``
    (as the run's schedule has it), ``from_layer`` (layers below it run in full) and ``skip`` (the
    ablation mode: pooled regions left out instead of downsampled)."""

    layout: pooling.RegionLayout
    sigma: float
    from_layer: int
    skip: bool = False

    @property
    def compact_length(self) -> int:
        """Tokens of a reduced block's sequence: kept tokens + one per cell (skip: kept tokens only)."""
        return int(self.layout.keep_index.numel()) if self.skip else self.layout.compact_length

    @property
    def compact_attention(self) -> bool:
        """Whether a reduced block's self-attention is the layout's (pooled keys weighted by their
        cells); in skip mode it is plain attention over the kept tokens."""
        return not self.skip

    def __deepcopy__(self, memo):
        return self


def feature_state(plan: Plan) -> FeatureReuseState:
    """The plan's :class:`FeatureReuseState` (the declared ``plan.state.feature_reuse``)."""
    return plan.state.feature_reuse


def select_regions(redundancy: torch.Tensor, grid, region, share: float, *, keep_first_frame: bool = True,
                   held_frames=None) -> torch.Tensor:
    """Ids of the ``round(share * R)`` most redundant complete regions (int64, sorted), excluding
    regions that hold frame 0 when ``keep_first_frame``, and those that hold a frame with an input image
    (``held_frames``: per latent frame of ``grid``, whether it holds one, as
    :func:`~chorus.engine.model_info.image_frame_flags`; None: none known; a first-last-frame video's end image,
    and an image frame inside a context window, is never computed downsampled). ``redundancy``: ``[R]`` scores.
    Raises ``ValueError`` for scores or flags that do not fit ``grid``."""
    counts = pooling.region_counts(grid, region)
    total = counts[0] * counts[1] * counts[2]
    if redundancy.numel() != total:
        raise ValueError(f"{redundancy.numel()} region scores for {total} complete regions of grid {tuple(grid)}")
    want = int(round(float(share) * total))
    scores = torch.nan_to_num(redundancy.double(), nan=-math.inf, posinf=-math.inf, neginf=-math.inf)
    starts = pooling.region_frames(grid, region)
    if keep_first_frame:
        scores[starts == 0] = -math.inf
    if held_frames is not None:
        held = torch.tensor([bool(h) for h in held_frames], dtype=torch.bool)
        if held.numel() != int(tuple(grid)[0]):
            raise ValueError(f"{held.numel()} image-frame flags for the {tuple(grid)[0]} frames of grid {tuple(grid)}")
        held_in = torch.zeros(starts.shape, dtype=torch.bool)
        for offset in range(int(tuple(region)[0])):  # a complete region holds frames [start, start + region[0])
            held_in |= held[starts + offset]
        scores[held_in] = -math.inf
    eligible = int(torch.isfinite(scores).sum())
    want = min(want, eligible)
    if want <= 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.topk(scores, want).indices.sort().values


def compact_per_token(per_token: dict | None, layout: pooling.RegionLayout) -> dict:
    """Compact per-token host inputs: ``{name: (tensor [B or 1, L, ...], rule)}`` with rule ``"mean"``
    (cell mean), ``"rotation"`` (RoPE rotation matrices ``[..., 2, 2]``) or ``"none"`` (unchanged)."""
    out = {}
    for name, (tensor, rule) in (per_token or {}).items():
        if rule == "mean":
            out[name] = pooling.pool_tokens(tensor, layout)
        elif rule == "rotation":
            out[name] = pooling.pool_rotations(tensor, layout)
        elif rule == "none":
            out[name] = tensor
        else:
            raise ValueError(f"unknown pooling rule {rule!r} for {name!r} (one of {POOL_RULES})")
    return out


class FeatureReuse:
    """One patched model's feature-reuse handle (the counterpart of ``ChorusAttention``).

    Args: ``plan`` (shared by every model of the request), ``config`` (:class:`FeatureReuseConfig`),
    ``model_info`` (:class:`ModelInfo`; an unsupported model always runs in full).
    Per sampler run: :meth:`begin_run` / :meth:`end_run` (a miss's scores are written into
    ``plan.state.entry_extras["feature_reuse"]`` at the end of every run). ``block`` begins a run itself.
    """

    def __init__(self, plan: Plan, config: FeatureReuseConfig, model_info: ModelInfo):
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a chorus Plan, got {type(plan).__name__}")
        if not isinstance(config, FeatureReuseConfig):
            raise ValueError(f"config must be a FeatureReuseConfig, got {type(config).__name__}")
        if not isinstance(model_info, ModelInfo):
            raise ValueError(f"model_info must be a ModelInfo, got {type(model_info).__name__}")
        self.plan, self.config, self.model_info = plan, config, model_info
        self.state = feature_state(plan)
        self.expert: int | None = None
        self.sample_sigmas: list[float] | None = None
        self._running = False
        self._forward_grid = None  # the token grid of the run's first forward (serve_grid)
        self._layouts: dict = {}
        self.full_blocks_reason: str | None = None  # set when a compact block failed: full blocks from then on

    def __deepcopy__(self, memo):
        return self

    def begin_run(self, sample_sigmas=None) -> None:
        """Start a sampler run (``sample_sigmas``: its schedule or None): the plan serves this model
        (:meth:`Plan.serve_run`)."""
        self.sample_sigmas = sigma_schedule(sample_sigmas)
        self._layouts.clear()
        self._running = True
        self._forward_grid = None
        self.expert = self.plan.serve_run(self.model_info)

    def serve_grid(self, grid, image_frames=None) -> None:
        """The token grid ``(T', H', W')`` of a forward of this model (the host calls this before it decides
        anything else of the forward) and its input images (``image_frames``: as for ``ChorusAttention``): the
        run's first forward has the plan serve them (:meth:`Plan.serve_run`,
        as :meth:`ChorusAttention.serve_grid <chorus.engine.runtime.ChorusAttention.serve_grid>`), and reads
        this model's expert index in what the plan serves now. Begins the run if the host did not. Never
        raises: a failure is a note (its blocks then run as the plan and expert index it had allow)."""
        try:
            if not self._running:
                self.begin_run()
            if self._forward_grid is not None:
                return
            self._forward_grid = grid = tuple(int(g) for g in grid)
            self._layouts.clear()
            frames = image_frames() if image_frames is not None else None
            self.expert = self.plan.serve_run(self.model_info, forward_grid=grid, image_frames=frames)
        except Exception as exc:  # noqa: BLE001 - never crash sampling
            self.plan.note(grid_unchecked(grid, exc))

    def end_run(self) -> None:
        request = self.plan.state
        if not self.plan.is_hit:
            exported = self.state.export()
            if exported is not None:
                with request.lock:  # written with the new entry: commit_plan merges the entry extras
                    request.entry_extras[META_KEY] = exported
        elif self.state.blocks_reduced or self.state.blocks_full:
            # the request's summary for the UI (ChorusCacheWrite shows plan.stats.messages); one line
            with request.lock:
                messages = request.stats.messages
                messages[:] = [m for m in messages if not m.startswith("feature reuse: ") or "block calls" not in m]
                messages.append(self.state.summary())
        self._layouts.clear()
        self._running = False
        self.expert = None

    # -- the hit side ----------------------------------------------------------------------------
    def _entry_scores(self) -> dict | None:
        meta = self.plan.entry_meta or {}
        fr = meta.get(META_KEY)
        if not isinstance(fr, dict) or fr.get("version") != META_VERSION:
            return None
        return fr

    def layout_for(self, sigma: float, grid, device, image_flags=None,
                   end_image_biased: bool = False) -> pooling.RegionLayout | None:
        """The layout to use at this step and grid, or None (run in full). The entry's region scores are for
        its grid; at another grid of the same aspect (context windows of two lengths, a request of another
        size) they are carried there (:func:`chorus.kernels.resample_region_scores`, noted), at another aspect
        not (noted, None). Regions on a frame with an input image run in full (:func:`select_regions`; so do
        those on the last frame where the entry's order keeps it out of its tiles, a first-last-frame entry's): the
        forward's own frames (``image_flags``: a callable giving them, per frame of ``grid``; the host's answer
        for a forward in a context window, which holds part of the video), else the request's first and last
        image frames (the plan's ``state.image_frames``). ``end_image_biased``: the forward's self-attention
        biases its last frame (Chorus Guidance Boost's end-image bias): where that frame holds an image, the
        layout leads with it (:meth:`_build_layout`). Raises ``ValueError`` on an entry whose scores do not
        fit."""
        cfg = self.config
        if cfg.downsample_share <= 0 or self.expert is None or not self.plan.is_hit or self.full_blocks_reason:
            return None
        fr = self._entry_scores()
        if fr is None:
            self.plan.note("feature reuse: the entry has no region scores (written without Chorus Feature "
                           "Reuse on the model); blocks run in full")
            return None
        scores_grid, grid = tuple(int(g) for g in fr["token_grid"]), tuple(int(g) for g in grid)
        if scores_grid != grid and not aspect_matches(scores_grid, grid):
            self.plan.note(f"feature reuse: entry region scores are for grid {scores_grid}, this request has {grid} "
                           "(another aspect); blocks run in full")
            return None
        if tuple(fr["region"]) != cfg.region or tuple(fr["pool"]) != cfg.pool:
            self.plan.note("feature reuse: the entry's region geometry differs; blocks run in full")
            return None
        held = image_flags() if image_flags is not None else None
        if held is None or len(held) != grid[0]:
            held = frame_flags_of(self.plan.state.image_frames, grid[0])
        end_image = bool(end_image_biased) and bool(held) and bool(held[-1]) and grid[0] > 1
        key = (round(sigma, 6), grid, str(device), held, end_image)
        if key in self._layouts:
            return self._layouts[key]
        per_expert = {float(s): v for s, v in fr["scores"].get(str(self.expert), {}).items()}
        ordered = sorted(per_expert, reverse=True)
        step = match_step(sigma, ordered)
        layout = None
        if step is not None:
            scores = torch.tensor(per_expert[ordered[step]], dtype=torch.float64)
            if scores_grid != grid:  # context windows of two lengths, a request at another size of the same aspect
                scores = resample_region_scores(scores, scores_grid, grid, cfg.region)
                self.plan.note(f"feature reuse: entry region scores for grid {scores_grid} carried to grid {grid}")
            if getattr(self.plan.entry_order, "last_frame_rim", False):  # its tiles never hold the last frame
                held = (tuple(held) if held else (False,) * grid[0])[:-1] + (True,)
            regions = select_regions(scores, grid, cfg.region, cfg.downsample_share,
                                     keep_first_frame=cfg.keep_first_frame, held_frames=held)
            if regions.numel():
                layout = self._build_layout(grid, regions, device, end_image)
        self._layouts[key] = layout
        return layout

    def _build_layout(self, grid, regions: torch.Tensor, device, end_image: bool) -> pooling.RegionLayout:
        """The layout pooling ``regions``: in the compact order where there is one (:meth:`_compact_order`),
        leading with the last frame where it holds an end image the forward's self-attention biases
        (``end_image``) and the order allows (``RegionLayout.end_image_leads``: the bias then reaches it on
        compact calls; it costs blocks on the two image frames' query rows, so a forward without the bias
        keeps the order's own layout)."""
        cfg, order = self.config, self._compact_order(grid, regions)
        if end_image and order is not None:
            try:
                return pooling.build_layout(grid, cfg.region, cfg.pool, regions, device=device, order=order,
                                            end_image_leads=True)
            except ValueError:  # an order the last frame does not end, or too little rim to pad the two frames
                pass  # (a tiny grid): the order's own layout
        return pooling.build_layout(grid, cfg.region, cfg.pool, regions, device=device, order=order)

    def _compact_order(self, grid, regions: torch.Tensor):
        """The entry's :class:`~chorus.kernels.tile_order.RegionTileOrder` at ``grid`` (at another grid than the
        entry's, the order of its kind there: what the hit's attention runs in, :func:`~chorus.engine.compat.
        order_at`) when its tiles are this config's regions and hold every region to pool (then the layout is
        built in that order and self-attention runs on the compact sequence), else None (attention on the
        expanded grid)."""
        from ..kernels.tile_order import RegionTileOrder

        order = self.plan.entry_order
        if not isinstance(order, RegionTileOrder) or order.region != self.config.region:
            return None
        order = order_at(order, grid)
        if not bool(torch.isin(regions.cpu(), order.tile_regions).all()):
            return None
        return order

    # -- the call ----------------------------------------------------------------------------------
    def reduction(self, sigma, grid, device, *, avoid_lengths=(), image_flags=None,
                  end_image_biased: bool = False) -> Reduction | None:
        """This forward's :class:`Reduction` on a hit, or None (its blocks run in full). Host side, once
        per forward (begins the sampler run if the host did not). ``sigma``: float or tensor (first
        element); ``grid``: ``(T', H', W')``; ``avoid_lengths``: sequence lengths a reduced block must not
        have (the forward's cross-attention contexts: a host that tells self- from cross-attention by
        length could not); ``image_flags``: the forward's own image frames; ``end_image_biased``: whether its
        self-attention biases its last frame (both :meth:`layout_for`).
        Counts the forward's full blocks (all layers, or those below ``full_layers``) when feature reuse
        serves the run. Never raises: a problem is a note and None."""
        plan = self.plan
        try:
            if not self._running:
                self.begin_run()
            if self.expert is None or not plan.is_hit:
                return None
            found = self._reduction_at(sigma, tuple(int(g) for g in grid), device, image_flags, end_image_biased)
            if found is not None:
                if found.compact_length in set(avoid_lengths):
                    plan.note(f"feature reuse: the compact sequence ({found.compact_length} tokens) is as long as a "
                              "cross-attention context; blocks run in full")
                    found = None
        except Exception as exc:  # noqa: BLE001 - never crash sampling: full blocks
            plan.note(f"feature reuse not used in a forward ({failure_text(exc)}); full blocks")
            return None
        with self.state.lock:
            self.state.blocks_full += self.model_info.num_layers if found is None else found.from_layer
        return found

    def _reduction_at(self, sigma, grid, device, image_flags=None,
                      end_image_biased: bool = False) -> Reduction | None:
        """The :class:`Reduction` of the step at ``sigma`` (float or tensor) on ``grid``, or None (no
        layout: full blocks). Raises what :meth:`layout_for` raises; both callers note it."""
        sigma = step_sigma(sigma_value(sigma), self.sample_sigmas)
        layout = self.layout_for(sigma, grid, device, image_flags, end_image_biased)
        if layout is None:
            return None
        return Reduction(layout, sigma, self.from_layer, self.config.mode == "skip")

    @property
    def from_layer(self) -> int:
        """The first layer a hit's forward reduces (``full_layers``, at most the model's layer count): the same
        in every forward, so a host can tell its reducible blocks apart when it patches the model."""
        return min(int(self.config.full_layers), self.model_info.num_layers)

    def compact(self, tensor: torch.Tensor, rule: str, reduction: Reduction) -> torch.Tensor:
        """A reduced block's input ``[B or 1, L, ...] -> [B or 1, L', ...]`` (``L' =
        reduction.compact_length``, row-major): ``rule`` ``"mean"`` (the residual stream, per-token
        modulation: cell means) or ``"rotation"`` (RoPE rotations ``[..., 2, 2]``); in skip mode the kept
        tokens' rows whatever the rule. Always a new tensor (a compiled graph may reuse an op's output
        buffer). Raises ``ValueError`` for an unknown rule or a tensor of another length."""
        layout = reduction.layout
        if tensor.dim() < 2 or tensor.shape[1] != layout.length:
            raise ValueError(f"a per-token input of {tuple(tensor.shape)} for a layout of {layout.length} tokens")
        if reduction.skip:
            return tensor.index_select(1, layout.keep_index)
        if rule == "mean" and tensor.dim() == 3:  # the residual stream: the fused pooling kernel reads rows
            return pooling.pool_tokens(tensor.contiguous(), layout)
        return compact_per_token({rule: (tensor, rule)}, layout)[rule]

    def expand(self, x: torch.Tensor, x_c: torch.Tensor, y_c: torch.Tensor, reduction: Reduction) -> torch.Tensor:
        """A reduced block's output on the full sequence ``[B, L, C]`` (row-major) from its input ``x``,
        the compact input ``x_c`` (:meth:`compact`) and the block's compact output ``y_c``: a pooled
        token's update upsampled onto its cell's tokens, each keeping its own input
        (``kernels.pooling.unpool_residual``; skip mode: the left-out tokens keep their input). Counts the
        reduced block."""
        layout = reduction.layout
        if reduction.skip:
            y = x.index_copy(1, layout.keep_index, y_c)
        else:
            y = pooling.unpool_residual(x.contiguous(), x_c, y_c, layout)
        with self.state.lock:
            self.state.blocks_reduced += 1
            self.state.tokens_saved += layout.length - y_c.shape[1]
            self.state.tokens_total += layout.length
        return y

    def block(self, block_fn, x: torch.Tensor, *, layer: int, sigma, grid, per_token: dict | None = None
              ) -> torch.Tensor:
        """One block call on the host side (hosts that wrap each block in Python, e.g. diffusers):
        ``[B, L, C] -> [B, L, C]`` (a reduced call's output is row-major whatever ``x``'s strides).

        ``block_fn(x, per_token, layout)``: the host's block on ``x`` with ``per_token`` (same keys as
        given, compacted on a reduced call) and the layout (None = full sequence or skip mode).
        ``sigma``: float or tensor (first element). ``grid``: ``(T', H', W')`` with ``T'*H'*W' == L``.
        ``per_token``: ``{name: (tensor [B or 1, L, ...], rule)}``, see :func:`compact_per_token`.
        A miss's full block records its region scores. A block that fails on the compact sequence is run
        in full, and feature reuse stays off for the rest of the run (a note says why).
        """
        plan = self.plan
        full_inputs = {name: t for name, (t, _) in (per_token or {}).items()}
        full, record_sigma = True, None  # decided here; the host's block runs once, outside (its errors are its own)
        try:
            if not self._running:
                self.begin_run()
            if self.expert is not None:
                grid = tuple(int(g) for g in grid)
                if x.dim() != 3 or grid[0] * grid[1] * grid[2] != x.shape[1]:
                    plan.note(f"feature reuse: token grid {grid} does not hold the {x.shape[1]} tokens of a block "
                              "call; that call runs in full")
                elif not plan.is_hit:
                    record_sigma = step_sigma(sigma_value(sigma), self.sample_sigmas)
                else:
                    full = False
        except Exception as exc:  # noqa: BLE001 - never crash sampling: full block
            plan.note(f"feature reuse not used for a block call ({failure_text(exc)}); full block")
            full, record_sigma = True, None
        if record_sigma is not None:
            return self._full_and_record(block_fn, x, full_inputs, layer, record_sigma, grid)
        if full:
            return block_fn(x, full_inputs, None)
        reduction = self._block_reduction(sigma, grid, x.device) if int(layer) >= self.config.full_layers else None
        if reduction is None:
            with self.state.lock:
                self.state.blocks_full += 1
            return block_fn(x, full_inputs, None)
        try:
            x_c = self.compact(x, "mean", reduction)
            inputs_c = {name: self.compact(t, rule, reduction) if rule != "none" else t
                        for name, (t, rule) in (per_token or {}).items()}
        except Exception as exc:  # noqa: BLE001
            plan.note(f"feature reuse: pooling failed ({failure_text(exc)}); full block")
            return block_fn(x, full_inputs, None)
        try:
            y_c = block_fn(x_c, inputs_c, None if reduction.skip else reduction.layout)
        except Exception as exc:  # noqa: BLE001 - e.g. another patch that needs the full sequence
            if type(exc).__name__ in PROPAGATE:
                raise
            self.full_blocks_reason = f"the block failed on the compact sequence ({failure_text(exc)})"
            plan.note(f"feature reuse: {self.full_blocks_reason}; full blocks from now on")
            return block_fn(x, full_inputs, None)
        try:
            return self.expand(x, x_c, y_c, reduction)
        except Exception as exc:  # noqa: BLE001 - e.g. a block whose output is not [B, L', C]: full block
            self.full_blocks_reason = f"the compact block's output could not be expanded ({failure_text(exc)})"
            plan.note(f"feature reuse: {self.full_blocks_reason}; full blocks from now on")
            return block_fn(x, full_inputs, None)

    def _block_reduction(self, sigma, grid, device) -> Reduction | None:
        """:meth:`block`'s reduction of one call (:meth:`_reduction_at`; None: full block; never raises)."""
        try:
            return self._reduction_at(sigma, grid, device)
        except Exception as exc:  # noqa: BLE001
            self.plan.note(f"feature reuse not used for a block call ({failure_text(exc)}); full block")
            return None

    def _full_and_record(self, block_fn, x, inputs, layer, sigma, grid):
        y = block_fn(x, inputs, None)
        self._record_scores(x, y, layer, sigma, grid)
        return y

    def record_block(self, x: torch.Tensor, y: torch.Tensor, *, layer: int, sigma, grid) -> None:
        """A miss's block call that the host ran in full (e.g. inside a compiled graph): record its
        region scores from its input ``x`` and output ``y`` (``[B, L, C]``; arguments as :meth:`block`).
        Does nothing on a hit or for an unsupported model; never raises."""
        try:
            if not self._running:
                self.begin_run()
            if self.expert is None or self.plan.is_hit:
                return
            sigma = step_sigma(sigma_value(sigma), self.sample_sigmas)
            grid = tuple(int(g) for g in grid)
            if x.dim() != 3 or y.shape != x.shape or grid[0] * grid[1] * grid[2] != x.shape[1]:
                self.plan.note(f"feature reuse: token grid {grid} does not hold the {x.shape[1]} tokens of a block "
                               "call; no region scores from it")
                return
        except Exception as exc:  # noqa: BLE001
            self.plan.note(f"feature reuse: recording region scores failed ({failure_text(exc)})")
            return
        self._record_scores(x, y, layer, sigma, grid)

    def _record_scores(self, x, y, layer, sigma, grid) -> None:
        try:
            if int(layer) >= self.config.full_layers:
                # a strided channel subset (<= RECORD_CHANNELS) estimates the detail share: a 14B
                # block at 720p would otherwise need ~3 GB of float32 temporaries per call
                stride = max(1, x.shape[-1] // RECORD_CHANNELS)
                with torch.no_grad():
                    update = y[..., ::stride] - x[..., ::stride]
                    detail = pooling.region_detail(update, grid, self.config.region, self.config.pool)
                if detail.numel():
                    self.state.record(self.expert, sigma, grid, self.config.region, self.config.pool, 1.0 - detail)
        except Exception as exc:  # noqa: BLE001 - the block output stands
            self.plan.note(f"feature reuse: recording region scores failed ({failure_text(exc)})")

