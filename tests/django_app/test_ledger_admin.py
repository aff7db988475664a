"""The run ledger in the Django admin: a read-only change list, filtered by status, schedule and period."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from celery_guardrails.scheduling.ledger import MISSED, OK, RUNNING
from django_celery_guardrails.models import ScheduledRun
from django_celery_guardrails.store import DjangoStore

pytestmark = pytest.mark.django_db
T0 = 1_800_000_000.0  # 2027-01-15 08:00 UTC
CHANGELIST = "admin:guardrails_scheduledrun_changelist"


@pytest.fixture
def ledger() -> dict[str, ScheduledRun]:
    """Three periods of a nightly report (finished ok, missed, running) and one of another schedule."""
    store = DjangoStore()
    store.run_dispatch("nightly report", T0, task_id="task-ok", now=T0)
    store.run_start("nightly report", T0, task_id="task-ok", now=T0 + 1)
    store.run_finish("nightly report", T0, status=OK, now=T0 + 10.5)
    store.run_record("nightly report", T0 + 86_400, status=MISSED, now=T0 + 86_700, reason="beat was down")
    store.run_start("nightly report", T0 + 2 * 86_400, task_id="task-running", now=T0 + 2 * 86_400 + 2)
    store.run_dispatch("hourly sync", T0, task_id="task-sync", now=T0)
    return {row.task_id or row.status: row for row in ScheduledRun.objects.all()}


def listed(client: Client, **query: str) -> list[str]:
    page = client.get(reverse(CHANGELIST), query)
    assert page.status_code == 200
    return sorted(row.task_id or row.status for row in page.context["cl"].result_list)


def test_the_change_list_shows_every_run(admin_client: Client, ledger: dict[str, ScheduledRun]) -> None:
    # Given the ledger above, When an admin opens the change list
    page = admin_client.get(reverse(CHANGELIST))
    # Then every record is listed, newest period first, with its duration when it has ended
    assert page.status_code == 200
    rows = page.context["cl"].result_list
    assert sorted(row.pk for row in rows) == sorted(row.pk for row in ledger.values())
    assert [row.period for row in rows] == sorted((row.period for row in rows), reverse=True)
    html = page.content.decode()
    for text in ("nightly report", "hourly sync", "task-ok", "task-running", "0:00:09.500000", "Scheduled runs"):
        assert text in html


def test_filters_and_search(admin_client: Client, ledger: dict[str, ScheduledRun]) -> None:
    # Given the ledger above
    # When the change list is filtered by status, by schedule, by the date hierarchy, or searched
    # Then only the matching records are listed
    assert listed(admin_client, status__exact=MISSED) == [MISSED]
    assert listed(admin_client, status__exact=RUNNING) == ["task-running"]
    assert listed(admin_client, schedule="hourly sync") == ["task-sync"]
    assert listed(admin_client, period__year="2027", period__month="1", period__day="16") == [MISSED]
    assert listed(admin_client, q="task-ok") == ["task-ok"]
    assert listed(admin_client, q="task") == []  # a task id matches whole, not in part
    assert listed(admin_client, q="sync") == ["task-sync"]


def test_records_cannot_be_added_changed_or_deleted(admin_client: Client, ledger: dict[str, ScheduledRun]) -> None:
    record = ledger["task-ok"]
    # Given a superuser, When they try to add a record, Then it is refused
    assert admin_client.get(reverse("admin:guardrails_scheduledrun_add")).status_code == 403
    assert admin_client.post(reverse("admin:guardrails_scheduledrun_add"), {}).status_code == 403
    # When they open a record, Then they can read it, but there is nothing to save and no deleting it
    detail = admin_client.get(reverse("admin:guardrails_scheduledrun_change", args=[record.pk]))
    assert detail.status_code == 200
    assert b"task-ok" in detail.content and b'name="_save"' not in detail.content
    changed: dict[str, Any] = {"status": MISSED, "task_id": "forged"}
    admin_client.post(reverse("admin:guardrails_scheduledrun_change", args=[record.pk]), changed)
    record.refresh_from_db()
    assert (record.status, record.task_id) == (OK, "task-ok")
    assert admin_client.get(reverse("admin:guardrails_scheduledrun_delete", args=[record.pk])).status_code == 403
    assert ScheduledRun.objects.filter(pk=record.pk).exists()
