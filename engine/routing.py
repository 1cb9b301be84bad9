"""Step identity from sigma values.

A step is named by the sigma at its start. Hosts hand the engine the *current* sigma of a model
call and, when they know it, the schedule of the current sampler call (ComfyUI's
``sample_sigmas``; a KSamplerAdvanced slice, or the high / low half of a Wan 2.2 A14B run). The
current sigma is mapped to the step it belongs to (last schedule value >= it, so samplers that
evaluate intermediate sigmas stay on their step), and that step sigma is then matched *by value*
against the request's whole schedule. Nothing depends on step counters, so slicing and splitting a
schedule across two models route to the same global steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

RTOL = 1e-4
ATOL = 1e-7


def sigmas_close(a: float, b: float) -> bool:
    """``|a - b| <= ATOL + RTOL * |b|`` (the tolerance ComfyUI's context windows use)."""
    return abs(a - b) <= ATOL + RTOL * abs(b)


def sigma_value(sigma) -> float:
    """A sigma as a finite float: a number, or the first element of a tensor (one host read).
    Raises ``ValueError`` for an empty tensor or a non-finite value."""
    if hasattr(sigma, "reshape") and hasattr(sigma, "numel"):
        if sigma.numel() == 0:
            raise ValueError("empty sigma tensor")
        sigma = sigma.reshape(-1)[0].item()
    sigma = float(sigma)
    if not math.isfinite(sigma):
        raise ValueError(f"sigma must be finite, got {sigma}")
    return sigma


def sigma_schedule(sample_sigmas) -> list[float] | None:
    """A sampler run's schedule as a list of floats, the one normalisation every host and engine
    part uses: a tensor, list or tuple of numbers -> ``[float, ...]``; None, an empty schedule, a
    non-number or a non-finite value -> None (no schedule: each sigma names its own step)."""
    if sample_sigmas is None:
        return None
    try:
        values = sample_sigmas.tolist() if hasattr(sample_sigmas, "tolist") else list(sample_sigmas)
        values = [float(s) for s in (values if isinstance(values, list) else [values])]
    except (TypeError, ValueError):
        return None
    return values if values and all(math.isfinite(s) for s in values) else None


def run_starts(sample_sigmas: list[float] | None) -> list[float] | None:
    """The sigmas a sampler run's steps start at (its schedule without the last value; a one-value
    schedule: that value), or None for no schedule."""
    if not sample_sigmas:
        return None
    return sample_sigmas[:-1] if len(sample_sigmas) > 1 else sample_sigmas


def step_sigma(sigma: float, sample_sigmas: Sequence[float] | None) -> float:
    """The sigma at the start of the step that ``sigma`` is evaluated in.

    ``sample_sigmas`` is the schedule of the running sampler call (descending, last value usually 0)
    or None. Without it, or when ``sigma`` lies above the schedule, the sigma itself names the step.
    Raises ``ValueError`` for a non-finite sigma.
    """
    sigma = float(sigma)
    if not math.isfinite(sigma):
        raise ValueError(f"sigma must be finite, got {sigma}")
    if not sample_sigmas:
        return sigma
    starts = run_starts([float(s) for s in sample_sigmas])
    for s in starts:
        if sigmas_close(sigma, s):
            return s
    best = None
    for s in starts:  # last start sigma >= current (schedules are descending)
        if s >= sigma:
            best = s
    return sigma if best is None else best


def match_step(sigma: float, schedule: Sequence[float]) -> int | None:
    """Index of ``sigma`` in ``schedule`` (by value, :func:`sigmas_close`), or None."""
    for i, s in enumerate(schedule):
        if sigmas_close(float(sigma), float(s)):
            return i
    return None


class SigmaSchedule:
    """The step sigmas a request has used so far (a miss records under them).

    ``canonical(s)`` returns the already-known sigma close to ``s`` (or adds ``s``), so float noise
    never splits one step in two. ``steps()`` is the known sigmas, descending: index = global step.
    """

    def __init__(self, sigmas: Sequence[float] = ()):
        self._sigmas: list[float] = []
        for s in sigmas:
            self.canonical(s)

    def canonical(self, sigma: float) -> float:
        sigma = float(sigma)
        for s in self._sigmas:
            if sigmas_close(sigma, s):
                return s
        self._sigmas.append(sigma)
        return sigma

    def steps(self) -> list[float]:
        return sorted(self._sigmas, reverse=True)

    def index(self, sigma: float) -> int | None:
        return match_step(sigma, self.steps())

    def __len__(self) -> int:
        return len(self._sigmas)
