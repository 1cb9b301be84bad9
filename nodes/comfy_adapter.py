"""ComfyUI model identity: the LoRA-aware :class:`~chorus.engine.ModelInfo` of a ``ModelPatcher``.

The patching itself (one Chorus patch per model: attention override, wrappers, block patches) is
:mod:`.comfy_patch`.
"""

from __future__ import annotations

import hashlib

from ..engine import ModelInfo, wan_model_info


def patch_summary(model_patcher) -> str:
    """Description of the weight patches (LoRAs) a ModelPatcher will apply: keys, counts, strengths.

    Part of the weights fingerprint, so a model with other LoRAs (or strengths) is another model.
    """
    patches = getattr(model_patcher, "patches", None) or {}
    h = hashlib.sha256()
    for key in sorted(patches):
        strengths = []
        for p in patches[key]:
            try:
                strengths.append((round(float(p[0]), 6), round(float(p[2]), 6)))
            except (TypeError, ValueError, IndexError):
                strengths.append(None)
        h.update(f"{key}:{strengths};".encode())
    return h.hexdigest()[:16] if patches else ""


def comfy_model_info(model_patcher) -> ModelInfo:
    """:class:`ModelInfo` of the diffusion model inside a ComfyUI ``ModelPatcher`` (never raises)."""
    diffusion_model = getattr(getattr(model_patcher, "model", None), "diffusion_model", None)
    if diffusion_model is None:
        return ModelInfo("unknown", type(model_patcher).__name__, 0, 0, 0, 0, "", False,
                         "the MODEL input holds no diffusion model")
    prefix = "diffusion_model."
    patched_keys = frozenset(k[len(prefix):] for k in (getattr(model_patcher, "patches", None) or {})
                             if isinstance(k, str) and k.startswith(prefix))
    try:
        # weights with patches (LoRAs) are applied in place when ComfyUI loads the model: their values
        # differ between a loaded and an unloaded model, so only the patch description enters the hash
        return wan_model_info(diffusion_model, fingerprint_extra=patch_summary(model_patcher),
                              fingerprint_exclude=patched_keys)
    except Exception as exc:  # noqa: BLE001
        return ModelInfo("unknown", type(diffusion_model).__name__, 0, 0, 0, 0, "", False,
                         f"could not inspect the model ({type(exc).__name__}: {exc})")
