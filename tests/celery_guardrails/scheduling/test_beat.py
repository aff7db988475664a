"""Guarded beat on real processes: missed runs while beat is down, each catch-up policy, two beats at once,
and bad policies refused at start-up. Real ``celery beat`` and ``celery worker`` processes, Redis broker
and Redis store, on a shared clock that stands still until the test moves it (tests/support/scheduling.py)."""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from celery_guardrails.scheduling.beat import Entry, plan
from celery_guardrails.scheduling.ledger import MISSED, OK, Run
from celery_guardrails.scheduling.policy import SchedulePolicy
from tests.conftest import Sink
from tests.support.proxy import TcpProxy
from tests.support.scheduling import Rig, a_whole_minute
from tests.support.services import REDIS_URL

MINUTE = 60.0
GRACE = 20.0  # seconds of the rig's clock, which moves only when the test moves it
TASK = "tests.proj.tasks.scheduled_job"


def entry(sink: Sink, schedule: Any = MINUTE, **kwargs: Any) -> dict[str, Any]:
    return {"task": TASK, "schedule": schedule, "kwargs": {"sink": sink.key, **kwargs}}


def periods_ran(sink: Sink, schedule: str) -> list[float]:
    return [item["period"] for item in sink.items() if item["schedule"] == schedule]


# --- plan(): the catch-up rules on their own -------------------------------------------------------------


def _entry(**policy: Any) -> Entry:
    from zoneinfo import ZoneInfo

    return Entry(name="e", task=TASK, schedule=60.0, policy=SchedulePolicy(**policy), zone=ZoneInfo("UTC"))


@pytest.mark.parametrize(
    ("catch_up", "limit", "dispatched", "recorded"),
    [
        ("skip", 10, [360], [60, 120, 180, 240, 300]),
        # "latest" runs the most recent period: 360, due on time, is it (#30: dispatching 300 beside it let the
        # stale run take the overlap slot and the current one be skipped)
        ("latest", 10, [360], [60, 120, 180, 240, 300]),
        ("all", 10, [60, 120, 180, 240, 300, 360], []),
        ("all", 2, [240, 300, 360], [60, 120, 180]),
    ],
)
def test_plan_applies_the_catch_up_policy(
    catch_up: str, limit: int, dispatched: list[int], recorded: list[int]
) -> None:
    # Given periods 60..360 due, now 370, grace 20: 60..300 are late, 360 is on time
    due = [60.0, 120.0, 180.0, 240.0, 300.0, 360.0]
    # When the plan is made for each policy
    to_dispatch, to_record = plan(_entry(catch_up=catch_up, catch_up_limit=limit, grace=20), due, 370.0)
    # Then exactly these periods run, oldest first, and the rest are recorded missed
    assert (to_dispatch, to_record) == (dispatched, recorded)


@pytest.mark.parametrize(
    ("catch_up", "dispatched", "recorded"),
    [("skip", [], [60, 120, 180]), ("latest", [180], [60, 120]), ("all", [60, 120, 180], [])],
)
def test_plan_with_every_period_late_catches_up_the_newest(
    catch_up: str, dispatched: list[int], recorded: list[int]
) -> None:
    # Given periods 60..180 due, now 370, grace 20: all late, none due on time
    # When the plan is made for each policy
    to_dispatch, to_record = plan(_entry(catch_up=catch_up, grace=20), [60.0, 120.0, 180.0], 370.0)
    # Then "latest" runs the newest late period (what Celery beat does), "all" each, "skip" none
    assert (to_dispatch, to_record) == (dispatched, recorded)


@pytest.mark.parametrize(
    ("schedule", "grace"),
    [(4.0, 2.0), (60.0, 30.0), (120.0, 60.0), (3600.0, 60.0), ("* * * * *", 30.0), ("0 9,17 * * *", 60.0)],
)
def test_the_default_grace_is_a_minute_or_half_the_period(schedule: Any, grace: float) -> None:
    from zoneinfo import ZoneInfo

    from celery_guardrails.scheduling.policy import DEFAULT_POLICY

    # Given an entry with no policy written (the default one), and one whose policy sets grace
    # When its grace is read
    default = Entry(name="e", task=TASK, schedule=schedule, policy=DEFAULT_POLICY, zone=ZoneInfo("UTC"))
    stated = Entry(name="e", task=TASK, schedule=schedule, policy=SchedulePolicy(grace=7), zone=ZoneInfo("UTC"))
    # Then the default is 60 s, or half the period when that is shorter; a stated grace is kept as it is
    assert (default.grace, stated.grace, default.default, stated.default) == (grace, 7.0, True, False)


