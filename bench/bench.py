"""``make bench``: what the guardrails cost, as ratios against plain Celery measured in the same run.

A real embedded worker (solo pool) on the local Redis runs N no-op tasks of each kind; for each kind the
publish time (N x delay) and the end-to-end time (publish, then wait for every result) are measured, three
rounds, best kept. Kinds: a plain Celery task; a GuardedTask; a GuardedTask with a dependency (a store round
trip to admit each run and one to record its outcome). Prints ratios to plain Celery; asserts nothing.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("DJANGO_SETTINGS_MODULE", None)

from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_guardrails import GuardedTask

REDIS = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
N = int(os.environ.get("BENCH_TASKS", "300"))

app = Celery("bench", broker=REDIS, backend=REDIS)
app.conf.update(
    task_default_queue=f"bench-{uuid.uuid4().hex[:8]}",
    guardrails={"store": REDIS},
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)


@app.task
def plain() -> int:
    return 1


@app.task(base=GuardedTask)
def guarded() -> int:
    return 1


@app.task(base=GuardedTask, dependency="bench-dependency", retry_budget_floor=1000)
def guarded_dependency() -> int:
    return 1


def measure(task: object) -> tuple[float, float]:
    start = time.perf_counter()
    results = [task.delay() for _ in range(N)]  # type: ignore[attr-defined]
    published = time.perf_counter() - start
    for result in results:
        result.get(timeout=120)
    return published, time.perf_counter() - start


def main() -> None:
    import celery.contrib.testing.tasks  # noqa: F401  (the ping task start_worker checks)

    with start_worker(app, pool="solo", perform_ping_check=True, loglevel="ERROR"):
        best: dict[str, tuple[float, float]] = {}
        for _ in range(3):
            for task in (plain, guarded, guarded_dependency):
                publish, total = measure(task)
                name = task.name.rsplit(".", 1)[-1]
                old = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(old[0], publish), min(old[1], total))
    base_publish, base_total = best["plain"]
    print(f"{N} no-op tasks, embedded solo worker on {REDIS}, best of 3 rounds")
    print(f"{'kind':<20} {'publish s':>10} {'ratio':>7} {'end-to-end s':>13} {'ratio':>7} {'tasks/s':>9}")
    for name, (publish, total) in best.items():
        print(
            f"{name:<20} {publish:>10.3f} {publish / base_publish:>7.2f} {total:>13.3f} "
            f"{total / base_total:>7.2f} {N / total:>9.0f}"
        )


if __name__ == "__main__":
    main()
