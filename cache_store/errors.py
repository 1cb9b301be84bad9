"""Errors of the store contract (see README.md, "Store contract") and the time bound.

Every store (the one-host :class:`~chorus.cache_store.Workspace`, the fleet store) raises these
for problems of the store itself, so that callers on the prompt path can catch ``OSError`` (the
store) and ``ValueError`` (bad input, a damaged entry) and turn them into a miss or a write not
made, with the message:

* :class:`StoreError` (an ``OSError``): the store cannot serve the call: its metadata database is
  unreadable or damaged, its layout is unsafe (:class:`UnsafeLayoutError`), or it is busy
  (:class:`StoreBusyError`). ``sqlite3`` errors never leave a store call as such.
* :class:`StoreBusyError` (also a ``TimeoutError``): another process (or thread) held what the call
  needed for longer than the store's time bound; nothing was changed by the call.
* :class:`UnsafeLayoutError`: a path the store would read, write, move or delete is a symbolic
  link, is not the kind of file the store makes (a FIFO, a device, a directory where a file
  belongs), or would lead outside the workspace. The store refuses to use it.
* :class:`StoreUnavailableError` (also a ``ConnectionError``): the fleet's server could not be
  reached or did not answer in time.
* :class:`StoreFullError`: the store's disk is full (PostgreSQL's SQLSTATE 53100); nothing was
  written. (A one-host workspace raises the disk's own ``OSError``, ``ENOSPC``.)
* :class:`StoreReadOnlyError`: the store refuses writes: a handle opened read-only, or a
  PostgreSQL server that is read-only (a standby, ``default_transaction_read_only``; SQLSTATE
  25006); nothing was written.
* :class:`MissingDriverError` (an ``ImportError`` and a ``ValueError``): the fleet store was asked
  for but psycopg 3 is not installed.

How PostgreSQL's own errors map onto these (by SQLSTATE): ``pg_errors.py``.

Time bound: :func:`store_timeout` is how long a store call may wait for another process: the
``timeout`` a caller passes, else env ``CHORUS_CACHE_TIMEOUT`` (seconds), else
:data:`DEFAULT_TIMEOUT`.
"""

from __future__ import annotations

import math
import os

TIMEOUT_ENV = "CHORUS_CACHE_TIMEOUT"
DEFAULT_TIMEOUT = 2.0  # seconds a prompt-path store call may wait for another process
MAX_TIMEOUT = 86400.0  # the largest time bound accepted (seconds)


class StoreError(OSError):
    """The store cannot serve this call (damaged or unreadable metadata, unsafe layout, busy)."""


class StoreBusyError(StoreError, TimeoutError):
    """Another process or thread held the store past the time bound; the call changed nothing."""


class UnsafeLayoutError(StoreError):
    """A store path is a link, a non-regular file or leads outside the workspace; it is not used."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The store's server could not be reached or did not answer in time. The message never holds
    credentials."""


class StoreFullError(StoreError):
    """The store's disk is full; the call wrote nothing."""


class StoreReadOnlyError(StoreError):
    """The store refuses writes (a read-only handle or a read-only server); the call wrote nothing."""


class MissingDriverError(ImportError, ValueError):
    """The fleet store was asked for but psycopg 3 is not installed (a ``ValueError`` too, so that
    a node answers with a miss and a message instead of failing the prompt)."""


def store_timeout(timeout=None) -> float:
    """The time bound in seconds: ``timeout`` if given, else ``CHORUS_CACHE_TIMEOUT``, else
    :data:`DEFAULT_TIMEOUT`. Raises ``ValueError`` unless it is a finite number > 0 and at most
    :data:`MAX_TIMEOUT` (a day: past ``threading.TIMEOUT_MAX`` a lock wait raises ``OverflowError``)."""
    source = "timeout"
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT
        source, timeout = TIMEOUT_ENV, raw
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a number of seconds > 0, got {timeout!r}") from None
    if isinstance(timeout, bool) or not math.isfinite(value) or value <= 0 or value > MAX_TIMEOUT:
        raise ValueError(f"{source} must be a number of seconds > 0 and <= {MAX_TIMEOUT:g}, got {timeout!r}")
    return value