# --- real beat, real worker -------------------------------------------------------------------------------


def test_beat_down_for_three_periods_watchdog_records_and_alerts_then_each_catch_up_policy(
    tmp_path: Path, rigs: list[Rig], sink: Sink, webhook: tuple[str, list[dict[str, Any]]]
) -> None:
    url, posted = webhook
    uid = uuid.uuid4().hex[:6]
    names = {policy: f"every-minute-{policy}-{uid}" for policy in ("skip", "latest", "all")}
    start = a_whole_minute() + 30
    rig = Rig(
        tmp_path,
        entries={name: entry(sink) for name in names.values()},
        policies={
            names["skip"]: {"catch_up": "skip", "grace": GRACE, "since": True},
            names["latest"]: {"catch_up": "latest", "grace": GRACE, "since": True},
            names["all"]: {"catch_up": "all", "grace": GRACE},
        },
        start=start,
        # every period alerts (run_alert_throttle 0): the test counts one report per period through the alerts
        settings={"alert_channels": ["log", "webhook"], "alert_webhooks": [url], "run_alert_throttle": 0},
    )
    rigs.append(rig)
    # Given a worker (with its watchdog) and a guarded beat that has run each one-minute entry once
    first = start + 30
    rig.worker()
    beat = rig.beat()
    rig.looking(beat, *names.values())
    rig.set_clock(first + 1)
    for name in names.values():
        rig.wait(f"{name} ran {first}", lambda name=name: _status(rig, name, first) == OK)
    # When beat is stopped, and the clock passes three more periods, one at a time, each past its grace
    beat.stop()
    periods = [first + MINUTE * k for k in (1, 2, 3)]
    for period in periods:
        rig.set_clock(period + GRACE + 1)
        # Then the watchdog records each missed, at the first check after its grace (the clock stands still
        # until the test moves it: the record says exactly when)
        for name in names.values():
            run = rig.wait(f"{name} {period} missed", lambda name=name, period=period: _missed(rig, name, period))
            assert (run.task_id, run.reason) == ("", "not dispatched within 20s of its due time (is beat running?)")
            assert run.finished_at == run.missed_at == period + GRACE + 1
    # When beat comes back between the third missed period and the next one
    rig.set_clock(periods[-1] + 30)
    rig.looking(rig.beat(name="beat-again"), *names.values())
    caught_up: dict[str, list[float]] = {"skip": [], "latest": periods[-1:], "all": periods}
    for policy, name in names.items():
        for period in caught_up[policy]:
            rig.wait(f"{name} caught up {period}", lambda name=name, period=period: _status(rig, name, period) == OK)
    # And the next period is due
    resumed = periods[-1] + MINUTE
    rig.set_clock(resumed + 1)
    for name in names.values():
        rig.wait(f"{name} resumed", lambda name=name: _status(rig, name, resumed) == OK)

    # Then each missed period was alerted exactly once (not again when its catch-up was dispatched late, nor
    # by beat's own catch-up)
    def alerts() -> Counter[tuple[str, str]]:
        return Counter((post["run"]["schedule"], post["run"]["period"]) for post in list(posted) if "run" in post)

    expected = Counter({(name, _iso(period)): 1 for name in names.values() for period in periods})
    rig.wait("an alert for each missed period", lambda: set(alerts()) == set(expected))
    rig.stop()  # (a stopping worker sends what it still has queued: any second alert would be in by now)
    assert alerts() == expected
    # And skip ran none of the missed periods, latest ran the newest once, all ran each in order
    for policy, name in names.items():
        assert periods_ran(sink, name) == [first, *caught_up[policy], resumed]
        statuses = {r.period: r.status for r in rig.runs(name)}
        assert statuses == {first: OK, resumed: OK, **{p: OK if p in caught_up[policy] else MISSED for p in periods}}
        assert all(r.missed_at == r.period + GRACE + 1 for r in rig.runs(name) if r.period in periods)
    # And since=True gave each run the end of the last successful period, read from the ledger
    horizon = {(item["schedule"], item["period"]): (item["since"], item["request_since"]) for item in sink.items()}
    skip, latest = names["skip"], names["latest"]
    assert horizon[(skip, resumed)] == (first, first)
    assert horizon[(latest, periods[-1])] == (first, first)
    assert horizon[(latest, resumed)] == (periods[-1], periods[-1])


