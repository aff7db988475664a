"""Real ``celery worker`` / ``celery beat`` subprocesses that tests start, stop and SIGKILL."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from tests.support import zygote
from tests.support.services import BROKER_URLS, REDIS_URL

ROOT = Path(__file__).resolve().parents[2]
#: The app module the test subprocesses load.
PROJ_APP = "tests.proj.app"


def quick_redelivery(visibility: float = 3) -> dict[str, object]:
    """Redis transport options for a test whose unacked messages must come back quickly: a short
    ``visibility_timeout``, kombu's restore sweep every second (``unacked_restore_interval`` times
    ``unacked_restore_throttle``: 10 x 10 s by default), and a restore mutex of the test's own with a short
    expiry. A worker SIGKILLed in the middle of a sweep leaves kombu's mutex held for ``unacked_mutex_expire``
    (300 s by default): shared, it would stop every other test's sweeps for five minutes."""
    return {
        "visibility_timeout": visibility,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "unacked_mutex_key": f"unacked_mutex:{uuid.uuid4().hex[:12]}",
        "unacked_mutex_expire": 2,
    }


def proj_env(*, queue: str, broker: str = "redis", django: bool = False, **extra: str) -> dict[str, str]:
    """Environment for a ``tests.proj.app`` subprocess on ``broker``, consuming/publishing ``queue``.

    ``django=True``: the worker runs with the test Django settings, on the test process's test database.
    """
    database: dict[str, str] = {}
    if django:
        from django.db import connection

        database = {
            "GUARDRAILS_TEST_DB_NAME": str(connection.settings_dict["NAME"]),
            "GUARDRAILS_TEST_DB": os.environ.get("GUARDRAILS_TEST_DB", "sqlite"),
        }
    return {
        # Without django=True a plain Celery app: the pytest-django variable would switch on the Django fixup.
        "DJANGO_SETTINGS_MODULE": "tests.django_settings" if django else "",
        **database,
        "GUARDRAILS_TEST_BROKER_URL": BROKER_URLS[broker],
        "GUARDRAILS_TEST_REDIS_URL": REDIS_URL,
        "GUARDRAILS_TEST_QUEUE": queue,
        **extra,
    }


#: Every process a test started, in order: a failed test's logs are printed and kept (tests/conftest.py).
STARTED: list[CeleryProcess] = []


class CeleryProcess:
    """A ``celery`` subprocess in its own process group, output captured in a log file."""

    ready_text: str | None = None

    def __init__(self, command: Sequence[str], *, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.command = [sys.executable, "-m", "celery", *command]
        self.log_path = log_path
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.process: subprocess.Popen[bytes] | zygote.ForkedProcess | None = None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, timeout: float = 45.0) -> CeleryProcess:
        STARTED.append(self)
        with self.log_path.open("wb") as out:
            self.process = zygote.spawn(self.command, cwd=ROOT, env=self.env, stdout=out.fileno(), stderr=out.fileno())
        if self.ready_text is None:
            return self
        deadline = time.monotonic() + timeout
        while self.ready_text not in self.log:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.command} exited with {self.process.returncode}:\n{self.log}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.command} not ready after {timeout}s:\n{self.log}")
            time.sleep(0.1)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group (main process and pool children)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)

    def stop(self, timeout: float = 15.0, *, group: bool = True) -> int | None:
        """SIGTERM, then SIGKILL to the group when it hangs. ``group=False`` sends the SIGTERM to the main process
        only, as a deployment does (``celery multi stopwait``, Kubernetes, ``docker stop``): the pool's children
        end their deliveries and exit through Celery's own shutdown (``worker_process_shutdown``). To the group,
        the children get it too, and billiard turns it into a ``SystemExit`` wherever a child is: between a
        delivery's result and its last bookkeeping, say."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            if group:
                self.kill(signal.SIGTERM)
            else:
                os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.process.wait(timeout)
        return self.process.returncode

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def __enter__(self) -> CeleryProcess:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()


class WorkerProcess(CeleryProcess):
    """``celery -A <app> worker`` consuming one queue."""

    ready_text = " ready."

    def __init__(
        self,
        *,
        app: str,
        queue: str,
        log_path: Path,
        pool: str = "prefork",
        concurrency: int = 1,
        env: dict[str, str] | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        name = f"gr-{uuid.uuid4().hex[:8]}@%h"
        #: Its node name, as remote control addresses it (``destination=[worker.hostname]``).
        self.hostname = name.replace("%h", socket.gethostname())
        super().__init__(
            [
                "-A",
                app,
                "worker",
                "-P",
                pool,
                "-c",
                str(concurrency),
                "-Q",
                queue,
                "-n",
                name,
                "-l",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                *extra,
            ],
            log_path=log_path,
            env=env,
        )


class BeatProcess(CeleryProcess):
    """``celery -A <app> beat`` with its schedule file in a temporary folder."""

    def __init__(
        self,
        *,
        app: str,
        workdir: Path,
        env: dict[str, str] | None = None,
        scheduler: str | None = None,
        name: str = "beat",
    ) -> None:
        chosen = ["-S", scheduler] if scheduler else []
        super().__init__(
            ["-A", app, "beat", "-l", "INFO", "-s", str(workdir / f"{name}-schedule"), "--pidfile=", *chosen],
            log_path=workdir / f"{name}.log",
            env=env,
        )


class WatchdogLoop(CeleryProcess):
    """``python -m tests.support.watchdog_loop``: the watchdog's check in a loop, no turn taken."""

    ready_text = "watchdog loop: first check done"

    def __init__(self, *, log_path: Path, env: dict[str, str] | None = None) -> None:
        super().__init__([], log_path=log_path, env=env)
        self.command = [sys.executable, "-m", "tests.support.watchdog_loop"]
