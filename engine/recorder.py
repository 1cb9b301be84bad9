"""The recorder: on a miss, block attention mass of the dense run becomes the entry's block maps."""

from __future__ import annotations

import threading

import torch

from .. import kernels
from ..kernels.codec import unpack_bits
from .compat import grid_carry, order_of_kind
from .routing import SigmaSchedule

class MassRecorder:
    """Collects, per ``(expert, step sigma, layer)``, the block map selected from the block mass.

    ``add(expert, sigma, layer, mass, ...)`` takes the float32 block mass ``[B, H, Qb, Kb]`` of the
    cond rows of one self-attention call, averages it over the batch, selects blocks with
    ``select_blocks_packed(top_p, k_min, keep_diagonal=True, keep_first_frame_blocks, keep_last_frame_blocks)``
    (bit-packed on the mass's device: on a GPU one Triton kernel, no host copy; the keep-sets are the key blocks
    of the frames holding an input image) and ORs the map into what that key
    already holds (samplers that evaluate several sigmas in one step, or cond chunks
    run separately, add to one key). Maps are kept bit-packed on the mass's device and copied to the host only
    when the entry is written (:meth:`block_maps`; a 14B 480p request: ~52 MB).
    With ``keep_mass=True`` the averaged mass is kept too (float32, for benchmarks and tests).

    ``token_order``: the name of the token order the calls were recorded in (None = raster); one per
    recorder (a call in another order raises ``ValueError``).

    ``grid``: the token grid of the first call; the entry's maps are for it. A call of another grid (context
    windows of two lengths in one run: later ComfyUI's causal anchor frame, a shorter last window) has its
    mass carried to that grid by the rule that serves an entry's maps to another grid
    (:func:`~chorus.engine.compat.grid_carry`: the same aspect, ``kernels.resample_block_map``; in a token order
    from that order at the call's grid to the order of its kind at the recorder's) and recorded there; of another
    aspect it is not recorded (:meth:`add` returns False).

    A recorder that missed calls (an error, or a plan demoted after sparse steps ran) is marked
    ``incomplete`` with a reason; :meth:`block_maps` then raises ``ValueError`` so no partial entry is
    ever written.
    """

    def __init__(self, *, keep_mass: bool = False):
        self.keep_mass = keep_mass
        self.schedule = SigmaSchedule()
        self._packed: dict[tuple[int, float, int], torch.Tensor] = {}
        self._shape: dict[tuple[int, float, int], tuple[int, int, int]] = {}
        self._mass: dict[tuple[int, float, int], tuple[torch.Tensor, int]] = {}
        self.grid: tuple[int, int, int] | None = None
        self.num_heads: int | None = None
        self.block_size: int | None = None
        self.token_order: str | None = None
        self.incomplete_reason: str | None = None
        self._bad = None  # device bool: some recorded mass was NaN, inf or negative
        self._first_sigma: dict[int, float] = {}  # expert -> the first step it recorded
        self._lock = threading.Lock()

    def mark_incomplete(self, reason: str) -> None:
        if self.incomplete_reason is None:
            self.incomplete_reason = reason

    @property
    def complete(self) -> bool:
        return self.incomplete_reason is None and bool(self._packed)

    def __len__(self) -> int:
        return len(self._packed)

    def is_first_step(self, expert: int, sigma: float) -> bool:
        """True when ``sigma`` is the first step this recorder sees for ``expert`` (the first sigma it
        is asked about fixes it): the step at which a later hit of the entry verifies that expert."""
        with self._lock:
            canonical = self.schedule.canonical(sigma)
            return self._first_sigma.setdefault(int(expert), canonical) == canonical

    def add(self, expert: int, sigma: float, layer: int, mass: torch.Tensor, *, grid, top_p: float,
            k_min: int, keep_first_frame_blocks: int = 0, keep_last_frame: bool = False, block_size: int = 128,
            token_order: str | None = None) -> bool:
        """Record one call's mass ``[B, H, Qb, Kb]`` of token grid ``grid`` (its map selected and ORed into
        the key's); False when a call of another grid than the recorder's cannot be carried to it (class
        docstring). ``keep_first_frame_blocks``: leading key blocks every row keeps; ``keep_last_frame``: every
        row also keeps the key blocks of the last frame (the end image), which the caller has checked is the
        suffix of the recording's token order. Raises ``ValueError`` for another head count or token order than
        earlier calls'."""
        if mass.dim() != 4:
            raise ValueError(f"mass must be [B, H, Qb, Kb], got shape {tuple(mass.shape)}")
        grid = tuple(int(g) for g in grid)
        with self._lock:
            if self.grid is None:
                self.grid, self.num_heads, self.block_size = grid, int(mass.shape[1]), int(block_size)
                self.token_order = token_order
            elif int(mass.shape[1]) != self.num_heads:
                raise ValueError(f"recorded heads changed within a request: {self.num_heads} -> {mass.shape[1]}")
            elif token_order != self.token_order:
                raise ValueError(f"recorded token order changed within a request: {self.token_order} -> {token_order} "
                                 "(the experts' models are patched with different feature-reuse settings?)")
            target = self.grid
        mean = mass.float().mean(dim=0, keepdim=True)
        verdict, _ = grid_carry(grid, target, token_order)
        if verdict == "incompatible":
            return False
        if verdict == "resample":
            dst_order = order_of_kind(token_order, target, block_size)
            mean = kernels.resample_block_map(mean, grid, target, block_size=block_size,
                                              src_order=order_of_kind(token_order, grid, block_size),
                                              dst_order=dst_order)
            # the caller checked the last frame at the call's grid: in a token order it need not be the suffix
            # at the recorder's (a region order of an odd frame count has it there, of an even one not)
            keep_last_frame = keep_last_frame and (dst_order is None or dst_order.last_frame_is_suffix)
        # NaN / inf / negative mass is flagged on the device (no host sync per call) and checked when
        # the maps are written: such a recording is never written
        bad = ~(torch.isfinite(mean) & (mean >= 0)).all()
        last_blocks = 0
        if keep_last_frame:  # on the recorder's grid (a resampled call's mass is on it now)
            last_blocks = kernels.last_frame_blocks(target[0] * target[1] * target[2], target[1] * target[2],
                                                    block_size)
        packed = kernels.select_blocks_packed(mean, top_p=top_p, k_min=min(k_min, mean.shape[-1]), keep_diagonal=True,
                                              keep_first_frame_blocks=keep_first_frame_blocks,
                                              keep_last_frame_blocks=last_blocks, check_values=False)[0]
        with self._lock:
            self._bad = bad if self._bad is None else (self._bad | bad)
            key = (int(expert), self.schedule.canonical(sigma), int(layer))
            if key in self._packed:
                self._packed[key] |= packed
            else:
                self._packed[key] = packed
                self._shape[key] = tuple(mean.shape[1:])
            if self.keep_mass:
                prev = self._mass.get(key)
                m = mean[0].cpu()
                self._mass[key] = (m, 1) if prev is None else (prev[0] + m, prev[1] + 1)
        return True

    def step_sigmas(self) -> list[float]:
        return self.schedule.steps()

    def block_maps(self) -> dict[tuple[int, int, int, int], torch.Tensor]:
        """``{(expert, step, layer, 0): bool [H, Qb, Kb]}`` with global step indices (descending sigma).

        Raises ``ValueError`` when nothing was recorded or the recording is incomplete.
        """
        if self._bad is not None and bool(self._bad):
            self.mark_incomplete("the recorded attention mass was not finite (NaN/inf in the model's activations)")
        if self.incomplete_reason is not None:
            raise ValueError(f"recording incomplete: {self.incomplete_reason}")
        if not self._packed:
            raise ValueError("nothing was recorded (did the patched model sample?)")
        steps = self.step_sigmas()
        out = {}
        for (expert, sigma, layer), packed in self._packed.items():
            step = steps.index(sigma)
            out[(expert, step, layer, 0)] = unpack_bits(packed.cpu(), self._shape[(expert, sigma, layer)][-1])
        return out

    def masses(self) -> dict[tuple[int, int, int, int], torch.Tensor]:
        """Averaged float32 mass per key (only with ``keep_mass=True``), same keys as :meth:`block_maps`."""
        steps = self.step_sigmas()
        return {(e, steps.index(s), l, 0): m / n for (e, s, l), (m, n) in self._mass.items()}
