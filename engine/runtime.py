"""The engine's one entry per self-attention call: :func:`attend` / :meth:`ChorusAttention.attend`.

A host translates each self-attention call of a Wan model into an :class:`~chorus.engine.call.AttnCall`
(q/k/v ``[B, H, L, D]``, layer, sigma, grid, cond rows, a feature-reuse layout, the first-frame bias,
its dense attention) and hands it here. The engine owns the order, and every counter and note:

1. bias: guidance's first-frame bias goes into the sparse kernel, or into the dense call;
2. expand: a compact call whose maps are not in its layout's order runs on the full grid;
3. sparse (a hit: the run's map, ``engine/maps.py``, into ``kernels.block_sparse_attention``) or dense
   + recording (a miss: block mass into the plan's recorder);
4. verification (a hit's first step per expert, ``engine/verify.py``; it may demote the plan);
5. compact: an expanded call's output back on the compact sequence.

Nothing raises from there: anything unexpected is noted once (``plan.note``), counted in
``plan.stats.fallback_calls`` and answered with dense attention.
"""

from __future__ import annotations

import math
import time

import torch

from .. import kernels
from ..kernels.pooling import compact_block_map
from .call import AttnCall, Fallback
from .config import SparseConfig
from .maps import RunMaps, floor_k_min
from .plan import Plan, grid_unchecked
from .routing import match_step, run_starts, sigma_schedule, sigma_value, step_sigma
from .compat import order_at, region_order_for, token_order_name
from .model_info import ModelInfo, ends_with_image
from .state import failure_text
from .verify import ANCHORS_META_KEY, Verifier, verify_head_index

__all__ = ["ChorusAttention", "ExpertRun", "attend", "floor_k_min"]


