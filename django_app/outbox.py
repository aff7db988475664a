"""The transactional outbox: a task message written in the caller's database transaction, published by a relay
once that transaction committed.

``task.enqueue_in_transaction(*args, **kwargs)`` (or ``task.apply_async(args, kwargs, outbox=True, ...)``)
writes an :class:`~django_celery_guardrails.models.OutboxMessage` row on the default database connection, in
whatever transaction the caller is in. A rollback takes the row with it: nothing is published. A commit makes it
durable: the relay publishes it even if the process that enqueued it dies the next instant (Celery's
``delay_on_commit`` is a hook that runs after the commit, in the same process: a crash between the two loses the
message).

At enqueue, in the caller: the task's id is fixed (the caller gets its ``AsyncResult``), the caller's tenant and
correlation id are captured, the payload contract is checked (entities, sensitive keys, size: see
:mod:`celery_guardrails.guardrails.contract`) and so is ``tenant_required``; the arguments are serialised with
kombu's JSON, as a publish would.

:func:`relay` publishes the due rows, oldest first, in batches of three steps: a short transaction claims the
batch (``SELECT ... FOR UPDATE SKIP LOCKED`` on PostgreSQL, so several relays share the work without waiting for
each other, then the rows are hidden from other relays for a lease of :data:`LEASE` seconds); each row is
published through the task's own ``apply_async`` (every guardrail's publish hooks run, with the captured tenant
and correlation id); the published rows are deleted. A relay killed mid-batch leaves the rows it had not
deleted to come back when the lease ends, and they are published again: delivery is at least once, and the
task's idempotency key keeps its effect single (give tasks you enqueue through the outbox a key). A row that
cannot be published (the broker down, a task this process does not know) stays, with ``attempts`` and
``last_error``, and is tried again after a backoff (1 s doubling, at most 5 minutes); a broker failure ends the
batch and gives the rest back at once.

Where the relay runs: in every worker, a bootstep thread (``outbox_relay``, every ``outbox_relay_interval``
seconds; see :mod:`celery_guardrails.outbox`), and as ``manage.py guardrails_outbox_relay``. On SQLite, FOR
UPDATE is not supported: run one relay, or set ``"transaction_mode": "IMMEDIATE"`` so relays take turns.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from celery.utils import uuid
from django.db import connection, transaction
from django.utils import timezone
from kombu.serialization import dumps, loads

from celery_guardrails.options import OPTIONS

from .models import OutboxMessage

logger = logging.getLogger(__name__)

#: The JSON marker of a datetime option (eta, expires) kept in a row's options.
DATETIME = "__datetime__"
#: Backoff of a row whose publish failed: 1 s, doubling, at most this (seconds).
BACKOFF_MAX = 300.0
#: Seconds a relay's claimed rows stay out of other relays' sight while it publishes them.
LEASE = 60.0
#: Options a row may carry: what apply_async takes, and the guardrail options that may be set per call.
ALLOWED_OPTIONS = frozenset(
    {
        "queue",
        "routing_key",
        "exchange",
        "priority",
        "countdown",
        "eta",
        "expires",
        "headers",
        "time_limit",
        "soft_time_limit",
        "ignore_result",
        "shadow",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Relayed:
    """What one :func:`relay` pass did: rows published (and deleted), rows that failed (kept, backed off)."""

    published: int
    failed: int


def _encode(options: dict[str, Any]) -> dict[str, Any]:
    encoded: dict[str, Any] = {}
    for name, value in options.items():
        if name not in ALLOWED_OPTIONS and name not in OPTIONS:
            raise ValueError(f"outbox: the option {name!r} cannot be kept in an outbox message")
        if isinstance(value, datetime):
            value = {DATETIME: value.isoformat()}
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"outbox: the option {name!r} is not JSON ({exc})") from exc
        encoded[name] = value
    return encoded


def _decode(options: dict[str, Any]) -> dict[str, Any]:
    return {
        name: datetime.fromisoformat(value[DATETIME]) if isinstance(value, dict) and DATETIME in value else value
        for name, value in options.items()
    }


def enqueue(task: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
    """Write ``task``'s message in the caller's transaction (see the module docstring); its ``AsyncResult``."""
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    task_id = options.pop("task_id", None) or uuid()
    task.prepare_deferred(args, kwargs, options)  # the caller's context captured, its checks run, now
    tenant = options.pop("tenant", None) or ""
    correlation_id = options.pop("correlation_id", None) or ""
    _, _, body = dumps((list(args), kwargs), serializer="json")  # type: ignore[no-untyped-call]
    OutboxMessage.objects.create(
        task_name=task.name,
        task_id=task_id,
        body=body,
        options=_encode(options),
        tenant=tenant,
        correlation_id=correlation_id,
        available_at=timezone.now(),
    )
    return task.AsyncResult(task_id)


def _publish(app: Any, row: OutboxMessage) -> None:
    task = app.tasks.get(row.task_name)
    if task is None:
        raise LookupError(f"no task {row.task_name!r} is registered in this process")
    args, kwargs = loads(row.body, "application/json", "utf-8")  # type: ignore[no-untyped-call]
    options = _decode(dict(row.options or {}))
    if isinstance(getattr(task, "guardrails", None), tuple):  # a GuardedTask: the captured context goes with it
        options.update(tenant=row.tenant or None, correlation_id=row.correlation_id or None)
    task.apply_async(args, kwargs, task_id=row.task_id, **options)


def _broker_down(exc: BaseException) -> bool:
    from kombu.exceptions import OperationalError

    return isinstance(exc, OperationalError | ConnectionError | OSError)


def relay(app: Any, *, batch: int = 100, lease: float = LEASE, now: datetime | None = None) -> Relayed:
    """Publish up to ``batch`` due rows, oldest first (see the module docstring). Raises only what the
    database raises (a row claimed before that is published again once its lease is over)."""
    moment = now or timezone.now()
    due = OutboxMessage.objects.filter(available_at__lte=moment)
    if not due.exists():  # most passes: one indexed read, no transaction, no lock
        return Relayed(published=0, failed=0)
    # 1. Claim: lock due rows no other relay holds and push them out of sight for the lease, in one short
    # transaction. Publishing happens after its commit: a database write a guardrail makes as it publishes (an
    # ordering number, a dedupe reservation) is never rolled back with the relay's transaction.
    with transaction.atomic():
        locked = due.order_by("id")
        if connection.features.has_select_for_update_skip_locked:
            locked = locked.select_for_update(skip_locked=True)
        rows = list(locked[:batch])
        OutboxMessage.objects.filter(pk__in=[row.pk for row in rows]).update(
            available_at=moment + timedelta(seconds=lease)
        )
    # 2. Publish each; 3. delete what was published. A relay killed between 2 and 3 leaves its rows to come back
    # after the lease and be published again: at least once.
    published: list[int] = []
    failed: list[OutboxMessage] = []
    for index, row in enumerate(rows):
        try:
            _publish(app, row)
        except Exception as exc:
            row.attempts += 1
            row.last_error = f"{type(exc).__name__}: {exc}"[:2000]
            delay = min(BACKOFF_MAX, 2.0 ** (row.attempts - 1))
            row.available_at = moment + timedelta(seconds=delay)
            failed.append(row)
            logger.warning(
                "Outbox: publishing %s[%s] failed (attempt %d, next in %.0fs): %s",
                row.task_name,
                row.task_id,
                row.attempts,
                delay,
                row.last_error,
            )
            if _broker_down(exc):  # the rest would fail the same way: back to the queue at once
                OutboxMessage.objects.filter(pk__in=[r.pk for r in rows[index + 1 :]]).update(available_at=moment)
                break
            continue
        published.append(row.pk)
    with transaction.atomic():
        OutboxMessage.objects.filter(pk__in=published).delete()
        for row in failed:
            OutboxMessage.objects.filter(pk=row.pk).update(
                attempts=row.attempts, last_error=row.last_error, available_at=row.available_at
            )
    return Relayed(published=len(published), failed=len(failed))


def backlog(*, now: datetime | None = None) -> tuple[int, float | None]:
    """(rows waiting, seconds since the oldest was enqueued; None when there is none): the relay's lag."""
    moment = now or datetime.now(UTC)
    oldest = OutboxMessage.objects.order_by("created_at").values_list("created_at", flat=True).first()
    if oldest is None:
        return 0, None
    return OutboxMessage.objects.count(), max(0.0, (moment - oldest).total_seconds())
