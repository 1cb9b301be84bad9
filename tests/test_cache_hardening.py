"""The store against an unlucky operator or a hostile file (issue 16): bounded waits, nothing outside
the workspace, hostile entries cost at most their stated size, clear errors, names and roots.

Real files and processes throughout: FIFOs from ``os.mkfifo``, a second process holding SQLite's
write transaction (``BEGIN IMMEDIATE``) and the writers' lock, real symbolic links, sparse files.
The only timed assertions are bounds ("returned within 10 s" for a 1 s time bound).
"""

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

import cache_helpers
from cache_helpers import SIGNATURE, Holder, embedding, small_masks, tree_snapshot
from chorus.cache_store import CorruptEntryError, Workspace, resolve_workspace, signature_key
from chorus.cache_store.entry_format import FORMAT, VERSION, decode_entry, encode_entry
from chorus.cache_store.errors import StoreBusyError, StoreError, UnsafeLayoutError

BOUND = 1.0  # the time bound the tests give the store
LIMIT = 10.0  # what they allow it (generous: a loaded 2-core CI machine)

# An engine-shaped signature (states its geometry: 300 tokens, block 128 -> 3 blocks a side).
GEO_SIG = {"format": 1, "family": "wan", "variant": "test", "experts": ["fp"], "num_layers": 2, "num_heads": 3,
           "latent_shape": [16, 5, 12, 20], "token_grid": [5, 6, 10], "block_size": 128, "token_order": "thw",
           "step_sigmas": [1.0, 0.5], "head_groups": 1}

def _filled(path, n=4, sig=SIGNATURE):
    with Workspace.open(path) as ws:
        return [ws.add(embedding(s), small_masks(s), {"signature": sig, "seed": s}) for s in range(n)]


def _entry_file(path, entry_id) -> Path:
    with sqlite3.connect(path / "chorus.sqlite3") as db:
        return path / "entries" / db.execute("SELECT file FROM entries WHERE id=?", (entry_id,)).fetchone()[0]


