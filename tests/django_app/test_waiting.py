"""The admin's Waiting page on the Django store (PostgreSQL or SQLite, per GUARDRAILS_TEST_DB), on a real
worker and broker: a task deferred by an open circuit and one retrying after an error are listed with their
reason, attempt and due time, scoped by tenant, and leave the page once they run.

The Redis store and the status command: tests/celery_guardrails/test_waiting.py.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from celery_guardrails import budget_status, tenant_context
from django_celery_guardrails import health
from django_celery_guardrails.models import WaitingMessage
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

WAITING = "admin:guardrails_waitingmessage_changelist"
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
    dues = re.findall(r'<td class="gr-due"><time datetime="([^"]+)"', html)
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
