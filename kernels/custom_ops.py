"""The pack's ``torch.library`` custom ops (namespace ``chorus``): whether one is registered.

ComfyUI imports the pack under its folder name while tests import ``chorus``, so one process may
import each module that registers an op twice; each registers only when :func:`op_registered` says
the op is not there yet (a second registration would raise)."""

from __future__ import annotations

import torch


def op_registered(name: str) -> bool:
    """Whether ``torch.ops.chorus.<name>`` exists in this process."""
    try:
        getattr(torch.ops.chorus, name)
        return True
    except (AttributeError, RuntimeError):
        return False
