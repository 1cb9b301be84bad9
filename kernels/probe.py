"""First-use probes: one build-and-launch check of a kernel per key, asked while ``auto`` resolves.

A kernel that does not build on this machine (a Triton of another torch release, a GPU it was never run
on), or builds and computes wrong, is a *reason* found once, so ``auto`` takes the next backend of its
chain from the start instead of every call failing, building again or giving a wrong video. Users:
the Triton kernels (:mod:`chorus.kernels.triton`: the warp-specialised, portable and block-mass kernels)
and compiled FlexAttention (:func:`chorus.kernels.api.why_unavailable`). Imports torch alone.

- :func:`build_probe` ``(key, kernel, run) -> reason | None``
- :func:`probe_inputs` ``(q, count) -> [count, 1, 2, PROBE_TOKENS, D]``: the probes' unit Gaussian inputs
- :func:`attention_error` ``(q, numerics, attention) -> float``: an attention kernel's full-map run on them,
  checked against the fp64 oracle (the portable Triton kernels' and flex's first-use check)
"""

from __future__ import annotations

import logging

import torch

from .reference import NUMERICS_CEILINGS, dense_attention_oracle, relative_l2

LOG = logging.getLogger(__name__)

PROBE_TOKENS = 200  # two blocks of 128, the second partial (as Wan's lengths)

_PROBED: dict[tuple, str | None] = {}


def probe_inputs(q: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` unit Gaussian tensors ``[1, 2, PROBE_TOKENS, D]`` like ``q`` (device, dtype, head dim), stacked,
    the same each time (seed 0)."""
    gen = torch.Generator(device=q.device).manual_seed(0)
    return torch.randn(count, 1, 2, PROBE_TOKENS, q.shape[-1], generator=gen, device=q.device).to(q.dtype)


def attention_error(q: torch.Tensor, numerics: str, attention) -> float:
    """Run ``attention(q, k, v, full_map)`` (an attention kernel; ``full_map`` a bool ``[1, 1, Qb, Kb]`` of
    128-token blocks keeping every one) on unit Gaussian q / k / v like ``q`` (2 heads x :data:`PROBE_TOKENS`)
    and return its relative L2 against the fp64 oracle; ``RuntimeError`` when it is not finite or past the
    ceiling of its ``numerics`` (:data:`~chorus.kernels.reference.NUMERICS_CEILINGS`). Whatever the kernel
    raises propagates."""
    x = probe_inputs(q, 3)
    blocks = -(-PROBE_TOKENS // 128)
    full = torch.ones(1, 1, blocks, blocks, dtype=torch.bool, device=q.device)
    error = relative_l2(attention(x[0], x[1], x[2], full), dense_attention_oracle(x[0], x[1], x[2]))
    if not error <= NUMERICS_CEILINGS[numerics]:
        raise RuntimeError(f"it computes wrong: relative error {error:.3g} against exact attention, where its "
                           f"numerics stay under {NUMERICS_CEILINGS[numerics]}")
    return error


def build_probe(key: tuple, kernel: str, run) -> str | None:
    """Run ``run()`` (a build and launch of ``kernel``, named in the reason, on a tiny input) once per
    ``key``: None when it returns, else the reason it raised (remembered for ``key``, logged once as a
    warning). An out-of-memory error says nothing about the build: it is neither a reason nor remembered."""
    if key not in _PROBED:
        try:
            run()
        except torch.OutOfMemoryError:
            return None
        except Exception as exc:  # noqa: BLE001 - any build or launch failure makes the kernel unavailable
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            _PROBED[key] = f"{kernel} does not build or run here ({type(exc).__name__}: {first_line})"
            LOG.warning("chorus: %s", _PROBED[key])
        else:
            _PROBED[key] = None
    return _PROBED[key]
