"""When scheduled work is due: wall-clock schedules with stated DST behaviour.

A timetable answers ``next_after(instant)``: the first run strictly after ``instant``, in UTC. Instants in and
out are timezone-aware; nothing here reads the system clock, so a simulated clock can drive a whole year (see
the tests). :func:`timetable` makes one from a Celery schedule; :func:`periods_between` lists runs in a window.

"Every day at 02:30" and "every hour" mean different things across a DST change, so there are two readings:

* **Wall clock**: :class:`DailyAt`, and a :class:`Cron` whose hour field is not all 24 hours (a *fixed-hour*
  crontab such as ``crontab(hour=2, minute=30)``). It names local times in its ``zone``:

  - a local time that does not exist (spring forward: 02:30 in Berlin on the last Sunday of March) runs
    once, at the first valid instant after it (03:00 local, the end of the gap); several such times on one
    day run once there (02:00 and 02:30 both mean 03:00, which runs once even if 03:00 is listed too);
  - a time that happens twice (fall back: 02:30 in Berlin on the last Sunday of October) runs once, at its
    first occurrence; ``fall_back="both"`` runs at both.

* **Elapsed time**: :class:`Every`, and a :class:`Cron` whose hour field is all 24 hours (a *wildcard-hour*
  crontab: hourly ``crontab(minute=0)``, every minute).

  - ``Every(interval, anchor)`` runs at ``anchor + n * interval``; it neither skips nor doubles a run (in a
    zone with a 30-minute shift, such as Australia/Lord_Howe, the local minute changes after a DST change);
  - a wildcard-hour ``Cron`` runs at every real instant whose local time matches: a local time that does
    not exist is not run (the clock jumped over it), one that happens twice runs at both occurrences
    (``fall_back`` is not read). So an hourly crontab neither skips nor doubles an elapsed hour across a
    one-hour shift (celery #10107 is the bug this avoids). Across Lord Howe's 30-minute shift, minute 0
    runs 90 minutes apart at both changes, minute 30 runs 30 minutes apart at both.

The days of a :class:`Cron` follow Celery, not Vixie cron: a local date runs only when its month, its day of
the month *and* its day of the week (0 = Sunday) all match.
"""

from __future__ import annotations

import calendar
import math
from bisect import bisect_right
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from functools import lru_cache
from typing import Protocol
from zoneinfo import ZoneInfo

import celery.schedules

#: ``anchor`` of an :class:`Every` made by :func:`timetable`: periods are multiples of the interval since it.
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

_FALL_BACK = ("first", "both")
_ALL_HOURS = frozenset(range(24))
#: 400 Gregorian years: every valid (month, day) falls on every weekday within them, so a Cron that can
#: run at all runs within this many days.
_CYCLE_DAYS = 146_097
#: The fields of a crontab string, in its order, as Celery's keyword arguments and as cron names them.
_STRING_FIELDS = (
    ("minute", "minute"),
    ("hour", "hour"),
    ("day_of_month", "day-of-month"),
    ("month_of_year", "month"),
    ("day_of_week", "day-of-week"),
)


class Timetable(Protocol):
    """What the schedule guardrails read: the first run (UTC) strictly after a timezone-aware instant."""

    def next_after(self, instant: datetime) -> datetime: ...


def _local(zone: ZoneInfo, day: date, at: time, fold: int) -> datetime:
    return datetime.combine(day, at, tzinfo=zone).replace(fold=fold)


def _exists(moment: datetime) -> bool:
    """Whether a zone-aware local time is a real instant (not inside a spring-forward gap)."""
    back = moment.astimezone(UTC).astimezone(moment.tzinfo)
    return back.replace(tzinfo=None) == moment.replace(tzinfo=None)


def _end_of_gap(zone: ZoneInfo, day: date, at: time) -> datetime:
    """The first real instant after a local time that does not exist (the moment the clocks jumped)."""
    low = _local(zone, day, at, fold=1).astimezone(UTC)  # read with the offset from after the jump: earlier
    high = _local(zone, day, at, fold=0).astimezone(UTC)  # read with the offset from before: later
    while (high - low) > timedelta(seconds=1):
        middle = low + (high - low) / 2
        if middle.astimezone(zone).time() >= at or middle.astimezone(zone).date() > day:
            high = middle
        else:
            low = middle
    return high.replace(microsecond=0)


def _aware(instant: datetime) -> datetime:
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ValueError(f"a schedule needs a timezone-aware instant, got the naive {instant.isoformat()}")
    return instant


