"""``ChorusAttention``: the per-model attention handle that routes, records and applies reuse.

Hosts (the ComfyUI adapter, the diffusers adapter, a user's own loop) call
:meth:`ChorusAttention.self_attention` for every *self*-attention call of a Wan model with
``q, k, v`` as ``[B, H, L, D]``, the layer index, the current sigma and the token grid, plus a
``dense_fn(q, k, v) -> [B, H, L, D]`` that computes the host's own dense attention. The handle
never raises from there: anything unexpected is logged once (``plan.note``) and answered with
``dense_fn``.
"""

from __future__ import annotations

import math
import time

import torch

from .. import kernels
from ..kernels.codec import pack_bits_on_device, unpack_bits_on_device
from ..kernels.pooling import compact_block_map
from .config import SparseConfig
from .guidance import biased_dense_or_plain
from .plan import Plan
from .recorder import MassRecorder
from .routing import match_step, step_sigma
from .signature import ModelInfo, region_order_for, token_order_name
from .verify import ANCHORS_META_KEY, ExpertCheck, anchors_cover, recall_terms, verify_head_index


_NEAR_TABLES: dict = {}


def _nearest_blocks(num_q: int, num_kv: int, k: int, device) -> torch.Tensor:
    """Bool ``[Qb, Kb]``: for each query block row, its ``k`` key blocks nearest to the diagonal position
    ``j ~ i * Kb / Qb`` (ties to the lower index); cached per geometry and device."""
    key = (num_q, num_kv, k, str(device))
    table = _NEAR_TABLES.get(key)
    if table is None:
        centre = torch.arange(num_q, dtype=torch.float64)[:, None] * (num_kv / num_q)
        dist = (torch.arange(num_kv, dtype=torch.float64)[None, :] - centre).abs()
        rank = torch.argsort(torch.argsort(dist, dim=-1, stable=True), dim=-1)
        table = _NEAR_TABLES[key] = (rank < k).to(device)
    return table


def floor_k_min(block_map: torch.Tensor, k_min: int) -> torch.Tensor:
    """Give every row of a bool map ``[..., Qb, Kb]`` at least ``min(k_min, Kb)`` kept blocks.

    Rows below the floor gain the ``k_min`` key blocks nearest to their diagonal position
    (``j ~ i * Kb / Qb``; a reused map has no mass left to rank by, and local blocks are the ones
    video attention needs most). Rows already at the floor are unchanged. Runs on the map's device
    without a host sync (a few elementwise kernels; the nearest-block table is built once per grid).
    """
    num_q, num_kv = block_map.shape[-2:]
    k = min(int(k_min), num_kv)
    if k <= 0:
        return block_map
    short = block_map.sum(-1, dtype=torch.int32) < k
    return block_map | (_nearest_blocks(num_q, num_kv, k, block_map.device) & short[..., None])


def _first_frame_tokens(grid, q) -> int:
    """``H' * W'`` when ``grid`` is a 3-int token grid holding q's ``L`` tokens, else 0."""
    try:
        t, h, w = (int(g) for g in grid)
    except (TypeError, ValueError):
        return 0
    return h * w if t * h * w == q.shape[-2] and h * w > 0 else 0


class _Fallback(Exception):
    """A reason to run one call dense (not an error of the host)."""


