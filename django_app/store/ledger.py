"""The run ledger in the Django database (the :class:`~celery_guardrails.scheduling.ledger.RunLedger` half of the
Django store, mixed in).

One row per (schedule, period) (:class:`~django_celery_guardrails.models.ScheduledRun`), unique on the pair.
Every change is an INSERT the constraint refuses on conflict or one conditional UPDATE, so concurrent beats and
workers need no lock; each INSERT runs in a savepoint, so a refused one leaves the caller's transaction usable.
It mirrors ``celery_guardrails/stores/redis_ledger.py``, whose script has the same rules field by field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import F, QuerySet, Value
from django.db.models.functions import Concat
from django.utils import timezone

from celery_guardrails.scheduling.ledger import (
    DISPATCHED,
    MISSED,
    OVERDUE,
    REASON_MAX_LENGTH,
    RUNNING,
    WAS_OVERDUE,
    Heads,
    Run,
)

from ..models import ScheduledRun
from .database import failure, to_datetime, to_seconds

#: Schedules read per query by run_heads.
HEADS_CHUNK = 500
T = TypeVar("T")


def _period(seconds: float) -> datetime:
    """A period's due instant, in whole seconds: the Redis store keys periods the same way."""
    return to_datetime(round(seconds))


#: The fields of a ledger record, read as values (no model instance made for each of thousands of rows).
RUN_FIELDS = (
    "schedule",
    "period",
    "status",
    "task_id",
    "dispatched_at",
    "started_at",
    "finished_at",
    "reason",
    "missed_at",
    "overdue_at",
)


def _run(row: dict[str, Any]) -> Run:
    return Run(
        schedule=row["schedule"],
        period=row["period"].timestamp(),
        status=row["status"],
        task_id=row["task_id"],
        dispatched_at=to_seconds(row["dispatched_at"]),
        started_at=to_seconds(row["started_at"]),
        finished_at=to_seconds(row["finished_at"]),
        reason=row["reason"],
        missed_at=to_seconds(row["missed_at"]),
        overdue_at=to_seconds(row["overdue_at"]),
    )


