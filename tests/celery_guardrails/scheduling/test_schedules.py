"""A year of runs on a simulated clock: daily 02:30, hourly and crontabs, in three zones with different DST changes.

The zones: Europe/Berlin and America/New_York shift by one hour (Berlin at 02:00 local both ways, New York at
02:00 in spring and 02:00 EDT -> 01:00 EST in autumn); Australia/Lord_Howe shifts by 30 minutes at 02:00 local
(spring: 02:00 -> 02:30 on the first Sunday of October; autumn: 02:00 -> 01:30 on the first Sunday of April).
"""

from __future__ import annotations

import random
from collections import Counter
from datetime import UTC, date, datetime, time, timedelta
from itertools import pairwise
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import crontab, schedule, solar

from celery_guardrails.scheduling.schedules import EPOCH, Cron, DailyAt, Every, Timetable, periods_between, timetable

ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe"]
YEAR_START, YEAR_END = datetime(2026, 1, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)
HOUR, MINUTE = timedelta(hours=1), timedelta(minutes=1)


def simulate(
    schedule: Timetable, zone: ZoneInfo, start: date = date(2026, 1, 1), end: date = date(2027, 1, 1)
) -> list[datetime]:
    """Drive the schedule with a clock that only moves forward, from local midnight ``start`` to ``end``."""
    begin = datetime.combine(start, time(), tzinfo=zone) - timedelta(microseconds=1)
    stop = datetime.combine(end, time(), tzinfo=zone)
    runs, clock = [], begin
    while (clock := schedule.next_after(clock)) < stop:
        runs.append(clock)
    return runs


def cron_of(given: object, zone: ZoneInfo, fall_back: str = "first") -> Cron:
    """timetable() of a crontab or crontab string, which is a Cron."""
    table = timetable(given, zone=zone, fall_back=fall_back)
    assert isinstance(table, Cron)
    return table


def local(runs: list[datetime], zone: ZoneInfo) -> list[str]:
    """Runs as local wall-clock readings with their UTC offset: what a person in that zone sees."""
    return [run.astimezone(zone).strftime("%Y-%m-%d %H:%M%z") for run in runs]


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


# Cron: a Celery crontab read in a zone -------------------------------------------------------------------------


@pytest.mark.parametrize("fall_back", ["first", "both"])
@pytest.mark.parametrize("name", ZONES)
def test_fixed_hour_crontab_runs_exactly_as_daily_at(name: str, fall_back: str) -> None:
    # Given crontab(hour=2, minute=30) and DailyAt(02:30) in the same zone
    zone = ZoneInfo(name)
    cron = cron_of(crontab(hour=2, minute=30), zone, fall_back)

    # When a year is simulated for each
    runs = simulate(cron, zone)

    # Then they run at the same instants, all in UTC
    assert runs == simulate(DailyAt(time(2, 30), zone, fall_back=fall_back), zone)
    assert {run.tzinfo for run in runs} == {UTC}


# An hourly crontab over a year. Each case: the runs in the local year (local New Year to New Year is 8760
# elapsed hours in all three zones: both ends have the same offset), the local dates without 24 runs, and
# every pair of consecutive runs that is not one elapsed hour apart (local readings).
#
# * Berlin and New York shift by a whole hour at the top of an hour. Spring: the local hour 02:00-02:59 does
#   not exist, so minute 0 and minute 30 of it have no run (23 on that date), and 01:xx -> 03:xx is one
#   elapsed hour. Autumn: an hour repeats (02:xx in Berlin, 01:xx in New York) and each of its runs happens
#   twice (25 on that date), one elapsed hour apart. So 8760 runs, every one exactly an hour after the last.
# * Lord Howe shifts by 30 minutes at 02:00. Spring (2026-10-04, 02:00 -> 02:30): local 02:00 does not exist,
#   02:30 does (the gap's end). Minute 0 loses a run (23 that date) and 01:00 -> 03:00 is 90 elapsed
#   minutes; minute 30 keeps all 24, but 01:30 -> 02:30 is only 30 elapsed minutes. Autumn (2026-04-05,
#   02:00 -> 01:30): 01:30-01:59 happens twice. Minute 0 is not in it (24 runs), and 01:00 (+11:00) ->
#   02:00 (+10:30) is 90 elapsed minutes; minute 30 runs 01:30 twice (25 runs), 30 elapsed minutes apart.
#   So minute 0 runs 8759 times and minute 30 8761 times: across a half-hour shift no minute of the hour can
#   stay an elapsed hour apart, and the crontab runs each local time as often as the clock shows it.
HOURLY_CRONTAB = {
    ("Europe/Berlin", 0): (8760, {"2026-03-29": 23, "2026-10-25": 25}, []),
    ("America/New_York", 0): (8760, {"2026-03-08": 23, "2026-11-01": 25}, []),
    ("Australia/Lord_Howe", 0): (
        8759,
        {"2026-10-04": 23},
        [
            ("2026-04-05 01:00+1100", "2026-04-05 02:00+1030", timedelta(minutes=90)),
            ("2026-10-04 01:00+1030", "2026-10-04 03:00+1100", timedelta(minutes=90)),
        ],
    ),
    ("Australia/Lord_Howe", 30): (
        8761,
        {"2026-04-05": 25},
        [
            ("2026-04-05 01:30+1100", "2026-04-05 01:30+1030", timedelta(minutes=30)),
            ("2026-10-04 01:30+1030", "2026-10-04 02:30+1100", timedelta(minutes=30)),
        ],
    ),
}


