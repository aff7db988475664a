"""``make bench``: what the guardrails cost, as ratios against plain Celery measured in the same run.

One real ``celery worker`` process (solo pool) on the local Redis runs N no-op tasks of each kind, published
from this process; each kind is measured end to end (publish N, wait for every result) once in each of
BENCH_ROUNDS rounds, and compared with plain Celery in the same round (the median of those ratios is
printed, with their range: this machine's speed drifts by more than the differences measured). Kinds:
plain Celery (early and late acks); GuardedTask; GuardedTask with an idempotency key; GuardedTask with a
dependency (retry budget). A first worker uses the Redis store, a second one the Django store (SQLite):
each prints its own plain baseline. For the Redis store it also counts, from Redis' own statistics, the
extra commands and round trips (script calls) per task over plain Celery. Prints ratios; asserts nothing.
"""

from __future__ import annotations

import gc
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
N = int(os.environ.get("BENCH_TASKS", "500"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "12"))
REDIS = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")


def redis_stats(client: Any) -> tuple[int, int]:
    """(commands processed, script calls) so far."""
    stats = client.info("commandstats")
    scripts = sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))
    return int(client.info("stats")["total_commands_processed"]), int(scripts)


@dataclass
class Measured:
    """One kind's end-to-end seconds in each round, and its Redis commands and script calls in the last."""

    seconds: list[float] = field(default_factory=list)
    commands: int = 0
    scripts: int = 0


def run_worker(store: str, kinds: list[str]) -> dict[str, Measured]:
    """Every kind measured in every round on one worker process."""
    env = {
        **os.environ,
        "BENCH_STORE": store,
        "BENCH_QUEUE": f"bench-{uuid.uuid4().hex[:8]}",
        "BENCH_RUN": uuid.uuid4().hex[:8],
        "BENCH_REDIS_URL": REDIS,
        "PYTHONPATH": str(ROOT),
        "EXAMPLE_LOG_LEVEL": "WARNING",
    }
    if store == "django":  # the worker sets Django up (Celery's fixup) on a fresh, migrated SQLite file
        env.update(
            {
                "DJANGO_SETTINGS_MODULE": "example_project.settings",
                "EXAMPLE_SQLITE_PATH": str(Path(tempfile.mkdtemp()) / "bench.sqlite3"),
            }
        )
        subprocess.run(
            [sys.executable, str(ROOT / "example_project" / "manage.py"), "migrate", "-v", "0"], env=env, check=True
        )
    else:
        env.pop("DJANGO_SETTINGS_MODULE", None)
    os.environ.update({k: env[k] for k in ("BENCH_STORE", "BENCH_QUEUE", "BENCH_RUN")})
    sys.modules.pop("bench.app", None)  # this run's queue and store (one store per process anyway)
    import redis

    from bench import app as bench_app

    client = redis.Redis.from_url(REDIS)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench.app",
            "worker",
            "-P",
            "solo",
            "-l",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        bench_app.plain.delay(0).get(timeout=60)  # the worker is up
        results = {name: Measured() for name in kinds}
        for round_ in range(ROUNDS):
            # Each round starts with another kind: the first measured after a pause ran measurably faster.
            shift = round_ % len(kinds)
            for index, name in enumerate(kinds[shift:] + kinds[:shift]):
                task = getattr(bench_app, name)
                before = redis_stats(client)
                start = time.perf_counter()
                pending = [task.delay((round_ * len(kinds) + index + 1) * N + i) for i in range(N)]
                for result in pending:
                    result.get(timeout=300)
                seconds = time.perf_counter() - start
                after = redis_stats(client)
                # Results unsubscribe from their channels when collected: here, not inside the next kind's
                # measurement (which paid for this kind's unsubscribes).
                del pending, result
                gc.collect()
                results[name].seconds.append(seconds)
                results[name].commands, results[name].scripts = after[0] - before[0], after[1] - before[1]
        return results
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(30)


def report(title: str, results: dict[str, Measured], *, counts: bool) -> None:
    """Per kind: its best time; throughput as the median over rounds of plain's time over its time in the
    same round (paired, so a slow spell of the machine slows both), with the lowest and highest."""
    base = results["plain"]
    print(f"\n{title}")
    print(
        f"{'kind':<20} {'best s':>7} {'tasks/s':>8} {'throughput':>10} {'(range)':>11}"
        + (f" {'+cmds/task':>10} {'+round trips/task':>17}" if counts else "")
    )
    for name, kind in results.items():
        ratios = [b / s for b, s in zip(base.seconds, kind.seconds, strict=True)]
        best = min(kind.seconds)
        line = (
            f"{name:<20} {best:>7.3f} {N / best:>8.0f} {statistics.median(ratios):>10.2f} "
            f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>11}"
        )
        if counts:
            line += f" {(kind.commands - base.commands) / N:>10.2f} {(kind.scripts - base.scripts) / N:>17.2f}"
        print(line)


def main() -> None:
    sys.path.insert(0, str(ROOT))
    if len(sys.argv) == 3 and sys.argv[1] == "--store":  # one store, in a process of its own
        if sys.argv[2] == "redis":
            kinds = ["plain", "plain_acks_late", "guarded", "guarded_key", "guarded_dependency"]
            report("Redis store", run_worker("redis", kinds), counts=True)
        else:
            report(
                "Django store (SQLite)",
                run_worker("django", ["plain", "guarded_key", "guarded_dependency"]),
                counts=False,
            )
        return
    print(
        f"{N} no-op tasks per kind, one `celery worker -P solo` process, broker and results on {REDIS}; "
        f"{ROUNDS} rounds",
        flush=True,
    )
    for store in ("redis", "django"):
        subprocess.run([sys.executable, __file__, "--store", store], check=True)
    print(
        "\nthroughput: plain Celery's end-to-end time over this kind's in the same round on the same worker "
        "(1.00 = as fast), median over the rounds (range: lowest-highest)."
    )
    print("GuardedTask acks late: 'plain_acks_late' separates the cost of that policy from the guardrails'.")
    print("Publisher, worker and Redis share this machine's cores: single rounds differ widely; read the median.")


if __name__ == "__main__":
    main()
