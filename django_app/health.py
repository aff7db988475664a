"""Schedule health: one line per guarded schedule, read from the run ledger (the ``guardrails.ScheduledRun`` table).

:func:`schedule_health` lists every watched beat entry (with its policy in the ``schedules`` setting, or the
default one: its policy reads "default", see :mod:`celery_guardrails.scheduling.beat`), and every schedule the ledger
has
records of that is no longer watched. Each line says when the schedule last succeeded, what its
newest record is, when it is due next, how many of its runs were missed, overdue or failed in a window
(default the last 7 days; a run that was missed or overdue counts as such after it ran or finished: its
``missed_at`` / ``overdue_at`` stay), and one ``state`` word, the first of these that holds:

    no policy   the ledger has records of it, but it is no longer watched (opted out, or gone)
    disabled    its django-celery-beat row is disabled (its due periods are recorded skipped, not missed)
    never run   it has a policy and no record yet
    overdue     a run past ``max_runtime`` is still open (an ``overdue`` record)
    missed      its newest decided run (ok, failed or missed) was missed, or a period due more than ``grace``
                after its newest record has no record at all (beat and the watchdog are both down)
    failing     its newest decided run failed
    running     a run is dispatched or running
    ok          otherwise: its newest decided run succeeded (or it has only skipped runs)

Reading it costs one query whatever the number of schedules or records (plus one for django-celery-beat's
rows when a policy names a PeriodicTask): counts and newest periods are conditional aggregates grouped by
schedule, the newest record's status a subquery evaluated once per schedule. The ledger keeps 90 days
(:data:`celery_guardrails.scheduling.ledger.RETENTION`, ``guardrails_prune``), which bounds the scan.

The admin page (``ScheduledRunAdmin``, ``health/``) shows this list; :func:`celery_app` is the app it reads
policies from.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Count, Max, OuterRef, Q, Subquery

from celery_guardrails.foundation.clock import now as current_time
from celery_guardrails.scheduling.beat import Entry, all_configured_entries, owner_of_entry
from celery_guardrails.scheduling.ledger import DISPATCHED, FAILED, MISSED, OK, OVERDUE, RUNNING

from .models import ScheduledRun

#: Default window of the missed / overdue / failed counts.
DEFAULT_WINDOW = timedelta(days=7)

NO_POLICY = "no policy"
DISABLED = "disabled"
NEVER_RUN = "never run"
STATE_OVERDUE = "overdue"
STATE_MISSED = "missed"
FAILING = "failing"
STATE_RUNNING = "running"
STATE_OK = "ok"
#: Every state word, worst first (the order the admin page's legend lists them).
STATES = (STATE_OVERDUE, STATE_MISSED, FAILING, STATE_RUNNING, NEVER_RUN, STATE_OK, DISABLED, NO_POLICY)


#: Entries already warned about (a crontab without a zone): once per process, not on every page view.
_WARNED: set[str] = set()


def celery_app() -> Any:
    """The Celery app whose policies the admin page shows: the current app (a project's ``celery.py`` sets it)."""
    from celery import current_app

    return current_app._get_current_object()


@dataclass(frozen=True, slots=True, kw_only=True)
class LastRecord:
    """A schedule's newest ledger record."""

    period: datetime
    status: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleHealth:
    """The health of one schedule (see the module docstring). Times are aware datetimes in UTC."""

    schedule: str
    #: The beat entry's task and zone; None for a schedule without a policy (the ledger does not keep them).
    task: str | None
    timezone: str | None
    owner: str | None
    #: Whether it is watched with the default policy (the ``schedules`` setting does not name it).
    default_policy: bool
    #: The policy's overlap, catch_up, grace (seconds) and max_runtime (seconds, None: no limit).
    overlap: str | None
    catch_up: str | None
    grace: float | None
    max_runtime: float | None
    #: Period of the newest ``ok`` record.
    last_success: datetime | None
    last_record: LastRecord | None
    #: The next period after both the newest record and now; None without a policy.
    next_due: datetime | None
    #: Records in the window (periods since now - window): missed, still overdue, failed.
    missed_count: int
    overdue_count: int
    failed_count: int
    state: str
    #: Why the state is what it is, in a sentence.
    detail: str

    @property
    def has_policy(self) -> bool:
        return self.state != NO_POLICY

    @property
    def policy_summary(self) -> str:
        if not self.has_policy:
            return ""
        runtime = "none" if self.max_runtime is None else f"{self.max_runtime:g}s"
        summary = f"overlap {self.overlap}, catch-up {self.catch_up}, grace {self.grace or 0:g}s, max runtime {runtime}"
        return f"default: {summary}" if self.default_policy else summary


class _PerSchedule(Subquery):
    """A subquery correlated on the grouped column only: its value is the same for every row of a group, so it
    is left out of GROUP BY (Django would group by it, evaluating it once per row instead of once per group)."""

    def get_group_by_cols(self) -> list[Any]:
        return []


def _ledger(since: datetime) -> dict[str, dict[str, Any]]:
    """Per schedule name: counts in the window, newest periods by status, the newest record's status."""
    newest = ScheduledRun.objects.filter(schedule=OuterRef("schedule")).order_by("-period").values("status")[:1]
    in_window = Q(period__gte=since)
    rows = (
        ScheduledRun.objects.order_by()
        .values("schedule")
        .annotate(
            newest_period=Max("period"),
            newest_status=_PerSchedule(newest),
            last_ok=Max("period", filter=Q(status=OK)),
            last_failed=Max("period", filter=Q(status=FAILED)),
            last_missed=Max("period", filter=Q(status=MISSED)),
            open_overdue=Count("pk", filter=Q(status=OVERDUE)),
            in_flight=Count("pk", filter=Q(status__in=(DISPATCHED, RUNNING))),
            missed_count=Count("pk", filter=in_window & (Q(status=MISSED) | Q(missed_at__isnull=False))),
            overdue_count=Count("pk", filter=in_window & (Q(status=OVERDUE) | Q(overdue_at__isnull=False))),
            failed_count=Count("pk", filter=in_window & Q(status=FAILED)),
        )
    )
    return {row["schedule"]: row for row in rows}


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _utc(value: datetime) -> str:
    return f"{value:%Y-%m-%d %H:%M:%S} UTC"


def _state(
    entry: Entry | None, row: dict[str, Any] | None, current: float, *, disabled: bool = False
) -> tuple[str, str]:
    """The state word and its explanation."""
    if entry is None:
        return NO_POLICY, "the ledger has records of it, but it is no longer watched (opted out, or no such entry)"
    if disabled:
        return DISABLED, "its periodic task is disabled: periods that come due are recorded skipped, not missed"
    if row is None:
        return NEVER_RUN, "no record yet (beat has not dispatched it)"
    if row["open_overdue"]:
        return STATE_OVERDUE, f"{row['open_overdue']} run(s) past max_runtime still open"
    unrecorded = entry.next_due(row["newest_period"].timestamp())
    if current - unrecorded > entry.grace:
        return STATE_MISSED, f"no record of the run due {_utc(_at(unrecorded))} (are beat and the watchdog running?)"
    decided = [(row[key], word) for key, word in (("last_ok", OK), ("last_failed", FAILED), ("last_missed", MISSED))]
    newest_decided = max((item for item in decided if item[0] is not None), default=None, key=lambda item: item[0])
    if newest_decided is not None and newest_decided[1] == MISSED:
        return STATE_MISSED, f"the run due {_utc(newest_decided[0])} was missed"
    if newest_decided is not None and newest_decided[1] == FAILED:
        return FAILING, f"the run due {_utc(newest_decided[0])} failed"
    if row["in_flight"]:
        return STATE_RUNNING, f"{row['in_flight']} run(s) dispatched or running"
    if newest_decided is None:
        return STATE_OK, "no run decided yet (only skipped ones)"
    return STATE_OK, f"the run due {_utc(newest_decided[0])} succeeded"


def _health(
    name: str, entry: Entry | None, row: dict[str, Any] | None, app: Any, current: float, *, disabled: bool = False
) -> ScheduleHealth:
    state, detail = _state(entry, row, current, disabled=disabled)
    newest = None if row is None else row["newest_period"].timestamp()
    policy = None if entry is None else entry.policy
    return ScheduleHealth(
        schedule=name,
        task=None if entry is None else entry.task,
        timezone=None if entry is None else str(entry.zone),
        owner=None if entry is None else owner_of_entry(app, entry),
        default_policy=entry is not None and entry.default,
        overlap=None if policy is None else policy.overlap,
        catch_up=None if policy is None else policy.catch_up,
        grace=None if entry is None else entry.grace,
        max_runtime=None if policy is None else policy.max_runtime,
        last_success=None if row is None else row["last_ok"],
        last_record=None if row is None else LastRecord(period=row["newest_period"], status=row["newest_status"]),
        next_due=None if entry is None or disabled else _at(entry.next_due(max(newest or current, current))),
        missed_count=0 if row is None else row["missed_count"],
        overdue_count=0 if row is None else row["overdue_count"],
        failed_count=0 if row is None else row["failed_count"],
        state=state,
        detail=detail,
    )


def schedule_health(app: Any, *, now: float | None = None, window: timedelta = DEFAULT_WINDOW) -> list[ScheduleHealth]:
    """The health of every guarded schedule of ``app`` (by name), then of every schedule in the ledger without a
    policy (by name). ``now``: epoch seconds, default the ``clock`` option's time.

    Raises :class:`~celery_guardrails.exceptions.ConfigurationError` when the ``schedules`` setting is wrong
    (a policy for an entry that does not exist), as beat would.
    """
    current = current_time(app) if now is None else now
    entries, disabled = all_configured_entries(app, warned=_WARNED)
    ledger = _ledger(_at(current - window.total_seconds()))
    guarded = {**disabled, **entries}
    configured = [
        _health(name, guarded[name], ledger.get(name), app, current, disabled=name in disabled)
        for name in sorted(guarded)
    ]
    orphans = [
        _health(name, None, ledger[name], app, current) for name in sorted(set(ledger) - set(entries) - set(disabled))
    ]
    return configured + orphans