def attend(call: AttnCall, attention: "ChorusAttention | None" = None, note=None) -> torch.Tensor:
    """The engine's entry for one self-attention call ``[B, H, L, D]`` of a patched model:
    ``attention.attend(call)`` for a model with a sparse part; without one (guidance alone), the
    call's dense attention with its image biases (:meth:`AttnCall.dense`: a compact call's pooled keys
    weighted by the tokens they stand for). ``note(message)``: where a model without a sparse part
    reports. Never raises."""
    if attention is not None:
        return attention.attend(call)
    return call.dense(note)


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

    Per sampler run: :meth:`begin_run` (optional ``sample_sigmas`` of the run; the plan's one place
    that may move or demote a hit, :meth:`Plan.serve_run`) makes :attr:`run`, an :class:`ExpertRun`;
    :meth:`end_run` finishes it. A call outside a run begins one.
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
        self.run: ExpertRun | None = None

    def __deepcopy__(self, memo):
        return self

    @property
    def expert(self) -> int | None:
        """The expert index of the current run (None: no run, or an unsupported model)."""
        return None if self.run is None else self.run.expert

    @property
    def sample_sigmas(self) -> list[float] | None:
        return None if self.run is None else self.run.sample_sigmas

    # -- run bracket --------------------------------------------------------------------------
    def begin_run(self, sample_sigmas=None) -> "ExpertRun":
        """Start a sampler run (``sample_sigmas``: its schedule, descending, the last usually 0, or None):
        the plan serves this model and run (:meth:`Plan.serve_run`: a hit's entry must serve the model,
        block size and schedule, else it moves to a candidate that does, or is demoted)."""
        plan = self.plan
        sig = sigma_schedule(sample_sigmas)
        if sample_sigmas is not None and sig is None:
            plan.note(f"ignoring a sampler schedule with non-finite or no values: {sample_sigmas}")
        previous, self.run = self.run, None
        if previous is not None:
            previous.finish()
        plan.stats.runs += 1
        expert = plan.serve_run(self.model_info, run_starts=run_starts(sig), block_size=self.config.block_size)
        self.run = ExpertRun(self, expert, sig)
        return self.run

    def serve_grid(self, grid, image_frames=None) -> None:
        """The token grid ``(T', H', W')`` of a forward of this model (the host calls this before it decides
        anything else of the forward), and ``image_frames``: a callable giving the latent frames the request's
        input holds images on (:func:`~chorus.engine.model_info.image_frames` of the forward's input; for a
        forward in a context window, which holds part of the video, the host reads the whole latent's; it may
        sync, so it is asked at a run's first forward only), or None. The run's first forward has the plan serve
        both (:meth:`Plan.serve_run`; a miss keeps the images for its entry, a hit's entry must have the same):
        a hit whose maps are for another grid -- recorded in context windows and sampled without, or the other
        way round -- is served at this one (resampled, or unresampled where it is the entry's own) or, where it
        cannot be (an entry in a token order), moves to a candidate made for this grid or is demoted before any
        sparse call (a miss that records, so the request can be written); the run then starts again on what the
        plan serves now. Later forwards are not checked again (a call of another grid gets the maps resampled to
        it where it can, else runs dense, noted: :class:`~chorus.engine.maps.RunMaps`). Never raises: a failure
        is a note, the calls then fall back one by one."""
        try:
            run = self.run if self.run is not None else self.begin_run()
            if run.forward_grid is not None:
                return
            run.forward_grid = grid = tuple(int(g) for g in grid)
            plan, served = self.plan, self.plan.retrieval
            frames = image_frames() if image_frames is not None else None
            if not plan.is_hit:
                plan.serve_run(self.model_info, image_frames=frames)
                return
            expert = plan.serve_run(self.model_info, run_starts=run_starts(run.sample_sigmas),
                                    block_size=self.config.block_size, forward_grid=grid, image_frames=frames)
            if plan.retrieval is not served or not plan.is_hit or expert != run.expert:
                run.finish()
                self.run = ExpertRun(self, expert, run.sample_sigmas)
                self.run.forward_grid = grid
        except Exception as exc:  # noqa: BLE001 - never crash sampling
            self.plan.note(grid_unchecked(grid, exc))

    def end_run(self) -> None:
        """End a sampler run: count the blocks computed (one host sync per run), decide a verification
        still pending, drop per-run state (device maps); the plan keeps request state."""
        run, self.run = self.run, None
        if run is not None:
            run.finish()

    def flush_stats(self) -> None:
        """Add the device-side count of computed blocks to ``plan.stats.blocks_computed`` (syncs)."""
        if self.run is not None:
            self.run.flush_stats()

    @property
    def current_step(self) -> int | None:
        """The entry step a hit's run computes now (the last sparse call's), or None."""
        return None if self.run is None else self.run.maps.step

    def used_map(self, step: int, layer: int) -> torch.Tensor | None:
        """The bool map ``[1, H, Qb, Kb]`` this run computes for (step, layer) (stored map + floor +
        refresh), or None when the current step has not reached that layer (diagnostics, tests)."""
        return None if self.run is None else self.run.maps.used_map(step, layer)

    def token_order(self, grid):
        """The token order this model's attention runs in for ``grid``: a hit's entry order (at another grid than
        the entry's, the order of its kind there, :func:`~chorus.engine.compat.order_at`), a miss's
        ``record_region`` order (None = raster; of the kind whose last frame is rim where the request holds an end
        image, so that frame ends the order at every frame count; a hit's order was read when its plan was made). Raises
        ``ValueError`` for a grid an order cannot be rebuilt at (the callers fall back)."""
        if self.plan.is_hit:
            return order_at(self.plan.entry_order, grid)
        if self.record_region is None:
            return None
        return region_order_for(grid, self.record_region, self.config.block_size,
                                last_frame_rim=ends_with_image(self.plan.state.image_frames))

    # -- the calls -----------------------------------------------------------------------------
    def attend(self, call: AttnCall) -> torch.Tensor:
        """Attention output ``[B, H, L, D]`` of one self-attention call, in the module docstring's order.

        A compact call (``call.layout``) whose layout is not in a token order runs expanded to the full
        grid and comes back compacted; one in its order runs on the compact sequence itself (a hit of
        an entry recorded in that order: the map is carried to the compact blocks by
        ``kernels.pooling.compact_block_map`` and each cell's key gets ``log(P)`` on its logits, so it
        weighs as the ``P`` tokens it stands for), else dense on the compact sequence.
        """
        if call.layout is not None and call.layout.order is None:
            return call.compact(self.attend(call.expanded()))
        start = time.perf_counter()
        try:
            run = self.run if self.run is not None else self.begin_run()
            return run.attend(call)
        finally:
            self.plan.stats.attention_seconds += time.perf_counter() - start

    def record(self, call: AttnCall) -> None:
        """A dense self-attention call the host computed itself (e.g. inside a compiled graph): counted,
        and on a miss that records, its block mass recorded. Never raises: a failed recording marks the
        request unwritable, with a note."""
        run = self.run if self.run is not None else self.begin_run()
        run.record(call)

    def skip_calls(self, count: int) -> None:
        """Count ``count`` self-attention calls left to the host's own attention (a forward Chorus stays
        out of, a call the host could not hand over) as fallbacks. Called by the engine's forward context
        (``engine/attend.py``), which notes why; hosts never count."""
        self.plan.stats.fallback_calls += int(count)

    def self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer: int, sigma, grid,
                       dense_fn, cond_rows=None, first_frame_bias: float = 0.0,
                       last_frame_bias: float = 0.0) -> torch.Tensor:
        """:meth:`attend` of the call these arguments describe (:class:`~chorus.engine.call.AttnCall`)."""
        return self.attend(AttnCall(q, k, v, layer=layer, sigma=sigma, grid=grid, cond_rows=cond_rows,
                                    first_frame_bias=first_frame_bias, dense_fn=dense_fn,
                                    last_frame_bias=last_frame_bias))

    def compact_self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout, layer: int,
                               sigma, dense_fn, cond_rows=None, first_frame_bias: float = 0.0,
                               last_frame_bias: float = 0.0) -> torch.Tensor:
        """:meth:`attend` of a feature-reuse block's call on the compact sequence of ``layout`` (built in
        a token order: kept tokens in that order, then the cells), q/k/v ``[B, H, L', D]``."""
        return self.attend(AttnCall(q, k, v, layer=layer, sigma=sigma, grid=layout.grid, cond_rows=cond_rows,
                                    layout=layout, first_frame_bias=first_frame_bias, dense_fn=dense_fn,
                                    last_frame_bias=last_frame_bias))



