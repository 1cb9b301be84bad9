"""Workload families of similar requests, built from the sample images scikit-image ships.

Entries (written to the workspace first, as misses would write them): plain requests on
``astronaut``, ``chelsea``, ``coffee``, ``rocket`` and two *templates* (a subject inset in a fixed
background: ``brick`` and ``grass`` textures). Queries, each with a controlled change:

* ``near_duplicate`` -- the same image and prompt with Gaussian noise, JPEG re-encoding or a
  brightness change;
* ``layout`` -- the same subject and prompt, another layout: off-centre crop, shift, mirror;
* ``template_subject`` -- the same template (background, layout, prompt wording) with another subject;
* ``unrelated`` -- other images (camera, coins, hubble_deep_field, ...) with unrelated prompts.

Every request has its own seed (different noise), like real traffic. Images are float ``[h, w, 3]``
in [0, 1].
"""

from __future__ import annotations

import io

import numpy as np
import skimage.data
import skimage.transform
from PIL import Image

from .source import Request

FAMILIES = ("near_duplicate", "layout", "template_subject", "unrelated")

BASE_PROMPTS = {
    "astronaut": "an astronaut in a white suit smiles and turns toward the camera, flags waving behind her",
    "chelsea": "a tabby cat looks around curiously and blinks, soft indoor light",
    "coffee": "steam rises from a cup of coffee on a saucer, slow camera push-in",
    "rocket": "a rocket lifts off from the launch pad, smoke billowing, camera tilts up",
}
SUBJECT_WORDS = {"astronaut": "astronaut", "chelsea": "cat", "coffee": "coffee cup", "rocket": "rocket"}
TEMPLATES = {"brick": "the {s} in front of a red brick wall, gentle zoom in, cinematic lighting",
             "grass": "the {s} standing on a green lawn, the camera orbits slowly, sunny day"}
UNRELATED = {
    "camera": "a photographer adjusts his camera on a tripod in an open field, black and white film",
    "coins": "old coins spin and fall onto a table, macro shot",
    "hubble_deep_field": "a flight through a field of distant galaxies, stars drifting past",
    "immunohistochemistry": "microscope footage of stained tissue cells, slow focus pull",
    "moon": "the surface of the moon with craters, the sun rises over the horizon",
    "colorwheel": "a spinning color wheel, abstract motion graphics, loopable",
}


def load_image(name: str) -> np.ndarray:
    """A scikit-image sample image as float ``[h, w, 3]`` in [0, 1] (gray is repeated to RGB)."""
    img = np.asarray(getattr(skimage.data, name)())
    if img.dtype == bool:
        img = img.astype(np.float64)
    img = img.astype(np.float64)
    if img.max() > 1.0:
        img = img / 255.0
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return np.clip(img[..., :3], 0.0, 1.0)


def _resize(img: np.ndarray, shape) -> np.ndarray:
    return skimage.transform.resize(img, shape, order=1, anti_aliasing=True, preserve_range=True)


def template_image(background: str, subject: str, size=(320, 480)) -> np.ndarray:
    """A template frame: the ``background`` texture (tinted) with the subject inset at a fixed place."""
    bg = _resize(load_image(background), size)
    tint = np.array([1.0, 0.55, 0.45]) if background == "brick" else np.array([0.45, 0.9, 0.4])
    bg = bg * tint[None, None, :]
    h, w = size
    sh, sw = int(0.62 * h), int(0.42 * w)
    top, left = int(0.2 * h), int(0.29 * w)
    bg[top:top + sh, left:left + sw] = _resize(load_image(subject), (sh, sw))
    return np.clip(bg, 0, 1)


def perturb(img: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Near-duplicate (``noise``, ``jpeg``, ``brightness``) or layout (``crop``, ``shift``, ``flip``) change."""
    h, w = img.shape[:2]
    if kind == "noise":
        return np.clip(img + rng.normal(0.0, 0.04, img.shape), 0, 1)
    if kind == "jpeg":
        buf = io.BytesIO()
        Image.fromarray((img * 255).round().astype(np.uint8)).save(buf, format="JPEG", quality=30)
        return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"), dtype=np.float64) / 255.0
    if kind == "brightness":
        return np.clip(img * 1.2 + 0.03, 0, 1)
    if kind == "crop":  # off-centre 75% crop, resized back: the subject moves and grows
        return _resize(img[: int(0.75 * h), int(0.2 * w): int(0.2 * w) + int(0.75 * w)], (h, w))
    if kind == "shift":
        return np.roll(img, int(0.18 * w), axis=1)
    if kind == "flip":
        return img[:, ::-1].copy()
    raise ValueError(f"unknown perturbation {kind!r}")


def build_workload(quick: bool = False, seed: int = 0) -> tuple[list[Request], list[Request]]:
    """``(entries, queries)``. ``quick``: 2 plain entries + 1 template and 6 queries."""
    rng = np.random.default_rng(seed)
    next_seed = iter(range(1000 + 97 * seed, 10**6))
    bases = ["astronaut", "chelsea"] if quick else ["astronaut", "chelsea", "coffee", "rocket"]
    templates = [("brick", "astronaut")] if quick else [("brick", "astronaut"), ("grass", "coffee")]
    entries, queries = [], []
    base_images = {}
    for name in bases:
        base_images[name] = load_image(name)
        entries.append(Request(name, base_images[name], BASE_PROMPTS[name], next(next_seed), "entry"))
    for bg, subject in templates:
        entries.append(Request(f"{bg}+{subject}", template_image(bg, subject),
                               TEMPLATES[bg].format(s=SUBJECT_WORDS[subject]), next(next_seed), "entry"))
    near = ("noise",) if quick else ("noise", "jpeg", "brightness")
    lay = ("flip",) if quick else ("crop", "shift", "flip")
    for name in bases:
        for kind in near:
            queries.append(Request(f"{name}/{kind}", perturb(base_images[name], kind, rng), BASE_PROMPTS[name],
                                   next(next_seed), "near_duplicate", name))
    for name in bases[:1] if quick else bases:
        for kind in lay:
            queries.append(Request(f"{name}/{kind}", perturb(base_images[name], kind, rng), BASE_PROMPTS[name],
                                   next(next_seed), "layout", name))
    for bg, subject in templates:
        others = [s for s in ("astronaut", "chelsea", "coffee", "rocket") if s != subject]
        for other in others[:1] if quick else others:
            queries.append(Request(f"{bg}+{other}", template_image(bg, other), TEMPLATES[bg].format(s=SUBJECT_WORDS[other]),
                                   next(next_seed), "template_subject", f"{bg}+{subject}"))
    for name in list(UNRELATED)[:2 if quick else None]:
        queries.append(Request(name, load_image(name), UNRELATED[name], next(next_seed), "unrelated"))
    return entries, queries
