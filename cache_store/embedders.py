"""Embedders for the joint text+image request embedding used as the cache key.

Every embedder returns a float32 numpy vector ``[dim]`` from :meth:`embed(image=..., text=...)`.
The joint embedding is the concatenation ``[sqrt(w) * t, sqrt(1 - w) * i]`` of the L2-normalised
text part ``t`` and image part ``i`` with ``w = text_weight``: for two requests with both parts
present, its cosine similarity is exactly ``w * cos(t, t') + (1 - w) * cos(i, i')``. A missing part
is a zero block (the vector is then not unit-norm; the index normalises it, so a request with only
text matches on text alone). At least one part must be given (``ValueError``).

Images are ComfyUI ``IMAGE`` tensors: float ``[B, H, W, C]`` in ``[0, 1]`` (or ``[H, W, C]``); the
first batch item is the start image.

* :class:`OpenClipEmbedder` -- open_clip image and text towers built with ``pretrained=None`` and
  loaded from a LOCAL checkpoint file (safetensors, or a torch state dict read with
  ``weights_only=True``). Nothing is downloaded; the tokenizer is open_clip's bundled BPE.
* :class:`ComfyGraphEmbedder` -- tensors already in a ComfyUI graph, so no second model is loaded:
  text from ``CONDITIONING`` (``[[cond [B, tokens, dim], {...}], ...]``: mean over tokens of the
  first item) or a prompt string (hashed n-grams); image from ``CLIP_VISION_OUTPUT``
  (``image_embeds`` ``[B, D]``, else the mean of ``penultimate_hidden_states`` ``[B, N, D]``), else
  the raw start image pixels (thumbnail). Each pooled vector is projected to ``part_dim`` by a
  fixed orthonormal matrix drawn from a generator seeded with ``(seed, input dim)``, so the same
  input gives the same embedding in every process and on every machine (QR in float64 on CPU).
* :class:`HashEmbedder` -- small, deterministic, dependency-free: image = mean-centred
  ``thumb x thumb`` RGB thumbnail (area downsampling); text = signed hashed character 3-grams and
  words (blake2b). For tests and as a last resort.

Parts from different sources (CLIP vision vs pixels) are not comparable: keep one embedder per
workspace, and put :attr:`name` into the signature or the workspace name.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from pathlib import Path

import numpy as np
import torch

LOG = logging.getLogger(__name__)

__all__ = ["joint_embedding", "HashEmbedder", "ComfyGraphEmbedder", "OpenClipEmbedder", "orthonormal_projection"]


def _unit(x) -> np.ndarray | None:
    if x is None:
        return None
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.isfinite(x).all():
        raise ValueError("embedding part holds NaN or inf")
    n = np.linalg.norm(x)
    return None if n == 0 else x / n


def joint_embedding(text_vec, image_vec, text_weight: float, text_dim: int, image_dim: int) -> np.ndarray:
    """``[sqrt(w) * unit(text), sqrt(1 - w) * unit(image)]`` as float32 ``[text_dim + image_dim]``."""
    if not 0.0 <= float(text_weight) <= 1.0:
        raise ValueError(f"text_weight must be in [0, 1], got {text_weight}")
    t, i = _unit(text_vec), _unit(image_vec)
    if t is None and i is None:
        raise ValueError("give a text and/or an image (both parts are empty or zero)")
    out = np.zeros(text_dim + image_dim, dtype=np.float64)
    if t is not None:
        if t.size != text_dim:
            raise ValueError(f"text part has dim {t.size}, expected {text_dim}")
        out[:text_dim] = math.sqrt(text_weight) * t
    if i is not None:
        if i.size != image_dim:
            raise ValueError(f"image part has dim {i.size}, expected {image_dim}")
        out[text_dim:] = math.sqrt(1.0 - text_weight) * i
    if not out.any():
        raise ValueError("the weighted parts are all zero (text_weight excludes the only part given)")
    return out.astype(np.float32)


def _as_tensor(value, what: str) -> torch.Tensor:
    """``torch.as_tensor(value)``, or ``ValueError`` naming ``what`` (None, strings, ragged lists...)."""
    try:
        return torch.as_tensor(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be a tensor, got {type(value).__name__} ({exc})") from exc


def _first_image(image) -> torch.Tensor:
    """ComfyUI IMAGE ``[B, H, W, C]`` / ``[H, W, C]`` -> float32 ``[1, C, H, W]`` of the first item."""
    image = _as_tensor(image, "image")
    if image.dim() == 3:
        image = image.unsqueeze(0)
    if image.dim() != 4 or min(image.shape[:3]) < 1 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"image must be [B, H, W, C] with B, H, W >= 1 and C in (1, 3, 4), got {tuple(image.shape)}")
    img = image[:1, ..., :3].float()
    if img.shape[-1] == 1:
        img = img.expand(-1, -1, -1, 3)
    if not torch.isfinite(img).all():
        raise ValueError("image holds NaN or inf")
    return img.permute(0, 3, 1, 2).contiguous()


def thumbnail_vector(image, thumb: int = 8) -> np.ndarray:
    """Mean-centred RGB area-thumbnail of the first image, float64 ``[3 * thumb * thumb]``."""
    img = _first_image(image).double()
    small = torch.nn.functional.adaptive_avg_pool2d(img, (thumb, thumb)).reshape(-1).numpy()
    return small - small.mean()


def hashed_text_vector(text: str, dim: int = 256) -> np.ndarray:
    """Signed feature hashing of lowercase words and character 3-grams (blake2b), float64 ``[dim]``."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    norm = " ".join(re.findall(r"\w+", text.lower()))
    vec = np.zeros(dim, dtype=np.float64)
    feats = [f"w:{w}" for w in norm.split()] + [f"c:{norm[i:i + 3]}" for i in range(max(0, len(norm) - 2))]
    for feat in feats:
        h = hashlib.blake2b(feat.encode(), digest_size=8).digest()
        idx = int.from_bytes(h[:4], "little") % dim
        vec[idx] += 1.0 if h[4] & 1 else -1.0
    return vec


