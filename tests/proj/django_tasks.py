"""Guarded tasks with database effects, for workers running with the test Django settings."""

from __future__ import annotations

import time
from typing import Any

import redis
from celery import shared_task

from celery_guardrails import GuardedTask
from tests.proj.tasks import REDIS_URL, seen


@shared_task(base=GuardedTask, bind=True, idempotency_key="effect:{key}", atomic=True)
def write_effect(self: GuardedTask, key: str, sink: str, hold: float = 0.0, gate: str | None = None) -> str:
    """Insert one Effect row; the first run may then hold (to be killed mid-transaction), ``hold`` seconds or
    until an item is pushed to the Redis list ``gate``."""
    from tests.testapp.models import Effect

    client = redis.Redis.from_url(REDIS_URL)
    runs = client.incr(f"{sink}:runs")
    seen(self, sink, run=runs, key=self.request.idempotency_key)
    Effect.objects.create(key=key)
    if hold and runs == 1:
        time.sleep(hold)
    if gate and runs == 1:
        client.rpush(f"{gate}:written", 1)  # the effect is written (uncommitted): the test may cut now
    if gate and runs == 1 and client.blpop([gate], timeout=120) is None:
        raise RuntimeError(f"gate {gate} never opened")
    return "written"


@shared_task(
    base=GuardedTask,
    bind=True,
    owner="payments",
    backoff_base=0.05,
    idempotent=True,
    # It carries test secrets and huge arguments on purpose: the dead letters' redaction and cuts are tested.
    allow_sensitive_payload="tests the dead letters' redaction of secrets",
    max_payload_bytes=0,
)
def fail_with(self: GuardedTask, step: str, card_number: str = "", **details: object) -> str:
    """Fails the way ``step`` says (for dead letters); ``card_number`` and ``details`` carry test secrets."""
    from celery_guardrails import PermanentError, RetryLater, TransientError

    if step == "permanent":
        raise PermanentError("card refused")
    if step == "transient":
        raise TransientError("provider down")
    if step == "later":
        raise RetryLater("not yet", delay=0.05)
    if step == "unknown":
        raise RuntimeError("no idea")
    if step == "leak":  # an error whose text carries secrets (a provider echoing the request back)
        raise TransientError(
            f"login refused: password=hunter2 Authorization: Bearer s3cr3t-t0ken, card {card_number} declined"
        )
    return "ok"


@shared_task(base=GuardedTask, bind=True)
def decline(self: GuardedTask, order_id: int, cause: str = "declined") -> None:
    """Fails for good for one cause per ``cause``, its message naming the order (dead letters' fingerprints)."""
    from celery_guardrails import PermanentError

    if cause == "declined":
        raise PermanentError(f"order {order_id} declined by provider account 'acct-{order_id}'")
    raise PermanentError(f"order {order_id}: card expired")


@shared_task(base=GuardedTask, bind=True, backoff_base=0.05)
def not_idempotent(self: GuardedTask) -> None:
    raise RuntimeError("unknown, and this task is not idempotent")


@shared_task(base=GuardedTask, bind=True, tenant_required=True, owner="accounts")
def needs_tenant(self: GuardedTask) -> str:
    return "ran"


