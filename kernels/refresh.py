"""Visit refresh: keep information flowing through block pairs a reused mask never visits.

For each key (e.g. ``(layer, head_group)``) the scheduler remembers, per block pair, the last step
at which the pair was computed during the current request. At step ``s`` it returns the pairs not
in this step's map that would otherwise be left out for more than ``R`` consecutive steps
(``R = max_unvisited_steps``). The first forced visits are staggered over ``R + 1`` phases by
``(i + j) mod (R + 1)`` so the extra work is spread evenly over the steps instead of arriving all at
once.

Guarantee: if every step's computed map is ``block_map | extra_pairs(...)`` and is passed to
:meth:`VisitRefresh.record`, no pair stays unvisited for more than ``R`` consecutive steps, counting
from step 0. ``R = 0`` disables the refresh (no extra pairs).
"""

from __future__ import annotations

import torch


class VisitRefresh:
    """Per-request visit tracker. Steps are request-global step indices ``0, 1, 2, ...``."""

    def __init__(self, max_unvisited_steps: int):
        if not isinstance(max_unvisited_steps, int) or max_unvisited_steps < 0:
            raise ValueError(f"max_unvisited_steps must be an int >= 0, got {max_unvisited_steps!r}")
        self.max_unvisited_steps = max_unvisited_steps
        self._last_visit: dict = {}

    def reset(self) -> None:
        """Forget every key (call at the start of a request)."""
        self._last_visit.clear()

    def _state(self, key, block_map: torch.Tensor) -> torch.Tensor:
        state = self._last_visit.get(key)
        if state is None or state.shape != block_map.shape or state.device != block_map.device:
            period = self.max_unvisited_steps + 1
            qb, kb = block_map.shape[-2:]
            phase = (torch.arange(qb, device=block_map.device)[:, None]
                     + torch.arange(kb, device=block_map.device)[None, :]) % period
            state = (phase - period).expand(block_map.shape).clone()
            self._last_visit[key] = state
        return state

    def extra_pairs(self, key, block_map: torch.Tensor, step: int) -> torch.Tensor:
        """Bool map (``block_map``'s shape) of pairs to add at ``step``; never overlaps ``block_map``."""
        if block_map.dtype != torch.bool:
            raise ValueError(f"block_map must be bool, got {block_map.dtype}")
        if self.max_unvisited_steps == 0:
            return torch.zeros_like(block_map)
        last = self._state(key, block_map)
        return ((step - last) > self.max_unvisited_steps) & ~block_map

    def record(self, key, used_map: torch.Tensor, step: int) -> None:
        """Mark the pairs of ``used_map`` (bool) as computed at ``step``."""
        if used_map.dtype != torch.bool:
            raise ValueError(f"used_map must be bool, got {used_map.dtype}")
        if self.max_unvisited_steps == 0:
            return
        last = self._state(key, used_map)
        last.masked_fill_(used_map, int(step))
