"""Chorus II: cross-request block-sparse attention reuse for Wan image-to-video.

This file is the ComfyUI entry point and the root of the ``chorus`` Python package.
Importing it must not need ComfyUI: the node modules are imported only when ComfyUI
calls :func:`comfy_entrypoint`. ``chorus.kernels`` and ``chorus.cache_store`` never
import ComfyUI.
"""

__version__ = "0.1.0"


async def comfy_entrypoint():
    """Return the pack's ``ComfyExtension`` (ComfyUI V3 API); called by ComfyUI only."""
    from .nodes import ChorusExtension

    return ChorusExtension()
