"""A throwaway PostgreSQL cluster for the fleet tests (``tests/test_fleet_*.py``): a real server,
never a mock.

:func:`cluster` starts one cluster per test process (``initdb`` in a fresh temp dir, the unix
socket in that dir, TCP on 127.0.0.1 at a free port) and returns it; it is stopped at the end of
the session (the modules' session fixtures call :meth:`Cluster.stop`, and ``atexit`` as a last
resort). PostgreSQL refuses to run as root, so as root every server command (``initdb``,
``postgres``) runs as the ``postgres`` user that Debian's ``postgresql`` package creates (a child
process with that uid, as ``runuser -u postgres --`` would, so that this process reaps it) and
the temp dir is owned by it. Where no cluster can be started (no ``initdb``, root without a
``postgres`` user, psycopg missing), :func:`require` skips the test with the reason (fails
under ``CHORUS_REQUIRE_FLEET=1``).

Authentication (``pg_hba.conf``): ``trust`` on the socket and on loopback, except the role
``chorus_pw``, which needs a SCRAM password over TCP (the credential tests).
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

PG_BIN_CANDIDATES = ["/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/17/bin"]

_CLUSTER = None
_FAILED: str | None = None


def _bin_dir() -> Path | None:
    for cand in PG_BIN_CANDIDATES:
        if (Path(cand) / "initdb").exists():
            return Path(cand)
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """One PostgreSQL cluster: ``url(db)`` gives a loopback URL, ``kill()`` SIGKILLs every server
    process (postmaster and backends), ``start()`` starts it again (crash recovery)."""

    proc: subprocess.Popen | None = None

    def __init__(self, primary: "Cluster | None" = None):
        """A new cluster, or with ``primary`` a streaming standby of it (``pg_basebackup -R``)."""
        self.bin = _bin_dir()
        if self.bin is None:
            raise RuntimeError("PostgreSQL's initdb not found (install Debian's postgresql package)")
        self.as_user = None
        if os.geteuid() == 0:
            try:
                self.as_user = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root and there is no postgres user (PostgreSQL refuses root)") from None
        self.tmp = Path(tempfile.mkdtemp(prefix="chorus_pg_"))
        os.chmod(self.tmp, 0o755)
        if self.as_user is not None:
            os.chown(self.tmp, self.as_user.pw_uid, self.as_user.pw_gid)
        self.data = self.tmp / "data"
        self.port = _free_port()
        self.log = self.tmp / "server.log"
        if primary is not None:
            self._run("pg_basebackup", "-D", str(self.data), "-h", "127.0.0.1", "-p", str(primary.port),
                      "-U", "postgres", "-X", "stream", "-R", "-c", "fast")
            (self.data / "postgresql.conf").open("a").write(
                f"\nport = {self.port}\nunix_socket_directories = '{self.tmp}'\n")
            self.start()
            return
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-instructions")
        (self.data / "postgresql.conf").open("a").write(
            f"\nlisten_addresses = '127.0.0.1'\nport = {self.port}\nunix_socket_directories = '{self.tmp}'\n"
            "max_connections = 200\nshared_buffers = 64MB\nfsync = on\nsynchronous_commit = on\n"
            "log_min_messages = warning\n")
        (self.data / "pg_hba.conf").write_text(
            "local all all trust\n"
            "host all chorus_pw 127.0.0.1/32 scram-sha-256\n"
            "host all all 127.0.0.1/32 trust\n"
            "host replication all 127.0.0.1/32 trust\n")
        self.start()

    def promote(self) -> None:
        """Promote a standby to primary (``pg_ctl promote``)."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

    def _user_kwargs(self) -> dict:
        if self.as_user is None:
            return {}
        return {"user": self.as_user.pw_uid, "group": self.as_user.pw_gid, "extra_groups": [],
                "env": dict(os.environ, HOME=str(self.tmp), USER="postgres", LOGNAME="postgres")}

    def _run(self, tool: str, *args: str, check: bool = True, timeout: float = 120):
        # As root: the tool runs as the postgres user (the equivalent of ``runuser -u postgres --``,
        # but as a direct child, so that this process reaps it: PID 1 of some containers does not).
        done = subprocess.run([str(self.bin / tool), *args], capture_output=True, text=True, timeout=timeout,
                              cwd=str(self.tmp), **self._user_kwargs())
        if check and done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}")
        return done

    def start(self, timeout: float = 60) -> None:
        """Start the postmaster as a child process and wait until it accepts connections."""
        log = open(self.log, "a")
        self.proc = subprocess.Popen([str(self.bin / "postgres"), "-D", str(self.data)], stdout=log,
                                     stderr=subprocess.STDOUT, cwd=str(self.tmp), **self._user_kwargs())
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            done = self._run("pg_isready", "-h", "127.0.0.1", "-p", str(self.port), "-t", "2", check=False)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not accept connections within {timeout:.0f} s: "
                                   f"{self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def server_pids(self) -> list[int]:
        """The postmaster and all its children (backends, walwriter, checkpointer, ...)."""
        import psutil

        pid = self.postmaster_pid()
        if pid is None:
            return []
        try:
            proc = psutil.Process(pid)
            return [pid] + [c.pid for c in proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """SIGKILL every server process at once (as a power cut of the server would), and wait."""
        import psutil

        pids = self.server_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)  # the postmaster is this process's child: reaped here
        deadline = time.monotonic() + 30
        for pid in pids[1:]:  # backends: gone or zombies (their parent died)
            while time.monotonic() < deadline:
                try:
                    if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                        break
                except psutil.NoSuchProcess:
                    break
                time.sleep(0.05)

    def url(self, db: str = "postgres", user: str = "postgres", **params) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"postgresql://{user}@127.0.0.1:{self.port}/{db}" + (f"?{query}" if query else "")

    def sql(self, statement: str, db: str = "postgres", params=None):
        """Run one statement as the superuser (autocommit); returns the rows, if any."""
        import psycopg

        with psycopg.connect(self.url(db), autocommit=True, connect_timeout=10) as conn:
            cur = conn.execute(statement, params)
            return cur.fetchall() if cur.description else None

    def new_database(self, prefix: str = "t") -> str:
        """A fresh, empty database; returns its name."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self.sql(f'CREATE DATABASE "{name}"')
        return name


def cluster() -> Cluster:
    """The process-wide cluster (started on first use). Raises ``RuntimeError`` if it cannot start."""
    global _CLUSTER, _FAILED
    if _CLUSTER is None:
        if _FAILED is not None:
            raise RuntimeError(_FAILED)
        try:
            import psycopg  # noqa: F401
        except ImportError:
            _FAILED = "psycopg (psycopg 3) is not installed: pip install 'psycopg[binary]'"
            raise RuntimeError(_FAILED) from None
        try:
            _CLUSTER = Cluster()
        except Exception as exc:  # noqa: BLE001 - becomes the skip reason
            _FAILED = f"cannot start a PostgreSQL cluster: {exc}"
            raise RuntimeError(_FAILED) from exc
        atexit.register(stop)
    return _CLUSTER


def stop() -> None:
    global _CLUSTER
    if _CLUSTER is not None:
        _CLUSTER.stop()
        _CLUSTER = None


def skip_reason() -> str | None:
    """None when a cluster runs (starting it if needed), else why not."""
    try:
        cluster()
    except RuntimeError as exc:
        return str(exc)
    return None


def require() -> Cluster:
    """The cluster for a test: skips with the reason where it cannot start, or fails when
    ``CHORUS_REQUIRE_FLEET=1`` (set by ``.ci/run`` where PostgreSQL is installed)."""
    import pytest

    try:
        return cluster()
    except RuntimeError as exc:
        if os.environ.get("CHORUS_REQUIRE_FLEET") == "1":
            pytest.fail(f"fleet test cannot start PostgreSQL although CI installed it (CHORUS_REQUIRE_FLEET=1): {exc}")
        pytest.skip(f"PostgreSQL not available: {exc}")


def connect(url: str):
    """A plain autocommit psycopg connection (for tests that write hostile rows directly)."""
    import psycopg

    return psycopg.connect(url, autocommit=True, connect_timeout=10)


def unique_writer(url: str, local: str, barrier, results, rounds: int = 8) -> None:
    """Child process of the fleet dedupe test: :func:`testing.add_same_requests` on a fleet store."""
    from chorus.cache_store.fleet import FleetStore
    from testing import add_same_requests

    add_same_requests(FleetStore.open(url, "race", local_path=Path(local)), barrier, results, rounds)


def raised(fn):
    """The exception ``fn()`` raised, or None (for a thread whose error the test inspects)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None
