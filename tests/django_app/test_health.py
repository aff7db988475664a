"""Schedule health: one line per guarded schedule from the run ledger, and the admin page that shows it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from celery_guardrails.scheduling.ledger import FAILED, MISSED, OK, OVERDUE, RUNNING
from django_celery_guardrails import health
from django_celery_guardrails.health import LastRecord, ScheduleHealth, schedule_health
from django_celery_guardrails.store import DjangoStore

pytestmark = pytest.mark.django_db(transaction=True)

T0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC, a whole minute
NOW = T0 + 600  # 08:10
MINUTE = 60.0
DAY = 86_400.0
HEALTH = "admin:guardrails_scheduledrun_health"
CHANGELIST = "admin:guardrails_scheduledrun_changelist"
STORE = DjangoStore()

# Every entry runs each minute with a policy of defaults (grace 30 s: half the period, overlap skip, catch-up
# latest), except:
POLICIES: dict[str, dict[str, Any]] = {
    "a ok": {},
    "b missed": {"owner": "ops"},
    "c failing": {"catch_up": "all"},
    "d overdue": {"max_runtime": 30},
    "e running": {"overlap": "allow"},
    "f never run": {"timezone": "Europe/Berlin", "grace": 300},
    "h silent": {},
}
CRONTABS = {"f never run": "30 2 * * *"}  # 02:30 in Berlin


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def make_app(policies: dict[str, dict[str, Any]] = POLICIES, *, store: str = "django") -> Celery:
    app = Celery("health", set_as_current=False)
    app.conf.guardrails = {"store": store, "schedules": policies, "alert_channels": ["log"]}
    app.conf.beat_schedule = {
        name: {"task": f"tasks.{name.split()[1]}", "schedule": CRONTABS.get(name, MINUTE)} for name in policies
    }
    return app


def ran(schedule: str, period: float, status: str = OK) -> None:
    """A period dispatched on time, started a second later and finished with ``status`` ten seconds later."""
    STORE.run_dispatch(schedule, period, task_id=f"{schedule}@{period:.0f}", now=period)
    STORE.run_start(schedule, period, task_id=f"{schedule}@{period:.0f}", now=period + 1)
    STORE.run_finish(schedule, period, status=status, now=period + 10)


def fill_ledger() -> None:
    """Each schedule of POLICIES in a different state, and one ("g gone") whose policy was removed."""
    ran("a ok", NOW - 2 * MINUTE)
    ran("a ok", NOW - MINUTE)
    ran("b missed", NOW - 2 * MINUTE)
    STORE.run_record("b missed", NOW - MINUTE, status=MISSED, now=NOW - 1, reason="beat was down")
    STORE.run_record("b missed", NOW - 8 * DAY, status=MISSED, now=NOW - 8 * DAY, reason="outside the window")
    ran("c failing", NOW - 3 * MINUTE)
    ran("c failing", NOW - 2 * MINUTE, FAILED)
    ran("c failing", NOW - MINUTE, FAILED)
    STORE.run_dispatch("d overdue", NOW - MINUTE, task_id="slow", now=NOW - MINUTE)
    STORE.run_start("d overdue", NOW - MINUTE, task_id="slow", now=NOW - MINUTE + 1)
    STORE.run_transition("d overdue", NOW - MINUTE, from_=(RUNNING,), to=OVERDUE, now=NOW - 10, reason="too long")
    ran("e running", NOW - 2 * MINUTE)
    STORE.run_dispatch("e running", NOW - MINUTE, task_id="now", now=NOW - MINUTE)
    STORE.run_start("e running", NOW - MINUTE, task_id="now", now=NOW - MINUTE + 1)
    ran("g gone", NOW - DAY)
    ran("h silent", T0)  # its newest record is 08:00; 08:01 .. 08:08 are more than grace late, with no record


@pytest.fixture
def ledger() -> None:
    fill_ledger()


def expected(schedule: str, **fields: Any) -> ScheduleHealth:
    """A guarded every-minute schedule with a policy of defaults, due next at 08:11; ``fields`` differ."""
    values: dict[str, Any] = {
        "schedule": schedule,
        "task": f"tasks.{schedule.split()[1]}",
        "timezone": "UTC",
        "owner": None,
        "default_policy": False,
        "overlap": "skip",
        "catch_up": "latest",
        "grace": 30.0,
        "max_runtime": None,
        "last_success": None,
        "last_record": None,
        "next_due": at(NOW + MINUTE),
        "missed_count": 0,
        "overdue_count": 0,
        "failed_count": 0,
        **fields,
    }
    return ScheduleHealth(**values)


def last(period: float, status: str) -> LastRecord:
    return LastRecord(period=at(period), status=status)


def test_one_line_per_schedule_in_each_state(ledger: None) -> None:
    # Given the ledger above and an app with a policy for every schedule but "g gone"
    # When the health is read at 08:10
    lines = schedule_health(make_app(), now=NOW)
    # Then every guarded schedule is listed by name, then the one without a policy, each in its own state
    assert lines == [
        expected(
            "a ok",
            last_success=at(NOW - MINUTE),
            last_record=last(NOW - MINUTE, OK),
            state="ok",
            detail="the run due 2027-01-15 08:09:00 UTC succeeded",
        ),
        expected(
            "b missed",
            owner="ops",
            last_success=at(NOW - 2 * MINUTE),
            last_record=last(NOW - MINUTE, MISSED),
            missed_count=1,  # the one 8 days ago is outside the window
            state="missed",
            detail="the run due 2027-01-15 08:09:00 UTC was missed",
        ),
        expected(
            "c failing",
            catch_up="all",
            last_success=at(NOW - 3 * MINUTE),
            last_record=last(NOW - MINUTE, FAILED),
            failed_count=2,
            state="failing",
            detail="the run due 2027-01-15 08:09:00 UTC failed",
        ),
        expected(
            "d overdue",
            max_runtime=30.0,
            last_record=last(NOW - MINUTE, OVERDUE),
            overdue_count=1,
            state="overdue",
            detail="1 run(s) past max_runtime still open",
        ),
        expected(
            "e running",
            overlap="allow",
            last_success=at(NOW - 2 * MINUTE),
            last_record=last(NOW - MINUTE, RUNNING),
            state="running",
            detail="1 run(s) dispatched or running",
        ),
        expected(
            "f never run",
            timezone="Europe/Berlin",
            grace=300.0,
            next_due=datetime(2027, 1, 16, 1, 30, tzinfo=UTC),  # 02:30 CET
            state="never run",
            detail="no record yet (beat has not dispatched it)",
        ),
        expected(
            "h silent",
            last_success=at(T0),
            last_record=last(T0, OK),
            state="missed",
            detail="no record of the run due 2027-01-15 08:01:00 UTC (are beat and the watchdog running?)",
        ),
        ScheduleHealth(
            schedule="g gone",
            task=None,
            timezone=None,
            owner=None,
            default_policy=False,
            overlap=None,
            catch_up=None,
            grace=None,
            max_runtime=None,
            last_success=at(NOW - DAY),
            last_record=last(NOW - DAY, OK),
            next_due=None,
            missed_count=0,
            overdue_count=0,
            failed_count=0,
            state="no policy",
            detail="the ledger has records of it, but it is no longer watched (opted out, or no such entry)",
        ),
    ]


def test_a_wider_window_counts_older_runs(ledger: None) -> None:
    # Given the ledger above, When the window is 30 days
    lines = {line.schedule: line for line in schedule_health(make_app(), now=NOW, window=timedelta(days=30))}
    # Then the missed run of 8 days ago counts too
    assert lines["b missed"].missed_count == 2


def test_without_now_the_clock_option_is_read(ledger: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an app whose clock option says 08:10
    app = make_app()
    app.conf.guardrails = {**app.conf.guardrails, "clock": lambda: NOW}
    # When the health is read without now, Then it is the health at 08:10
    assert schedule_health(app) == schedule_health(make_app(), now=NOW)


def test_the_number_of_queries_does_not_grow_with_schedules() -> None:
    # Given two guarded schedules with a few records each, and an app
    few = {f"s{i:02d} job": {} for i in range(2)}
    many = {f"s{i:02d} job": {} for i in range(12)}
    for name in many:
        ran(name, NOW - 2 * MINUTE)
        ran(name, NOW - MINUTE, FAILED)
    # When the health of 2 and of 12 schedules (and 10 without policy) is read
    with CaptureQueriesContext(connection) as two:
        assert len(schedule_health(make_app(few), now=NOW)) == 12
    with CaptureQueriesContext(connection) as twelve:
        lines = schedule_health(make_app(many), now=NOW)
    # Then both take the same two queries: the ledger's, and django-celery-beat's rows (every row is watched)
    assert len(two) == len(twelve) == 2
    assert {line.state for line in lines} == {"failing"} and {line.failed_count for line in lines} == {1}


def test_no_policy_and_an_empty_ledger() -> None:
    # Given an app with no schedules setting and an empty ledger, When the health is read, Then it is empty
    assert schedule_health(make_app({}), now=NOW) == []


# The admin page.


def use_app(monkeypatch: pytest.MonkeyPatch) -> Celery:
    """Make the admin page read policies from an app like make_app()'s, at 08:10 (in a project: the current
    app, at the clock option's time)."""
    celery = make_app()
    celery.conf.guardrails = {**celery.conf.guardrails, "clock": lambda: NOW}
    monkeypatch.setattr(health, "celery_app", lambda: celery)
    return celery


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Celery:
    return use_app(monkeypatch)


