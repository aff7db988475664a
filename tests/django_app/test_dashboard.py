"""The admin dashboard: the numbers of the status command, and dead letters per hour by reason over 24 hours."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import OutcomeCount, QueueSample
from django_celery_guardrails import health
from django_celery_guardrails.dashboard import OTHER, chart, dead_letters_by_reason
from django_celery_guardrails.models import DeadLetter
from tests.support.services import BROKER_URLS

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 30, 12, 30, tzinfo=UTC)
DASHBOARD = "admin:guardrails_dashboard_changelist"


def letter(reason: str, at: datetime, *, owner: str = "payments") -> DeadLetter:
    return DeadLetter.objects.create(
        task_name="shop.tasks.charge",
        task_id=uuid.uuid4().hex,
        reason=reason,
        owner=owner,
        first_failed_at=at,
        last_failed_at=at,
    )


def test_dead_letters_per_hour_by_reason_the_five_most_frequent_and_the_rest_as_other() -> None:
    # Given dead letters of seven reasons in the hour before this one (7 of a, 6 of b, ... 1 of g), one of a in
    # this hour, and one 25 hours ago
    for count, reason in zip(range(7, 0, -1), "abcdefg", strict=True):
        for _ in range(count):
            letter(reason, NOW - timedelta(hours=1))
    letter("a", NOW - timedelta(minutes=20))
    letter("a", NOW - timedelta(hours=25))
    # When the last 24 hours are counted
    hours = dead_letters_by_reason(now=NOW)
    # Then the five most frequent reasons are kept, the others are "other"; the old one is out of the window
    assert hours.reasons == ["a", "b", "c", "d", "e", OTHER]
    assert hours.counts[-1] == {"a": 1}
    assert hours.counts[-2] == {"a": 7, "b": 6, "c": 5, "d": 4, "e": 3, OTHER: 3}
    assert [hour for hour in hours.counts[:-2] if hour] == []
    assert hours.total == 29 and len(hours.starts) == 24
    assert hours.starts[-1] == NOW.replace(minute=0)
    # and the chart draws one bar segment per hour and reason, with its count
    svg = chart(hours)
    assert svg.count("data-series=") == 7
    assert 'data-series="other" data-value="3"' in svg


def test_a_reason_is_escaped_in_the_chart() -> None:
    # Given a dead letter whose reason holds markup, When the chart is drawn, Then the markup is text
    letter("<script>x</script>", NOW - timedelta(hours=2))
    svg = chart(dead_letters_by_reason(now=NOW))
    assert "<script>" not in svg and "&lt;script&gt;" in svg


@pytest.fixture
def celery_app(monkeypatch: pytest.MonkeyPatch, queue_name: str) -> Celery:
    """The app the admin reads: the test Redis broker, one queue, the Django store and sink."""
    app = Celery("dashboard", broker=BROKER_URLS["redis"], set_as_current=False)
    app.conf.task_default_queue = queue_name
    app.conf.guardrails = {"store": "django", "dead_letter_sinks": ["django"], "alert_channels": ["log"]}
    monkeypatch.setattr(health, "celery_app", lambda: app)
    return app


def test_the_dashboard_is_listed_on_the_admin_index_and_shows_the_numbers(
    admin_client: Client, celery_app: Any
) -> None:
    # Given an open dead letter owned by payments
    letter("permanent", datetime.now(UTC) - timedelta(minutes=5))
    # When an admin opens the index, Then the dashboard is listed with the app's models
    assert reverse(DASHBOARD) in admin_client.get(reverse("admin:index")).content.decode()
    # and the dashboard shows the queue, the open dead letter by owner and the chart
    page = admin_client.get(reverse(DASHBOARD))
    assert page.status_code == 200
    text = page.content.decode()
    assert celery_app.conf.task_default_queue in text
    assert '<td>payments</td><td class="number">1</td>' in text
    assert 'id="dl-reasons-chart"' in text and 'data-series="permanent"' in text


def test_staff_without_the_dead_letter_view_permission_do_not_see_it(celery_app: Any) -> None:
    # Given a staff user without, then with, the permission to view dead letters
    user = User.objects.create_user("staff", password="x", is_staff=True)
    client = Client()
    client.force_login(user)
    # Then without it the page is refused and not listed; with it, it is shown
    assert client.get(reverse(DASHBOARD)).status_code == 403
    assert reverse(DASHBOARD) not in client.get(reverse("admin:index")).content.decode()
    user.user_permissions.add(Permission.objects.get(codename="view_deadletter"))
    client.force_login(User.objects.get(pk=user.pk))
    assert client.get(reverse(DASHBOARD)).status_code == 200


def chart_after(text: str, title: str) -> str:
    """The SVG chart that follows ``title`` in the page."""
    start = text.index("<svg", text.index(title))
    return text[start : text.index("</svg>", start)]


def test_outcomes_per_task_and_queue_age_per_hour_from_the_activity(admin_client: Client, celery_app: Any) -> None:
    # Given the activity the workers kept in the Django store: a task's outcomes in two hours and another task's
    # in one, and a queue sampled in two hours (one sample with no known age)
    store = get_store(celery_app)
    now = datetime.now(UTC)
    this_hour = now.replace(minute=0, second=0, microsecond=0).timestamp()
    queue = celery_app.conf.task_default_queue
    store.activity_add(
        [
            OutcomeCount(minute=this_hour - 3600, task="shop.charge", queue=queue, outcome="succeeded", count=40),
            OutcomeCount(minute=this_hour - 3600, task="shop.charge", queue=queue, outcome="dead_lettered", count=2),
            OutcomeCount(minute=this_hour, task="shop.charge", queue=queue, outcome="retried", count=3),
            OutcomeCount(minute=this_hour, task="shop.email", queue=queue, outcome="succeeded", count=5),
            OutcomeCount(minute=this_hour - 25 * 3600, task="shop.old", queue=queue, outcome="succeeded", count=9),
        ],
        batch=uuid.uuid4().hex,
        retention=3600,
    )
    store.activity_sample([QueueSample(minute=this_hour - 7200, queue=queue, depth=8, oldest_age=42.0)], retention=1)
    store.activity_sample([QueueSample(minute=this_hour, queue=queue, depth=1, oldest_age=None)], retention=1)
    # When the dashboard is shown
    text = admin_client.get(reverse(DASHBOARD)).content.decode()
    # Then a chart per task, the busiest first, each bar stacked by outcome; the day-old task is not in it (other
    # tests' workers may have left activity in this database: each chart is found by its title)
    assert text.index("shop.charge (45)") < text.index("shop.email (5)") and "shop.old" not in text
    charge = chart_after(text, "<h3>shop.charge (45)</h3>")
    assert re.findall(r'data-series="(\w+)" data-value="(\d+)"', charge) == [
        ("succeeded", "40"),
        ("dead_lettered", "2"),
        ("retried", "3"),
    ]
    # and the queue's oldest age per hour, an hour without a known age drawn as no bar
    ages = chart_after(text, f"<h3>{queue} (up to 42 s)</h3>")
    assert re.findall(r'data-value="([\d.]+)"', ages) == ["42"]
    assert "no known age" in ages


def test_the_activity_off_or_unreadable_is_said_and_the_rest_is_shown(admin_client: Client, celery_app: Any) -> None:
    # Given the activity option off, Then the page says so and shows the rest
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "activity": False}
    text = admin_client.get(reverse(DASHBOARD)).content.decode()
    assert "the activity option is off" in text and 'id="dl-reasons-chart"' in text
    # Given a Redis store that cannot be reached, Then the reason is named and the page still renders
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "activity": True, "store": "redis://127.0.0.1:1/0"}
    page = admin_client.get(reverse(DASHBOARD))
    assert page.status_code == 200
    assert "activity could not be read" in page.content.decode()


def test_the_outbox_backlog_is_shown(admin_client: Client, celery_app: Any) -> None:
    from django_celery_guardrails.models import OutboxMessage

    OutboxMessage.objects.create(task_name="t", task_id="id-1", body="[[], {}]", available_at=datetime.now(UTC))
    text = admin_client.get(reverse(DASHBOARD)).content.decode()
    assert re.search(r'<table id="outbox">.*<td class="number">1</td>', text, re.S)