@shared_task(base=GuardedTask, bind=True, owner="ops")
def kill_my_worker(self: GuardedTask, marker: str) -> str:
    """SIGKILLs its own worker process, every time (a poison message)."""
    import os
    import signal

    redis.Redis.from_url(REDIS_URL).rpush(marker, os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


@shared_task(base=GuardedTask, bind=True, backoff_base=0.05)
def insert_items(
    self: GuardedTask,
    job: str,
    count: int,
    every: int = 100,
    pause: float = 0.0,
    gate_at: int | None = None,
    fail_at: int | None = None,
    sink: str | None = None,
) -> dict[str, int]:
    """A chunked job: one ChunkItem row per item of range(count), through self.checkpoint; its state keeps a
    running sum. On its first run it may wait at a gate after item ``gate_at`` (Redis list ``<job>:gate``; it
    says so in ``<job>:at-gate``), or raise TransientError after item ``fail_at``. Keyed only when published
    with idempotency_key=..."""
    from celery_guardrails import TransientError
    from tests.testapp.models import ChunkItem

    client = redis.Redis.from_url(REDIS_URL)
    run = int(client.incr(f"{job}:runs"))
    start = self.checkpoint.position
    total = (self.checkpoint.state or {}).get("sum", 0)
    seen(self, sink, run=run, start=start, attempt=self.request.attempt, key=self.checkpoint.key)
    for item in self.checkpoint.iterate(range(count), every=every):
        ChunkItem.objects.create(job=job, item=item, run=run)
        total += item
        self.checkpoint.state = {"sum": total}
        if run == 1 and item == gate_at:
            client.rpush(f"{job}:at-gate", item)
            if client.blpop([f"{job}:gate"], timeout=120) is None:
                raise RuntimeError("gate never opened")
        if run == 1 and item == fail_at:
            raise TransientError("provider hiccup mid-job")
        if pause:
            time.sleep(pause)
    return {"sum": total, "start": start, "run": run}


@shared_task(base=GuardedTask, bind=True)
def iterate_badly(self: GuardedTask, how: str) -> int:
    """Misuses self.checkpoint the way ``how`` says (each ends in a CheckpointError or ConfigurationError)."""
    from django.db import transaction

    items: Any = range(10)
    if how == "generator":
        items = (i for i in range(10))
    elif how == "set":
        items = {1, 2, 3}
    elif how == "state":
        self.checkpoint.state = {"when": object()}
    elif how == "transaction":
        with transaction.atomic():
            return sum(self.checkpoint.iterate(items))
    elif how == "twice":
        sum(self.checkpoint.iterate(items))
    return sum(self.checkpoint.iterate(items, every=0 if how == "every" else 5))


@shared_task(
    base=GuardedTask,
    bind=True,
    idempotency_key="limited-effect:{key}",
    atomic=True,
    concurrency_key="tenant:{tenant}",
    concurrency_limit=1,
    backoff_base=0.05,
)
def write_effect_limited(self: GuardedTask, key: str, sink: str) -> str:
    """Insert one Effect row in the key's transaction, one per tenant at a time; the first attempt then fails
    transiently (its row rolled back with the transaction, its slot given back all the same)."""
    from celery_guardrails import TransientError
    from tests.testapp.models import Effect

    seen(self, sink, attempt=self.request.attempt, history=[r.get("rule") for r in self.request.attempt_history])
    Effect.objects.create(key=key)
    if self.request.attempt == 1:
        raise TransientError("provider busy")
    return "written"


@shared_task(
    base=GuardedTask,
    bind=True,
    idempotency_key="fenced:{key}",
    atomic=True,
    concurrency_key="tenant:{tenant}",
    concurrency_limit=2,
    retry_later_delay=0.2,
)
def limited_atomic_effect(self: GuardedTask, key: str, sink: str, gate: str) -> dict[str, Any]:
    """At most two at once per tenant, its body one transaction with its key. Reports itself, waits until the
    Redis key ``gate`` exists, then inserts an Effect row and marks the key processed through the effect helper
    ``mark_processed`` (fenced in the same transaction: a holder whose slot was reaped rolls both back)."""
    from django_celery_guardrails.effects import mark_processed
    from tests.testapp.models import Effect

    client = redis.Redis.from_url(REDIS_URL)
    report = seen(
        self,
        sink,
        attempt=self.request.attempt,
        history=[(r.get("class"), r.get("rule")) for r in self.request.attempt_history],
    )
    deadline = time.monotonic() + 120
    while not client.exists(gate):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gate {gate} never opened")
        time.sleep(0.05)
    Effect.objects.create(key=key)
    mark_processed(f"fenced:{key}")
    return report


@shared_task(
    base=GuardedTask,
    bind=True,
    idempotent=True,
    concurrency_key="tenant:{tenant}",
    concurrency_limit=1,
    retry_later_delay=0.1,
)
def limited_chunks(self: GuardedTask, job: str, count: int, thief: str) -> dict[str, Any]:
    """One per tenant, a chunked job (two items a chunk, one ChunkItem row each). On its first run, as its second
    chunk starts, another delivery (``thief``) takes its slot, reaping it, as after a stall past the ceiling (from
    a thread of its own: outside the chunk's transaction)."""
    import threading

    from celery_guardrails.foundation.context import current_tenant
    from celery_guardrails.stores import get_store
    from tests.testapp.models import ChunkItem

    run = int(redis.Redis.from_url(REDIS_URL).incr(f"{job}:runs"))
    store, key = get_store(self.app), f"limit:tenant:{current_tenant()}"

    def take_the_slot() -> None:
        from django.db import connection

        try:
            store.acquire_slot(key, holder=thief, limit=1, now=time.time() + 100, reap_after=60.0, task_id=thief)
        finally:
            connection.close()

    for item in self.checkpoint.iterate(range(count), every=2):
        if run == 1 and item == 2:
            taker = threading.Thread(target=take_the_slot)
            taker.start()
            taker.join()
        ChunkItem.objects.create(job=job, item=item, run=run)
    return {
        "run": run,
        "attempt": self.request.attempt,
        "history": [(r.get("class"), r.get("rule")) for r in self.request.attempt_history],
    }


@shared_task(base=GuardedTask, bind=True)
def ship_order(self: GuardedTask, order_id: int, sink: str) -> dict[str, Any]:
    """Ship an order another path may not have committed yet: ``self.require()`` waits for its row, then one
    Effect row ``shipped:<id>`` lands. Each run reports to ``sink`` before it looks."""
    from tests.testapp.models import Effect, Order

    runs = redis.Redis.from_url(REDIS_URL).incr(f"{sink}:runs")
    seen(self, sink, run=runs, attempt=self.request.attempt)
    order = self.require(Order.objects, pk=order_id)
    Effect.objects.create(key=f"shipped:{order.pk}")
    return {"runs": runs, "history": self.request.attempt_history}


@shared_task(base=GuardedTask, bind=True)
def ship_order_by_get(self: GuardedTask, order_id: int, sink: str) -> dict[str, Any]:
    """The same with a plain ``Order.objects.get`` (its DoesNotExist goes to absent_records), its effect marked
    with ``self.effect()``: a failure before it is safe to run again."""
    from tests.testapp.models import Effect, Order

    runs = redis.Redis.from_url(REDIS_URL).incr(f"{sink}:runs")
    seen(self, sink, run=runs, attempt=self.request.attempt)
    order = Order.objects.get(pk=order_id)
    with self.effect():
        Effect.objects.create(key=f"shipped:{order.pk}")
    return {"runs": runs, "history": self.request.attempt_history}


@shared_task(base=GuardedTask, bind=True)
def ship_order_unmarked(self: GuardedTask, order_id: int, sink: str) -> dict[str, Any]:
    """The same, marking no effect: its body counts as one effect from its first line."""
    from tests.testapp.models import Effect, Order

    runs = redis.Redis.from_url(REDIS_URL).incr(f"{sink}:runs")
    seen(self, sink, run=runs, attempt=self.request.attempt)
    order = Order.objects.get(pk=order_id)
    Effect.objects.create(key=f"shipped:{order.pk}")
    return {"runs": runs, "history": self.request.attempt_history}


@shared_task(base=GuardedTask, bind=True, idempotency_key="report:{name}", atomic=True, backoff_base=0.05)
def build_report(
    self: GuardedTask,
    name: str,
    sink: str,
    *,
    later: int = 0,
    fail: int = 0,
    items: int = 0,
    hold: float = 0.0,
    stall_at: int = 0,
) -> dict[str, Any]:
    """A job: one Effect row per report, committed with its key and its success (atomic). Its runs are counted;
    the first ``later`` ask to run later, the next ``fail`` fail transiently; while ``{sink}:broken`` is set a
    run fails permanently. It reports ``items`` steps of progress; its first run may hold ``hold`` seconds after
    its effect (uncommitted), or, with ``stall_at``, right after reporting that step of its progress."""
    from celery_guardrails import PermanentError, RetryLater, TransientError
    from tests.testapp.models import Effect

    client = redis.Redis.from_url(REDIS_URL)
    runs = int(client.incr(f"{sink}:runs"))
    seen(self, sink, run=runs, job=self.job.id)
    if runs <= later:
        raise RetryLater("the export is not ready", delay=0.2)
    if runs <= later + fail:
        raise TransientError("storage answered 503")
    if client.get(f"{sink}:broken"):
        raise PermanentError("the report's template is broken")
    for step in range(items):
        self.job.progress(step + 1, items)
        if step + 1 == stall_at:
            client.rpush(f"{sink}:holding", 1)
            time.sleep(hold)
    Effect.objects.create(key=name)
    if hold and runs == 1 and not stall_at:
        client.rpush(f"{sink}:holding", 1)
        time.sleep(hold)
    return {"ref": f"reports/{name}.csv"}


@shared_task
def count_effects(key: str) -> int:
    """A plain Celery task that reads the database in its body (no guardrail touches it): the Effect rows of
    ``key``."""
    from tests.testapp.models import Effect

    return Effect.objects.filter(key=key).count()


@shared_task(base=GuardedTask, bind=True, idempotency_key="scripted-effect:{key}", atomic=True, backoff_base=0.05)
def write_effect_scripted(self: GuardedTask, key: str, sink: str, script: list[str]) -> str:
    """Insert one Effect row, then end the run as the script says for this run: "transient" (a retry),
    "permanent" (a final failure) or "ok"; runs past the script end as its last step."""
    from celery_guardrails import PermanentError, TransientError
    from tests.testapp.models import Effect

    runs = int(redis.Redis.from_url(REDIS_URL).incr(f"{sink}:runs"))
    seen(self, sink, run=runs)
    Effect.objects.create(key=key)
    step = script[min(runs, len(script)) - 1]
    if step == "transient":
        raise TransientError("provider busy")
    if step == "permanent":
        raise PermanentError("refused for good")
    return "written"
