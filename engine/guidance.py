"""Guidance enhancement: reinforce the text and image conditioning on the steps where reuse acted.

Reuse (sparse attention with an earlier request's masks, downsampled regions) lets a request drift
from its own conditioning: attention to some key blocks is never computed, and pooled regions
see the prompt at reduced resolution. Three corrections, each with its own strength:

- **text** (``strength``): Wan injects the prompt (and, for Wan 2.1 I2V, the CLIP image tokens)
  through cross-attention, so its output gets a gain

      out_cross  ->  (1 + GAIN_PER_STRENGTH * strength) * out_cross

- **image** (``image_strength``): Wan 2.2 (A14B I2V, TI2V 5B) carries the start image in the first
  latent frame, whose tokens are the first ``H' * W'`` of the ``(t, h, w)`` sequence. Self-attention
  gets a logit bias toward those keys,

      bias = log(1 + IMAGE_GAIN_PER_STRENGTH * image_strength)

  added to the scaled logits of the first-frame keys for every query: their softmax weights are
  multiplied by ``1 + IMAGE_GAIN_PER_STRENGTH * image_strength`` before renormalisation. On the
  sparse path the kernel applies it (the reused maps always keep the first frame's key blocks); a
  dense call applies it through :func:`image_biased_attention`. A first-last-frame request (an end
  image in the last latent frame of the forward: in context windows the window that ends the video) gets the
  same bias on the last frame's keys, the sequence's suffix in raster order and in feature reuse's region
  orders where that frame ends them (:meth:`GuidanceBoost.last_frame_bias`; feature reuse's compact calls
  take it on their leading keys, ``AttnCall.key_prefix``; a hit whose entry runs in a token order where that
  frame is not the suffix, e.g. a tile order of an odd frame count, biases the first frame only, with a note).

- **CFG-style correction** (``cfg_strength``, only where the sampler's cfg > 1): the guidance
  direction ``cond - uncond`` of the denoised prediction is amplified, i.e. the step runs at
  ``cfg * (1 + CFG_GAIN_PER_STRENGTH * cfg_strength)``:

      denoised  ->  denoised + cfg * CFG_GAIN_PER_STRENGTH * cfg_strength * (cond_denoised - uncond_denoised)

  (a ComfyUI post-CFG function; cfg 1 graphs, such as the 4-step Wan 2.2 LoRA, have no uncond
  prediction and are left alone).

All act only in model calls whose step is one where reuse acted: the plan is a hit and the sigma is
one of the entry's steps (sparsity reuse acts on every such step, feature reuse on a subset). A miss
has no reuse, so nothing changes; without a plan, every step is boosted (the user asked).
A strength of 0 leaves that part out entirely; all 0 is bit-identical to no patch.
"""

from __future__ import annotations

import math

import torch

from .model_info import ends_with_image
from .plan import Plan
from .routing import match_step, sigma_schedule, sigma_value, step_sigma
from .state import failure_text

GAIN_PER_STRENGTH = 0.2
IMAGE_GAIN_PER_STRENGTH = 0.2
CFG_GAIN_PER_STRENGTH = 0.2
MAX_STRENGTH = 5.0


def _check_strength(name: str, value) -> float:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)
                                       and 0.0 <= value <= MAX_STRENGTH):
        raise ValueError(f"{name} must be in [0, {MAX_STRENGTH}], got {value!r}")
    return float(value)


