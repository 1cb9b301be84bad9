"""PostgreSQL's errors as the store contract's errors (``errors.py``), by SQLSTATE.

The fleet store (``fleet.py``) passes every ``psycopg`` exception of a store call through
:func:`translate`; no driver exception leaves a store call. The message names what happened and
what was (not) changed, with PostgreSQL's own first line (credentials removed, see
``redaction.py``) and its SQLSTATE; ``docs/OPERATIONS.md`` ("Fleet failure modes") promises these:

* 53100 disk full: :class:`StoreFullError` "PostgreSQL's disk is full ... nothing was written";
  other class-53 shortages: :class:`StoreError` "PostgreSQL ran out of resources ...";
* 25006 read-only transaction: :class:`StoreReadOnlyError` "PostgreSQL is read-only ... nothing
  was written" (the connection is dropped);
* 55P03 lock not available (``lock_timeout``): :class:`StoreBusyError` "... another worker held
  the write lock past the time bound (N s); nothing was changed";
* 40001 serialization failure, 40P01 deadlock: :class:`StoreBusyError` "... a concurrent
  transaction conflicted with this one ...; nothing was changed";
* 57014 query canceled (``statement_timeout``): :class:`StoreUnavailableError` "PostgreSQL did not
  answer in time";
* 08xxx, 57P0x (server shut down) and client-side failures without a SQLSTATE (a lost socket):
  :class:`StoreUnavailableError` "PostgreSQL connection lost" (the connection is dropped);
* 42501 insufficient privilege: :class:`StoreError` "PostgreSQL refused: permission denied";
* anything else: :class:`StoreError` "PostgreSQL error (SQLSTATE ...)".

A dropped connection is reopened by the next call (after a read-only error that may reach the
primary of a multi-host URL with ``target_session_attrs=read-write``). Tested against a real
server in ``tests/test_fleet_store.py::test_postgres_errors_map_to_store_errors_by_sqlstate``
(read-only, lock timeout, serialization failure, statement timeout provoked there; disk full, which
cannot be provoked safely, through a ``psycopg.errors.DiskFull`` raised inside a real transaction).
"""

from __future__ import annotations

from .errors import StoreBusyError, StoreError, StoreFullError, StoreReadOnlyError, StoreUnavailableError
from .redaction import redact


def first_line(exc) -> str:
    """The first line of an exception's text (its type name when empty)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def translate(exc, *, workspace: str, timeout: float, secrets=(), deadline_fired: float | None = None,
              reading: bool = False) -> tuple[StoreError, bool]:
    """``(the store error to raise for exc, whether the connection must be dropped)``.

    ``exc``: a ``psycopg.Error``; ``workspace``: named in the message; ``timeout``: the store's
    time bound (for lock timeouts); ``deadline_fired``: the seconds of the client-side deadline
    when it shut the socket (the server stopped answering), else None; ``reading``: the call only
    read (a lock it waited for was another worker's lock on a table, not the write lock)."""
    import psycopg

    code = getattr(exc, "sqlstate", None) or ""
    detail = redact(first_line(exc), secrets)
    where = f"fleet workspace {workspace}"
    if deadline_fired is not None:
        return StoreUnavailableError(f"PostgreSQL did not answer within {deadline_fired:.0f} s ({where})"), True
    if code == "53100":
        return StoreFullError(f"PostgreSQL's disk is full (SQLSTATE 53100: {detail}); nothing was written to {where}: "
                              "free space on the database server, or lower the fleet's max_bytes"), False
    if code.startswith("53"):
        return StoreError(f"PostgreSQL ran out of resources (SQLSTATE {code}: {detail}); nothing was written to "
                          f"{where}"), False
    if code == "25006":
        return StoreReadOnlyError(f"PostgreSQL is read-only (SQLSTATE 25006: {detail}): a standby, or "
                                  f"default_transaction_read_only is on; nothing was written to {where}"), True
    if code == "55P03":
        lock = "a lock on the fleet tables" if reading else "the write lock"
        return StoreBusyError(f"{where}: another worker held {lock} past the time bound ({timeout:g} s); "
                              "nothing was changed"), False
    if code in ("40001", "40P01"):
        return StoreBusyError(f"{where}: a concurrent transaction conflicted with this one (SQLSTATE {code}: "
                              f"{detail}); nothing was changed, the next call tries again"), False
    if code == "57014":
        return StoreUnavailableError(f"PostgreSQL did not answer in time (SQLSTATE 57014: {detail})"), False
    if code.startswith(("08", "57P")) or (not code and isinstance(exc, (psycopg.OperationalError,
                                                                          psycopg.InterfaceError))):
        return StoreUnavailableError(f"PostgreSQL connection lost ({detail})"), True
    if code == "42501":
        return StoreError(f"PostgreSQL refused: permission denied (SQLSTATE 42501: {detail}); grant the privileges "
                          "of docs/OPERATIONS.md (Fleet)"), False
    return StoreError(f"PostgreSQL error (SQLSTATE {code or 'none'}: {detail})"), False
