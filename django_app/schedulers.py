"""django-celery-beat with the schedule guardrails.

Run beat with ``-S django_celery_guardrails.schedulers:GuardedDatabaseScheduler``: ``PeriodicTask`` rows
whose name has a policy in ``CELERY_GUARDRAILS["schedules"]`` are dispatched through the run ledger (see
:mod:`celery_guardrails.beat`); every other row is left to django-celery-beat as it is. A row's crontab
time zone is used when its policy states none.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from celery import current_app
from django.db import DatabaseError, close_old_connections
from django.db.models import F
from django.utils import timezone
from django_celery_beat.models import PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler, ModelEntry

from celery_guardrails.beat import Entry, GuardedSchedulerMixin, build_disabled_entries, build_entries
from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.options import app_value

logger = logging.getLogger(__name__)


class Unparsable:
    """Stands for the schedule of a row that cannot be read (a crontab field out of range)."""

    def __init__(self, error: str) -> None:
        self.error = error


def periodic_task_rows(app: Any = None, *, names: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """Rows named ``names``, in one query: (enabled ones as beat entries, disabled ones as beat entries, the names
    of all). An enabled row whose schedule cannot be read is kept, standing for its error (django-celery-beat
    itself skips it with a log line, so a guarded entry would silently never run); a disabled one is left out
    (it is not due anyway)."""
    enabled: dict[str, Any] = {}
    disabled: dict[str, Any] = {}
    found = set()
    for row in PeriodicTask.objects.filter(name__in=list(names)):
        found.add(row.name)
        try:
            (enabled if row.enabled else disabled)[row.name] = ModelEntry(row, app=app or current_app)
        except (ValueError, TypeError) as exc:
            if row.enabled:
                error = Unparsable(f"its schedule does not parse: {exc}")
                enabled[row.name] = {"task": row.task, "schedule": error}
    return enabled, disabled, found


class GuardedDatabaseScheduler(GuardedSchedulerMixin, DatabaseScheduler):  # type: ignore[misc]
    """django-celery-beat's DatabaseScheduler with the schedule guardrails."""

    def dispatched(self, entry: Entry, period: float, task_id: str) -> None:
        # django-celery-beat's admin shows "last run" and a run count: keep them true for guarded rows too
        # (an UPDATE, which does not mark the schedule as changed).
        PeriodicTask.objects.filter(name=entry.name).update(
            last_run_at=timezone.now(), total_run_count=F("total_run_count") + 1
        )

    def tick_guarded(self) -> float:
        # A connection an outage broke is dropped before the tick uses it (django-celery-beat does the same
        # before it reads its rows); beat does not run inside a request, where Django would do it.
        close_old_connections()
        return super().tick_guarded()

    def current_entries(self) -> dict[str, Entry]:
        # Rows can be added, changed, disabled or renamed while beat runs: read them again on every tick.
        try:
            self._guardrails_entries, self._guardrails_disabled_entries = self._read_rows()
        except ConfigurationError:  # a policy's row renamed or broken meanwhile: keep the last good entries
            logger.exception("celery-guardrails: guarded beat entries not reloaded")
        except DatabaseError:  # a database blip: keep the last entries, try again next tick
            logger.exception("celery-guardrails: guarded beat entries not reloaded (database error)")
        return self._guardrails_entries

    def current_disabled_entries(self) -> dict[str, Entry]:
        return getattr(self, "_guardrails_disabled_entries", {})

    def guarded_entries(self) -> dict[str, Entry]:
        return self._read_rows()[0]

    def _read_rows(self) -> tuple[dict[str, Entry], dict[str, Entry]]:
        # Straight from the rows with a policy (one query a tick), not from self.schedule: a row
        # django-celery-beat cannot read is missing there, and must stop beat instead.
        policies = app_value(self.app, "schedules")
        enabled, disabled, names = periodic_task_rows(self.app, names=policies)
        warned = self._guardrails_warned
        return (
            build_entries(self.app, enabled, known=names, warned=warned),
            build_disabled_entries(self.app, disabled, warned=warned),
        )