def _status(rig: Rig, name: str, period: float) -> str | None:
    run = rig.run_of(name, period)
    return None if run is None else run.status


def _missed(rig: Rig, name: str, period: float) -> Run | None:
    run = rig.run_of(name, period)
    return run if run is not None and run.status == MISSED else None


def _iso(period: float) -> str:
    from datetime import UTC, datetime

    return str(datetime.fromtimestamp(period, UTC))


def test_two_beats_at_once_run_each_period_once(tmp_path: Path, rigs: list[Rig], sink: Sink) -> None:
    name = f"every-10s-{uuid.uuid4().hex[:6]}"
    rig = Rig(tmp_path, entries={name: entry(sink, schedule=10.0)}, policies={name: {"grace": GRACE}})
    rigs.append(rig)
    # Given two guarded beat processes with the same entry, and a worker
    rig.worker()
    one, two = rig.beat(name="beat-one"), rig.beat(name="beat-two")
    rig.looking(one, name)
    rig.looking(two, name)
    # When the clock passes a dozen periods, each one once both beats could have seen it
    due = [rig.now() + 10.0 * k for k in range(1, 13)]
    for period in due:
        rig.set_clock(period + 1)
        rig.wait(f"{period} ran", lambda period=period: _status(rig, name, period) == OK)
    one.stop()
    two.stop()
    # Then every period ran exactly once, in order, and the two beats together published exactly one
    # message per period
    assert periods_ran(sink, name) == due
    dispatches = one.log.count(f"Dispatching '{name}'") + two.log.count(f"Dispatching '{name}'")
    assert dispatches == len(rig.runs(name)) == len(due)


def test_a_period_whose_publish_failed_is_due_again_and_runs_once(tmp_path: Path, rigs: list[Rig], sink: Sink) -> None:
    name = f"every-minute-{uuid.uuid4().hex[:6]}"
    start = a_whole_minute() + 30
    rig = Rig(tmp_path, entries={name: entry(sink)}, policies={name: {"grace": GRACE}}, start=start)
    rigs.append(rig)
    # Given a worker, and a guarded beat that reaches the broker through a proxy the test cuts
    proxy = TcpProxy(6379)
    try:
        rig.worker()
        rig.env["GUARDRAILS_TEST_BROKER_URL"] = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
        beat = rig.beat()
        rig.looking(beat, name)
        # When the period is due while the broker is out of beat's reach: the publish fails
        proxy.cut()
        period = start + 30
        rig.set_clock(period + 1)
        rig.wait("the publish failed", lambda: f"Publishing '{name}' period" in beat.log)
        # When the broker is back (the failed dispatch was forgotten: kept "dispatched", nothing could run it)
        proxy.restore()
        # Then the period is dispatched again and runs, once
        rig.wait(f"{period} ran", lambda: _status(rig, name, period) == OK)
    finally:
        proxy.close()
    assert periods_ran(sink, name) == [period]
    assert beat.process is not None and beat.process.poll() is None


def test_an_entry_whose_message_cannot_be_made_records_its_period_missed_once(
    tmp_path: Path, rigs: list[Rig], sink: Sink
) -> None:
    name = f"every-minute-{uuid.uuid4().hex[:6]}"
    start = a_whole_minute() + 30
    # Given an entry whose arguments do not fit its task (Celery refuses to publish it)
    broken = {"task": TASK, "schedule": MINUTE, "kwargs": {"no_such_argument": 1}}
    rig = Rig(tmp_path, entries={name: broken}, policies={name: {"grace": GRACE}}, start=start)
    rigs.append(rig)
    beat = rig.beat()
    rig.looking(beat, name)
    # When its period is due
    period = start + 30
    rig.set_clock(period + 1)
    # Then the period is recorded missed, saying why, once (not tried again every tick), and beat goes on
    run = rig.wait("the period missed", lambda: _missed(rig, name, period))
    assert run.reason.startswith("could not be published: TypeError")
    # And the next period the same way: one try per period, however many ticks beat made meanwhile
    rig.set_clock(period + MINUTE + 1)
    rig.wait("the next period missed", lambda: _missed(rig, name, period + MINUTE))
    assert beat.log.count(f"Publishing '{name}' period") == 2
    assert beat.process is not None and beat.process.poll() is None


