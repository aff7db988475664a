"""Scheduled work with stated guardrails: beat entries with a policy dispatch through the run ledger.

Give an entry of ``CELERY_BEAT_SCHEDULE`` (or a django-celery-beat ``PeriodicTask``, by name) a policy in
``CELERY_GUARDRAILS["schedules"]`` (see :class:`~celery_guardrails.options.SchedulePolicy`) and run beat
with a guarded scheduler::

    celery -A proj beat -S celery_guardrails.beat:GuardedScheduler
    celery -A proj beat -S django_celery_guardrails.schedulers:GuardedDatabaseScheduler

For those entries the scheduler does not use Celery's own "is it due" arithmetic. On every tick (at most a
second apart) it reads each entry's timetable (:mod:`celery_guardrails.schedules`: its time zone and DST
rules) from the entry's *horizon*, the newest period the ledger says was handled, to now:

* a period due within ``grace`` is dispatched: its ledger record is inserted first (unique per schedule and
  period, so a second beat process dispatching the same period gets ``False`` and publishes nothing), then
  the message is published with the period in its ``guardrails`` header and the period key as its
  idempotency key (a manual re-run of that period is a duplicate, skipped by the worker);
* periods older than ``grace`` (beat was down) are handled by ``catch_up``: ``skip`` records them missed,
  ``latest`` dispatches the newest one, ``all`` dispatches each, oldest first (the newest ``catch_up_limit``;
  older ones are recorded missed). At most :data:`LOOKBACK` seconds are looked back at.

The horizon is read from the ledger when beat starts, so a restart neither repeats nor forgets a period
(django-celery-beat #634 is the bug this avoids). A disabled django-celery-beat row is not dispatched: each of
its periods that comes due is recorded ``skipped_disabled`` (by beat, or by the watchdog when beat is down),
so that enabled again it goes on from its next period instead of owing (and alerting) its disabled time.
Entries without a policy are left to Celery as they are.
An entry may also give its schedule as a 5-field crontab string (``"30 2 * * *"``).
"""

from __future__ import annotations

import heapq
import logging
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from celery.beat import PersistentScheduler
from celery.schedules import crontab
from kombu.exceptions import OperationalError

from celery_guardrails import headers, signals

# accelerated_clock stays importable from here: settings name it as celery_guardrails.beat.accelerated_clock.
from celery_guardrails.clock import accelerated_clock, now
from celery_guardrails.context import validate_tenant
from celery_guardrails.exceptions import ConfigurationError, ContextError
from celery_guardrails.ledger import DISPATCHED, MISSED, SKIPPED_DISABLED, Heads, period_key
from celery_guardrails.options import SchedulePolicy, app_value
from celery_guardrails.schedules import Every, parse_crontab, periods_between, timetable
from celery_guardrails.stores import django_apps_installed, get_store

logger = logging.getLogger(__name__)

#: Seconds beat and the watchdog look back from now at most (7 days): older unhandled periods are not
#: recorded one by one.
LOOKBACK = 7 * 24 * 3600.0
#: Periods recorded or dispatched per entry in one pass at most.
MAX_PERIODS = 2000
#: Seconds a guarded scheduler sleeps at most between two looks at its entries.
TICK = 1.0


@dataclass(slots=True, kw_only=True)
class Entry:
    """One beat entry with a policy: what to send and when."""

    name: str
    task: str
    schedule: Any
    policy: SchedulePolicy
    zone: ZoneInfo
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    #: The tenant its runs carry: the entry's own (``options["tenant"]``, or ``tenant`` in a django-celery-beat
    #: row's headers), else the policy's; None: none.
    tenant: str | None = None
    #: Read from ``schedule`` once, when the entry is made (raises ValueError for a schedule it cannot read).
    timetable: Any = field(init=False)

    def __post_init__(self) -> None:
        self.timetable = timetable(self.schedule, zone=self.zone, fall_back=self.policy.fall_back)

    def periods(self, after: float, until: float, *, limit: int = MAX_PERIODS) -> list[float]:
        """Due instants in (after, until], epoch seconds, oldest first (the newest ``limit``)."""
        after = max(after, until - LOOKBACK)
        found: list[float] = []
        start = datetime.fromtimestamp(after, UTC)
        end = datetime.fromtimestamp(until, UTC)
        while True:
            batch = periods_between(self.timetable, start, end, limit=limit)
            found.extend(moment.timestamp() for moment in batch)
            found = found[-limit:]
            if len(batch) < limit:
                return found
            start = batch[-1]

    def next_due(self, after: float) -> float:
        return float(self.timetable.next_after(datetime.fromtimestamp(after, UTC)).timestamp())


