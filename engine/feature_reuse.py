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
self-attention can be intercepted should expand q/k/v to the full sequence (``expand_tokens``), run
its (sparse) attention there and take ``compact_rows`` of the output: then each pooled key counts as
the tokens it stands for and the attention mass stays right (the ComfyUI patch's one attention
override does that, ``nodes/comfy_patch.py``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from ..kernels import pooling
from .plan import Plan
from .routing import match_step, sigma_schedule, sigma_value, step_sigma
from .model_info import ModelInfo
from .state import FEATURE_REUSE_META_VERSION, FeatureReuseState

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
    - ``region`` / ``pool``: region and cell sizes in tokens (t, h, w); ``pool`` divides ``region``.
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
        object.__setattr__(self, "region", tuple(int(v) for v in self.region))
        object.__setattr__(self, "pool", tuple(int(v) for v in self.pool))
        if not isinstance(self.full_layers, int) or self.full_layers < 0:
            raise ValueError(f"full_layers must be an int >= 0, got {self.full_layers!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


def feature_state(plan: Plan) -> FeatureReuseState:
    """The plan's :class:`FeatureReuseState` (the declared ``plan.state.feature_reuse``)."""
    return plan.state.feature_reuse


def select_regions(redundancy: torch.Tensor, grid, region, share: float, *, keep_first_frame: bool = True
                   ) -> torch.Tensor:
    """Ids of the ``round(share * R)`` most redundant complete regions (int64, sorted), excluding
    regions that hold frame 0 when ``keep_first_frame``. ``redundancy``: ``[R]`` scores."""
    counts = pooling.region_counts(grid, region)
    total = counts[0] * counts[1] * counts[2]
    if redundancy.numel() != total:
        raise ValueError(f"{redundancy.numel()} region scores for {total} complete regions of grid {tuple(grid)}")
    want = int(round(float(share) * total))
    scores = torch.nan_to_num(redundancy.double(), nan=-math.inf, posinf=-math.inf, neginf=-math.inf)
    if keep_first_frame:
        scores[pooling.region_frames(grid, region) == 0] = -math.inf
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
        self._layouts: dict = {}
        self._compacted: dict = {}
        self.full_blocks_reason: str | None = None  # set when a compact block failed: full blocks from then on

    def __deepcopy__(self, memo):
        return self

    def begin_run(self, sample_sigmas=None) -> None:
        """Start a sampler run (``sample_sigmas``: its schedule or None): the plan serves this model
        (:meth:`Plan.serve_run`)."""
        self.sample_sigmas = sigma_schedule(sample_sigmas)
        self._layouts.clear()
        self._compacted.clear()
        self._running = True
        self.expert = self.plan.serve_run(self.model_info)

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
        self._compacted.clear()
        self._running = False
        self.expert = None

    # -- the hit side ----------------------------------------------------------------------------
    def _entry_scores(self) -> dict | None:
        meta = self.plan.entry_meta or {}
        fr = meta.get(META_KEY)
        if not isinstance(fr, dict) or fr.get("version") != META_VERSION:
            return None
        return fr

    def layout_for(self, sigma: float, grid, device) -> pooling.RegionLayout | None:
        """The layout to use at this step and grid, or None (run in full). Raises ``ValueError`` on
        an entry whose scores do not fit."""
        cfg = self.config
        if cfg.downsample_share <= 0 or self.expert is None or not self.plan.is_hit or self.full_blocks_reason:
            return None
        fr = self._entry_scores()
        if fr is None:
            self.plan.note("feature reuse: the entry has no region scores (written without Chorus Feature "
                           "Reuse on the model); blocks run in full")
            return None
        if tuple(fr["token_grid"]) != tuple(grid):
            self.plan.note(f"feature reuse: entry region scores are for grid {tuple(fr['token_grid'])}, "
                           f"this request has {tuple(grid)}; blocks run in full")
            return None
        if tuple(fr["region"]) != cfg.region or tuple(fr["pool"]) != cfg.pool:
            self.plan.note("feature reuse: the entry's region geometry differs; blocks run in full")
            return None
        key = (round(sigma, 6), tuple(grid), str(device))
        if key in self._layouts:
            return self._layouts[key]
        per_expert = {float(s): v for s, v in fr["scores"].get(str(self.expert), {}).items()}
        ordered = sorted(per_expert, reverse=True)
        step = match_step(sigma, ordered)
        layout = None
        if step is not None:
            scores = torch.tensor(per_expert[ordered[step]], dtype=torch.float64)
            regions = select_regions(scores, grid, cfg.region, cfg.downsample_share,
                                     keep_first_frame=cfg.keep_first_frame)
            if regions.numel():
                layout = pooling.build_layout(grid, cfg.region, cfg.pool, regions, device=device,
                                              order=self._compact_order(grid, regions))
        self._layouts[key] = layout
        return layout

    def _compact_order(self, grid, regions: torch.Tensor):
        """The entry's :class:`~chorus.kernels.tile_order.RegionTileOrder` when its tiles are this
        config's regions and hold every region to pool (then the layout is built in that order and
        self-attention runs on the compact sequence), else None (attention on the expanded grid)."""
        from ..kernels.tile_order import RegionTileOrder

        order = self.plan.entry_order
        if not isinstance(order, RegionTileOrder) or order.region != self.config.region or order.grid != tuple(grid):
            return None
        if not bool(torch.isin(regions.cpu(), order.tile_regions).all()):
            return None
        return order

    # -- the call ----------------------------------------------------------------------------------
    def block(self, block_fn, x: torch.Tensor, *, layer: int, sigma, grid, per_token: dict | None = None
              ) -> torch.Tensor:
        """One block call: ``[B, L, C] -> [B, L, C]`` (a reduced call's output is row-major whatever
        ``x``'s strides).

        ``block_fn(x, per_token, layout)``: the host's block on ``x`` with ``per_token`` (same keys as
        given, compacted on a reduced call) and the layout (None = full sequence). ``sigma``: float or
        tensor (first element). ``grid``: ``(T', H', W')`` with ``T'*H'*W' == L``.
        ``per_token``: ``{name: (tensor [B or 1, L, ...], rule)}``, see :func:`compact_per_token`.
        """
        plan = self.plan
        full_inputs = {name: t for name, (t, _) in (per_token or {}).items()}
        try:
            if not self._running:
                self.begin_run()
            if self.expert is None:
                return block_fn(x, full_inputs, None)
            sigma = step_sigma(sigma_value(sigma), self.sample_sigmas)
            grid = tuple(int(g) for g in grid)
            if x.dim() != 3 or grid[0] * grid[1] * grid[2] != x.shape[1]:
                plan.note(f"feature reuse: token grid {grid} does not hold the {x.shape[1]} tokens of a block "
                          "call; that call runs in full")
                return block_fn(x, full_inputs, None)
            if not plan.is_hit:
                return self._full_and_record(block_fn, x, full_inputs, layer, sigma, grid)
            layout = None if int(layer) < self.config.full_layers else self.layout_for(sigma, grid, x.device)
        except Exception as exc:  # noqa: BLE001 - never crash sampling: full block
            plan.note(f"feature reuse not used for a block call ({type(exc).__name__}: {exc}); full block")
            return block_fn(x, full_inputs, None)
        if layout is None:
            with self.state.lock:
                self.state.blocks_full += 1
            return block_fn(x, full_inputs, None)
        skip = self.config.mode == "skip"
        try:
            if skip:
                keep = layout.keep_index
                x_c = x.index_select(1, keep)
                inputs_c = {name: (t if rule == "none" else t.index_select(1, keep))
                            for name, (t, rule) in (per_token or {}).items()}
            else:
                # a channel-strided stream (ComfyUI's WanModel hands its blocks a transposed view of the
                # patch embedding) is copied row-major once: the fused pooling kernels read rows of
                # channels, and the unpooled output, row-major, carries that layout to later blocks
                x = x.contiguous()
                x_c = pooling.pool_tokens(x, layout)
                inputs_c = self._compact_inputs(per_token, layout)
        except Exception as exc:  # noqa: BLE001
            plan.note(f"feature reuse: pooling failed ({type(exc).__name__}: {exc}); full block")
            return block_fn(x, full_inputs, None)
        try:
            y_c = block_fn(x_c, inputs_c, None if skip else layout)
        except Exception as exc:  # noqa: BLE001 - e.g. another patch that needs the full sequence
            if type(exc).__name__ in PROPAGATE:
                raise
            self.full_blocks_reason = f"the block failed on the compact sequence ({type(exc).__name__}: {exc})"
            plan.note(f"feature reuse: {self.full_blocks_reason}; full blocks from now on")
            return block_fn(x, full_inputs, None)
        with self.state.lock:
            self.state.blocks_reduced += 1
            self.state.tokens_saved += layout.length - x_c.shape[1]
            self.state.tokens_total += layout.length
            self.state.acted_sigmas.add(round(sigma, 6))
        if skip:
            return x.index_copy(1, layout.keep_index, y_c)
        return pooling.unpool_residual(x, x_c, y_c, layout)

    def _compact_inputs(self, per_token, layout):
        """:func:`compact_per_token`, reusing the result while the same tensor object comes back with
        the same layout (hosts pass one RoPE tensor to every block of a forward)."""
        out = {}
        for name, (tensor, rule) in (per_token or {}).items():
            hit = self._compacted.get(name)
            if hit is not None and hit[0]() is tensor and hit[1] is layout and hit[2] == rule:
                out[name] = hit[3]
                continue
            value = compact_per_token({name: (tensor, rule)}, layout)[name]
            try:
                self._compacted[name] = (weakref.ref(tensor), layout, rule, value)
            except TypeError:  # not weak-referenceable: no caching
                pass
            out[name] = value
        return out

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
            self.plan.note(f"feature reuse: recording region scores failed ({type(exc).__name__}: {exc})")
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
            self.plan.note(f"feature reuse: recording region scores failed ({type(exc).__name__}: {exc})")

