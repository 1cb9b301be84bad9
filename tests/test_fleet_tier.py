"""The fleet store's local tier (``cache_store/fleet_tier.py``) on its own: no-follow reads, a
link or a FIFO under an entry's name treated as absent, the cap, cleanup. No PostgreSQL needed;
the same through a real fleet store: ``tests/test_fleet_store.py::test_local_tier_refuses_links``."""

from __future__ import annotations

import hashlib
import os

from chorus.cache_store.fleet_tier import LocalTier, tier_name


def _entry(i: int, size: int = 1000) -> tuple[bytes, str]:
    data = bytes([i % 251]) * size
    return data, hashlib.sha256(data).hexdigest()


def test_put_get_and_the_cap_keep_the_newest(tmp_path):
    tier = LocalTier(tmp_path / "fleet_tier", max_bytes=2500)
    assert tier.get(1, _entry(1)[1]) is None and not (tmp_path / "fleet_tier").exists()  # nothing made by a read
    for i in range(1, 4):
        data, digest = _entry(i)
        tier.put(i, digest, data)
        os.utime(tier.path / tier_name(i, digest), (i, i))  # a distinct LRU order
    assert tier.get(1, _entry(1)[1]) is None  # the oldest went to keep 2 of 1000 bytes under 2500
    assert tier.get(3, _entry(3)[1]) == _entry(3)[0] and tier.usage() == (2, 2000)
    assert tier.get(3, _entry(3)[1], nbytes=999) is None  # a size other than the row's is not read


def test_a_link_under_an_entry_name_is_absent_and_removed_never_followed(tmp_path):
    """The link points at a file outside holding the entry's very bytes (following it would
    "work"): the tier still treats the entry as absent, removes the link, leaves the target alone."""
    tier = LocalTier(tmp_path / "fleet_tier", max_bytes=1 << 20)
    data, digest = _entry(7)
    tier.put(7, digest, data)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(data)
    os.utime(outside, (1000, 1000))
    name = tier.path / tier_name(7, digest)
    name.unlink()
    name.symlink_to(outside)
    readonly = LocalTier(tier.path, max_bytes=1 << 20, readonly=True)
    assert readonly.get(7, digest) is None and name.is_symlink()  # read-only: refused, left in place
    assert tier.get(7, digest) is None and not os.path.lexists(name)
    assert outside.read_bytes() == data and outside.stat().st_mtime == 1000  # not touched through the link
    os.mkfifo(name)  # a FIFO: refused without blocking
    assert tier.get(7, digest) is None and not os.path.lexists(name)
    name.symlink_to(outside)
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 30)
    (tier.path / tier_name(8, _entry(8)[1])).symlink_to(big)
    assert tier.usage() == (0, 0)  # links are not the tier's files and count nothing
    assert tier.clean({7: digest}) == {"temp_files_removed": 0, "orphans_removed": 1, "stray": []}  # 8 is not live
    assert outside.exists() and big.exists()


def test_a_link_in_place_of_the_tier_folder_is_not_used(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    data, digest = _entry(3)
    (outside / tier_name(3, digest)).write_bytes(data)
    os.utime(outside / tier_name(3, digest), (1000, 1000))
    (tmp_path / "fleet_tier").symlink_to(outside, target_is_directory=True)
    tier = LocalTier(tmp_path / "fleet_tier", max_bytes=1 << 20)
    assert tier.get(3, digest) is None  # the entry is fetched from PostgreSQL instead
    tier.put(4, _entry(4)[1], _entry(4)[0])  # logged, not kept
    tier.drop(3)
    assert sorted(os.listdir(outside)) == [tier_name(3, digest)]
    assert (outside / tier_name(3, digest)).stat().st_mtime == 1000 and tier.usage() == (0, 0)


def test_cleanup_deletes_only_what_the_tier_makes_and_no_write_in_flight(tmp_path):
    """``clean`` and ``remove_temps`` (run by verify and by every open) delete the files of entries
    not live and the temporary files of processes that are gone; a file the tier never makes (an
    operator's note) is left alone and reported as stray, and a temporary file of a live process (a
    write in flight: another worker on this host, or this process's other thread) is not touched."""
    import subprocess
    import sys
    import uuid

    tier = LocalTier(tmp_path / "fleet_tier", max_bytes=1 << 20)
    data, digest = _entry(5)
    tier.put(5, digest, data)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {"dead": f".tmp-{dead_pid}-{uuid.uuid4().hex}", "live": f".tmp-{worker.pid}-{uuid.uuid4().hex}",
                 "own": f".tmp-{os.getpid()}-{uuid.uuid4().hex}", "note": "README-operator-notes.txt",
                 "old": tier_name(6, _entry(6)[1])}
        for name in names.values():
            (tier.path / name).write_bytes(b"x")
        assert tier.remove_temps() == 1 and not (tier.path / names["dead"]).exists()
        (tier.path / names["dead"]).write_bytes(b"x")
        report = tier.clean({5: digest})
        assert report == {"temp_files_removed": 1, "orphans_removed": 1,
                          "stray": ["fleet_tier/README-operator-notes.txt"]}
        left = sorted(os.listdir(tier.path))
        assert left == sorted([names["live"], names["own"], names["note"], tier_name(5, digest)])
    finally:
        worker.kill()
        worker.wait()