class DjangoRunLedger:
    """The run ledger operations of :class:`~django_celery_guardrails.store.DjangoStore` (mixed in)."""

    @staticmethod
    def _ledger(what: str, operation: Callable[[], T]) -> T:
        try:
            return operation()
        except DatabaseError as exc:
            raise failure(what, exc) from exc

    @staticmethod
    def _record(schedule: str, period: float) -> QuerySet[ScheduledRun]:
        return ScheduledRun.objects.filter(schedule=schedule, period=_period(period))

    @staticmethod
    def _insert(schedule: str, period: float, **values: Any) -> bool:
        """Insert the period's record; False when it has one already."""
        try:
            with transaction.atomic():
                ScheduledRun.objects.create(schedule=schedule, period=_period(period), **values)
        except IntegrityError:
            return False
        return True

    @staticmethod
    def _update(records: QuerySet[ScheduledRun], **values: Any) -> bool:
        # QuerySet.update() does not apply auto_now: updated_at is set here.
        return bool(records.update(updated_at=timezone.now(), **values))

    def _upsert(self, schedule: str, period: float, **values: Any) -> None:
        """Update the period's record, else insert it, else (a concurrent insert won) update it after all."""
        records = self._record(schedule, period)
        if not self._update(records, **values) and not self._insert(schedule, period, **values):
            self._update(records, **values)

    def run_dispatch(self, schedule: str, period: float, *, task_id: str, now: float) -> bool:
        values = {"status": DISPATCHED, "task_id": task_id, "dispatched_at": to_datetime(now)}

        def dispatch() -> bool:
            if self._insert(schedule, period, **values):
                return True
            # A missed period that no message was sent for may be dispatched once (a catch-up): it is open again
            # (no end); the reason it was missed is kept.
            missed = self._record(schedule, period).filter(status=MISSED, task_id="")
            return self._update(missed, finished_at=None, **values)

        return self._ledger(f"dispatch {schedule!r} @ {period}", dispatch)

    def run_undispatch(self, schedule: str, period: float, *, task_id: str) -> bool:
        records = self._record(schedule, period).filter(status=DISPATCHED, task_id=task_id)
        return self._ledger(f"forget the dispatch of {schedule!r} @ {period}", lambda: bool(records.delete()[0]))

    def run_record(self, schedule: str, period: float, *, status: str, now: float, reason: str) -> bool:
        values = {"status": status, "reason": reason[:REASON_MAX_LENGTH], "finished_at": to_datetime(now)}
        if status == MISSED:
            values["missed_at"] = values["finished_at"]
        return self._ledger(f"record {schedule!r} @ {period}", lambda: self._insert(schedule, period, **values))

    def run_transition(
        self, schedule: str, period: float, *, from_: tuple[str, ...], to: str, now: float, reason: str
    ) -> bool:
        records = self._record(schedule, period).filter(status__in=from_)
        values = {"status": to, "reason": reason[:REASON_MAX_LENGTH]}

        def move() -> bool:
            if to == OVERDUE:  # overdue_at is kept once set: the record says so after the run finishes
                return self._update(records.filter(overdue_at__isnull=True), overdue_at=to_datetime(now), **values) or (
                    self._update(records, **values)
                )
            if to != MISSED:
                return self._update(records, **values)
            # Reported once: only the update that first sets missed_at answers True; one that moves a period
            # missed before (a lost catch-up) answers False. Each UPDATE is atomic, so of two racing
            # watchdogs one moves the record and the other finds it moved already.
            if self._update(records.filter(missed_at__isnull=True), missed_at=to_datetime(now), **values):
                return True
            self._update(records, **values)
            return False

        return self._ledger(f"move {schedule!r} @ {period} to {to}", move)

    def run_start(self, schedule: str, period: float, *, task_id: str, now: float) -> None:
        # dispatched_at and reason are kept; a start after an end (a redelivered message) clears the end.
        values = {"status": RUNNING, "task_id": task_id, "started_at": to_datetime(now), "finished_at": None}
        self._ledger(f"start {schedule!r} @ {period}", lambda: self._upsert(schedule, period, **values))

    def run_finish(self, schedule: str, period: float, *, status: str, now: float, reason: str = "") -> None:
        values: dict[str, Any] = {"status": status, "finished_at": to_datetime(now)}
        if reason:
            values["reason"] = reason[:REASON_MAX_LENGTH]

        def finish() -> None:
            # No reason keeps the one the record has; a run that was overdue says so first (one UPDATE, from
            # overdue only: a finish delivered twice does not say it twice).
            if not reason:
                was_overdue = self._record(schedule, period).filter(status=OVERDUE)
                if self._update(was_overdue, reason=Concat(Value(WAS_OVERDUE), F("reason")), **values):
                    return
            self._upsert(schedule, period, **values)

        self._ledger(f"finish {schedule!r} @ {period}", finish)

    def run_list(
        self,
        schedule: str,
        *,
        statuses: tuple[str, ...] | None = None,
        before: float | None = None,
        limit: int = 100,
    ) -> list[Run]:
        records = ScheduledRun.objects.of(schedule)
        if statuses is not None:
            records = records.filter(status__in=statuses)
        if before is not None:
            records = records.filter(period__lt=_period(before))
        return self._ledger(
            f"list the runs of {schedule!r}",
            lambda: [_run(row) for row in records.order_by("-period").values(*RUN_FIELDS)[:limit]],
        )

    def run_heads(self, schedules: Iterable[str], *, limit: int = 500) -> dict[str, Heads]:
        names = list(dict.fromkeys(schedules))

        def read() -> dict[str, Heads]:
            newest: dict[str, float] = {}
            pending: dict[str, list[Run]] = {}
            for start in range(0, len(names), HEADS_CHUNK):
                chunk = names[start : start + HEADS_CHUNK]
                newest.update(_newest_periods(chunk))
                records = ScheduledRun.objects.filter(schedule__in=chunk, status__in=(DISPATCHED, RUNNING))
                for row in records.order_by("schedule", "-period").values(*RUN_FIELDS):
                    runs = pending.setdefault(row["schedule"], [])
                    if len(runs) < limit:
                        runs.append(_run(row))
            return {name: Heads(newest_period=newest.get(name), pending=tuple(pending.get(name, ()))) for name in names}

        return self._ledger(f"read the newest runs of {len(names)} schedule(s)", read)


def _newest_periods(names: list[str]) -> Iterator[tuple[str, float]]:
    """(name, period of its newest record) of each schedule that has one: one index-only probe of the
    (schedule, -period) index per name, driven by the names (a VALUES list: PostgreSQL and SQLite both call its
    column column1). A GROUP BY over the ledger would read every record of every schedule (90 days of them)."""
    quote = connection.ops.quote_name
    table, schedule, period = (quote(name) for name in (ScheduledRun._meta.db_table, "schedule", "period"))
    values = ", ".join(["(%s)"] * len(names))
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT wanted.column1, (SELECT {period} FROM {table} WHERE {schedule} = wanted.column1 "
            f"ORDER BY {period} DESC LIMIT 1) FROM (VALUES {values}) AS wanted",
            names,
        )
        for name, newest in cursor.fetchall():
            if newest is not None:
                yield name, _timestamp(newest)


def _timestamp(value: datetime | str) -> float:
    """Epoch seconds of a raw query's timestamp: PostgreSQL's driver gives an aware datetime, SQLite the text
    Django stored (UTC, without its zone: USE_TZ, which the ledger's aware periods need)."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value).replace(tzinfo=UTC)
    return value.timestamp()
