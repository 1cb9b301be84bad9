"""The fleet store's local disk tier: this worker's recent entries, so a hit fetches an entry from
PostgreSQL at most once per host.

Files live in ``<CHORUS_CACHE_DIR>/<workspace>/fleet_tier/`` (created by the first entry kept
there, never by opening), named ``<id>-<sha256>.safetensors``, an LRU cache bounded by
``max_bytes`` (``CHORUS_FLEET_TIER_BYTES``, 20 GiB by default; ordered by modification time,
which a read refreshes). Every operation goes through ``safe_fs.py``, relative to the tier folder
opened without following links: a link, FIFO or other non-regular file under a tier name (or a
link in place of the folder) is never read, it is treated as absent (logged; a writable tier
removes the link itself, never its target); a file larger than the entry's size is not read.
Bytes are checked against the sha256 of the row before use (a damaged file is deleted and the
entry fetched again), so writes are not fsynced. A read-only tier (``readonly=True``) creates,
refreshes and deletes nothing. Tested in ``tests/test_fleet_store.py``
(``::test_local_tier_is_bounded_lru_and_serves_hits_without_postgres``,
``::test_local_tier_refuses_links``) and ``tests/test_fleet_hostile.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from contextlib import contextmanager
from pathlib import Path

from .entries import MAX_ENTRY_FILE_BYTES
from .errors import UnsafeLayoutError
from .rows import is_digest
from .safe_fs import TEMP_NAME_RE, abandoned_temp, atomic_write, open_dir, read_regular_file, regular_files, unlink

LOG = logging.getLogger(__name__)

TIER_DIR = "fleet_tier"
DEFAULT_TIER_BYTES = 20 << 30
TIER_ENV = "CHORUS_FLEET_TIER_BYTES"
TIER_NAME_RE = re.compile(r"(\d+)-([0-9a-f]{64})\.safetensors")


def tier_bytes_setting(tier_bytes: int | None = None) -> int:
    """The tier's byte cap: ``tier_bytes`` if given, else ``CHORUS_FLEET_TIER_BYTES``, else 20 GiB.
    ``ValueError`` for a setting that is not a number of bytes >= 0."""
    if tier_bytes is None:  # the operator's setting, else 20 GiB
        raw = os.environ.get(TIER_ENV, "").strip()
        try:
            tier_bytes = int(raw) if raw else DEFAULT_TIER_BYTES
        except ValueError:
            raise ValueError(f"{TIER_ENV} must be a number of bytes, got {raw!r}") from None
    if tier_bytes < 0:
        raise ValueError("the local tier's byte cap must be >= 0")
    return int(tier_bytes)


def tier_name(entry_id: int, digest: str) -> str:
    """The file name of an entry in the tier; ``ValueError`` unless ``digest`` is a hex sha256."""
    if not is_digest(digest):  # names are made from checked rows only; never a path of another shape
        raise ValueError(f"not a sha256 digest: {str(digest)[:80]!r}")
    return f"{int(entry_id)}-{digest}.safetensors"


class LocalTier:
    """The local tier of one fleet workspace on this host (see the module docstring).

    ``path``: the tier folder; ``max_bytes``: its cap (a larger entry is not kept); ``readonly``:
    nothing is created, refreshed or deleted. Thread-safe; never raises for the tier's own
    trouble (a disk error is logged and the entry served from PostgreSQL).
    """

    def __init__(self, path: Path, max_bytes: int, *, readonly: bool = False):
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.readonly = bool(readonly)
        self._lock = threading.Lock()

    @contextmanager
    def _folder(self, create: bool = False):
        """The tier folder's descriptor (its last component not followed), or None when absent."""
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        try:
            fd = open_dir(self.path)
        except FileNotFoundError:
            yield None
            return
        try:
            yield fd
        finally:
            os.close(fd)

    def get(self, entry_id: int, digest: str, nbytes: int | None = None) -> bytes | None:
        """The bytes of ``entry_id`` when the tier holds them with sha256 ``digest`` (and size
        ``nbytes`` when given), else None; a read refreshes the file's place in the LRU order."""
        name = tier_name(entry_id, digest)
        try:
            with self._folder() as fd:
                if fd is None:
                    return None
                try:
                    data = read_regular_file(name, dir_fd=fd, max_bytes=MAX_ENTRY_FILE_BYTES, expected_size=nbytes)
                except FileNotFoundError:
                    return None
                except UnsafeLayoutError as exc:
                    LOG.warning("local tier %s: %s; fetching entry %d again", self.path, exc, entry_id)
                    self._discard(name, fd)
                    return None
                if hashlib.sha256(data).hexdigest() != digest:
                    LOG.warning("local tier file %s is damaged; fetching entry %d again", name, entry_id)
                    self._discard(name, fd)
                    return None
                if not self.readonly:
                    try:
                        os.utime(name, dir_fd=fd, follow_symlinks=False)  # LRU order of the tier
                    except OSError:
                        pass
                return data
        except OSError as exc:  # the folder is a link, unreadable, ...: the tier is not used
            LOG.warning("local tier %s not used: %s", self.path, exc)
            return None

    def _discard(self, name: str, fd: int) -> None:
        if not self.readonly:
            unlink(name, fd)

    def put(self, entry_id: int, digest: str, data: bytes) -> None:
        """Keep an entry's bytes (not on a read-only tier, nor past the cap), then evict down to
        the cap, oldest first."""
        if self.readonly or len(data) > self.max_bytes:
            return
        try:
            with self._folder(create=True) as fd:
                atomic_write(fd, tier_name(entry_id, digest), data, durable=False)  # checked by sha256 on read
                self._evict(fd)
        except OSError as exc:
            LOG.warning("could not keep entry %d in the local tier: %s", entry_id, exc)

    def _files(self, fd: int) -> list[tuple[float, str, int]]:
        return [(st.st_mtime, name, st.st_size) for name, st in regular_files(fd) if TIER_NAME_RE.fullmatch(name)]

    def _evict(self, fd: int) -> None:
        with self._lock:
            files = sorted(self._files(fd))
            total = sum(f[2] for f in files)
            for _, name, size in files:
                if total <= self.max_bytes:
                    break
                unlink(name, fd)
                total -= size

    def usage(self) -> tuple[int, int]:
        """``(files, bytes)`` of the entries the tier holds."""
        try:
            with self._folder() as fd:
                files = self._files(fd) if fd is not None else []
        except OSError:
            return 0, 0
        return len(files), sum(f[2] for f in files)

    def drop(self, entry_id: int) -> None:
        """Delete the tier's files of ``entry_id`` (removed or quarantined; not on a read-only tier)."""
        if self.readonly:
            return
        prefix = f"{int(entry_id)}-"
        try:
            with self._folder() as fd:
                for name in os.listdir(fd) if fd is not None else []:
                    if name.startswith(prefix) and TIER_NAME_RE.fullmatch(name):
                        unlink(name, fd)
        except OSError as exc:
            LOG.warning("local tier %s: could not drop entry %d: %s", self.path, entry_id, exc)

    def remove_temps(self) -> int:
        """Delete temporary files left by a killed process (:func:`~.safe_fs.abandoned_temp`: those of
        live processes, e.g. another worker's write on this host, stay); returns how many."""
        if self.readonly:
            return 0
        try:
            with self._folder() as fd:
                return sum(unlink(name, fd) for name in (os.listdir(fd) if fd is not None else [])
                           if abandoned_temp(name))
        except OSError:
            return 0

    def clean(self, live: dict) -> dict:
        """Delete the tier's abandoned temporary files and its entry files (names
        ``<id>-<sha256>.safetensors``, links included: removed, never followed) not of a live entry
        with that sha256 (``live``: id -> sha256). Names the tier does not make are left alone and
        listed under ``stray``; temporary files of live processes (writes in flight) stay."""
        temps = orphans = 0
        stray = []
        with self._lock:
            try:
                with self._folder() as fd:
                    for name in os.listdir(fd) if fd is not None else []:
                        if TEMP_NAME_RE.fullmatch(name):
                            temps += unlink(name, fd) if abandoned_temp(name) else 0
                            continue
                        m = TIER_NAME_RE.fullmatch(name)
                        if m is None:
                            stray.append(f"{TIER_DIR}/{name}")
                        elif live.get(int(m.group(1))) != m.group(2):
                            orphans += unlink(name, fd)
            except OSError as exc:
                LOG.warning("local tier %s not cleaned: %s", self.path, exc)
        return {"temp_files_removed": temps, "orphans_removed": orphans, "stray": stray}