@pytest.mark.parametrize(("case", "expected"), HOURLY_CRONTAB.items(), ids=[f"{z}-:{m:02}" for z, m in HOURLY_CRONTAB])
def test_hourly_crontab_runs_every_elapsed_hour_the_clock_shows(
    case: tuple[str, int], expected: tuple[int, dict[str, int], list[tuple[str, str, timedelta]]]
) -> None:
    # Given an hourly crontab (every hour: the elapsed-time reading) in a zone
    name, minute = case
    zone = ZoneInfo(name)
    count, odd_days, odd_gaps = expected

    # When a local year is simulated
    runs = simulate(cron_of(crontab(minute=minute), zone), zone)

    # Then it runs at that minute of every local hour the clock shows, as often as the clock shows it
    assert datetime(2027, 1, 1, tzinfo=zone) - datetime(2026, 1, 1, tzinfo=zone) == 8760 * HOUR
    assert len(runs) == count == len(set(runs))
    assert {run.astimezone(zone).minute for run in runs} == {minute}
    per_day = Counter(run.astimezone(zone).date().isoformat() for run in runs)
    assert len(per_day) == 365 and {d: n for d, n in per_day.items() if n != 24} == odd_days
    # And runs are an elapsed hour apart, except exactly where the clock's shift moved the minute
    gaps = [(*local([a, b], zone), b - a) for a, b in pairwise(runs) if b - a != HOUR]
    assert gaps == odd_gaps


def test_every_minute_crontab_runs_each_elapsed_minute_across_both_berlin_changes() -> None:
    # Given an every-minute crontab in Berlin
    zone = ZoneInfo("Europe/Berlin")
    cron = cron_of("* * * * *", zone)

    # When the two DST days are read
    spring = cron.runs_on(date(2026, 3, 29))
    autumn = cron.runs_on(date(2026, 10, 25))

    # Then spring has 1440 - 60 runs (02:00-02:59 never shows) and autumn 1440 + 60 (02:00-02:59 shows twice):
    # in both, one run per elapsed minute from local midnight to local midnight (23 and 25 hours)
    assert spring == [datetime(2026, 3, 28, 23, tzinfo=UTC) + i * MINUTE for i in range(1380)]
    assert autumn == [datetime(2026, 10, 24, 22, tzinfo=UTC) + i * MINUTE for i in range(1500)]
    assert not any(run.astimezone(zone).hour == 2 for run in spring)
    assert Counter(run.astimezone(zone).hour for run in autumn)[2] == 120

    # And a clock driven minute by minute from the Friday before to the Tuesday after sees the same runs
    for day in (date(2026, 3, 27), date(2026, 10, 23)):
        runs = simulate(cron, zone, day, day + timedelta(days=4))
        assert {b - a for a, b in pairwise(runs)} == {MINUTE}
        assert runs == [run for offset in range(4) for run in cron.runs_on(day + timedelta(days=offset))]