@pytest.mark.parametrize(
    ("policies", "entries", "expected"),
    [
        ({"nightly": {"timezone": "Europe/Berlinn"}}, {"nightly": 60}, "unknown time zone 'Europe/Berlinn'"),
        ({"nightly": {"grace": 5}}, {"nighty": 60}, "policy for 'nightly', but there is no such beat entry"),
        (
            {"nightly": {"grace": 5}},
            {"nightly": "61 * * * *"},
            "entry 'nightly': bad crontab string '61 * * * *': minute",
        ),
        ({"often": {}}, {"often": 0.5}, "beat entry 'often': an interval of a policy must be whole seconds"),
    ],
)
def test_beat_refuses_to_start_on_a_bad_policy_naming_the_entry(
    tmp_path: Path, rigs: list[Rig], sink: Sink, policies: dict[str, Any], entries: dict[str, Any], expected: str
) -> None:
    rig = Rig(tmp_path, entries={n: entry(sink, schedule=s) for n, s in entries.items()}, policies=policies)
    rigs.append(rig)
    # When beat starts on a bad policy
    beat = rig.beat()
    # Then it exits with an error that names the entry and the problem
    assert beat.wait(timeout=30) != 0
    assert expected in beat.log


def test_a_crontab_entry_without_a_timezone_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from celery import Celery
    from celery.schedules import crontab

    from celery_guardrails.scheduling.beat import build_entries

    app = Celery("zones", set_as_current=False)
    app.conf.timezone = "America/New_York"
    app.conf.guardrails = {"schedules": {"nightly": {}, "berlin": {"timezone": "Europe/Berlin"}, "often": {}}}
    raw = {
        "nightly": {"task": TASK, "schedule": crontab(hour=2, minute=30)},
        "berlin": {"task": TASK, "schedule": crontab(hour=2, minute=30)},
        "often": {"task": TASK, "schedule": 60.0},
    }
    # When the entries are read (beat and worker start-up); the level is stated here rather than left to what
    # earlier tests did to logging (this assertion saw no record once, in a run after other tests)
    with caplog.at_level(logging.WARNING, logger="celery_guardrails.scheduling.entries"):
        entries = build_entries(app, raw)
    # Then the crontab without a zone is read in the app's zone, with a warning that names it; the entry
    # with a zone and the interval entry are not warned about
    assert {name: str(entry.zone) for name, entry in entries.items()} == {
        "nightly": "America/New_York",
        "berlin": "Europe/Berlin",
        "often": "America/New_York",
    }
    warnings = [r.getMessage() for r in caplog.records if "without a timezone" in r.getMessage()]
    assert warnings == [
        "celery-guardrails: beat entry 'nightly' is a crontab without a timezone in its policy; it is read in "
        "America/New_York"
    ]


# --- #30: every entry watched by default; catch-up keeps the current period --------------------------------


