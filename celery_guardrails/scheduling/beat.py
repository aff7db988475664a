"""Scheduled work with stated guardrails: every beat entry dispatches through the run ledger.

Run beat with a guarded scheduler::

    celery -A proj beat -S celery_guardrails.scheduling.beat:GuardedScheduler
    celery -A proj beat -S django_celery_guardrails.schedulers:GuardedDatabaseScheduler

Every entry of ``CELERY_BEAT_SCHEDULE`` and every django-celery-beat ``PeriodicTask`` is *watched*: the entry's
policy in ``CELERY_GUARDRAILS["schedules"]`` (see :class:`~.policy.SchedulePolicy`), else the
default policy (:data:`~.policy.DEFAULT_POLICY`: grace 60 s, or half the entry's period when
that is shorter). These are left to Celery as they are (:func:`watched_by_default` says why):

* an entry whose policy is ``None`` (``schedules = {"cleanup": None}``: opted out);
* with no policy written: an entry whose task is a plain Celery task registered in this process (only a
  ``GuardedTask`` records its runs in the ledger; Celery's own ``celery.backend_cleanup`` and the guardrails
  app's ``django_celery_guardrails.prune`` are plain tasks, never watched by default), a one-off
  django-celery-beat row, and a schedule the guardrails cannot read (solar, clocked, an interval shorter
  than a second or not whole seconds, a row that does not parse: a written policy makes those an error).

For watched entries the scheduler does not use Celery's own "is it due" arithmetic. On every tick (at most a
second apart) it reads each entry's timetable (:mod:`celery_guardrails.scheduling.schedules`: its time zone and DST
rules) from the entry's *horizon*, the newest period the ledger says was handled, to now:

* a period due within ``grace`` is dispatched: its ledger record is inserted first (unique per schedule and
  period, so a second beat process dispatching the same period gets ``False`` and publishes nothing), then
  the message is published with the period in its ``guardrails`` header and the period key as its
  idempotency key (a manual re-run of that period is a duplicate, skipped by the worker);
* periods older than ``grace`` (beat was down) are handled by ``catch_up``: ``skip`` records them missed,
  ``latest`` dispatches the newest one (when a period is due on time in the same tick, it is the newest: the
  late ones are recorded missed and the current one runs, never skipped as overlapping a stale run), ``all``
  dispatches each, oldest first (the newest ``catch_up_limit``; older ones are recorded missed). A catch-up
  message says so in its header (``catchup``): on the worker, a current run never yields to a catch-up run
  under ``overlap="skip"`` (it waits for it; see :mod:`celery_guardrails.guardrails.scheduled_runs`). At most
  :data:`LOOKBACK` seconds are looked back at.

The horizon is read from the ledger when beat starts, so a restart neither repeats nor forgets a period
(django-celery-beat #634 is the bug this avoids). A disabled django-celery-beat row is not dispatched: each of
its periods that comes due is recorded ``skipped_disabled`` (by beat, or by the watchdog when beat is down),
so that enabled again it goes on from its next period instead of owing (and alerting) its disabled time.
An entry may also give its schedule as a 5-field crontab string (``"30 2 * * *"``).
"""

from __future__ import annotations

import heapq
import logging
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from itertools import pairwise
from typing import Any
from zoneinfo import ZoneInfo

from celery.beat import PersistentScheduler
from celery.schedules import crontab
from kombu.exceptions import OperationalError

from celery_guardrails import signals
from celery_guardrails.exceptions import ConfigurationError, ContextError

# accelerated_clock stays importable from here: settings name it as celery_guardrails.scheduling.beat.accelerated_clock.
from celery_guardrails.foundation.clock import accelerated_clock, now
from celery_guardrails.foundation.context import validate_tenant
from celery_guardrails.options import app_value
from celery_guardrails.runtime import headers
from celery_guardrails.scheduling.ledger import DISPATCHED, MISSED, SKIPPED_DISABLED, Heads, period_key
from celery_guardrails.scheduling.policy import DEFAULT_POLICY, SchedulePolicy
from celery_guardrails.scheduling.schedules import Every, parse_crontab, periods_between, timetable
from celery_guardrails.stores import django_apps_installed, get_store

logger = logging.getLogger(__name__)