def test_fixed_hour_crontab_runs_a_repeated_hour_once_and_a_wildcard_hour_twice() -> None:
    # Given two hourly crontabs in Berlin, one on all 24 hours and one on 0-22 (so it names wall-clock hours)
    zone, day = ZoneInfo("Europe/Berlin"), date(2026, 10, 25)
    wildcard = cron_of(crontab(minute=0, hour="*"), zone)
    fixed = cron_of(crontab(minute=0, hour="0-22"), zone)

    # When the autumn day is read, Then the wildcard runs the repeated 02:00 twice, the fixed-hour once
    assert local(wildcard.runs_on(day), zone)[:5] == [
        "2026-10-25 00:00+0200",
        "2026-10-25 01:00+0200",
        "2026-10-25 02:00+0200",
        "2026-10-25 02:00+0100",
        "2026-10-25 03:00+0100",
    ]
    assert local(fixed.runs_on(day), zone)[:4] == [
        "2026-10-25 00:00+0200",
        "2026-10-25 01:00+0200",
        "2026-10-25 02:00+0200",
        "2026-10-25 03:00+0100",
    ]
    # And in spring the wildcard has no 02:00, the fixed-hour runs it at 03:00, once with its own 03:00
    spring = date(2026, 3, 29)
    assert local(wildcard.runs_on(spring), zone)[1:3] == ["2026-03-29 01:00+0100", "2026-03-29 03:00+0200"]
    assert local(fixed.runs_on(spring), zone)[1:4] == [
        "2026-03-29 01:00+0100",
        "2026-03-29 03:00+0200",
        "2026-03-29 04:00+0200",
    ]


def test_fixed_hour_crontab_first_or_both_occurrences_in_new_york() -> None:
    # Given a fixed-hour crontab at :00 and :30 from 01:00 to 03:59, in New York
    zone = ZoneInfo("America/New_York")
    spec = crontab(hour="1-3", minute="0,30")
    first = cron_of(spec, zone)
    both = cron_of(spec, zone, "both")

    # When the autumn day is read (01:00-01:59 happens twice: EDT, then EST)
    autumn = date(2026, 11, 1)

    # Then "first" runs 01:00 and 01:30 at their EDT occurrence, "both" at both
    assert local(first.runs_on(autumn), zone) == [
        "2026-11-01 01:00-0400",
        "2026-11-01 01:30-0400",
        "2026-11-01 02:00-0500",
        "2026-11-01 02:30-0500",
        "2026-11-01 03:00-0500",
        "2026-11-01 03:30-0500",
    ]
    assert local(both.runs_on(autumn), zone) == [
        "2026-11-01 01:00-0400",
        "2026-11-01 01:30-0400",
        "2026-11-01 01:00-0500",
        "2026-11-01 01:30-0500",
        "2026-11-01 02:00-0500",
        "2026-11-01 02:30-0500",
        "2026-11-01 03:00-0500",
        "2026-11-01 03:30-0500",
    ]
    # And in spring 02:00 and 02:30 do not exist: both run at 03:00, once, with 03:00 itself
    expected_spring = [
        "2026-03-08 01:00-0500",
        "2026-03-08 01:30-0500",
        "2026-03-08 03:00-0400",
        "2026-03-08 03:30-0400",
    ]
    assert local(first.runs_on(date(2026, 3, 8)), zone) == expected_spring
    assert local(both.runs_on(date(2026, 3, 8)), zone) == expected_spring
    # And over the year: 6 runs a day, 2 fewer on the spring day, 2 more on the autumn day with "both"
    assert len(simulate(first, zone)) == 365 * 6 - 2
    assert len(simulate(both, zone)) == 365 * 6


def test_fixed_hour_crontab_in_lord_howe_half_hour_gap_runs_once_at_its_end() -> None:
    # Given a crontab every quarter of 02:xx in Lord Howe, When its spring day is read (02:00 -> 02:30)
    zone = ZoneInfo("Australia/Lord_Howe")
    cron = cron_of(crontab(hour=2, minute="*/15"), zone)

    # Then 02:00 and 02:15 (gone) run at 02:30, once with 02:30 itself; autumn runs each once (not repeated)
    assert local(cron.runs_on(date(2026, 10, 4)), zone) == ["2026-10-04 02:30+1100", "2026-10-04 02:45+1100"]
    assert local(cron.runs_on(date(2026, 4, 5)), zone) == [
        "2026-04-05 02:00+1030",
        "2026-04-05 02:15+1030",
        "2026-04-05 02:30+1030",
        "2026-04-05 02:45+1030",
    ]


