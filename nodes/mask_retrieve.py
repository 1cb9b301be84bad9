"""ChorusMaskRetrieve: embed the request, search the workspace, output a CHORUS_PLAN (hit or miss)."""

from __future__ import annotations

import hashlib

import torch
from comfy_api.latest import io

from ..cache_store.embedders import ComfyGraphEmbedder
from ..engine import Plan, mask_heatmap, placeholder, retrieve_plan
from ..engine.maps import unpacked_map
from ..kernels.masks import density
from .common import CATEGORY, ChorusPlan, node_text, number_input, open_workspace, search_aliases, ui_text

TEXT_WEIGHT = 0.5
EMBEDDER = ComfyGraphEmbedder(text_weight=TEXT_WEIGHT)
PREVIEW_MAPS = 32


def _image_hash(image) -> str | None:
    if not isinstance(image, torch.Tensor) or image.dim() == 0:
        return None  # no usable image: the embedding step says why
    data = image[:1].detach().to(torch.float32).cpu().contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def request_embedding(positive=None, start_image=None, prompt=None, clip_vision_output=None, end_image=None):
    """Joint text+image embedding (``cache_store.embedders.ComfyGraphEmbedder``, text weight 0.5).

    Text part: the positive CONDITIONING tensor (mean over tokens), else the prompt string (hashed
    n-grams). Image part: the CLIP_VISION_OUTPUT when given, else the start image pixels (thumbnail),
    with a first-last-frame request's ``end_image`` thumbnail joined to it. Raises ``ValueError`` when
    neither part is given.
    """
    image = start_image if isinstance(start_image, torch.Tensor) else None
    end = end_image if isinstance(end_image, torch.Tensor) else None
    empty = positive is None or (isinstance(positive, (list, tuple, str)) and not positive)
    conditioning = None if empty else positive  # a tensor is passed on (never truth-tested): the embedder checks it
    return EMBEDDER.embed(image=image, text=prompt or None, conditioning=conditioning,
                          clip_vision_output=clip_vision_output, end_image=end)


def plan_density(plan: Plan) -> tuple[float | None, list]:
    """Mean density of (up to PREVIEW_MAPS evenly chosen) maps of a hit, and those maps."""
    if not plan.is_hit or not plan.masks:
        return None, []
    keys = sorted(plan.masks)
    stride = max(1, len(keys) // PREVIEW_MAPS)
    maps = [unpacked_map(plan.masks[key]) for key in keys[::stride][:PREVIEW_MAPS]]
    return sum(density(m) for m in maps) / len(maps), maps


class ChorusMaskRetrieve(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusMaskRetrieve",
            display_name="Chorus Mask Retrieve",
            category=CATEGORY,
            **search_aliases("attention mask cache", "sparse attention cache lookup"),
            description="Find the most similar earlier request in a cache workspace and plan to reuse its "
                        "sparse attention masks (hit), or to record new ones (miss).",
            inputs=[
                io.Latent.Input("latent", tooltip="The latent to be sampled (only its shape is used)."),
                io.String.Input("workspace", default="default",
                                tooltip="Cache workspace name (letters, digits, . _ -), under ComfyUI's user "
                                        "directory /chorus. Created when missing."),
                io.Float.Input("similarity_threshold", default=0.9, min=0.0, max=1.0, step=0.01,
                               tooltip="Minimum cosine similarity of the request embedding for a hit."),
                io.Image.Input("start_image", optional=True,
                               tooltip="Start image of the video (image part of the embedding when no CLIP "
                                       "vision output is given)."),
                io.Conditioning.Input("positive", optional=True,
                                      tooltip="Positive conditioning (text part of the embedding)."),
                io.String.Input("prompt", optional=True, multiline=True, default="",
                                tooltip="Prompt text: text part of the embedding when no conditioning is "
                                        "connected; stored with a new entry."),
                io.ClipVisionOutput.Input("clip_vision_output", optional=True,
                                          tooltip="CLIP vision output of the start image (image part of the "
                                                  "embedding when given)."),
                io.Image.Input("end_image", optional=True,
                               tooltip="End image of a first-last-frame video (WanFirstLastFrameToVideo): joins "
                                       "the image part of the embedding."),
            ],
            outputs=[
                ChorusPlan.Output("plan", display_name="plan"),
                io.Image.Output("mask_preview", display_name="mask_preview",
                                tooltip="Heatmap of the reused masks (query blocks down, key blocks across); "
                                        "gray on a miss."),
                io.String.Output("info", display_name="info"),
            ],
            not_idempotent=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")  # depends on the cache on disk: run every time

    @classmethod
    def execute(cls, latent, workspace="default", similarity_threshold=0.9, start_image=None, positive=None,
                prompt="", clip_vision_output=None, end_image=None) -> io.NodeOutput:
        samples = latent.get("samples") if isinstance(latent, dict) else None
        shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else None
        if shape is None or len(shape) != 5:
            plan = Plan.miss(f"miss: the latent must be a video latent [B, C, T, H, W], got {shape}; "
                             "dense attention, nothing will be written", record=False)
            return cls._out(plan)
        if prompt is not None and not isinstance(prompt, str):
            plan = Plan.miss(f"miss: the prompt input must be text, got {type(prompt).__name__}; dense attention, "
                             "nothing will be written", latent_shape=shape, record=False)
            return cls._out(plan)
        try:
            similarity_threshold = number_input(similarity_threshold, "similarity_threshold")
        except ValueError as exc:
            plan = Plan.miss(f"miss: {exc}; dense attention, nothing will be written", latent_shape=shape, record=False)
            return cls._out(plan)
        meta = {"prompt": (prompt or "")[:2000], "image_hash": _image_hash(start_image),
                "embedder": EMBEDDER.name, "text_weight": TEXT_WEIGHT,
                "image_source": "clip_vision" if clip_vision_output is not None else
                                ("pixels" if start_image is not None else None)}
        if end_image is not None:
            meta["end_image_hash"] = _image_hash(end_image)
        try:
            embedding = request_embedding(positive, start_image, prompt, clip_vision_output, end_image)
        except (ValueError, TypeError) as exc:
            plan = Plan.miss(f"miss: no request embedding ({exc}); connect start_image and/or positive. "
                             "Dense attention, nothing will be written", latent_shape=shape, record=False)
            return cls._out(plan)
        try:
            ws = open_workspace(workspace)
        except (ValueError, OSError) as exc:
            plan = Plan.miss(f"miss: workspace {workspace!r} unusable ({exc}); dense attention, nothing will be "
                             "written", embedding=embedding, latent_shape=shape, request_meta=meta, record=False)
            return cls._out(plan)
        try:
            plan = retrieve_plan(ws, embedding, shape, similarity_threshold=similarity_threshold, request_meta=meta,
                                 workspace_name=workspace)
        except ValueError as exc:
            plan = Plan.miss(f"miss: {exc}", embedding=embedding, latent_shape=shape, request_meta=meta,
                             workspace_name=workspace)
        return cls._out(plan)

    @classmethod
    def _out(cls, plan: Plan) -> io.NodeOutput:
        density, maps = plan_density(plan)
        preview = placeholder()
        if maps:
            try:
                preview = mask_heatmap(maps)
            except ValueError:
                pass
        if plan.is_hit:
            info = (f"HIT entry {plan.entry_id} | similarity {plan.similarity:.3f} | "
                    f"stored density {density:.1%} | {len(plan.masks)} maps")
        else:
            message = plan.message
            info = "MISS" + (message[4:] if message.lower().startswith("miss") else f": {message}")
        info = node_text(info)
        return io.NodeOutput(plan, preview, info, ui=ui_text(info))
