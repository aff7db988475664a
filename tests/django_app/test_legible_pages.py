"""The admin pages write times and absent values one way (#30 point 8).

A moment is ``2026-12-02 10:31:05 UTC`` (ISO-like, in the current time zone, its name after) on every list and
record page, the dashboard and the overview, never Django's ``Dec. 2, 2026, 10:31 a.m.`` beside it; the epoch
seconds a dependency's circuit keeps are shown as moments too; an absent tenant is ``-`` everywhere. Layout at
1,366 px is test_admin_browser.py's.
"""

from __future__ import annotations

import re
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_celery_guardrails.models import (
    ConcurrencySlot,
    DeadLetter,
    DependencyState,
    Job,
    OutboxMessage,
)
from django_celery_guardrails.store import DjangoStore

pytestmark = pytest.mark.django_db

#: How every page writes a moment.
MOMENT = re.compile(r"\b\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z][A-Za-z0-9+-]*\b")
#: Django's own date and time format (DATETIME_FORMAT "N j, Y, P"): what a page must no longer show.
DJANGO_FORMAT = re.compile(r"\b(?:Jan|Feb|March|April|May|June|July|Aug|Sept|Oct|Nov|Dec)\.? \d{1,2}, \d{4}")


@pytest.fixture
def rows() -> dict[str, Any]:
    """One row of each table the admin lists, none with a tenant, and a dependency whose circuit is open."""
    now = timezone.now()
    letter = DeadLetter.objects.create(
        task_name="shop.tasks.charge",
        task_id=str(uuid.uuid4()),
        reason="permanent",
        args=[42, 1200],
        kwargs={"api_token": "[redacted]"},
        exc_type="shop.errors.CardRefused",
        exc_message="card refused\nby the issuer",
        history=[{"n": 1, "start": (now - timedelta(minutes=3)).isoformat(), "end": now.isoformat()}],
        first_failed_at=now - timedelta(minutes=3),
        last_failed_at=now - timedelta(minutes=3),
    )
    ConcurrencySlot.objects.create(
        key="report:1", holder="celery@w1:1:abc", task_name="shop.tasks.report", acquired_at=now, heartbeat_at=now
    )
    OutboxMessage.objects.create(task_name="shop.tasks.charge", task_id="t-1", body="[[], {}]", available_at=now)
    DependencyState.objects.create(dependency="payments-api", circuit="open", open_until=time.time() + 240)
    DjangoStore().run_record("nightly report", time.time() - 3600, status="missed", now=time.time(), reason="down")
    job = Job(
        task_name="shop.tasks.build_report",
        task_id=str(uuid.uuid4()),
        created_at=now - timedelta(minutes=2),
        updated_at=now,
    )
    job.record("queued", attempt=0, detail="submitted", now=now - timedelta(minutes=2))
    job.record("succeeded", attempt=1, now=now)
    job.save(force_insert=True)
    return {"dead letter": letter.pk, "job": job.pk}


def test_every_page_writes_a_moment_one_way_and_an_absent_tenant_as_a_dash(
    admin_client: Client, rows: dict[str, Any]
) -> None:
    # Given a row of each table, none with a tenant
    pages = {
        "dead letters": reverse("admin:guardrails_deadletter_changelist"),
        "dead letter": reverse("admin:guardrails_deadletter_change", args=[rows["dead letter"]]),
        "overview": reverse("admin:guardrails_deadletter_overview"),
        "dashboard": reverse("admin:guardrails_dashboard_changelist"),
        "concurrency slots": reverse("admin:guardrails_concurrencyslot_changelist"),
        "outbox": reverse("admin:guardrails_outboxmessage_changelist"),
        "dependencies": reverse("admin:guardrails_dependencystate_changelist"),
        "run ledger": reverse("admin:guardrails_scheduledrun_changelist"),
        "jobs": reverse("admin:guardrails_job_changelist"),
        "job": reverse("admin:guardrails_job_change", args=[rows["job"]]),
    }
    # When an admin opens every page that shows them
    found = {}
    for name, url in pages.items():
        page = admin_client.get(url)
        assert page.status_code == 200, name
        html = page.content.decode()
        found[name] = (len(MOMENT.findall(html)), DJANGO_FORMAT.findall(html))
    # Then each writes its moments one way, and none in Django's own format
    assert {name: bool(count) and not other for name, (count, other) in found.items()} == dict.fromkeys(pages, True)
    # And the dependency's open circuit says until when, as a moment, not epoch seconds
    dependency = admin_client.get(pages["dependencies"]).content.decode()
    assert re.search(r"open until <time[^>]*>" + MOMENT.pattern, dependency)
    # And an absent tenant is "-" in each list that has a tenant column
    for name, column in {
        "dead letters": "owner_and_tenant",
        "concurrency slots": "tenant_shown",
        "outbox": "tenant_shown",
        "jobs": "tenant_shown",
    }.items():
        cell = re.search(rf'<td class="field-{column}">(.*?)</td>', admin_client.get(pages[name]).content.decode())
        assert cell is not None and re.sub(r"<[^>]+>", " ", cell.group(1)).split()[-1] == "-", name


def test_moments_spans_errors_and_arguments_as_people_read_them() -> None:
    from django_celery_guardrails.display import ago, arguments_line, error_line, moment, span

    # Given a moment, lengths of time, an error and a call's stored arguments
    now = timezone.now()
    # Then a moment is ISO-like with its zone, and how long ago it was reads in words
    assert MOMENT.fullmatch(moment(now)) and moment(now.isoformat()) == moment(now) and moment(None) == "-"
    assert [ago(now - timedelta(seconds=s), now=now) for s in (10, 200, 7200, 3 * 86400, -240)] == [
        "just now",
        "3 min ago",
        "2 h ago",
        "3 days ago",
        "in 4 min",
    ]
    assert [span(s) for s in (None, 0.4, 42, 245, 7620, 3 * 86400 + 4 * 3600)] == [
        "-",
        "0.4 s",
        "42 s",
        "4 min 5 s",
        "2 h 7 min",
        "3 days 4 h",
    ]
    # And an error is its class and its message on one line, the arguments as a call reads, redacted kept so
    assert error_line("requests.exceptions.HTTPError", "503 Server Error:\n  Service Unavailable") == (
        "HTTPError: 503 Server Error: Service Unavailable"
    )
    assert arguments_line([42, 1200], {"api_token": "[redacted]"}, names=["order_id", "amount_cents"]) == (
        "order_id=42, amount_cents=1200, api_token=[redacted]"
    )
    assert arguments_line([42, "x"], {}) == '42, "x"' and arguments_line([], {}) == "(none)"
    assert arguments_line(["[1, <object>]"], {"repr": "{}"}, as_repr=True) == "as text: [1, <object>]"