def test_changes_across_local_midnight_keep_the_rules() -> None:
    # Given St. John's in 2006, which fell back at 00:01 local to 23:01 the day before: 23:01-00:00 repeated,
    # so runs of two local dates interleave (00:00 on the 29th comes before the second 23:30 on the 28th)
    zone = ZoneInfo("America/St_Johns")
    night = (datetime(2006, 10, 28, 22, tzinfo=zone), datetime(2006, 10, 29, 1, tzinfo=zone))

    # When a wildcard-hour and a fixed-hour crontab run through that night
    wildcard = periods_between(cron_of("*/30 * * * *", zone), *night, limit=100)
    fixed = periods_between(cron_of("0,30 0,23 * * *", zone, "both"), *night, limit=100)

    # Then the wildcard runs every 30 elapsed minutes, each repeated reading twice; the fixed-hour the same
    assert local(wildcard, zone) == [
        "2006-10-28 22:30-0230",
        "2006-10-28 23:00-0230",
        "2006-10-28 23:30-0230",
        "2006-10-29 00:00-0230",
        "2006-10-28 23:30-0330",
        "2006-10-29 00:00-0330",
        "2006-10-29 00:30-0330",
        "2006-10-29 01:00-0330",
    ]
    assert {b - a for a, b in pairwise(wildcard)} == {timedelta(minutes=30)}
    assert fixed == [run for run in wildcard if run.astimezone(zone).hour in (0, 23)]

    # Given Nuuk on 2024-03-30, whose clocks jumped from 23:00 to 00:00: 23:30 did not exist that day
    zone = ZoneInfo("America/Nuuk")
    days = (date(2024, 3, 29), date(2024, 4, 1))
    # When a daily 23:30 runs, Then that day's run is the end of the gap, just after local midnight
    expected = ["2024-03-29 23:30-0200", "2024-03-31 00:00-0100", "2024-03-31 23:30-0100"]
    assert local(simulate(cron_of("30 23 * * *", zone), zone, *days), zone) == expected
    assert local(simulate(DailyAt(time(23, 30), zone), zone, *days), zone) == expected


# Days: Celery's rule (month, day of month AND day of week), checked against Celery itself in UTC ----------------

CELERY_DAY_SPECS: list[dict[str, Any]] = [
    {"minute": 15, "hour": "3,17", "day_of_week": "mon,fri", "day_of_month": "1-7,13"},
    {"minute": "0,45", "hour": 9, "day_of_week": "sun", "month_of_year": "2,9"},
    {"minute": 5, "hour": 4, "day_of_week": "sat"},
    {"minute": 0, "hour": 0, "day_of_month": 29, "month_of_year": 2, "day_of_week": "sun"},
]


@pytest.fixture
def utc_app() -> Celery:
    app = Celery("schedules-test", set_as_current=False)
    app.conf.timezone = "UTC"
    app.conf.enable_utc = True
    return app


@pytest.mark.parametrize("spec", CELERY_DAY_SPECS, ids=lambda spec: " ".join(f"{k}={v}" for k, v in spec.items()))
def test_crontab_days_match_celery(spec: dict[str, Any], utc_app: Celery) -> None:
    # Given a crontab with day fields, read by Celery (UTC app, simulated clock) and by Cron in UTC
    clock = [YEAR_START]
    celery_cron = crontab(**spec, app=utc_app, nowfun=lambda: clock[0])
    cron = cron_of(celery_cron, ZoneInfo("UTC"))

    # When both chain "next run after the last one" from New Year, for 2026-2033
    ours = simulate(cron, ZoneInfo("UTC"), date(2026, 1, 1), date(2034, 1, 1))
    celery_runs, last = [], YEAR_START - timedelta(microseconds=1)
    while True:
        clock[0] = last
        if (last := last + celery_cron.remaining_estimate(last)) >= datetime(2034, 1, 1, tzinfo=UTC):
            break
        celery_runs.append(last)

    # Then the sequences are equal, and each run's date matches every day field (not either, as Vixie cron)
    assert ours == celery_runs and ours
    for run in ours:
        assert run.month in cron.months_of_year and run.day in cron.days_of_month
        assert run.isoweekday() % 7 in cron.days_of_week

    # And from random instants, Celery's is_due agrees: not due a second before our next run, due at it
    rng = random.Random(20260101)
    for _ in range(200):
        last_run = YEAR_START + timedelta(seconds=rng.randrange(3 * 365 * 86400), microseconds=rng.randrange(10**6))
        following = cron.next_after(last_run)
        clock[0] = following - timedelta(seconds=1)
        assert tuple(celery_cron.is_due(last_run)) == (False, 1.0)
        clock[0] = following
        assert celery_cron.is_due(last_run)[0] is True


