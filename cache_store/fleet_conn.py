"""The fleet store's connections to PostgreSQL: session settings, bounded waits, reconnects, errors.

A handle holds one connection for writes and one for reads (a read-only session), each in a
:class:`Slot` (opened on first use, reopened when broken, with the lock of the threads sharing
it); the change feed and ``verify`` open their own. Every connection gets ``connect_timeout``
(3 s), ``statement_timeout`` (5 s), ``lock_timeout`` (the store's time bound), TCP keepalives and
``tcp_user_timeout``, and each call runs under a client-side :class:`Deadline` (7 s) that shuts
the socket down when a call overruns (a server that stopped answering). :meth:`Connections.call`
waits at most the time bound for another thread using the same connection
(:class:`~chorus.cache_store.errors.StoreBusyError`), pings a reused connection first, and maps
PostgreSQL's errors onto the store's by SQLSTATE (``pg_errors.py``). Credentials come from the
URL, the environment or a pgpass file, as libpq reads them, and never appear in a message or log
(``redaction.py``). Tested in ``tests/test_fleet_store.py`` (bounded waits against a frozen
server, reconnects, credentials, pgpass, sslmode) and ``tests/test_fleet_hostile.py`` (SQLSTATE
mapping, reads beside writes).
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from .errors import MissingDriverError, StoreBusyError, StoreReadOnlyError, StoreUnavailableError
from .pg_errors import first_line, translate
from .redaction import RedactingFilter, redact

LOG = logging.getLogger(__name__)
LOG.addFilter(RedactingFilter())

CONNECT_TIMEOUT_S = 3
STATEMENT_TIMEOUT_MS = 5000
LOCK_TIMEOUT_MS = 2000  # the default; the store's time bound (errors.store_timeout) sets it
CALL_DEADLINE_S = 7.0  # client side: statement_timeout + margin for the transfer


def psycopg_module():
    """The ``psycopg`` module; :class:`~chorus.cache_store.errors.MissingDriverError` without it."""
    try:
        import psycopg
    except ImportError:
        raise MissingDriverError("the fleet store (CHORUS_CACHE_URL=postgresql://...) needs psycopg 3: "
                                 "pip install 'chorus-ii[fleet]' (or pip install 'psycopg[binary]')") from None
    return psycopg


class Connection:
    """One psycopg connection with the store's session settings and a client-side deadline."""

    def __init__(self, params: dict, secrets, lock_timeout_ms: int = LOCK_TIMEOUT_MS, read_only: bool = False):
        psycopg = psycopg_module()
        self.secrets = secrets
        try:
            self.conn = psycopg.connect(**params, autocommit=True)
        except psycopg.Error as exc:
            raise StoreUnavailableError(f"PostgreSQL unreachable: {redact(first_line(exc), secrets)}") from None
        try:
            self.conn.execute("SELECT set_config('statement_timeout', %s, false), set_config('lock_timeout', %s, false)",
                              (str(STATEMENT_TIMEOUT_MS), str(int(lock_timeout_ms))))
            if read_only:  # a read connection: the server refuses any write made through it
                self.conn.execute("SET default_transaction_read_only = on")
        except psycopg.Error as exc:
            self.close()
            raise StoreUnavailableError(f"PostgreSQL session setup failed: {redact(first_line(exc), secrets)}") from None

    def deadline(self, seconds: float = CALL_DEADLINE_S):
        """Context manager: past ``seconds`` the socket is shut down, so a blocked call returns."""
        return Deadline(self.conn, seconds)

    @property
    def broken(self) -> bool:
        return self.conn.closed or self.conn.broken

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass


class Deadline:
    """Context manager of :meth:`Connection.deadline`: a timer that shuts the socket down."""

    def __init__(self, conn, seconds: float):
        self.conn, self.seconds, self.fired = conn, seconds, False
        self.timer = None

    def _fire(self):
        self.fired = True
        try:
            fd = self.conn.pgconn.socket
            socket.socket(fileno=os.dup(fd)).shutdown(socket.SHUT_RDWR)
        except Exception:  # noqa: BLE001 - already closed
            pass

    def __enter__(self):
        self.timer = threading.Timer(self.seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        return False


class Slot:
    """A connection of the handle (opened on first use, reopened when broken) and the lock of the
    threads that share it."""

    def __init__(self, name: str, read_only: bool):
        self.name, self.read_only = name, read_only
        self.lock = threading.RLock()
        self.conn: Connection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

class Connections:
    """The connections of one fleet store handle (see the module docstring).

    ``url``: a PostgreSQL URL (``ValueError`` when it does not parse; the message does not repeat
    it). ``workspace`` names the workspace in messages; ``timeout`` is the store's time bound;
    ``readonly``: the write slot is a read-only session too and :meth:`check_writable` refuses.
    ``connected`` says how the last call went (an outage is logged once); :attr:`url` is safe to show.
    """

    def __init__(self, url: str, workspace: str, *, timeout: float, readonly: bool):
        psycopg = psycopg_module()
        try:
            params = psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.Error:
            raise ValueError("the cache URL does not parse as a PostgreSQL connection URL") from None
        params.setdefault("connect_timeout", str(CONNECT_TIMEOUT_S))
        params.setdefault("application_name", "chorus-fleet")
        for key, value in (("keepalives", "1"), ("keepalives_idle", "5"), ("keepalives_interval", "2"),
                           ("keepalives_count", "3"), ("tcp_user_timeout", str(int(CALL_DEADLINE_S * 1000)))):
            params.setdefault(key, value)
        self.params = params
        self.secrets = [s for s in (params.get("password"), os.environ.get("PGPASSWORD")) if s]
        self.url = redact(url, self.secrets)  # safe to show
        self.workspace = workspace
        self.timeout = timeout
        self.readonly = readonly
        self.write = Slot("write", read_only=readonly)
        self.read = Slot("read", read_only=True)
        self.connected = False
        self.closed = False

    def connect(self, name: str = "write", read_only: bool = False) -> Connection:
        """A new connection; ``name`` (``write``, ``read``, ``feed``, ``verify``) tells it apart in
        ``pg_stat_activity``: ``application_name`` is ``chorus-fleet`` for writes, else
        ``chorus-fleet-<name>``."""
        params = dict(self.params)
        if name != "write":
            params["application_name"] = f"{params['application_name']}-{name}"
        return Connection(params, self.secrets, lock_timeout_ms=int(self.timeout * 1000), read_only=read_only)

    def check_writable(self) -> None:
        if self.readonly:
            raise StoreReadOnlyError(f"fleet workspace {self.workspace} was opened read-only; nothing was written")

    def close(self) -> None:
        """Refuse further calls and close the write and read connections."""
        self.closed = True
        for slot in (self.write, self.read):
            with slot.lock:
                slot.close()

    def call(self, fn, *args, deadline: float = CALL_DEADLINE_S, read: bool = False, wait: bool = True,
              slot: Slot | None = None):
        """Run ``fn(conn, *args)`` on the read or write connection (or ``slot``), reconnecting as
        needed, within ``deadline`` seconds. Waits at most the time bound for another thread using
        that connection (not at all unless ``wait``): past it :class:`StoreBusyError`. PostgreSQL's
        errors leave as the store's (:func:`pg_errors.translate`)."""
        if self.closed:
            raise StoreUnavailableError("the fleet store is closed")
        slot = slot or (self.read if read else self.write)
        if not slot.lock.acquire(timeout=self.timeout if wait else 0):
            held = f"for the time bound ({self.timeout:g} s)" if wait else "this instant"
            raise StoreBusyError(f"fleet workspace {self.workspace}: another thread of this process kept its {slot.name} "
                                 f"connection busy {held}; nothing was changed")
        try:
            return self._call_on(slot, fn, args, deadline)
        finally:
            slot.lock.release()

    def _call_on(self, slot: Slot, fn, args, deadline: float):
        psycopg = psycopg_module()
        fresh = False
        if slot.conn is None or slot.conn.broken:
            slot.close()
            try:
                slot.conn = self.connect(slot.name, read_only=slot.read_only)
            except StoreUnavailableError as exc:
                self._down(str(exc))
                raise
            fresh = True
        conn = slot.conn
        if not fresh:  # a reused connection may have died with a server restart: ping first
            try:
                with conn.deadline(CONNECT_TIMEOUT_S):
                    conn.conn.execute("SELECT 1")
            except psycopg.Error:
                slot.close()
                return self._call_on(slot, fn, args, deadline)
        guard = conn.deadline(deadline)
        try:
            with guard:
                result = fn(conn.conn, *args)
            self.connected = True
            return result
        except psycopg.Error as exc:
            error, drop = translate(exc, workspace=self.workspace, timeout=self.timeout, secrets=self.secrets,
                                    deadline_fired=deadline if guard.fired else None, reading=slot.read_only)
            if drop:
                slot.close()
                if isinstance(error, StoreUnavailableError):
                    self._down(str(error))
            raise error from None

    def _down(self, reason: str) -> None:
        if self.connected:  # logged once per outage (a failed open is reported by its exception)
            LOG.warning("Chorus fleet store %s: %s", self.url, reason)
        self.connected = False
