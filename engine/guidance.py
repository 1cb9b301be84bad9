"""Guidance enhancement: reinforce the text and image conditioning on the steps where reuse acted.

Reuse (sparse attention with an earlier request's masks, downsampled regions) lets a request drift
from its own conditioning: attention to some key blocks is never computed, and pooled regions
see the prompt at reduced resolution. Wan injects text (and, for Wan 2.1 I2V, the CLIP image
tokens) through cross-attention, so the correction here is a gain on the cross-attention output:

    out_cross  ->  (1 + GAIN_PER_STRENGTH * strength) * out_cross

applied to every cross-attention call (text, and CLIP image where the model has it) of the model
calls whose step is one where reuse acted. "Reuse acted" means: the plan is a hit and the sigma
is one of the entry's steps (sparsity reuse acts on every such step, feature reuse on a subset);
a miss has no reuse, so nothing changes; without a plan, every step is boosted (the user asked).
``strength == 0`` returns the host's output object unchanged: bit-identical to no patch.

Wan 2.2 A14B I2V carries its image condition in the latent channels, not in cross-attention: for it
this reinforces the text only (the first-frame keep-set of the masks protects the image tokens).
"""

from __future__ import annotations

import math

import torch

from .plan import Plan
from .routing import match_step, step_sigma

GAIN_PER_STRENGTH = 0.2
MAX_STRENGTH = 5.0


class GuidanceBoost:
    """Decides and applies the cross-attention gain for one patched model.

    ``plan``: the request's :class:`Plan` or None. ``strength`` in [0, MAX_STRENGTH]; bad values raise
    ``ValueError``. ``sample_sigmas`` (optional): the run's schedule, so intermediate sigmas of
    multi-evaluation samplers map to their step.
    """

    def __init__(self, plan: Plan | None, strength: float = 0.5):
        if plan is not None and not isinstance(plan, Plan):
            raise ValueError(f"plan must be a chorus Plan or None, got {type(plan).__name__}")
        if not (isinstance(strength, (int, float)) and math.isfinite(strength) and 0.0 <= strength <= MAX_STRENGTH):
            raise ValueError(f"strength must be in [0, {MAX_STRENGTH}], got {strength!r}")
        self.plan = plan
        self.strength = float(strength)
        self.sample_sigmas: list[float] | None = None
        self.boosted_calls = 0

    def __deepcopy__(self, memo):
        return self

    @property
    def gain(self) -> float:
        return 1.0 + GAIN_PER_STRENGTH * self.strength

    def active_at(self, sigma) -> bool:
        """Whether reuse acted at this sigma (float or tensor; first element)."""
        if self.strength == 0.0:
            return False
        if self.plan is None:
            return True
        if not self.plan.is_hit:
            return False
        try:
            if isinstance(sigma, torch.Tensor):
                sigma = sigma.reshape(-1)[0].item()
            s = step_sigma(float(sigma), self.sample_sigmas)
            return match_step(s, self.plan.step_sigmas) is not None
        except Exception:  # noqa: BLE001 - no step identity: no boost
            return False

    def cross_attention(self, out: torch.Tensor, sigma) -> torch.Tensor:
        """The cross-attention output, boosted when reuse acted at ``sigma``; else ``out`` itself."""
        if not self.active_at(sigma):
            return out
        self.boosted_calls += 1
        return out * self.gain
