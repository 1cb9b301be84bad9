"""ComfyUI model identity: the LoRA-aware :class:`~chorus.engine.ModelInfo` of a ``ModelPatcher``, and the
request's input images as a sampler run's conditioning tells them (:func:`request_image_flags`).

The patching itself (one Chorus patch per model: attention override, wrappers, block patches) is
:mod:`.comfy_patch`.
"""

from __future__ import annotations

import hashlib

import torch

from ..engine import ModelInfo, wan_model_info
from ..engine.model_info import I2V_IN_CHANNELS, I2V_MASK_CHANNELS, mask_frame_flags
from ..engine.state import failure_text


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


ROPE_IDENTITY = {"scale_t": 1.0, "scale_y": 1.0, "scale_x": 1.0, "shift_t": 0.0, "shift_y": 0.0, "shift_x": 0.0}


def rope_summary(model_patcher) -> str:
    """The model's RoPE scaling, as ComfyUI's ScaleROPE node sets it (``transformer_options["rope_options"]``,
    read by 0.38.x's Wan ``rope_encode``), or "" when none or the identity. Part of the weights fingerprint:
    scaled or shifted positions attend in other places, so that model's masks are its own (like a LoRA's).
    Options a node sets after the Chorus nodes are not seen here."""
    options = ((getattr(model_patcher, "model_options", None) or {}).get("transformer_options") or {})
    rope = options.get("rope_options")
    if not isinstance(rope, dict):
        return ""
    values = {}
    for key in sorted(rope):
        try:
            values[key] = round(float(rope[key]), 6)
        except (TypeError, ValueError):
            values[key] = repr(rope[key])
    if all(values.get(key, default) == default for key, default in ROPE_IDENTITY.items()) \
            and set(values) <= set(ROPE_IDENTITY):
        return ""
    return f"rope:{values}"


def model_dtypes(diffusion_model) -> dict:
    """Parameter name -> the dtype ComfyUI computes it in, where ComfyUI recorded one that differs from
    the stored tensor's (``<name>_comfy_model_dtype`` on the owning module, set when the model is built;
    ComfyUI 0.38.x). With dynamic VRAM (on by default on NVIDIA GPUs there) the weights stay as the file
    stores them until the model is loaded, and small ones are then cast to that dtype in place: rounding
    the fingerprint's samples to it keeps one fingerprint before and after the first run, and the one a
    host without dynamic VRAM computes (it loads the weights in that dtype). Empty on 0.3.64."""
    dtypes = {}
    for module_name, module in diffusion_model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            dtype = getattr(module, f"{param_name}_comfy_model_dtype", None)
            if isinstance(dtype, torch.dtype) and dtype != param.dtype:
                dtypes[f"{module_name}.{param_name}" if module_name else param_name] = dtype
    return dtypes


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
        extra = patch_summary(model_patcher) + rope_summary(model_patcher)
        return wan_model_info(diffusion_model, fingerprint_extra=extra, fingerprint_exclude=patched_keys,
                              fingerprint_dtypes=model_dtypes(diffusion_model))
    except Exception as exc:  # noqa: BLE001
        return ModelInfo("unknown", type(diffusion_model).__name__, 0, 0, 0, 0, "", False,
                         f"could not inspect the model ({failure_text(exc)})")


def request_image_flags(guider, info: ModelInfo) -> tuple[bool, ...] | None:
    """Per latent frame of the whole video a sampler run denoises, whether the request's input holds an image
    there, read from the run's conditioning: ``guider.conds`` of ComfyUI's ``CFGGuider``, whose positive conds
    carry, once its sampler processed them (before the first model call), the model's ``c_concat``: for Wan I2V
    ``[B, 20, T, H, W]``, the 4 mask channels the model puts after the noise first (:func:`~chorus.engine.
    model_info.mask_frame_flags`), over the whole latent. What a forward in a context window cannot tell: its
    input holds its window's frames. None where it cannot be read (no guider, conds not processed, no
    ``c_concat`` of that layout, a model without the mask channels): the caller reads the forward's own input
    then. One host sync."""
    if info.in_dim != I2V_IN_CHANNELS:
        return None
    conds = getattr(guider, "conds", None)
    positive = conds.get("positive") if isinstance(conds, dict) else None
    for cond in positive if isinstance(positive, (list, tuple)) else ():
        model_conds = cond.get("model_conds") if isinstance(cond, dict) else None
        concat = getattr(model_conds.get("c_concat"), "cond", None) if isinstance(model_conds, dict) else None
        # the model's input is [noise, c_concat]: c_concat holds its channels from the mask's on
        if isinstance(concat, torch.Tensor) and concat.dim() == 5 \
                and concat.shape[1] == I2V_IN_CHANNELS - I2V_MASK_CHANNELS.start:
            return mask_frame_flags(concat[:, :I2V_MASK_CHANNELS.stop - I2V_MASK_CHANNELS.start])
    return None
