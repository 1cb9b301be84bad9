"""engine/guidance.py: when the boost acts, its gain, and that strength 0 changes nothing."""

import math

import pytest
import torch

from chorus.engine.guidance import GAIN_PER_STRENGTH, GuidanceBoost
from chorus.engine.plan import Plan


def _hit(step_sigmas=(1.0, 0.75, 0.5, 0.25)):
    sig = {"step_sigmas": list(step_sigmas), "token_grid": [1, 2, 2]}
    return Plan("hit", masks={(0, 0, 0, 0): torch.ones(1, 1, 1, dtype=torch.bool)}, entry_meta={"signature": sig},
                similarity=0.95, entry_id=1)


def test_strength_zero_returns_the_same_object():
    out = torch.randn(1, 8, 4)
    for plan in (None, _hit(), Plan.miss("m")):
        boost = GuidanceBoost(plan, 0.0)
        assert boost.cross_attention(out, 1.0) is out and not boost.active_at(1.0)


def test_acts_only_where_reuse_acted():
    out = torch.ones(1, 3, 2)
    hit = GuidanceBoost(_hit(), 0.5)
    assert hit.gain == pytest.approx(1 + 0.5 * GAIN_PER_STRENGTH)
    assert torch.equal(hit.cross_attention(out, torch.tensor([0.75])), out * hit.gain)
    assert hit.cross_attention(out, 0.6) is out  # not a step of the entry
    hit.sample_sigmas = [1.0, 0.75, 0.5, 0.25, 0.0]
    assert hit.active_at(0.6)  # an intermediate sigma of step 0.75 (multi-evaluation samplers)
    miss = GuidanceBoost(Plan.miss("m"), 2.0)
    assert miss.cross_attention(out, 1.0) is out
    no_plan = GuidanceBoost(None, 1.0)
    assert torch.equal(no_plan.cross_attention(out, 0.3), out * (1 + GAIN_PER_STRENGTH))
    assert hit.boosted_calls == 1 and no_plan.boosted_calls == 1


@pytest.mark.parametrize("bad", [-0.1, 5.1, math.nan, math.inf, "1"])
def test_bad_strength_raises(bad):
    with pytest.raises(ValueError, match="strength"):
        GuidanceBoost(None, bad)


def test_bad_plan_raises():
    with pytest.raises(ValueError, match="plan"):
        GuidanceBoost(object(), 0.5)
