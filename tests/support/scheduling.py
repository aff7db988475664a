"""A scheduled-work rig: real ``celery beat`` and ``celery worker`` processes on a fast shared clock.

Beat, worker and test read one clock (:func:`celery_guardrails.beat.accelerated_clock`) that runs ``speed``
times faster than real time, so a one-minute schedule passes in a few real seconds. Only the schedule
guardrails read it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from celery_guardrails.ledger import Run
from celery_guardrails.stores.redis import RedisStore
from tests.support.services import REDIS_URL
from tests.support.workers import PROJ_APP, BeatProcess, WorkerProcess, proj_env

T = TypeVar("T")
GUARDED_SCHEDULER = "celery_guardrails.beat:GuardedScheduler"


class Rig:
    """Entries (name -> beat entry dict), their policies, and the processes that run them."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        entries: dict[str, dict[str, Any]],
        policies: dict[str, dict[str, Any]],
        speed: float = 10.0,
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.tmp_path = tmp_path
        self.queue = f"gr-sched-{uuid.uuid4().hex[:8]}"
        self.t0, self.speed = time.time(), speed
        guardrails = {
            "schedules": policies,
            "clock": "celery_guardrails.beat.accelerated_clock",
            "watchdog_interval": 1.0,
            **(settings or {}),
        }
        self.env = proj_env(
            queue=self.queue,
            GUARDRAILS_CLOCK=f"{self.t0}:{speed}",
            GUARDRAILS_TEST_BEAT=json.dumps(entries),
            GUARDRAILS_TEST_GUARDRAILS=json.dumps(guardrails),
        )
        self.store = RedisStore(REDIS_URL)
        self.processes: list[Any] = []

    def now(self) -> float:
        """The rig's clock (epoch seconds, fast)."""
        return self.t0 + (time.time() - self.t0) * self.speed

    def real_seconds(self, clock_seconds: float) -> float:
        return clock_seconds / self.speed

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
        return worker.start()

    def beat(self, *, name: str = "beat", scheduler: str = GUARDED_SCHEDULER) -> BeatProcess:
        beat = BeatProcess(app=PROJ_APP, workdir=self.tmp_path, env=self.env, scheduler=scheduler, name=name)
        self.processes.append(beat)
        beat.start()
        return beat

    def runs(self, schedule: str) -> list[Run]:
        """The schedule's ledger, oldest period first."""
        return list(reversed(self.store.run_list(schedule, limit=1000)))

    def wait(self, what: str, probe: Callable[[], T | None], timeout: float = 60.0) -> T:
        """Poll ``probe`` until it returns something truthy; fail with the processes' logs after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = probe()
            if found:
                return found
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.log_path.name}\n{p.log[-4000:]}" for p in self.processes)
                raise AssertionError(f"timed out waiting for {what}\n{logs}")
            time.sleep(0.1)

    def sleep_until(self, clock_instant: float) -> None:
        time.sleep(max(0.0, self.real_seconds(clock_instant - self.now())))

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
