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
task's idempotency key keeps its effect single (give tasks you enqueue through the outbox a key).

A row is deleted only once the broker took its message: on RabbitMQ the relay publishes with publisher confirms
and ``mandatory`` on a connection of its own, whatever the app's ``broker_transport_options`` say (see
:class:`celery_guardrails.runtime.outbox.RelayPublisher`), so that a refusal (an exchange that does not exist, a message
no queue takes) raises in the publish of the row it is about, never in the next one's. On Redis a publish is a
synchronous write: it raised, or the message is stored, when it returns.

A publish that fails is one of two kinds. The broker out of reach (a connection error, a confirm that did not
come in time, a nack: the broker could not take it now) or the guardrails store out of reach is no fault of the
row: the pass ends, and its rows wait for the next one with no attempt spent. Anything else (a task this process
does not know, a refusal, arguments the serializer refuses) spends one of the row's ``outbox_max_attempts``: it
stays, with ``attempts`` and ``last_error``, and is tried again after a backoff (1 s doubling, at most 5
minutes). At the last attempt it becomes a dead letter, reason ``unpublishable``: the record (arguments redacted,
their sealed copy kept when ``seal_keys`` are set, the row's tenant, correlation id and per-call guardrail
options in its header) is written and the row deleted in one transaction, so that it is never both gone and
unrecorded; where the record cannot be written the row stays and is tried again. A replay publishes it through
its task (its tenant, correlation id and guardrail options kept; to the task's own route, at once: the row's
queue, exchange and countdown are not kept). A task unknown to the relay's process is looked for once more after
importing the project's task modules as a worker does (``app.loader.import_default_modules()``, which runs
``autodiscover_tasks``), so that a relay outside a worker does not count a task it never imported.

Where the relay runs: in every worker, a bootstep thread (``outbox_relay``, every ``outbox_relay_interval``
seconds; see :mod:`celery_guardrails.runtime.outbox`), and as ``manage.py guardrails_outbox_relay``. On SQLite, FOR
UPDATE is not supported: run one relay, or set ``"transaction_mode": "IMMEDIATE"`` so relays take turns.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery.utils import uuid
from django.db import close_old_connections, connection, transaction
from django.utils import timezone
from kombu.serialization import dumps, loads

from celery_guardrails import signals
from celery_guardrails.foundation.forks import quiet
from celery_guardrails.log import shown
from celery_guardrails.options import OPTIONS, app_value
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.outbox import RelayPublisher

from .discovery import in_a_worker
from .models import OutboxMessage

if TYPE_CHECKING:
    from celery_guardrails.runtime.final_failure import FinalFailure

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
    """What one :func:`relay` pass did: rows published (and deleted), rows that failed (kept, backed off, or
    given back for want of the broker), rows that became dead letters (recorded, and deleted)."""

    published: int
    failed: int
    dead_lettered: int = 0

    @property
    def handled(self) -> int:
        """Rows this pass took out of the due ones: a full batch means more may be waiting."""
        return self.published + self.failed + self.dead_lettered


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


def _task(app: Any, name: str) -> Any:
    """The task ``name`` registered in this process, or None. A name not found is looked for again once, after
    the project's task modules are imported the way a worker imports them (``autodiscover_tasks`` imports only
    in a worker or when asked: a web process may never have imported the module that defines it)."""
    task = app.tasks.get(name)
    # (Not in a worker, which imported them as it started: see discovery.in_a_worker.)
    if task is None and not in_a_worker(app) and not getattr(app, "_guardrails_outbox_imported", False):
        app._guardrails_outbox_imported = True
        try:
            app.loader.import_default_modules()
        except Exception:  # a task module that fails to import is the project's bug, not this row's
            logger.exception("Outbox: importing the project's task modules failed")
        task = app.tasks.get(name)
    return task


def _arguments(row: OutboxMessage) -> tuple[list[Any], dict[str, Any]]:
    """The row's arguments and keyword arguments, read back from its JSON; ValueError when they cannot be."""
    decoded = loads(row.body, "application/json", "utf-8")  # type: ignore[no-untyped-call]
    if not (isinstance(decoded, list | tuple) and len(decoded) == 2):
        raise ValueError("outbox: the stored body is not [args, kwargs]")
    args, kwargs = decoded
    if not isinstance(args, list | tuple) or not isinstance(kwargs, dict):
        raise ValueError("outbox: the stored body is not [args, kwargs]")
    return list(args), kwargs


def _publish(app: Any, row: OutboxMessage, publisher: RelayPublisher) -> None:
    task = _task(app, row.task_name)
    if task is None:
        raise LookupError(f"no task {row.task_name!r} is registered in this process")
    args, kwargs = _arguments(row)
    options = _decode(dict(row.options or {}))
    if isinstance(getattr(task, "guardrails", None), tuple):  # a GuardedTask: the captured context goes with it
        options.update(tenant=row.tenant or None, correlation_id=row.correlation_id or None)
    publisher.send(functools.partial(task.apply_async, args, kwargs, task_id=row.task_id, **options))