@dataclass(frozen=True, slots=True)
class DailyAt:
    """Every day at ``at`` in ``zone``; ``fall_back`` is ``"first"`` (default) or ``"both"``."""

    at: time
    zone: ZoneInfo
    fall_back: str = "first"

    def runs_on(self, day: date) -> list[datetime]:
        """The instants (UTC) this schedule runs on local date ``day``."""
        first = _local(self.zone, day, self.at, fold=0)
        if not _exists(first):
            return [_end_of_gap(self.zone, day, self.at)]
        second = _local(self.zone, day, self.at, fold=1)
        instants = [first.astimezone(UTC)]
        if self.fall_back == "both" and second.astimezone(UTC) != instants[0]:
            instants.append(second.astimezone(UTC))
        return instants

    def next_after(self, instant: datetime) -> datetime:
        instant = _aware(instant)
        day = instant.astimezone(self.zone).date() - timedelta(days=1)
        while True:
            for run in self.runs_on(day):
                if run > instant:
                    return run
            day += timedelta(days=1)


@dataclass(frozen=True, slots=True)
class Every:
    """Every ``interval`` of elapsed time from ``anchor`` (a zone-aware instant)."""

    interval: timedelta
    anchor: datetime

    def next_after(self, instant: datetime) -> datetime:
        # In UTC: arithmetic between datetimes of one ZoneInfo is wall-clock arithmetic, DST ignored.
        anchor = self.anchor.astimezone(UTC)
        elapsed = (_aware(instant).astimezone(UTC) - anchor) // self.interval
        return anchor + (elapsed + 1) * self.interval


@dataclass(frozen=True, slots=True)
class Cron:
    """A Celery crontab read in ``zone``: the expanded fields of ``celery.schedules.crontab``.

    ``days_of_week`` uses Celery's numbering (0 = Sunday). A date runs when all three day fields match it
    (Celery's rule). An hour field of all 24 hours reads as elapsed time, any other as wall-clock times
    (module docstring); ``fall_back`` (``"first"`` or ``"both"``) is read by the wall-clock reading only.
    """

    minutes: frozenset[int]
    hours: frozenset[int]
    days_of_week: frozenset[int]
    days_of_month: frozenset[int]
    months_of_year: frozenset[int]
    zone: ZoneInfo
    fall_back: str = "first"

    def __post_init__(self) -> None:
        for name, low, high in (
            ("minutes", 0, 59),
            ("hours", 0, 23),
            ("days_of_week", 0, 6),
            ("days_of_month", 1, 31),
            ("months_of_year", 1, 12),
        ):
            values = frozenset(getattr(self, name))
            if not values or not all(isinstance(v, int) and low <= v <= high for v in values):
                raise ValueError(f"Cron {name} must be a non-empty set of integers {low}-{high}, got {sorted(values)}")
            object.__setattr__(self, name, values)
        if self.fall_back not in _FALL_BACK:
            raise ValueError(f"fall_back must be 'first' or 'both', got {self.fall_back!r}")
        longest = max(calendar.monthrange(2000, month)[1] for month in self.months_of_year)  # a leap year
        if min(self.days_of_month) > longest:
            days, months = sorted(self.days_of_month), sorted(self.months_of_year)
            raise ValueError(f"Cron never runs: no day of the month in {days} occurs in the months {months}")

    def matches(self, day: date) -> bool:
        """Whether the crontab runs on local date ``day`` (month, day of the month and weekday all match)."""
        return (
            day.month in self.months_of_year
            and day.day in self.days_of_month
            and day.isoweekday() % 7 in self.days_of_week
        )

    def runs_on(self, day: date) -> list[datetime]:
        """The instants (UTC) this crontab runs on local date ``day``, sorted, each once."""
        return list(_runs_on(self, day)) if self.matches(day) else []

    def next_after(self, instant: datetime) -> datetime:
        instant = _aware(instant)
        # From the day before the instant's local date: a late local time of that day can still be ahead of
        # the instant (a repeated hour across midnight, or a gap whose end is after midnight). For the same
        # reason, once a day has a run after the instant, the day after it is looked at too.
        day = instant.astimezone(self.zone).date() - timedelta(days=1)
        found: datetime | None = None
        for _ in range(_CYCLE_DAYS + 2):
            runs = _runs_on(self, day) if self.matches(day) else ()
            index = bisect_right(runs, instant)
            if index < len(runs):
                if found is not None:
                    return min(found, runs[index])
                found = runs[index]
            elif found is not None:
                return found
            day += timedelta(days=1)
        raise AssertionError(f"{self!r} found no run in 400 years")  # unreachable: __post_init__ checks the days

    def _compute_runs_on(self, day: date) -> tuple[datetime, ...]:
        elapsed = self.hours == _ALL_HOURS
        runs: set[datetime] = set()
        for hour in self.hours:
            for minute in self.minutes:
                at = time(hour, minute)
                # PEP 495: fold=0 reads a local time with the offset from before a change, fold=1 with the one
                # from after. Equal: it happens once; first earlier: it happens twice; first later: never.
                first = _local(self.zone, day, at, fold=0).astimezone(UTC)
                second = _local(self.zone, day, at, fold=1).astimezone(UTC)
                if first > second:
                    if not elapsed:
                        runs.add(_end_of_gap(self.zone, day, at))
                    continue
                runs.add(first)
                if elapsed or self.fall_back == "both":
                    runs.add(second)
        return tuple(sorted(runs))


