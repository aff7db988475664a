"""The watchdog's check against both real stores, on a clock the test sets: missed periods, stuck
dispatches and overdue runs are recorded and reported once each, however many checks run."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery

from celery_guardrails import signals
from celery_guardrails.scheduling.beat import Entry
from celery_guardrails.scheduling.ledger import DISPATCHED, MISSED, OK, OVERDUE, RUNNING
from celery_guardrails.scheduling.policy import SchedulePolicy
from celery_guardrails.scheduling.watchdog import check, check_if_my_turn, lock_key
from tests.support.scheduling import Rig, a_whole_minute
from tests.support.services import REDIS_URL, require
from tests.support.workers import proj_env

pytestmark = pytest.mark.django_db(transaction=True)
T0 = 1_800_000_000.0  # a whole minute


@pytest.fixture(params=["redis", "django"])
def app(request: pytest.FixtureRequest) -> Any:
    if request.param == "redis":
        require("redis")
    app = Celery(f"watchdog-{request.param}", set_as_current=False)
    store = REDIS_URL if request.param == "redis" else "django"
    app.conf.guardrails = {"store": store, "alert_channels": ["log"]}
    return app


@pytest.fixture
def entry() -> Entry:
    policy = SchedulePolicy(grace=10, max_runtime=30)
    name = f"every-minute-{uuid.uuid4().hex[:8]}"
    return Entry(name=name, task="tests.proj.tasks.scheduled_job", schedule=60.0, policy=policy, zone=ZoneInfo("UTC"))


def statuses(app: Any, entry: Entry) -> dict[float, str]:
    from celery_guardrails.stores import get_store

    return {run.period - T0: run.status for run in get_store(app).run_list(entry.name)}


def test_missed_periods_are_recorded_and_reported_once(app: Any, entry: Entry, received: Any) -> None:
    from celery_guardrails.stores import get_store

    missed = received(signals.run_missed)
    store = get_store(app)
    entries = {entry.name: entry}
    # Given a schedule whose last period (T0) ran
    store.run_dispatch(entry.name, T0, task_id="t0", now=T0)
    store.run_finish(entry.name, T0, status=OK, now=T0 + 1)
    # When the watchdog checks within grace of the next period: nothing is late yet
    assert check(app, entries=entries, current=T0 + 60 + 10).missed == []
    # When it checks later, three periods past their grace (the fourth is not)
    findings = check(app, entries=entries, current=T0 + 240 + 5)
    # Then those three are recorded missed, and reported, once
    assert findings.missed == [(entry.name, T0 + 60), (entry.name, T0 + 120), (entry.name, T0 + 180)]
    assert statuses(app, entry) == {0: OK, 60: MISSED, 120: MISSED, 180: MISSED}
    assert check(app, entries=entries, current=T0 + 240 + 9).missed == []
    assert [(m["schedule"], m["period"].timestamp() - T0) for m in missed] == [
        (entry.name, 60),
        (entry.name, 120),
        (entry.name, 180),
    ]
    assert all(m["sender"] is app and "not dispatched within 10s" in m["reason"] for m in missed)


def test_a_dispatch_no_worker_started_is_missed_and_a_long_run_overdue(app: Any, entry: Entry, received: Any) -> None:
    from celery_guardrails.stores import get_store

    missed, overdue = received(signals.run_missed), received(signals.run_overdue)
    store = get_store(app)
    entries = {entry.name: entry}
    # Given period T0 started at T0+1, and period T0+60 dispatched but never started
    store.run_dispatch(entry.name, T0, task_id="slow", now=T0)
    store.run_start(entry.name, T0, task_id="slow", now=T0 + 1)
    store.run_dispatch(entry.name, T0 + 60, task_id="stuck", now=T0 + 60)
    # When the watchdog checks within grace and max_runtime: nothing
    assert check(app, entries=entries, current=T0 + 30).overdue == []
    assert statuses(app, entry) == {0: RUNNING, 60: DISPATCHED}
    # When it checks after both
    findings = check(app, entries=entries, current=T0 + 71)
    # Then the stuck dispatch is missed, the long run overdue, each reported once
    assert findings.missed == [(entry.name, T0 + 60)]
    assert findings.overdue == [(entry.name, T0)]
    assert check(app, entries=entries, current=T0 + 75).overdue == []
    assert statuses(app, entry) == {0: OVERDUE, 60: MISSED}
    assert [(m["task_id"], "not started within 10s" in m["reason"]) for m in missed] == [("stuck", True)]
    assert [(o["task_id"], o["started_at"].timestamp() - T0) for o in overdue] == [("slow", 1)]
    # And the overdue run still finishes normally
    store.run_finish(entry.name, T0, status=OK, now=T0 + 80)
    assert statuses(app, entry)[0] == OK


def test_a_late_catch_up_is_given_its_grace_from_its_dispatch_and_a_period_is_reported_missed_once(
    app: Any, entry: Entry, received: Any
) -> None:
    from celery_guardrails.stores import get_store

    missed = received(signals.run_missed)
    store = get_store(app)
    entries = {entry.name: entry}
    period = T0 + 60
    # Given a period the watchdog recorded missed (grace 10 s), and reported
    store.run_dispatch(entry.name, T0, task_id="t0", now=T0)
    store.run_finish(entry.name, T0, status=OK, now=T0 + 1)
    assert check(app, entries=entries, current=period + 15).missed == [(entry.name, period)]
    # When beat comes back and a catch-up dispatches it, long after its due time
    assert store.run_dispatch(entry.name, period, task_id="catch-up", now=period + 100)
    # Then a check within grace of that dispatch leaves it dispatched (the worker has not had its grace yet)
    assert (entry.name, period) not in check(app, entries=entries, current=period + 105).missed
    assert statuses(app, entry)[60] == DISPATCHED
    # When the catch-up is lost too (no worker starts it within grace of its dispatch)
    assert (entry.name, period) not in check(app, entries=entries, current=period + 111).missed
    # Then the record is missed again, with why, but the period is not reported a second time
    [run] = [r for r in get_store(app).run_list(entry.name) if r.period == period]
    assert (run.status, run.task_id, run.missed_at) == (MISSED, "catch-up", period + 15)
    assert "dispatched as catch-up but not started within 10s" in run.reason
    assert [m["period"].timestamp() for m in missed].count(period) == 1


def test_a_dispatch_never_started_is_reported_missed_once_by_racing_checks(
    app: Any, entry: Entry, received: Any
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from celery_guardrails.stores import get_store

    missed = received(signals.run_missed)
    store = get_store(app)
    # Given a period dispatched on time whose message no worker started
    store.run_dispatch(entry.name, T0, task_id="lost", now=T0)
    # When eight watchdogs check at once, past its grace
    with ThreadPoolExecutor(8) as pool:
        found = list(pool.map(lambda _: check(app, entries={entry.name: entry}, current=T0 + 11).missed, range(8)))
        if connection_close := getattr(store, "close_thread", None):
            pool.map(lambda _: connection_close(), range(8))
    # Then one of them moved it to missed and reported it
    assert sorted(map(len, found)) == [0] * 7 + [1]
    assert [m["task_id"] for m in missed] == ["lost"]


def test_a_schedule_with_no_record_is_not_checked(app: Any, entry: Entry) -> None:
    # Given a schedule beat has never dispatched
    # When the watchdog checks a day later, Then it records nothing (it cannot tell a new schedule from one
    # that never ran; beat's first dispatch starts the ledger)
    assert check(app, entries={entry.name: entry}, current=T0 + 86400).missed == []
    assert statuses(app, entry) == {}


def test_a_check_of_many_schedules_reads_the_ledger_once_for_all(
    app: Any, received: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from celery_guardrails.stores import get_store
    from django_celery_guardrails.store import ledger

    missed = received(signals.run_missed)
    store = get_store(app)
    # (The Django store reads the heads 500 schedules a query; read 50 a query here, so that three chunks need
    # 120 schedules, not 1,200: the ledger's set-up was most of the suite's longest test, 82 s.)
    monkeypatch.setattr(ledger, "HEADS_CHUNK", 50)
    # Given 120 guarded schedules whose period T0 + 60 ran, but for three whose message is stuck
    policy = SchedulePolicy(grace=10)
    run_id = uuid.uuid4().hex[:8]
    entries = {
        name: Entry(
            name=name, task="tests.proj.tasks.scheduled_job", schedule=60.0, policy=policy, zone=ZoneInfo("UTC")
        )
        for name in (f"many-{run_id}-{n:04d}" for n in range(120))
    }
    try:
        stuck = sorted(entries)[::50]
        for name in entries:
            store.run_dispatch(name, T0 + 60, task_id=f"t-{name}", now=T0 + 60)
            if name not in stuck:
                store.run_finish(name, T0 + 60, status=OK, now=T0 + 61)
        # When the watchdog checks after the stuck ones' grace, before the next period is due
        with CaptureQueriesContext(connection) as queries:
            findings = check(app, entries=entries, current=T0 + 75)
        # Then exactly the stuck ones are missed and reported
        assert findings.missed == [(name, T0 + 60) for name in stuck]
        assert sorted(m["schedule"] for m in missed) == stuck
        if app.conf.guardrails["store"] == "django":
            # And the Django ledger was read in six queries (two per chunk of schedules), not two per schedule
            # (the three moves to missed are UPDATEs)
            ledger = [q["sql"] for q in queries.captured_queries if 'FROM "guardrails_scheduledrun"' in q["sql"]]
            assert len([sql for sql in ledger if sql.startswith("SELECT")]) == 6, ledger
    finally:
        if app.conf.guardrails["store"] != "django":  # Redis keeps them; the database is flushed
            for key in store.client.scan_iter(match=f"guardrails:runs*:many-{run_id}-*", count=10_000):
                store.client.delete(key)


def test_one_watchdog_per_interval_in_the_cluster(app: Any) -> None:
    # Given a watchdog interval (no schedules: the check itself is empty)
    app.conf.guardrails = {**app.conf.guardrails, "watchdog_interval": 30.0}
    owners = [f"w{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    _forget_lock(app)  # a watchdog of an earlier test may hold it
    # When three workers try in the same interval, Then exactly one checks
    turns = [check_if_my_turn(app, owner=owner) for owner in owners]
    assert [turn is not None for turn in turns] == [True, False, False]


def _forget_lock(app: Any) -> None:
    from celery_guardrails.stores import get_store
    from celery_guardrails.stores.redis import IDEM_PREFIX, RedisStore

    store = get_store(app)
    if isinstance(store, RedisStore):
        store.client.delete(IDEM_PREFIX + lock_key(app))
    else:
        from django_celery_guardrails.models import IdempotencyKey

        IdempotencyKey.objects.filter(key=lock_key(app)).delete()


def test_apps_guarding_other_schedules_on_one_store_each_get_their_turn(app: Any) -> None:
    # Given two apps on one store, each guarding a schedule of its own, and a second worker of the first app
    def guarding(name: str) -> Any:
        other = Celery(f"watchdog-{uuid.uuid4().hex[:6]}", set_as_current=False)
        other.conf.beat_schedule = {name: {"task": "tests.proj.tasks.scheduled_job", "schedule": 60.0}}
        other.conf.guardrails = {**app.conf.guardrails, "schedules": {name: {}}, "watchdog_interval": 30.0}
        return other

    first, second = (f"job-{uuid.uuid4().hex[:8]}" for _ in range(2))
    apps = [guarding(first), guarding(second), guarding(first)]
    # When each checks in the same interval
    turns = [check_if_my_turn(a, owner=f"w{i}-{uuid.uuid4().hex[:6]}") for i, a in enumerate(apps)]
    # Then both apps checked their schedules, and the first app's second worker left it to its first
    assert [turn is not None for turn in turns] == [True, True, False]


def test_the_watchdog_thread_ends_with_its_worker(celery_app: Any) -> None:
    import threading

    from celery.contrib.testing.worker import start_worker

    def watchdogs() -> int:
        return sum(thread.name == "guardrails-watchdog" and thread.is_alive() for thread in threading.enumerate())

    before = watchdogs()
    # Given a worker started in this process (as tests and embedding projects do), When it stops, Then its
    # watchdog thread is gone: stale threads would go on checking and flushing for an app nobody uses
    for _ in range(2):
        with start_worker(celery_app, pool="solo", perform_ping_check=False):
            assert watchdogs() == before + 1
        assert watchdogs() == before


@pytest.mark.parametrize("store", ["redis", "django"])
def test_two_watchdogs_and_a_restarting_beat_race_on_the_same_missed_periods_one_alert_each(
    tmp_path: Path, rigs: list[Rig], webhook: tuple[str, list[dict[str, Any]]], store: str
) -> None:
    from celery_guardrails.stores import get_store

    url, posted = webhook
    uid = uuid.uuid4().hex[:6]
    names = [f"race-latest-{uid}", f"race-all-{uid}"]
    start = a_whole_minute() + 30
    # Every period alerts (run_alert_throttle 0): the test counts reports, one per period, through the alerts.
    settings: dict[str, Any] = {
        "alert_channels": ["webhook"],
        "alert_webhooks": [url],
        "watchdog": False,
        "run_alert_throttle": 0,
    }
    if store == "django":
        test_app = Celery("race", set_as_current=False)
        test_app.conf.guardrails = {"store": "django"}
        settings["store"] = "django"
    rig = Rig(
        tmp_path,
        entries={
            name: {"task": "tests.proj.tasks.scheduled_job", "schedule": 60.0, "kwargs": {"sink": "gr-test-unused"}}
            for name in names
        },
        policies={names[0]: {"catch_up": "latest", "grace": 20}, names[1]: {"catch_up": "all", "grace": 20}},
        start=start,
        settings=settings,
        store=get_store(test_app) if store == "django" else None,
    )
    if store == "django":  # the processes use this test's database
        rig.env.update(proj_env(queue=rig.queue, django=True))
    rigs.append(rig)
    # Given a beat that dispatched each entry's first period, no worker to run anything, and two watchdogs
    # checking over and over without taking turns
    first = start + 30
    beat = rig.beat(name="beat-0")
    rig.looking(beat, *names)
    rig.set_clock(first + 1)
    for name in names:
        rig.wait(f"{name} dispatched", lambda name=name: rig.run_of(name, first))
    rig.watchdog_loop(name="watchdog-a")
    rig.watchdog_loop(name="watchdog-b")
    # When, period after period, the clock passes a period's grace and beat is killed and started again
    # at once: its catch-up (record missed, dispatch late periods) races the watchdogs on the same periods,
    # and every catch-up it dispatches is lost again (no worker)
    periods = [first + 60.0 * k for k in range(1, 5)]
    for k, period in enumerate(periods, start=1):
        beat.kill()
        beat.wait(15)
        rig.set_clock(period + 25)
        beat = rig.beat(name=f"beat-{k}")
        rig.looking(beat, *names)
        rig.wait(
            f"beat-{k} caught up to {period}",
            lambda period=period: all((run := rig.run_of(name, period)) and run.task_id for name in names),
        )
    beat.kill()
    beat.wait(15)
    # And the clock passes one more period with beat down
    last = periods[-1] + 60.0
    rig.set_clock(last + 25)
    every = [first, *periods, last]

    def all_missed() -> bool:
        return all([r.period for r in rig.runs(name) if r.status == MISSED] == every for name in names)

    rig.wait("every period of both entries missed", all_missed)
    expected = Counter({(name, _iso(period)): 1 for name in names for period in every})
    rig.wait("an alert for each", lambda: set(_alerts(posted)) == set(expected))
    for loop in rig.processes:
        loop.stop()
    # Then every period of both entries was alerted exactly once, and says when it was first missed
    assert _alerts(posted) == expected
    assert all(r.missed_at is not None for name in names for r in rig.runs(name))


def _alerts(posted: list[dict[str, Any]]) -> Counter[tuple[str, str]]:
    return Counter((post["run"]["schedule"], post["run"]["period"]) for post in list(posted) if "run" in post)


def _iso(period: float) -> str:
    from datetime import UTC, datetime

    return str(datetime.fromtimestamp(period, UTC))


def test_a_beat_outage_of_ten_periods_alerts_once_then_sends_one_summary(
    app: Any, received: Any, webhook: tuple[str, list[dict[str, Any]]], mailoutbox: list[Any]
) -> None:
    from celery_guardrails.operations.alerts import flush_alert_summaries
    from celery_guardrails.stores import get_store
    from tests.support.waiting import wait_for

    url, posted = webhook
    clock = [T0]
    name = f"owned-every-minute-{uuid.uuid4().hex[:8]}"
    policy = SchedulePolicy(grace=10, owner="ops")
    entry = Entry(name=name, task="tests.proj.tasks.scheduled_job", schedule=60.0, policy=policy, zone=ZoneInfo("UTC"))
    app.conf.guardrails = {
        **app.conf.guardrails,
        "alert_channels": ["webhook", "mail"],
        "alert_webhooks": [url],
        "owner_emails": {"ops": ["ops@example.com"]},
        "clock": lambda: clock[0],
    }
    missed = received(signals.run_missed)
    store = get_store(app)
    # Given a schedule whose last period ran
    store.run_dispatch(entry.name, T0, task_id="t0", now=T0)
    store.run_finish(entry.name, T0, status=OK, now=T0 + 1)
    # When beat is down for ten periods, and the watchdog records each as it passes its grace
    periods = [T0 + 60 * k for k in range(1, 11)]
    for period in periods:
        clock[0] = period + 11
        check(app, entries={entry.name: entry}, current=clock[0])
    # Then each period is recorded and signalled missed once
    assert [call["period"].timestamp() for call in missed] == periods

    def mine() -> list[dict[str, Any]]:
        return [
            post
            for post in list(posted)
            if (post.get("run") or post.get("summary") or {}).get("schedule") == entry.name
        ]

    # And its owner got one alert, for the first period; the others are counted while the outage goes on
    wait_for("the first alert", mine)
    flush_alert_summaries(app)  # the window is still open (each period pushed its end): no summary yet
    # When the outage has been over for a window
    clock[0] = periods[-1] + 11 + 300 + 1
    flush_alert_summaries(app)
    # Then one summary counts the nine other periods: two posts in all
    wait_for("the summary", lambda: len(mine()) >= 2)
    first, summary = mine()
    assert first["run"]["period"] == _iso(periods[0]) and first["subject"].startswith("Run missed:")
    assert summary["summary"]["count"] == 9 and summary["subject"] == f"9 more missed run(s): {entry.name}"
    assert len(mine()) == 2
    # And the owner got two mails about it: the alert and the summary
    mails = wait_for(
        "two mails",
        lambda: (
            [m for m in mailoutbox if name in m.subject]
            if len([m for m in mailoutbox if name in m.subject]) >= 2
            else None
        ),
    )
    assert [m.to for m in mails] == [["ops@example.com"], ["ops@example.com"]]
    assert mails[1].subject == f"[guardrails] 9 more missed run(s): {name}"
