"""Servers the soak owns, so it can restart them without touching the machine's own: a Redis with an
append-only file (the broker, restarted once), a PostgreSQL cluster (the database of the effects and of the
Django store, restarted once), and TCP forwarders through which the workers reach the store (cut for a while).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.proxy import TcpProxy  # the suite's own forwarder: cut() drops every connection

PG_BIN = Path(os.environ.get("SOAK_PG_BIN", "/usr/lib/postgresql/15/bin"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(port: int, *, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing answers on 127.0.0.1:{port} after {timeout}s") from None
            time.sleep(0.1)


class PrivateRedis:
    """``redis-server`` on a free port, its data in a folder of its own. ``appendfsync always``: a message the
    publisher was told is stored survives the restart (with ``everysec`` the last second may not)."""

    def __init__(self, workdir: Path, name: str) -> None:
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--logfile",
                str(self.dir / "redis.log"),
            ],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_for_port(self.port)
        import redis

        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 60
        while True:  # LOADING while it replays the append-only file
            try:
                client.ping()
                break
            except redis.exceptions.BusyLoadingError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        return self

    def kill(self) -> None:
        """SIGKILL: no chance to write anything more (the append-only file already holds every write)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(30)

    def restart(self, *, down_for: float = 2.0) -> None:
        self.kill()
        time.sleep(down_for)
        self.start()

    def stop(self) -> None:
        self.kill()


class PrivatePostgres:
    """A PostgreSQL cluster of its own (``initdb`` as the ``postgres`` user when run as root), on a free port."""

    def __init__(self, workdir: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="soak-pg-"))
        self.port = free_port()
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        self.log = workdir / "postgres.log"

    def _run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        prefix = ["runuser", "-u", "postgres", "--"] if self._as_postgres else []
        return subprocess.run([*prefix, *command], check=check, capture_output=True, stdin=subprocess.DEVNULL)

    def start(self) -> PrivatePostgres:
        if not (self.dir / "PG_VERSION").exists():
            self._run(str(PG_BIN / "initdb"), "-D", str(self.dir), "-A", "trust", "-U", "postgres", "--no-sync")
        log = self.dir / "server.log"
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=on -c max_connections=200"
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.dir), "-l", str(log), "-o", options, "-w", "start")
        wait_for_port(self.port)
        return self

    def restart(self) -> None:
        """Fast shutdown (every session cut, open transactions rolled back), then start again."""
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.dir), "-m", "fast", "-w", "stop")
        self.start()

    def stop(self) -> None:
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.dir), "-m", "immediate", "-w", "stop", check=False)
        server_log = self.dir / "server.log"
        if server_log.exists():
            shutil.copy(server_log, self.log)
        shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["PrivatePostgres", "PrivateRedis", "TcpProxy", "free_port", "wait_for_port"]