def _zone(app: Any, name: str, schedule: Any, policy: SchedulePolicy, warned: set[str]) -> ZoneInfo:
    if policy.timezone is not None:
        return policy.timezone
    # A django-celery-beat crontab row states its zone (an instance attribute; on a plain Celery crontab,
    # ``tz`` is a property that answers the app's zone, which says nothing about the entry).
    own = getattr(schedule, "__dict__", {}).get("tz")
    if own is not None:
        return ZoneInfo(str(own))
    if isinstance(schedule, crontab | str) and name not in warned:
        warned.add(name)
        logger.warning(
            "celery-guardrails: beat entry %r is a crontab without a timezone in its policy; it is read in %s",
            name,
            app.conf.timezone or "UTC",
        )
    return ZoneInfo(str(app.conf.timezone or "UTC"))


def _tenant_of(options: dict[str, Any], policy: SchedulePolicy) -> tuple[dict[str, Any], str | None]:
    """(options without the tenant, the tenant): a beat_schedule entry names it as ``options={"tenant": ...}``,
    a django-celery-beat row in its headers (``{"tenant": "acme"}``: the row has no other place for it; its
    kwargs are the task's arguments), else the policy's ``tenant``. A bad one is a ValueError naming it."""
    tenant = options.pop("tenant", None)
    message_headers = options.get("headers")
    if isinstance(message_headers, Mapping) and "tenant" in message_headers:
        message_headers = dict(message_headers)
        tenant = tenant or message_headers.pop("tenant")
        options["headers"] = message_headers
    if tenant is None:
        return options, policy.tenant
    try:
        return options, validate_tenant(tenant)
    except ContextError as exc:
        raise ValueError(f"its tenant: {exc}") from None


def build_entries(
    app: Any, raw: Mapping[str, Any], *, known: Iterable[str] | None = None, warned: set[str] | None = None
) -> dict[str, Entry]:
    """The guarded entries among ``raw`` (name -> beat entry dict or Celery ScheduleEntry).

    Raises :class:`ConfigurationError` naming the entry for a policy whose entry does not exist (among
    ``known`` names, default the keys of ``raw``), a crontab that does not parse, or a schedule kind the
    guardrails cannot read (solar).
    """
    policies: dict[str, SchedulePolicy] = app_value(app, "schedules")
    names = set(raw if known is None else known)
    missing = sorted(set(policies) - names)
    if missing:
        raise ConfigurationError(
            "schedules",
            f"policy for {', '.join(map(repr, missing))}, but there is no such beat entry or PeriodicTask "
            f"(known: {', '.join(sorted(names)) or 'none'})",
        )
    entries = {}
    for name, policy in policies.items():
        if name not in raw:
            continue  # a disabled PeriodicTask: known, not scheduled now
        item = raw[name]
        get = (
            item.get if isinstance(item, Mapping) else lambda key, default=None, item=item: getattr(item, key, default)
        )
        schedule = get("schedule")
        error = getattr(schedule, "error", None)  # a django-celery-beat row that cannot be read
        if isinstance(error, str):
            raise ConfigurationError("schedules", f"beat entry {name!r}: {error}")
        try:
            if isinstance(schedule, str):
                schedule = parse_crontab(schedule)
            options, tenant = _tenant_of(dict(get("options") or {}), policy)
            entry = Entry(
                name=name,
                task=str(get("task")),
                schedule=schedule,
                policy=policy,
                zone=_zone(app, name, schedule, policy, warned if warned is not None else set()),
                args=tuple(get("args") or ()),
                kwargs=dict(get("kwargs") or {}),
                options=options,
                tenant=tenant,
            )
            table = entry.timetable
            if isinstance(table, Every) and (
                table.interval.total_seconds() % 1 or table.interval < timedelta(seconds=1)
            ):
                # Periods are named by whole seconds (the period key): shorter or fractional ones would collide.
                raise ValueError(f"an interval of a policy must be whole seconds, at least 1, got {table.interval}")
        except (ValueError, TypeError) as exc:
            raise ConfigurationError("schedules", f"beat entry {name!r}: {exc}") from None
        entries[name] = entry
    return entries


