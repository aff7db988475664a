"""``make bench``: what the guardrails cost, as ratios against plain Celery measured in the same run.

A real embedded worker (solo pool) on the local Redis runs N no-op tasks of each kind; for each kind the
publish time (N x delay) and the end-to-end time (publish, then wait for every result) are measured over
BENCH_ROUNDS rounds, best kept. Kinds: plain Celery (early and late acks); GuardedTask; GuardedTask with an
idempotency key, on the Redis store and on the Django store (SQLite); GuardedTask with a dependency (retry
budget, Redis store). For the Redis store it also counts, from Redis' own statistics, the extra commands and
the extra round trips (script calls) per task over plain Celery. Prints; asserts nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(
    {
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        "EXAMPLE_SQLITE_PATH": str(Path(tempfile.mkdtemp()) / "bench.sqlite3"),
        "EXAMPLE_LOG_LEVEL": "WARNING",
    }
)

import django  # noqa: E402

django.setup()

import redis  # noqa: E402
from celery import Celery  # noqa: E402
from celery.contrib.testing.worker import start_worker  # noqa: E402
from django.core.management import call_command  # noqa: E402

from celery_guardrails import GuardedTask  # noqa: E402

REDIS = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
N = int(os.environ.get("BENCH_TASKS", "1000"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))

app = Celery("bench", broker=REDIS, backend=REDIS, set_as_current=True)
app.conf.update(
    task_default_queue=f"bench-{uuid.uuid4().hex[:8]}",
    guardrails={"store": REDIS},
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
RUN = uuid.uuid4().hex[:8]


@app.task
def plain(n: int) -> int:
    return n


@app.task(acks_late=True)
def plain_acks_late(n: int) -> int:
    return n


@app.task(base=GuardedTask)
def guarded(n: int) -> int:
    return n


@app.task(base=GuardedTask, idempotency_key="bench-" + RUN + ":{n}")
def guarded_key(n: int) -> int:
    return n


@app.task(base=GuardedTask, dependency="bench-dependency", retry_budget_floor=1000)
def guarded_dependency(n: int) -> int:
    return n


def redis_stats(client: Any) -> tuple[int, int]:
    """(commands processed, script calls) so far."""
    stats = client.info("commandstats")
    scripts = sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))
    return int(client.info("stats")["total_commands_processed"]), int(scripts)


def measure(task: Any, offset: int) -> tuple[float, float]:
    start = time.perf_counter()
    results = [task.delay(offset + i) for i in range(N)]
    published = time.perf_counter() - start
    for result in results:
        result.get(timeout=120)
    return published, time.perf_counter() - start


def main() -> None:
    import celery.contrib.testing.tasks  # noqa: F401  (the ping task start_worker checks)

    call_command("migrate", verbosity=0)
    client = redis.Redis.from_url(REDIS)
    kinds = [
        ("plain", plain, REDIS),
        ("plain, acks late", plain_acks_late, REDIS),
        ("guarded", guarded, REDIS),
        ("key, Redis store", guarded_key, REDIS),
        ("key, Django store", guarded_key, "django"),
        ("dependency, Redis", guarded_dependency, REDIS),
    ]
    best: dict[str, tuple[float, float]] = {}
    counted: dict[str, tuple[int, int]] = {}
    with start_worker(app, pool="solo", perform_ping_check=True, loglevel="ERROR"):
        for round_ in range(ROUNDS):
            for index, (name, task, store) in enumerate(kinds):
                app.conf.guardrails = {"store": store}
                before = redis_stats(client)
                publish, total = measure(task, offset=(round_ * len(kinds) + index) * N)
                after = redis_stats(client)
                counted[name] = (after[0] - before[0], after[1] - before[1])
                old = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(old[0], publish), min(old[1], total))
    base_publish, base_total = best["plain"]
    base_commands, base_scripts = counted["plain"]
    print(f"{N} no-op tasks, embedded solo worker, broker and results on {REDIS}; best of {ROUNDS} rounds")
    print(
        f"{'kind':<20} {'publish s':>9} {'ratio':>6} {'end-to-end s':>12} {'throughput':>10} "
        f"{'+cmds/task':>10} {'+round trips/task':>17}"
    )
    for name, (publish, total) in best.items():
        commands, scripts = counted[name]
        print(
            f"{name:<20} {publish:>9.3f} {publish / base_publish:>6.2f} {total:>12.3f} "
            f"{base_total / total:>10.2f} {(commands - base_commands) / N:>10.2f} "
            f"{(scripts - base_scripts) / N:>17.2f}"
        )
    print("throughput: plain Celery's end-to-end time over this kind's (1.00 = as fast as plain Celery).")
    print("GuardedTask acks late: 'plain, acks late' separates the cost of that policy from the guardrails'.")
    print("Publisher and worker share one process (and its GIL) here: expect a few percent of noise.")


if __name__ == "__main__":
    main()
