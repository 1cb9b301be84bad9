"""The block maps a hit computes with: the entry's stored map, made the run's map on the device.

Per (expert, step, layer) of a hit: the stored map (unpacked; an entry storing float mass selects
blocks with ``top_p`` / ``k_min``; resampled to the request's token grid when the entry's grid
differs with the same aspect, and to a call's own grid when a call has another one: context windows
of two lengths in one run) | the ``k_min`` floor (:func:`floor_k_min`) | the visit refresh's extra
pairs (``kernels.VisitRefresh``, request-wide). :class:`RunMaps` builds each map once per sampler run
(and call grid) without a host sync and keeps only the current step's maps on the device.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels.codec import pack_bits_on_device, unpack_bits_on_device
from ..kernels.masks import floor_k_min, floor_packed_map
from .call import Fallback
from .compat import grid_compatibility, order_at

__all__ = ["floor_k_min", "unpacked_map", "stored_map", "RunMaps"]  # floor_k_min: kernels.masks's, re-exported


def unpacked_map(stored, device=None):
    """An entry's stored map as a tensor: a bit-packed map (``cache_store.PackedMap``, what retrieval loads:
    anything with ``unpack`` that is not a tensor) unpacked on ``device`` (default: where its bits are);
    anything else (a tensor) comes back as it is."""
    if hasattr(stored, "unpack") and not isinstance(stored, torch.Tensor):
        return stored.unpack(device) if device is not None else stored.unpack()
    return stored

def stored_map(plan, expert: int, step: int, layer: int, *, block_size: int, top_p: float, k_min: int,
               device=None, grid=None) -> torch.Tensor:
    """Bool ``[H, Qb, Kb]`` of a hit's entry for a key (on ``device``, default CPU), resampled to ``grid``
    (default: the plan's ``resample_to``; None there too: the entry's own grid); an entry in a token order is
    resampled to the order of its kind at ``grid`` (:func:`~chorus.engine.compat.order_at`).

    Entries store bool maps (possibly bit-packed, ``cache_store.PackedMap``: unpacked on ``device``);
    an entry that stores float block *mass* instead is turned into a map here with
    ``select_blocks(top_p, k_min)`` (density chosen at retrieval time). A map is transformed where it is unpacked
    (on a GPU ``device``: there, where a 720p map's resampling is two small products, while two CPU cores take
    ~0.2 s and the map would go to the host and back; the run keeps each step's maps on the device,
    :class:`RunMaps`); transformed on the CPU it is cached there for the request (``plan.state.resampled``).
    Raises ``KeyError`` when the entry has no map for the key, ``ValueError`` on a bad map.
    """
    key = (expert, step, layer, 0)
    state = plan.state
    target = plan.resample_to if grid is None else tuple(int(g) for g in grid)
    with state.lock:
        stored = plan.masks[key]
        cache_key = (key, top_p, k_min, block_size, target)
        if cache_key in state.resampled:
            cached = state.resampled[cache_key]
            return cached.to(device) if device is not None else cached
        stored = unpacked_map(stored, device)
        if not isinstance(stored, torch.Tensor):
            raise ValueError(f"entry map {key} is not a tensor")
        block_map = stored
        if block_map.dim() == 4 and block_map.shape[0] == 1:
            block_map = block_map[0]
        if block_map.dim() == 2:
            block_map = block_map[None]
        if block_map.dim() != 3:
            raise ValueError(f"entry map {key} must be [H, Qb, Kb], got {tuple(stored.shape)}")
        transformed = False
        if block_map.dtype != torch.bool:
            if not block_map.is_floating_point():
                raise ValueError(f"entry map {key} has dtype {block_map.dtype}, expected bool or float mass")
            block_map = kernels.select_blocks(block_map.float()[None], top_p=top_p,
                                              k_min=min(k_min, block_map.shape[-1]))[0]
            transformed = True
        src = tuple(int(g) for g in plan.entry_meta["signature"]["token_grid"])
        if target is not None and target != src:
            order = plan.entry_order
            block_map = kernels.resample_block_map(block_map[None], src, target, block_size=block_size,
                                                   src_order=order, dst_order=order_at(order, target))[0]
            transformed = True
        if transformed and block_map.device.type == "cpu":
            state.resampled[cache_key] = block_map
        return block_map.to(device) if device is not None else block_map


def _fitting_heads(shape: tuple, heads: int, qb: int) -> int:
    """The heads of an entry map of ``shape`` (``[Hs, Qb, Qb]`` or ``[1, Hs, Qb, Qb]``) that fits a call of
    ``heads`` heads and ``qb`` query blocks: 1 (shared) or ``heads``. :class:`Fallback` otherwise."""
    fit = shape[1:] if len(shape) == 4 and shape[0] == 1 else shape
    if len(fit) != 3 or tuple(fit[-2:]) != (qb, qb) or fit[0] not in (1, heads):
        raise Fallback(f"entry mask {tuple(shape)} does not fit {heads} heads x {qb} blocks")
    return int(fit[0])


class RunMaps:
    """The maps one expert's sampler run computes with (``plan``: a hit; ``config``: the model's
    ``SparseConfig``). One per run: device copies live as long as the run."""

    def __init__(self, plan, config, expert: int):
        self.plan, self.config, self.expert = plan, config, expert
        self._maps: dict = {}       # (step, layer) -> (bit-packed map, kept, Kb) of the current step
        self.step: int | None = None  # the entry step whose maps are on the device (the run's current one)
        self._device_bits: dict | None = None  # (step, layer) -> the entry's bit-packed map on the device

    def _prefetch(self, device) -> None:
        """Copy this expert's bit-packed entry maps to ``device`` at once (pinned, non-blocking), at the
        first sparse call of a run: later calls never copy from the host (a pageable host -> device copy
        waits for the GPU). Retrieval has already pinned them (``retrieval._pin_packed``), so this call
        only enqueues the copy (on the CPU the maps are used where they are). Maps that need a host-side
        transform (resampling, stored mass) and plain tensors are left to :func:`stored_map`."""
        self._device_bits = {}
        plan = self.plan
        if plan.resample_to is not None:
            return
        for key, stored in plan.masks.items():
            if key[0] != self.expert or key[3] != 0 or isinstance(stored, torch.Tensor):
                continue
            bits = getattr(stored, "bits", None)
            shape = getattr(stored, "shape", None)
            if not isinstance(bits, torch.Tensor) or bits.dtype != torch.uint8 or shape is None:
                continue
            if device.type == "cuda":
                try:
                    bits = bits if bits.is_pinned() else bits.pin_memory()
                except RuntimeError:  # no pinned memory here: a plain copy, still only once per run
                    pass
            self._device_bits[(int(key[1]), int(key[2]))] = (bits.to(device, non_blocking=True), tuple(shape))

    def _entry_bits(self, step: int, layer: int, q: torch.Tensor):
        """The entry's bit-packed map for (step, layer) on q's device and its stored shape, or None where
        it has none there (:meth:`_prefetch`)."""
        if self._device_bits is None:
            self._prefetch(q.device)
        return self._device_bits.get((step, layer))

    def _stored_on_device(self, step: int, layer: int, q: torch.Tensor, grid=None) -> torch.Tensor:
        cfg = self.config
        try:
            return stored_map(self.plan, self.expert, step, layer, block_size=cfg.block_size, top_p=cfg.top_p,
                              k_min=cfg.k_min, device=q.device, grid=grid)
        except KeyError:
            raise Fallback(f"the entry has no mask for expert {self.expert}, step {step}, layer {layer}") from None

    def _floored(self, step: int, layer: int, q: torch.Tensor, heads: int, qb: int, grid=None):
        """The entry's map for (step, layer) with the ``k_min`` floor, for ``heads`` heads of ``qb`` blocks
        (``grid``: a call grid to resample the map to, else None):
        ``(bool [heads, Qb, Qb], packed or None, kept per row int32 [heads, Qb] or None)``. From the packed
        bits on the device in one step (:func:`kernels.masks.floor_packed_map`: the packed copy and the row
        counts come with it); else from :func:`stored_map`. :class:`Fallback` for a map that does not fit."""
        k_min = self.config.k_min
        found = self._entry_bits(step, layer, q) if grid is None else None
        if found is not None:
            bits, shape = found
            map_heads = _fitting_heads(shape, heads, qb)
            return floor_packed_map(bits.reshape(map_heads, qb, -1), qb, heads, k_min)
        stored = self._stored_on_device(step, layer, q, grid)
        stored = stored.reshape(_fitting_heads(tuple(stored.shape), heads, qb), qb, qb)
        block_map = floor_k_min(stored.to(q.device), k_min)
        if block_map.shape[0] == 1 and heads > 1:
            block_map = block_map.expand(heads, qb, qb).clone()
        return block_map, None, None

    def map_for(self, step: int, layer: int, q: torch.Tensor, length: int | None = None, grid=None):
        """Final map for (this expert, step, layer) on q's device: ``(bool [1, H, Qb, Kb], kept)`` with
        ``kept`` the number of kept blocks (a device scalar on CUDA, read only when the run ends).
        ``length``: the grid's token count when ``q`` is not at full length (a compact call), else q's;
        ``grid``: the call's token grid (:meth:`_call_grid`: a call of another grid than the maps' gets them
        resampled to its own where it can).

        stored map (resampled) | k_min floor | visit-refresh extra pairs. No host sync: the entry's
        maps reach the device once per run (:meth:`_prefetch`), the floor and the refresh are device
        ops (the floor, the packed copy and the count in one kernel on CUDA where the refresh is off).
        Built once per (step, layer) and run: the current step's maps stay on the device
        bit-packed (a 720p 14B step's 40 maps take ~70 MB) for a second call of the same step (cond
        and uncond run separately), so the refresh records each map once. Raises :class:`Fallback`
        for a key the entry lacks or a map that does not fit the call.
        """
        if self.step != step:  # keep only the current step's maps on the device
            self._maps.clear()
            self.step = step
        cfg = self.config
        heads, length = q.shape[1], q.shape[2] if length is None else int(length)
        target = self._call_grid(length, grid)
        key = (step, layer, target)
        if key in self._maps:
            packed, kept, num_kv = self._maps[key]
            return unpack_bits_on_device(packed, num_kv), kept
        qb = -(-length // cfg.block_size)
        block_map, packed, row_kept = self._floored(step, layer, q, heads, qb, target)
        if cfg.refresh_steps > 0:
            refresh = self.plan.refresh_state(cfg.refresh_steps)
            block_map = block_map | refresh.extra_pairs(layer, block_map, step)
            refresh.record(layer, block_map, step)
            packed = row_kept = None
        block_map = block_map[None]
        counted = block_map if row_kept is None else row_kept
        kept = counted.sum() if counted.device.type == "cuda" else int(counted.sum())
        packed = pack_bits_on_device(block_map) if packed is None else packed[None]
        self._maps[key] = (packed, kept, block_map.shape[-1])
        return block_map, kept

    def _call_grid(self, length: int, grid=None):
        """None when the call's token count is that of the grid the maps are for (the entry's, or the one
        retrieval resamples them to); else the call's ``grid`` (of that many tokens) to serve the entry's maps
        at, by the rule retrieval applies to latents (:func:`~chorus.engine.compat.grid_compatibility`: the
        entry's own grid, or one of the same aspect its maps are resampled to, in the order of their kind there
        -- context windows of two lengths in one run: later ComfyUI's causal anchor frame, a shorter last
        window). :class:`Fallback` otherwise (a call of another aspect, or whose grid is not known)."""
        maps_grid = self.plan.token_grid
        if maps_grid is None:
            return None
        maps_grid = tuple(int(g) for g in maps_grid)
        tokens = maps_grid[0] * maps_grid[1] * maps_grid[2]
        if tokens == length:
            return None
        call_grid = None if grid is None else tuple(int(g) for g in grid)
        why = "its grid is not known"
        if call_grid is not None and call_grid[0] * call_grid[1] * call_grid[2] == length:
            verdict, why = grid_compatibility(self.plan.entry_meta["signature"], call_grid)
            if verdict != "incompatible":
                return call_grid
        raise Fallback(f"the entry's maps are for {tokens} tokens (grid {maps_grid}), this call has {length}"
                       + ("" if call_grid is None else f" (grid {call_grid})") + ": a sequence of another length "
                       f"they cannot be resampled to ({why})")

    def used_map(self, step: int, layer: int) -> torch.Tensor | None:
        """The bool map ``[1, H, Qb, Kb]`` this run computes for (step, layer) at the maps' grid, or None when
        the current step has not reached that layer."""
        entry = self._maps.get((step, layer, None))
        return None if entry is None else unpack_bits_on_device(entry[0], entry[2])
