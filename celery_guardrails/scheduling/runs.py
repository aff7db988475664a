"""A watched entry's due periods: which are dispatched and which recorded missed (:func:`plan`, by the
entry's ``catch_up`` policy), one dispatch (recorded in the run ledger first, then published: :func:`dispatch`),
the horizon a restarted beat goes on from (:func:`horizon`), a disabled row's periods recorded
``skipped_disabled`` (:func:`skip_disabled`), and the signal and owner's alert for a missed or overdue run
(:func:`report`). Called by the guarded scheduler (:mod:`.beat`) on every tick and by the watchdog.
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime
from typing import Any

from kombu.exceptions import OperationalError

from celery_guardrails import signals
from celery_guardrails.log import moment_text
from celery_guardrails.runtime import headers
from celery_guardrails.scheduling.entries import Entry
from celery_guardrails.scheduling.ledger import DISPATCHED, MISSED, SKIPPED_DISABLED, Heads, period_key
from celery_guardrails.stores import get_store

logger = logging.getLogger(__name__)


def skip_disabled(app: Any, entry: Entry, current: float, *, heads: Heads | None = None) -> float | None:
    """Record the newest period of a disabled schedule that came due ``skipped_disabled``, so that when it is
    enabled again it goes on from the next period instead of counting its disabled time as missed.

    Called by beat on each tick and by the watchdog on each check (once a period is enough: the newest record
    is the schedule's horizon), which passes the ``heads`` it read for every schedule at once. Returns the
    horizon, None when the schedule has no record (never run: nothing is owed when it is enabled)."""
    store = get_store(app)
    if heads is None:
        heads = Heads(newest_period=next((run.period for run in store.run_list(entry.name, limit=1)), None))
    if heads.newest_period is None:
        return None
    periods = entry.periods(heads.newest_period, current)
    if not periods:
        return heads.newest_period
    reason = "its schedule was disabled when it came due"
    if store.run_record(entry.name, periods[-1], status=SKIPPED_DISABLED, now=current, reason=reason):
        logger.info("Guarded beat entry %r is disabled: period %s skipped", entry.name, moment_text(periods[-1]))
    return periods[-1]


def owner_of_entry(app: Any, entry: Entry) -> str | None:
    """Who hears of the entry's missed and overdue runs: its policy's owner, else its task's."""
    if entry.policy.owner:
        return entry.policy.owner
    task = app.tasks.get(entry.task)
    if task is not None:
        from celery_guardrails.runtime.outcomes import owner_of

        return owner_of(task)
    return None


def moment(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def report(app: Any, entry: Entry, period: float, *, kind: str, reason: str, **extra: Any) -> None:
    """A missed or overdue period was recorded (once, by whoever recorded it): signal, and alert its owner
    unless an alert about this schedule went out within ``run_alert_throttle`` (then it is counted for the
    summary: see :func:`celery_guardrails.operations.alerts.run_alert_due`)."""
    from celery_guardrails.operations.alerts import run_alert_due, send

    owner = owner_of_entry(app, entry)
    details = {"schedule": entry.name, "task": entry.task, "period": moment(period), "reason": reason, **extra}
    logger.warning("Scheduled run %s of %r %s: %s", moment_text(period), entry.name, kind, reason)
    signal = signals.run_missed if kind == "missed" else signals.run_overdue
    try:
        signal.send(sender=app, owner=owner, **details)
        if run_alert_due(app, owner=owner, schedule=entry.name, kind=kind):
            subject = f"Run {kind}: {entry.name} at {moment_text(period)}"
            send(app, subject=subject, run=details, owner=owner)
    except Exception:  # an alert must never stop beat or the watchdog
        logger.exception("Alert for the %s run %s of %r could not be sent", kind, moment_text(period), entry.name)


def horizon(app: Any, name: str) -> float | None:
    """The newest period of ``name`` the ledger says was handled (a missed record no message was sent for
    does not count: a catch-up may still take it); None when the schedule has no record."""
    runs = get_store(app).run_list(name, limit=200)
    for run in runs:
        if run.status != MISSED or run.task_id:
            return run.period
    return runs[-1].period - 1 if runs else None


def plan(entry: Entry, periods: list[float], current: float) -> tuple[list[float], list[float]]:
    """(periods to dispatch, periods to record missed), each oldest first, for due ``periods``."""
    grace = entry.grace
    late = [p for p in periods if current - p > grace]
    on_time = [p for p in periods if current - p <= grace]
    if entry.policy.catch_up == "skip" or not late:
        return on_time, late
    if entry.policy.catch_up == "latest":
        # "Run the most recent": a period due on time in this tick is the most recent one. Dispatching a stale
        # period beside it would let the stale run take the overlap slot and the current one be skipped.
        return (on_time, late) if on_time else (late[-1:], late[:-1])
    keep = entry.policy.catch_up_limit
    return late[-keep:] + on_time, late[:-keep]


class PublishFailed(Exception):
    """A period's message could not be published (the broker is out of reach); the period is due again."""


def dispatch(app: Any, entry: Entry, period: float, *, current: float, catch_up: bool = False) -> str | None:
    """Dispatch one period of ``entry`` once: record it, then publish. The task id, or None when the period
    was recorded already (another beat, an earlier dispatch)."""
    task_id = str(uuid.uuid4())
    if not get_store(app).run_dispatch(entry.name, period, task_id=task_id, now=current):
        return None
    options = dict(entry.options)
    message_headers = dict(options.pop("headers", None) or {})
    guardrails = headers.from_message_headers(message_headers)
    guardrails.update(
        {
            headers.SCHEDULE: entry.name,
            headers.PERIOD: round(period),
            headers.IDEMPOTENCY_KEY: period_key(entry.name, period),
        }
    )
    if catch_up:
        guardrails[headers.CATCH_UP] = 1
    if entry.tenant is not None:
        guardrails[headers.TENANT] = entry.tenant
    message_headers[headers.HEADER] = guardrails
    logger.info(
        "Dispatching %r period %s as %s%s", entry.name, moment_text(period), task_id, " (catch-up)" if catch_up else ""
    )
    task = app.tasks.get(entry.task)
    try:
        if task is not None:
            task.apply_async(entry.args, entry.kwargs, task_id=task_id, headers=message_headers, **options)
        else:
            app.send_task(entry.task, entry.args, entry.kwargs, task_id=task_id, headers=message_headers, **options)
    except (OperationalError, OSError) as exc:
        # The broker could not be reached: nothing was sent. Forget the dispatch, so the period is due again
        # (the next tick dispatches it, or its catch-up policy decides once it is late); kept "dispatched",
        # no catch-up could ever take it.
        logger.exception("Publishing %r period %s failed; it is due again", entry.name, moment_text(period))
        try:
            get_store(app).run_undispatch(entry.name, period, task_id=task_id)
        except Exception:  # the watchdog reports it missed after grace
            logger.exception("The dispatch of %r period %s could not be forgotten", entry.name, moment_text(period))
        raise PublishFailed(str(exc)) from exc
    except Exception as exc:
        # The entry itself is wrong (its arguments do not fit the task, say): trying again each tick would
        # fail the same way. The period is recorded missed, saying why, and its owner is alerted.
        reason = f"could not be published: {type(exc).__name__}: {exc}"
        logger.exception("Publishing %r period %s failed", entry.name, moment_text(period))
        if get_store(app).run_transition(
            entry.name, period, from_=(DISPATCHED,), to=MISSED, now=current, reason=reason
        ):
            report(app, entry, period, kind="missed", reason=reason, task_id=task_id)
    return task_id
