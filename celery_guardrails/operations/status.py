"""What ``celery -A proj guardrails status`` shows and the metrics collector exports, read at the time asked.

Each source is read on its own (:func:`read_dead_letters`, :func:`read_dependencies`, :func:`read_schedules`,
:func:`celery_guardrails.broker.queues.read_queues` and :func:`celery_guardrails.operations.activity.rates`);
:func:`gather`
reads them all into one :class:`Status`, in which a source that could not be read (its store or broker down) is
named in ``errors`` with the reason, and the others are there: a status read never raises for a source.
:func:`render` writes it as a table, :func:`as_json` as JSON.

Where each comes from:

* rates in and out per queue (with the ``activity`` option, its default): deliveries that ended per minute over
  the last :data:`RATE_MINUTES` whole minutes, from the outcome counts the workers keep in the store, and
  arrivals derived as those plus the depth's change between the first and last queue samples of the window
  (a broker counts no arrivals); "?" until two samples are kept.
* messages waiting for a countdown (when the app has a guarded task): re-published by a retry, a
  retry-budget or circuit deferral, a wait for a concurrency slot, an ordering turn, a busy key or a store
  outage, and not in any queue until the broker delivers them again: how many per reason, and the
  :data:`WAITING_SHOWN` soonest due (task, id, tenant, reason, attempt, due, since when), from the store's rows
  (see :mod:`celery_guardrails.guardrails.waiting`).
* the transactional outbox (with the Django app): messages waiting for the relay and the age of the oldest.
* dead letters still open, per owner and task: the app's dead-letter sinks
  (:func:`celery_guardrails.runtime.dead_letters.sinks_for`). The Django sink: ``DeadLetter`` rows with status
  ``open``, counted by the database. The Redis stream sink keeps no status (nothing closes a stream entry):
  every entry counts as open, and only the newest :data:`STREAM_SCAN` entries are read (``truncated`` says
  when the stream holds more).
* retry budget and circuit per dependency: the ``dependency`` of each guarded task of the app (a dependency
  given only per call is not known here), read with the store's ``budget_status`` under that task's policy.
* ordering keys that wait for a missing earlier message (when a guarded task declares ``ordering_key``): how
  many, the oldest wait's age, and the :data:`ORDERING_SHOWN` oldest (key, the number waited for, since when),
  from the store's index of waits (written as a wait starts and ends, not by each look of a waiting message).
* per watched schedule (every beat entry: its policy, or the default one): records of the run ledger in the last
  :data:`WINDOW` seconds that were missed or overdue (a period that was missed or overdue and then ran still
  counts: its ``missed_at`` / ``overdue_at`` stay), the newest successful period, and the newest record's
  status, read with the store's ``run_list``.

The shape of a read is in :mod:`.status_data`, the readers of each source in :mod:`.status_sources`, the text
and JSON in :mod:`.status_text`; their names stay importable from here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from celery_guardrails.broker.queues import read_queues
from celery_guardrails.foundation.redaction import DEFAULT, exception_text, for_app
from celery_guardrails.operations import activity
from celery_guardrails.operations.status_data import (
    DEAD_LETTERS,
    DEPENDENCIES,
    LEDGER_SCAN,
    ORDERING,
    ORDERING_SHOWN,
    OUTBOX,
    QUEUES,
    RATE_MINUTES,
    RATES,
    SCHEDULES,
    SOURCES,
    STREAM_SCAN,
    WAITING,
    WAITING_SHOWN,
    WINDOW,
    DeadLetterCount,
    DeadLetters,
    DependencyStatus,
    OrderingWait,
    OrderingWaits,
    OutboxBacklog,
    ScheduleStatus,
    Status,
    Waiting,
    WaitingMessage,
)
from celery_guardrails.operations.status_sources import (
    guarded,
    ordered,
    read_dead_letters,
    read_dependencies,
    read_ordering,
    read_outbox,
    read_schedules,
    read_waiting,
)
from celery_guardrails.operations.status_text import as_dict, as_json, render
from celery_guardrails.stores import django_apps_installed

logger = logging.getLogger(__name__)

T = TypeVar("T")


def attempt(source: str, read: Callable[[], T], errors: dict[str, str], *, app: Any = None) -> T | None:
    """``read()``, or None with the failure logged and kept in ``errors[source]`` (redacted with ``app``'s
    settings, else the defaults): a status read or a scrape goes on without a source it cannot read."""
    try:
        return read()
    except Exception as exc:
        # The reason in the warning, the traceback at debug: a status command prints no traceback for a down store.
        logger.warning("Guardrails status: reading %s failed: %r", source, exc)
        logger.debug("Guardrails status: reading %s failed", source, exc_info=True)
        # Printed by the commands: a store's error names its URL, password included.
        redaction = for_app(app) if app is not None else DEFAULT
        errors[source] = redaction.text(f"{type(exc).__name__}: {exception_text(exc)}", keep=300)
        return None


def gather(app: Any, *, queues: Iterable[str] = (), now: float | None = None) -> Status:
    """Read every source (see the module docstring); never raises for a source that cannot be read."""
    names = list(queues)
    status = Status(at=time.time() if now is None else now)
    errors = status.errors
    status.queues = attempt(QUEUES, lambda: read_queues(app, names, now=status.at), errors, app=app) or []
    if activity.enabled(app):
        status.rates = attempt(RATES, lambda: activity.rates(app, minutes=RATE_MINUTES), errors, app=app)
    status.dead_letters = attempt(DEAD_LETTERS, lambda: read_dead_letters(app), errors, app=app) or DeadLetters(
        counts=[]
    )
    status.dependencies = attempt(DEPENDENCIES, lambda: read_dependencies(app), errors, app=app) or []
    status.schedules = attempt(SCHEDULES, lambda: read_schedules(app), errors, app=app) or []
    if django_apps_installed():
        status.outbox = attempt(OUTBOX, read_outbox, errors, app=app)
    if ordered(app):
        status.ordering = attempt(ORDERING, lambda: read_ordering(app, now=status.at), errors, app=app)
    if guarded(app):
        status.waiting = attempt(WAITING, lambda: read_waiting(app, now=status.at), errors, app=app)
    return status


def with_change(current: Status, previous: Status | None) -> Status:
    """``current`` with each queue's depth change per second since ``previous`` (watch mode)."""
    if previous is None or current.at <= previous.at:
        return current
    before = {queue.queue: queue.depth for queue in previous.queues}
    elapsed = current.at - previous.at
    current.depth_change = {
        queue.queue: (queue.depth - before[queue.queue]) / elapsed for queue in current.queues if queue.queue in before
    }
    return current


# The names other modules read from here (their code is in the modules named in the docstring).
__all__ = [
    "DEAD_LETTERS",
    "DEPENDENCIES",
    "LEDGER_SCAN",
    "ORDERING",
    "ORDERING_SHOWN",
    "OUTBOX",
    "QUEUES",
    "RATES",
    "RATE_MINUTES",
    "SCHEDULES",
    "SOURCES",
    "STREAM_SCAN",
    "WAITING",
    "WAITING_SHOWN",
    "WINDOW",
    "DeadLetterCount",
    "DeadLetters",
    "DependencyStatus",
    "OrderingWait",
    "OrderingWaits",
    "OutboxBacklog",
    "ScheduleStatus",
    "Status",
    "Waiting",
    "WaitingMessage",
    "as_dict",
    "as_json",
    "attempt",
    "gather",
    "guarded",
    "ordered",
    "read_dead_letters",
    "read_dependencies",
    "read_ordering",
    "read_outbox",
    "read_schedules",
    "read_waiting",
    "render",
    "with_change",
]
