"""Guarded tasks the tests run on real workers. Each reports the context it saw.

A task reports by returning it (read through the result backend) and, when given ``sink``, by pushing it
to a Redis list (for runs whose result nobody waits on: beat, errbacks, each retry).
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import UTC, datetime
from typing import Any

import redis
from celery import shared_task

from celery_guardrails import (
    GuardedTask,
    Guardrail,
    PermanentError,
    RetryLater,
    TransientError,
    current_correlation_id,
    current_tenant,
)
from celery_guardrails.runtime.delivery import delivery

REDIS_URL = os.environ.get("GUARDRAILS_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")


def seen(task: GuardedTask, sink: str | None = None, **extra: Any) -> dict[str, Any]:
    report = {
        "task": task.name,
        "task_id": task.request.id,
        "tenant": current_tenant(),
        "cid": current_correlation_id(),
        "retries": task.request.retries,
        "pid": os.getpid(),
        "thread": threading.get_ident(),
        "started": datetime.now(UTC).isoformat(timespec="milliseconds"),
        **extra,
    }
    if sink:
        redis.Redis.from_url(REDIS_URL).rpush(sink, json.dumps(report))
    return report


@shared_task(base=GuardedTask, bind=True)
def observe(self: GuardedTask, *previous: Any, sink: str | None = None) -> dict[str, Any]:
    return seen(self, sink)


@shared_task(base=GuardedTask, bind=True)
def collect(self: GuardedTask, parts: list[Any], sink: str | None = None) -> dict[str, Any]:
    return seen(self, sink, parts=parts)


# Idempotent: its only effect is its report (a retry's gate lets self.retry() through).
@shared_task(base=GuardedTask, bind=True, max_retries=5, idempotent=True)
def retry_thrice(self: GuardedTask, sink: str) -> dict[str, Any]:
    report = seen(self, sink)
    if self.request.retries < 3:
        raise self.retry(countdown=0)
    return report


@shared_task(base=GuardedTask, bind=True)
def spawn_child(self: GuardedTask, sink: str | None = None, child_tenant: str | None = None) -> dict[str, Any]:
    options = {"tenant": child_tenant} if child_tenant else {}
    child = observe.apply_async(kwargs={"sink": sink}, **options)
    return seen(self, sink, child_id=child.id)


@shared_task(base=GuardedTask, bind=True)
def explode(self: GuardedTask, sink: str | None = None) -> None:
    seen(self, sink)
    raise ValueError("boom")


@shared_task(base=GuardedTask, bind=True)
def record_errback(self: GuardedTask, failed_task_id: str, sink: str) -> dict[str, Any]:
    return seen(self, sink, failed_task_id=failed_task_id)


@shared_task(base=GuardedTask, bind=True, tenant_required=True)
def tenant_only(self: GuardedTask, sink: str) -> dict[str, Any]:
    return seen(self, sink)


@shared_task(base=GuardedTask, bind=True)
def log_line(self: GuardedTask, text: str) -> None:
    import logging

    logging.getLogger("tests.proj").warning("%s", text)


@shared_task(base=GuardedTask, bind=True, max_retries=1, idempotent=True)
def header_echo(self: GuardedTask, sink: str) -> None:
    from celery_guardrails.runtime.headers import from_request

    seen(self, sink, header=from_request(self.request))
    if self.request.retries == 0:
        raise self.retry(countdown=0)


@shared_task(base=GuardedTask, bind=True, acks_late=True)
def hold_until_redelivered(self: GuardedTask, sink: str) -> dict[str, Any]:
    """Reports, then (on its first delivery) blocks so a test can SIGKILL the worker mid-task."""
    import time

    redelivered = bool((self.request.delivery_info or {}).get("redelivered"))
    report = seen(self, sink, redelivered=redelivered)
    if not redelivered:
        time.sleep(60)
    return report


def _behave(task: GuardedTask, sink: str, script: list[str]) -> dict[str, Any]:
    """Run number n (counted across deliveries) does what ``script[n - 1]`` says (the last step repeats)."""
    runs = redis.Redis.from_url(REDIS_URL).incr(f"{sink}:runs")
    step = script[min(runs, len(script)) - 1]
    report = seen(
        task,
        sink,
        run=runs,
        step=step,
        attempt=task.request.attempt,
        history=task.request.attempt_history,
        admitted=delivery(task).admitted,
    )
    kind, _, arg = step.partition(":")
    if kind == "transient":
        raise TransientError(f"run {runs} failed")
    if kind == "permanent":
        raise PermanentError(f"run {runs} refused")
    if kind == "value_error":
        raise ValueError(f"run {runs}: bad value")
    if kind == "unknown":
        raise RuntimeError(f"run {runs}: nobody knows")
    if kind == "remote":
        raise RuntimeError(arg)
    if kind == "until" and not redis.Redis.from_url(REDIS_URL).exists(arg):  # down until the key exists
        raise TransientError("dependency down")
    if kind == "store_down":  # the task's own call into the guardrails (a guarded publish) found the store down
        from celery_guardrails.exceptions import StoreUnavailableError

        raise StoreUnavailableError(f"run {runs}: the store of a publish from the body is unavailable")
    if kind == "later":
        raise RetryLater("not readable yet", delay=float(arg or 0.05))
    if kind == "record":  # what require(Order.objects, pk=arg) raises when the row is not there (yet)
        from celery_guardrails.exceptions import RecordNotThereYet

        raise RecordNotThereYet("testapp.Order", f"pk={arg}")
    if kind == "gate" and redis.Redis.from_url(REDIS_URL).blpop([arg], timeout=120) is None:
        raise RuntimeError(f"gate {arg} never opened")  # gate:<list>: runs until an item is pushed to the list
    if kind == "gate_then_transient":  # waits at the gate (a Redis list), then fails transiently
        if redis.Redis.from_url(REDIS_URL).blpop([arg], timeout=120) is None:
            raise RuntimeError(f"gate {arg} never opened")
        raise TransientError(f"run {runs} failed after its gate")
    if kind == "sleep":  # longer than a time limit, say
        time.sleep(float(arg))
    if kind == "kill_once" and redis.Redis.from_url(REDIS_URL).set(arg, 1, nx=True, ex=600):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)  # the first run only: its worker process dies mid-task
    if kind == "get":  # a real HTTP call to the test's provider: get:<url>
        import requests

        requests.get(arg, timeout=5).raise_for_status()
    if kind == "get_quick":  # the same, giving up on an answer after half a second
        import requests

        requests.get(arg, timeout=(5, 0.5)).raise_for_status()
    if kind == "httpx":
        import httpx

        httpx.get(arg, timeout=5).raise_for_status()
    return report


@shared_task(
    base=GuardedTask,
    bind=True,
    idempotent=True,
    backoff_base=0.05,
    backoff_max=10.0,
    permanent_errors=(ValueError,),
    error_patterns={r"(?i)\b404 not found\b": "permanent"},
)
def behave(self: GuardedTask, sink: str, script: list[str]) -> dict[str, Any]:
    return _behave(self, sink, script)


@shared_task(base=GuardedTask, bind=True, idempotent=True)
def behave_by_default(self: GuardedTask, sink: str, script: list[str]) -> dict[str, Any]:
    """``behave`` with the documented backoff (no backoff option set): the first retry waits 1-2 s."""
    return _behave(self, sink, script)


@shared_task(base=GuardedTask, bind=True, backoff_base=0.05)
def behave_not_idempotent(self: GuardedTask, sink: str, script: list[str]) -> dict[str, Any]:
    return _behave(self, sink, script)


@shared_task(base=GuardedTask, bind=True, backoff_base=0.05, retry_unsafe=True)
def behave_retry_unsafe(self: GuardedTask, sink: str, script: list[str]) -> dict[str, Any]:
    """Not idempotent, but retried on ambiguous failures all the same (its author accepts a second run)."""
    return _behave(self, sink, script)


@shared_task(base=GuardedTask, bind=True, idempotency_key="charge:{order_id}", backoff_base=0.05)
def charge(
    self: GuardedTask,
    order_id: int,
    sink: str,
    script: list[str] | None = None,
    hold: float = 0.0,
    gate: str | None = None,
) -> str:
    """The effect is ``INCR <sink>:effects``; run n does ``script[n-1]`` first; the first run may hold the key
    (``hold`` seconds, or until an item is pushed to the Redis list ``gate``)."""
    import time

    client = redis.Redis.from_url(REDIS_URL)
    runs = client.incr(f"{sink}:runs")
    seen(self, sink, run=runs, key=self.request.idempotency_key, attempt=self.request.attempt)
    steps = script or ["ok"]
    step = steps[min(runs, len(steps)) - 1]
    if step == "transient":
        raise TransientError("provider hiccup")
    if step == "permanent":
        raise PermanentError("card refused")
    client.incr(f"{sink}:effects")
    if hold and runs == 1:
        time.sleep(hold)
    if gate and runs == 1 and client.blpop([gate], timeout=120) is None:
        raise RuntimeError(f"gate {gate} never opened")
    if step == "unencodable":  # the effect happened; then Celery cannot store this result as JSON
        return {"order": order_id, "receipt": object()}  # type: ignore[return-value]
    return f"charged {order_id}"


@shared_task(base=GuardedTask, bind=True, idempotency_key="charge:{order_id}", ignore_result=True)
def charge_quietly(self: GuardedTask, order_id: int, sink: str, gate: str | None = None) -> None:
    """A keyed charge whose result is ignored (its completion may ride the ack: celery_guardrails.guardrails.acks):
    ``INCR <sink>:effects``, then, on its first run, an optional wait for an item on the Redis list ``gate``."""
    client = redis.Redis.from_url(REDIS_URL)
    runs = client.incr(f"{sink}:runs")
    seen(self, sink, run=runs)
    client.incr(f"{sink}:effects")
    if gate and runs == 1 and client.blpop([gate], timeout=120) is None:
        raise RuntimeError(f"gate {gate} never opened")


@shared_task(
    base=GuardedTask, bind=True, idempotency_key="charge:{order_id}", ignore_result=True, idempotency_lease=20.0
)
def charge_quietly_leased(self: GuardedTask, order_id: int, sink: str) -> None:
    """``charge_quietly`` with a lease of its own (not the app's)."""
    client = redis.Redis.from_url(REDIS_URL)
    seen(self, sink, run=client.incr(f"{sink}:runs"))
    client.incr(f"{sink}:effects")


@shared_task(base=GuardedTask, bind=True)
def scheduled_job(
    self: GuardedTask, sink: str, hold: float = 0.0, since: datetime | None = None, gate: str | None = None
) -> dict[str, Any]:
    """A scheduled job: reports its period, the horizon it was given, and when it ran (real time).

    ``gate``: a Redis list the run waits on (one item lets one run finish), so a test decides when it ends.
    """
    request = self.request
    started = time.time()
    time.sleep(hold)
    if gate is not None and redis.Redis.from_url(REDIS_URL).blpop([gate], timeout=120) is None:
        raise RuntimeError(f"gate {gate} never opened")
    return seen(
        self,
        sink,
        schedule=getattr(request, "schedule_name", None),
        period=request.period.timestamp() if getattr(request, "period", None) else None,
        period_key=getattr(request, "period_key", None),
        idempotency_key=getattr(request, "idempotency_key", None),
        since=since.timestamp() if since else None,
        request_since=request.since.timestamp() if getattr(request, "since", None) else None,
        real_start=started,
        real_end=time.time(),
    )


@shared_task(base=GuardedTask, bind=True, idempotency_key="retry:{order_id}")
def retry_keyed(self: GuardedTask, order_id: int, sink: str) -> dict[str, Any]:
    """A keyed task whose first run asks for a retry itself (``self.retry``)."""
    runs = redis.Redis.from_url(REDIS_URL).incr(f"{sink}:runs")
    if runs == 1:
        raise self.retry(countdown=0.2)  # before its effect: the gate lets it through
    with self.effect():
        return seen(self, sink, run=runs, history=self.request.attempt_history)


@shared_task(base=GuardedTask, bind=True, idempotency_key="poison:{order_id}", owner="ops")
def kill_my_worker_keyed(self: GuardedTask, order_id: int, marker: str) -> str:
    """Claims its key, then SIGKILLs its own worker process, every time (a poison message with a key)."""
    import signal

    redis.Redis.from_url(REDIS_URL).rpush(marker, os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


@shared_task(base=GuardedTask, bind=True, idempotency_key="poison-gated:{order_id}", owner="ops")
def kill_my_worker_at_a_gate(self: GuardedTask, order_id: int, marker: str, gate: str) -> str:
    """``kill_my_worker_keyed`` that, once it has claimed its key and said so (its pid on ``marker``), waits for
    an item on the Redis list ``gate`` (at most 30 s: a bound, not a measure) before it SIGKILLs its process, so
    that the test can change the world between a run's start and its worker's death."""
    import signal

    client = redis.Redis.from_url(REDIS_URL)
    client.rpush(marker, os.getpid())
    client.blpop([gate], timeout=30)
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


@shared_task
def plain_add(x: int, y: int) -> int:
    """A plain Celery task (no guardrails), for what must refuse one."""
    return x + y


@shared_task(base=GuardedTask, bind=True, idempotency_key="sync:{account}", backoff_base=0.05)
def sync_account(
    self: GuardedTask,
    account: str,
    sink: str,
    *,
    api_token: str,
    options: dict[str, Any] | None = None,
    gate: str | None = None,
) -> str:
    """Calls a provider with ``api_token`` (a secret: redacted from its dead letter). The provider refuses it
    until ``<sink>:fixed`` is set (the cause fixed); each run reports the token and options it was given, then
    waits for an item on the Redis list ``gate`` when given one."""
    client = redis.Redis.from_url(REDIS_URL)
    seen(self, sink, token=api_token, account=account, options=options, key=self.request.idempotency_key)
    if gate and client.blpop([gate], timeout=120) is None:
        raise RuntimeError(f"gate {gate} never opened")
    if not client.exists(f"{sink}:fixed"):
        raise PermanentError(f"provider refused account {account}")
    return f"synced {account}"


@shared_task(
    base=GuardedTask,
    bind=True,
    ordering_key="stream:{stream}",
    idempotency_key="append:{stream}:{n}",  # an ordered task should also be keyed: a duplicate runs once
    retry_later_delay=0.1,
    backoff_base=0.2,
)
def ordered_append(self: GuardedTask, stream: str, n: int, sink: str, fail: str | None = None) -> int:
    """Message ``n`` of ``stream``, ordered per stream: appends its sequence number (and attempt, and outages
    met) to the list ``sink`` (durable, in Redis); ``fail="permanent"`` raises PermanentError instead,
    ``fail="first"`` on its first run only; ``fail="kill_first"`` SIGKILLs its worker process on its first run."""
    from celery_guardrails.runtime import headers

    client = redis.Redis.from_url(REDIS_URL)
    first_run = fail in ("first", "kill_first") and client.incr(f"{sink}:runs:{n}") == 1
    if fail == "permanent" or (fail == "first" and first_run):
        raise PermanentError(f"poison in stream {stream}")
    if fail == "kill_first" and first_run:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    sequence = self.request.ordering_sequence
    outages = headers.counter(headers.from_request(self.request), headers.OUTAGES)
    item = {"stream": stream, "n": n, "seq": sequence, "attempt": self.request.attempt, "outages": outages}
    client.rpush(sink, json.dumps(item))
    return int(sequence)


def _slot_run(task: GuardedTask, sink: str, counters: list[str], *, hold: float, gate: str | None) -> dict[str, Any]:
    """A body holding concurrency slots: each of ``counters`` (Redis counters of the tasks running now) is
    incremented at the start and decremented at the end; the report says how many ran at that start (the
    overlap, sampled at every start), the attempt and the history. Waits ``hold`` seconds, or at ``gate``."""
    client = redis.Redis.from_url(REDIS_URL)
    running = [int(client.incr(counter)) for counter in counters]
    try:
        report = seen(
            task,
            sink,
            running=running,
            attempt=task.request.attempt,
            history=[(r.get("class"), r.get("rule")) for r in task.request.attempt_history],
        )
        if gate and client.blpop([gate], timeout=120) is None:
            raise RuntimeError(f"gate {gate} never opened")
        time.sleep(hold)
    finally:
        for counter in counters:
            client.decr(counter)
    client.rpush(f"{sink}:ended", json.dumps({"task_id": task.request.id, "tenant": current_tenant()}))
    return report


@shared_task(base=GuardedTask, bind=True, concurrency_key="tenant:{tenant}", concurrency_limit=2, retry_later_delay=0.1)
def tenant_limited(self: GuardedTask, sink: str, hold: float = 0.2, gate: str | None = None) -> dict[str, Any]:
    """At most two at once per tenant, across every worker."""
    return _slot_run(self, sink, [f"{sink}:running:{current_tenant()}"], hold=hold, gate=gate)


@shared_task(base=GuardedTask, bind=True, exclusive_key="entity:{entity}", retry_later_delay=0.1)
def entity_exclusive(self: GuardedTask, entity: str, sink: str, hold: float = 0.2) -> dict[str, Any]:
    """Never two at once on one entity; any number on different ones."""
    return _slot_run(self, sink, [f"{sink}:running:{entity}", f"{sink}:running"], hold=hold, gate=None)


@shared_task(
    base=GuardedTask,
    bind=True,
    concurrency_key="tenant:{tenant}",
    concurrency_limit=1,
    backoff_base=0.05,
)
def limited_flaky(self: GuardedTask, sink: str) -> dict[str, Any]:
    """Limited to one per tenant; its first attempt fails transiently (its retry must find the slot free)."""
    report = seen(
        self, sink, attempt=self.request.attempt, history=[r.get("rule") for r in self.request.attempt_history]
    )
    if self.request.attempt == 1:
        raise TransientError("provider busy")
    return report


@shared_task(base=GuardedTask, bind=True, concurrency_key="tenant:{tenant}", concurrency_limit=2, retry_later_delay=0.2)
def limited_effect(self: GuardedTask, sink: str, gate: str) -> dict[str, Any]:
    """At most two at once per tenant. Reports itself, waits until the key ``gate`` exists (it stays: a run
    again passes it), then lands its effect through ``self.effect()``: its task id pushed to ``{sink}:effects``."""
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
    with self.effect():
        client.rpush(f"{sink}:effects", str(self.request.id))
    return report


@shared_task(base=GuardedTask, bind=True, concurrency_key="x:{no_such_argument}", concurrency_limit=1)
def bad_concurrency_key(self: GuardedTask) -> None:
    """A template naming an argument the task does not take."""


@shared_task(base=GuardedTask, bind=True, backoff_base=0.05)
def log_in(self: GuardedTask, user_id: int, password: str, sink: str = "") -> dict[str, Any]:
    """Takes a password by name: the payload contract refuses it at publish (sensitive_keys)."""
    return seen(self, sink or None, user_id=user_id)


@shared_task(
    base=GuardedTask,
    bind=True,
    allow_sensitive_payload="the legacy directory takes the raw password; the broker is encrypted at rest",
)
def legacy_log_in(self: GuardedTask, user_id: int, password: str, sink: str = "") -> dict[str, Any]:
    """The same, with a reason given: let through."""
    return seen(self, sink or None, user_id=user_id)


# Keyed: a test stops its worker right after the last result, and a delivery whose ack the stop cut short comes
# back (acks late); the key makes that redelivery a duplicate skipped, not a second run.
@shared_task(base=GuardedTask, bind=True, idempotency_key="versioned:{sink}:{order_id}", backoff_base=0.05)
def versioned(self: GuardedTask, sink: str, order_id: int, fail_first: bool = False) -> dict[str, Any]:
    """Reports the payload version it ran with; fails its first attempt transiently when asked."""
    from celery_guardrails.runtime import headers

    report = seen(self, sink, order_id=order_id, pv=headers.from_request(self.request).get(headers.PAYLOAD_VERSION))
    if fail_first and self.request.attempt == 1:
        raise TransientError("provider busy")
    return report


# The retry gate (celery_guardrails.runtime.gate) on real workers: each effect is a POST to the test's fake provider,
# which counts it; ``provider`` is its URL.


def _post(url: str, *, key: str | None = None) -> None:
    import requests

    headers = {"Idempotency-Key": key} if key else {}
    requests.post(url, headers=headers, timeout=5).raise_for_status()


def _run_number(sink: str) -> int:
    return int(redis.Redis.from_url(REDIS_URL).incr(f"{sink}:runs"))


#: A port nothing listens on (the discard port): connecting there is refused, nothing is sent.
REFUSED = "http://127.0.0.1:9"


@shared_task(base=GuardedTask, bind=True, backoff_base=0.05)
def charge_then_notify(self: GuardedTask, provider: str, order_id: int, sink: str) -> None:
    """Charges (an effect, not marked), then calls a notifier that refuses the connection."""
    _run_number(sink)
    _post(f"{provider}/charges/{order_id}")
    _post(f"{REFUSED}/notify/{order_id}")


@shared_task(base=GuardedTask, bind=True, autoretry_for=(Exception,), retry_backoff=0.05)
def autoretried_charge(self: GuardedTask, provider: str, order_id: int, sink: str) -> None:
    """Celery's autoretry_for=(Exception,): charges, then fails."""
    _run_number(sink)
    _post(f"{provider}/charges/{order_id}")
    raise RuntimeError("the receipt could not be stored")


@shared_task(base=GuardedTask, bind=True, idempotent=True, max_attempts=3)
def asks_again(self: GuardedTask, sink: str) -> None:
    """Idempotent; asks for a retry itself every time (self.retry())."""
    _run_number(sink)
    raise self.retry(countdown=0.05)


@shared_task(base=GuardedTask, bind=True, max_attempts=3)
def asks_again_not_idempotent(self: GuardedTask, provider: str, sink: str) -> None:
    """Charges, then asks for a retry itself (self.retry()): the gate refuses it."""
    _run_number(sink)
    _post(f"{provider}/charges/asks-again")
    raise self.retry(countdown=0.05)


@shared_task(base=GuardedTask, bind=True, idempotency_key="pay:{order_id}", backoff_base=0.05)
def keyed_key_kept(self: GuardedTask, provider: str, order_id: int, sink: str) -> None:
    """Keyed, but the key never reaches the provider."""
    _run_number(sink)
    _post(f"{provider}/flaky/{order_id}")


@shared_task(base=GuardedTask, bind=True, idempotency_key="pay:{order_id}", backoff_base=0.05)
def keyed_key_handed(self: GuardedTask, provider: str, order_id: int, sink: str) -> str:
    """Keyed, and the key goes to the provider (which deduplicates by it)."""
    _run_number(sink)
    _post(f"{provider}/flaky/{order_id}", key=self.request.idempotency_key)
    return "paid"


@shared_task(base=GuardedTask, bind=True, idempotency_key="value:{order_id}", backoff_base=0.05)
def keyed_value_error(self: GuardedTask, order_id: int, sink: str) -> None:
    """Keyed; its input is wrong (a deterministic error: no retry can fix it)."""
    _run_number(sink)
    raise ValueError(f"order {order_id}: amount must be positive")


@shared_task(base=GuardedTask, bind=True, backoff_base=0.05)
def marked_charge(self: GuardedTask, provider: str, order_id: int, sink: str, down_runs: int = 1) -> str:
    """Marks its effect; the provider refuses the connection for its first ``down_runs`` runs."""
    run = _run_number(sink)
    with self.effect():
        _post(f"{REFUSED if run <= down_runs else provider}/charges/{order_id}")
    return "charged"


# Issue #28: nothing escapes the record.


class TravelsOnce:
    """Pickled once by its producer; the copy a worker unpickles refuses to be pickled again (as a prefork worker
    does to hand it to its child)."""

    def __init__(self, arrived: bool = False) -> None:
        self.arrived = arrived

    def __reduce__(self) -> tuple[Any, ...]:
        if self.arrived:
            raise TypeError("TravelsOnce: it travels once")
        return (TravelsOnce, (True,))


class BuggyGuardrail(Guardrail):
    """A project's own guardrail with a bug: it raises before the body runs."""

    def before_run(self, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise RuntimeError("BuggyGuardrail.before_run: a bug in the project's own guardrail")


@shared_task(base=GuardedTask, bind=True, guardrails=(*GuardedTask.guardrails, BuggyGuardrail()))
def guarded_by_a_bug(self: GuardedTask, sink: str) -> dict[str, Any]:
    return seen(self, sink)


def _without_retries() -> tuple[Guardrail, ...]:
    from celery_guardrails.guardrails.retries import Retries

    return tuple(guardrail for guardrail in GuardedTask.guardrails if not isinstance(guardrail, Retries))


@shared_task(base=GuardedTask, bind=True, guardrails=_without_retries())
def retry_as_asked(self: GuardedTask, sink: str, countdown: float) -> None:
    """A project's own composition of the guardrails without ``Retries``: the body's ``self.retry(countdown=...)``
    goes to Celery as asked (no gate, no rounding to what the broker takes). Counts its runs in ``sink:runs``."""
    redis.Redis.from_url(REDIS_URL).incr(f"{sink}:runs")
    raise self.retry(countdown=countdown)


class Unprintable(Exception):
    """An exception whose ``str()`` raises (a library's bug)."""

    def __str__(self) -> str:
        raise RuntimeError("Unprintable.__str__ failed")


@shared_task(base=GuardedTask, bind=True)
def raise_unprintable(self: GuardedTask, sink: str) -> None:
    seen(self, sink)
    raise Unprintable()


@shared_task(base=GuardedTask, bind=True, owner="fuzz", idempotent=True, backoff_base=0.01, max_attempts=2)
def fail_loudly(self: GuardedTask, text: str, *payload: Any, kind: str = "value", **extra: Any) -> None:
    """Fails with ``text`` as its exception message, whatever else it was given: a ValueError (permanent at once),
    a RuntimeError (retried once, as idempotent, then attempts_exhausted), or an exception whose str() raises."""
    if kind == "runtime":
        raise RuntimeError(text)
    if kind == "unprintable":
        raise Unprintable(text)
    raise ValueError(text)
