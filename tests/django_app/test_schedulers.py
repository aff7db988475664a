"""django-celery-beat rows with a policy, dispatched by a real ``celery beat`` running the guarded
DatabaseScheduler against the test database, and the ``guardrails_watchdog`` command."""

from __future__ import annotations

import json
import uuid
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

from celery_guardrails.scheduling.ledger import MISSED, OK
from django_celery_guardrails.store import DjangoStore
from tests.celery_guardrails.guardrails.test_scheduled_runs import Gated, overlap_skip_outlives_the_lease
from tests.conftest import Sink
from tests.support.proxy import TcpProxy
from tests.support.scheduling import Rig, a_whole_minute
from tests.support.services import require
from tests.support.workers import proj_env

pytestmark = pytest.mark.django_db(transaction=True)
TASK = "tests.proj.tasks.scheduled_job"
SCHEDULER = "django_celery_guardrails.schedulers:GuardedDatabaseScheduler"


def database_rig(tmp_path: Path, policies: dict[str, Any], settings: dict[str, Any] | None = None) -> Rig:
    rig = Rig(tmp_path, entries={}, policies=policies, settings=settings)
    # The beat and worker subprocesses run with the test Django settings, on this test's database.
    rig.env.update(proj_env(queue=rig.queue, django=True))
    return rig


def periodic_task(name: str, sink: Sink, **schedule: Any) -> PeriodicTask:
    return PeriodicTask.objects.create(name=name, task=TASK, kwargs=json.dumps({"sink": sink.key}), **schedule)


@pytest.mark.smoke
def test_periodic_task_rows_with_a_policy_run_once_per_period(tmp_path: Path, sink: Sink) -> None:
    require("redis")
    name = f"db every 10s {uuid.uuid4().hex[:6]}"
    # Given a django-celery-beat row every 10 (clock) seconds, with a policy, and a plain row without one
    every = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.SECONDS)
    periodic_task(name, sink, interval=every)
    rig = database_rig(tmp_path, {name: {"grace": 30}})
    try:
        rig.worker()
        # When two guarded database schedulers run side by side, and the clock passes six periods
        for beat in (rig.beat(name="beat-one", scheduler=SCHEDULER), rig.beat(name="beat-two", scheduler=SCHEDULER)):
            rig.looking(beat, name)
        due = [rig.now() + 10.0 * k for k in range(1, 7)]
        for period in due:
            rig.set_clock(period + 1)
            rig.wait(f"{period} ran", lambda period=period: (run := rig.run_of(name, period)) and run.status == OK)
    finally:
        rig.stop()
    # Then each period ran once, through the ledger, in order
    periods = [item["period"] for item in sink.items()]
    assert periods == due
    assert {item["period_key"].split("@")[0] for item in sink.items()} == {name.replace(" ", "%20")}
    # And django-celery-beat's own bookkeeping of the row counts each dispatch once
    row = PeriodicTask.objects.get(name=name)
    assert row.total_run_count == len(rig.runs(name))
    assert row.last_run_at is not None


def test_a_policy_for_a_row_whose_crontab_does_not_parse_stops_beat(tmp_path: Path, sink: Sink) -> None:
    require("redis")
    name = f"broken {uuid.uuid4().hex[:6]}"
    # Given a row whose crontab was saved with a minute out of range (the admin would refuse it; SQL did not)
    broken = CrontabSchedule.objects.create(minute="75", hour="*", timezone="Europe/Berlin")
    periodic_task(name, sink, crontab=broken)
    rig = database_rig(tmp_path, {name: {"grace": 30}})
    # When beat starts, Then it exits with an error naming the entry
    beat = rig.beat(scheduler=SCHEDULER)
    try:
        assert beat.wait(timeout=60) != 0
    finally:
        rig.stop()
    assert f"beat entry {name!r}" in beat.log
    assert "does not parse" in beat.log


def test_the_watchdog_command_records_missed_runs_of_rows(settings: Any, sink: Sink) -> None:
    require("redis")
    from celery import current_app

    name = f"db nightly {uuid.uuid4().hex[:6]}"
    # Given a row every minute with a policy, whose last period ran an hour ago
    every = IntervalSchedule.objects.create(every=60, period=IntervalSchedule.SECONDS)
    periodic_task(name, sink, interval=every)
    app = current_app._get_current_object()
    before = app.conf.guardrails
    current = a_whole_minute() + 30
    app.conf.guardrails = {
        **(before or {}),
        "schedules": {name: {"grace": 60}},
        "alert_channels": ["log"],
        "clock": lambda: current,
    }
    try:
        _watch(app, name, current)
    finally:
        app.conf.guardrails = before


