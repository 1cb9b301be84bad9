"""Embedders of cache_store.embedders: open_clip from a local checkpoint, ComfyUI graph tensors, hash embedder."""

import math

import numpy as np
import pytest
import torch

from chorus.cache_store import embedders as E


def _image(seed, h=48, w=64):
    return torch.rand(1, h, w, 3, generator=torch.Generator().manual_seed(seed))


def _cos(a, b):
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("w", [0.0, 0.3, 0.5, 1.0])
def test_joint_embedding_weighting(w):
    rng = np.random.default_rng(0)
    t1, t2, i1, i2 = (rng.normal(size=d) for d in (8, 8, 5, 5))
    a = E.joint_embedding(t1, i1, w, 8, 5)
    b = E.joint_embedding(t2, i2, w, 8, 5)
    assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-6)
    assert float(a @ b) == pytest.approx(w * _cos(t1, t2) + (1 - w) * _cos(i1, i2), abs=1e-6)


def test_joint_embedding_bad_input():
    with pytest.raises(ValueError):
        E.joint_embedding(None, None, 0.5, 4, 4)
    with pytest.raises(ValueError):
        E.joint_embedding([1, 0, 0, 0], None, 1.5, 4, 4)
    with pytest.raises(ValueError):
        E.joint_embedding([1, 0, 0], None, 0.5, 4, 4)
    with pytest.raises(ValueError):
        E.joint_embedding([np.nan, 0, 0, 0], None, 0.5, 4, 4)
    with pytest.raises(ValueError):
        E.joint_embedding(None, [1, 0, 0, 0], 1.0, 4, 4)  # weight excludes the only part


def test_hash_embedder_deterministic_and_discriminative():
    emb = E.HashEmbedder(text_weight=0.5)
    a = emb.embed(_image(0), "a red fox running through snow")
    assert np.array_equal(a, E.HashEmbedder(text_weight=0.5).embed(_image(0), "a red fox running through snow"))
    near = emb.embed(_image(0) * 0.97 + 0.01, "a red fox running in snow")
    far = emb.embed(_image(5), "city skyline at night, neon")
    assert a.shape == (emb.dim,) and a.dtype == np.float32
    assert float(a @ near) > 0.8 > float(a @ far)
    assert emb.embed(text="x").shape == emb.embed(image=_image(1)).shape
    with pytest.raises(ValueError):
        emb.embed(image=torch.rand(2, 3))
    with pytest.raises(ValueError):
        emb.embed()


def test_orthonormal_projection():
    p = E.orthonormal_projection(300, 64, seed=3)
    assert p.shape == (300, 64)
    torch.testing.assert_close(p.T @ p, torch.eye(64), atol=1e-5, rtol=0)
    assert torch.equal(p, E.orthonormal_projection(300, 64, seed=3))
    assert not torch.equal(p, E.orthonormal_projection(300, 64, seed=4))
    up = E.orthonormal_projection(16, 64)
    torch.testing.assert_close(up @ up.T, torch.eye(16), atol=1e-5, rtol=0)


def test_comfy_graph_embedder():
    emb = E.ComfyGraphEmbedder(text_weight=0.6, part_dim=128)
    gen = torch.Generator().manual_seed(0)
    cond = torch.randn(1, 512, 4096, generator=gen)  # Wan umT5 conditioning [B, tokens, dim]
    cv = {"image_embeds": torch.randn(1, 1280, generator=gen),
          "penultimate_hidden_states": torch.randn(1, 257, 1280, generator=gen)}
    a = emb.embed(conditioning=[[cond, {"pooled_output": None}]], clip_vision_output=cv)
    assert a.shape == (256,) and np.linalg.norm(a) == pytest.approx(1.0, abs=1e-5)
    assert np.array_equal(a, E.ComfyGraphEmbedder(text_weight=0.6, part_dim=128).embed(
        conditioning=[[cond.clone(), {}]], clip_vision_output=cv))
    # The text part is the projected token mean: an orthonormal projection keeps cosines of pooled vectors
    # when the input dim <= part_dim; here it is a random projection (4096 -> 128): similar stays similar.
    near = emb.embed(conditioning=[[cond + 0.05 * torch.randn(cond.shape, generator=gen), {}]], clip_vision_output=cv)
    other = emb.embed(conditioning=[[torch.randn(1, 512, 4096, generator=gen), {}]],
                      clip_vision_output={"image_embeds": torch.randn(1, 1280, generator=gen)})
    assert float(a @ near) > 0.95 and float(a @ other) < 0.5
    # penultimate hidden states when image_embeds is absent, raw pixels when there is no CLIP vision
    obj = type("CVOut", (), {"penultimate_hidden_states": cv["penultimate_hidden_states"]})()
    b = emb.embed(conditioning=cond, clip_vision_output=obj)
    c = emb.embed(image=_image(1), text="prompt only")
    assert b.shape == c.shape == (256,)
    with pytest.raises(ValueError):
        emb.embed(conditioning=torch.randn(4))
    with pytest.raises(ValueError):
        emb.embed(clip_vision_output={})
    with pytest.raises(ValueError):
        emb.embed(conditioning=torch.full((1, 3, 8), float("nan")))