# device types where a hit whose ``auto`` lands on the reference kernel runs it: the CPU, where nothing faster is
# built (for trying the nodes and for tests); on any other device such a hit runs dense (ExpertRun._backend)
REFERENCE_SERVES_HITS_ON = frozenset({"cpu"})


def _no_fast_kernel(q: torch.Tensor) -> tuple[str, str]:
    """``(why, remedy)`` for a device where only the reference kernel runs for tensors like ``q``: why no sparse
    kernel faster than dense runs there (the first reason of auto's chain), and what would bring one."""
    reasons = [f"{backend.value}: {why}" for backend, why in kernels.auto_chain(q) if why]
    why = (f"no sparse attention kernel faster than dense runs on this {q.device.type} device"
           + (f" ({reasons[0]})" if reasons else ""))
    remedy = ("install a Triton that matches this torch (on Windows, triton-windows) for Chorus's kernels, and "
              "see `chorus check`" if q.device.type == "cuda" else "Chorus's kernels need a CUDA GPU")
    return why, remedy


def _resolved(backend: str, q: torch.Tensor, config: SparseConfig) -> str | None:
    """The kernel ``backend`` runs for tensors like ``q`` with the config's block size and pooled tail (``auto``:
    its choice on this device), or None when it cannot run them here (its calls then run dense, each with a
    message)."""
    try:
        return kernels.resolve_backend(backend, q, block_size=config.block_size,
                                       pooled_tail=config.pooled_tail).value
    except kernels.BackendUnavailableError:
        return None


