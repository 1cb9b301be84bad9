"""Step identity from sigma: schedules sliced like KSamplerAdvanced, split across two experts."""

from __future__ import annotations

import math

import pytest

from chorus.engine import SigmaSchedule, match_step, step_sigma

# a 4-step flow schedule (shift 8) as ComfyUI's "simple" scheduler gives it, then 0
FULL = [1.0, 0.96, 0.8889, 0.7273, 0.0]


def test_sigma_on_the_schedule_names_its_step():
    for i, s in enumerate(FULL[:-1]):
        assert step_sigma(s, FULL) == s and match_step(s, FULL[:-1]) == i


@pytest.mark.parametrize("start,end", [(0, 2), (2, 4), (1, 3), (0, 4), (3, 4)])
def test_sliced_schedules_route_to_global_steps(start, end):
    """KSamplerAdvanced runs sigmas[start:end+1]; its steps keep their global index."""
    sliced = FULL[start:end + 1]
    for local, s in enumerate(sliced[:-1]):
        assert match_step(step_sigma(s, sliced), FULL[:-1]) == start + local


def test_intermediate_sigmas_stay_on_their_step():
    """Samplers that evaluate sigmas between schedule points (heun, dpm 2s) stay on the step."""
    mid = math.sqrt(FULL[1] * FULL[2])
    assert step_sigma(mid, FULL) == FULL[1]
    assert match_step(step_sigma(mid, FULL), FULL[:-1]) == 1


def test_float_noise_is_tolerated_and_far_values_are_not():
    assert match_step(0.8889 * (1 + 3e-5), FULL[:-1]) == 2
    assert match_step(0.85, FULL[:-1]) is None
    assert step_sigma(1.5, FULL) == 1.5  # above the schedule: the sigma names itself
    assert step_sigma(0.5, None) == 0.5
    with pytest.raises(ValueError):
        step_sigma(float("nan"), FULL)


def test_sigma_schedule_merges_two_experts_in_descending_order():
    sched = SigmaSchedule()
    for s in FULL[2:4] + FULL[0:2]:  # low expert's steps registered first: order comes from the values
        sched.canonical(s)
    sched.canonical(0.96 * (1 + 1e-6))
    assert sched.steps() == FULL[:-1] and len(sched) == 4
    assert sched.index(0.7273) == 3
