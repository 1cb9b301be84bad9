"""Use the engine from a diffusers Wan pipeline (``WanTransformer3DModel``); see README.md.

Importing this package needs torch and ``chorus.engine`` only (the patches take a model the caller
built), not diffusers itself.
"""

from .adapter import DiffusersGuidancePatch, DiffusersPatch, patch_diffusers_guidance, patch_diffusers_wan
from .feature_reuse import DiffusersFeatureReusePatch, patch_diffusers_feature_reuse

__all__ = [
    "patch_diffusers_wan", "patch_diffusers_guidance", "patch_diffusers_feature_reuse",
    "DiffusersPatch", "DiffusersGuidancePatch", "DiffusersFeatureReusePatch",
]
