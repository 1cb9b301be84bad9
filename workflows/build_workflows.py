"""Build the example workflows of this folder (UI format + API-format twins) from Python dicts.

Run ``python workflows/build_workflows.py`` from the pack root after editing a graph below; the JSON
files it writes are committed, and ``tests/test_workflows_*.py`` check them against the node
definitions of a real ComfyUI (``/object_info``), not against the tables in this file.

Every graph is ComfyUI's standard Wan image-to-video graph (the loaders, encoders and samplers of
ComfyUI's own Wan templates, with their model file names) plus the Chorus II nodes:

    WanImageToVideo (or WanFirstLastFrameToVideo).latent -> ChorusMaskRetrieve.latent  (the request's latent shape)
    LoadImage / CLIPTextEncode (+ CLIPVisionEncode) -> ChorusMaskRetrieve (what the request is)
    ChorusMaskRetrieve.plan -> ChorusSparseSampler.plan      (every diffusion model, same plan)
    ChorusSparseSampler.model -> KSampler / KSamplerAdvanced
    last sampler's LATENT + plan -> ChorusCacheWrite         (runs after sampling)

Output files:
    workflows/<name>.json        UI format (load in the graph editor, or via Browse Templates)
    workflows/api/<name>_api.json  API format for ``POST /prompt`` (kept in a subfolder so that the
                                   template browser, which lists ``workflows/*.json``, shows UI files only)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# Per node type: socket inputs (name, type) in ComfyUI's order (required first, then optional),
# widget names in order (UI-only widgets marked with a leading "!"), outputs (name, type).
# "!control" follows a seed widget (control_after_generate), "!upload" follows LoadImage's image.
NODE_SPECS: dict[str, dict] = {
    "UNETLoader": dict(sockets=[], widgets=["unet_name", "weight_dtype"], outputs=[("MODEL", "MODEL")]),
    "CLIPLoader": dict(sockets=[], widgets=["clip_name", "type", "device"], outputs=[("CLIP", "CLIP")]),
    "VAELoader": dict(sockets=[], widgets=["vae_name"], outputs=[("VAE", "VAE")]),
    "CLIPVisionLoader": dict(sockets=[], widgets=["clip_name"], outputs=[("CLIP_VISION", "CLIP_VISION")]),
    "CLIPVisionEncode": dict(
        sockets=[("clip_vision", "CLIP_VISION"), ("image", "IMAGE")],
        widgets=["crop"],
        outputs=[("CLIP_VISION_OUTPUT", "CLIP_VISION_OUTPUT")],
    ),
    "LoadImage": dict(sockets=[], widgets=["image", "!upload"], outputs=[("IMAGE", "IMAGE"), ("MASK", "MASK")]),
    "LoraLoaderModelOnly": dict(
        sockets=[("model", "MODEL")], widgets=["lora_name", "strength_model"], outputs=[("MODEL", "MODEL")]
    ),
    "ModelSamplingSD3": dict(sockets=[("model", "MODEL")], widgets=["shift"], outputs=[("MODEL", "MODEL")]),
    "CLIPTextEncode": dict(sockets=[("clip", "CLIP")], widgets=["text"], outputs=[("CONDITIONING", "CONDITIONING")]),
    "WanImageToVideo": dict(
        sockets=[
            ("positive", "CONDITIONING"),
            ("negative", "CONDITIONING"),
            ("vae", "VAE"),
            ("clip_vision_output", "CLIP_VISION_OUTPUT"),
            ("start_image", "IMAGE"),
        ],
        widgets=["width", "height", "length", "batch_size"],
        outputs=[("positive", "CONDITIONING"), ("negative", "CONDITIONING"), ("latent", "LATENT")],
    ),
    "WanFirstLastFrameToVideo": dict(
        sockets=[
            ("positive", "CONDITIONING"),
            ("negative", "CONDITIONING"),
            ("vae", "VAE"),
            ("clip_vision_start_image", "CLIP_VISION_OUTPUT"),
            ("clip_vision_end_image", "CLIP_VISION_OUTPUT"),
            ("start_image", "IMAGE"),
            ("end_image", "IMAGE"),
        ],
        widgets=["width", "height", "length", "batch_size"],
        outputs=[("positive", "CONDITIONING"), ("negative", "CONDITIONING"), ("latent", "LATENT")],
    ),
    "Wan22ImageToVideoLatent": dict(
        sockets=[("vae", "VAE"), ("start_image", "IMAGE")],
        widgets=["width", "height", "length", "batch_size"],
        outputs=[("LATENT", "LATENT")],
    ),
    "KSampler": dict(
        sockets=[("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"), ("latent_image", "LATENT")],
        widgets=["seed", "!control", "steps", "cfg", "sampler_name", "scheduler", "denoise"],
        outputs=[("LATENT", "LATENT")],
    ),
    "KSamplerAdvanced": dict(
        sockets=[("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"), ("latent_image", "LATENT")],
        widgets=[
            "add_noise", "noise_seed", "!control", "steps", "cfg", "sampler_name", "scheduler",
            "start_at_step", "end_at_step", "return_with_leftover_noise",
        ],
        outputs=[("LATENT", "LATENT")],
    ),
    # ComfyUI 0.28.2 and later (0.3.64's node has the first six widgets only, and its windows cannot sample Wan I2V)
    "WanContextWindowsManual": dict(
        sockets=[("model", "MODEL")],
        widgets=["context_length", "context_overlap", "context_schedule", "context_stride", "closed_loop",
                 "fuse_method", "freenoise", "retain_first_frame", "split_conds_to_windows"],
        outputs=[("MODEL", "MODEL")],
    ),
    "VAEDecode": dict(sockets=[("samples", "LATENT"), ("vae", "VAE")], widgets=[], outputs=[("IMAGE", "IMAGE")]),
    "CreateVideo": dict(sockets=[("images", "IMAGE"), ("audio", "AUDIO")], widgets=["fps"], outputs=[("VIDEO", "VIDEO")]),
    "SaveVideo": dict(sockets=[("video", "VIDEO")], widgets=["filename_prefix", "format", "codec"], outputs=[]),
    "PreviewImage": dict(sockets=[("images", "IMAGE")], widgets=[], outputs=[]),
    # Frontend-only (virtual) node: not in the API twin.
    "MarkdownNote": dict(sockets=[], widgets=["text"], outputs=[], virtual=True),
    # Chorus II nodes (the node contract; ids and input names are public API).
    "ChorusMaskRetrieve": dict(
        sockets=[
            ("latent", "LATENT"),
            ("start_image", "IMAGE"),
            ("positive", "CONDITIONING"),
            ("clip_vision_output", "CLIP_VISION_OUTPUT"),
            ("end_image", "IMAGE"),
        ],
        widgets=["workspace", "similarity_threshold", "prompt"],
        outputs=[("plan", "CHORUS_PLAN"), ("mask_preview", "IMAGE"), ("info", "STRING")],
    ),
    "ChorusSparseSampler": dict(
        sockets=[("model", "MODEL"), ("plan", "CHORUS_PLAN")],
        widgets=["top_p", "k_min", "refresh_steps", "backend", "verify_threshold", "pooled_tail"],
        outputs=[("model", "MODEL")],
    ),
    "ChorusFeatureReuse": dict(
        sockets=[("model", "MODEL"), ("plan", "CHORUS_PLAN")], widgets=["downsample_share"],
        outputs=[("model", "MODEL")],
    ),
    "ChorusGuidanceBoost": dict(
        sockets=[("model", "MODEL"), ("plan", "CHORUS_PLAN")], widgets=["strength", "image_strength", "cfg_strength"],
        outputs=[("model", "MODEL")],
    ),
    "ChorusCacheWrite": dict(
        sockets=[("latent", "LATENT"), ("plan", "CHORUS_PLAN")], widgets=[], outputs=[("info", "STRING")]
    ),
}

# Display names the graph editor shows (and puts into an API graph's ``_meta.title``) for nodes
# without a title of their own; a type not listed shows its id.
DISPLAY_NAMES = {
    "UNETLoader": "Load Diffusion Model", "CLIPLoader": "Load CLIP", "VAELoader": "Load VAE",
    "CLIPVisionLoader": "Load CLIP Vision", "CLIPVisionEncode": "CLIP Vision Encode", "LoadImage": "Load Image",
    "CLIPTextEncode": "CLIP Text Encode (Prompt)", "KSamplerAdvanced": "KSampler (Advanced)",
    "VAEDecode": "VAE Decode", "CreateVideo": "Create Video", "SaveVideo": "Save Video",
    "PreviewImage": "Preview Image", "WanContextWindowsManual": "Wan Context Windows",
    "ChorusMaskRetrieve": "Chorus Mask Retrieve",
    "ChorusSparseSampler": "Chorus Sparse Sampler", "ChorusFeatureReuse": "Chorus Feature Reuse",
    "ChorusGuidanceBoost": "Chorus Guidance Boost", "ChorusCacheWrite": "Chorus Cache Write",
}

NEGATIVE_PROMPT = (
    "static, blurry details, subtitles, overall gray, worst quality, low quality, JPEG artifacts, "
    "deformed, disfigured, extra fingers, poorly drawn hands, poorly drawn face, messy background"
)

# Chorus defaults (the node contract): similarity threshold 0.9, top_p 0.9, k_min 4, refresh off.
CHORUS_RETRIEVE = {"workspace": "default", "similarity_threshold": 0.9, "prompt": ""}
CHORUS_SPARSE = {"top_p": 0.9, "k_min": 4, "refresh_steps": 0, "backend": "auto", "verify_threshold": 0.0,
                 "pooled_tail": True}


@dataclass
class Node:
    id: int
    type: str
    widgets: dict
    links_in: dict  # socket name -> (src Node, src output index)
    pos: tuple
    size: tuple
    title: str | None = None
    color: str | None = None


@dataclass
class Graph:
    name: str
    nodes: list = field(default_factory=list)

    def add(self, type_, widgets=None, inputs=None, pos=(0, 0), size=(300, 100), title=None, color=None) -> Node:
        spec = NODE_SPECS[type_]
        widgets = dict(widgets or {})
        wanted = [w for w in spec["widgets"] if not w.startswith("!")]
        if sorted(widgets) != sorted(wanted):
            raise ValueError(f"{self.name}: {type_} widgets {sorted(widgets)} != {sorted(wanted)}")
        sockets = {s for s, _ in spec["sockets"]}
        for name in inputs or {}:
            if name not in sockets:
                raise ValueError(f"{self.name}: {type_} has no socket {name!r}")
        node = Node(len(self.nodes) + 1, type_, widgets, dict(inputs or {}), pos, size, title, color)
        self.nodes.append(node)
        return node

    # -- UI format ---------------------------------------------------------------------------
    def to_ui(self) -> dict:
        links = []  # [id, src, src_slot, dst, dst_slot, type]
        out_links: dict[tuple[int, int], list[int]] = {}
        in_link: dict[tuple[int, str], int] = {}
        for node in self.nodes:
            spec = NODE_SPECS[node.type]
            for dst_slot, (sock, typ) in enumerate(spec["sockets"]):
                if sock not in node.links_in:
                    continue
                src, src_slot = node.links_in[sock]
                src_type = NODE_SPECS[src.type]["outputs"][src_slot][1]
                if src_type != typ:
                    raise ValueError(f"{self.name}: {src.type}[{src_slot}] {src_type} -> {node.type}.{sock} {typ}")
                link_id = len(links) + 1
                links.append([link_id, src.id, src_slot, node.id, dst_slot, typ])
                out_links.setdefault((src.id, src_slot), []).append(link_id)
                in_link[(node.id, sock)] = link_id
        order = self._topological_order()
        ui_nodes = []
        for node in self.nodes:
            spec = NODE_SPECS[node.type]
            values = []
            for w in spec["widgets"]:
                if w == "!control":
                    values.append("fixed")
                elif w == "!upload":
                    values.append("image")
                else:
                    values.append(node.widgets[w])
            entry = {
                "id": node.id,
                "type": node.type,
                "pos": list(node.pos),
                "size": list(node.size),
                "flags": {},
                "order": order[node.id],
                "mode": 0,
                "inputs": [
                    {"name": sock, "type": typ, "link": in_link.get((node.id, sock))} for sock, typ in spec["sockets"]
                ],
                "outputs": [
                    {"name": name, "type": typ, "links": out_links.get((node.id, slot), []), "slot_index": slot}
                    for slot, (name, typ) in enumerate(spec["outputs"])
                ],
                "properties": {"Node name for S&R": node.type},
                "widgets_values": values,
            }
            if node.title:
                entry["title"] = node.title
            if node.color:
                entry["color"] = node.color
            ui_nodes.append(entry)
        return {
            "last_node_id": len(self.nodes),
            "last_link_id": len(links),
            "nodes": ui_nodes,
            "links": links,
            "groups": [],
            "config": {},
            "extra": {"ds": {"scale": 0.6, "offset": [40, 40]}},
            "version": 0.4,
        }

    def _topological_order(self) -> dict[int, int]:
        done: dict[int, int] = {}
        pending = list(self.nodes)
        while pending:
            for node in pending:
                if all(src.id in done for src, _ in node.links_in.values()):
                    done[node.id] = len(done)
                    pending.remove(node)
                    break
            else:
                raise ValueError(f"{self.name}: graph has a cycle")
        return done

    # -- API format ---------------------------------------------------------------------------
    def to_api(self) -> dict:
        api = {}
        for node in self.nodes:
            if NODE_SPECS[node.type].get("virtual"):
                continue
            inputs = dict(node.widgets)
            for sock, (src, slot) in node.links_in.items():
                inputs[sock] = [str(src.id), slot]
            title = node.title or DISPLAY_NAMES.get(node.type, node.type)
            api[str(node.id)] = {"inputs": inputs, "class_type": node.type, "_meta": {"title": title}}
        return api


CHORUS_COLOR = "#335"


def _common_text(g: Graph, clip, positive_text, x, y):
    pos = g.add("CLIPTextEncode", {"text": positive_text}, {"clip": (clip, 0)}, pos=(x, y), size=(420, 160),
                title="Positive prompt")
    neg = g.add("CLIPTextEncode", {"text": NEGATIVE_PROMPT}, {"clip": (clip, 0)}, pos=(x, y + 200), size=(420, 140),
                title="Negative prompt")
    return pos, neg


def _chorus_tail(g: Graph, plan_node, final_latent_node, vae, fps, prefix, x, y):
    decode = g.add("VAEDecode", {}, {"samples": (final_latent_node, 0), "vae": (vae, 0)}, pos=(x, y), size=(220, 50))
    video = g.add("CreateVideo", {"fps": fps}, {"images": (decode, 0)}, pos=(x, y + 90), size=(220, 80))
    g.add("SaveVideo", {"filename_prefix": prefix, "format": "auto", "codec": "auto"}, {"video": (video, 0)},
          pos=(x + 260, y), size=(420, 420))
    g.add("ChorusCacheWrite", {}, {"latent": (final_latent_node, 0), "plan": (plan_node, 0)},
          pos=(x, y + 220), size=(240, 60), color=CHORUS_COLOR)
    g.add("PreviewImage", {}, {"images": (plan_node, 1)}, pos=(x, y + 330), size=(240, 240),
          title="Chorus mask preview")


def wan22_a14b_i2v_4step(feature_reuse: bool = False, first_last: bool = False, long_video: bool = False) -> Graph:
    """Wan 2.2 A14B I2V, lightx2v 4-step LoRAs: high-noise expert steps 0-2, low-noise expert 2-4, cfg 1.

    ``feature_reuse``: each expert's model also goes through ChorusFeatureReuse (downsample_share
    0.25) and ChorusGuidanceBoost (strength 0.5, image_strength 0.5, cfg_strength 0), same plan, after ChorusSparseSampler.
    ``first_last``: a start and an end image through WanFirstLastFrameToVideo (ComfyUI's Wan 2.2 14B
    first-last-frame template) instead of WanImageToVideo's start image.
    ``long_video``: 161 frames in ComfyUI's Wan context windows (81 frames overlapping by 30, the node's
    defaults but the static schedule) after ChorusSparseSampler and ChorusFeatureReuse (0.25) on each expert;
    needs ComfyUI 0.28.2 or later.
    """
    if first_last:
        g = Graph("chorus_wan22_a14b_flf2v_4step")
    elif long_video:
        g = Graph("chorus_wan22_a14b_i2v_4step_long")
    else:
        g = Graph("chorus_wan22_a14b_i2v_4step" + ("_feature_reuse" if feature_reuse else ""))
    extra = ("With **ChorusFeatureReuse** (on a hit, redundant regions run at a downsampled resolution) and "
             "**ChorusGuidanceBoost** (reinforces the conditioning on the reused steps) after the sparse "
             "sampler of each expert.\n\n" if feature_reuse else "")
    if first_last:
        extra = ("A start and an end image (**WanFirstLastFrameToVideo**). An entry records which latent frames "
                 "held an image: a first-last-frame request reuses only entries of first-last-frame requests, "
                 "never a start-image-only one (nor the other way round), in the same workspace.\n\n")
    if long_video:
        extra = ("A long video: 161 frames (10 s at 16 fps) sampled in ComfyUI's **Wan Context Windows** of 81 "
                 "frames overlapping by 30, with **ChorusFeatureReuse** on each expert. **Needs ComfyUI 0.28.2 or "
                 "later** (earlier releases cannot sample Wan I2V in windows). A miss records every window; a hit "
                 "runs every window sparse (the later windows, one frame longer, get the maps resampled). Measured "
                 "on an H100 (ComfyUI 0.33.0, 720p in two windows): a hit 3.9x ComfyUI's dense request, 4.7x with "
                 "feature reuse.\n\n")
    title = "First-Last Frame" if first_last else "I2V, long video" if long_video else "I2V"
    g.add("MarkdownNote", {"text": (
        f"## Chorus II — Wan 2.2 A14B {title}, 4-step LoRA (2 + 2 steps, cfg 1)\n\n"
        "Both experts are patched by **ChorusSparseSampler** with the **same plan** from "
        "**ChorusMaskRetrieve**. A miss runs dense attention and records masks; **ChorusCacheWrite** "
        "then stores them. A similar later request (similarity >= threshold) reuses them.\n\n" + extra +
        "Model files (ComfyUI/models/...):\n"
        "- diffusion_models/wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors\n"
        "- diffusion_models/wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors\n"
        "- loras/wan2.2_i2v_lightx2v_4steps_lora_v1_high_noise.safetensors\n"
        "- loras/wan2.2_i2v_lightx2v_4steps_lora_v1_low_noise.safetensors\n"
        "- text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors\n"
        "- vae/wan_2.1_vae.safetensors")}, pos=(0, 1240 if first_last else 880), size=(380, 420))
    high = g.add("UNETLoader", {"unet_name": "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors",
                                "weight_dtype": "default"}, pos=(0, 0), size=(380, 82), title="Load high-noise expert")
    low = g.add("UNETLoader", {"unet_name": "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors",
                               "weight_dtype": "default"}, pos=(0, 130), size=(380, 82), title="Load low-noise expert")
    clip = g.add("CLIPLoader", {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan",
                                "device": "default"}, pos=(0, 260), size=(380, 106))
    vae = g.add("VAELoader", {"vae_name": "wan_2.1_vae.safetensors"}, pos=(0, 410), size=(380, 58))
    image = g.add("LoadImage", {"image": "example.png"}, pos=(0, 520), size=(320, 320), title="Start image")
    lora_high = g.add("LoraLoaderModelOnly", {"lora_name": "wan2.2_i2v_lightx2v_4steps_lora_v1_high_noise.safetensors",
                                              "strength_model": 1.0}, {"model": (high, 0)}, pos=(420, 0), size=(380, 82))
    lora_low = g.add("LoraLoaderModelOnly", {"lora_name": "wan2.2_i2v_lightx2v_4steps_lora_v1_low_noise.safetensors",
                                             "strength_model": 1.0}, {"model": (low, 0)}, pos=(420, 130), size=(380, 82))
    shift_high = g.add("ModelSamplingSD3", {"shift": 5.0}, {"model": (lora_high, 0)}, pos=(840, 0), size=(240, 58))
    shift_low = g.add("ModelSamplingSD3", {"shift": 5.0}, {"model": (lora_low, 0)}, pos=(840, 130), size=(240, 58))
    pos, neg = _common_text(g, clip, "The white dragon warrior stands still, eyes full of determination. "
                            "The camera slowly circles around the warrior.", 420, 260)
    if first_last:
        end = g.add("LoadImage", {"image": "example.png"}, pos=(0, 880), size=(320, 320), title="End image")
        i2v = g.add("WanFirstLastFrameToVideo", {"width": 640, "height": 640, "length": 81, "batch_size": 1},
                    {"positive": (pos, 0), "negative": (neg, 0), "vae": (vae, 0), "start_image": (image, 0),
                     "end_image": (end, 0)}, pos=(420, 620), size=(300, 230))
    else:
        i2v = g.add("WanImageToVideo", {"width": 640, "height": 640, "length": 161 if long_video else 81,
                                         "batch_size": 1},
                    {"positive": (pos, 0), "negative": (neg, 0), "vae": (vae, 0), "start_image": (image, 0)},
                    pos=(420, 620), size=(300, 190))
    request = {"latent": (i2v, 2), "start_image": (image, 0), "positive": (pos, 0)}
    if first_last:
        request["end_image"] = (end, 0)
    retrieve = g.add("ChorusMaskRetrieve", CHORUS_RETRIEVE, request, pos=(880, 260), size=(320, 240),
                     color=CHORUS_COLOR)
    sparse_high = g.add("ChorusSparseSampler", CHORUS_SPARSE, {"model": (shift_high, 0), "plan": (retrieve, 0)},
                        pos=(1240, 0), size=(300, 160), title="ChorusSparseSampler (high-noise)", color=CHORUS_COLOR)
    sparse_low = g.add("ChorusSparseSampler", CHORUS_SPARSE, {"model": (shift_low, 0), "plan": (retrieve, 0)},
                       pos=(1240, 200), size=(300, 160), title="ChorusSparseSampler (low-noise)", color=CHORUS_COLOR)
    model_high, model_low = sparse_high, sparse_low
    if feature_reuse or long_video:
        model_high = g.add("ChorusFeatureReuse", {"downsample_share": 0.25},
                           {"model": (sparse_high, 0), "plan": (retrieve, 0)}, pos=(1240, 420), size=(300, 80),
                           title="ChorusFeatureReuse (high-noise)", color=CHORUS_COLOR)
        model_low = g.add("ChorusFeatureReuse", {"downsample_share": 0.25},
                          {"model": (sparse_low, 0), "plan": (retrieve, 0)}, pos=(1240, 560), size=(300, 80),
                          title="ChorusFeatureReuse (low-noise)", color=CHORUS_COLOR)
    if feature_reuse:
        model_high = g.add("ChorusGuidanceBoost", {"strength": 0.5, "image_strength": 0.5, "cfg_strength": 0.0},
                           {"model": (model_high, 0), "plan": (retrieve, 0)}, pos=(1240, 700), size=(300, 130),
                           title="ChorusGuidanceBoost (high-noise)", color=CHORUS_COLOR)
        model_low = g.add("ChorusGuidanceBoost", {"strength": 0.5, "image_strength": 0.5, "cfg_strength": 0.0},
                          {"model": (model_low, 0), "plan": (retrieve, 0)}, pos=(1240, 860), size=(300, 130),
                          title="ChorusGuidanceBoost (low-noise)", color=CHORUS_COLOR)
    if long_video:
        windows = {"context_length": 81, "context_overlap": 30, "context_schedule": "standard_static",
                   "context_stride": 1, "closed_loop": False, "fuse_method": "pyramid", "freenoise": True,
                   "retain_first_frame": False, "split_conds_to_windows": False}
        model_high = g.add("WanContextWindowsManual", windows, {"model": (model_high, 0)}, pos=(1240, 700),
                           size=(300, 250), title="Wan Context Windows (high-noise)")
        model_low = g.add("WanContextWindowsManual", windows, {"model": (model_low, 0)}, pos=(1240, 980),
                          size=(300, 250), title="Wan Context Windows (low-noise)")
    sample_high = g.add("KSamplerAdvanced", {
        "add_noise": "enable", "noise_seed": 42, "steps": 4, "cfg": 1.0, "sampler_name": "euler",
        "scheduler": "simple", "start_at_step": 0, "end_at_step": 2, "return_with_leftover_noise": "enable"},
        {"model": (model_high, 0), "positive": (i2v, 0), "negative": (i2v, 1), "latent_image": (i2v, 2)},
        pos=(1580, 0), size=(300, 340), title="KSamplerAdvanced (high-noise, steps 0-2)")
    sample_low = g.add("KSamplerAdvanced", {
        "add_noise": "disable", "noise_seed": 0, "steps": 4, "cfg": 1.0, "sampler_name": "euler",
        "scheduler": "simple", "start_at_step": 2, "end_at_step": 4, "return_with_leftover_noise": "disable"},
        {"model": (model_low, 0), "positive": (i2v, 0), "negative": (i2v, 1), "latent_image": (sample_high, 0)},
        pos=(1920, 0), size=(300, 340), title="KSamplerAdvanced (low-noise, steps 2-4)")
    prefix = "video/chorus_wan22_a14b" + ("_flf2v" if first_last else "_feature_reuse" if feature_reuse
                                          else "_long" if long_video else "")
    _chorus_tail(g, retrieve, sample_low, vae, 16.0, prefix, 1580, 400)
    return g


def wan22_ti2v_5b() -> Graph:
    """Wan 2.2 TI2V 5B with a start image (Wan22ImageToVideoLatent), 20 steps uni_pc, cfg 5."""
    g = Graph("chorus_wan22_ti2v_5b")
    g.add("MarkdownNote", {"text": (
        "## Chorus II — Wan 2.2 TI2V 5B (image to video)\n\n"
        "**ChorusMaskRetrieve** looks the request up in the workspace; **ChorusSparseSampler** "
        "runs reused masks on a hit and records them on a miss; **ChorusCacheWrite** stores them.\n\n"
        "Model files (ComfyUI/models/...):\n"
        "- diffusion_models/wan2.2_ti2v_5B_fp16.safetensors\n"
        "- text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors\n"
        "- vae/wan2.2_vae.safetensors")}, pos=(0, 750), size=(380, 300))
    unet = g.add("UNETLoader", {"unet_name": "wan2.2_ti2v_5B_fp16.safetensors", "weight_dtype": "default"},
                 pos=(0, 0), size=(380, 82))
    clip = g.add("CLIPLoader", {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan",
                                "device": "default"}, pos=(0, 130), size=(380, 106))
    vae = g.add("VAELoader", {"vae_name": "wan2.2_vae.safetensors"}, pos=(0, 280), size=(380, 58))
    image = g.add("LoadImage", {"image": "example.png"}, pos=(0, 390), size=(320, 320), title="Start image")
    shift = g.add("ModelSamplingSD3", {"shift": 8.0}, {"model": (unet, 0)}, pos=(420, 0), size=(240, 58))
    pos, neg = _common_text(g, clip, "A street musician plays guitar in a retro subway station; "
                            "the camera slowly moves right.", 420, 120)
    latent = g.add("Wan22ImageToVideoLatent", {"width": 1280, "height": 704, "length": 121, "batch_size": 1},
                   {"vae": (vae, 0), "start_image": (image, 0)}, pos=(420, 520), size=(300, 150))
    retrieve = g.add("ChorusMaskRetrieve", CHORUS_RETRIEVE,
                     {"latent": (latent, 0), "start_image": (image, 0), "positive": (pos, 0)},
                     pos=(880, 120), size=(320, 220), color=CHORUS_COLOR)
    sparse = g.add("ChorusSparseSampler", CHORUS_SPARSE, {"model": (shift, 0), "plan": (retrieve, 0)},
                   pos=(1240, 0), size=(300, 160), color=CHORUS_COLOR)
    sample = g.add("KSampler", {"seed": 42, "steps": 20, "cfg": 5.0, "sampler_name": "uni_pc",
                                "scheduler": "simple", "denoise": 1.0},
                   {"model": (sparse, 0), "positive": (pos, 0), "negative": (neg, 0), "latent_image": (latent, 0)},
                   pos=(1580, 0), size=(300, 270))
    _chorus_tail(g, retrieve, sample, vae, 24.0, "video/chorus_wan22_ti2v_5b", 1580, 330)
    return g


def wan21_i2v_14b() -> Graph:
    """Wan 2.1 I2V 14B 480p with CLIP vision, 20 steps uni_pc, cfg 6."""
    g = Graph("chorus_wan21_i2v_14b")
    g.add("MarkdownNote", {"text": (
        "## Chorus II — Wan 2.1 I2V 14B (480p)\n\n"
        "**ChorusMaskRetrieve** embeds the request from the start image, the positive conditioning and "
        "the CLIP-vision output already in the graph (no second model is loaded).\n\n"
        "Model files (ComfyUI/models/...):\n"
        "- diffusion_models/wan2.1_i2v_480p_14B_fp16.safetensors\n"
        "- text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors\n"
        "- clip_vision/clip_vision_h.safetensors\n"
        "- vae/wan_2.1_vae.safetensors")}, pos=(0, 860), size=(380, 320))
    unet = g.add("UNETLoader", {"unet_name": "wan2.1_i2v_480p_14B_fp16.safetensors", "weight_dtype": "default"},
                 pos=(0, 0), size=(380, 82))
    clip = g.add("CLIPLoader", {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan",
                                "device": "default"}, pos=(0, 130), size=(380, 106))
    vae = g.add("VAELoader", {"vae_name": "wan_2.1_vae.safetensors"}, pos=(0, 280), size=(380, 58))
    clip_vision = g.add("CLIPVisionLoader", {"clip_name": "clip_vision_h.safetensors"}, pos=(0, 390), size=(380, 58))
    image = g.add("LoadImage", {"image": "example.png"}, pos=(0, 500), size=(320, 320), title="Start image")
    vision = g.add("CLIPVisionEncode", {"crop": "none"}, {"clip_vision": (clip_vision, 0), "image": (image, 0)},
                   pos=(420, 500), size=(260, 80))
    shift = g.add("ModelSamplingSD3", {"shift": 8.0}, {"model": (unet, 0)}, pos=(420, 0), size=(240, 58))
    pos, neg = _common_text(g, clip, "A cute fox turns around and looks at the camera, soft daylight.", 420, 120)
    i2v = g.add("WanImageToVideo", {"width": 512, "height": 512, "length": 33, "batch_size": 1},
                {"positive": (pos, 0), "negative": (neg, 0), "vae": (vae, 0),
                 "clip_vision_output": (vision, 0), "start_image": (image, 0)},
                pos=(420, 640), size=(300, 190))
    retrieve = g.add("ChorusMaskRetrieve", CHORUS_RETRIEVE,
                     {"latent": (i2v, 2), "start_image": (image, 0), "positive": (pos, 0),
                      "clip_vision_output": (vision, 0)},
                     pos=(880, 120), size=(320, 240), color=CHORUS_COLOR)
    sparse = g.add("ChorusSparseSampler", CHORUS_SPARSE, {"model": (shift, 0), "plan": (retrieve, 0)},
                   pos=(1240, 0), size=(300, 160), color=CHORUS_COLOR)
    sample = g.add("KSampler", {"seed": 42, "steps": 20, "cfg": 6.0, "sampler_name": "uni_pc",
                                "scheduler": "simple", "denoise": 1.0},
                   {"model": (sparse, 0), "positive": (i2v, 0), "negative": (i2v, 1), "latent_image": (i2v, 2)},
                   pos=(1580, 0), size=(300, 270))
    _chorus_tail(g, retrieve, sample, vae, 16.0, "video/chorus_wan21_i2v_14b", 1580, 330)
    return g


def wan22_a14b_i2v_4step_feature_reuse() -> Graph:
    return wan22_a14b_i2v_4step(feature_reuse=True)


def wan22_a14b_flf2v_4step() -> Graph:
    return wan22_a14b_i2v_4step(first_last=True)


def wan22_a14b_i2v_4step_long() -> Graph:
    return wan22_a14b_i2v_4step(long_video=True)


WORKFLOWS = (wan22_a14b_i2v_4step, wan22_a14b_i2v_4step_feature_reuse, wan22_a14b_flf2v_4step,
             wan22_a14b_i2v_4step_long, wan22_ti2v_5b, wan21_i2v_14b)


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    os.makedirs(os.path.join(here, "api"), exist_ok=True)
    for build in WORKFLOWS:
        graph = build()
        with open(os.path.join(here, f"{graph.name}.json"), "w", encoding="utf-8") as f:
            json.dump(graph.to_ui(), f, indent=2, ensure_ascii=False)
            f.write("\n")
        with open(os.path.join(here, "api", f"{graph.name}_api.json"), "w", encoding="utf-8") as f:
            json.dump(graph.to_api(), f, indent=2, ensure_ascii=False)
            f.write("\n")
        print(f"wrote {graph.name}.json and api/{graph.name}_api.json ({len(graph.nodes)} nodes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