def test_the_admin_page_shows_each_state_and_links_to_the_ledger(
    admin_client: Client, app: Celery, ledger: None
) -> None:
    # Given the ledger above, When an admin opens the schedule-health page
    page = admin_client.get(reverse(HEALTH))
    # Then it lists every schedule with its state as a word, linked to its records in the change list
    assert page.status_code == 200
    html = page.content.decode()
    assert [item.schedule for item, _ in page.context["rows"]] == [*POLICIES, "g gone"]
    for item, url in page.context["rows"]:
        assert url == f"{reverse(CHANGELIST)}?schedule={item.schedule.replace(' ', '+')}"
        assert f'<a href="{url}" class="ledger-link">{item.schedule}</a>' in html
        assert f'<span class="health-state state-{item.state.replace(" ", "-")}" title="{item.detail}">' in html
        assert f">{item.state}</span>" in html
    # with the next due time in UTC and in the schedule's zone, and its policy
    assert "2027-01-16 01:30:00<span" in html and "2027-01-16 02:30:00 CET (Europe/Berlin)" in html
    assert "overlap skip, catch-up latest, grace 30s, max runtime 30s" in html
    assert "Schedule health" in html and 'class="breadcrumbs"' in html
    # and a schedule's link lists that schedule's records
    item, url = page.context["rows"][0]
    records = admin_client.get(url).context["cl"].result_list
    assert {record.schedule for record in records} == {"a ok"} and len(records) == 2


