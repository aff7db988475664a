"""A redis-server of the test's own, for a test that kills the broker and starts it again.

The shared Redis on 6379 is never stopped or restarted (other suites and engineers use it): a test that needs
a Redis to take away starts this one on a free port, in its temporary folder, with an append-only file
fsynced on every write, so what it acknowledged before a SIGKILL is there when it starts again.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import redis

from tests.support.waiting import wait_for


def require_redis_server() -> str:
    """The redis-server program; skip (locally) or fail (CI) the calling test without it."""
    program = shutil.which("redis-server")
    if program is None:
        message = "redis-server is not installed (Debian package redis-server); `make services` installs it"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set, so this is a failure)", pytrace=False)
        pytest.skip(message)
    return program


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return int(probe.getsockname()[1])


class PrivateRedis:
    """``redis-server`` on 127.0.0.1:<free port>, data and log in ``workdir``; ``kill()`` then ``start()``
    again serves the same data on the same port."""

    def __init__(self, *, workdir: Path) -> None:
        self.program = require_redis_server()
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def client(self) -> redis.Redis[bytes]:
        return redis.Redis(port=self.port, socket_timeout=5)

    def answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.ConnectionError:
            return False

    def start(self) -> PrivateRedis:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                self.program,
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--dir", str(self.workdir),
                "--appendonly", "yes",
                "--appendfsync", "always",
                "--save", "",
                "--logfile", str(self.workdir / "redis.log"),
            ],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        wait_for(f"redis-server on port {self.port}", self.answers)
        return self

    def kill(self) -> None:
        """SIGKILL: the server goes without a word to its clients (a crash, an OOM kill)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self.process = None