#: Seconds beat and the watchdog look back from now at most (7 days): older unhandled periods are not
#: recorded one by one.
LOOKBACK = 7 * 24 * 3600.0
#: Periods recorded or dispatched per entry in one pass at most.
MAX_PERIODS = 2000
#: Seconds a guarded scheduler sleeps at most between two looks at its entries.
TICK = 1.0
#: Task name prefixes of plain tasks that Celery and the guardrails app schedule themselves: never watched by
#: default, even where the task is not imported (a web process), so that no page shows them as watched.
PLAIN_TASK_PREFIXES = ("celery.", "django_celery_guardrails.")
#: Where the shortest gap of a crontab is measured (a Monday; the first runs after it).
_GAP_FROM = datetime(2001, 1, 1, tzinfo=UTC)


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
    #: Seconds a run may start late before its period counts as missed (:meth:`SchedulePolicy.grace_for`).
    grace: float = field(init=False)

    def __post_init__(self) -> None:
        self.timetable = timetable(self.schedule, zone=self.zone, fall_back=self.policy.fall_back)
        self.grace = self.policy.grace_for(None if self.policy.grace is not None else shortest_gap(self.timetable))

    @property
    def default(self) -> bool:
        """Whether it is watched with the default policy (the ``schedules`` setting does not name it)."""
        return self.policy.default

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


@lru_cache(maxsize=1024)
def shortest_gap(table: Any) -> float:
    """Seconds between two runs of a timetable: its interval, or a crontab's shortest gap among its first runs
    (every minute: 60; hourly: 3600; at 09:00 and 17:00: 8 hours). Cached: the guarded database scheduler makes
    every row's entry again on each tick, and thousands of rows share a few crontabs."""
    if isinstance(table, Every):
        return table.interval.total_seconds()
    runs = periods_between(table, _GAP_FROM, _GAP_FROM + timedelta(days=800), limit=6)
    gaps = [(later - earlier).total_seconds() for earlier, later in pairwise(runs)]
    return min(gaps, default=LOOKBACK)  # fewer than two runs in 800 days (29 February): the full grace


def watched_by_default(app: Any, task_name: str) -> bool:
    """Whether an entry with no policy written, running ``task_name``, is watched: not a plain Celery task.

    A plain task registered here is not (its worker would never record the run started, and every dispatch
    would be reported missed); nor are Celery's and the guardrails app's own (:data:`PLAIN_TASK_PREFIXES`), nor
    a one-off django-celery-beat row (:func:`read_entry` says so).
    A task not registered in this process (sent by name) is watched: beat imports the task modules a worker
    imports, so there it is known."""
    if task_name.startswith(PLAIN_TASK_PREFIXES):
        return False
    task = app.tasks.get(task_name)
    return task is None or hasattr(task, "guardrails")


def own_zone(schedule: Any) -> Any:
    """The zone a schedule states itself, or None: a django-celery-beat crontab row's (an instance attribute; on
    a plain Celery crontab, ``tz`` is a property that answers the app's zone, which says nothing about the
    entry)."""
    return getattr(schedule, "__dict__", {}).get("tz")


def states_no_timezone(schedule: Any, policy: SchedulePolicy) -> bool:
    """A crontab entry whose written policy states no timezone, nor its crontab: read in the app's zone. The one
    rule for beat's start-up warning (:func:`_zone`) and the audit's GA602."""
    return (
        not policy.default
        and policy.timezone is None
        and own_zone(schedule) is None
        and isinstance(schedule, crontab | str)
    )


def _zone(app: Any, name: str, schedule: Any, policy: SchedulePolicy, warned: set[str]) -> ZoneInfo:
    if policy.timezone is not None:
        return policy.timezone
    own = own_zone(schedule)
    if own is not None:
        return ZoneInfo(str(own))
    if states_no_timezone(schedule, policy) and name not in warned:
        # A policy written without a timezone is warned about; an entry with none is read as Celery reads it.
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
    """The watched entries among ``raw`` (name -> beat entry dict or Celery ScheduleEntry): each with its policy,
    or the default one (see the module docstring for the entries left to Celery).

    Raises :class:`ConfigurationError` naming the entry for a policy whose entry does not exist (among
    ``known`` names, default the keys of ``raw``), and, for an entry with a policy written, a crontab that does
    not parse or a schedule kind the guardrails cannot read (solar).
    """
    policies: dict[str, SchedulePolicy | None] = app_value(app, "schedules")
    names = set(raw if known is None else known)
    missing = sorted(name for name, policy in policies.items() if policy is not None and name not in names)
    if missing:
        raise ConfigurationError(
            "schedules",
            f"policy for {', '.join(map(repr, missing))}, but there is no such beat entry or PeriodicTask "
            f"(known: {', '.join(sorted(names)) or 'none'})",
        )
    entries = {}
    for name, item in raw.items():
        found = read_entry(app, name, item, policy=policies.get(name, DEFAULT_POLICY), warned=warned)
        if isinstance(found, Entry):
            entries[name] = found
    return entries


