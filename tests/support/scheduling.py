"""A scheduled-work rig: real ``celery beat`` and ``celery worker`` processes on a clock the test moves.

Beat, worker, watchdog and test read one clock, :func:`celery_guardrails.foundation.clock.file_clock`: it stands still
until the test moves it (:meth:`Rig.set_clock`, :meth:`Rig.advance`). A period is due when the test says so,
and everything the processes do about it is waited for as a condition, never as a span of real time: a busy
machine makes a test slower, not wrong.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from celery_guardrails.foundation.clock import CLOCK_FILE_ENV, set_file_clock
from celery_guardrails.scheduling.ledger import Run
from celery_guardrails.stores.base import Store
from celery_guardrails.stores.redis import RedisStore
from tests.support.services import REDIS_URL
from tests.support.waiting import BOUND, wait_for
from tests.support.workers import PROJ_APP, BeatProcess, CeleryProcess, WatchdogLoop, WorkerProcess, proj_env

T = TypeVar("T")
GUARDED_SCHEDULER = "celery_guardrails.scheduling.beat:GuardedScheduler"
MINUTE = 60.0


def a_whole_minute() -> float:
    """A whole minute (epoch seconds) near the real time: the Redis ledger keeps records 90 days from it."""
    return (time.time() // MINUTE) * MINUTE


class Rig:
    """Entries (name -> beat entry dict), their policies, and the processes that run them."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        entries: dict[str, dict[str, Any]],
        policies: dict[str, dict[str, Any] | None],
        start: float | None = None,
        settings: dict[str, Any] | None = None,
        store: Store | None = None,
    ) -> None:
        self.tmp_path = tmp_path
        self.queue = f"gr-sched-{uuid.uuid4().hex[:8]}"
        self.clock_file = tmp_path / "clock"
        self.set_clock(a_whole_minute() if start is None else start)
        guardrails = {
            "schedules": policies,
            "clock": "celery_guardrails.foundation.clock.file_clock",
            "watchdog_interval": 0.5,
            **(settings or {}),
        }
        self.env = proj_env(
            queue=self.queue,
            GUARDRAILS_TEST_BEAT=json.dumps(entries),
            GUARDRAILS_TEST_GUARDRAILS=json.dumps(guardrails),
            **{CLOCK_FILE_ENV: str(self.clock_file)},
        )
        self.store = store or RedisStore(REDIS_URL)  # where the test reads the ledger: the processes' store
        self.processes: list[CeleryProcess] = []

    def now(self) -> float:
        """The rig's clock (epoch seconds)."""
        return float(self.clock_file.read_text())

    def set_clock(self, instant: float) -> None:
        set_file_clock(self.clock_file, instant)

    def advance(self, seconds: float) -> float:
        """Move the clock forward; the new time."""
        self.set_clock(self.now() + seconds)
        return self.now()

    def worker(self, *, concurrency: int = 1, name: str = "worker") -> WorkerProcess:
        worker = WorkerProcess(
            app=PROJ_APP,
            queue=self.queue,
            log_path=self.tmp_path / f"{name}.log",
            pool="threads" if concurrency > 1 else "solo",
            concurrency=concurrency,
            env=self.env,
        )
        self.processes.append(worker)
        worker.start()
        return worker

    def watchdog_loop(self, *, name: str = "watchdog") -> WatchdogLoop:
        """A process checking over and over, without the workers' turn (tests/support/watchdog_loop.py)."""
        loop = WatchdogLoop(log_path=self.tmp_path / f"{name}.log", env=self.env)
        self.processes.append(loop)
        loop.start()
        return loop

    def beat(self, *, name: str = "beat", scheduler: str = GUARDED_SCHEDULER) -> BeatProcess:
        beat = BeatProcess(app=PROJ_APP, workdir=self.tmp_path, env=self.env, scheduler=scheduler, name=name)
        self.processes.append(beat)
        beat.start()
        return beat

    def looking(self, beat: BeatProcess, *names: str) -> None:
        """Wait until ``beat`` has read the horizon of each entry: from then on, it dispatches a period the
        clock is moved past (moved before, it would start from the moved time, with nothing to catch up)."""
        self.wait(
            f"{beat.log_path.name} looking at {', '.join(names)}",
            lambda: all(f"Guarded beat entry {name!r}: periods after" in beat.log for name in names),
        )

    def runs(self, schedule: str) -> list[Run]:
        """The schedule's ledger, oldest period first."""
        return list(reversed(self.store.run_list(schedule, limit=1000)))

    def run_of(self, schedule: str, period: float) -> Run | None:
        return next((run for run in self.runs(schedule) if run.period == period), None)

    def wait(self, what: str, probe: Callable[[], T | None], timeout: float = BOUND) -> T:
        """Wait for ``probe`` (tests/support/waiting.py); a timeout shows the processes' logs."""
        try:
            return wait_for(what, probe, timeout=timeout)
        except AssertionError as exc:
            logs = "\n".join(f"--- {p.log_path.name}\n{p.log[-4000:]}" for p in self.processes)
            raise AssertionError(f"{exc}\n{logs}") from None

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
