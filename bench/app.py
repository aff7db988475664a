"""The Celery app ``make bench`` measures: the same task in each kind, on one worker process.

Configured from the environment by bench.py: BENCH_REDIS_URL (broker, results), BENCH_QUEUE, BENCH_STORE
("redis" or "django"; the Django database is bench.settings'), BENCH_RUN (keeps idempotency keys of
different runs apart), BENCH_DB_REUSE_MAX (Celery's CELERY_DB_REUSE_MAX).

Every task takes ``done``: the name of a Redis list the task pushes its number to when it is given one
(the last task of a batch), so a batch whose results are ignored is waited for without a result backend.
The tasks whose names end in ``_insert`` INSERT one row (``tests.testapp.Effect``) in the Django database.
"""

import json
import os
from typing import Any

from celery import Celery

from celery_guardrails import GuardedTask

REDIS = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
RUN = os.environ.get("BENCH_RUN", "run")
KEY = "bench-" + RUN + ":{n}"

app = Celery("bench", broker=REDIS, backend=REDIS)
app.conf.update(
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    guardrails={
        "store": "django" if os.environ.get("BENCH_STORE") == "django" else REDIS,
        "dead_letter_sinks": ["redis"],
        "alert_channels": ["log"],
        # bench.py's variants: kombu's pop (broker_atomic_pop False), metrics recorded (metrics True)
        **json.loads(os.environ.get("BENCH_GUARDRAILS", "{}")),
    },
)

# Django-store variants (bench.py): Celery's Django fixup keeps the connections for this many tasks (unset: it
# closes them before and after every task).
if os.environ.get("BENCH_DB_REUSE_MAX"):
    app.conf["CELERY_DB_REUSE_MAX"] = int(os.environ["BENCH_DB_REUSE_MAX"])

_client: list[Any] = []


def finished(n: int, done: str) -> int:
    """Tell the publisher, when asked (``done`` names the list it waits on), that task ``n`` ran."""
    if done:
        if not _client:
            import redis

            _client.append(redis.Redis.from_url(REDIS))
        _client[0].rpush(done, n)
    return n


def insert(n: int) -> None:
    from tests.testapp.models import Effect

    Effect.objects.create(key=f"bench-{RUN}:{n}")


# Results stored (Celery's default).


@app.task
def plain(n: int, done: str = "") -> int:
    return finished(n, done)


@app.task(acks_late=True)
def plain_acks_late(n: int, done: str = "") -> int:
    return finished(n, done)


@app.task(base=GuardedTask, owner="bench")
def guarded(n: int, done: str = "") -> int:
    return finished(n, done)


@app.task(base=GuardedTask, owner="bench", idempotency_key=KEY)
def guarded_key(n: int, done: str = "") -> int:
    return finished(n, done)


@app.task(base=GuardedTask, owner="bench", dependency="bench-dependency", retry_budget_floor=1000)
def guarded_dependency(n: int, done: str = "") -> int:
    return finished(n, done)


# Results ignored: waited for through ``done``.


@app.task(ignore_result=True)
def plain_ignored(n: int, done: str = "") -> int:
    return finished(n, done)


@app.task(base=GuardedTask, owner="bench", ignore_result=True)
def guarded_ignored(n: int, done: str = "") -> int:
    return finished(n, done)


@app.task(base=GuardedTask, owner="bench", idempotency_key=KEY, ignore_result=True)
def guarded_key_ignored(n: int, done: str = "") -> int:
    return finished(n, done)


# One INSERT in the Django database: plain Celery in a transaction of its own, a GuardedTask without a key doing
# the same (what the guardrails cost without the store's key), and a keyed guarded task with ``atomic=True``
# (the body's transaction also commits the key's completion) or without.


@app.task
def plain_insert(n: int, done: str = "") -> int:
    from django.db import transaction

    with transaction.atomic():
        insert(n)
    return finished(n, done)


@app.task(base=GuardedTask, owner="bench")
def guarded_insert(n: int, done: str = "") -> int:
    from django.db import transaction

    with transaction.atomic():
        insert(n)
    return finished(n, done)


@app.task(base=GuardedTask, owner="bench", idempotency_key=KEY, atomic=True)
def guarded_key_atomic_insert(n: int, done: str = "") -> int:
    insert(n)
    return finished(n, done)


@app.task(base=GuardedTask, owner="bench", idempotency_key=KEY)
def guarded_key_insert(n: int, done: str = "") -> int:
    insert(n)
    return finished(n, done)


# The peers a keyed task is compared with (bench.py's redis_peers worker), on the same Redis: celery-once
# (an enqueue-time lock, released when the task returns) and celery-singleton (the same, and a duplicate publish
# gets the queued task's result). Each is keyed on ``n`` as guarded_key is. Imported only where installed (the
# suite extra has them).
try:
    from celery_once import QueueOnce
    from celery_singleton import Singleton
except ImportError:  # pragma: no cover - the bench's own environment has them
    pass
else:
    app.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": REDIS, "default_timeout": 3600}}
    app.conf.singleton_backend_url = REDIS
    app.conf.singleton_key_prefix = f"bench-{RUN}-singleton:"

    @app.task(base=QueueOnce, once={"graceful": True, "keys": ["n"]})
    def celery_once(n: int, done: str = "") -> int:
        return finished(n, done)

    @app.task(base=Singleton, unique_on=["n"])
    def celery_singleton(n: int, done: str = "") -> int:
        return finished(n, done)