class ExpertRun:
    """One sampler run of one patched model: the expert it serves (None: an unsupported model, every
    call dense), the run's schedule, the maps it computes with (:class:`~chorus.engine.maps.RunMaps`),
    its verification (:class:`~chorus.engine.verify.Verifier`) and the device count of computed blocks."""

    def __init__(self, attention: ChorusAttention, expert: int | None, sample_sigmas: list[float] | None):
        self.attention = attention
        self.plan, self.config, self.model_info = attention.plan, attention.config, attention.model_info
        self.expert = expert
        self.sample_sigmas = sample_sigmas
        self.forward_grid = None  # the token grid of the run's first forward (ChorusAttention.serve_grid)
        self.entry_steps = list(self.plan.step_sigmas) if self.plan.is_hit else []  # of the entry it serves
        self.maps = RunMaps(self.plan, self.config, expert)
        self.verifier = Verifier(self.plan, self.config, expert, self.model_info.num_layers, self.record_into)
        self._kept = None  # device counter of computed blocks (read when the run ends: no sync per call)
        # the config's backend that runs here and what it resolves to, decided at the run's first call
        # (_decide_backend); _no_fast_kernel: (why, remedy) where none beats dense here
        self._backend_name = self._resolved_name = self._no_fast_kernel = None
        self._backend_decided = self._kernel_noted = False
        self._records_for_nothing_here = None  # (_records_for_nothing)

    def finish(self) -> None:
        if self.expert is not None:
            self.verifier.decide_pending()
        self.flush_stats()

    def flush_stats(self) -> None:
        if self._kept is not None:
            self.plan.stats.blocks_computed += int(self._kept)
            self._kept = None

    def attend(self, call: AttnCall) -> torch.Tensor:
        plan = self.plan
        if self.expert is None or (call.layout is not None and not plan.is_hit):
            plan.stats.dense_calls += 1
            return call.dense(plan.note)
        if call.sigma is None:
            return self._fallback(call, "no sigma in this forward")
        if plan.is_hit:
            if self._backend(call.q) is None:  # no sparse kernel here beats the host's dense attention
                plan.stats.dense_calls += 1
                return call.dense(plan.note)
            return self._sparse(call)
        return self._dense_and_record(call)

    def _dense_and_record(self, call: AttnCall) -> torch.Tensor:
        out = call.dense(self.plan.note)
        self.record(call)
        return out

    def _fallback(self, call: AttnCall, why: str) -> torch.Tensor:
        self.plan.note(f"sparse attention not used for a call ({why}); dense attention instead")
        self.plan.stats.fallback_calls += 1
        self.verifier.fell_back(why)  # a dense call the record-ahead did not record
        return call.dense(self.plan.note)

    def _sparse(self, call: AttnCall) -> torch.Tensor:
        plan, layout = self.plan, call.layout
        check = None
        try:
            grid = call.check(self.model_info.num_layers, self.model_info.num_heads)
            sigma = step_sigma(sigma_value(call.sigma), self.sample_sigmas)
            step = match_step(sigma, self.entry_steps)
            if step is None:
                if match_step(sigma, plan.sampler_sigmas) is not None:  # the entry's schedule, a step it skipped
                    raise Fallback(f"no map for the step at sigma {sigma:.4g} (the entry's request did not run the "
                                   "model there, e.g. EasyCache skipped it)")
                raise Fallback(f"sigma {sigma:.4g} is not a step of the entry's schedule")
            if self.verifier.moved_on(step) and not plan.is_hit:  # demoted by a late verdict: this call too
                return self._dense_and_record(call)
            block_map, kept = self.maps.map_for(step, int(call.layer), call.q,
                                                None if layout is None else layout.length, grid)
            order = self.attention.token_order(grid)
            suffix_len, suffix_bias = 0, 0.0
            if call.last_frame_bias:
                suffix_len, suffix_bias = self._end_image_bias(call, order)
            if layout is None:
                check = self.verifier.observe(call, step, sigma, grid, block_map, order)
            else:  # (no verification estimate from a compact call: the check reads full-grid calls)
                if order is None or order.name != layout.order.name or order.grid != layout.order.grid:
                    raise Fallback(f"the compact sequence is in token order {layout.order.name}, this run's maps in "
                                   f"{'raster' if order is None else order.name}")
                block_map = compact_block_map(block_map, layout.block_sources)
                kept = block_map.sum() if block_map.device.type == "cuda" else int(block_map.sum())
                suffix_len, suffix_bias = layout.num_cells, math.log(layout.cell_size)
                order = None  # q/k/v are in the order already
            out = self._kernel(call, block_map, order, suffix_len, suffix_bias)
        except Exception as exc:  # noqa: BLE001 - never crash sampling: dense for this call
            why = str(exc) if isinstance(exc, Fallback) else failure_text(exc)
            return self._fallback(call, why)
        self._count_sparse(call.q.shape[0], block_map, kept)
        self.verifier.after_call(check, call.layer)
        return out

    def _end_image_bias(self, call: AttnCall, order) -> tuple[int, float]:
        """``(suffix_len, suffix_bias)`` of guidance's end-image bias on a sparse call: the last frame's keys are
        the kernel's key suffix in raster order and in a token order that ends with that frame
        (``last_frame_is_suffix``: a region order of an odd frame count). A compact call's suffix is its cells:
        its end-image bias rides on the key prefix where its layout leads with the last frame
        (``call.end_image_in_prefix``; ``(0, 0.0)`` here). Elsewhere ``(0, 0.0)`` with a note: that call
        biases the first frame alone."""
        if call.layout is None and (order is None or order.last_frame_is_suffix):
            return call.suffix_len, float(call.last_frame_bias) if call.suffix_len else 0.0
        if call.end_image_in_prefix:
            return 0, 0.0
        where = ("feature reuse's compact calls whose layout does not lead with the last frame"
                 if call.layout is not None else f"calls in the entry's token order {token_order_name(order)}")
        self.plan.note(f"guidance's end-image bias is not applied on {where} (its last frame is not the keys' "
                       "suffix or prefix there); the start-image bias is")
        return 0, 0.0

    def _kernel(self, call: AttnCall, block_map, order, suffix_len: int, suffix_bias: float) -> torch.Tensor:
        """The sparse kernel call of a hit (the one call site of ``kernels.block_sparse_attention``).
        ``rows_checked``: the k_min >= 1 floor keeps a block in every row (of a compact map too: a
        compact row has at least one source row), so the kernel API skips the one validation that
        would sync the host with the GPU."""
        cfg, (prefix_len, prefix_bias) = self.config, call.key_prefix
        return kernels.block_sparse_attention(call.q, call.k, call.v, block_map, block_size=cfg.block_size,
                                              backend=self._backend(call.q), prefix_len=prefix_len,
                                              prefix_bias=prefix_bias,
                                              rows_checked=True, token_perm=order, suffix_len=suffix_len,
                                              suffix_bias=suffix_bias, pooled_tail=cfg.pooled_tail)

    def _decide_backend(self, q: torch.Tensor) -> None:
        """Once per run, from the first call: the first of the config's
        :attr:`~chorus.engine.config.SparseConfig.attention_backends` that can run here with the config's block
        size and pooled tail (with auto's accurate choice, ``triton_int8_ws``, else ``triton_int8``, else ``auto``;
        any other config, its backend) and what it resolves to.

        Where ``auto`` lands on the reference kernel on a device outside :data:`REFERENCE_SERVES_HITS_ON` (a GPU
        where no Triton kernel runs, e.g. Windows' portable ComfyUI without ``triton-windows``; Apple's ``mps``),
        no backend: the reference is plain torch, a loop over query blocks that scores every key in fp32 whatever
        the map keeps (dense work at fp32 rates, plus the masking), slower than the host's dense attention, and
        its block mass (what a miss records) a loop of fp32 products over every key too. So there a hit's calls
        run dense and a miss records nothing (:meth:`_backend`, :meth:`record`), each with one note: on such a
        device Chorus costs a request only its bookkeeping. An explicitly chosen ``reference`` still runs."""
        if self._backend_decided:
            return
        self._backend_decided = True
        wanted = self.config.attention_backends
        self._backend_name, self._resolved_name = wanted[-1], None
        for name in wanted[:-1]:
            self._resolved_name = _resolved(name, q, self.config)
            if self._resolved_name is not None:
                self._backend_name = name
                break
        if self._resolved_name is None:
            self._resolved_name = _resolved(self._backend_name, q, self.config)
        if (self._backend_name == kernels.Backend.AUTO.value
                and self._resolved_name == kernels.Backend.REFERENCE.value
                and q.device.type not in REFERENCE_SERVES_HITS_ON):
            self._backend_name, self._no_fast_kernel = None, _no_fast_kernel(q)

    def _records_for_nothing(self, q: torch.Tensor) -> bool:
        """True where a miss's recording would serve no hit here: its block mass would run the reference kernel
        on a device outside :data:`REFERENCE_SERVES_HITS_ON` and a hit would run dense
        (:meth:`_decide_backend`). The block-mass choice is asked first: it is what the recording resolves
        anyway, so a miss on a GPU whose Triton kernels run builds no attention kernel for this question. Decided
        at the run's first recorded call."""
        if self._records_for_nothing_here is None:
            self._records_for_nothing_here = False
            if (q.device.type not in REFERENCE_SERVES_HITS_ON
                    and kernels.resolve_backend("auto", q, "block_mass") == kernels.Backend.REFERENCE):
                self._decide_backend(q)
                self._records_for_nothing_here = self._no_fast_kernel is not None
        return self._records_for_nothing_here

    def _backend(self, q: torch.Tensor) -> str | None:
        """The backend a hit's sparse calls ask the kernels for (:meth:`_decide_backend`), or None where they run
        dense. The first time in a run it names the kernel once in the request's stats
        (:attr:`~chorus.engine.state.PlanStats.kernels`, the run's UI text: ``dense`` for None, with one note)."""
        self._decide_backend(q)
        if not self._kernel_noted:
            self._kernel_noted = True
            if self._backend_name is None:
                why, remedy = self._no_fast_kernel
                self.plan.stats.note_kernel("dense", "dense")
                self.plan.note(f"{why}: the hit's self-attention runs dense (no speed-up); {remedy}")
            else:
                self.plan.stats.note_kernel(self._backend_name, self._resolved_name)
        return self._backend_name

    def _count_sparse(self, batch: int, block_map, kept) -> None:
        stats = self.plan.stats
        stats.sparse_calls += 1
        stats.tail_calls += int(self.config.pooled_tail)
        stats.blocks_total += batch * block_map.shape[1] * block_map.shape[2] * block_map.shape[3]
        if isinstance(kept, int):
            stats.blocks_computed += batch * kept
        else:
            self._kept = kept * batch if self._kept is None else self._kept + kept * batch

    # -- recording (a miss; the first expert of a verified hit records ahead) -------------------
    def record(self, call: AttnCall) -> None:
        """Count one dense call and, on a miss that records, record its block mass. Never raises."""
        plan = self.plan
        plan.stats.dense_calls += 1
        recorder = plan.recorder
        if recorder is None or recorder.incomplete_reason is not None or self.expert is None:
            return
        try:
            if self._records_for_nothing(call.q):  # a hit would run dense here: the recording would only cost time
                why, remedy = self._no_fast_kernel
                recorder.mark_incomplete(f"{why}, so a hit would run dense here")
                plan.note(f"{why}: this miss records nothing (a hit would run dense here, and recording would only "
                          f"slow this request); {remedy}")
                return
            if call.layout is not None:
                raise Fallback("a call on a compact sequence cannot be recorded")
            grid = call.check(self.model_info.num_layers, self.model_info.num_heads)
            if self.record_into(recorder, call, step_sigma(sigma_value(call.sigma), self.sample_sigmas), grid):
                plan.stats.recorded_calls += 1
        except Exception as exc:  # noqa: BLE001 - the dense output stands; no partial entry is written
            why = str(exc) if isinstance(exc, Fallback) else failure_text(exc)
            recorder.mark_incomplete(why)
            plan.note(f"recording stopped ({why}); this request will not be written to the cache")

    def _keeps_end_image(self, order) -> bool:
        """Whether a recorded map keeps the last frame's key blocks in every row, as it keeps the first frame's:
        the request's input holds an end image there (``state.image_frames``: a first-last-frame request) and
        the recording's token order has that frame as its suffix (raster; a region order of an odd frame count,
        ``kernels.tile_order``'s ``last_frame_is_suffix``)."""
        return ends_with_image(self.plan.state.image_frames) and (order is None or order.last_frame_is_suffix)

    def record_into(self, recorder, call: AttnCall, sigma: float, grid) -> bool:
        """Record the cond rows' block mass of one call into ``recorder`` (raises on error); False when the
        call has no positive-conditioning row (nothing to record: the positive rows carry the mask) or a token
        grid the recorder cannot carry to its own (:class:`~chorus.engine.recorder.MassRecorder`; noted).

        Verification anchors: at the first step of each expert, on the ``verify_layers`` and the
        ``verify_heads`` heads (exactly where a later hit of this entry checks how well it fits), the
        mass is exact (every query row) instead of ``sample_rows`` per block, so a genuine hit's fit
        ratio is not held down by the recording's row-sampling noise (docs/BENCHMARK_LOG.md,
        "Self-verifying hits"). Cost: exact block mass of those heads on those few calls."""
        cfg = self.config
        qs, ks = call.positive_rows()
        if qs is None:
            return False
        layer = int(call.layer)
        order = self.attention.token_order(grid)
        with torch.no_grad():
            mass = kernels.block_mass(qs, ks, block_size=cfg.block_size, sample_rows=cfg.sample_rows,
                                      token_perm=order)
            if layer in cfg.verify_layers and recorder.is_first_step(self.expert, sigma):
                if cfg.sample_rows is not None:  # (sample_rows None: every call is exact already)
                    heads = torch.tensor(verify_head_index(qs.shape[1], cfg.verify_heads), device=qs.device)
                    exact = kernels.block_mass(qs.index_select(1, heads), ks.index_select(1, heads),
                                               block_size=cfg.block_size, sample_rows=None, token_perm=order)
                    mass = mass.index_copy(1, heads, exact.to(mass.dtype))
                with self.plan.state.lock:
                    self.plan.state.entry_extras[ANCHORS_META_KEY] = {"layers": list(cfg.verify_layers),
                                                                      "heads": int(cfg.verify_heads)}
            first_frame = kernels.first_frame_blocks(grid[1] * grid[2], cfg.block_size)
            recorded = recorder.add(self.expert, sigma, layer, mass, grid=grid, top_p=cfg.top_p, k_min=cfg.k_min,
                                    keep_first_frame_blocks=first_frame, keep_last_frame=self._keeps_end_image(order),
                                    block_size=cfg.block_size,
                                    token_order=None if order is None else token_order_name(order))
        if not recorded:
            self.plan.note(f"calls of token grid {tuple(grid)} are not recorded: the entry records grid "
                           f"{recorder.grid} and cannot carry maps of another aspect to it")
        return recorded
