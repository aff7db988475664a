"""Reading beat entries: which ones the schedule guardrails watch, and under what policy.

Every entry of ``beat_schedule`` and every django-celery-beat ``PeriodicTask`` row becomes an :class:`Entry` (its
task, timetable, time zone, grace and tenant, under its policy in the ``schedules`` setting or the default one)
or a :class:`NotWatched` saying why it is left to Celery (:func:`watched_by_default`). A policy that names no
entry, or an entry with a policy written whose schedule cannot be read, is a :class:`ConfigurationError` naming
it, raised when beat or a worker starts. What happens to an entry's due periods is :mod:`.runs`'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from itertools import pairwise
from typing import Any
from zoneinfo import ZoneInfo

from celery.schedules import crontab

from celery_guardrails.exceptions import ConfigurationError, ContextError
from celery_guardrails.foundation.context import validate_tenant
from celery_guardrails.options import app_value
from celery_guardrails.scheduling.policy import DEFAULT_POLICY, SchedulePolicy
from celery_guardrails.scheduling.schedules import Every, parse_crontab, periods_between, timetable
from celery_guardrails.stores import django_apps_installed

logger = logging.getLogger(__name__)

#: Seconds beat and the watchdog look back from now at most (7 days): older unhandled periods are not
#: recorded one by one.
LOOKBACK = 7 * 24 * 3600.0
#: Periods recorded or dispatched per entry in one pass at most.
MAX_PERIODS = 2000
#: Task name prefixes of plain tasks that Celery and the guardrails app schedule themselves: never watched by
#: default, even where the task is not imported (a web process), so that no page shows them as watched.
PLAIN_TASK_PREFIXES = ("celery.", "django_celery_guardrails.")
#: Where the shortest gap of a crontab is measured (a Monday; the first runs after it).
_GAP_FROM = datetime(2001, 1, 1, tzinfo=UTC)

#: django-celery-beat's rows as beat entries, ``reader(app, names=...)``: registered by the Django app when it is
#: ready with django-celery-beat installed (:func:`register_rows`; the core does not import the Django app).
_row_reader: Callable[..., tuple[dict[str, Any], dict[str, Any], set[str]]] | None = None


def register_rows(reader: Callable[..., tuple[dict[str, Any], dict[str, Any], set[str]]]) -> None:
    """Make ``reader`` the source of django-celery-beat's rows (``django_celery_guardrails``' AppConfig.ready)."""
    global _row_reader
    _row_reader = reader


def registered_rows() -> Callable[..., tuple[dict[str, Any], dict[str, Any], set[str]]] | None:
    """The registered reader of django-celery-beat's rows, when django-celery-beat is an installed app."""
    return _row_reader if django_apps_installed("django_celery_beat") else None


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
    periodic_task_rows = registered_rows()
    if periodic_task_rows is not None:
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
    periodic_task_rows = registered_rows() if rows else None
    if periodic_task_rows is not None:
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


def check_tasks(app: Any, entries: Mapping[str, Entry]) -> None:
    """A guarded entry's task must be a GuardedTask where it is registered (only it keeps the ledger)."""
    for entry in entries.values():
        task = app.tasks.get(entry.task)
        if task is not None and not hasattr(task, "guardrails"):
            raise ConfigurationError(
                "schedules", f"beat entry {entry.name!r}: task {entry.task!r} is not a GuardedTask"
            )
