"""No-follow file I/O inside a store's directory: what both the workspace and the fleet's local tier use.

Every call works relative to a directory descriptor opened without following links
(:func:`open_dir`), so a path is never resolved again after it was checked. Reads
(:func:`read_regular_file`) ``lstat`` first and open with ``O_NOFOLLOW | O_NONBLOCK``: a symbolic
link, FIFO, device or directory is refused with
:class:`~chorus.cache_store.errors.UnsafeLayoutError` before a byte is read, as is a file larger
than the caller's cap or of a size other than the expected one. Writes (:func:`atomic_write`) go
to a temporary file (``O_EXCL | O_NOFOLLOW``, named :func:`temp_name`), then rename over the final
name, with fsyncs of the file and the directory when durable. :func:`unlink` removes a directory
entry itself (a link, never its target). Tested in ``tests/test_cache_hardening.py`` (links, FIFOs,
sparse files, through the workspace) and ``tests/test_fleet_store.py::test_local_tier_refuses_links``.
"""

from __future__ import annotations

import os
import re
import stat
import uuid

from .errors import UnsafeLayoutError

DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
TEMP_NAME_RE = re.compile(r"\.tmp-[0-9]+-[0-9a-f]{32}")  # names of the temporary files (fullmatch)


def file_kind(mode: int) -> str:
    """``"a symbolic link"``, ``"a directory"``, ``"a FIFO"``, ... for an ``st_mode``."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def open_dir(path, *, dir_fd: int | None = None) -> int:
    """A descriptor of the directory ``path`` (relative to ``dir_fd`` when given), its last
    component not followed: a link there raises ``OSError`` (``ELOOP``/``ENOTDIR``)."""
    return os.open(path, DIR_FLAGS, dir_fd=dir_fd)


def read_regular_file(name: str, *, dir_fd: int, max_bytes: int, expected_size: int | None = None) -> bytes:
    """Read the regular file ``name`` (relative to ``dir_fd``) whole, never following a link and
    never blocking on a FIFO or device. Raises ``FileNotFoundError`` if absent and
    :class:`UnsafeLayoutError` (before reading a byte) if it is not a regular file, is larger than
    ``max_bytes`` or its size is not ``expected_size``."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeLayoutError(f"{name} is {file_kind(st.st_mode)}, not a regular file")
    fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the lstat and the open
            raise UnsafeLayoutError(f"{name} is {file_kind(st.st_mode)}, not a regular file")
        if expected_size is not None and st.st_size != expected_size:
            raise UnsafeLayoutError(f"{name} has {st.st_size} bytes, its row says {expected_size}")
        if st.st_size > max_bytes:
            raise UnsafeLayoutError(f"{name} has {st.st_size} bytes, more than the {max_bytes} the store reads")
        parts, size = [], st.st_size
        while size > 0:
            part = os.read(fd, min(size, 0x7FFFF000))  # one read for any entry (Linux's per-call maximum)
            if not part:
                break
            parts.append(part)
            size -= len(part)
        if size or os.read(fd, 1):
            raise UnsafeLayoutError(f"{name} changed size while being read")
        return parts[0] if len(parts) == 1 else b"".join(parts)  # (an empty file: b"")
    finally:
        os.close(fd)


def temp_name() -> str:
    """A fresh temporary file name of this process (matches :data:`TEMP_NAME_RE`)."""
    return f".tmp-{os.getpid()}-{uuid.uuid4().hex}"


def abandoned_temp(name: str) -> bool:
    """Whether ``name`` is a temporary file (:data:`TEMP_NAME_RE`) that no write can still be making:
    the process named in it is not alive on this host. A file of this process, or of a live one, may be
    a write in flight (another thread's, another worker's beside this one): not abandoned."""
    if TEMP_NAME_RE.fullmatch(name) is None:
        return False
    pid = int(name.split("-")[1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):  # gone, or not a pid this host can have
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def atomic_write(dir_fd: int, name: str, data: bytes, *, durable: bool = True, phase=None) -> None:
    """Write ``data`` as ``name`` relative to ``dir_fd``: temp file (``O_EXCL | O_NOFOLLOW``) ->
    write -> fsync -> rename -> fsync the directory (the fsyncs only when ``durable``). On any error
    the temporary file is removed and the error raised; ``name`` is then untouched. ``phase``: a
    callable told ``"temp_written"`` and ``"renamed"`` (the test seams of the store's protocol).
    The caller serialises writers of ``name``."""
    tmp = temp_name()
    try:
        fd = os.open(tmp, WRITE_FLAGS, 0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if phase is not None:
                phase("temp_written")
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if phase is not None:
            phase("renamed")
        if durable:
            fsync_dir(dir_fd)
    except BaseException:
        unlink(tmp, dir_fd)
        raise


def fsync_dir(dir_fd: int | None) -> None:
    """fsync an open directory so a rename inside it is durable (errors ignored: not all file
    systems support it)."""
    if dir_fd is None:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass


def unlink(name: str, dir_fd: int) -> bool:
    """Remove the directory entry ``name`` (a link itself, never its target); returns whether it
    did. A missing name, a directory or a refusal (``OSError``) is left alone (False)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        return False
    return True


def regular_files(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """``(name, lstat)`` of the regular files directly in ``dir_fd`` (links and other kinds left out)."""
    out = []
    for name in os.listdir(dir_fd):
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((name, st))
    return out