def configured_entries(app: Any, *, warned: set[str] | None = None) -> dict[str, Entry]:
    """The guarded entries of the app: ``beat_schedule``, and django-celery-beat rows when installed."""
    return all_configured_entries(app, warned=warned)[0]


def all_configured_entries(app: Any, *, warned: set[str] | None = None) -> tuple[dict[str, Entry], dict[str, Entry]]:
    """(the guarded entries, the guarded entries disabled now: django-celery-beat rows with ``enabled`` off),
    from one read of the rows."""
    policies = app_value(app, "schedules")
    if not policies:
        return {}, {}
    raw: dict[str, Any] = dict(app.conf.beat_schedule or {})
    known = set(raw)
    disabled: dict[str, Any] = {}
    if django_apps_installed("django_celery_beat"):
        from django_celery_guardrails.schedulers import periodic_task_rows

        rows, disabled, names = periodic_task_rows(app, names=set(policies) - known)
        raw.update(rows)
        known |= names
    return build_entries(app, raw, known=known, warned=warned), build_disabled_entries(app, disabled, warned=warned)


def build_disabled_entries(app: Any, raw: Mapping[str, Any], *, warned: set[str] | None = None) -> dict[str, Entry]:
    """The guarded entries among disabled rows ``raw``; none when one cannot be read (a disabled row is not due:
    it must not stop beat or the watchdog from handling the others)."""
    try:
        return build_entries(app, raw, known=app_value(app, "schedules"), warned=warned)
    except ConfigurationError:
        logger.exception("celery-guardrails: a disabled guarded row cannot be read; its periods are not skipped")
        return {}


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
        logger.info("Guarded beat entry %r is disabled: period %s skipped", entry.name, moment(periods[-1]))
    return periods[-1]


def check_tasks(app: Any, entries: Mapping[str, Entry]) -> None:
    """A guarded entry's task must be a GuardedTask where it is registered (only it keeps the ledger)."""
    for entry in entries.values():
        task = app.tasks.get(entry.task)
        if task is not None and not hasattr(task, "guardrails"):
            raise ConfigurationError(
                "schedules", f"beat entry {entry.name!r}: task {entry.task!r} is not a GuardedTask"
            )


def owner_of_entry(app: Any, entry: Entry) -> str | None:
    """Who hears of the entry's missed and overdue runs: its policy's owner, else its task's."""
    if entry.policy.owner:
        return entry.policy.owner
    task = app.tasks.get(entry.task)
    if task is not None:
        from celery_guardrails.outcomes import owner_of

        return owner_of(task)
    return None