@lru_cache(maxsize=128)
def _runs_on(cron: Cron, day: date) -> tuple[datetime, ...]:
    # Cached so that consecutive next_after calls (an every-minute crontab: 1440 local times a day) build
    # each day once. Keys are small and equal Crons share entries.
    return cron._compute_runs_on(day)


@lru_cache(maxsize=1024)
def _cron(
    minutes: frozenset[int],
    hours: frozenset[int],
    days_of_week: frozenset[int],
    days_of_month: frozenset[int],
    months_of_year: frozenset[int],
    zone: ZoneInfo,
    fall_back: str,
) -> Cron:
    # Cached (a Cron is immutable): thousands of django-celery-beat rows share a few crontabs, and beat and the
    # watchdog make every entry's timetable again on each tick and check (checking a Cron's fields is most of it).
    return Cron(minutes, hours, days_of_week, days_of_month, months_of_year, zone, fall_back)


def timetable(schedule: object, *, zone: ZoneInfo, fall_back: str = "first") -> Cron | Every:
    """The timetable of a Celery schedule, read in ``zone``.

    * ``celery.schedules.crontab`` (django-celery-beat's subclass too), or a 5-field crontab string
      (``"30 2 * * 1-5"``: minute hour day-of-month month day-of-week) -> :class:`Cron`;
    * ``celery.schedules.schedule``, a ``timedelta`` or a number of seconds -> :class:`Every` anchored at
      :data:`EPOCH` (periods are multiples of the interval since 1970-01-01 UTC; ``zone`` is not read).

    Raises ``ValueError`` for anything else (``solar`` included) and for a string Celery cannot parse.
    """
    if fall_back not in _FALL_BACK:
        raise ValueError(f"fall_back must be 'first' or 'both', got {fall_back!r}")
    if isinstance(schedule, str):
        schedule = parse_crontab(schedule)
    if isinstance(schedule, celery.schedules.crontab):
        return _cron(
            frozenset(schedule.minute),
            frozenset(schedule.hour),
            frozenset(schedule.day_of_week),
            frozenset(schedule.day_of_month),
            frozenset(schedule.month_of_year),
            zone,
            fall_back,
        )
    if isinstance(schedule, celery.schedules.solar):
        raise ValueError(
            "a solar schedule (sunrise, sunset, ...) has no timetable the guardrails can check; "
            "use a crontab or an interval"
        )
    interval: object = schedule
    if isinstance(schedule, celery.schedules.schedule):
        interval = schedule.run_every
        if interval is None:
            raise ValueError("a celery schedule without run_every has no timetable")
    if isinstance(interval, int | float) and not isinstance(interval, bool):
        if not math.isfinite(interval):
            raise ValueError(f"an interval schedule needs a finite number of seconds, got {interval!r}")
        interval = timedelta(seconds=interval)
    if not isinstance(interval, timedelta):
        raise ValueError(
            f"cannot read a schedule of type {type(schedule).__name__} as a timetable: give a celery crontab, "
            "a crontab string, a celery schedule, a timedelta or a number of seconds"
        )
    if interval <= timedelta(0):
        raise ValueError(f"an interval schedule needs a positive interval, got {interval}")
    return Every(interval, anchor=EPOCH)


def parse_crontab(text: str) -> celery.schedules.crontab:
    """A Celery crontab from a 5-field string (minute hour day-of-month month day-of-week); a ValueError
    that names the field it refuses."""
    fields = text.split()
    if len(fields) != 5:
        raise ValueError(
            f"a crontab string has 5 fields (minute hour day-of-month month day-of-week), got {len(fields)}: {text!r}"
        )
    spec = {keyword: value for (keyword, _), value in zip(_STRING_FIELDS, fields, strict=True)}
    try:
        # By keyword: Celery's positional order (minute, hour, day_of_week, ...) is not the string's.
        return celery.schedules.crontab(**spec)
    except (ValueError, celery.schedules.ParseException) as exc:
        # Celery's message does not say which field it refused ("Invalid weekday literal 'x'." for a minute).
        for keyword, name in _STRING_FIELDS:
            try:
                celery.schedules.crontab(**{keyword: spec[keyword]})
            except (ValueError, celery.schedules.ParseException) as field_exc:
                raise ValueError(
                    f"bad crontab string {text!r}: {name} field {spec[keyword]!r}: {field_exc}"
                ) from field_exc
        raise ValueError(f"bad crontab string {text!r}: {exc}") from exc


def periods_between(timetable: Timetable, after: datetime, until: datetime, *, limit: int) -> list[datetime]:
    """The runs of ``timetable`` in ``(after, until]``, oldest first: the *oldest* ``limit`` of them.

    When the list has ``limit`` items there may be more: call again with ``after`` set to its last item.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    until = _aware(until)
    runs: list[datetime] = []
    clock = _aware(after)
    while len(runs) < limit and (clock := timetable.next_after(clock)) <= until:
        runs.append(clock)
    return runs