def test_the_change_list_links_to_the_page(admin_client: Client, app: Celery) -> None:
    # Given an admin, When they open the run ledger, Then it links to the schedule-health page
    page = admin_client.get(reverse(CHANGELIST))
    assert f'<a href="{reverse(HEALTH)}" class="health-link">Schedule health</a>' in page.content.decode()


def test_staff_without_the_view_permission_get_403(client: Client, app: Celery) -> None:
    # Given a staff user without permissions on the run ledger
    user = User.objects.create_user("staff", password="pw", is_staff=True)
    client.force_login(user)
    # When they open the page, Then it is refused
    assert client.get(reverse(HEALTH)).status_code == 403
    # When they are given the view permission, Then they see it
    user.user_permissions.add(Permission.objects.get(codename="view_scheduledrun"))
    user = User.objects.get(pk=user.pk)  # no cached permissions
    client.force_login(user)
    assert client.get(reverse(HEALTH)).status_code == 200


def test_an_anonymous_visitor_is_sent_to_log_in(client: Client, app: Celery) -> None:
    page = client.get(reverse(HEALTH))
    assert page.status_code == 302 and "/login/" in page["Location"]


def test_a_bad_schedules_setting_is_shown(admin_client: Client, app: Celery) -> None:
    # Given a policy for a beat entry that does not exist
    app.conf.guardrails = {**app.conf.guardrails, "schedules": {**POLICIES, "nowhere": {}}}
    # When an admin opens the page, Then it says what is wrong instead of failing
    page = admin_client.get(reverse(HEALTH))
    assert page.status_code == 200
    assert "policy for &#x27;nowhere&#x27;, but there is no such beat entry" in page.content.decode()