class ChorusAttention:
    """One patched model's view of a request's :class:`Plan`.

    Args:
        plan: the request's plan; Wan 2.2 A14B passes the SAME plan to both experts' handles.
        config: :class:`SparseConfig`.
        model_info: :class:`ModelInfo` of this model (``wan_model_info``); an unsupported model runs
            dense, with a message in ``plan.stats.messages``.
        record_region: None (a miss records in raster order), or feature reuse's region ``(rt, rh, rw)``
            of one block's tokens: a miss records in that :class:`~chorus.kernels.tile_order.RegionTileOrder`
            (the entry's ``token_order``), so that a hit with feature reuse can run self-attention on the
            compact sequence. A hit always runs in its entry's order (exact: attention is
            permutation-equivariant; the kernels take the order fused into their loads where they can).

    Per sampler run: :meth:`begin_run` (optional ``sample_sigmas`` of the run; registers the expert,
    checks the schedule against a hit's entry) and :meth:`end_run` (drops device copies of maps).
    ``self_attention`` begins a run by itself when the host did not.
    """

    def __init__(self, plan: Plan, config: SparseConfig, model_info: ModelInfo, record_region=None):
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a chorus Plan, got {type(plan).__name__}")
        if not isinstance(config, SparseConfig):
            raise ValueError(f"config must be a SparseConfig, got {type(config).__name__}")
        if not isinstance(model_info, ModelInfo):
            raise ValueError(f"model_info must be a ModelInfo, got {type(model_info).__name__}")
        self.plan = plan
        self.config = config
        self.model_info = model_info
        self.record_region = None if record_region is None else tuple(int(r) for r in record_region)
        self.expert: int | None = None
        self.sample_sigmas: list[float] | None = None
        self._running = False
        self._maps: dict = {}
        self._maps_step: int | None = None
        self._device_bits: dict | None = None  # (step, layer) -> the entry's bit-packed map on the device
        self._entry_steps: list[float] = []
        self._kept = None  # device counter of computed blocks (read at end_run: no sync per call)

    def __deepcopy__(self, memo):
        return self

    # -- run bracket --------------------------------------------------------------------------
    def begin_run(self, sample_sigmas=None) -> None:
        """Start a sampler run: register this model as an expert of the request, check schedules.

        ``sample_sigmas``: the run's schedule (descending sigmas, the last usually 0) or None.
        """
        plan = self.plan
        sig = None
        if sample_sigmas is not None:
            sig = [float(s) for s in (sample_sigmas.tolist() if hasattr(sample_sigmas, "tolist") else sample_sigmas)]
            if not sig or not all(math.isfinite(s) for s in sig):
                plan.note(f"ignoring a sampler schedule with non-finite or no values: {sig}")
                sig = None
        self.sample_sigmas = sig
        self._reset_run_state()
        self._running = True
        plan.stats.runs += 1
        starts = (sig[:-1] if len(sig) > 1 else sig) if sig else None  # the sigmas the run's steps start at
        # a hit's entry must serve this model, block size and schedule: else it moves to a candidate
        # that does (before the request's first sparse call) or is demoted (Plan.serve_model)
        self.expert = plan.register_expert(self.model_info, run_starts=starts, block_size=self.config.block_size)
        self._entry_steps = list(plan.step_sigmas) if plan.is_hit else []  # of the entry it serves now

    def end_run(self) -> None:
        """End a sampler run: count the blocks computed (one host sync per run), decide a verification
        still pending (engine/verify.py), drop per-run state (device maps); the plan keeps request state."""
        self._decide_pending()
        self.flush_stats()
        self._reset_run_state()
        self._running = False
        self.expert = None
        self.sample_sigmas = None

    def _reset_run_state(self) -> None:
        self._maps.clear()
        self._maps_step = None
        self._device_bits = None
        self._kept = None
        self._entry_steps = list(self.plan.step_sigmas) if self.plan.is_hit else []

    def flush_stats(self) -> None:
        """Add the device-side count of computed blocks to ``plan.stats.blocks_computed`` (syncs)."""
        if self._kept is not None:
            self.plan.stats.blocks_computed += int(self._kept)
            self._kept = None

    # -- the call ------------------------------------------------------------------------------
    def self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer: int, sigma: float,
                       grid, dense_fn, cond_rows=None, first_frame_bias: float = 0.0) -> torch.Tensor:
        """Attention output ``[B, H, L, D]`` for one self-attention call.

        ``q, k, v``: ``[B, H, L, D]`` (post-norm, post-RoPE). ``layer``: block index of the model.
        ``sigma``: current sigma (float or tensor; first element used). ``grid``: token grid
        ``(T', H', W')`` with ``T'*H'*W' == L``. ``cond_rows``: bool ``[B]`` marking rows of positive
        conditioning (recorded on a miss) or None (all rows). ``dense_fn(q, k, v)``: the host's dense
        attention, used on a miss and for every fallback. ``first_frame_bias`` (guidance, natural-log
        units): added to the logits of the first frame's ``H' * W'`` keys, in the sparse kernel and,
        in place of ``dense_fn``, in dense calls (:func:`biased_dense_or_plain`: ``dense_fn`` itself if
        the biased call fails); ignored when the grid does not hold the call's tokens. Block mass is
        always recorded without it.
        """
        start = time.perf_counter()
        try:
            # the first frame is the prefix of every order the engine runs (kernels/tile_order.py)
            prefix_len = _first_frame_tokens(grid, q) if first_frame_bias else 0
            if prefix_len:
                dense_fn = biased_dense_or_plain(dense_fn, prefix_len, float(first_frame_bias), self.plan.note)
            if not self._running:
                self.begin_run()
            if self.expert is None:
                self.plan.stats.dense_calls += 1
                return dense_fn(q, k, v)
            if self.plan.is_hit:
                return self._sparse(q, k, v, layer, sigma, grid, dense_fn, prefix_len, float(first_frame_bias),
                                    cond_rows)
            return self._dense_and_record(q, k, v, layer, sigma, grid, dense_fn, cond_rows)
        finally:
            self.plan.stats.attention_seconds += time.perf_counter() - start

    def compact_self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout, layer: int,
                               sigma: float, dense_fn, cond_rows=None, first_frame_bias: float = 0.0) -> torch.Tensor:
        """Self-attention of a feature-reuse block that runs on the compact sequence (issue 17).

        ``q, k, v``: ``[B, H, L', D]``, the compact sequence of ``layout`` (a
        :class:`~chorus.kernels.pooling.RegionLayout` built in a token order, ``layout.order``: the
        kept tokens in that order, then the cells). The map is the run's map in that order (a hit of
        an entry recorded in it) carried to the compact sequence by
        :func:`~chorus.kernels.pooling.compact_block_map` (pairs of kept tiles: their own entry; blocks
        of cells: the union over their regions); each cell's key gets ``log(P)`` added to its logits
        (the kernels' suffix bias), so it weighs as the ``P`` tokens it stands for: the attention of
        the full grid with every cell's key repeated over its tokens, on fewer blocks.
        ``first_frame_bias`` as in :meth:`self_attention` (frame 0 is the prefix of the order). Returns
        ``[B, H, L', D]``. Not a hit in that order, or anything unexpected: ``dense_fn(q, k, v)`` (the
        host's attention on the compact sequence; cells then weigh as one token each), with a note;
        never raises.
        """
        start = time.perf_counter()
        try:
            prefix_len = layout.order.first_frame_tokens if first_frame_bias else 0
            if prefix_len:
                dense_fn = biased_dense_or_plain(dense_fn, prefix_len, float(first_frame_bias), self.plan.note)
            if not self._running:
                self.begin_run()
            if self.expert is None or not self.plan.is_hit:
                self.plan.stats.dense_calls += 1
                return dense_fn(q, k, v)
            return self._sparse(q, k, v, layer, sigma, layout.grid, dense_fn, prefix_len, float(first_frame_bias),
                                cond_rows, layout=layout)
        finally:
            self.plan.stats.attention_seconds += time.perf_counter() - start

    def _check(self, q, k, v, layer, grid, layout=None) -> tuple[int, int, int]:
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            raise _Fallback("q/k/v are not tensors")
        if q.dim() != 4 or q.shape != k.shape or q.shape[:3] != v.shape[:3]:
            raise _Fallback(f"unexpected q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        tokens = q.shape[2]
        if layout is not None:  # the compact sequence of a full grid
            if tokens != layout.compact_length:
                raise _Fallback(f"{tokens} tokens in a compact call, the layout has {layout.compact_length}")
            tokens = layout.length
        try:
            grid = tuple(int(g) for g in grid)
        except (TypeError, ValueError):
            raise _Fallback(f"bad token grid {grid!r}") from None
        if len(grid) != 3 or grid[0] * grid[1] * grid[2] != tokens:
            raise _Fallback(f"token grid {grid} does not hold the {tokens} tokens of this call "
                            "(extra reference / concatenated tokens?)")
        if not (0 <= int(layer) < max(self.model_info.num_layers, 1)):
            raise _Fallback(f"layer index {layer} outside the model's {self.model_info.num_layers} layers")
        if q.shape[1] != self.model_info.num_heads:
            raise _Fallback(f"{q.shape[1]} heads in the call, the model has {self.model_info.num_heads}")
        return grid

    def _sigma(self, sigma) -> float:
        if isinstance(sigma, torch.Tensor):
            if sigma.numel() == 0:
                raise _Fallback("empty sigma tensor")
            sigma = sigma.reshape(-1)[0].item()
        return step_sigma(float(sigma), self.sample_sigmas)

    def _sparse(self, q, k, v, layer, sigma, grid, dense_fn, prefix_len=0, prefix_bias=0.0, cond_rows=None,
                layout=None):
        plan, cfg = self.plan, self.config
        check = None
        try:
            grid = self._check(q, k, v, layer, grid, layout)
            s = self._sigma(sigma)
            step = match_step(s, self._entry_steps)
            if step is None:
                if match_step(s, plan.sampler_sigmas) is not None:  # the entry's schedule, a step it skipped
                    raise _Fallback(f"no map for the step at sigma {s:.4g} (the entry's request did not run the "
                                    "model there, e.g. EasyCache skipped it)")
                raise _Fallback(f"sigma {s:.4g} is not a step of the entry's schedule")
            if self._verify_moved_on(step) and not plan.is_hit:  # demoted by a late verdict: this call too
                return self._dense_and_record(q, k, v, layer, sigma, grid, dense_fn, cond_rows)
            block_map, kept = self._device_map(step, int(layer), q, None if layout is None else layout.length)
            order = self.token_order(grid)
            suffix_len, suffix_bias = 0, 0.0
            if layout is None:
                check = self._verify(q, k, int(layer), step, s, grid, block_map, cond_rows, order)
            else:  # (no verification estimate from a compact call: the check reads full-grid calls)
                if order is None or order.name != layout.order.name or order.grid != layout.order.grid:
                    raise _Fallback(f"the compact sequence is in token order {layout.order.name}, this run's maps in "
                                    f"{'raster' if order is None else order.name}")
                block_map = compact_block_map(block_map, layout.block_sources)
                kept = block_map.sum() if block_map.device.type == "cuda" else int(block_map.sum())
                suffix_len, suffix_bias = layout.num_cells, math.log(layout.cell_size)
                order = None  # q/k/v are in the order already
            # rows_checked: the k_min >= 1 floor keeps a block in every row (of the compact map too: a
            # compact row has at least one source row), so the kernel API skips the one validation
            # that would sync the host with the GPU
            out = kernels.block_sparse_attention(q, k, v, block_map, block_size=cfg.block_size, backend=cfg.backend,
                                                 prefix_len=prefix_len, prefix_bias=prefix_bias if prefix_len else 0.0,
                                                 rows_checked=True, token_perm=order, suffix_len=suffix_len,
                                                 suffix_bias=suffix_bias, pooled_tail=cfg.pooled_tail)
        except Exception as exc:  # noqa: BLE001 - never crash sampling: dense for this call
            why = str(exc) if isinstance(exc, _Fallback) else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            plan.note(f"sparse attention not used for a call ({why}); dense attention instead")
            plan.stats.fallback_calls += 1
            if plan.state.verify_recorder is not None:  # a dense call the record-ahead did not record
                plan.state.verify_recorder.mark_incomplete(f"a call fell back during verification ({why})")
            return dense_fn(q, k, v)
        batch = q.shape[0]
        plan.stats.sparse_calls += 1
        plan.stats.tail_calls += int(cfg.pooled_tail)
        plan.stats.blocks_total += batch * block_map.shape[1] * block_map.shape[2] * block_map.shape[3]
        if isinstance(kept, int):
            plan.stats.blocks_computed += batch * kept
        else:
            self._kept = kept * batch if self._kept is None else self._kept + kept * batch
        if check is not None and int(layer) >= check.layers[-1]:
            self._decide(check)
        return out

    # -- self-verifying hits (engine/verify.py) ------------------------------------------------------
    def _verify(self, q, k, layer, step, sigma, grid, block_map, cond_rows, order=None):
        """At the first step of this expert: record this call ahead (first expert) and add the
        estimate of a checked layer (``order``: the token order the run's maps are in; None = raster).
        Returns the pending :class:`ExpertCheck` or None. Never raises."""
        plan, cfg = self.plan, self.config
        if cfg.verify_threshold <= 0:
            return None
        state = plan.state
        try:
            with state.lock:
                check = state.verification.get(self.expert)
                if check is None:
                    layers = tuple(l for l in cfg.verify_layers if l < self.model_info.num_layers)
                    if not layers:
                        check = state.verification[self.expert] = ExpertCheck(step, (), verdict="no verdict",
                                                                              reason="no checked layer in the model")
                        self._publish(check)
                        return None
                    first = not state.verification and plan.stats.sparse_calls == 0
                    check = state.verification[self.expert] = ExpertCheck(step, layers, records=first)
                    if first and not anchors_cover(plan.entry_meta, layers, cfg.verify_heads):
                        plan.note("hit verification: the entry was recorded without exact mass where this check "
                                  "looks (no verification anchors for these layers / heads), so its fit ratio is "
                                  "held down by the recording's row sampling and a fitting hit may be demoted "
                                  "(the request then writes an entry that has them)")
                    if first and plan.embedding is not None:  # a demoted request could be written
                        state.verify_recorder, state.verify_covered = MassRecorder(), 0
            if check.verdict is not None or check.step != step:
                return None
            recorder = state.verify_recorder if check.records else None
            if recorder is not None and recorder.incomplete_reason is None:
                try:
                    self._record_into(recorder, q, k, layer, sigma, grid, cond_rows)
                    state.verify_covered += 1
                except Exception as exc:  # noqa: BLE001
                    recorder.mark_incomplete(f"recording ahead failed ({type(exc).__name__}: {exc})")
            if layer in check.layers and layer not in check.estimates:
                qs, ks = self._cond_subset(q, k, cond_rows, keep_all=True)
                with torch.no_grad():
                    check.estimates[layer] = recall_terms(
                        qs, ks, block_map, heads=verify_head_index(q.shape[1], cfg.verify_heads),
                        sample_rows=cfg.verify_rows, block_size=cfg.block_size, token_perm=order)
            return check
        except Exception as exc:  # noqa: BLE001 - verification never breaks sampling
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            plan.note(f"hit verification gave no verdict for expert {self.expert} ({why})")
            check = state.verification.get(self.expert)
            if check is not None and check.verdict is None:
                check.verdict, check.reason, check.estimates = "no verdict", why, {}
                self._publish(check)
                self._drop_record_ahead(check)
            return None

    def _verify_moved_on(self, step: int) -> bool:
        """Decide this expert's check if it is still pending at a later step (its last checked layer
        never ran sparse, e.g. a fallback); True when a verdict was taken now."""
        check = self.plan.state.verification.get(self.expert)
        if check is None or check.verdict is not None or check.step == step:
            return False
        self._decide(check)
        return True

    def _publish(self, check: ExpertCheck) -> None:
        self.plan.stats.verification[self.expert] = {**check.summary(), "threshold": self.config.verify_threshold}

    def _drop_record_ahead(self, check: ExpertCheck) -> None:
        if check.records:
            self.plan.state.verify_recorder = None

    def _decide(self, check: ExpertCheck) -> None:
        """The verdict of a pending check: reads its estimates (the one host sync of the check: one
        stacked copy), demotes the plan when the fit ratio (recall / best recall at the same density,
        over the checked layers and heads; engine/verify.py) is below the threshold. Never raises."""
        plan, cfg = self.plan, self.config
        state = plan.state
        if check.verdict is not None:
            return
        try:
            layers = sorted(check.estimates)
            terms = (torch.stack([check.estimates[l].float().reshape(2, -1).mean(-1) for l in layers]).cpu().tolist()
                     if layers else [])
            check.values = {layer: (float(r), float(b)) for layer, (r, b) in zip(layers, terms)}
            check.estimates = {}
            vals = [v for pair in check.values.values() for v in pair]
            if not vals or not all(math.isfinite(v) for v in vals):  # none, or NaN / inf
                check.verdict, check.reason = "no verdict", "no estimate" if not vals else "non-finite estimate"
                plan.note(f"hit verification gave no verdict for expert {self.expert} ({check.reason})")
                self._publish(check)
                self._drop_record_ahead(check)
                return
            ratio = check.ratio
            check.verdict = "pass" if ratio >= cfg.verify_threshold else "fail"
            self._publish(check)
            if check.verdict == "pass":
                self._drop_record_ahead(check)
                return
            recorder = state.verify_recorder if check.records else None
            if recorder is not None and state.verify_covered != plan.stats.sparse_calls:
                recorder = None  # some sparse call was not recorded ahead: nothing can be written
            self._drop_record_ahead(check)
            if recorder is not None:
                plan.stats.recorded_calls += state.verify_covered  # the calls recorded ahead
            summary = check.summary()
            plan.demote(f"hit verification failed for expert {self.expert}: the reused maps keep an estimated "
                        f"{summary['recall']:.3f} of the attention mass where maps as sparse could keep "
                        f"{summary['best']:.3f} (fit ratio {ratio:.3f} < verify_threshold {cfg.verify_threshold:g}) "
                        f"on layers {sorted(check.values)} at step {check.step}", recorder=recorder)
            if plan.recorder is not None and plan.recorder.incomplete_reason is not None:
                plan.note("hit verification failed after other steps ran sparse: the rest of the request runs "
                          "dense; nothing will be written to the cache")
        except Exception as exc:  # noqa: BLE001
            check.verdict, check.reason = "no verdict", f"{type(exc).__name__}: {exc}"
            plan.note(f"hit verification gave no verdict for expert {self.expert} ({check.reason})")
            self._publish(check)
            self._drop_record_ahead(check)

    def _decide_pending(self) -> None:
        if self.expert is None:
            return
        check = self.plan.state.verification.get(self.expert)
        if check is not None and check.verdict is None:
            self._decide(check)

    def _cond_subset(self, q, k, cond_rows, keep_all: bool = False):
        """``(q, k)`` restricted to the positive-conditioning rows (chosen on the host: no device sync).
        No positive row: ``(None, None)``, or all rows with ``keep_all``."""
        if cond_rows is None:
            return q, k
        rows = torch.as_tensor(cond_rows, dtype=torch.bool, device="cpu").reshape(-1)
        if rows.numel() != q.shape[0]:
            raise _Fallback(f"cond_rows has {rows.numel()} entries for a batch of {q.shape[0]}")
        keep = rows.nonzero().flatten().tolist()
        if not keep:
            return (q, k) if keep_all else (None, None)
        if len(keep) < q.shape[0]:
            return q[keep], k[keep]
        return q, k

    def _record_into(self, recorder, q, k, layer, sigma, grid, cond_rows) -> None:
        """Record the cond rows' block mass of one call into ``recorder`` (raises on error).

        Verification anchors: at the first step of each expert, on the ``verify_layers`` and the
        ``verify_heads`` heads (exactly where a later hit of this entry checks how well it fits), the
        mass is exact (every query row) instead of ``sample_rows`` per block, so a genuine hit's fit
        ratio is not held down by the recording's row-sampling noise (docs/BENCHMARKS.md,
        "Self-verifying hits"). Cost: exact block mass of those heads on those few calls."""
        cfg = self.config
        qs, ks = self._cond_subset(q, k, cond_rows)
        if qs is None:
            return  # negative conditioning only: the positive rows carry the mask
        order = self.token_order(grid)
        with torch.no_grad():
            mass = kernels.block_mass(qs, ks, block_size=cfg.block_size, sample_rows=cfg.sample_rows,
                                      token_perm=order)
            if int(layer) in cfg.verify_layers and recorder.is_first_step(self.expert, sigma):
                if cfg.sample_rows is not None:  # (sample_rows None: every call is exact already)
                    heads = torch.tensor(verify_head_index(qs.shape[1], cfg.verify_heads), device=qs.device)
                    exact = kernels.block_mass(qs.index_select(1, heads), ks.index_select(1, heads),
                                               block_size=cfg.block_size, sample_rows=None, token_perm=order)
                    mass = mass.index_copy(1, heads, exact.to(mass.dtype))
                self.plan.state.entry_extras[ANCHORS_META_KEY] = {"layers": list(cfg.verify_layers),
                                                                  "heads": int(cfg.verify_heads)}
            first_frame = kernels.first_frame_blocks(grid[1] * grid[2], cfg.block_size)
            recorder.add(self.expert, sigma, int(layer), mass, grid=grid, top_p=cfg.top_p, k_min=cfg.k_min,
                         keep_first_frame_blocks=first_frame, block_size=cfg.block_size,
                         token_order=None if order is None else token_order_name(order))

    def token_order(self, grid):
        """The token order this model's attention runs in for ``grid``: a hit's entry order, a miss's
        ``record_region`` order (None = raster; a hit's order was read when its plan was made)."""
        if self.plan.is_hit:
            return self.plan.entry_order
        if self.record_region is None:
            return None
        return region_order_for(grid, self.record_region, self.config.block_size)

    def _prefetch(self, device) -> None:
        """Copy this expert's bit-packed entry maps to ``device`` at once (pinned, non-blocking), at the
        first sparse call of a run: later calls never copy from the host (a pageable host -> device copy
        waits for the GPU). Retrieval has already pinned them (``retrieval._pin_packed``), so this call
        only enqueues the copy. Maps that need a host-side transform (resampling, stored mass) and plain
        tensors are left to :meth:`Plan.stored_map`."""
        self._device_bits = {}
        plan = self.plan
        if plan.resample_to is not None or device.type != "cuda":
            return
        for key, stored in plan.masks.items():
            if key[0] != self.expert or key[3] != 0 or isinstance(stored, torch.Tensor):
                continue
            bits = getattr(stored, "bits", None)
            shape = getattr(stored, "shape", None)
            if not isinstance(bits, torch.Tensor) or bits.dtype != torch.uint8 or shape is None:
                continue
            try:
                host = bits if bits.is_pinned() else bits.pin_memory()
            except RuntimeError:  # no pinned memory here: a plain copy, still only once per run
                host = bits
            self._device_bits[(int(key[1]), int(key[2]))] = (host.to(device, non_blocking=True), tuple(shape))

    def _stored_on_device(self, step: int, layer: int, q: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if self._device_bits is None:
            self._prefetch(q.device)
        found = self._device_bits.get((step, layer))
        if found is not None:
            bits, shape = found
            return unpack_bits_on_device(bits, shape[-1]).reshape(shape)
        try:
            return self.plan.stored_map(self.expert, step, layer, block_size=cfg.block_size, top_p=cfg.top_p,
                                        k_min=cfg.k_min, device=q.device)
        except KeyError:
            raise _Fallback(f"the entry has no mask for expert {self.expert}, step {step}, layer {layer}") from None

    def _device_map(self, step: int, layer: int, q: torch.Tensor, length: int | None = None):
        """Final map for (this expert, step, layer) on q's device: ``(bool [1, H, Qb, Kb], kept)`` with
        ``kept`` the number of kept blocks (a device scalar on CUDA, read only at :meth:`end_run`).
        ``length``: the grid's token count when ``q`` is not at full length (a compact call), else q's.

        stored map (resampled) | k_min floor | visit-refresh extra pairs. No host sync: the entry's
        maps reach the device once per run (:meth:`_prefetch`), the floor and the refresh are device
        ops. Built once per (step, layer) and run: the current step's maps stay on the device
        bit-packed (a 720p 14B step's 40 maps take ~70 MB) for a second call of the same step (cond
        and uncond run separately), so the refresh records each map once.
        """
        if self._maps_step != step:  # keep only the current step's maps on the device
            self._maps.clear()
            self._maps_step = step
        key = (step, layer)
        if key in self._maps:
            packed, kept, num_kv = self._maps[key]
            return unpack_bits_on_device(packed, num_kv), kept
        cfg = self.config
        stored = self._stored_on_device(step, layer, q)
        if stored.dim() == 4 and stored.shape[0] == 1:
            stored = stored[0]
        heads, length = q.shape[1], q.shape[2] if length is None else int(length)
        qb = -(-length // cfg.block_size)
        if stored.dim() != 3 or tuple(stored.shape[-2:]) != (qb, qb) or stored.shape[0] not in (1, heads):
            raise _Fallback(f"entry mask {tuple(stored.shape)} does not fit {heads} heads x {qb} blocks")
        block_map = floor_k_min(stored.to(q.device), cfg.k_min)
        if block_map.shape[0] == 1 and heads > 1:
            block_map = block_map.expand(heads, qb, qb).clone()
        if cfg.refresh_steps > 0:
            refresh = self.plan.refresh_state(cfg.refresh_steps)
            block_map = block_map | refresh.extra_pairs(layer, block_map, step)
            refresh.record(layer, block_map, step)
        block_map = block_map[None]
        kept = block_map.sum() if block_map.device.type == "cuda" else int(block_map.sum())
        self._maps[key] = (pack_bits_on_device(block_map), kept, block_map.shape[-1])
        return block_map, kept

    def used_map(self, step: int, layer: int) -> torch.Tensor | None:
        """The bool map ``[1, H, Qb, Kb]`` this run computes for (step, layer) (stored map + floor +
        refresh), or None when the current step has not reached that layer (diagnostics, tests)."""
        entry = self._maps.get((step, layer))
        return None if entry is None else unpack_bits_on_device(entry[0], entry[2])

    def _dense_and_record(self, q, k, v, layer, sigma, grid, dense_fn, cond_rows):
        out = dense_fn(q, k, v)
        self.record_dense_call(q, k, layer=layer, sigma=sigma, grid=grid, cond_rows=cond_rows)
        return out

    def count_fallback(self, calls: int = 1) -> None:
        """Count ``calls`` self-attention calls the host answered with dense attention for a reason of its own."""
        self.plan.stats.fallback_calls += int(calls)

    def record_dense_call(self, q: torch.Tensor, k: torch.Tensor, *, layer: int, sigma, grid, cond_rows=None) -> None:
        """Count one dense self-attention call (computed by the host, e.g. inside a compiled graph) and,
        on a miss that records, record its block mass (``q, k``: ``[B, H, L, D]``; arguments as
        :meth:`self_attention`). Never raises: a failed recording marks the request unwritable, with a note."""
        plan = self.plan
        if not self._running:
            self.begin_run()
        plan.stats.dense_calls += 1
        recorder = plan.recorder
        if recorder is None or recorder.incomplete_reason is not None or self.expert is None:
            return
        try:
            grid = self._check(q, k, k, layer, grid)
            if self._cond_subset(q, k, cond_rows)[0] is None:
                return  # negative conditioning only: the positive rows carry the mask
            self._record_into(recorder, q, k, layer, self._sigma(sigma), grid, cond_rows)
            plan.stats.recorded_calls += 1
        except Exception as exc:  # noqa: BLE001 - the dense output stands; no partial entry is written
            why = str(exc) if isinstance(exc, _Fallback) else f"{type(exc).__name__}: {exc}"
            recorder.mark_incomplete(why)
            plan.note(f"recording stopped ({why}); this request will not be written to the cache")
