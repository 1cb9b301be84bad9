"""Entry format, signature keys and workspace name resolution (cache_store.entry_format/signature/paths)."""

import os
import sys
import types

import numpy as np
import pytest
import torch

from chorus.cache_store import entry_format as ef
from chorus.cache_store import default_cache_root, resolve_workspace, signature_key
from chorus.cache_store.paths import PACK_DIR


def _masks():
    gen = torch.Generator().manual_seed(3)
    return {
        ("high", 0, 0, 0): torch.rand(1, 3, 9, 13, generator=gen) < 0.4,  # [1, H, Qb, Kb], Kb % 8 != 0
        ("high", 1, 0, 0): torch.rand(3, 9, 13, generator=gen) < 0.4,  # [H, Qb, Kb]
        ("low", 2, 5, 1): torch.rand(2, 1, 1, 1, generator=gen) < 0.5,  # 1x1 grid
        ("low", 3, 5, 1): torch.ones(1, 2, 257, 300, dtype=torch.bool),  # awkward, large
        (0, 0, 1, 0): torch.rand(1, 2, 9, 13, generator=gen).half(),  # quantised mass, int expert
        (1, 0, 1, 0): (torch.rand(2, 9, 13, generator=gen) * 255).to(torch.uint8),
        ("x", 0, 2, 0): torch.rand(2, 4, generator=gen).bfloat16(),
    }