def moment(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def report(app: Any, entry: Entry, period: float, *, kind: str, reason: str, **extra: Any) -> None:
    """A missed or overdue period was recorded (once, by whoever recorded it): signal, and alert its owner
    unless an alert about this schedule went out within ``run_alert_throttle`` (then it is counted for the
    summary: see :func:`celery_guardrails.alerts.run_alert_due`)."""
    from celery_guardrails.alerts import run_alert_due, send

    owner = owner_of_entry(app, entry)
    details = {"schedule": entry.name, "task": entry.task, "period": moment(period), "reason": reason, **extra}
    logger.warning("Scheduled run %s of %r %s: %s", moment(period), entry.name, kind, reason)
    signal = signals.run_missed if kind == "missed" else signals.run_overdue
    try:
        signal.send(sender=app, owner=owner, **details)
        if run_alert_due(app, owner=owner, schedule=entry.name, kind=kind):
            subject = f"Run {kind}: {entry.name} at {moment(period):%Y-%m-%d %H:%M:%S}Z"
            send(app, subject=subject, run=details, owner=owner)
    except Exception:  # an alert must never stop beat or the watchdog
        logger.exception("Alert for the %s run %s of %r could not be sent", kind, moment(period), entry.name)


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
    grace = entry.policy.grace
    late = [p for p in periods if current - p > grace]
    on_time = [p for p in periods if current - p <= grace]
    if entry.policy.catch_up == "skip" or not late:
        return on_time, late
    keep = 1 if entry.policy.catch_up == "latest" else entry.policy.catch_up_limit
    return late[-keep:] + on_time, late[:-keep]


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
    if entry.tenant is not None:
        guardrails[headers.TENANT] = entry.tenant
    message_headers[headers.HEADER] = guardrails
    logger.info(
        "Dispatching %r period %s as %s%s", entry.name, moment(period), task_id, " (catch-up)" if catch_up else ""
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
        logger.exception("Publishing %r period %s failed; it is due again", entry.name, moment(period))
        try:
            get_store(app).run_undispatch(entry.name, period, task_id=task_id)
        except Exception:  # the watchdog reports it missed after grace
            logger.exception("The dispatch of %r period %s could not be forgotten", entry.name, moment(period))
        raise PublishFailed(str(exc)) from exc
    except Exception as exc:
        # The entry itself is wrong (its arguments do not fit the task, say): trying again each tick would
        # fail the same way. The period is recorded missed, saying why, and its owner is alerted.
        reason = f"could not be published: {type(exc).__name__}: {exc}"
        logger.exception("Publishing %r period %s failed", entry.name, moment(period))
        if get_store(app).run_transition(
            entry.name, period, from_=(DISPATCHED,), to=MISSED, now=current, reason=reason
        ):
            report(app, entry, period, kind="missed", reason=reason, task_id=task_id)
    return task_id


class PublishFailed(Exception):
    """A period's message could not be published (the broker is out of reach); the period is due again."""


class GuardedSchedulerMixin:
    """Beat scheduler behaviour for entries with a policy (mixed into a Celery scheduler class)."""

    app: Any
    schedule: Any
    _heap: Any
    _guardrails_horizons: dict[str, float]
    _guardrails_warned: set[str]
    _guardrails_entries: dict[str, Entry]

    def setup_schedule(self) -> None:
        self._guardrails_horizons = {}
        self._guardrails_skipped: dict[str, float] = {}  # disabled entry -> when its next period comes due
        self._guardrails_warned = set()
        # Crontab strings become Celery crontabs before Celery reads the entries (it cannot read strings).
        for name, item in (self.app.conf.beat_schedule or {}).items():
            if isinstance(item, dict) and isinstance(item.get("schedule"), str):
                try:
                    item["schedule"] = parse_crontab(item["schedule"])
                except ValueError as exc:
                    raise ConfigurationError("beat_schedule", f"entry {name!r}: {exc}") from None
        super().setup_schedule()  # type: ignore[misc]
        entries = self._guardrails_entries = self.guarded_entries()  # a bad policy stops beat, naming the entry
        check_tasks(self.app, entries)
        logger.info("celery-guardrails: guarded beat entries: %s", ", ".join(sorted(entries)) or "none")

    def known_entry_names(self) -> set[str]:
        return set(self.schedule)

    def guarded_entries(self) -> dict[str, Entry]:
        return build_entries(self.app, self.schedule, known=self.known_entry_names(), warned=self._guardrails_warned)

    def current_entries(self) -> dict[str, Entry]:
        """The guarded entries for this tick: the ones read at start-up (a scheduler whose entries can change
        while it runs re-reads them here)."""
        return self._guardrails_entries

    def current_disabled_entries(self) -> dict[str, Entry]:
        """The guarded entries that are disabled now (a scheduler whose entries can be disabled says which)."""
        return {}

    def dispatched(self, entry: Entry, period: float, task_id: str) -> None:
        """Called after this scheduler dispatched a period (a hook for the scheduler's own bookkeeping)."""

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        super().populate_heap(*args, **kwargs)  # type: ignore[misc]
        # Guarded entries are dispatched by tick_guarded, never by Celery's heap.
        policies = app_value(self.app, "schedules")
        self._heap = [event for event in self._heap if event[2].name not in policies]
        heapq.heapify(self._heap)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        wait = self.tick_guarded()
        return float(min(wait, super().tick(*args, **kwargs)))  # type: ignore[misc]

    def tick_guarded(self) -> float:
        """Dispatch or record every due period of the guarded entries; seconds until the next look."""
        current = now(self.app)
        wait = TICK
        entries = self.current_entries()
        # An entry gone from the schedule (disabled, deleted) is read from the ledger again if it comes back:
        # its horizon moved on meanwhile (skipped_disabled records), and a cached one would owe every period.
        for name in set(self._guardrails_horizons) - set(entries):
            del self._guardrails_horizons[name]
        for entry in entries.values():
            try:
                wait = min(wait, self._tick_entry(entry, current))
            except Exception:  # one broken entry (or a store outage) must not stop the others
                logger.exception("Guarded beat entry %r: tick failed", entry.name)
        skipped = self._guardrails_skipped
        for entry in self.current_disabled_entries().values():
            if skipped.get(entry.name, 0.0) > current:
                continue  # its newest due period is recorded; nothing new is due before this
            try:
                horizon = skip_disabled(self.app, entry, current)
                skipped[entry.name] = entry.next_due(max(horizon or current, current))
            except Exception:
                logger.exception("Guarded beat entry %r (disabled): tick failed", entry.name)
        return max(wait, 0.05)

    def _tick_entry(self, entry: Entry, current: float) -> float:
        seen = self._guardrails_horizons.get(entry.name)
        if seen is None:
            found = horizon(self.app, entry.name)
            seen = current if found is None else found  # never run: start now, nothing to catch up
            logger.info(
                "Guarded beat entry %r: periods after %s are due (%s)",
                entry.name,
                moment(seen),
                "no ledger record yet: from now on" if found is None else "the ledger's newest handled period",
            )
        periods = entry.periods(seen, current)
        if periods:
            to_dispatch, to_record = plan(entry, periods, current)
            store = get_store(self.app)
            for period in to_record:
                reason = f"beat did not dispatch it within {entry.policy.grace:g}s (catch_up={entry.policy.catch_up})"
                if store.run_record(entry.name, period, status=MISSED, now=current, reason=reason):
                    report(self.app, entry, period, kind="missed", reason=reason)
            for period in to_dispatch:
                try:
                    task_id = dispatch(
                        self.app, entry, period, current=current, catch_up=current - period > entry.policy.grace
                    )
                except PublishFailed:  # not published: the next tick looks at this period again
                    self._guardrails_horizons[entry.name] = period - 1
                    raise
                if task_id is not None:
                    try:
                        self.dispatched(entry, period, task_id)
                    except Exception:  # the scheduler's own bookkeeping; the period is dispatched
                        logger.exception("Guarded beat entry %r: bookkeeping of %s failed", entry.name, task_id)
            seen = periods[-1]
        self._guardrails_horizons[entry.name] = seen
        return entry.next_due(max(seen, current)) - current


class GuardedScheduler(GuardedSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default (shelve-file) scheduler with the schedule guardrails."""


__all__ = [
    "GuardedScheduler",
    "GuardedSchedulerMixin",
    "accelerated_clock",
    "configured_entries",
    "dispatch",
    "now",
    "plan",
]
