"""The admin's Waiting page on the Django store (PostgreSQL or SQLite, per GUARDRAILS_TEST_DB), on a real
worker and broker: a task deferred by an open circuit and one retrying after an error are listed with their
reason, attempt and due time, scoped by tenant, and leave the page once they run.

The Redis store and the status command: tests/celery_guardrails/guardrails/test_waiting.py.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.urls import reverse

from celery_guardrails import budget_status, tenant_context
from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import Wait
from django_celery_guardrails import health
from django_celery_guardrails.models import WaitingMessage
from tests.conftest import Sink
from tests.django_app import test_admin_browser
from tests.django_app.test_admin_browser import ARTIFACTS, boxes, log_in, overlap
from tests.proj import tasks
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

WAITING = "admin:guardrails_waitingmessage_changelist"
#: Headless Chromium (tests/django_app/test_admin_browser.py's fixture).
browser = test_admin_browser.browser
TIMEOUT = 60


def rows(html: str) -> list[list[str]]:
    """The Waiting table's rows, each as its cells' text."""
    body = html.split('<table id="waiting">', 1)[1].split("</table>", 1)[0].split("<tbody>", 1)[1]
    found = []
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, flags=re.S):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)
        found.append([re.sub(r"<[^>]+>", "", cell).strip() for cell in cells])
    return found


def counts(html: str) -> dict[str, str]:
    return dict(re.findall(r'<li data-reason="([^"]+)">[^<]*<strong>(\d+)</strong>', html))


@pytest.fixture
def clock() -> list[float]:
    import time

    return [float(int(time.time()))]


@pytest.fixture
def django_app(celery_app: Any, clock: list[float], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The Django store and sink; a circuit that opens after one failure, for 60 s of a clock the test moves."""
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "store": "django",
        "dead_letter_sinks": ["django"],
        "circuit_threshold": 1,
        "circuit_open_seconds": 60.0,
        "clock": lambda: clock[0],
        "backoff_random": lambda: 1.0,
    }
    monkeypatch.setattr(health, "celery_app", lambda: celery_app)
    return celery_app


def test_a_circuit_deferral_and_a_retry_are_on_the_waiting_page_scoped_and_gone_once_they_run(
    django_app: Any, celery_worker: Any, admin_client: Client, sink: Sink, clock: list[float], settings: Any
) -> None:
    # Given a dependency whose circuit one failure opened
    dependency = f"dep-{uuid.uuid4().hex[:8]}"
    with pytest.raises(Exception, match="failed"):
        tasks.behave.apply_async((f"{sink.key}:x", ["transient"]), dependency=dependency, max_attempts=1).get(
            timeout=TIMEOUT
        )
    wait_for("the circuit open", lambda: budget_status(dependency, app=django_app)["circuit"] == "open")

    # When acme's task of that dependency is published, and globex's task fails once (its retry waits 6 s)
    with tenant_context("acme"):
        deferred = tasks.behave.apply_async((f"{sink.key}:a", ["ok"]), dependency=dependency, backoff_max=3.0)
    with tenant_context("globex"):
        retried = tasks.behave.apply_async((f"{sink.key}:g", ["transient", "ok"]), backoff_base=6.0, backoff_max=6.0)
    wait_for("both waiting", lambda: WaitingMessage.objects.filter(task_id__in=[deferred.id, retried.id]).count() == 2)

    # Then an admin sees both, soonest due first, with their counts per reason
    page = admin_client.get(reverse(WAITING))
    assert page.status_code == 200
    html = page.content.decode()
    listed = {row[1]: row for row in rows(html)}
    assert listed[deferred.id][:5] == ["tests.proj.tasks.behave", deferred.id, "acme", f"circuit {dependency}", "1"]
    assert listed[retried.id][:5] == [
        "tests.proj.tasks.behave",
        retried.id,
        "globex",
        "retry after TransientError",
        "2",
    ]
    assert re.fullmatch(r"in \d+ s", listed[deferred.id][5]) and re.fullmatch(r"in \d+ s", listed[retried.id][5])
    dues = re.findall(r'<td class="gr-due gr-when"><time datetime="([^"]+)"', html)
    assert len(dues) == 2 and dues == sorted(dues)  # the soonest due first (ISO times of one zone sort as text)
    assert counts(html) == {"retry": "1", "circuit": "1"}
    assert re.search(r'<time datetime="\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d" title=', html)  # ISO on hover
    # And the page is on the admin index, beside the app's other pages
    assert reverse(WAITING) in admin_client.get(reverse("admin:index")).content.decode()

    # And a staff user who may view dead letters of acme only sees acme's wait, counts included
    settings.CELERY_GUARDRAILS = {"admin_tenants": lambda user: ["acme"]}
    staff = User.objects.create_user("acme-ops", password="x", is_staff=True)
    client = Client()
    client.force_login(staff)
    assert client.get(reverse(WAITING)).status_code == 403  # not without the dead letters' view permission
    staff.user_permissions.add(Permission.objects.get(codename="view_deadletter"))
    scoped = client.get(reverse(WAITING)).content.decode()
    assert [row[1] for row in rows(scoped)] == [deferred.id]
    assert counts(scoped) == {"circuit": "1"}

    # When the retry has run, Then it is gone; while the circuit stays open the deferral stays one row
    assert retried.get(timeout=TIMEOUT)["attempt"] == 2
    assert not WaitingMessage.objects.filter(task_id=retried.id).exists()
    assert WaitingMessage.objects.filter(task_id=deferred.id).count() == 1
    # When the circuit's open time has passed, Then the deferred task runs (its first attempt) and is gone too
    clock[0] += 61
    assert deferred.get(timeout=TIMEOUT)["attempt"] == 1
    assert not WaitingMessage.objects.filter(task_id__in=[deferred.id, retried.id]).exists()
    assert "Nothing waits." in admin_client.get(reverse(WAITING)).content.decode()