def image_biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, prefix_bias: float,
                           suffix_len: int = 0, suffix_bias: float = 0.0) -> torch.Tensor:
    """Dense attention ``[B, H, L, D]`` with ``prefix_bias`` added to the scaled logits of keys
    ``[0, prefix_len)`` (the first frame) and ``suffix_bias`` to those of the last ``suffix_len`` keys (the last
    frame of a first-last-frame request): PyTorch SDPA with an additive ``[1, 1, 1, Lk]`` mask, any device/dtype.

    No bias that acts (each length or bias 0) is plain SDPA. ``ValueError`` for a prefix or suffix outside
    ``[0, Lk]``, the two overlapping, or a non-finite bias."""
    kv_len = k.shape[-2]
    prefix_len, suffix_len = int(prefix_len), int(suffix_len)
    if not (0 <= prefix_len <= kv_len and 0 <= suffix_len <= kv_len - prefix_len) \
            or not (math.isfinite(prefix_bias) and math.isfinite(suffix_bias)):
        raise ValueError(f"prefix_len and suffix_len must be disjoint ranges of the {kv_len} keys and the biases "
                         f"finite, got {prefix_len!r}, {suffix_len!r}, {prefix_bias!r}, {suffix_bias!r}")
    if (prefix_len == 0 or prefix_bias == 0.0) and (suffix_len == 0 or suffix_bias == 0.0):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    mask = torch.zeros(1, 1, 1, kv_len, dtype=q.dtype, device=q.device)
    mask[..., :prefix_len] = prefix_bias
    if suffix_len:
        mask[..., kv_len - suffix_len:] = suffix_bias
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def biased_dense_or_plain(dense_fn, prefix_len: int, prefix_bias: float, suffix_len: int = 0, suffix_bias: float = 0.0,
                          on_error=None):
    """A ``dense_fn``-shaped callable ``(q, k, v) -> [B, H, L, D]``: :func:`image_biased_attention`,
    or ``dense_fn(q, k, v)`` (no bias) when that raises — e.g. out of memory on a GPU/dtype where SDPA
    has no fused kernel for an additive mask — after telling ``on_error(message)``. Guidance must never
    fail a sampling run."""
    def run(q, k, v):
        try:
            return image_biased_attention(q, k, v, prefix_len, prefix_bias, suffix_len, suffix_bias)
        except Exception as exc:  # noqa: BLE001 - fall back to the plain dense call
            if on_error is not None:
                on_error(f"image bias not applied to a dense call ({failure_text(exc)}); plain dense attention")
            return dense_fn(q, k, v)
    return run