def _in_thread(fn, limit=LIMIT):
    """Run ``fn`` in a thread; return (result or exception, seconds). Fails if it outlives ``limit``."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["value"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"{fn} still blocked after {limit} s"
    return out["value"], time.monotonic() - t0


# -- 1. bounded time ---------------------------------------------------------------------------------
def test_fifo_entry_never_blocks_load_or_verify(tmp_path):
    """An entry file replaced by a FIFO (nobody writing to it) is quarantined, not read: load and verify
    return at once."""
    path = tmp_path / "ws"
    ids = _filled(path)
    for victim in (ids[1], ids[2]):
        f = _entry_file(path, victim)
        f.unlink()
        os.mkfifo(f)
    with Workspace.open(path, timeout=BOUND) as ws:
        result, _ = _in_thread(lambda: ws.load(ids[1]))
        assert isinstance(result, CorruptEntryError) and "FIFO" in str(result), result
        report, _ = _in_thread(ws.verify)
        assert [d["id"] for d in report["damaged"]] == [ids[2]] and "FIFO" in report["damaged"][0]["reason"]
        assert report["index_consistent"] and len(ws) == 2
        assert {q["id"] for q in ws.quarantined()} == {ids[1], ids[2]}
        masks, _ = ws.load(ids[3])
        assert all(torch.equal(masks[k], v) for k, v in small_masks(3).items())


def test_held_sqlite_transaction_bounds_every_prompt_call(tmp_path, caplog):
    """Another process holds SQLite's write transaction and the writers' lock: open, search, len and
    load(touch=False) do not wait at all; load(touch=True) returns the entry without waiting (its hit
    is kept pending); touch and add give up within the bound with StoreBusyError (an OSError) and
    write nothing; a search on the same handle while add waits returns before add gives up."""
    path = tmp_path / "ws"
    ids = _filled(path)
    holder = Holder(path)
    try:
        t0 = time.monotonic()
        ws = Workspace.open(path, timeout=BOUND)
        assert ws.search(embedding(2), k=1)[0][0] == ids[2] and len(ws) == 4
        masks, _ = ws.load(ids[2], touch=False)
        assert time.monotonic() - t0 < LIMIT
        result, took = _in_thread(lambda: ws.load(ids[3]))  # touch=True: the hit cannot be counted
        assert isinstance(result, tuple) and took < LIMIT and "not counted" in caplog.text
        result, took = _in_thread(lambda: ws.touch(ids[3]))
        assert isinstance(result, StoreBusyError) and isinstance(result, OSError) and took < LIMIT
        before = sorted(p.name for p in (path / "entries").iterdir())
        result, took = _in_thread(lambda: ws.add(embedding(9), small_masks(9), {"signature": SIGNATURE}))
        assert isinstance(result, StoreBusyError) and "writers' lock" in str(result) and took < LIMIT
        assert sorted(p.name for p in (path / "entries").iterdir()) == before

        slow = Workspace.open(path, timeout=4 * BOUND)  # add waits up to 4 s; a search must not wait for it
        added = {}

        def add_and_keep_the_outcome():
            try:
                added["value"] = slow.add(embedding(8), small_masks(8), {"signature": SIGNATURE})
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                added["value"] = exc

        adder = threading.Thread(target=add_and_keep_the_outcome, daemon=True)
        adder.start()
        time.sleep(0.2)
        assert slow.search(embedding(1), k=1)[0][0] == ids[1]
        assert adder.is_alive(), "the search waited for the writer"
        adder.join(LIMIT)
        assert not adder.is_alive(), f"add still blocked after {LIMIT} s"
        assert isinstance(added["value"], StoreBusyError) and "writers' lock" in str(added["value"]), added
    finally:
        holder.release()
    assert ws.add(embedding(9), small_masks(9), {"signature": SIGNATURE}) == 5
    assert ws.stats()["hits"] == 0
    ws.touch(ids[2])  # counts the hits kept pending while the store was busy
    assert {e["id"]: e["hits"] for e in ws.entries()} == {ids[0]: 0, ids[1]: 0, ids[2]: 1, ids[3]: 2, 5: 0}
    ws.close()
    slow.close()


def test_an_add_that_finds_the_store_busy_when_it_evicts_returns_its_committed_entry(tmp_path, monkeypatch, caplog):
    """The eviction after an add runs once the entry is committed. When SQLite's write lock is held
    at that instant past the time bound (another process's hit flush takes it without the writers'
    lock), the add still returns the entry it wrote (not a StoreBusyError saying nothing changed);
    the eviction is logged as deferred and the next write makes it."""
    from chorus.cache_store import seams

    path = tmp_path / "ws"
    with Workspace.open(path, max_entries=2) as ws:
        for s in range(2):
            ws.add(embedding(s), small_masks(s), {"signature": SIGNATURE})
    other = sqlite3.connect(path / "chorus.sqlite3", isolation_level=None, check_same_thread=False)
    release = []

    def hold_sqlite_at_commit(phase):
        if phase == "committed" and not release:
            other.execute("BEGIN IMMEDIATE")
            release.append(threading.Timer(3 * BOUND, lambda: other.execute("COMMIT")))
            release[0].start()

    with Workspace.open(path, timeout=BOUND) as ws:
        monkeypatch.setattr(seams, "workspace_phase", hold_sqlite_at_commit)
        entry_id, took = _in_thread(lambda: ws.add(embedding(9), small_masks(9), {"signature": SIGNATURE}))
        monkeypatch.setattr(seams, "workspace_phase", lambda phase: None)
        assert isinstance(entry_id, int), entry_id
        assert took < LIMIT and "eviction deferred" in caplog.text
        assert len(ws) == 3 and ws.search(embedding(9))[0][0] == entry_id
        release[0].join()
        ws.add(embedding(10), small_masks(10), {"signature": SIGNATURE})
        assert len(ws) == 2 and ws.load(entry_id, touch=False)  # the next write evicted the oldest two
        assert ws.verify()["ok"]
    other.close()


def test_close_beside_a_write_of_another_thread_leaves_that_write_its_files(tmp_path, monkeypatch):
    """``close`` gives up waiting for another thread's write after the time bound but closes no
    descriptor under it (a closed directory descriptor reused by another open could send the entry
    elsewhere): the write completes and is committed, and the handle's files close when it ends."""
    from chorus.cache_store import seams

    path = tmp_path / "ws"
    _filled(path, n=1)
    ws = Workspace.open(path, timeout=0.2)
    writing, release = threading.Event(), threading.Event()

    def slow_write(phase):
        if phase == "file_durable":
            writing.set()
            release.wait(LIMIT)

    monkeypatch.setattr(seams, "workspace_phase", slow_write)
    added = {}
    writer = threading.Thread(target=lambda: added.setdefault(
        "id", ws.add(embedding(7), small_masks(7), {"signature": SIGNATURE})), daemon=True)
    writer.start()
    assert writing.wait(LIMIT)
    ws.close()  # gives up on the writer mutex after 0.2 s
    assert ws.closed
    release.set()
    writer.join(LIMIT)
    monkeypatch.setattr(seams, "workspace_phase", lambda phase: None)
    assert isinstance(added.get("id"), int), added
    with Workspace.open(path) as again:
        assert len(again) == 2 and again.search(embedding(7))[0][0] == added["id"] and again.verify()["ok"]


def test_open_of_a_new_workspace_is_bounded_and_raises_oserror(tmp_path):
    """Creating a workspace needs the writers' lock: held by another process, open gives up within the
    bound with StoreBusyError, which the retrieve node catches (it catches OSError)."""
    path = tmp_path / "ws"
    path.mkdir()
    (path / "chorus.sqlite3").touch()
    holder = Holder(path)
    try:
        result, took = _in_thread(lambda: Workspace.open(path, timeout=BOUND))
        assert isinstance(result, StoreBusyError) and isinstance(result, OSError) and took < LIMIT
    finally:
        holder.release()
    Workspace.open(path).close()


