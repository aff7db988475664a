"""A real ``celery worker`` the test kit starts, SIGKILLs and starts again, with the kit's agent inside."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from celery_guardrails.testing import events

#: Seconds a worker may take to start consuming (an import of a large project on a busy machine).
START_BOUND = 90.0
#: The pools a kit worker can run.
POOLS = ("solo", "threads", "prefork")


class Started(Protocol):
    """What the kit needs of a started worker process: what :class:`subprocess.Popen` offers."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


#: Starts the worker's command: ``launcher(command, env=..., stdout=<descriptor>)``.
Launcher = Callable[..., Started]


def start_process(command: Sequence[str], *, env: dict[str, str], stdout: int) -> subprocess.Popen[bytes]:
    """The default launcher: ``command`` as a subprocess in a session of its own (so that one ``killpg`` takes
    the main process and every pool child), its output and errors to ``stdout``, no input.

    Another launcher (the ``guardrails_launcher`` ini option) must do the same: a process of its own, in a new
    session, with exactly this environment; it may start it differently (under coverage, from a fork server)."""
    return subprocess.Popen(
        list(command),
        env=env,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


class WorkerFailed(AssertionError):
    """The kit's worker did not start or stopped by itself; the message carries the end of its log."""


class GuardedWorker:
    """``celery -A <app> worker`` consuming the kit's own queue, in a process group of its own (so that a
    SIGKILL takes the main process and every pool child at once, as a machine that dies does)."""

    def __init__(
        self,
        *,
        app: str,
        celery_app: Any,
        folder: Path,
        queue: str,
        pool: str = "prefork",
        concurrency: int = 2,
        env: dict[str, str] | None = None,
        arguments: Sequence[str] = (),
        launcher: Launcher = start_process,
    ) -> None:
        if pool not in POOLS:
            raise ValueError(f"pool {pool!r}: one of {', '.join(POOLS)}")
        self.app, self.celery_app, self.folder, self.queue = app, celery_app, folder, queue
        self.pool, self.concurrency = pool, concurrency
        self.env = dict(env or {})
        self.arguments = list(arguments)
        self.launcher = launcher
        self.process: Started | None = None
        #: The node name, kept across restarts as a restarted worker's is: the guardrails judge a claim left by
        #: a process of this very worker (gone after a kill) by it, and take it over at once.
        self.name = f"kit-{uuid.uuid4().hex[:8]}@%h"
        self.starts = 0
        #: How many times the worker was SIGKILLed (by the kit, or by the agent's plan).
        self.kills = 0
        #: Task ids of the messages given back after a kill (Redis), in order.
        self.returned: list[str] = []
        #: Whether the broker is Redis (where the kit gives back what a dead worker held).
        with celery_app.connection_for_write() as connection:  # not connected: the transport class tells
            self.redis_broker = connection.transport.driver_type == "redis"

    @property
    def log_path(self) -> Path:
        return self.folder / f"worker-{self.starts}.log"

    @property
    def log(self) -> str:
        """The output of every start of the worker, oldest first."""
        parts = []
        for number in range(1, self.starts + 1):
            path = self.folder / f"worker-{number}.log"
            if path.exists():
                parts.append(f"--- start {number} ---\n" + path.read_text(errors="replace"))
        return "\n".join(parts)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "celery_guardrails.testing.agent",
            "-A",
            self.app,
            "worker",
            "-P",
            self.pool,
            "-c",
            str(1 if self.pool == "solo" else self.concurrency),
            "-Q",
            self.queue,
            "-n",
            self.name,
            "-l",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            *self.arguments,
        ]

    def start(self, timeout: float = START_BOUND) -> GuardedWorker:
        """Start the worker and wait until it consumes."""
        if self.alive:
            return self
        ready_before = self._ready_count()
        self.starts += 1
        environment = {
            **os.environ,
            # The test's own import path: the worker imports the project as the test did.
            "PYTHONPATH": os.pathsep.join(path for path in sys.path if path),
            "GUARDRAILS_KIT_DIR": str(self.folder),
            "GUARDRAILS_KIT_QUEUE": self.queue,
            **self.env,
        }
        with self.log_path.open("wb") as out:
            self.process = self.launcher(self.command(), env=environment, stdout=out.fileno())
        deadline = time.monotonic() + timeout
        while self._ready_count() <= ready_before:
            if self.process.poll() is not None:
                raise WorkerFailed(f"the kit's worker exited with {self.process.returncode}:\n{self._tail()}")
            if time.monotonic() > deadline:
                self.kill(give_back=False)
                raise WorkerFailed(f"the kit's worker was not ready after {timeout:g}s:\n{self._tail()}")
            time.sleep(0.05)
        return self

    def kill(self, *, give_back: bool = True) -> None:
        """SIGKILL the worker (main process and pool children), wait for it, and let its unacked messages
        come back as the broker would once it notices (see :func:`give_back`)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.kills += 1
        self.process.wait(30)
        self._reap_group()
        if give_back:
            self.give_back()

    def died(self) -> bool:
        """Whether the worker is gone by itself (its agent SIGKILLed it); then it is waited for and its
        messages given back, ready for :meth:`start`."""
        if self.process is None or self.process.poll() is None:
            return False
        self.kills += 1
        self._reap_group()
        self.give_back()
        return True

    def terminate(self) -> None:
        """Send SIGTERM (Celery's warm shutdown: running tasks finish, nothing new starts) without waiting."""
        if self.alive:
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):  # the main process only, as Celery asks
                os.kill(self.process.pid, signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int | None:
        """A warm shutdown (SIGTERM), as a deployment does; SIGKILL when it hangs."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap_group()
        return self.process.returncode

    def restart(self) -> GuardedWorker:
        """Kill the worker if it runs, then start it again."""
        if self.alive:
            self.kill()
        return self.start()

    def give_back(self) -> int:
        """Put the messages of the kit's queue the dead worker held unacked back at the head of the queue.

        On RabbitMQ the broker does it as soon as the connection drops. kombu's Redis transport does it only
        after ``visibility_timeout`` (an hour by default), from another worker's restore sweep: the kit does
        at once what that sweep would do later (kombu's own ``QoS.restore_by_tag``), so that a test need not
        wait an hour. Only the kit's own queue is touched; its worker is dead, so nothing else holds them."""
        with self.celery_app.connection_for_write() as connection:
            if connection.transport.driver_type != "redis":
                return 0
            channel = connection.default_channel
            client = channel.client
            tags = []
            for tag, raw in client.hgetall(channel.unacked_key).items():
                with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                    payload, _, routing_key = json.loads(raw)
                    if routing_key == self.queue:
                        tags.append(tag)
                        self.returned.append(str(payload["headers"]["id"]))
            for tag in tags:
                channel.qos.restore_by_tag(tag, leftmost=True)
            return len(tags)

    def _ready_count(self) -> int:
        return sum(1 for event in events.read(self.folder / "events.jsonl") if event["e"] == "ready")

    def _reap_group(self) -> None:
        """Wait until no process of the worker's group is left (a pool child outliving its parent would go
        on consuming)."""
        if self.process is None:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            time.sleep(0.05)

    def _tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-lines:])
