"""Fuzzing the cache's entry files (hypothesis; no ComfyUI needed).

A template workspace holds 4 engine-shaped entries (tiny Wan 2.2 A14B-I2V signature, 8 tokens).
Each case copies it into a fresh directory under a tmp cache root, damages ONE entry file and
then uses the workspace the way a worker does:

- damage: truncation, bit flips, an empty file, a deleted file, or a *valid safetensors file with
  hostile contents* (embedding / chunk tensors of the wrong dtype or shape, map records with wrong,
  negative or huge shapes / offsets / sizes, hostile ``chunk_raw_sizes``, codec, format, version,
  metadata and signature strings with NUL, traversal paths, unicode, 100k characters);
- checksum: left stale (the SQLite sha256 no longer matches: the store must catch it) or made
  consistent (a writer that committed hostile bytes: the decoder must catch it).

Every case must end in a clear message or a dense fallback: ``Workspace.load`` returns or raises
``CorruptEntryError`` (a ``ValueError``, entry quarantined) and nothing else; ``retrieve_plan``
never raises; when it returns a hit, ``ChorusAttention`` still answers every call with an output
equal to dense attention (8 tokens = one block, so a fitting mask is dense; anything else falls
back). No committed entry is lost: the 3 other entries load bit-identical and are found by search;
``verify`` ends index-consistent; nothing is written outside the workspace directory (a snapshot of
the cache root around it is unchanged). The number of cases is printed (FuzzReport warning).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import struct
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import serving_helpers as sh

HOSTILE_STRINGS = ["../../../../etc/passwd", "/abs/path", "a\x00b", "\u202e\u0000\ufffd", "\ud7ff\ue000",
                   "x" * 100_000, "", "{}", "null", "C:\\Windows\\x", "%s%n", "'; DROP TABLE entries; --"]
MAX_CASES = 100

hostile_text = st.one_of(st.sampled_from(HOSTILE_STRINGS), st.text(max_size=40))
hostile_int = st.one_of(st.sampled_from([-1, 0, 1, 7, 2**31, 2**40, 2**62, -(2**62)]), st.integers(-5, 300))
hostile_json = st.recursive(
    st.one_of(st.none(), st.booleans(), hostile_int, st.floats(allow_nan=False, allow_infinity=False), hostile_text),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(hostile_text, children, max_size=4)),
    max_leaves=8)

STRUCTURED = ["embedding_dtype", "embedding_shape", "chunk_dtype", "map_shape", "map_dtype", "map_encoding",
              "map_offset", "map_nbytes", "map_key", "raw_sizes", "codec", "format", "version", "meta_strings",
              "meta_not_json", "signature", "maps_not_list", "drop_chunk", "extra_tensor"]

damage = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0.0, 0.999)),
    st.tuples(st.just("bitflip"), st.lists(st.floats(0.0, 0.999999), min_size=1, max_size=6)),
    st.tuples(st.just("empty"), st.none()),
    st.tuples(st.just("delete"), st.none()),
    st.tuples(st.sampled_from(STRUCTURED), st.tuples(hostile_json, hostile_int, hostile_text,
                                                     st.sampled_from([torch.float64, torch.int32, torch.float16,
                                                                      torch.uint8, torch.bool]))),
)


def _split(data: bytes):
    from safetensors.torch import load

    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return load(data), dict(header["__metadata__"])


def _hostile_entry(data: bytes, kind: str, params) -> bytes:
    """A valid safetensors file made from entry ``data`` with one field made hostile."""
    from safetensors.torch import save

    tensors, meta = _split(data)
    any_json, number, text, dtype = params
    maps = json.loads(meta["maps"])
    if kind == "embedding_dtype":
        tensors["embedding"] = tensors["embedding"].to(dtype)
    elif kind == "embedding_shape":
        tensors["embedding"] = tensors["embedding"].reshape(1, -1) if number % 2 else torch.zeros(0)
    elif kind == "chunk_dtype":
        chunk = tensors["chunk_000"]
        tensors["chunk_000"] = chunk[: chunk.numel() // 4 * 4].view(torch.float32) if dtype != torch.bool else chunk.bool()
    elif kind == "map_shape":
        maps[number % len(maps)]["shape"] = any_json if isinstance(any_json, list) else [number, 1, number]
    elif kind == "map_dtype":
        maps[number % len(maps)].update({"encoding": "raw", "dtype": str(dtype).replace("torch.", "")})
    elif kind == "map_encoding":
        maps[number % len(maps)]["encoding"] = text
    elif kind == "map_offset":
        maps[number % len(maps)]["offset"] = number
    elif kind == "map_nbytes":
        maps[number % len(maps)]["nbytes"] = number
    elif kind == "map_key":
        maps[number % len(maps)]["key"] = any_json
    elif kind == "raw_sizes":
        meta["chunk_raw_sizes"] = json.dumps(any_json if not isinstance(any_json, (type(None), bool)) else [number])
    elif kind == "codec":
        meta["codec"] = text
    elif kind == "format":
        meta["format"] = text
    elif kind == "version":
        meta["version"] = text if number % 2 else str(number)
    elif kind == "meta_strings":
        user_meta = json.loads(meta["meta"])
        user_meta.update({"prompt": text, text: any_json, "image_hash": text[:64]})
        meta["meta"] = json.dumps(user_meta)
    elif kind == "meta_not_json":
        meta["meta"] = text
    elif kind == "signature":
        user_meta = json.loads(meta["meta"])
        fields = ["latent_shape", "token_grid", "step_sigmas", "format", "token_order", "block_size", "experts",
                  "num_layers", "num_heads", "variant"]
        field = fields[number % len(fields)]
        user_meta["signature"] = dict(user_meta["signature"], **{field: any_json})
        meta["meta"] = json.dumps(user_meta)
    elif kind == "maps_not_list":
        meta["maps"] = json.dumps(any_json)
    elif kind == "drop_chunk":
        del tensors["chunk_000"]
    elif kind == "extra_tensor":
        tensors["chunk_%03d" % (number % 3 + 1)] = torch.zeros(abs(number) % 64, dtype=dtype)
        meta["chunk_raw_sizes"] = json.dumps([json.loads(meta["chunk_raw_sizes"])[0], abs(number) % 64])
    meta["maps"] = meta["maps"] if kind == "maps_not_list" else json.dumps(maps)
    return save({k: v.contiguous() for k, v in tensors.items()}, metadata={k: str(v) for k, v in meta.items()})


def _damage(data: bytes, kind: str, params) -> bytes | None:
    if kind == "truncate":
        return data[: int(params * len(data))]
    if kind == "bitflip":
        out = bytearray(data)
        for f in params:
            bit = int(f * len(out) * 8)
            out[bit // 8] ^= 1 << (bit % 8)
        return bytes(out)
    if kind == "empty":
        return b""
    if kind == "delete":
        return None
    return _hostile_entry(data, kind, params)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    from chorus.cache_store import Workspace

    path = tmp_path_factory.mktemp("fuzz_template") / "ws"
    with Workspace.open(path) as ws:
        ids = [ws.add(sh.embedding(i), sh.entry_masks(i), {"signature": sh.signature(), "prompt": f"entry {i}"})
               for i in range(4)]
        originals = {i: ws.load(i, touch=False) for i in ids}
    return path, ids, originals


def test_fuzz_entry_files(template, tmp_path, record_property):
    from chorus.cache_store import CorruptEntryError, Workspace
    from chorus.engine import ChorusAttention, SparseConfig, retrieve_plan

    template_path, ids, originals = template
    root = tmp_path / "cache_root"
    root.mkdir()
    (tmp_path / "outside.txt").write_text("sentinel")
    before_outside = sh.snapshot(tmp_path, skip=root)
    counts: dict[str, int] = {}

    @settings(max_examples=MAX_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.data_too_large])
    @given(victim_index=st.integers(0, 3), how=damage, consistent=st.booleans())
    def case(victim_index, how, consistent):
        kind, params = how
        ws_dir = root / uuid.uuid4().hex[:12]
        shutil.copytree(template_path, ws_dir)
        victim = ids[victim_index]
        db = sqlite3.connect(str(ws_dir / "chorus.sqlite3"))
        file_name = db.execute("SELECT file FROM entries WHERE id=?", (victim,)).fetchone()[0]
        entry_file = ws_dir / "entries" / file_name
        try:
            new = _damage(entry_file.read_bytes(), kind, params)
        except (ValueError, TypeError, RuntimeError, OverflowError, KeyError):
            new = b"not an entry"  # the hostile variant could not even be serialised: plain garbage
        if new is None:
            entry_file.unlink()
        else:
            entry_file.write_bytes(new)
            if consistent:  # as if a writer had committed these bytes
                db.execute("UPDATE entries SET sha256=?, nbytes=? WHERE id=?",
                           (hashlib.sha256(new).hexdigest(), len(new), victim))
                db.commit()
        db.close()
        outside_ws = sh.snapshot(root, skip=ws_dir)

        with Workspace.open(ws_dir) as ws:
            try:
                masks, meta = ws.load(victim, touch=False)
                outcome = "loaded"
                assert isinstance(masks, dict) and isinstance(meta, dict)
            except CorruptEntryError as exc:
                outcome = "rejected"
                assert "quarantined" in str(exc) and str(exc)
            # a worker asking for the victim's request: a hit that works, or a miss that says why
            plan = retrieve_plan(ws, sh.embedding(victim - 1), sh.LATENT, similarity_threshold=0.5)
            assert plan.message.startswith("hit: entry " if plan.is_hit else "miss"), plan.message
            handle = ChorusAttention(plan, SparseConfig(backend="reference"), sh.model_info())
            gen = torch.Generator().manual_seed(victim)
            q, k, v = (torch.randn(1, sh.NUM_HEADS, 8, sh.HEAD_DIM, generator=gen) for _ in range(3))
            handle.begin_run(sample_sigmas=sh.STEP_SIGMAS + [0.0])
            for layer in range(sh.NUM_LAYERS):
                for sigma in sh.STEP_SIGMAS:
                    out = handle.self_attention(q, k, v, layer=layer, sigma=sigma, grid=sh.GRID, dense_fn=sh.dense)
                    torch.testing.assert_close(out, sh.dense(q, k, v), rtol=1e-5, atol=1e-5)
            handle.end_run()
            # no committed entry lost: the others load bit-identical and are found
            for other in ids:
                if other == victim:
                    continue
                masks, meta = ws.load(other, touch=False)
                ref_masks, ref_meta = originals[other]
                assert meta == ref_meta and set(masks) == set(ref_masks)
                assert all(torch.equal(masks[key], ref_masks[key]) for key in ref_masks)
                assert ws.search(sh.embedding(other - 1), k=1)[0][0] == other
            report = ws.verify()
            assert report["index_consistent"], report
            assert len(ws) >= len(ids) - 1
        allowed = {"chorus.sqlite3", "chorus.sqlite3-wal", "chorus.sqlite3-shm", "entries", "quarantine", "write.lock"}
        assert {p.name for p in ws_dir.iterdir() if not p.name.startswith("index.g")} <= allowed
        assert sh.snapshot(root, skip=ws_dir) == outside_ws
        counts[f"{kind}/{outcome}"] = counts.get(f"{kind}/{outcome}", 0) + 1
        shutil.rmtree(ws_dir)

    case()
    assert sh.snapshot(tmp_path, skip=root) == before_outside
    total = sum(counts.values())
    sh.report(record_property, "entry files", counts)
    assert total >= MAX_CASES // 2, counts
    assert any(k.endswith("/rejected") for k in counts), counts


def test_fuzz_decode_entry_bytes(template, record_property):
    """The decoder alone on hostile bytes: returns or raises EntryFormatError (a ValueError), nothing else."""
    from chorus.cache_store.entry_format import EntryFormatError, decode_entry

    template_path, ids, _ = template
    data = next((template_path / "entries").iterdir()).read_bytes()
    counts: dict[str, int] = {}

    @settings(max_examples=MAX_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(how=damage, packed=st.booleans())
    def case(how, packed):
        kind, params = how
        try:
            new = _damage(data, kind, params)
        except (ValueError, TypeError, RuntimeError, OverflowError, KeyError):
            new = b"not an entry"
        try:
            masks, emb, meta = decode_entry(new if new is not None else b"", packed=packed)
            outcome = "decoded"
            assert isinstance(masks, dict) and isinstance(meta, dict)
        except EntryFormatError as exc:
            outcome = "rejected"
            assert str(exc)
        counts[f"{kind}/{outcome}"] = counts.get(f"{kind}/{outcome}", 0) + 1

    case()
    sh.report(record_property, "decode_entry", counts)
    assert sum(counts.values()) >= MAX_CASES // 2


GRID_JSON = [None, True, [], [2**62], [-5], [-1, 8], [-1, 1, -8], {"a": 1}, [[1]], "str", 2**62, [1, 2**40, -1],
             [2, 1, 2**62], 3.5]
GRID_INT = [-1, 0, 1, 7, 2**31, 2**40, 2**62, -(2**62)]
GRID_DTYPE = [torch.float64, torch.bool, torch.int32, torch.float16]


def test_hostile_entry_grid(template, record_property):
    """Every hostile field x a fixed grid of hostile values (huge, negative, wrong-typed), decoded
    packed and unpacked: EntryFormatError or a decode, nothing else (deterministic complement of
    the hypothesis cases, which draw few of the huge values)."""
    from chorus.cache_store.entry_format import EntryFormatError, decode_entry

    template_path, _, _ = template
    data = next((template_path / "entries").iterdir()).read_bytes()
    counts: dict[str, int] = {}
    unexpected = []
    for kind in STRUCTURED:
        for any_json in GRID_JSON:
            for i, number in enumerate(GRID_INT):
                try:
                    new = _hostile_entry(data, kind, (any_json, number, "../x\x00\u202e", GRID_DTYPE[i % 4]))
                except (ValueError, TypeError, RuntimeError, OverflowError, KeyError):
                    continue  # not serialisable as safetensors: nothing to decode
                for packed in (False, True):
                    try:
                        decode_entry(new, packed=packed)
                        outcome = "decoded"
                    except EntryFormatError:
                        outcome = "rejected"
                    except Exception as exc:  # noqa: BLE001 - collected and reported below
                        outcome = "UNEXPECTED"
                        unexpected.append((kind, any_json, number, f"{type(exc).__name__}: {exc}"[:200]))
                    counts[outcome] = counts.get(outcome, 0) + 1
    sh.report(record_property, "hostile entry grid", counts)
    assert not unexpected, unexpected[:5]
    assert counts.get("rejected", 0) > 1000, counts