def _broker_down(exc: BaseException) -> bool:
    """Whether ``exc`` says the broker (or the guardrails store a publish hook writes to) could not take the
    message now, rather than that it refused it: no attempt is spent for it."""
    from amqp.exceptions import ConnectionError as AMQPConnectionError  # type: ignore[import-untyped]
    from amqp.exceptions import MessageNacked
    from kombu.exceptions import OperationalError

    from celery_guardrails.exceptions import StoreUnavailableError

    # MessageNacked: RabbitMQ could not take it (a queue process failed, or a full queue with
    # x-overflow=reject-publish); nothing about the message itself.
    return isinstance(
        exc,
        OperationalError | ConnectionError | OSError | AMQPConnectionError | MessageNacked | StoreUnavailableError,
    )


def relay(
    app: Any,
    *,
    batch: int = 100,
    lease: float = LEASE,
    now: datetime | None = None,
    publisher: RelayPublisher | None = None,
) -> Relayed:
    """Publish up to ``batch`` due rows, oldest first (see the module docstring), through ``publisher`` (a
    relay loop's, kept from pass to pass; else one for this pass). Raises only what the database raises (a row
    claimed before that is published again once its lease is over)."""
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
    own = publisher is None
    sender = RelayPublisher(app) if publisher is None else publisher
    try:
        published, failed, dead = _publish_rows(app, rows, sender, moment)
    finally:
        if own:
            sender.close()
    # 3. Delete what was published. A relay killed between 2 and 3 leaves its rows to come back after the lease
    # and be published again: at least once.
    with transaction.atomic():
        OutboxMessage.objects.filter(pk__in=published).delete()
        for row in failed:
            OutboxMessage.objects.filter(pk=row.pk).update(
                attempts=row.attempts, last_error=row.last_error, available_at=row.available_at
            )
    recorded = sum(_dead_letter(app, row, exc, moment=moment) for row, exc in dead)
    return Relayed(published=len(published), failed=len(failed) + len(dead) - recorded, dead_lettered=recorded)


def _publish_rows(
    app: Any, rows: list[OutboxMessage], publisher: RelayPublisher, moment: datetime
) -> tuple[list[int], list[OutboxMessage], list[tuple[OutboxMessage, Exception]]]:
    """2. Publish each claimed row: the ids published, the rows kept (their new attempts, error and time set), and
    the rows at their last attempt with the error that ended it (to become dead letters)."""
    limit = int(app_value(app, "outbox_max_attempts"))
    published: list[int] = []
    failed: list[OutboxMessage] = []
    dead: list[tuple[OutboxMessage, Exception]] = []
    for index, row in enumerate(rows):
        try:
            _publish(app, row, publisher)
        except Exception as exc:
            row.last_error = f"{type(exc).__name__}: {exc}"[:2000]
            if _broker_down(exc):  # not the row's fault: it and the rest wait for the next pass, none spent
                logger.warning(
                    "Outbox: publishing %s[%s] failed for want of the broker (no attempt spent; the pass ends): %s",
                    row.task_name,
                    row.task_id,
                    row.last_error,
                )
                row.available_at = moment
                failed.append(row)
                OutboxMessage.objects.filter(pk__in=[r.pk for r in rows[index + 1 :]]).update(available_at=moment)
                break
            row.attempts += 1
            if row.attempts >= limit:
                dead.append((row, exc))
                continue
            delay = min(BACKOFF_MAX, 2.0 ** (row.attempts - 1))
            row.available_at = moment + timedelta(seconds=delay)
            failed.append(row)
            logger.warning(
                "Outbox: publishing %s[%s] failed (attempt %d of %d, next in %.0fs): %s",
                row.task_name,
                row.task_id,
                row.attempts,
                limit,
                delay,
                row.last_error,
            )
            continue
        published.append(row.pk)
    return published, failed, dead


@dataclass(frozen=True, slots=True, kw_only=True)
class Unregistered:
    """What a dead letter is recorded for when the row's task is not registered here: its name and the app
    (redaction, owner patterns, sinks and seal keys are the app's)."""

    app: Any
    name: str

    def run(self, *args: Any, **kwargs: Any) -> None:
        """No parameter names: arguments are redacted by value only."""


