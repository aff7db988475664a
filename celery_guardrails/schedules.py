"""When scheduled work is due: wall-clock schedules with stated DST behaviour.

Two kinds of schedule, because the two readings of "every day at 02:30" and "every hour" differ:

* :class:`DailyAt` runs at a local wall-clock time in its own time zone, once per local date:

  - a time that does not exist that day (spring forward: 02:30 in Berlin on the last Sunday of March) runs
    once, at the first valid instant after it (03:00 local, the end of the gap);
  - a time that happens twice (fall back: 02:30 in Berlin on the last Sunday of October) runs once, at its
    first occurrence; ``fall_back="both"`` runs at both.

* :class:`Every` runs at a fixed interval of elapsed time (``Every(hours=1)``), anchored at a local time;
  across a DST change it neither skips nor doubles a run (it may show a different local minute afterwards in
  a zone with a 30-minute shift, such as Australia/Lord_Howe).

``next_after(instant)`` takes and returns timezone-aware datetimes; nothing here reads the system clock, so
a simulated clock can drive a whole year (see the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo


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
        elapsed = (instant.astimezone(UTC) - anchor) // self.interval
        return anchor + (elapsed + 1) * self.interval