def test_day_of_week_and_day_of_month_both_have_to_match() -> None:
    # Given Mondays and Fridays that are also in the first week or the 13th (Celery's "and")
    cron = cron_of("15 3 1-7,13 * mon,fri", ZoneInfo("UTC"))

    # When the first quarter of 2026 is simulated
    runs = simulate(cron, ZoneInfo("UTC"), date(2026, 1, 1), date(2026, 4, 1))

    # Then only such days run: Tue 13 Jan and the other first-week days do not, Fri 13 Feb does
    assert [run.strftime("%a %d %b") for run in runs] == [
        "Fri 02 Jan",
        "Mon 05 Jan",
        "Mon 02 Feb",
        "Fri 06 Feb",
        "Fri 13 Feb",
        "Mon 02 Mar",
        "Fri 06 Mar",
        "Fri 13 Mar",
    ]


# timetable(): Celery schedules in, timetables out ----------------------------------------------------------------


class Sunrise(solar):  # type: ignore[misc]  # celery is untyped here
    """A solar schedule without ephem (celery[solar] is not installed): timetable() reads only its type."""

    def __init__(self) -> None:
        pass


def test_timetable_reads_crontabs_and_crontab_strings() -> None:
    zone = ZoneInfo("Europe/Berlin")
    # Given a crontab, When it is converted, Then its expanded fields, the zone and fall_back are kept
    assert timetable(crontab(minute="*/15", hour="9-17", day_of_week="mon-fri"), zone=zone, fall_back="both") == Cron(
        minutes=frozenset({0, 15, 30, 45}),
        hours=frozenset(range(9, 18)),
        days_of_week=frozenset(range(1, 6)),
        days_of_month=frozenset(range(1, 32)),
        months_of_year=frozenset(range(1, 13)),
        zone=zone,
        fall_back="both",
    )
    # And a string is read in cron's order (minute hour day-of-month month day-of-week), not Celery's arguments'
    assert timetable("30 2 * * *", zone=zone) == timetable(crontab(minute=30, hour=2), zone=zone)
    spec = crontab(minute=0, hour=12, day_of_month=13, month_of_year="6-8", day_of_week=5)
    assert timetable("0 12  13 6-8 5", zone=zone) == timetable(spec, zone=zone)


@pytest.mark.parametrize(
    "given",
    [schedule(timedelta(minutes=15)), timedelta(minutes=15), 900, 900.0],
    ids=["celery schedule", "timedelta", "int seconds", "float seconds"],
)
def test_timetable_reads_intervals_as_elapsed_time_since_the_epoch(given: object) -> None:
    # Given a 15-minute interval in any of its forms, When converted
    table = timetable(given, zone=ZoneInfo("Australia/Lord_Howe"))

    # Then it is Every(15 min) anchored at the epoch: runs on UTC quarter hours, whatever the zone
    assert table == Every(timedelta(minutes=15), anchor=EPOCH)
    after = datetime(2026, 10, 3, 15, 29, 59, tzinfo=UTC)
    assert periods_between(table, after, after + HOUR, limit=10) == [
        datetime(2026, 10, 3, 15, 30, tzinfo=UTC),
        datetime(2026, 10, 3, 15, 45, tzinfo=UTC),
        datetime(2026, 10, 3, 16, 0, tzinfo=UTC),
        datetime(2026, 10, 3, 16, 15, tzinfo=UTC),
    ]