@dataclass(frozen=True, slots=True, kw_only=True)
class NotWatched:
    """Why a beat entry is left to Celery. ``expected``: by design (opted out, Celery's or the guardrails app's own
    plain task, a one-off row), nothing to fix; else the audit reports it (a plain task, a schedule it cannot
    read)."""

    reason: str
    expected: bool = False


def read_entry(
    app: Any, name: str, item: Any, *, policy: SchedulePolicy | None, warned: set[str] | None = None
) -> Entry | NotWatched:
    """The watched entry of beat entry ``item`` (a dict or a Celery ScheduleEntry) under ``policy`` (None: opted
    out; :data:`DEFAULT_POLICY`: none written), or why it is not watched. Raises :class:`ConfigurationError` for
    an entry with a policy written whose schedule cannot be read."""
    if policy is None:
        return NotWatched(reason="opted out (its policy is None)", expected=True)
    get = item.get if isinstance(item, Mapping) else lambda key, default=None: getattr(item, key, default)
    task = str(get("task"))
    if policy.default:
        if get("one_off"):
            return NotWatched(reason="a one-off task (django-celery-beat disables it after its run)", expected=True)
        if task.startswith(PLAIN_TASK_PREFIXES):
            return NotWatched(reason=f"{task} is Celery's or the guardrails app's own plain task", expected=True)
        if not watched_by_default(app, task):
            return NotWatched(reason=f"its task {task} is a plain Celery task (not a GuardedTask)")
    schedule = get("schedule")
    error = getattr(schedule, "error", None)  # a django-celery-beat row that cannot be read
    if isinstance(error, str):
        if policy.default:  # django-celery-beat logs it and skips it, as it always did
            return NotWatched(reason=error)
        raise ConfigurationError("schedules", f"beat entry {name!r}: {error}")
    try:
        if isinstance(schedule, str):
            schedule = parse_crontab(schedule)
        options, tenant = _tenant_of(dict(get("options") or {}), policy)
        entry = Entry(
            name=name,
            task=task,
            schedule=schedule,
            policy=policy,
            zone=_zone(app, name, schedule, policy, warned if warned is not None else set()),
            args=tuple(get("args") or ()),
            kwargs=dict(get("kwargs") or {}),
            options=options,
            tenant=tenant,
        )
        table = entry.timetable
        if isinstance(table, Every) and (table.interval.total_seconds() % 1 or table.interval < timedelta(seconds=1)):
            # Periods are named by whole seconds (the period key): shorter or fractional ones would collide.
            raise ValueError(f"an interval of a policy must be whole seconds, at least 1, got {table.interval}")
    except (ValueError, TypeError) as exc:
        if policy.default:  # a solar or clocked schedule, a sub-second interval: Celery's to run, unwatched
            logger.debug("Beat entry %r is not watched: %s", name, exc)
            return NotWatched(reason=str(exc))
        raise ConfigurationError("schedules", f"beat entry {name!r}: {exc}") from None
    return entry


def configured_entries(app: Any, *, warned: set[str] | None = None, every_row: bool = True) -> dict[str, Entry]:
    """The watched entries of the app: ``beat_schedule``, and django-celery-beat rows when installed (only the rows
    a policy names when not ``every_row``: a worker's start-up check, which reads no row unless a policy does)."""
    return all_configured_entries(app, warned=warned, every_row=every_row)[0]


