"""The watchdog's check against both real stores, on a clock the test sets: missed periods, stuck
dispatches and overdue runs are recorded and reported once each, however many checks run."""

from __future__ import annotations

import uuid
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery

from celery_guardrails import signals
from celery_guardrails.beat import Entry
from celery_guardrails.ledger import DISPATCHED, MISSED, OK, OVERDUE, RUNNING
from celery_guardrails.options import SchedulePolicy
from celery_guardrails.watchdog import check, check_if_my_turn, lock_key
from tests.support.services import REDIS_URL, require

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


def test_a_schedule_with_no_record_is_not_checked(app: Any, entry: Entry) -> None:
    # Given a schedule beat has never dispatched
    # When the watchdog checks a day later, Then it records nothing (it cannot tell a new schedule from one
    # that never ran; beat's first dispatch starts the ledger)
    assert check(app, entries={entry.name: entry}, current=T0 + 86400).missed == []
    assert statuses(app, entry) == {}


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