class GuidanceBoost:
    """Decides and applies the guidance for one patched model.

    ``plan``: the request's :class:`Plan` or None. ``strength`` (text: cross-attention gain),
    ``image_strength`` (first-frame logit bias in self-attention) and ``cfg_strength`` (CFG-style
    correction where cfg > 1), each in [0, MAX_STRENGTH]; bad values raise ``ValueError``.
    ``sample_sigmas`` (per sampler run, :meth:`begin_run`): the run's schedule, so intermediate
    sigmas of multi-evaluation samplers map to their step.
    """

    def __init__(self, plan: Plan | None, strength: float = 0.5, image_strength: float = 0.5,
                 cfg_strength: float = 0.0):
        if plan is not None and not isinstance(plan, Plan):
            raise ValueError(f"plan must be a chorus Plan or None, got {type(plan).__name__}")
        self.plan = plan
        self.strength = _check_strength("strength", strength)
        self.image_strength = _check_strength("image_strength", image_strength)
        self.cfg_strength = _check_strength("cfg_strength", cfg_strength)
        self.sample_sigmas: list[float] | None = None
        self.boosted_calls = 0
        self.biased_calls = 0
        self.cfg_corrected_calls = 0

    def __deepcopy__(self, memo):
        return self

    def begin_run(self, sample_sigmas=None) -> None:
        """Start a sampler run with this schedule (a tensor, list or None)."""
        self.sample_sigmas = sigma_schedule(sample_sigmas)

    def end_run(self) -> None:
        self.sample_sigmas = None

    @property
    def is_off(self) -> bool:
        return self.strength == 0.0 and self.image_strength == 0.0 and self.cfg_strength == 0.0

    @property
    def gain(self) -> float:
        """Cross-attention output gain where reuse acted."""
        return 1.0 + GAIN_PER_STRENGTH * self.strength

    @property
    def image_bias(self) -> float:
        """First-frame logit bias (natural-log units) where reuse acted."""
        return math.log1p(IMAGE_GAIN_PER_STRENGTH * self.image_strength)

    def reuse_acted(self, sigma) -> bool:
        """Whether reuse acted at this sigma (float or tensor; first element), regardless of strengths."""
        if self.plan is None:
            return True
        if not self.plan.is_hit:
            return False
        try:
            s = step_sigma(sigma_value(sigma), self.sample_sigmas)
            return match_step(s, self.plan.step_sigmas) is not None
        except Exception:  # noqa: BLE001 - no step identity: no boost
            return False

    def active_at(self, sigma) -> bool:
        """Whether any part of the guidance acts at this sigma."""
        return not self.is_off and self.reuse_acted(sigma)

    def text_gain(self, sigma) -> float | None:
        """The gain for a cross-attention output at ``sigma`` (where reuse acted and the text strength is
        not 0), counted as a boosted call; else None. Never raises."""
        if self.strength == 0.0 or not self.reuse_acted(sigma):
            return None
        self.boosted_calls += 1
        return float(self.gain)

    def cross_attention(self, out: torch.Tensor, sigma) -> torch.Tensor:
        """The cross-attention output, boosted when reuse acted at ``sigma`` (:meth:`text_gain`); else ``out``
        itself."""
        gain = self.text_gain(sigma)
        return out if gain is None else out * gain

    def first_frame_bias(self, sigma) -> float:
        """The self-attention logit bias toward the first frame's keys at ``sigma`` (0.0: none; also
        for a sigma without a step identity). Never raises."""
        if self.image_strength == 0.0 or not self.reuse_acted(sigma):
            return 0.0
        self.biased_calls += 1
        return self.image_bias

    def last_frame_bias(self, sigma, image_frames=None) -> float:
        """The self-attention logit bias toward the last frame's keys at ``sigma``: :meth:`first_frame_bias`'s
        value where the forward's input ends with an end image (a first-last-frame request), else 0.0.
        ``image_frames``: a callable giving the forward's own ``(first, last, other)``
        (:func:`~chorus.engine.model_info.image_frames`; the host's answer for a forward in a context window,
        which holds part of the video), asked only here; where it is None or gives None, the request's (the
        plan's ``state.image_frames``, read at the run's first forward). Not counted (the call's first-frame bias
        counts it). Never raises."""
        if self.image_strength == 0.0 or not self.reuse_acted(sigma):
            return 0.0
        try:
            frames = image_frames() if image_frames is not None else None
            if frames is None and self.plan is not None:
                frames = self.plan.state.image_frames
            return self.image_bias if ends_with_image(frames) else 0.0
        except Exception:  # noqa: BLE001 - no end image known: no bias
            return 0.0

    def cfg_correction(self, denoised: torch.Tensor, cond_denoised, uncond_denoised, cond_scale: float,
                       sigma) -> torch.Tensor:
        """The CFG result with its guidance direction amplified where reuse acted and ``cond_scale > 1``
        (see the module docstring); ``denoised`` itself otherwise (no uncond prediction, cfg <= 1,
        mismatched shapes, non-finite scale)."""
        if self.cfg_strength == 0.0 or not isinstance(cond_denoised, torch.Tensor) \
                or not isinstance(uncond_denoised, torch.Tensor) or cond_denoised.shape != denoised.shape \
                or uncond_denoised.shape != denoised.shape:
            return denoised
        try:
            scale = float(cond_scale)
        except (TypeError, ValueError):
            return denoised
        if not math.isfinite(scale) or scale <= 1.0 or math.isclose(scale, 1.0) or not self.reuse_acted(sigma):
            return denoised
        self.cfg_corrected_calls += 1
        extra = scale * CFG_GAIN_PER_STRENGTH * self.cfg_strength
        return denoised + (cond_denoised - uncond_denoised) * extra
