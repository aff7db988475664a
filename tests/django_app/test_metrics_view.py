"""The metrics view: the Prometheus exposition for staff users or the bearer of ``metrics_token``, 403 for
anyone else."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import LazySettings
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from celery_guardrails.operations import metrics
from example_project.celery_app import app

TOKEN = "a-scraper-token-of-some-length"
URL = "guardrails:metrics"

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def token(settings: LazySettings) -> None:
    settings.CELERY_GUARDRAILS = {**settings.CELERY_GUARDRAILS, "metrics_token": TOKEN}


@pytest.fixture
def recorded() -> tuple[str, str]:
    """A sample this web process recorded (a message it published), for the view to show."""
    labels = ("tests.metrics_view.task", "a-queue")
    metrics.instruments(app).published.labels(*labels).inc()
    return labels


def published(response: Any, labels: tuple[str, str]) -> float | None:
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            if sample.name == metrics.MESSAGES_PUBLISHED and (sample.labels["task"], sample.labels["queue"]) == labels:
                return float(sample.value)
    return None


def test_anonymous_is_refused(client: Client) -> None:
    # Given no user and no token; When the metrics are asked for; Then 403 (not a redirect to a login page)
    assert client.get(reverse(URL)).status_code == 403


def test_a_user_who_is_not_staff_is_refused(client: Client) -> None:
    # Given a logged-in user without staff status; When they ask; Then 403
    client.force_login(User.objects.create_user("someone", password="x"))
    assert client.get(reverse(URL)).status_code == 403


def test_staff_read_the_exposition(admin_client: Client, recorded: tuple[str, str]) -> None:
    # Given a staff user and a sample this process recorded; When they ask
    response = admin_client.get(reverse(URL))
    # Then 200 in Prometheus' text format, with the sample
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    assert published(response, recorded) is not None and published(response, recorded) >= 1


def test_the_bearer_of_the_token_reads_the_exposition(client: Client, recorded: tuple[str, str]) -> None:
    # Given no user, the right token; When a scraper asks
    response = client.get(reverse(URL), HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    # Then 200 with the sample
    assert response.status_code == 200
    assert published(response, recorded) is not None


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}x", "Bearer ", f"Basic {TOKEN}", TOKEN])
def test_a_wrong_token_is_refused(client: Client, header: str) -> None:
    # Given a wrong token, an empty one, another scheme, no scheme; When a scraper asks; Then 403
    assert client.get(reverse(URL), HTTP_AUTHORIZATION=header).status_code == 403


def test_without_a_token_setting_a_bearer_is_refused(client: Client, settings: LazySettings) -> None:
    # Given no metrics_token configured; When a bearer of anything asks; Then 403
    settings.CELERY_GUARDRAILS = {k: v for k, v in settings.CELERY_GUARDRAILS.items() if k != "metrics_token"}
    assert client.get(reverse(URL), HTTP_AUTHORIZATION="Bearer anything-at-all-here").status_code == 403


def test_metrics_that_cannot_be_collected_are_a_503(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # Given a multiprocess directory that is not there; When staff ask; Then 503 (the scraper sees it down)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "not-there"))
    assert admin_client.get(reverse(URL)).status_code == 503


def test_the_summed_metrics_of_a_multiprocess_directory(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # Given an empty multiprocess directory (as a web server's processes share it); When staff ask
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    response = admin_client.get(reverse(URL))
    # Then 200: the sums of what is there (nothing recorded yet: every family named, none with a sample),
    # beside the state gauges read at scrape time
    assert response.status_code == 200
    families = list(text_string_to_metric_families(response.content.decode()))
    recorded = [f for f in families if f.name.startswith(("celery_guardrails_task_", "celery_guardrails_messages_"))]
    assert recorded and all(not family.samples for family in recorded)
    assert any(f.name == "celery_guardrails_collector_source_up" and f.samples for f in families)


def test_the_exposition_carries_the_state_of_the_deployment(admin_client: Client) -> None:
    # Given an open dead letter of an owned task (the Django sink)
    from django.utils import timezone

    from django_celery_guardrails.models import DeadLetter

    moment = timezone.now()
    DeadLetter.objects.create(
        task_id="t-metrics-view",
        task_name="tests.metrics_view.owned",
        owner="payments",
        reason="permanent",
        first_failed_at=moment,
        last_failed_at=moment,
    )
    # When staff read the metrics
    response = admin_client.get(reverse(URL))
    # Then the state gauges are there: the dead letter counted open for its owner and task, the sources read
    open_letters = {
        (sample.labels["owner"], sample.labels["task"]): sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
        if sample.name == "celery_guardrails_dead_letters_open"
    }
    assert open_letters.get(("payments", "tests.metrics_view.owned")) == 1
    assert "celery_guardrails_collector_source_up" in response.content.decode()


def test_the_outbox_backlog_is_exported_as_the_relays_lag(admin_client: Client) -> None:
    # Given two outbox messages waiting, the older enqueued 90 s ago (no relay runs in this process)
    from datetime import timedelta

    from django.utils import timezone

    from django_celery_guardrails.models import OutboxMessage

    moment = timezone.now()
    for age in (90, 5):
        row = OutboxMessage.objects.create(task_name="t", task_id=f"id-{age}", body="[[], {}]", available_at=moment)
        OutboxMessage.objects.filter(pk=row.pk).update(created_at=moment - timedelta(seconds=age))
    # When staff read the metrics, Then the backlog and the oldest message's age are there
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(admin_client.get(reverse(URL)).content.decode())
        for sample in family.samples
    }
    assert samples["celery_guardrails_outbox_messages"] == 2
    assert samples["celery_guardrails_outbox_oldest_age_seconds"] >= 90