def all_configured_entries(
    app: Any, *, warned: set[str] | None = None, every_row: bool = True
) -> tuple[dict[str, Entry], dict[str, Entry]]:
    """(the watched entries, the watched entries disabled now: django-celery-beat rows with ``enabled`` off),
    from one read of the rows (every row: an entry with no policy is watched too; see :func:`configured_entries`
    for ``every_row``)."""
    raw: dict[str, Any] = dict(app.conf.beat_schedule or {})
    known = set(raw)
    disabled: dict[str, Any] = {}
    if django_apps_installed("django_celery_beat"):
        from django_celery_guardrails.schedulers import periodic_task_rows

        named = None if every_row else set(app_value(app, "schedules")) - known  # no query when empty
        rows, disabled, names = periodic_task_rows(app, names=named)
        # A settings entry django-celery-beat copied into its table is read from the settings, as it always was.
        raw.update({name: row for name, row in rows.items() if name not in known})
        disabled = {name: row for name, row in disabled.items() if name not in known}
        known |= names
    return build_entries(app, raw, known=known, warned=warned), build_disabled_entries(app, disabled, warned=warned)


@dataclass(frozen=True, slots=True, kw_only=True)
class Watch:
    """One beat entry and what the guardrails make of it: its watched :class:`Entry`, or why it is not watched."""

    name: str
    #: "beat entry" (``beat_schedule``) or "periodic task" (a django-celery-beat row).
    kind: str
    disabled: bool
    found: Entry | NotWatched


def watch_list(app: Any, *, rows: bool = True, warned: set[str] | None = None) -> list[Watch]:
    """Every beat entry of the app, by name: ``beat_schedule``, then django-celery-beat's rows when installed and
    ``rows`` (a settings entry django-celery-beat copied into its table is listed once, as the settings entry).
    Raises :class:`ConfigurationError` as beat would (a policy for an entry that does not exist, or whose
    schedule cannot be read), and the database's error when the rows cannot be read."""
    policies = app_value(app, "schedules")
    raw: dict[str, Any] = dict(app.conf.beat_schedule or {})
    disabled: dict[str, Any] = {}
    known = set(raw)
    if rows and django_apps_installed("django_celery_beat"):
        from django_celery_guardrails.schedulers import periodic_task_rows

        enabled, disabled, names = periodic_task_rows(app, names=None)
        enabled = {name: row for name, row in enabled.items() if name not in raw}
        disabled = {name: row for name, row in disabled.items() if name not in raw}
        known |= names
    else:
        enabled = {}
        known |= set(policies)  # rows not read: a policy may name one
    build_entries(app, {}, known=known)  # a policy for an entry that does not exist: ConfigurationError
    found = []
    sources = (("beat entry", raw, False), ("periodic task", enabled, False), ("periodic task", disabled, True))
    for kind, items, off in sources:
        for name, item in items.items():
            read = read_entry(app, name, item, policy=policies.get(name, DEFAULT_POLICY), warned=warned)
            found.append(Watch(name=name, kind=kind, disabled=off, found=read))
    return sorted(found, key=lambda watch: watch.name)


def build_disabled_entries(app: Any, raw: Mapping[str, Any], *, warned: set[str] | None = None) -> dict[str, Entry]:
    """The watched entries among disabled rows ``raw``; none when one cannot be read (a disabled row is not due:
    it must not stop beat or the watchdog from handling the others)."""
    try:
        return build_entries(app, raw, known=set(app_value(app, "schedules")) | set(raw), warned=warned)
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
        described = [f"{name} ({'default' if e.default else 'its'} policy)" for name, e in sorted(entries.items())]
        logger.info("celery-guardrails: watched beat entries: %s", ", ".join(described) or "none")
        unwatched = sorted(set(self.known_entry_names()) - set(entries))
        if unwatched:
            logger.info("celery-guardrails: beat entries left to Celery (not watched): %s", ", ".join(unwatched))

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
        # Watched entries are dispatched by tick_guarded, never by Celery's heap.
        watched = {*getattr(self, "_guardrails_entries", {}), *self.current_disabled_entries()}
        self._heap = [event for event in self._heap if event[2].name not in watched]
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
                reason = f"beat did not dispatch it within {entry.grace:g}s (catch_up={entry.policy.catch_up})"
                if store.run_record(entry.name, period, status=MISSED, now=current, reason=reason):
                    report(self.app, entry, period, kind="missed", reason=reason)
            for period in to_dispatch:
                try:
                    task_id = dispatch(
                        self.app, entry, period, current=current, catch_up=current - period > entry.grace
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