def _failure(task: Any, row: OutboxMessage, exc: Exception, *, moment: datetime) -> FinalFailure:
    from celery_guardrails.foundation.redaction import exception_name, exception_text
    from celery_guardrails.runtime.dead_letters import TRACEBACK_LIMIT
    from celery_guardrails.runtime.final_failure import FinalFailure
    from celery_guardrails.runtime.outcomes import UNPUBLISHABLE, formatted_traceback, kept_text, owner_of

    try:
        args, kwargs = _arguments(row)
    except Exception:
        # Not JSON any more (damaged in the table): kept as bytes, which the record shows as a repr and flags not
        # replayable (and no sealed copy is made of them), never as an empty call a replay would run.
        args, kwargs = [row.body.encode("utf-8", "backslashreplace")], {}
    options = dict(row.options or {})
    header = headers.context(tenant=row.tenant, correlation_id=row.correlation_id)
    call = {name: value for name, value in options.items() if name in OPTIONS}
    if call:
        header[headers.OPTIONS] = call
    queue = options.get("queue") or options.get("routing_key")
    return FinalFailure(
        task_name=row.task_name,
        task_id=row.task_id,
        reason=UNPUBLISHABLE,
        exc_type=exception_name(exc),
        exc_message=kept_text(task, exception_text(exc), headers.MESSAGE_LIMIT),
        tenant=row.tenant or None,
        correlation_id=row.correlation_id or None,
        attempts=row.attempts,
        args=tuple(args),
        kwargs=kwargs,
        queue=queue if isinstance(queue, str) else None,
        owner=owner_of(task),
        header=header,
        traceback=kept_text(task, formatted_traceback(exc), TRACEBACK_LIMIT, tail=True),
        # The row keeps no time of its first failed publish: its enqueue, a relay interval before it.
        first_failed_at=row.created_at.isoformat(timespec="milliseconds"),
        last_failed_at=moment.isoformat(timespec="milliseconds"),
    )


def _dead_letter(app: Any, row: OutboxMessage, exc: Exception, *, moment: datetime) -> bool:
    """Record ``row`` as a dead letter ``unpublishable`` and delete it, in one transaction; whether that was
    done. When it was not (a sink out of reach), the row stays, backed off, and is tried again."""
    from celery_guardrails.runtime import dead_letters

    task = app.tasks.get(row.task_name) or Unregistered(app=app, name=row.task_name)
    try:
        failure = _failure(task, row, exc, moment=moment)
        with transaction.atomic():
            # The Django sink writes in this transaction; the row goes with it or not at all. A Redis sink's entry
            # written before a rollback is found again by task id when the row comes back (one record).
            new = dead_letters.record(task, failure)
            OutboxMessage.objects.filter(pk=row.pk).delete()
    except Exception:
        logger.exception(
            "Outbox: %s[%s] could not be recorded as a dead letter after %d attempts; kept, tried again later",
            row.task_name,
            row.task_id,
            row.attempts,
        )
        OutboxMessage.objects.filter(pk=row.pk).update(
            attempts=row.attempts, last_error=row.last_error, available_at=moment + timedelta(seconds=BACKOFF_MAX)
        )
        return False
    logger.error(
        "Outbox: %s[%s] could not be published in %d attempts; dead-lettered unpublishable (tenant %s, "
        "correlation id %s): %s",
        row.task_name,
        row.task_id,
        row.attempts,
        shown(row.tenant),  # "-" for none, as the log context and the admin show it
        shown(row.correlation_id),
        failure.exc_message,
    )
    for signal in (signals.final_failure, *((signals.dead_lettered,) if new else ())):
        try:
            signal.send(sender=task, failure=failure)
        except Exception:  # a receiver's bug: the record stands
            logger.exception("Outbox: a receiver of %s failed for %s", signal.name, row.task_id)
    return True


def backlog(*, now: datetime | None = None) -> tuple[int, float | None]:
    """(rows waiting, seconds since the oldest was enqueued; None when there is none): the relay's lag."""
    moment = now or datetime.now(UTC)
    oldest = OutboxMessage.objects.order_by("created_at").values_list("created_at", flat=True).first()
    if oldest is None:
        return 0, None
    return OutboxMessage.objects.count(), max(0.0, (moment - oldest).total_seconds())


def relay_loop(app: Any, stopping: threading.Event, *, interval: float | None = None, batch: int | None = None) -> None:
    """Relay until ``stopping`` is set: a pass, then a wait of ``interval`` unless the pass filled its batch."""
    wait = float(app_value(app, "outbox_relay_interval") if interval is None else interval)
    size = int(app_value(app, "outbox_batch") if batch is None else batch)
    lease = float(app_value(app, "outbox_relay_lease"))
    with quiet():  # no pool child forked while this thread is inside kombu's imports
        publisher = RelayPublisher(app)  # one broker connection for every pass
    failures = 0
    try:
        while not stopping.is_set():
            full = False
            try:
                # The project's CONN_MAX_AGE decides whether the connection lives across passes (Django's default,
                # 0, closes it); one left broken by a failed pass is closed here either way.
                with quiet():  # no pool child forked while a pass is inside the database driver
                    close_old_connections()
                    done = relay(app, batch=size, lease=lease, publisher=publisher)
                full = done.handled >= size
                if failures:
                    logger.info("Outbox relay: working again after %d failed pass(es)", failures)
                failures = 0
            except Exception:
                failures += 1
                (logger.exception if failures == 1 else logger.debug)("Outbox relay: a pass failed", exc_info=True)
            if not full:
                stopping.wait(wait)
    finally:
        publisher.close()
        connection.close()