def _watch(app: Any, name: str, current: float) -> None:
    from celery_guardrails.stores import get_store

    store = get_store(app)
    last = current - 30 - 3600
    store.run_dispatch(name, last, task_id="t", now=last)
    store.run_finish(name, last, status=OK, now=last + 1)
    # When the command runs, half a minute into the next
    out = StringIO()
    call_command("guardrails_watchdog", stdout=out)
    # Then every minute since, but the last one (within grace), is recorded missed and printed
    missed = [r.period for r in store.run_list(name, limit=100) if r.status == MISSED]
    assert sorted(missed) == [last + 60 * k for k in range(1, 60)]
    assert out.getvalue().count("missed: ") == 59
    assert "Recorded 59 missed and 0 overdue run(s)." in out.getvalue()


def test_overlap_skip_holds_the_slot_for_a_run_longer_than_its_lease(
    tmp_path: Path, rigs: list[Rig], sink: Sink
) -> None:
    job = Gated(tmp_path, rigs, sink, overlap="skip", django=True, idempotency_lease=1.5)
    overlap_skip_outlives_the_lease(job, 1.5)


def test_beat_keeps_running_through_a_database_outage_and_catches_up(
    tmp_path: Path, rigs: list[Rig], sink: Sink
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("needs a database server to take away (runs in the PostgreSQL pass)")
    require("redis")
    name = f"db every minute {uuid.uuid4().hex[:6]}"
    every = IntervalSchedule.objects.create(every=60, period=IntervalSchedule.SECONDS)
    periodic_task(name, sink, interval=every)
    start = a_whole_minute() + 30
    rig = Rig(
        tmp_path,
        entries={},
        policies={name: {"grace": 20, "catch_up": "latest"}},
        start=start,
        settings={"store": "django"},
        store=DjangoStore(),
    )
    rig.env.update(proj_env(queue=rig.queue, django=True))
    rigs.append(rig)
    proxy = TcpProxy(5432)
    try:
        # Given a guarded database scheduler whose database connection goes through a proxy, and a worker
        rig.worker()
        rig.env["GUARDRAILS_TEST_DB_PORT"] = str(proxy.port)
        beat = rig.beat(scheduler=SCHEDULER)
        rig.looking(beat, name)
        first = start + 30
        rig.set_clock(first + 1)
        rig.wait(f"{first} ran", lambda: (run := rig.run_of(name, first)) and run.status == OK)
        # When the database goes away from beat while the next period comes and goes past its grace
        proxy.cut()
        late = first + 60
        rig.set_clock(late + 25)
        rig.wait("beat's ticks failing", lambda: beat.log.count("database") >= 2 or "tick failed" in beat.log)
        proxy.restore()
        # Then beat is still running, and once the database is back the late period runs (catch_up="latest"),
        # once
        rig.wait(f"{late} ran", lambda: (run := rig.run_of(name, late)) and run.status == OK)
        assert beat.process is not None and beat.process.poll() is None
    finally:
        rig.stop()
        proxy.close()
    assert [item["period"] for item in sink.items()] == [first, late]


def test_a_schedule_disabled_for_ten_minutes_and_enabled_again_owes_nothing_for_that_time(
    tmp_path: Path, sink: Sink, webhook: tuple[str, list[dict[str, Any]]]
) -> None:
    from django.contrib.auth.models import User
    from django.test import Client
    from django.urls import reverse

    from celery_guardrails.scheduling.ledger import SKIPPED_DISABLED

    require("redis")
    url, posted = webhook
    name = f"db every minute {uuid.uuid4().hex[:6]}"
    every = IntervalSchedule.objects.create(every=60, period=IntervalSchedule.SECONDS)
    row = periodic_task(name, sink, interval=every)
    admin = Client()
    admin.force_login(User.objects.create_superuser("ops", "ops@example.com", "pw"))
    changelist = reverse("admin:django_celery_beat_periodictask_changelist")
    settings = {"alert_channels": ["webhook"], "alert_webhooks": [url]}
    rig = database_rig(tmp_path, {name: {"grace": 20}}, settings)
    try:
        # Given a guarded row every minute that has run, a beat and a worker (with its watchdog)
        rig.worker()
        rig.looking(rig.beat(scheduler=SCHEDULER), name)
        first = rig.now() + 60
        rig.set_clock(first + 1)
        rig.wait("the first run", lambda: (run := rig.run_of(name, first)) and run.status == OK)
        # When an operator disables it in django-celery-beat's admin (its action is an UPDATE: no save signal)
        admin.post(changelist, {"action": "disable_tasks", "_selected_action": [row.pk]})
        assert not PeriodicTask.objects.get(pk=row.pk).enabled
        # and ten minutes pass, each period past its grace
        disabled = [first + 60.0 * k for k in range(1, 11)]
        for period in disabled:
            rig.set_clock(period + 21)
            rig.wait(
                f"{period} skipped",
                lambda period=period: (run := rig.run_of(name, period)) and run.status == SKIPPED_DISABLED,
            )
        # and enables it again
        admin.post(changelist, {"action": "enable_tasks", "_selected_action": [row.pk]})
        assert PeriodicTask.objects.get(pk=row.pk).enabled
        # Then it goes on from the next period
        resumed = disabled[-1] + 60
        rig.set_clock(resumed + 1)
        rig.wait("the run after", lambda: (run := rig.run_of(name, resumed)) and run.status == OK)
    finally:
        rig.stop()
    statuses = {run.period: run.status for run in rig.runs(name)}
    assert statuses == {first: OK, **{period: SKIPPED_DISABLED for period in disabled}, resumed: OK}
    assert [item["period"] for item in sink.items()] == [first, resumed]
    # And nobody was alerted of a missed run of it (the worker's watchdog also sends what other tests left due in
    # the shared store, dead-letter summaries: not this schedule's)
    about = [
        post
        for post in posted
        if name in ((post.get("run") or {}).get("schedule"), (post.get("summary") or {}).get("schedule"))
    ]
    assert about == []


def test_a_row_carries_its_tenant_in_its_headers_and_a_policy_names_one_for_its_entry(
    tmp_path: Path, sink: Sink
) -> None:
    require("redis")
    uid = uuid.uuid4().hex[:6]
    guarded, plain, by_policy = f"acme nightly {uid}", f"globex plain {uid}", f"initech by policy {uid}"
    # Given a guarded row whose headers name its tenant, a row opted out of the guardrails that does the same
    # (every second, on Celery's own clock), and a guarded row whose policy names the tenant
    every_minute = IntervalSchedule.objects.create(every=60, period=IntervalSchedule.SECONDS)
    every_second = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    periodic_task(guarded, sink, interval=every_minute, headers=json.dumps({"tenant": "acme"}))
    periodic_task(plain, sink, interval=every_second, headers=json.dumps({"tenant": "globex"}))
    periodic_task(by_policy, sink, interval=every_minute)
    policies = {guarded: {"grace": 30}, by_policy: {"grace": 30, "tenant": "initech"}, plain: None}
    rig = database_rig(tmp_path, policies)
    try:
        rig.worker()
        rig.looking(rig.beat(scheduler=SCHEDULER), guarded, by_policy)
        # When their periods come due
        due = rig.now() + 60
        rig.set_clock(due + 1)

        def tenants() -> dict[str, str] | None:
            seen = {item["schedule"] or "plain": item["tenant"] for item in sink.items()}
            return seen if len(seen) == 3 else None

        # Then each run carried its tenant
        assert rig.wait("a run of each", tenants) == {guarded: "acme", "plain": "globex", by_policy: "initech"}
    finally:
        rig.stop()


def test_a_bad_tenant_of_an_entry_is_refused_naming_it() -> None:
    from celery import Celery

    from celery_guardrails.exceptions import ConfigurationError
    from celery_guardrails.scheduling.beat import build_entries

    app = Celery("bad-tenant", set_as_current=False)
    app.conf.guardrails = {"schedules": {"nightly": {}}}
    for options in ({"tenant": "a/b"}, {"headers": {"tenant": ""}}):
        with pytest.raises(ConfigurationError, match="beat entry 'nightly': its tenant: tenant id"):
            build_entries(app, {"nightly": {"task": TASK, "schedule": 60.0, "options": options}})
    with pytest.raises(ConfigurationError, match="'schedules'"):
        app.conf.guardrails = {"schedules": {"nightly": {"tenant": "a b"}}}
        build_entries(app, {"nightly": {"task": TASK, "schedule": 60.0}})


def test_many_rows_are_read_as_django_celery_beat_reads_them_in_a_few_queries() -> None:
    from django.test.utils import CaptureQueriesContext
    from django_celery_beat.schedulers import ModelEntry

    from django_celery_guardrails.schedulers import Unparsable, periodic_task_rows

    # Given 300 rows sharing one crontab and one interval, with options and headers, one disabled, and a row
    # whose arguments are not JSON
    hourly = CrontabSchedule.objects.create(minute="5", hour="*", timezone="Europe/Berlin")
    every = IntervalSchedule.objects.create(every=90, period=IntervalSchedule.SECONDS)
    rows = PeriodicTask.objects.bulk_create(
        PeriodicTask(
            name=f"many-{n:03d}",
            task=TASK,
            crontab=hourly if n % 2 else None,
            interval=None if n % 2 else every,
            args=json.dumps([n]),
            kwargs=json.dumps({"n": n}),
            queue="reports" if n % 3 else None,
            priority=n % 10 or None,
            expire_seconds=600 if n % 5 == 0 else None,
            headers=json.dumps({"tenant": f"t{n % 7}"}),
            enabled=n != 7,
        )
        for n in range(300)
    )
    PeriodicTask.objects.create(name="many-bad", task=TASK, interval=every, args="[1,")
    # When they are read
    with CaptureQueriesContext(connection) as queries:
        enabled, disabled, names = periodic_task_rows(names=[row.name for row in rows] + ["many-bad", "many-gone"])
    # Then in three queries (the rows, their crontabs, their intervals)
    assert len(queries.captured_queries) == 3, [q["sql"] for q in queries.captured_queries]
    # And each entry is what django-celery-beat's own ModelEntry makes of its row
    assert names == {row.name for row in rows} | {"many-bad"} and list(disabled) == ["many-007"]
    for row in PeriodicTask.objects.filter(name__startswith="many-").exclude(name="many-bad"):
        entry, reference = (enabled | disabled)[row.name], ModelEntry(row)
        assert (entry["task"], entry["args"], entry["kwargs"]) == (reference.task, reference.args, reference.kwargs)
        assert entry["options"] == reference.options, row.name
        assert entry["schedule"] == reference.schedule and entry["schedule"].tz == reference.schedule.tz
    # And the row whose arguments are not JSON stands for its error
    assert isinstance(enabled["many-bad"]["schedule"], Unparsable)
    assert "not JSON" in enabled["many-bad"]["schedule"].error


def test_a_settings_entry_and_a_row_without_a_policy_are_watched_and_their_missed_runs_reported(
    tmp_path: Path, sink: Sink
) -> None:
    import os
    import subprocess
    import sys

    from celery_guardrails.log import moment_text

    require("redis")
    uid = uuid.uuid4().hex[:6]
    setting, row, opted = f"settings every 4s {uid}", f"row every 4s {uid}", f"row opted out {uid}"
    # Given a CELERY_BEAT_SCHEDULE entry and a django-celery-beat row, each every 4 s with no policy written, and
    # a row opted out with None
    every = IntervalSchedule.objects.create(every=4, period=IntervalSchedule.SECONDS)
    periodic_task(row, sink, interval=every)
    periodic_task(opted, sink, interval=every)
    start = a_whole_minute()
    rig = Rig(
        tmp_path,
        entries={setting: {"task": TASK, "schedule": 4.0, "kwargs": {"sink": sink.key}}},
        policies={opted: None},
        start=start,
        settings={"watchdog": False},  # the command below is the watchdog
    )
    rig.env.update(proj_env(queue=rig.queue, django=True))
    try:
        # And a worker and a guarded database scheduler
        rig.worker()
        beat = rig.beat(scheduler=SCHEDULER)
        rig.looking(beat, setting, row)
        # When a period comes due while beat runs, then beat stops and three more pass, the last 2.5 s late (the
        # default grace of an every-4-s entry: 2 s)
        first = start + 4
        rig.set_clock(first + 0.5)
        for name in (setting, row):
            rig.wait(f"{name} ran", lambda name=name: (run := rig.run_of(name, first)) and run.status == OK)
        beat.stop()
        periods = [first + 4 * k for k in (1, 2, 3)]
        rig.set_clock(periods[-1] + 2.5)
        # And `manage.py guardrails_watchdog` runs
        script = (
            "import django; django.setup(); from tests.proj.app import app; "
            "from django.core.management import call_command; call_command('guardrails_watchdog')"
        )
        done = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), **rig.env},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        rig.stop()
    # Then it prints each missed period of both, by name, and records it
    assert done.returncode == 0, done.stderr
    printed = [line for line in done.stdout.splitlines() if line.startswith("missed: ")]
    assert sorted(printed) == sorted(
        f"missed: {name} {moment_text(period)}" for name in (setting, row) for period in periods
    )
    for name in (setting, row):
        assert [(r.period, r.status) for r in rig.runs(name)] == [(first, OK), *((p, MISSED) for p in periods)]
    # And beat named both as watched with the default policy; the opted-out row has no ledger
    assert f"{row} (default policy)" in beat.log and f"{setting} (default policy)" in beat.log
    assert rig.runs(opted) == []