def orthonormal_projection(in_dim: int, out_dim: int, seed: int = 0) -> torch.Tensor:
    """Fixed float32 ``[in_dim, out_dim]`` matrix with orthonormal columns (rows when in < out).

    Drawn from ``torch.Generator().manual_seed(seed * 1_000_003 + in_dim)`` and orthonormalised by a
    float64 QR on CPU, so it is the same everywhere for the same ``(in_dim, out_dim, seed)``.
    """
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(in_dim))
    g = torch.randn(max(in_dim, out_dim), min(in_dim, out_dim), generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # fix QR's sign ambiguity
    return (q if in_dim >= out_dim else q.T).float()


class HashEmbedder:
    """Deterministic test embedder: thumbnail image part + hashed n-gram text part (module docstring)."""

    def __init__(self, *, text_weight: float = 0.5, thumb: int = 8, text_dim: int = 256):
        self.text_weight = float(text_weight)
        self.thumb = int(thumb)
        self.text_dim = int(text_dim)
        self.image_dim = 3 * self.thumb * self.thumb
        self.dim = self.text_dim + self.image_dim
        self.name = f"hash-t{self.text_dim}-i{self.thumb}"

    def embed(self, image=None, text=None) -> np.ndarray:
        t = hashed_text_vector(text, self.text_dim) if text else None
        i = thumbnail_vector(image, self.thumb) if image is not None else None
        return joint_embedding(t, i, self.text_weight, self.text_dim, self.image_dim)


class ComfyGraphEmbedder:
    """Embedding from tensors already in a ComfyUI graph (module docstring). ``part_dim`` per part."""

    def __init__(self, *, text_weight: float = 0.5, part_dim: int = 256, seed: int = 0, thumb: int = 16):
        self.text_weight = float(text_weight)
        self.part_dim = int(part_dim)
        self.seed = int(seed)
        self.thumb = int(thumb)
        self.dim = 2 * self.part_dim
        self.name = f"comfy-graph-p{self.part_dim}-s{self.seed}"
        self._projections: dict[int, torch.Tensor] = {}

    def _project(self, vec: torch.Tensor) -> np.ndarray:
        vec = vec.detach().float().cpu().reshape(-1)
        if not torch.isfinite(vec).all():
            raise ValueError("conditioning / CLIP-vision tensor holds NaN or inf")
        proj = self._projections.get(vec.numel())
        if proj is None:
            proj = self._projections[vec.numel()] = orthonormal_projection(vec.numel(), self.part_dim, self.seed)
        return (vec @ proj).double().numpy()

    @staticmethod
    def pool_conditioning(conditioning) -> torch.Tensor:
        """Mean over tokens of the first item of ComfyUI CONDITIONING -> ``[dim]``."""
        if isinstance(conditioning, torch.Tensor):
            cond = conditioning
        else:
            try:
                cond = conditioning[0][0]
            except (TypeError, IndexError, KeyError) as exc:
                raise ValueError("conditioning must be ComfyUI CONDITIONING [[tensor, dict], ...] or a tensor") from exc
        cond = _as_tensor(cond, "conditioning tensor")
        if cond.dim() == 2:
            cond = cond.unsqueeze(0)
        if cond.dim() != 3 or cond.shape[0] < 1 or cond.shape[1] < 1 or cond.shape[2] < 1:
            raise ValueError(f"conditioning tensor must be [B, tokens, dim], none empty, got {tuple(cond.shape)}")
        return cond[0].float().mean(0)

    @staticmethod
    def pool_clip_vision(clip_vision_output) -> torch.Tensor:
        """``image_embeds[0]`` of a CLIP_VISION_OUTPUT, else mean of ``penultimate_hidden_states[0]``."""
        get = clip_vision_output.get if isinstance(clip_vision_output, dict) else (
            lambda name, default=None: getattr(clip_vision_output, name, default))
        embeds = get("image_embeds", None)
        if embeds is not None:
            embeds = _as_tensor(embeds, "CLIP vision image_embeds")
            if embeds.numel() == 0:
                raise ValueError(f"CLIP vision image_embeds is empty ({tuple(embeds.shape)})")
            return (embeds[0] if embeds.dim() > 1 else embeds).float().reshape(-1)
        hidden = get("penultimate_hidden_states", None)
        if hidden is not None:
            hidden = _as_tensor(hidden, "CLIP vision penultimate_hidden_states")
            if hidden.dim() == 2:
                hidden = hidden.unsqueeze(0)
            if hidden.dim() != 3 or 0 in hidden.shape:
                raise ValueError(f"CLIP vision penultimate_hidden_states must be [B, tokens, dim], none empty, "
                                 f"got {tuple(hidden.shape)}")
            return hidden[0].float().mean(0)
        raise ValueError("CLIP_VISION_OUTPUT has neither image_embeds nor penultimate_hidden_states")

    def embed(self, image=None, text=None, *, conditioning=None, clip_vision_output=None,
              end_image=None) -> np.ndarray:
        """Text part from ``conditioning`` (else ``text``); image part from ``clip_vision_output``
        (else ``image`` pixels). ``end_image`` (a first-last-frame request's end image): its pixel thumbnail
        joins the image part, the mean of the start image's and its own unit vectors (alone where there is no
        other image part), so requests whose end images differ are less similar."""
        t = i = None
        if conditioning is not None:
            t = self._project(self.pool_conditioning(conditioning))
        elif text:
            t = self._project(torch.from_numpy(hashed_text_vector(text, 1024)))
        if clip_vision_output is not None:
            i = self._project(self.pool_clip_vision(clip_vision_output))
        elif image is not None:
            i = self._pixels(image)
        if end_image is not None:
            parts = [u for u in (_unit(i), _unit(self._pixels(end_image))) if u is not None]  # a uniform image: none
            i = sum(parts) if parts else None
        return joint_embedding(t, i, self.text_weight, self.part_dim, self.part_dim)

    def _pixels(self, image) -> np.ndarray:
        """An image part from pixels: the projected thumbnail (:func:`thumbnail_vector`)."""
        return self._project(torch.from_numpy(thumbnail_vector(image, self.thumb)))


OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def load_state_dict(path) -> dict:
    """State dict from a local ``.safetensors`` file, or a torch file read with ``weights_only=True``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path} does not hold a state dict")
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


class OpenClipEmbedder:
    """open_clip image and text towers from a local checkpoint file (never downloads).

    ``model_name``: an open_clip architecture (e.g. ``"ViT-B-32"``), built with ``pretrained=None``;
    ``checkpoint``: its state dict file (strict load: a wrong architecture raises ``ValueError``).
    Images are resized (bicubic, antialiased) to the tower's input size and normalised with the
    OpenAI CLIP mean/std; texts go through open_clip's bundled tokenizer.
    """

    def __init__(self, model_name: str, checkpoint, *, text_weight: float = 0.5, device="cpu",
                 image_size: int | None = None, mean=OPENAI_MEAN, std=OPENAI_STD):
        import open_clip

        self.model_name = model_name
        self.text_weight = float(text_weight)
        self.device = torch.device(device)
        kwargs = {"force_image_size": image_size} if image_size else {}
        model = open_clip.create_model(model_name, pretrained=None, **kwargs)
        try:
            model.load_state_dict(load_state_dict(checkpoint), strict=True)
        except RuntimeError as exc:
            raise ValueError(f"checkpoint {checkpoint} does not fit open_clip {model_name}: {exc}") from exc
        self.model = model.eval().to(self.device)
        self.tokenizer = open_clip.get_tokenizer(model_name)
        size = self.model.visual.image_size
        self.image_size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        self.mean = torch.tensor(mean).view(1, 3, 1, 1)
        self.std = torch.tensor(std).view(1, 3, 1, 1)
        self.part_dim = int(self.model.text_projection.shape[-1]) if hasattr(self.model, "text_projection") \
            and isinstance(self.model.text_projection, torch.Tensor) else int(self.model.visual.output_dim)
        self.dim = 2 * self.part_dim
        self.name = f"open_clip-{model_name}-{Path(checkpoint).name}"

    @torch.inference_mode()
    def image_features(self, image) -> np.ndarray:
        img = _first_image(image).clamp(0, 1)
        img = torch.nn.functional.interpolate(img, size=self.image_size, mode="bicubic", antialias=True,
                                              align_corners=False).clamp(0, 1)
        img = ((img - self.mean) / self.std).to(self.device)
        return self.model.encode_image(img)[0].float().cpu().double().numpy()

    @torch.inference_mode()
    def text_features(self, text: str) -> np.ndarray:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        tokens = self.tokenizer([text]).to(self.device)
        return self.model.encode_text(tokens)[0].float().cpu().double().numpy()

    def embed(self, image=None, text=None) -> np.ndarray:
        t = self.text_features(text) if text else None
        i = self.image_features(image) if image is not None else None
        return joint_embedding(t, i, self.text_weight, self.part_dim, self.part_dim)
