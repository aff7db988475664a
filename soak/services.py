"""Servers the soak owns, so it can restart them without touching the machine's own: a Redis with an
append-only file (the broker, restarted once; the suite's ``PrivateRedis``), a PostgreSQL cluster (the
database of the effects and of the Django store, restarted once), and TCP forwarders through which the workers
reach the store (cut for a while).
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

from tests.support.private_redis import PrivateRedis, free_port  # the suite's own: AOF fsynced always, same port again
from tests.support.proxy import TcpProxy  # the suite's own forwarder: cut() drops every connection

PG_BIN = Path(os.environ.get("SOAK_PG_BIN", "/usr/lib/postgresql/15/bin"))


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