def test_a_first_last_frame_request_s_end_image_joins_the_image_part():
    """The end image's thumbnail joins the start image's (the mean of their unit vectors): another end image is a
    less similar request, the same one the same; without an end image the embedding is what it was; a uniform end
    image (a zero thumbnail) adds nothing; an end image alone is the image part."""
    emb = E.ComfyGraphEmbedder(part_dim=128)
    start = emb.embed(image=_image(1), text="a red fox")
    with_end = emb.embed(image=_image(1), text="a red fox", end_image=_image(2))
    assert np.array_equal(with_end, emb.embed(image=_image(1), text="a red fox", end_image=_image(2).clone()))
    other_end = emb.embed(image=_image(1), text="a red fox", end_image=_image(3))
    assert float(with_end @ start) < 0.99 and float(with_end @ other_end) < float(with_end @ with_end) - 0.01
    images = float(emb.embed(image=_image(1)) @ emb.embed(image=_image(2))) / 0.5  # cosine of the two image parts
    # the text half, plus the image half's cosine of the start image with the mean of both: sqrt((1 + c) / 2)
    np.testing.assert_allclose(float(with_end @ start), 0.5 + 0.5 * np.sqrt(0.5 * (1 + images)), rtol=1e-4)
    assert np.allclose(emb.embed(image=_image(1), text="a red fox", end_image=torch.full((1, 16, 16, 3), 0.5)), start)
    assert np.allclose(emb.embed(text="a red fox", end_image=_image(2)), emb.embed(image=_image(2), text="a red fox"))


@pytest.fixture(scope="module")
def clip_checkpoint(tmp_path_factory):
    """A real open_clip architecture with random weights, saved to a local file at test time."""
    open_clip = pytest.importorskip("open_clip")
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = open_clip.create_model("ViT-S-32", pretrained=None, force_image_size=64).eval()
    path = tmp_path_factory.mktemp("clip") / "vit-s-32-random.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    torch.save(model.state_dict(), str(path.with_suffix(".pt")))
    return model, path


def test_open_clip_embedder_matches_the_model(clip_checkpoint):
    import open_clip

    model, path = clip_checkpoint
    emb = E.OpenClipEmbedder("ViT-S-32", path, text_weight=0.4, image_size=64)
    img, text = _image(2, 80, 100), "a lighthouse on a cliff"
    with torch.inference_mode():
        x = torch.nn.functional.interpolate(img.permute(0, 3, 1, 2), size=(64, 64), mode="bicubic",
                                            antialias=True, align_corners=False).clamp(0, 1)
        x = (x - torch.tensor(E.OPENAI_MEAN).view(1, 3, 1, 1)) / torch.tensor(E.OPENAI_STD).view(1, 3, 1, 1)
        ref_i = model.encode_image(x)[0].double().numpy()
        ref_t = model.encode_text(open_clip.get_tokenizer("ViT-S-32")([text]))[0].double().numpy()
    got = emb.embed(img, text)
    ref = E.joint_embedding(ref_t, ref_i, 0.4, ref_t.size, ref_i.size)
    np.testing.assert_allclose(got, ref, atol=1e-5)
    assert emb.dim == got.size == 2 * 384
    # the same weights through a torch state-dict file
    emb_pt = E.OpenClipEmbedder("ViT-S-32", path.with_suffix(".pt"), text_weight=0.4, image_size=64)
    np.testing.assert_allclose(emb_pt.embed(img, text), got, atol=1e-6)
    # text only: the joint vector is the text part (weight sqrt(w)) and zeros
    t_only = emb.embed(text=text)
    assert np.linalg.norm(t_only) == pytest.approx(math.sqrt(0.4), abs=1e-5) and not t_only[384:].any()


def test_open_clip_embedder_rejects_wrong_checkpoint(clip_checkpoint, tmp_path):
    _, path = clip_checkpoint
    with pytest.raises(ValueError, match="does not fit"):
        E.OpenClipEmbedder("ViT-S-16", path, image_size=64)
    with pytest.raises(ValueError, match="does not exist"):
        E.OpenClipEmbedder("ViT-S-32", tmp_path / "missing.safetensors")
