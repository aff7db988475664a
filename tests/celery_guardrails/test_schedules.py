"""A year of runs on a simulated clock: daily 02:30 and hourly, in three zones with different DST changes."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, time, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest

from celery_guardrails.schedules import DailyAt, Every

ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe"]
YEAR_START, YEAR_END = datetime(2026, 1, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)


def simulate(schedule: DailyAt | Every, zone: ZoneInfo) -> list[datetime]:
    """Drive the schedule with a clock that only moves forward, from local New Year to local New Year."""
    start = datetime(2026, 1, 1, tzinfo=zone) - timedelta(microseconds=1)
    end = datetime(2027, 1, 1, tzinfo=zone)
    runs, clock = [], start
    while (clock := schedule.next_after(clock)) < end:
        runs.append(clock)
    return runs


@pytest.mark.parametrize("name", ZONES)
def test_daily_0230_runs_once_every_local_day(name: str) -> None:
    zone = ZoneInfo(name)
    runs = simulate(DailyAt(time(2, 30), zone), zone)
    per_day = Counter(run.astimezone(zone).date() for run in runs)
    assert len(runs) == 365 and set(per_day.values()) == {1}
    assert runs == sorted(runs)


EXPECTED_SPRING = {  # the local date 02:30 does not exist, and when it runs instead
    "Europe/Berlin": ("2026-03-29", "03:00"),
    "America/New_York": ("2026-03-08", "03:00"),
}


@pytest.mark.parametrize(("name", "expected"), EXPECTED_SPRING.items())
def test_spring_forward_runs_at_the_end_of_the_gap(name: str, expected: tuple[str, str]) -> None:
    zone = ZoneInfo(name)
    runs = {
        r.astimezone(zone).date().isoformat(): r.astimezone(zone).strftime("%H:%M")
        for r in simulate(DailyAt(time(2, 30), zone), zone)
    }
    day, at = expected
    assert runs[day] == at
    assert sum(1 for t in runs.values() if t != "02:30") == 1  # that day only


def test_lord_howe_half_hour_gap_ends_exactly_at_0230() -> None:
    # Lord Howe springs forward from 02:00 to 02:30 (first Sunday of October): 02:30 exists, it is the gap's end
    zone = ZoneInfo("Australia/Lord_Howe")
    runs = [r.astimezone(zone) for r in simulate(DailyAt(time(2, 30), zone), zone)]
    assert {r.strftime("%H:%M") for r in runs} == {"02:30"}
    gap = DailyAt(time(2, 15), zone)  # 02:15 does not exist that day: runs at 02:30
    assert [r.astimezone(zone).strftime("%H:%M") for r in gap.runs_on(datetime(2026, 10, 4).date())] == ["02:30"]


def test_fall_back_runs_the_first_occurrence_or_both() -> None:
    zone, day = ZoneInfo("Europe/Berlin"), datetime(2026, 10, 25).date()
    (first,) = DailyAt(time(2, 30), zone).runs_on(day)
    both = DailyAt(time(2, 30), zone, fall_back="both").runs_on(day)
    assert first == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)  # 02:30 CEST
    assert both == [first, datetime(2026, 10, 25, 1, 30, tzinfo=UTC)]  # and 02:30 CET
    assert len(simulate(DailyAt(time(2, 30), zone, fall_back="both"), zone)) == 366


@pytest.mark.parametrize("name", ZONES)
def test_hourly_neither_skips_nor_doubles(name: str) -> None:
    zone = ZoneInfo(name)
    anchor = datetime(2026, 1, 1, 0, 0, tzinfo=zone)
    runs = simulate(Every(timedelta(hours=1), anchor), zone)
    year = datetime(2027, 1, 1, tzinfo=zone).astimezone(UTC) - anchor.astimezone(UTC)
    hours_in_year = int(year.total_seconds() // 3600)
    assert len(runs) == hours_in_year
    assert {b - a for a, b in pairwise(runs)} == {timedelta(hours=1)}
    assert hours_in_year == 8760 and len(set(runs)) == len(runs)  # local New Year to New Year, same offset