def test_an_entry_without_a_policy_is_watched_and_its_missed_runs_recorded_one_opted_out_is_left_to_celery(
    tmp_path: Path, rigs: list[Rig], sink: Sink
) -> None:
    uid = uuid.uuid4().hex[:6]
    watched, opted, plain = f"every-4s-{uid}", f"opted-out-{uid}", f"plain-{uid}"
    start = a_whole_minute()
    # Given three entries every 4 s and no policy written for any: a guarded task's, one opted out with None,
    # and a plain Celery task's
    rig = Rig(
        tmp_path,
        entries={
            watched: entry(sink, schedule=4.0),
            opted: entry(sink, schedule=4.0),
            plain: {"task": "tests.proj.tasks.plain_add", "schedule": 4.0, "args": [1, 2]},
        },
        policies={opted: None},
        start=start,
    )
    rigs.append(rig)
    # And a worker (with its watchdog) and a guarded beat
    rig.worker()
    beat = rig.beat()
    rig.looking(beat, watched)
    # When a period comes due while beat runs
    first = start + 4
    rig.set_clock(first + 0.5)
    # Then it runs through the ledger, as with a policy
    rig.wait(f"{watched} ran {first}", lambda: _status(rig, watched, first) == OK)
    # And the opted-out entry runs as Celery runs it: on the real clock, every 4 s, with no period and no ledger
    rig.wait(f"{opted} ran by Celery", lambda: [item for item in sink.items() if item["schedule"] is None])
    # When beat stops and the clock passes three more periods, the last one 2.5 s late (the default grace of an
    # every-4-s entry is half its period: 2 s)
    beat.stop()
    periods = [first + 4 * k for k in (1, 2, 3)]
    rig.set_clock(periods[-1] + 2.5)
    # Then the watchdog records each of them missed, saying why
    for period in periods:
        run = rig.wait(f"{watched} {period} missed", lambda period=period: _missed(rig, watched, period))
        assert (run.task_id, run.reason) == ("", "not dispatched within 2s of its due time (is beat running?)")
    assert [(r.period, r.status) for r in rig.runs(watched)] == [(first, OK), *((p, MISSED) for p in periods)]
    # And beat said which entries it watches, with which policy, and which it leaves to Celery
    assert f"watched beat entries: {watched} (default policy)" in beat.log
    assert f"beat entries left to Celery (not watched): {opted}, {plain}" in beat.log
    # And neither the opted-out entry nor the plain task's entry has a ledger record
    assert rig.runs(opted) == rig.runs(plain) == []
    assert {item["schedule"] for item in sink.items()} == {watched, None}


@pytest.mark.parametrize("catch_up", ["latest", "all", None])
def test_beat_back_with_a_stale_and_a_current_period_runs_the_current_one(
    tmp_path: Path, rigs: list[Rig], sink: Sink, catch_up: str | None
) -> None:
    """``catch_up=None``: no policy written for the entry, so the default one applies (#30: overlap "skip",
    catch-up "latest", grace half of the minute): the rules the Quick start's entries get."""
    import redis

    name = f"every-minute-{catch_up or 'default'}-{uuid.uuid4().hex[:6]}"
    gate = f"gate-{name}"
    start = a_whole_minute() + 30
    # Given an every-minute entry with overlap "skip" (written, or the default policy's) whose runs each wait for
    # the test to open a gate, and a worker that runs two at once
    written = {} if catch_up is None else {name: {"catch_up": catch_up, "overlap": "skip", "grace": GRACE}}
    rig = Rig(
        tmp_path,
        entries={name: entry(sink, gate=gate)},
        policies=written,
        start=start,
        settings={"retry_later_delay": 0.5},
    )
    rigs.append(rig)
    client = redis.Redis.from_url(REDIS_URL)
    rig.worker(concurrency=2)
    beat = rig.beat()
    rig.looking(beat, name)
    if catch_up is None:
        assert f"watched beat entries: {name} (default policy)" in beat.log
    first = start + 30
    client.rpush(gate, "go")
    rig.set_clock(first + 1)
    rig.wait(f"{first} ran", lambda: _status(rig, name, first) == OK)
    # When beat stops for a period, and comes back 1 s into the next one: one stale period and one current
    beat.stop()
    stale, current = first + MINUTE, first + 2 * MINUTE
    rig.set_clock(current + 1)
    rig.looking(rig.beat(name="beat-again"), name)
    # And a run has taken the overlap slot and waits at the gate (the current one, or "all"'s catch-up)
    rig.wait("a run started", lambda: "running" in {_status(rig, name, p) for p in (stale, current)})
    client.rpush(gate, "go", "go")
    # Then the current period runs, never skipped as overlapping the stale run
    rig.wait(f"{current} ran", lambda: _status(rig, name, current) == OK)
    if catch_up in ("latest", None):
        # And "latest" (written, or the default) recorded the stale period missed: the current one is the latest
        assert _status(rig, name, stale) == MISSED
        assert periods_ran(sink, name) == [first, current]
    else:
        # And "all" ran the stale one too, as a catch-up the current run waited behind (had the current run
        # taken the slot first, the catch-up would be the one skipped: a stale run yields, never the current)
        rig.wait(f"{stale} decided", lambda: _status(rig, name, stale) in (OK, "skipped_overlap"))
        ran = [first, current] if _status(rig, name, stale) == "skipped_overlap" else [first, stale, current]
        assert sorted(periods_ran(sink, name)) == ran
    assert _status(rig, name, current) == OK
    client.delete(gate)