REFUSED: list[tuple[object, str]] = [
    (Sunrise(), "a solar schedule .* use a crontab or an interval"),
    ("61 * * * *", r"bad crontab string '61 \* \* \* \*': minute field '61': Invalid end range: 61 > 59"),
    ("0 24 * * *", "hour field '24': Invalid end range: 24 > 23"),
    ("0 0 * * 7", "day-of-week field '7': Invalid end range: 7 > 6"),
    ("x 0 * * *", "minute field 'x': Invalid weekday literal 'x'"),
    ("0 0 1,,2 * *", "day-of-month field '1,,2': empty part"),
    ("0 0 30 2 *", "day_of_month '30' never occurs in month_of_year '2'"),
    ("* * *", "a crontab string has 5 fields .* got 3"),
    (0, "needs a positive interval"),
    (timedelta(seconds=-5), "needs a positive interval"),
    (float("nan"), "needs a finite number of seconds"),
    (True, "cannot read a schedule of type bool as a timetable"),
    (schedule(None), "a celery schedule without run_every has no timetable"),
    (object(), "cannot read a schedule of type object as a timetable"),
]


@pytest.mark.parametrize(
    ("given", "message"), REFUSED, ids=[g if isinstance(g, str) else type(g).__name__ for g, _ in REFUSED]
)
def test_timetable_refuses_what_it_cannot_check_with_a_clear_error(given: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        timetable(given, zone=ZoneInfo("UTC"))


def test_timetable_and_cron_refuse_bad_arguments() -> None:
    zone = ZoneInfo("UTC")
    with pytest.raises(ValueError, match="fall_back must be 'first' or 'both', got 'last'"):
        timetable(crontab(), zone=zone, fall_back="last")
    with pytest.raises(ValueError, match=r"Cron minutes must be a non-empty set of integers 0-59, got \[60\]"):
        Cron(frozenset({60}), frozenset({0}), frozenset({0}), frozenset({1}), frozenset({1}), zone)
    with pytest.raises(ValueError, match=r"Cron hours must be a non-empty set of integers 0-23, got \[\]"):
        Cron(frozenset({0}), frozenset(), frozenset({0}), frozenset({1}), frozenset({1}), zone)
    with pytest.raises(ValueError, match=r"no day of the month in \[30, 31\] occurs in the months \[2\]"):
        Cron(frozenset({0}), frozenset({0}), frozenset({0}), frozenset({30, 31}), frozenset({2}), zone)
    # a naive instant: every timetable refuses it (an interval would have read it as the machine's local time)
    for table in (cron_of(crontab(), zone), DailyAt(time(2, 30), zone), Every(HOUR, EPOCH)):
        with pytest.raises(ValueError, match="timezone-aware instant, got the naive 2026-01-01T00:00:00"):
            table.next_after(datetime(2026, 1, 1))


# periods_between ---------------------------------------------------------------------------------------------------


def test_periods_between_returns_the_oldest_runs_first_up_to_the_limit() -> None:
    # Given an hourly crontab in Berlin and the window (local midnight, next local midnight] of the autumn day
    zone = ZoneInfo("Europe/Berlin")
    hourly = timetable(crontab(minute=0), zone=zone)
    after, until = datetime(2026, 10, 25, tzinfo=zone), datetime(2026, 10, 26, tzinfo=zone)

    # When it is read 10 at a time, each call starting from the last run returned
    pages, start = [], after
    while page := periods_between(hourly, start, until, limit=10):
        pages.append(page)
        start = page[-1]

    # Then the pages are the oldest 10, the next 10, the last 5: the 25 elapsed hours, the start excluded and
    # the end included
    assert [len(page) for page in pages] == [10, 10, 5]
    runs = [run for page in pages for run in page]
    assert runs == [after.astimezone(UTC) + i * HOUR for i in range(1, 26)]
    assert local(runs, zone)[:3] == ["2026-10-25 01:00+0200", "2026-10-25 02:00+0200", "2026-10-25 02:00+0100"]
    assert runs[-1] == until
    # And an empty window has no runs; a limit below 1 is refused
    assert periods_between(hourly, until, after, limit=10) == []
    with pytest.raises(ValueError, match="limit must be at least 1, got 0"):
        periods_between(hourly, after, until, limit=0)
