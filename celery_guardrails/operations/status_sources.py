"""Reading each source of a status, on its own: open dead letters from every sink of the app, the budget and
circuit of each dependency, the run ledger of each watched schedule, the ordering keys that wait, the messages
waiting for a countdown, and the transactional outbox. Each reader raises what its store or database raises;
:func:`~.status.attempt` turns that into a named error of the read (see :mod:`.status` for where each comes from).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from celery_guardrails.operations.status_data import (
    LEDGER_SCAN,
    ORDERING_SHOWN,
    STREAM_SCAN,
    WAITING_SHOWN,
    WINDOW,
    DeadLetterCount,
    DeadLetters,
    DependencyStatus,
    OrderingWait,
    OrderingWaits,
    OutboxBacklog,
    ScheduleStatus,
    Waiting,
    WaitingMessage,
)
from celery_guardrails.options import TaskOptions
from celery_guardrails.scheduling.ledger import MISSED, OK, OVERDUE

logger = logging.getLogger(__name__)


def read_dead_letters(app: Any) -> DeadLetters:
    """Open dead letters per (owner, task), from every sink of the app (see the module docstring)."""
    from celery_guardrails.runtime.dead_letters import sinks_for

    totals: Counter[tuple[str, str]] = Counter()
    truncated = False
    for sink in sinks_for(app):
        found = sink.open_counts(limit=STREAM_SCAN)
        totals.update(found.counts)
        truncated = truncated or found.truncated
    counts = [DeadLetterCount(owner=owner, task=task, open=n) for (owner, task), n in sorted(totals.items())]
    return DeadLetters(counts=counts, truncated=truncated)


def read_dependencies(app: Any) -> list[DependencyStatus]:
    """Budget and circuit of each dependency a guarded task of the app declares."""
    from celery_guardrails.foundation.clock import now
    from celery_guardrails.guardrails.budget import policy_for
    from celery_guardrails.options import task_attribute
    from celery_guardrails.runtime.pipeline import is_guarded
    from celery_guardrails.stores import get_store

    tasks: dict[str, Any] = {}
    for task in app.tasks.values():
        dependency = task_attribute(task, "dependency") if is_guarded(task) else None
        if dependency and dependency not in tasks:
            tasks[dependency] = task
    store = get_store(app) if tasks else None
    found = []
    for dependency, task in sorted(tasks.items()):
        status = store.budget_status(dependency, policy_for(TaskOptions(task=task)), now=now(app))  # type: ignore[union-attr]
        found.append(
            DependencyStatus(
                dependency=dependency,
                retries=float(status["retries"]),
                retries_allowed=float(status["retries_allowed"]),
                exhausted=bool(status["exhausted"]),
                circuit=str(status["circuit"]),
                consecutive_failures=int(status["consecutive_failures"]),
                window_seconds=float(status["window_seconds"]),
            )
        )
    return found


def read_schedules(app: Any) -> list[ScheduleStatus]:
    """The ledger of each watched schedule: every beat entry, with its policy or the default one (see the module
    docstring)."""
    from celery_guardrails.foundation.clock import now
    from celery_guardrails.options import app_value
    from celery_guardrails.scheduling.beat import all_configured_entries
    from celery_guardrails.stores import get_store

    policies = app_value(app, "schedules")
    names = {name for name, policy in policies.items() if policy is not None}
    try:
        entries, disabled = all_configured_entries(app)
        names |= {*entries, *disabled}
    except Exception:  # a bad setting (beat and the worker say it), rows out of reach: the policies' ledgers still
        logger.debug("Status: the beat entries cannot be read; the schedules with a policy are listed", exc_info=True)
    if not names:
        return []
    store = get_store(app)
    current = now(app)
    since = current - WINDOW
    found = []
    for name in sorted(names):
        runs = store.run_list(name, limit=LEDGER_SCAN)
        recent = [run for run in runs if run.period >= since]
        success = next((run for run in runs if run.status == OK), None)
        if success is None and len(runs) >= LEDGER_SCAN:  # older than what was read: ask for it alone
            success = next(iter(store.run_list(name, statuses=(OK,), limit=1)), None)
        found.append(
            ScheduleStatus(
                schedule=name,
                missed=sum(1 for run in recent if run.status == MISSED or run.missed_at is not None),
                overdue=sum(1 for run in recent if run.status == OVERDUE or run.overdue_at is not None),
                last_success=None if success is None else success.period,
                last_success_age=None if success is None else max(0.0, current - success.period),
                last_status=runs[0].status if runs else None,
            )
        )
    return found


def ordered(app: Any) -> bool:
    """Whether a guarded task of the app declares an ``ordering_key`` (one given only per call is not known)."""
    from celery_guardrails.options import task_attribute
    from celery_guardrails.runtime.pipeline import is_guarded

    return any(
        is_guarded(task) and task_attribute(task, "ordering_key") is not None for task in list(app.tasks.values())
    )


def read_ordering(app: Any, *, now: float) -> OrderingWaits:
    """The ordering keys that wait, from the store's index of waits (:meth:`Store.order_waits`)."""
    from celery_guardrails.stores import get_store

    found = get_store(app).order_waits(now=now, limit=ORDERING_SHOWN)
    oldest = [
        OrderingWait(
            key=wait.key,
            waiting_for=wait.waiting_for,
            lowest=wait.lowest,
            since=wait.since,
            age=max(0.0, now - wait.since),
        )
        for wait in found.oldest
    ]
    return OrderingWaits(waiting=found.count, oldest_age=oldest[0].age if oldest else None, oldest=oldest)


def guarded(app: Any) -> bool:
    """Whether the app has a guarded task (only those can wait for a countdown the guardrails set)."""
    from celery_guardrails.runtime.pipeline import is_guarded

    return any(is_guarded(task) for task in list(app.tasks.values()))


def read_waiting(app: Any, *, now: float, tenants: frozenset[str] | None = None, limit: int = WAITING_SHOWN) -> Waiting:
    """The messages waiting for a countdown, from the store (:meth:`Store.waiting`): the ``limit`` soonest due;
    ``tenants``: only theirs."""
    from celery_guardrails.guardrails import waiting
    from celery_guardrails.stores import get_store

    found = get_store(app).waiting(now=now, limit=limit, tenants=tenants)
    order = {reason: n for n, reason in enumerate(waiting.REASONS)}
    by_reason = dict(sorted(found.by_reason.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))
    soonest = [
        WaitingMessage(
            task=wait.task_name,
            task_id=wait.task_id,
            tenant=wait.tenant,
            reason=wait.reason,
            detail=wait.detail,
            reason_text=waiting.label(wait),
            attempt=wait.attempt,
            due=wait.due,
            due_text=waiting.due_in_words(wait, now),
            since=wait.since,
            overdue=waiting.overdue(wait, now),
        )
        for wait in found.soonest
    ]
    return Waiting(count=found.count, by_reason=by_reason, soonest=soonest)


def read_outbox() -> OutboxBacklog:
    """The outbox's backlog (see :func:`django_celery_guardrails.outbox.backlog`), through the outbox the Django
    app registered (:func:`celery_guardrails.runtime.outbox.registered`)."""
    from celery_guardrails.runtime.outbox import registered

    waiting, oldest = registered().backlog()
    return OutboxBacklog(waiting=waiting, oldest_age=oldest)
