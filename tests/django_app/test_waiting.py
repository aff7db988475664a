"""The admin's Waiting page on the Django store (PostgreSQL or SQLite, per GUARDRAILS_TEST_DB), on a real
worker and broker: a task deferred by an open circuit and one retrying after an error are listed with their
reason, attempt and due time, scoped by tenant, and leave the page once they run; a task waiting for a
concurrency slot and one waiting behind a gap in its ordering key are listed with their key, attempt and due
time on the page, in ``status`` and in ``status --json``.

The Redis store and the status command: tests/celery_guardrails/guardrails/test_waiting.py.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
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
    # (Each redelivery of the deferral deletes its row as it starts and writes the next as it is put off again:
    # under load a read can fall between the two.)
    wait_for("the deferral waiting", lambda: WaitingMessage.objects.filter(task_id=deferred.id).count() == 1)
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


@pytest.fixture
def prefork_worker(celery_app: Any, queue_name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A prefork worker (3 processes) on the Django store, as the test's admin and ``status`` read it."""
    import json

    from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

    settings = {"store": "django", "dead_letter_sinks": ["django"]}
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, **settings}
    monkeypatch.setattr(health, "celery_app", lambda: celery_app)
    env = proj_env(queue=queue_name, django=True, GUARDRAILS_TEST_GUARDRAILS=json.dumps(settings))
    with WorkerProcess(
        app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env, concurrency=3
    ) as process:
        yield process


def waiting_as_a_person_and_a_program_see_it(
    app: Any, client: Client, task_id: str, reason: str
) -> tuple[list[str], Any, dict[str, Any]]:
    """``task_id``'s wait for ``reason`` as the admin's Waiting page, ``status`` and ``status --json`` show it
    (each read again until it lists it: the row is replaced by each re-publish, and gone while it runs)."""
    from celery_guardrails.operations import status

    def on_the_page() -> list[str] | None:
        html = client.get(reverse(WAITING)).content.decode()
        # (a row of one cell: "Nothing waits.", yet, or while the message runs)
        found = {row[1]: row for row in rows(html) if len(row) > 1}
        return found.get(task_id) if task_id in found and counts_reason(found[task_id], reason) else None

    def in_status() -> tuple[Any, dict[str, Any]] | None:
        read = status.gather(app)
        text, data = status.render(read), status.as_dict(read)
        row = next((w for w in data["waiting"]["soonest"] if w["task_id"] == task_id and w["reason"] == reason), None)
        shown = next((w for w in read.waiting.soonest if w.task_id == task_id), None) if read.waiting else None
        return (shown, row) if row and shown and task_id in text else None

    page = wait_for(f"{task_id} on the Waiting page", on_the_page, timeout=TIMEOUT)
    shown, row = wait_for(f"{task_id} in status", in_status, timeout=TIMEOUT)
    return page, shown, row


def counts_reason(row: list[str], reason: str) -> bool:
    return row[3].startswith(reason + " ")


def test_a_task_waiting_for_a_concurrency_slot_is_listed_with_its_key_attempt_and_due_time(
    prefork_worker: Any, celery_app: Any, admin_client: Client, sink: Sink
) -> None:
    import redis as redis_client

    from tests.support.services import REDIS_URL

    # Given tenant_limited (concurrency_key "tenant:{tenant}", limit 2) and acme's two slots held (their runs
    # wait at a gate the test opens)
    tenant, gate = f"acme-{uuid.uuid4().hex[:6]}", f"{sink.key}:gate"
    gates = redis_client.Redis.from_url(REDIS_URL)
    with tenant_context(tenant):
        holders = [tasks.tenant_limited.apply_async((sink.key, 0, gate)) for _ in range(2)]
        wait_for("both slots held", lambda: len(sink.items()) == 2)
        # When a third of acme's is published
        waiter = tasks.tenant_limited.apply_async((sink.key, 0))
    # Then the Waiting page, status and status --json list it: waiting for a slot of acme's key, for its first
    # attempt (a wait spends none), due soon
    page, shown, row = waiting_as_a_person_and_a_program_see_it(celery_app, admin_client, waiter.id, "concurrency")
    assert page[:3] == ["tests.proj.tasks.tenant_limited", waiter.id, tenant]
    assert page[3].endswith(f"tenant:{tenant}") and page[4] == "1", page
    assert re.fullmatch(r"in \d+ s|now", page[5]), page
    assert (shown.reason, shown.attempt, shown.tenant) == ("concurrency", 1, tenant)
    assert shown.detail.endswith(f"tenant:{tenant}") and shown.reason_text == f"concurrency {shown.detail}"
    assert shown.since <= shown.due and not shown.overdue
    assert (row["task"], row["detail"], row["attempt"]) == ("tests.proj.tasks.tenant_limited", shown.detail, 1)
    assert isinstance(row["due"], float) and row["since"] <= row["due"]
    # When the slots are freed, Then it runs on its first attempt and is no longer listed
    gates.rpush(gate, "go", "go")
    assert [h.get(timeout=TIMEOUT)["attempt"] for h in holders] == [1, 1]
    assert waiter.get(timeout=TIMEOUT)["attempt"] == 1
    assert not WaitingMessage.objects.filter(task_id=waiter.id).exists()
    gates.delete(gate)


def test_an_ordered_task_waiting_behind_a_gap_is_listed_with_its_key_attempt_and_due_time(
    prefork_worker: Any, celery_app: Any, admin_client: Client, sink: Sink
) -> None:
    # Given message 1 of an ordered stream published to a queue no worker consumes yet (a gap in the key)
    stream, held = f"s-{uuid.uuid4().hex[:10]}", f"held-{uuid.uuid4().hex[:10]}"
    first = tasks.ordered_append.apply_async((stream, 1, sink.key), queue=held)
    # When message 2 of the stream is published to the worker's queue
    second = tasks.ordered_append.apply_async((stream, 2, sink.key))
    # Then the Waiting page, status and status --json list it: waiting for its turn on the stream's key, for its
    # first attempt, due soon
    page, shown, row = waiting_as_a_person_and_a_program_see_it(celery_app, admin_client, second.id, "ordering")
    assert page[:2] == ["tests.proj.tasks.ordered_append", second.id] and page[2] == "-"
    assert page[3].endswith(f"stream:{stream}") and page[4] == "1", page
    assert re.fullmatch(r"in \d+ s|now", page[5]), page
    assert (shown.reason, shown.attempt, shown.tenant) == ("ordering", 1, "")
    assert shown.detail.endswith(f"stream:{stream}") and shown.reason_text == f"ordering {shown.detail}"
    assert shown.since <= shown.due and not shown.overdue
    assert (row["task"], row["detail"], row["attempt"]) == ("tests.proj.tasks.ordered_append", shown.detail, 1)
    assert isinstance(row["due"], float) and row["since"] <= row["due"]
    assert sink.items() == []  # message 2 did not run out of turn
    # When the worker consumes the held queue too, Then message 1 runs, then message 2, and nothing waits
    assert celery_app.control.add_consumer(held, destination=[prefork_worker.hostname], reply=True, timeout=10)
    assert [first.get(timeout=TIMEOUT), second.get(timeout=TIMEOUT)] == [1, 2]
    assert [item["n"] for item in sink.items()] == [1, 2]
    assert not WaitingMessage.objects.filter(task_id__in=[first.id, second.id]).exists()
