"""The Celery app ``make bench`` measures: the same no-op task in each kind, on one worker process.

Configured from the environment by bench.py: BENCH_REDIS_URL (broker, results), BENCH_QUEUE, BENCH_STORE
("redis" or "django"), BENCH_RUN (keeps idempotency keys of different runs apart).
"""

import os

from celery import Celery

from celery_guardrails import GuardedTask

REDIS = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
RUN = os.environ.get("BENCH_RUN", "run")

app = Celery("bench", broker=REDIS, backend=REDIS)
app.conf.update(
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    guardrails={
        "store": "django" if os.environ.get("BENCH_STORE") == "django" else REDIS,
        "dead_letter_sinks": ["redis"],
        "alert_channels": ["log"],
    },
)


@app.task
def plain(n: int) -> int:
    return n


@app.task(acks_late=True)
def plain_acks_late(n: int) -> int:
    return n


@app.task(base=GuardedTask, owner="bench")
def guarded(n: int) -> int:
    return n


@app.task(base=GuardedTask, owner="bench", idempotency_key="bench-" + RUN + ":{n}")
def guarded_key(n: int) -> int:
    return n


@app.task(base=GuardedTask, owner="bench", dependency="bench-dependency", retry_budget_floor=1000)
def guarded_dependency(n: int) -> int:
    return n