@pytest.fixture
def long_waits(monkeypatch: pytest.MonkeyPatch) -> list[Wait]:
    """Waits with long real values in the Django store (a long task name, UUID ids, 100-character tenants, a
    255-character key with no place to break a line), one of them overdue, and an admin user; written before the
    browser starts (Playwright's thread may not write)."""
    import time

    from celery import Celery

    app = Celery("waiting-page", set_as_current=False)
    app.conf.guardrails = {"store": "django"}
    monkeypatch.setattr(health, "celery_app", lambda: app)
    now = time.time()
    store = get_store(app)
    tenant = ("tenant_" + "northwind_traders_international_" * 4)[:100]
    waits = [
        Wait(
            task_id=str(uuid.uuid4()),
            task_name="billing.integrations.payment_providers.settlements.tasks.reconcile_settlement_batches",
            tenant=tenant,
            reason=reason,
            detail=detail,
            attempt=attempt,
            due=now + ahead,
            since=now - 3600,
            expires=now + 86400,
        )
        for reason, detail, attempt, ahead in [
            ("retry", "ProviderTemporarilyUnavailableError", 4, 3 * 3600),
            ("budget", "payments-platform-settlement-provider-api", 2, 1800),
            ("concurrency", "pdf:" + "x" * 251, 1, 600),
            ("circuit", "payments-platform-settlement-provider-api", 1, -900),
        ]
    ]
    for wait in waits:
        store.wait_note(wait)
    User.objects.create_superuser("admin", "admin@example.com", "pw-for-tests")
    return waits


def test_the_waiting_page_keeps_long_values_inside_a_1366_pixel_screen(
    long_waits: list[Wait], live_server: Any, browser: Any
) -> None:
    width = 1366
    page = browser.new_page(viewport={"width": width, "height": 768})
    # When the Waiting page lists waits with long task names, tenants and keys
    log_in(page, live_server, "/admin/guardrails/waitingmessage/", "**/admin/guardrails/waitingmessage/")
    page.wait_for_selector("#waiting")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "1366-waiting.png"), full_page=True)
    # Then the page is no wider than the screen, and every header and cell is inside it
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    cells = boxes(page, "#waiting th, #waiting td")
    assert [c["text"].strip()[:40] for c in cells if c["x"] < -0.5 or c["x"] + c["width"] > width + 0.5] == []
    # And no two cells of a row overlap (a long key wraps inside its own column)
    rows_ = page.locator("#waiting tbody tr")
    assert rows_.count() == 4
    for i in range(4):
        row = boxes(page, f"#waiting tbody tr:nth-child({i + 1}) td")
        assert [
            (a["text"][:20], b["text"][:20]) for j, a in enumerate(row) for b in row[j + 1 :] if overlap(a, b)
        ] == []
    # And the counts and the due times read as people say them, the overdue one marked
    assert page.locator("#waiting-total").inner_text() == "4 waiting"
    dues = [text.strip() for text in page.locator("#waiting td.gr-due").all_inner_texts()]
    assert dues == ["overdue 15 min", "in 10 min", "in 30 min", "in 3 h"]  # (the page took seconds, not minutes)
    assert page.locator("#waiting time.gr-overdue").count() == 1
    connection.close()  # the ORM's connection in Playwright's thread