@pytest.mark.parametrize("codec", ["zstd", "zlib", "none"])
def test_roundtrip_exact_all_dtypes_and_shapes(codec, monkeypatch):
    monkeypatch.setattr(ef, "CHUNK_RAW_BYTES", 64)  # force many chunks
    masks = _masks()
    meta = {"signature": {"a": 1}, "prompt": "ünïcode ✓"}
    data = ef.encode_entry(np.arange(5, dtype=np.float32), masks, meta, codec=codec)
    out, emb, meta_out = ef.decode_entry(data)
    assert meta_out == meta and torch.equal(emb, torch.arange(5, dtype=torch.float32))
    assert set(out) == set(masks)
    for key, value in masks.items():
        assert out[key].dtype == value.dtype and out[key].shape == value.shape, key
        assert torch.equal(out[key], value), key
    packed, _, _ = ef.decode_entry(data, packed=True)
    for key, value in masks.items():
        if value.dtype == torch.bool:
            assert isinstance(packed[key], ef.PackedMap)
            assert torch.equal(packed[key].unpack(), value)
            # the device path (shift-and-mask in torch), run here on CPU tensors
            shifts = torch.arange(7, -1, -1, dtype=torch.uint8)
            manual = ((packed[key].bits.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., : value.shape[-1]].bool()
            assert torch.equal(manual.reshape(value.shape), value)
    # the torch-free form (what verify runs): the same payloads as numpy bytes, the embedding as float32
    payloads, emb_np, meta_np = ef.decode_entry_arrays(data)
    assert meta_np == meta and emb_np.dtype == np.float32 and np.array_equal(emb_np, np.arange(5, dtype=np.float32))
    assert {p[0] for p in payloads} == set(masks) and len(payloads) == len(masks)
    for key, encoding, dtype, shape, payload in payloads:
        assert payload.dtype == np.uint8 and tuple(shape) == tuple(masks[key].shape), key
        expected = packed[key].bits if encoding == "bits" else masks[key].contiguous().view(-1).view(torch.uint8)
        assert np.array_equal(payload.reshape(-1), expected.reshape(-1).numpy()), key


def test_packed_unpack_on_device_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: device unpack runs in the GPU tests")
    value = torch.rand(1, 4, 37, 45) < 0.3
    out, _, _ = ef.decode_entry(ef.encode_entry([1.0], {("a", 0, 0, 0): value}, {}), packed=True)
    assert torch.equal(out[("a", 0, 0, 0)].unpack("cuda").cpu(), value)


@pytest.mark.parametrize("masks, match", [
    ({}, "non-empty"),
    ({("a", 0, 0): torch.ones(2, 2, dtype=torch.bool)}, "tuple"),
    ({("a", 0, 0, 1.5): torch.ones(2, 2, dtype=torch.bool)}, "int or str"),
    ({("a", 0, 0, True): torch.ones(2, 2, dtype=torch.bool)}, "int or str"),
    ({("a", 0, 0, 0): torch.ones(4, dtype=torch.bool)}, ">= 2 dims"),
    ({("a", 0, 0, 0): torch.ones(2, 2, dtype=torch.int64)}, "unsupported dtype"),
    ({("a", 0, 0, 0): torch.tensor([[float("nan")]]).half()}, "NaN"),
    ({("a", 0, 0, 0): [[True]]}, "torch.Tensor"),
])
def test_encode_rejects_bad_masks(masks, match):
    with pytest.raises(ValueError, match=match):
        ef.encode_entry([1.0], masks, {})


def test_encode_rejects_non_json_meta():
    with pytest.raises(ValueError, match="JSON"):
        ef.encode_entry([1.0], {("a", 0, 0, 0): torch.ones(2, 2, dtype=torch.bool)}, {"x": object()})


def test_decode_rejects_damage():
    data = ef.encode_entry([1.0, 2.0], _masks(), {"signature": {}})
    for decode in (ef.decode_entry, ef.decode_entry_arrays):
        for bad in (data[:5], data[: len(data) // 2], data[:-1], b"\0" * 64, b"garbage" * 20):
            with pytest.raises(ef.EntryFormatError):
                decode(bad)
        # A flipped payload byte inside a compressed chunk fails decompression or the size check.
        flipped = bytearray(data)
        flipped[-10] ^= 0xFF
        with pytest.raises(ef.EntryFormatError, match="corrupt chunk"):
            decode(bytes(flipped))


def test_signature_key_canonical():
    base = {"family": "wan", "latent_shape": (16, 21, 60, 104), "sigmas": [1.0, 0.5], "nested": {"b": 1, "a": 2}}
    same = {"nested": {"a": 2, "b": 1}, "sigmas": [1, 0.5], "latent_shape": [16, 21, 60, 104], "family": "wan"}
    assert signature_key(base) == signature_key(same)
    assert signature_key(base) == signature_key({**base, "sigmas": np.array([1.0, 0.5])})
    for change in ({"family": "wan2"}, {"sigmas": [1.0, 0.5000001]}, {"latent_shape": [16, 21, 60, 105]}, {"extra": None}):
        assert signature_key({**base, **change}) != signature_key(base), change
    assert len(signature_key(base)) == 32
    for bad in ({"x": float("nan")}, {"x": object()}, {1: 2}, [1, 2]):
        with pytest.raises(ValueError):
            signature_key(bad)


def test_resolve_workspace_validates_names(tmp_path):
    root = tmp_path / "root"
    assert resolve_workspace("good-name_1.v2", root) == (root / "good-name_1.v2").resolve()
    assert resolve_workspace("", root) == (root / "default").resolve()
    for bad in ("..", ".", "../x", "a/b", "a\\b", "/etc", "/tmp/x", ".hidden", "-x", "x" * 65, "a\0b"):
        with pytest.raises(ValueError):
            resolve_workspace(bad, root)
    with pytest.raises(ValueError):
        resolve_workspace(123, root)
    # A symlink planted inside the root must not lead outside it.
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "escape")
    with pytest.raises(ValueError, match="outside"):
        resolve_workspace("escape", root)


def test_root_never_inside_the_pack(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="pack folder"):
        default_cache_root(PACK_DIR / "cache")
    with pytest.raises(ValueError, match="pack folder"):
        resolve_workspace("ws", PACK_DIR)
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(PACK_DIR / "x"))
    with pytest.raises(ValueError, match="pack folder"):
        default_cache_root()


def test_default_root_order(tmp_path, monkeypatch):
    monkeypatch.delenv("CHORUS_CACHE_DIR", raising=False)
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == (tmp_path / "home" / ".cache" / "chorus").resolve()
    fake = types.ModuleType("folder_paths")
    fake.get_user_directory = lambda: str(tmp_path / "comfy_user")
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    assert default_cache_root() == (tmp_path / "comfy_user" / "chorus").resolve()
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "env"))
    assert default_cache_root() == (tmp_path / "env").resolve()
    assert default_cache_root(tmp_path / "given") == (tmp_path / "given").resolve()


def test_package_imports_without_comfyui():
    import subprocess

    code = ("import sys, chorus.cache_store as cs; "
            "assert 'folder_paths' not in sys.modules and not any(m.startswith('comfy') for m in sys.modules); "
            "print(sorted(n for n in ('Workspace', 'resolve_workspace', 'signature_key', 'embedders') if hasattr(cs, n)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['Workspace', 'embedders', 'resolve_workspace', 'signature_key']"