def test_a_ledger_kept_in_redis_is_pointed_out(admin_client: Client, app: Celery) -> None:
    # Given an app whose store is Redis, When an admin opens the page, Then it says the ledger is not shown
    app.conf.guardrails = {**app.conf.guardrails, "store": "redis://127.0.0.1:6379/15"}
    page = admin_client.get(reverse(HEALTH))
    assert page.status_code == 200 and b'id="health-other-store"' in page.content
    assert b"6379" not in page.content  # no store URL (it may hold a password) on the page


def test_a_disabled_row_shows_disabled_and_a_finished_overdue_run_stays_counted() -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    # Given a django-celery-beat row with a policy, disabled, and a schedule whose run went overdue, then finished
    every = IntervalSchedule.objects.create(every=60, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="nightly row", task="tasks.nightly", interval=every, enabled=False)
    ran("nightly row", NOW - 5 * MINUTE)
    STORE.run_dispatch("d overdue", NOW - MINUTE, task_id="slow", now=NOW - MINUTE)
    STORE.run_start("d overdue", NOW - MINUTE, task_id="slow", now=NOW - MINUTE + 1)
    STORE.run_transition("d overdue", NOW - MINUTE, from_=(RUNNING,), to=OVERDUE, now=NOW - 20, reason="too long")
    STORE.run_finish("d overdue", NOW - MINUTE, status=OK, now=NOW - 5)
    app = make_app({"nightly row": {}, "d overdue": {"max_runtime": 30}})
    app.conf.beat_schedule = {"d overdue": {"task": "tasks.overdue", "schedule": MINUTE}}
    # When the health is read
    rows = {row.schedule: row for row in schedule_health(app, now=NOW)}
    # Then the disabled row says so (not "no policy"), with no next due time
    assert (rows["nightly row"].state, rows["nightly row"].next_due) == ("disabled", None)
    assert "disabled" in rows["nightly row"].detail
    # And the run that was overdue is ok now, still counted overdue, its reason saying it was
    assert (rows["d overdue"].state, rows["d overdue"].overdue_count) == ("ok", 1)
    (run,) = STORE.run_list("d overdue")
    assert run.reason == "finished after being overdue: too long" and run.overdue_at == NOW - 20
    # And a finish delivered twice does not say it twice
    STORE.run_finish("d overdue", NOW - MINUTE, status=OK, now=NOW - 4)
    assert STORE.run_list("d overdue")[0].reason == "finished after being overdue: too long"


def test_entries_and_rows_without_a_policy_are_listed_with_the_default_policy(
    admin_client: Client, app: Celery
) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    # Given a settings entry every minute and a django-celery-beat row every 4 s, no policy written for either, and
    # a row opted out with None (whose ledger has a record from before)
    app.conf.guardrails = {**app.conf.guardrails, "schedules": {"z opted out": None}}
    app.conf.beat_schedule = {"x settings": {"task": "tasks.x", "schedule": MINUTE}}
    every = IntervalSchedule.objects.create(every=4, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="y row", task="tasks.y", interval=every)
    PeriodicTask.objects.create(name="z opted out", task="tasks.z", interval=every)
    ran("z opted out", NOW - MINUTE)
    # When the health is read
    lines = {line.schedule: line for line in schedule_health(app, now=NOW)}
    # Then both are listed with the default policy (grace: 60 s or half the period), never run yet; the opted-out
    # row is not watched (its old records: "no policy")
    assert {name: (line.default_policy, line.grace, line.state) for name, line in lines.items()} == {
        "x settings": (True, 30.0, "never run"),
        "y row": (True, 2.0, "never run"),
        "z opted out": (False, None, "no policy"),
    }
    # And the admin page shows their policy as "default"
    html = admin_client.get(reverse(HEALTH)).content.decode()
    assert "default: overlap skip, catch-up latest, grace 30s, max runtime none" in html
    assert "default: overlap skip, catch-up latest, grace 2s, max runtime none" in html
