"""django-celery-beat with the schedule guardrails.

Run beat with ``-S django_celery_guardrails.schedulers:GuardedDatabaseScheduler``: ``PeriodicTask`` rows are
dispatched through the run ledger (see :mod:`celery_guardrails.scheduling.beat`), each with its policy in
``CELERY_GUARDRAILS["schedules"]`` or the default one; a row opted out (``{"name": None}``), one-off, or whose
task is a plain Celery task is left to django-celery-beat as it is. A row's crontab time zone is used when its
policy states none.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from django.db import DatabaseError, close_old_connections
from django.db.models import F
from django.utils import timezone
from django_celery_beat.models import ClockedSchedule, CrontabSchedule, IntervalSchedule, PeriodicTask, SolarSchedule
from django_celery_beat.schedulers import DatabaseScheduler

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.scheduling.beat import Entry, GuardedSchedulerMixin, build_disabled_entries, build_entries

logger = logging.getLogger(__name__)


class Unparsable:
    """Stands for the schedule of a row that cannot be read (a crontab field out of range)."""

    def __init__(self, error: str) -> None:
        self.error = error


#: The fields a guarded entry is made of, read as values: no model instances for 10,000 rows a tick.
ROW_FIELDS = (
    *("name", "task", "enabled", "one_off", "args", "kwargs", "headers", "expires", "expire_seconds"),
    *("queue", "exchange", "routing_key", "priority"),
    *("interval_id", "crontab_id", "solar_id", "clocked_id"),
)
#: A row's schedule kinds, in the order django-celery-beat's ``PeriodicTask.scheduler`` looks at them.
KINDS = (
    ("interval_id", IntervalSchedule),
    ("crontab_id", CrontabSchedule),
    ("solar_id", SolarSchedule),
    ("clocked_id", ClockedSchedule),
)


def periodic_task_rows(
    app: Any = None, *, names: Iterable[str] | None
) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """Rows named ``names`` (None: every row; one query, and one per schedule kind): (enabled ones as beat entries,
    disabled ones as beat entries, the names of all). An enabled row whose schedule or arguments cannot be read is kept,
    standing for its error (django-celery-beat itself skips it with a log line, so a guarded entry would
    silently never run); a disabled one is left out (it is not due anyway). ``app`` is not read: entries are
    plain mappings."""
    found = PeriodicTask.objects.all() if names is None else PeriodicTask.objects.filter(name__in=list(names))
    rows = list(found.values(*ROW_FIELDS))
    schedules = _schedules(rows)
    enabled: dict[str, Any] = {}
    disabled: dict[str, Any] = {}
    for row in rows:
        try:
            (enabled if row["enabled"] else disabled)[row["name"]] = _entry(row, schedules)
        except ValueError as exc:
            if row["enabled"]:
                broken = Unparsable(str(exc))
                enabled[row["name"]] = {"task": row["task"], "schedule": broken, "one_off": row["one_off"]}
    return enabled, disabled, {row["name"] for row in rows}


def _schedules(rows: list[dict[str, Any]]) -> dict[tuple[str, int], Any]:
    """The Celery schedule of each schedule row the rows use, made once by django-celery-beat's own
    ``schedule`` property (many rows share one crontab: parsing it for each is most of the time of a read), or
    an :class:`Unparsable` saying what is wrong with it."""
    made: dict[tuple[str, int], Any] = {}
    for column, model in KINDS:
        for pk, schedule_row in model.objects.in_bulk({row[column] for row in rows if row[column] is not None}).items():
            try:
                made[column, pk] = schedule_row.schedule
            except (ValueError, TypeError) as exc:
                made[column, pk] = Unparsable(f"its schedule does not parse: {exc}")
    return made


def _entry(row: dict[str, Any], schedules: dict[tuple[str, int], Any]) -> dict[str, Any]:
    """The beat entry of a row, as django-celery-beat's ``ModelEntry`` makes it: task, schedule, arguments, and
    the options it publishes with (queue, exchange, routing key, priority, expiry, headers naming the row)."""
    column = next((column for column, _ in KINDS if row[column] is not None), None)
    schedule = schedules.get((column, row[column])) if column is not None else None
    if schedule is None:
        raise ValueError("its schedule does not parse: it has none (or it was deleted meanwhile)")
    if isinstance(schedule, Unparsable):
        raise ValueError(schedule.error)
    try:
        args, kwargs = _json(row["args"], empty="[]"), _json(row["kwargs"], empty="{}")
        headers = _json(row["headers"], empty="{}")
    except ValueError as exc:
        raise ValueError(f"its args, kwargs or headers are not JSON: {exc}") from None
    if not isinstance(headers, dict):
        raise ValueError(f"its headers are not a JSON object: {row['headers']!r:.80}")
    options = {name: row[name] for name in ("queue", "exchange", "routing_key", "priority") if row[name] is not None}
    if row["expires"] or row["expire_seconds"]:
        options["expires"] = row["expires"] or row["expire_seconds"]
    options["headers"] = {**headers, "periodic_task_name": row["name"]}
    return {
        "task": row["task"],
        "schedule": schedule,
        "args": args,
        "kwargs": kwargs,
        "options": options,
        "one_off": row["one_off"],  # django-celery-beat disables it after its run: not watched by default
    }


def _json(text: str | None, *, empty: str) -> Any:
    # Most rows hold "[]" and "{}": those are not parsed (30,000 texts a tick for 10,000 rows).
    if not text or text == empty:
        return [] if empty == "[]" else {}
    return json.loads(text)


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
        # Straight from the rows (one query a tick), not from self.schedule: a row with a policy that
        # django-celery-beat cannot read is missing there, and must stop beat instead.
        enabled, disabled, names = periodic_task_rows(self.app, names=None)
        warned = self._guardrails_warned
        return (
            build_entries(self.app, enabled, known=names, warned=warned),
            build_disabled_entries(self.app, disabled, warned=warned),
        )
