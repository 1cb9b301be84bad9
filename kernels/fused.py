"""The switch of a fused Triton fast path that has a torch twin (feature reuse's pooling, the miss's
block selection): the caller tries the kernel while the switch is on and takes the torch path when it
raises.

An out-of-memory error says nothing about the kernel (the next call tries it again); any other error (a
Triton that cannot build it) turns the switch off for the process, logged once. Tests:
``tests/test_feature_reuse_pooling.py``, ``tests/test_kernels_masks.py``.
"""

from __future__ import annotations

import logging

import torch

LOG = logging.getLogger(__name__)


class FusedSwitch:
    """Whether the fused path named ``what`` may run (``on``); :meth:`failure` takes what it raised."""

    def __init__(self, what: str):
        self.what = what
        self.on = True

    def failure(self, exc: Exception) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            return
        if self.on:
            LOG.warning("chorus: %s failed (%s: %s); using the torch implementation", self.what,
                        type(exc).__name__, exc)
        self.on = False