def test_timeout_setting(monkeypatch, tmp_path):
    from chorus.cache_store.errors import DEFAULT_TIMEOUT, store_timeout

    monkeypatch.delenv("CHORUS_CACHE_TIMEOUT", raising=False)
    assert store_timeout() == DEFAULT_TIMEOUT and store_timeout(0.5) == 0.5
    monkeypatch.setenv("CHORUS_CACHE_TIMEOUT", "7.5")
    assert store_timeout() == 7.5
    with Workspace.open(tmp_path / "ws") as ws:
        assert ws.timeout == 7.5 and ws.stats()["timeout_s"] == 7.5
    for bad in ("0", "-1", "nan", "inf", "soon", "1e10"):  # 1e10 s: past what a lock can wait for
        monkeypatch.setenv("CHORUS_CACHE_TIMEOUT", bad)
        with pytest.raises(ValueError, match="CHORUS_CACHE_TIMEOUT"):
            store_timeout()
    with pytest.raises(ValueError, match="timeout"):
        Workspace.open(tmp_path / "ws", timeout=1e10)


# -- 2. nothing outside the root ---------------------------------------------------------------------
@pytest.mark.parametrize("item", ["entries", "quarantine", "chorus.sqlite3", "write.lock"])
def test_links_leading_out_of_the_workspace_are_refused(tmp_path, item):
    """A store path that is a link to somewhere outside (the real thing moved there) is refused on open
    (UnsafeLayoutError, an OSError naming the link); nothing outside is written, moved or deleted."""
    path = tmp_path / "ws"
    ids = _filled(path)
    _entry_file(path, ids[0]).write_bytes(b"damaged")  # something verify would quarantine
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "unrelated.txt").write_text("keep me")
    (outside / f"{'ab' * 16}.safetensors").write_bytes(b"looks like an orphan entry")
    real = path / item
    moved = outside / item
    os.replace(real, moved)
    os.symlink(moved, real)
    before = tree_snapshot(outside)
    for attempt in (lambda: Workspace.open(path), lambda: Workspace.open(path, readonly=True)):
        with pytest.raises(UnsafeLayoutError, match=f"{item} is a symbolic link to {moved}") as info:
            attempt()
        assert isinstance(info.value, OSError)
    if item == "entries":  # the command line says so in one line (one case: each run imports torch)
        out = subprocess.run([sys.executable, "-m", "chorus", "cache", "verify", "--path", str(path)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.startswith("error:") and "symbolic link" in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
    assert tree_snapshot(outside) == before


def test_entry_file_link_is_quarantined_and_its_target_untouched(tmp_path):
    path = tmp_path / "ws"
    ids = _filled(path)
    target = tmp_path / "elsewhere.safetensors"
    f = _entry_file(path, ids[1])
    os.replace(f, target)  # the same bytes: the checksum would match if the link were followed
    os.symlink(target, f)
    data = target.read_bytes()
    with Workspace.open(path) as ws:
        with pytest.raises(CorruptEntryError, match="symbolic link"):
            ws.load(ids[1])
        assert (path / "quarantine" / f.name).is_symlink() and not os.path.lexists(f)
    assert target.read_bytes() == data


def test_verify_reports_strays_and_deletes_only_store_names(tmp_path):
    """lost+found, a leftover .tmp-* directory, foreign files: reported, left alone, never fatal."""
    path = tmp_path / "ws"
    ids = _filled(path)
    (path / "entries" / "lost+found").mkdir()
    (path / "entries" / "lost+found" / "x").write_text("x")
    (path / "entries" / f".tmp-1-{'ab' * 16}").mkdir()
    (path / "entries" / "notes.txt").write_text("operator notes")
    (path / f".tmp-2-{'cd' * 16}").mkdir()
    (path / "entries" / f".tmp-3-{'ef' * 16}").write_bytes(b"partial")  # the store's: removed
    with Workspace.open(path) as ws:
        report = ws.verify()
        assert report["ok"] and report["index_consistent"] and report["checked"] == len(ids)
        assert report["temp_files_removed"] == 1 and report["orphans_removed"] == 0
        assert sorted(report["stray"]) == sorted(["entries/lost+found/", f"entries/.tmp-1-{'ab' * 16}/",
                                                  "entries/notes.txt", f".tmp-2-{'cd' * 16}/"])
    assert (path / "entries" / "lost+found" / "x").exists() and (path / "entries" / "notes.txt").exists()


# -- 3. hostile entries cost at most their stated size -----------------------------------------------
def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
        return True
    except OSError:
        return False


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


PEAK_RSS_MEASURABLE = _reset_peak_rss()
needs_peak_rss = pytest.mark.skipif(not PEAK_RSS_MEASURABLE,
                                    reason="peak RSS cannot be reset here (/proc/self/clear_refs not writable)")


def _peak_growth_mib(fn):
    """(fn's result or exception, peak RSS growth in MiB); the tests that call it are ``needs_peak_rss``."""
    assert _reset_peak_rss(), "peak RSS could not be reset"
    base = _rss_kib("VmRSS")
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001
        value = exc
    return value, (_rss_kib("VmHWM") - base) / 1024


def _forge(path, entry_id, data: bytes) -> None:
    """Replace an entry's file and make its row agree (a hostile file with a consistent checksum)."""
    import hashlib

    _entry_file(path, entry_id).write_bytes(data)
    with sqlite3.connect(path / "chorus.sqlite3") as db:
        db.execute("UPDATE entries SET sha256=?, nbytes=? WHERE id=?", (hashlib.sha256(data).hexdigest(), len(data),
                                                                         entry_id))


def _bomb_stream(raw_bytes: int, codec: str) -> bytes:
    import zlib

    import zstandard

    zeros = bytes(1 << 20)
    if codec == "zstd":
        comp = zstandard.ZstdCompressor(level=3).compressobj()
        out = b"".join(comp.compress(zeros) for _ in range(raw_bytes >> 20)) + comp.flush()
    else:
        comp = zlib.compressobj(9)
        out = b"".join(comp.compress(zeros) for _ in range(raw_bytes >> 20)) + comp.flush()
    return out


def _entry_bytes(records, raw_sizes, chunks, meta, codec="zstd") -> bytes:
    tensors = {"embedding": torch.as_tensor(embedding(0))}
    for i, blob in enumerate(chunks):
        tensors[f"chunk_{i:03d}"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else \
            torch.zeros(0, dtype=torch.uint8)
    return st_save(tensors, metadata={"format": FORMAT, "version": str(VERSION), "codec": codec,
                                      "chunk_raw_sizes": json.dumps(raw_sizes), "maps": json.dumps(records),
                                      "meta": json.dumps(meta)})


@pytest.mark.parametrize("encoding, shape", [("bits", [2**40, 2**40, 0]), ("raw", [0, 2**70]),
                                             ("raw", [2**40, 2**40, 0])])
def test_an_empty_map_with_huge_dimensions_is_damage_not_a_crash(tmp_path, encoding, shape):
    """A forged map of zero elements whose other dimensions are past the cap (0 bytes, so its sizes
    agree) is refused by the record checks: load quarantines it (CorruptEntryError), verify runs."""
    path = tmp_path / "ws"
    ids = _filled(path)
    record = {"key": ["high", 0, 0, 0], "encoding": encoding, "dtype": "bool" if encoding == "bits" else "uint8",
              "shape": shape, "chunk": 0, "offset": 0, "nbytes": 0}
    _forge(path, ids[1], _entry_bytes([record], [0], [b""], {"signature": SIGNATURE}, codec="none"))
    with Workspace.open(path) as ws:
        with pytest.raises(CorruptEntryError, match="past the cap"):
            ws.load(ids[1])
        assert [q["id"] for q in ws.quarantined()] == [ids[1]]
        report = ws.verify()
        assert report["ok"] and len(ws) == 3


@needs_peak_rss
def test_sparse_huge_entry_file_is_refused_before_reading(tmp_path):
    path = tmp_path / "ws"
    ids = _filled(path)
    with open(_entry_file(path, ids[1]), "r+b") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB stated, nothing on disk
    with Workspace.open(path) as ws:
        result, growth = _peak_growth_mib(lambda: ws.load(ids[1]))
        assert isinstance(result, CorruptEntryError) and f"{1 << 30} bytes, its row says" in str(result)
        assert growth < 64, f"+{growth:.0f} MiB peak RSS"
        assert [q["id"] for q in ws.quarantined()] == [ids[1]]


@needs_peak_rss
@pytest.mark.parametrize("case", ["shape_past_geometry", "stream_past_declared_zstd", "stream_past_declared_zlib",
                                  "sizes_past_records", "bytes_past_shape", "raw_past_ceiling"])
def test_decompression_bombs_are_refused_at_their_stated_size(tmp_path, case):
    """Each forged entry (consistent checksum) is quarantined with a reason; the load's peak memory
    stays far below what the bomb would expand to (hundreds of MiB, x8 unpacked)."""
    path = tmp_path / "ws"
    ids = _filled(path, sig=GEO_SIG)
    meta = {"signature": GEO_SIG}
    big = 256 << 20
    if case == "shape_past_geometry":  # declared consistently, but far past what the signature's geometry allows
        side = 16384
        records = [{"key": ["high", 0, 0, 0], "encoding": "bits", "dtype": "bool", "shape": [3, side, side],
                    "chunk": 0, "offset": 0, "nbytes": 3 * side * side // 8}]
        data, match = _entry_bytes(records, [3 * side * side // 8], [_bomb_stream(big, "zstd")], meta), "cap"
    elif case.startswith("stream_past_declared"):  # 1 KiB declared, 256 MiB inside the stream
        codec = case.rsplit("_", 1)[1]
        records = [{"key": ["high", 0, 0, 0], "encoding": "raw", "dtype": "uint8", "shape": [1024], "chunk": 0,
                    "offset": 0, "nbytes": 1024}]
        data, match = _entry_bytes(records, [1024], [_bomb_stream(big, codec)], meta, codec), "wrong size"
    elif case == "sizes_past_records":  # a chunk declared larger than the maps it holds
        records = [{"key": ["high", 0, 0, 0], "encoding": "raw", "dtype": "uint8", "shape": [16], "chunk": 0,
                    "offset": 0, "nbytes": 16}]
        data, match = _entry_bytes(records, [big], [_bomb_stream(big, "zstd")], meta), "do not match"
    elif case == "bytes_past_shape":  # a one-element map declaring 256 MiB of payload
        records = [{"key": ["high", 0, 0, 0], "encoding": "raw", "dtype": "uint8", "shape": [1], "chunk": 0,
                    "offset": 0, "nbytes": big}]
        data, match = _entry_bytes(records, [big], [_bomb_stream(big, "zstd")], meta), "do not hold"
    else:  # a signature without geometry: the global ceiling on raw bytes
        records = [{"key": ["high", 0, 0, 0], "encoding": "raw", "dtype": "uint8", "shape": [3 << 30], "chunk": 0,
                    "offset": 0, "nbytes": 3 << 30}]
        data, match = _entry_bytes(records, [3 << 30], [b"x"], {"signature": SIGNATURE}), "chunk sizes"
    _forge(path, ids[1], data)
    with Workspace.open(path) as ws:
        result, growth = _peak_growth_mib(lambda: ws.load(ids[1], packed=False))
        assert isinstance(result, CorruptEntryError) and match in str(result), result
        assert growth < 96, f"+{growth:.0f} MiB peak RSS"
        assert ws.quarantined()[0]["id"] == ids[1] and match in ws.quarantined()[0]["reason"]
        assert ws.verify()["ok"] and len(ws) == 3


def test_a_machine_short_of_memory_quarantines_no_healthy_entry(tmp_path, monkeypatch):
    """A MemoryError while decoding a healthy entry (within its caps) is the machine's, not the
    entry's: load raises it and quarantines nothing, verify lists the entry as unchecked (not
    damaged, not removed), and once memory is back the entry loads as written."""
    import numpy as np

    from chorus.cache_store import entry_format

    path = tmp_path / "ws"
    ids = _filled(path)
    real_empty = np.empty

    def no_memory(*args, **kwargs):
        raise MemoryError("test: the allocation failed")

    with Workspace.open(path) as ws:
        monkeypatch.setattr(entry_format.np, "empty", no_memory)
        with pytest.raises(MemoryError):
            ws.load(ids[1])
        report = ws.verify()
        monkeypatch.setattr(entry_format.np, "empty", real_empty)
        assert report["ok"] and report["damaged"] == [] and report["index_consistent"]
        assert sorted(u["id"] for u in report["unchecked"]) == sorted(ids)
        assert ws.quarantined() == [] and len(ws) == 4
        masks, meta = ws.load(ids[1])
        assert meta["seed"] == 1 and all(torch.equal(masks[k], v) for k, v in small_masks(1).items())
        assert ws.verify()["unchecked"] == []


def test_encode_refuses_masks_past_the_geometry_cap():
    """The cap is the decoder's: a signature whose grid and sigmas are tuples (its JSON reads back as
    lists, the same signature key) is held to it as well, so no written entry fails its first load."""
    masks = {("high", 0, 0, 0): torch.ones(3, 64, 64, dtype=torch.bool)}  # 64 blocks a side; the grid has 3
    as_tuples = {k: tuple(v) if isinstance(v, list) else v for k, v in GEO_SIG.items()}
    assert as_tuples != GEO_SIG and signature_key(as_tuples) == signature_key(GEO_SIG)
    for signature in (GEO_SIG, as_tuples):
        with pytest.raises(ValueError, match="more than"):
            encode_entry(embedding(0), masks, {"signature": signature})
    ok = {("high", 0, 0, 0): torch.ones(3, 3, 3, dtype=torch.bool)}
    decoded, _, _ = decode_entry(encode_entry(embedding(0), ok, {"signature": GEO_SIG}))
    assert torch.equal(decoded[("high", 0, 0, 0)], ok[("high", 0, 0, 0)])


def _nested(depth: int):
    value = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def test_deep_json_is_quarantined_and_refused_by_add(tmp_path):
    path = tmp_path / "ws"
    ids = _filled(path)
    good = encode_entry(embedding(1), small_masks(1), {"signature": SIGNATURE})
    # The same entry with a header whose meta nests 100 000 deep (past the recursion limit) and one 100 deep.
    for entry_id, depth in ((ids[1], 100_000), (ids[2], 100)):
        header_len = int.from_bytes(good[:8], "little")
        header = json.loads(good[8 : 8 + header_len])
        header["__metadata__"]["meta"] = '{"signature": ' + "[" * depth + "]" * depth + "}"
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        _forge(path, entry_id, len(blob).to_bytes(8, "little") + blob + good[8 + header_len :])
    with Workspace.open(path) as ws:
        for entry_id in (ids[1], ids[2]):
            with pytest.raises(CorruptEntryError, match="nested"):
                ws.load(entry_id)
        _forge(path, ids[3], _entry_file(path, ids[3]).read_bytes())  # unchanged
        report = ws.verify()
        assert report["ok"] and len(ws) == 2
        for meta in ({"signature": SIGNATURE, "deep": _nested(100_000)}, {"signature": SIGNATURE, "deep": _nested(80)},
                     {"signature": {"deep": _nested(80)}}, {"signature": SIGNATURE, "big": "x" * (17 << 20)}):
            with pytest.raises(ValueError):
                ws.add(embedding(5), small_masks(5), meta)
        assert len(ws) == 2 and len(list((path / "entries").iterdir())) == 2


def test_rows_edited_in_sqlite_never_stop_an_open_or_a_listing(tmp_path, caplog):
    """Rows are checked like new entries (``rows.py``): an embedding edited to zeros, to NaN or
    to another size, or whose signature key is not text, is left out of the index (logged) while the
    workspace opens, searches and saves its index; 48 x 1e-45 is a valid direction (normalised in
    float64), as for an add; metadata nested 100 000 deep reads as unreadable in the listing; a size
    edited to text lists as unknown, counts as 0 where sizes are added up (stats, eviction) and makes
    the entry's load find it damaged."""
    import numpy as np

    path = tmp_path / "ws"
    ids = _filled(path, n=6)
    tiny = np.full(48, 1e-45, np.float32)
    with sqlite3.connect(path / "chorus.sqlite3") as db:
        for entry_id, blob in ((ids[0], bytes(4 * 48)), (ids[1], np.full(48, np.nan, np.float32).tobytes()),
                               (ids[2], b"\0" * 8)):
            db.execute("UPDATE entries SET embedding = ? WHERE id = ?", (blob, entry_id))
        db.execute("UPDATE entries SET meta_json = ? WHERE id = ?", ("[" * 100_000 + "]" * 100_000, ids[3]))
        db.execute("UPDATE entries SET nbytes = 'big' WHERE id = ?", (ids[4],))
        db.execute("UPDATE entries SET sig_key = ? WHERE id = ?", (b"\x01" * 32, ids[5]))
        db.execute("DELETE FROM settings WHERE key = 'generation'")  # no saved index matches: rebuilt from rows
    for index_file in path.glob("index.g*.safetensors"):
        index_file.unlink()
    with Workspace.open(path) as ws:
        assert ws.search(embedding(3))[0][0] == ids[3] and ws.stats()["indexed"] == 2
        listing = {e["id"]: e for e in ws.entries()}
        assert "nested too deeply" in listing[ids[3]]["meta"]["unreadable"] and listing[ids[4]]["nbytes"] is None
        assert ws.stats()["bytes"] == sum(e["nbytes"] or 0 for e in listing.values())
        assert caplog.text.count("is left out of the index") == 4
        new = ws.add(tiny, small_masks(9), {"signature": SIGNATURE})
        assert ws.search(tiny)[0] == (new, pytest.approx(1.0, abs=1e-5))
        ws.save_index()
        with pytest.raises(CorruptEntryError, match="not an integer"):
            ws.load(ids[4])
        assert len(ws) == 6 and len(ws.prune(max_entries=2)) == 4 and len(ws) == 2


# -- 4. verify beside a busy worker; evicted is not damaged ------------------------------------------
def test_verify_beside_an_evicting_worker_reports_no_false_damage(tmp_path):
    """A worker adds 12 entries, prunes to 2, and again, in a loop; verify runs over and over meanwhile:
    never damage, always a consistent index; entries evicted under it are listed apart, not quarantined."""
    path = tmp_path / "ws"
    Workspace.open(path).close()
    ctx = cache_helpers.forkserver_context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=cache_helpers.churner, args=(str(path), child))
    proc.start()
    try:
        assert parent.poll(60) and parent.recv()[0] == "ready"
        reports, pruned = [], 0
        with Workspace.open(path, timeout=30) as ws:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                reports.append(ws.verify())
                while parent.poll():
                    pruned += parent.recv()[1]
                time.sleep(0.01)  # let the worker take the writers' lock between runs
        assert proc.is_alive(), "the worker stopped early"
    finally:
        proc.kill()
        proc.join(30)
    evicted = sum(len(r["evicted"]) for r in reports)
    print(f"{len(reports)} verify runs while the worker evicted {pruned} entries; {evicted} evicted under a run")
    assert pruned > 0 and len(reports) >= 5
    assert all(r["ok"] and not r["damaged"] for r in reports), [r for r in reports if not r["ok"]][:2]
    assert all(r["index_consistent"] for r in reports)
    with Workspace.open(path) as ws:
        assert ws.quarantined() == []


@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "read_only"])
def test_verify_tells_entries_evicted_during_the_run_from_damage(tmp_path, monkeypatch, readonly):
    """Deterministic: right after verify lists the entries, another handle (its own SQLite connections
    and lock file descriptor, as another process) prunes most of them and adds two: verify reports the
    pruned ones as evicted, no damage, a consistent index, and quarantines nothing; so does plain
    ``cache verify``'s read-only handle (opened while no process had the database open)."""
    from chorus.cache_store import seams

    path = tmp_path / "ws"
    ids = _filled(path, n=8)
    pruned, handles = [], []

    def hook(phase):
        if phase == "verify_listed" and not pruned:
            handles.append(Workspace.open(path))
            pruned.extend(handles[0].prune(max_entries=2))
            handles[0].add(embedding(50), small_masks(50), {"signature": SIGNATURE})
            handles[0].add(embedding(51), small_masks(51), {"signature": SIGNATURE})

    monkeypatch.setattr(seams, "workspace_phase", hook)
    with Workspace.open(path, readonly=readonly) as ws:
        report = ws.verify()
        assert sorted(report["evicted"]) == sorted(pruned) == ids[:6]
        assert report["ok"] and report["damaged"] == [] and report["index_consistent"], report
        assert ws.quarantined() == [] and len(ws) == 4
    handles[0].close()


def test_a_read_only_handle_opened_while_the_workspace_is_idle_sees_later_writes(tmp_path):
    """A read-only handle opened while no process has the database open reads it as immutable (it
    creates no -wal / -shm file); once a worker writes, the handle reads what the worker committed:
    its adds, its removal (a KeyError, not damage), its count; nothing is quarantined or created."""
    path = tmp_path / "ws"
    ids = _filled(path, n=3)
    ro = Workspace.open(path, readonly=True)
    try:
        assert len(ro) == 3 and not (path / "chorus.sqlite3-wal").exists()
        with Workspace.open(path) as worker:
            added = [worker.add(embedding(s), small_masks(s), {"signature": SIGNATURE}) for s in range(10, 40)]
            worker.remove(ids[0])
        assert len(ro) == 32 and ro.stats()["entries"] == 32
        assert ro.search(embedding(25))[0][0] == added[15]
        with pytest.raises(KeyError):
            ro.load(ids[0])
        report = ro.verify()
        assert report["ok"] and report["checked"] == 32 and report["index_consistent"]
        with Workspace.open(path) as worker:  # a worker that stays open while the handle reads
            worker.add(embedding(99), small_masks(99), {"signature": SIGNATURE})
            assert len(ro) == 33
    finally:
        ro.close()
    with Workspace.open(path) as ws:
        assert ws.quarantined() == []


def test_load_of_an_entry_evicted_meanwhile_is_a_key_error_not_damage(tmp_path, monkeypatch):
    from chorus.cache_store import seams

    path = tmp_path / "ws"
    ids = _filled(path)
    a, b = Workspace.open(path), Workspace.open(path)
    removed = []

    def evict(phase):  # another worker evicts it after handle a read its row, before a reads the file
        if phase == "row_read" and not removed:
            removed.append(b.remove(ids[1]))

    monkeypatch.setattr(seams, "workspace_phase", evict)
    with pytest.raises(KeyError, match="evicted"):
        a.load(ids[1])
    assert removed == [True]
    monkeypatch.setattr(seams, "workspace_phase", lambda phase: None)
    with pytest.raises(KeyError):
        a.load(ids[1])
    assert a.quarantined() == [] and a.verify()["ok"]
    a.close()
    b.close()


# -- 5. errors as OSError / ValueError at the store boundary -----------------------------------------
def test_ids_no_entry_can_have_are_key_errors_and_ids_that_are_not_ints_value_errors(tmp_path):
    """An id past SQLite's 64 bits (or below 1) is an unknown id: load and touch raise KeyError,
    remove returns False, entry_path None, and nothing is left pending that would fail every later
    write of the handle; 1.7 or True is not entry 1 (ValueError). A good entry's hits still count."""
    import numpy as np

    path = tmp_path / "ws"
    ids = _filled(path)
    with Workspace.open(path) as ws:
        for bad in (2**63, 2**70, 0, -1):
            with pytest.raises(KeyError):
                ws.load(bad)
            with pytest.raises(KeyError):
                ws.touch(bad)
            assert ws.remove(bad) is False and ws.entry_path(bad) is None
        for not_an_id in (1.7, float(ids[0]), True, "1", None):
            for call in (ws.load, ws.touch, ws.remove, ws.entry_path):
                with pytest.raises(ValueError, match="entry id"):
                    call(not_an_id)
        for _ in range(3):
            ws.load(np.int64(ids[0]))
        ws.touch(ids[0])
        assert {e["id"]: e["hits"] for e in ws.entries()}[ids[0]] == 4 and len(ws) == 4


@pytest.mark.parametrize("damage", ["garbage_db", "db_is_directory", "db_is_fifo"])
def test_damaged_database_is_a_store_error(tmp_path, damage):
    path = tmp_path / "ws"
    _filled(path, n=1)
    db = path / "chorus.sqlite3"
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    db.unlink()
    if damage == "garbage_db":
        db.write_bytes(b"this is not a database" * 100)
    elif damage == "db_is_directory":
        db.mkdir()
    else:
        os.mkfifo(db)
    result, took = _in_thread(lambda: Workspace.open(path, timeout=BOUND))
    assert isinstance(result, StoreError) and isinstance(result, OSError) and took < LIMIT, result
    assert "chorus.sqlite3" in str(result)


# -- 6. names and roots ------------------------------------------------------------------------------
def test_names_are_fully_matched_and_relative_env_root_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "root"))
    for bad in ("abc\n", "abc\r\n", "\nabc", "abc\x00", "abc/"):
        with pytest.raises(ValueError, match="invalid workspace name"):
            resolve_workspace(bad)
    assert resolve_workspace("abc") == (tmp_path / "root" / "abc").resolve()
    monkeypatch.setenv("CHORUS_CACHE_DIR", "relative/cache")
    with pytest.raises(ValueError, match="relative path"):
        resolve_workspace("abc")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CHORUS_CACHE_DIR", "~/cache")
    assert resolve_workspace("abc") == (tmp_path / "home" / "cache" / "abc").resolve()
    assert not (tmp_path / "root").exists()


def test_missing_subdirectories_stay_inside(tmp_path, monkeypatch):
    """A workspace copied without quarantine/ (as the backup recipe does) gets it back inside the
    workspace on a writable open; a read-only handle of one without entries/ reads nothing elsewhere
    (the working directory holds a same-named file that must not be used)."""
    path = tmp_path / "ws"
    ids = _filled(path, n=2)
    victim = _entry_file(path, ids[0])
    victim.write_bytes(b"damaged")
    (path / "quarantine").rmdir()
    monkeypatch.chdir(tmp_path)
    with Workspace.open(path, create=False) as ws:
        assert not ws.verify()["ok"]
    assert (path / "quarantine" / victim.name).exists() and not (tmp_path / victim.name).exists()

    good = _entry_file(path, ids[1])
    os.replace(good, tmp_path / good.name)  # same name in the working directory
    (path / "entries").rmdir()
    with Workspace.open(path, readonly=True) as ws:
        with pytest.raises(CorruptEntryError, match="no entries/ directory"):
            ws.load(ids[1])
    assert not (path / "entries").exists()


@needs_peak_rss
def test_oversized_or_odd_index_files_are_not_read(tmp_path):
    """The saved index is capped by the entry count (a sparse 1 GiB index file is dropped unread, the
    index rebuilt from SQLite); an index file that is a FIFO is skipped without blocking."""
    path = tmp_path / "ws"
    ids = _filled(path)
    with Workspace.open(path) as ws:
        saved = ws.save_index()
    with open(saved, "r+b") as f:
        f.truncate(1 << 30)
    os.mkfifo(path / "index.g999.safetensors")
    result, growth = _peak_growth_mib(lambda: _in_thread(lambda: Workspace.open(path))[0])
    assert isinstance(result, Workspace), result
    assert growth < 64, f"+{growth:.0f} MiB peak RSS"
    assert result.search(embedding(2), k=1)[0][0] == ids[2] and result.verify()["index_consistent"]
    result.close()
    assert saved.stat().st_size < 1 << 20  # dropped, and saved again from the rebuilt index on close


def test_verify_beside_a_held_lock_checks_and_skips_only_the_cleanup(tmp_path):
    path = tmp_path / "ws"
    ids = _filled(path)
    holder = Holder(path)
    try:
        with Workspace.open(path, timeout=BOUND) as ws:
            report, took = _in_thread(ws.verify)
            assert report["ok"] and report["checked"] == len(ids) and report["index_consistent"], report
            assert "writers' lock" in report["cleanup_skipped"] and took < LIMIT
    finally:
        holder.release()
