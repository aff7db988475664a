"""The dead-letter admin in a real headless Chromium (Debian's, driven by Playwright; no browser download).

Log in, filter by reason, open a record, replay it through the confirmation page, see its status change; open
the schedule-health page from the run ledger. Screenshots of each step are kept in test-artifacts/admin/.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.db import connection

from celery_guardrails import tenant_context
from celery_guardrails.foundation.fingerprints import fingerprint
from celery_guardrails.operations import activity
from celery_guardrails.runtime.outcomes import REASONS
from django_celery_guardrails.models import DeadLetter, Job
from django_celery_guardrails.tasks import bulk_dead_letters  # registered before the worker starts, as autodiscover
from tests.conftest import Sink
from tests.django_app.test_health import fill_ledger, use_app
from tests.proj import tasks
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "admin"


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        message = f"{CHROMIUM} is missing; `make services` installs it (Debian's chromium)"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; Django then refuses ORM calls from it unless told
    # that this (test) code knows what it does.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            yield chromium
        finally:
            chromium.close()


def log_in(page: Any, live_server: Any, next_path: str, landing: str) -> None:
    """Log in as "admin" through the login page, and wait for the page it leads to."""
    page.goto(f"{live_server.url}/admin/login/?next={next_path}")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "pw-for-tests")
    page.click("input[type=submit]")
    page.wait_for_url(landing)


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"]}
    return celery_app


def test_replay_a_dead_letter_in_the_admin(celery_worker: Any, live_server: Any, browser: Any, sink: Sink) -> None:
    # Given a real dead letter and an admin user
    order = uuid.uuid4().int % 10**9
    with tenant_context("acme"):
        failed = tasks.charge.apply_async((order, sink.key, ["permanent", "ok"]))
    with pytest.raises(Exception, match="card refused"):
        failed.get(timeout=30)
    record = DeadLetter.objects.get(task_id=failed.id)
    User.objects.create_superuser("admin", "admin@example.com", "pw-for-tests")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page()

    def shot(name: str) -> None:
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    # When an operator logs in
    log_in(page, live_server, "/admin/guardrails/deadletter/", "**/admin/guardrails/deadletter/")
    shot("1-changelist")
    # filters by reason
    page.click("#changelist-filter a[href*='reason=permanent']")
    page.wait_for_url("**reason=permanent**")
    assert page.locator(f"[title*='{record.task_id}']").count() == 1
    shot("2-filtered")
    # opens the record: the attempt history is a table, the traceback is there
    page.click(f"a[href*='/deadletter/{record.pk}/change/']")
    page.wait_for_selector("table.attempt-history")
    assert "card refused" in page.content()
    shot("3-record")
    # replays it through the confirmation page
    page.click("a.replay-link")
    page.wait_for_selector("#confirm")
    shot("4-confirm")
    assert page.locator("#allow-not-idempotent").count() == 0  # a permanent failure: no not_idempotent box
    page.click("#confirm")
    page.wait_for_selector("ul.messagelist")
    shot("5-replayed")
    # Then its status is replayed, on the page and in the database
    assert "Replayed 1 dead letter(s)." in page.inner_text("ul.messagelist")
    assert "replayed" in page.inner_text("div.field-status")
    record.refresh_from_db()
    # Once Playwright's sync API runs, the ORM works on a connection of its own: close it, or PostgreSQL
    # cannot drop the test database at the end ("being accessed by other users").
    connection.close()
    assert record.status == "replayed" and record.handled_by == "admin"


@pytest.fixture
def not_idempotent_letter(celery_worker: Any, sink: Sink) -> DeadLetter:
    """A real not_idempotent dead letter (its task may have acted before it failed; a replay succeeds) and an
    admin user, written before the browser starts (see ``schedules``)."""
    with tenant_context("acme"):
        failed = tasks.behave_not_idempotent.delay(sink.key, ["unknown", "ok"])
    with pytest.raises(RuntimeError):
        failed.get(timeout=30)
    User.objects.create_superuser("admin", "admin@example.com", "pw-for-tests")
    return DeadLetter.objects.get(task_id=failed.id, reason="not_idempotent")


def test_a_not_idempotent_dead_letter_replays_only_once_its_box_is_ticked(
    not_idempotent_letter: DeadLetter, live_server: Any, browser: Any
) -> None:
    record = not_idempotent_letter
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page()
    detail = f"/admin/guardrails/deadletter/{record.pk}/change/"
    log_in(page, live_server, detail, f"**{detail}")
    # When the operator opens its Replay page
    page.click("a.replay-link")
    page.wait_for_selector("#not-idempotent")
    page.screenshot(path=str(ARTIFACTS / "8-not-idempotent-confirm.png"), full_page=True)
    # Then it warns that the effect may already have happened, and the box is unticked
    assert "may repeat that effect" in page.inner_text("#not-idempotent")
    assert not page.is_checked("#allow-not-idempotent")
    # When they confirm without ticking it: Then it is not replayed, and the message says why
    page.click("#confirm")
    page.wait_for_selector("ul.messagelist")
    assert "not replayed" in page.inner_text("ul.messagelist") and "open" in page.inner_text("div.field-status")
    # When they tick it and confirm: Then it is replayed
    page.click("a.replay-link")
    page.check("#allow-not-idempotent")
    page.click("#confirm")
    page.wait_for_selector("ul.messagelist")
    page.screenshot(path=str(ARTIFACTS / "9-not-idempotent-replayed.png"), full_page=True)
    assert "Replayed 1 dead letter(s)." in page.inner_text("ul.messagelist")
    status = DeadLetter.objects.get(pk=record.pk).status
    connection.close()  # the ORM's connection in Playwright's thread (see above)
    assert status == "replayed"


@pytest.fixture
def schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Schedules in every state (tests/django_app/test_health.py) and an admin user.

    Written before the browser starts: ORM calls in the test body, once Playwright's sync API runs, got a
    database connection of their own that nothing closed (PostgreSQL then could not drop the test database)."""
    use_app(monkeypatch)
    fill_ledger()
    User.objects.create_superuser("admin", "admin@example.com", "pw-for-tests")


def test_the_schedule_health_page(schedules: None, live_server: Any, browser: Any) -> None:
    # Given schedules in every state and an admin user
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page()
    # When an operator logs in to the run ledger and follows its "Schedule health" link
    log_in(page, live_server, "/admin/guardrails/scheduledrun/", "**/admin/guardrails/scheduledrun/")
    page.click("a.health-link")
    page.wait_for_selector("table#schedule-health")
    page.screenshot(path=str(ARTIFACTS / "6-schedule-health.png"), full_page=True)
    # Then each schedule is a row with its state as a word
    states = page.locator("table#schedule-health tbody .health-state").all_inner_texts()
    assert states == ["ok", "missed", "failing", "overdue", "running", "never run", "missed", "no policy"]


def test_the_dashboard_from_the_admin_index(
    four_dead_letters: list[DeadLetter], live_server: Any, browser: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given four real dead letters and an admin user (the page reads the app's queues, store and ledger)
    app = use_app(monkeypatch)
    # (the activity the embedded worker kept is in the test Redis, the worker's store, on the real clock)
    app.conf.guardrails = {**app.conf.guardrails, "store": REDIS_URL, "clock": time.time}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page()
    # When an operator logs in and follows the index's Dashboard link
    log_in(page, live_server, "/admin/", "**/admin/")
    page.click("a[href$='/admin/guardrails/dashboard/']")
    page.wait_for_selector("#dl-reasons-chart")
    page.screenshot(path=str(ARTIFACTS / "7-dashboard.png"), full_page=True)
    # Then the chart shows the four permanent failures of this hour, and the table their owner
    counts = page.locator("#dl-reasons-chart rect[data-series='permanent']").evaluate_all(
        "bars => bars.map(bar => Number(bar.dataset.value))"
    )
    assert sum(counts) == 4
    # and the charge task's chart of outcomes counts its four dead-lettered deliveries (at least: other tests of
    # this process may have dead-lettered charges in the same hour of the shared Redis; exact counts are
    # test_dashboard.py's)
    assert "tests.proj.tasks.charge" in page.locator("#activity-tasks").inner_text()
    dead = page.locator("#activity-tasks rect[data-series='dead_lettered']").evaluate_all(
        "bars => bars.map(bar => Number(bar.dataset.value))"
    )
    assert sum(dead) >= 4
    assert "4" in page.locator("table#open-dead-letters").inner_text()


@pytest.fixture
def four_dead_letters(celery_worker: Any, sink: Sink) -> list[DeadLetter]:
    """Four real open dead letters (charge refused once; a replay succeeds) and an admin user, written before
    the browser starts (see ``schedules``)."""
    first = uuid.uuid4().int % 10**9
    app = celery_worker.app
    app.conf.guardrails = {**app.conf.guardrails, "activity": True}  # off in the suite's embedded workers
    # This hour's activity in this process's Redis holds what earlier tests' workers counted: the chart of the
    # six busiest tasks would leave the charge out. The hour starts empty here.
    client = redis.Redis.from_url(REDIS_URL)
    hour = int(time.time() // 3600 * 3600)
    # The chart covers the last 24 hours, and the Redis of a machine keeps what earlier runs of the suite counted
    # in them (3,161 runs of another task once pushed the charge out of the six): those hours start empty too.
    client.delete(*(f"guardrails:{{activity}}:{hour + k * 3600}" for k in range(-25, 2)))
    results = []
    with tenant_context("acme"):
        for n in range(4):
            results.append(tasks.charge.apply_async((first + n, f"{sink.key}:{n}", ["permanent", "ok"])))
    for result in results:
        with pytest.raises(Exception, match="card refused"):
            result.get(timeout=30)
    # The embedded worker's counts, added to the store now rather than at its next flush
    recorder = activity.recorder(celery_worker.app)
    wait_for("the four endings counted and added", lambda: recorder.flush() and dead_lettered(celery_worker.app) >= 4)
    User.objects.create_superuser("admin", "admin@example.com", "pw-for-tests")
    return [DeadLetter.objects.get(task_id=result.id) for result in results]


def dead_lettered(app: Any) -> int:
    current = time.time()
    found = activity.read(app, since=current - 3600, until=current + 60)
    return sum(c.count for c in found.outcomes if c.task == tasks.charge.name and c.outcome == "dead_lettered")


ACTIONS = {"discard_selected": "discarded", "resolve_selected": "resolved", "replay_selected": "replayed"}


@pytest.mark.parametrize("action", list(ACTIONS))
def test_an_action_on_one_ticked_row_of_four_changes_that_row_only_and_select_all_changes_all(
    four_dead_letters: list[DeadLetter], live_server: Any, browser: Any, action: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_celery_guardrails.admin import DeadLetterAdmin

    records = four_dead_letters
    ids = [record.pk for record in records]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page()
    log_in(page, live_server, "/admin/guardrails/deadletter/?status__exact=open", "**/admin/guardrails/deadletter/**")

    def run(action: str) -> None:
        page.select_option("select[name=action]", action)
        page.click("button[name=index]")
        page.wait_for_selector("#confirm")
        page.screenshot(path=str(ARTIFACTS / f"7-{action}-confirm.png"), full_page=True)
        page.click("#confirm")
        page.wait_for_selector("ul.messagelist")

    # When the operator ticks the second of four rows and runs the action
    page.check(f"input.action-select[value='{records[1].pk}']")
    run(action)
    # Then that record only changed
    statuses = dict(DeadLetter.objects.filter(pk__in=ids).values_list("pk", "status"))
    assert statuses == {pk: ACTIONS[action] if pk == records[1].pk else "open" for pk in ids}
    # When, two rows a page, they tick the page and choose "Select all 3" of the open ones
    monkeypatch.setattr(DeadLetterAdmin, "list_per_page", 2)
    page.goto(f"{live_server.url}/admin/guardrails/deadletter/?status__exact=open")
    page.check("#action-toggle")
    page.click("div.actions span.question a")
    run(action)
    # Then every open record changed, the one on the second page too
    statuses = dict(DeadLetter.objects.filter(pk__in=ids).values_list("pk", "status"))
    connection.close()  # the ORM's connection in Playwright's thread (see above)
    assert statuses == {pk: ACTIONS[action] for pk in ids}


@pytest.fixture
def wide_records(monkeypatch: pytest.MonkeyPatch) -> DeadLetter:
    """Records with long values (a long task name, a UUID task id, a long owner and tenant), schedules in every
    state, and an admin user; written before the browser starts (see ``schedules``)."""
    from django.utils import timezone

    use_app(monkeypatch)
    fill_ledger()
    now = timezone.now()
    record = None
    for n in range(3):
        failure = {
            "task_name": "billing.integrations.payment_providers.tasks.reconcile_settlement_batches",
            "exc_type": "requests.exceptions.HTTPError",
            # The overview's causes name each in words: one as long as a provider's client makes them
            "exc_message": LONG_ERROR
            if n
            else "503 Server Error: Service Unavailable for url: https://api.example.com",
            "traceback": deep_traceback(),
        }
        record = DeadLetter.objects.create(
            **failure,
            fingerprint=fingerprint(**failure),
            task_id=str(uuid.uuid4()),
            reason="retry_budget_exhausted",
            owner="payments-platform-team",
            tenant=f"tenant-{uuid.uuid4().hex}",
            kwargs={"batch": n, "api_token": "[redacted]"},
            first_failed_at=now,
            last_failed_at=now,
        )
    for n in range(3):
        # Jobs of the same long task and tenant: one running with progress, one dead-lettered linking its record
        job = Job(
            task_name=record.task_name if record else "",
            task_id=str(uuid.uuid4()),
            tenant=f"tenant-{uuid.uuid4().hex}",
            created_at=now - timedelta(minutes=5),
            updated_at=now,
            progress_done=1200 * n,
            progress_total=1_000_000,
        )
        job.record("queued", attempt=0, detail="submitted", now=now - timedelta(minutes=5))
        job.record("running", attempt=1, now=now - timedelta(minutes=4))
        job.record("waiting", attempt=1, detail="retry_budget_exhausted: payments-platform-team", now=now)
        if n == 2 and record is not None:
            job.record("dead_lettered", attempt=5, detail="retry_budget_exhausted", now=now)
            job.dead_letter_task_id = record.task_id
            job.error = record.exc_message
        job.save(force_insert=True)
    User.objects.create_superuser("admin", "admin@example.com", "pw-for-tests")
    assert record is not None
    return record


def test_the_admin_pages_fit_a_1366_pixel_screen(wide_records: DeadLetter, live_server: Any, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1366, "height": 768})
    log_in(page, live_server, "/admin/guardrails/deadletter/", "**/admin/guardrails/deadletter/")
    pages = {
        "dead letters": "/admin/guardrails/deadletter/",
        "dead letter": f"/admin/guardrails/deadletter/{wide_records.pk}/change/",
        "overview": "/admin/guardrails/deadletter/overview/",
        "all matching": f"/admin/guardrails/deadletter/bulk/replay/?fingerprint={wide_records.fingerprint}",
        "edit and replay": f"/admin/guardrails/deadletter/{wide_records.pk}/edit-and-replay/",
        "run ledger": "/admin/guardrails/scheduledrun/",
        "schedule health": "/admin/guardrails/scheduledrun/health/",
        "jobs": "/admin/guardrails/job/",
        "job": f"/admin/guardrails/job/{Job.objects.filter(state='dead_lettered').get().pk}/change/",
    }
    too_wide = {}
    for name, path in pages.items():
        page.goto(f"{live_server.url}{path}")
        page.wait_for_selector("#content")
        page.screenshot(path=str(ARTIFACTS / f"1366-{name.replace(' ', '-')}.png"), full_page=True)
        # Neither the page nor a table inside it (the admin lets a wide one scroll on its own) is wider
        width = page.evaluate(
            "Math.max(document.documentElement.scrollWidth,"
            " ...[...document.querySelectorAll('.results, table')].map(e => e.scrollWidth - e.clientWidth + 1366))"
        )
        if width > 1366:
            too_wide[name] = width
    connection.close()
    assert too_wide == {}


#: The longest reasons a record can have (the dashboard charts the five most frequent, then "other").
LONGEST_REASONS = sorted(REASONS, key=len, reverse=True)[:6]
#: A valid owner (the owner option takes 1 to 100 of letters, digits, . : - _) of the longest length, with no
#: place a browser may break a line at.
LONG_OWNER = ("payments_platform_" + "settlement_reconciliation_and_chargebacks_" * 3)[:100]


#: What a provider's client really raises: a long exception message with no place to break in its URL.
LONG_ERROR = (
    "HTTPSConnectionPool(host='api.payments-provider.example.com', port=443): Max retries exceeded with url: "
    "/v1/settlements/batches/2026-12-02/reconcile?include=chargebacks,refunds,disputes,fees&page_size=500 "
    "(Caused by NewConnectionError('<urllib3.connection.HTTPSConnection object at 0x7f3b2c1d9e50>: "
    "Failed to establish a new connection: [Errno 111] Connection refused'))"
)


NO_SEALED_COPY = 'Sealed copy: no — a replay cannot send the original arguments (see "replay").'


def long_history(now: Any) -> list[dict[str, Any]]:
    """Ten attempts as the core records them (ISO times, a Kubernetes pod's host name, the whole error)."""
    return [
        {
            "n": n,
            "start": (now - timedelta(minutes=30 - n)).isoformat(),
            "end": (now - timedelta(minutes=30 - n, seconds=-2)).isoformat(),
            "host": "celery@payments-settlements-worker-eu-west-1a-7f9c8d6b5-x2x4q",
            "class": "transient",
            "rule": "transient_errors: requests.exceptions.ConnectionError",
            "exc": f"requests.exceptions.ConnectionError: {LONG_ERROR}",
            "delay": round(1.5**n, 3),
            "note": "" if n < 10 else "attempts exhausted: max_attempts=10 (the task's option)",
        }
        for n in range(1, 11)
    ]


def deep_traceback() -> str:
    """A 40-frame traceback with long paths and a long source line, as a real client library's."""
    frame = (
        '  File "/srv/app/.venv/lib/python3.12/site-packages/billing/integrations/payment_providers/settlements/'
        'client_{n}.py", line {line}, in _send_with_retries_and_circuit_breaker_and_rate_limiting\n'
        "    response = self._session.request(method, url, params=params, json=payload, timeout=(3.05, 27), "
        "headers={{'Idempotency-Key': key, 'X-Correlation-Id': correlation_id}})\n"
    )
    frames = "".join(frame.format(n=n, line=100 + n) for n in range(40))
    return f"Traceback (most recent call last):\n{frames}requests.exceptions.ConnectionError: {LONG_ERROR}"


@pytest.fixture
def longest_values() -> DeadLetter:
    """Open records of the six longest reasons in the last hour, one with a 100-character owner, a long task
    name and a UUID task id (a long title on its page), a long tenant, a long error, a deep traceback and a
    ten-attempt history, and an admin user; written before the browser starts (see ``schedules``)."""
    from django.utils import timezone

    now = timezone.now()
    record = None
    for position, reason in enumerate(LONGEST_REASONS):
        for n in range(len(LONGEST_REASONS) - position):  # a different count each: a stable order
            record = DeadLetter.objects.create(
                task_name="billing.integrations.payment_providers.settlements.tasks.reconcile_settlement_batches",
                task_id=str(uuid.uuid4()),
                reason=reason,
                owner=LONG_OWNER,
                tenant=f"acme-corporation-international-holdings-europe-{uuid.uuid4().hex}",
                args=[4200 + n, 129900],
                kwargs={"batch": n, "currency": "EUR", "api_token": "[redacted]"},
                exc_type="requests.exceptions.ConnectionError",
                exc_message=LONG_ERROR,
                traceback=deep_traceback(),
                history=long_history(now),
                attempts=10,
                first_failed_at=now - timedelta(minutes=30),
                last_failed_at=now - timedelta(minutes=5),
            )
    User.objects.create_superuser("admin", "admin@example.com", "pw-for-tests")
    assert record is not None
    return record


def boxes(page: Any, selector: str) -> list[dict[str, float]]:
    """The bounding boxes (x, y, width, height in CSS pixels, page coordinates) of what ``selector`` finds."""
    found: list[dict[str, float]] = page.locator(selector).evaluate_all(
        "elements => elements.map(e => { const r = e.getBoundingClientRect();"
        " return {x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height, text: e.textContent}; })"
    )
    assert found, f"nothing matches {selector}"
    return found


def overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return (
        a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and b["y"] < a["y"] + a["height"]
    )


#: Every element of ``root`` (a selector) that a person cannot read whole at this size: past the screen's right
#: edge (unless inside a box that scrolls: what it holds is reached by scrolling it), or holding content wider
#: than itself that it neither wraps nor scrolls (cut off by a hidden overflow, or spilling over its
#: neighbours). A text cut with an ellipsis counts too, unless its whole text is on hover (a title).
#: [{what, why, text}], empty when everything fits.
UNREADABLE = """root => {
  const screen = document.documentElement.clientWidth;
  const scrolls = e => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX);
  const named = e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '')
    + (typeof e.className === 'string' && e.className.trim() ? '.' + e.className.trim().split(/\\s+/).join('.') : '');
  const found = [];
  for (const e of document.querySelectorAll(`${root}, ${root} *`)) {
    const style = getComputedStyle(e);
    if (style.display === 'none' || style.visibility === 'hidden') continue;
    const box = e.getBoundingClientRect();
    if (!box.width && !box.height) continue;
    let inScrollBox = false;
    for (let up = e.parentElement; up; up = up.parentElement) if (scrolls(up)) { inScrollBox = true; break; }
    const text = (e.textContent || '').trim().slice(0, 60);
    if (!inScrollBox && box.right > screen + 0.5)
      found.push({what: named(e), why: `right edge ${Math.round(box.right)} px past the screen's ${screen}`, text});
    const ellipsis = style.textOverflow === 'ellipsis' && e.closest('[title]');
    if (e.clientWidth && !scrolls(e) && !ellipsis && e.scrollWidth > e.clientWidth + 1) {
      // (and which of its elements reaches furthest: what to fix)
      const widest = [...e.querySelectorAll('*')].reduce(
        (a, b) => (b.getBoundingClientRect().right > (a ? a.getBoundingClientRect().right : -1) ? b : a), null);
      const why = `${e.scrollWidth} px in ${e.clientWidth} (overflow ${style.overflowX})`;
      found.push({what: named(e), why: `${why}, widest ${widest ? named(widest) : 'text'}`, text});
    }
  }
  return found;
}"""


def unreadable(page: Any, root: str = "#content") -> list[str]:
    return [
        f"{item['what']}: {item['why']} [{' '.join(item['text'].split())}]" for item in page.evaluate(UNREADABLE, root)
    ]


def test_long_real_values_keep_the_layout_at_1366_pixels(
    longest_values: DeadLetter, live_server: Any, browser: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = use_app(monkeypatch)
    app.conf.guardrails = {**app.conf.guardrails, "activity": False}
    width = 1366
    page = browser.new_page(viewport={"width": width, "height": 768})
    log_in(page, live_server, "/admin/guardrails/deadletter/", "**/admin/guardrails/deadletter/")
    # When the change list shows records with a 100-character owner, long tenants, long errors and the longest
    # reasons
    page.wait_for_selector("#result_list")
    page.screenshot(path=str(ARTIFACTS / "1366-long-values-list.png"), full_page=True)
    # Then every column, the last one too, is inside the screen and inside the list's box (which would scroll)
    (results,) = boxes(page, "#changelist .results")
    edge = min(width, results["x"] + results["width"])
    columns = boxes(page, "#result_list thead th")
    outside = [c["text"].strip() for c in columns if c["x"] + c["width"] > edge + 0.5]
    assert outside == [], f"columns past {edge} px: {outside}"
    # and nothing on the page is cut off or past the screen, and the list needs no sideways scrolling
    assert unreadable(page) == []
    assert page.evaluate("(e => e.scrollWidth - e.clientWidth)(document.querySelector('#changelist .results'))") <= 1
    # and each row says which record it is: its id, its error, its arguments (the redacted one redacted)
    row = page.locator(f"#result_list tr:has(a[href*='/deadletter/{longest_values.pk}/change/'])").inner_text()
    assert f"#{longest_values.pk}" in row and longest_values.task_id[:8] in row
    assert "ConnectionError: HTTPSConnectionPool(host=" in row
    assert "4200, 129900, " in row and "api_token=[redacted]" in row
    # When the dashboard charts the six longest reasons
    page.goto(f"{live_server.url}/admin/guardrails/dashboard/")
    page.wait_for_selector("#dl-reasons-chart")
    page.screenshot(path=str(ARTIFACTS / "1366-long-values-dashboard.png"), full_page=True)
    # Then no two names of its legend overlap, and each is inside the screen
    legend = boxes(page, ".gr-figure:has(#dl-reasons-chart) .gr-legend li")
    names = [item["text"].strip() for item in legend]
    assert [name for name in LONGEST_REASONS[:5] if name not in names] == []
    crossed = [(a["text"], b["text"]) for i, a in enumerate(legend) for b in legend[i + 1 :] if overlap(a, b)]
    assert crossed == [], f"legend names overlap: {crossed}"
    assert [item["text"] for item in legend if item["x"] + item["width"] > width + 0.5] == []
    # and the owner's table stays on the screen, and nothing on the page is cut off
    owners = boxes(page, "table#open-dead-letters td")
    assert [cell["text"] for cell in owners if cell["x"] + cell["width"] > width + 0.5] == []
    assert unreadable(page) == []
    # When a record with a long task name and id, a ten-attempt history and a deep traceback is opened
    page.goto(f"{live_server.url}/admin/guardrails/deadletter/{longest_values.pk}/change/")
    page.wait_for_selector("a.replay-link")
    page.screenshot(path=str(ARTIFACTS / "1366-long-values-record.png"), full_page=True)
    # Then its title does not run under the Replay buttons, and neither leaves the screen
    (title,) = boxes(page, "#content h2")
    buttons = boxes(page, ".object-tools li")
    assert [b["text"].strip() for b in buttons if overlap(title, b)] == []
    assert [b["text"].strip() for b in [title, *buttons] if b["x"] + b["width"] > width + 0.5] == []
    # and all ten attempts and the whole traceback are there, none of it cut off or past the screen (the
    # history's box would scroll, visibly, rather than hide a column)
    assert page.locator("table.attempt-history tbody tr").count() == 10
    page.locator("div.field-attempt_history").screenshot(path=str(ARTIFACTS / "1366-long-values-history.png"))
    assert unreadable(page) == []
    (history,) = boxes(page, "table.attempt-history")
    (row,) = boxes(page, "div.form-row.field-attempt_history")
    assert history["x"] + history["width"] <= row["x"] + row["width"] + 0.5
    assert "Connection refused'))" in page.locator("div.field-traceback_text pre").inner_text()
    # and the stored arguments are said in words, not a bare "no"
    said = " ".join(page.locator("div.field-stored_arguments .stored-arguments").inner_text().split())
    assert said == "As JSON, with secrets redacted. " + NO_SEALED_COPY
    connection.close()  # the ORM's connection in Playwright's thread (see above)


@pytest.fixture
def admin_user() -> None:
    """An admin user, written before the browser starts (see ``schedules``)."""
    User.objects.create_superuser("admin", "admin@example.com", "pw-for-tests")


def test_an_empty_chart_says_so_at_1366_pixels(
    admin_user: None, live_server: Any, browser: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given no dead letter at all
    app = use_app(monkeypatch)
    app.conf.guardrails = {**app.conf.guardrails, "activity": False}
    page = browser.new_page(viewport={"width": 1366, "height": 768})
    # When an operator opens the dashboard
    log_in(page, live_server, "/admin/guardrails/dashboard/", "**/admin/guardrails/dashboard/")
    page.wait_for_selector("#dl-reasons-chart")
    page.screenshot(path=str(ARTIFACTS / "1366-empty-dashboard.png"), full_page=True)
    # Then the chart says there is no data, in itself and under it, and names no tallest bar
    figure = page.locator(".gr-figure:has(#dl-reasons-chart)")
    assert figure.locator("svg text.gr-no-data").text_content() == "no data in this window"
    assert figure.locator(".gr-legend").inner_text().strip() == "no data in this window"
    assert "tallest bar" not in page.locator("#content").inner_text()
    # and its text is inside the chart, and nothing on the page is cut off
    (chart,) = boxes(page, "#dl-reasons-chart")
    (said,) = boxes(page, "#dl-reasons-chart text.gr-no-data")
    assert chart["x"] <= said["x"] and said["x"] + said["width"] <= chart["x"] + chart["width"]
    assert unreadable(page) == []
    connection.close()  # the ORM's connection in Playwright's thread (see above)


def test_an_outage_of_10000_records_is_replayed_by_cause_in_the_background(
    celery_worker: Any, live_server: Any, browser: Any
) -> None:
    """#34's walk: 10,000 records, filtered to one cause from the overview, the count first, all of them replayed
    as a job whose progress is watched to the end, each record replayed once."""
    from django.utils import timezone

    assert bulk_dead_letters.name in celery_worker.app.tasks
    now = timezone.now()
    causes = {
        "ConnectionError": ("requests.exceptions.ConnectionError", "provider {n} unreachable", 1_000),
        "Timeout": ("requests.exceptions.Timeout", "read timed out after {n}s", 5_000),
        "KeyError": ("builtins.KeyError", "'order {n}'", 4_000),
    }
    rows = []
    for name, (exc_type, message, count) in causes.items():
        failure = {"task_name": tasks.observe.name, "exc_type": exc_type, "exc_message": message, "traceback": ""}
        cause = fingerprint(**failure)
        rows += [
            DeadLetter(
                **{**failure, "exc_message": message.format(n=n)},
                fingerprint=cause,
                task_id=f"{name}-{n}-{uuid.uuid4().hex[:8]}",
                reason="circuit_open",
                args=[n],
                first_failed_at=now - timedelta(minutes=n % 60),
                last_failed_at=now - timedelta(seconds=n % 3600),
            )
            for n in range(count)
        ]
    DeadLetter.objects.bulk_create(rows, batch_size=2_000)
    User.objects.create_superuser("admin", "admin@example.com", "pw-for-tests")
    unreachable = DeadLetter.objects.filter(exc_type="requests.exceptions.ConnectionError").values_list(
        "fingerprint", flat=True
    )[0]
    page = browser.new_page(viewport={"width": 1366, "height": 768})

    def shot(name: str) -> None:
        page.screenshot(path=str(ARTIFACTS / f"outage-{name}.png"), full_page=True)

    # When an operator opens the overview and follows the cause of the provider being unreachable
    log_in(page, live_server, "/admin/guardrails/deadletter/overview/", "**/deadletter/overview/")
    shot("1-overview")
    page.click(f"#by-cause a[href*='fingerprint={unreachable}']")
    page.wait_for_url(f"**fingerprint={unreachable}**")
    shot("2-cause")
    # asks to replay all matching: the count comes first
    page.click("#bulk-replay")
    page.wait_for_selector("#bulk-count")
    assert "1000 open dead letters match" in page.inner_text("#bulk-count")
    assert page.inner_text("#bulk-refused-none") == "The replay refuses none of the first 1000."
    shot("3-count")
    # confirms, and watches the job's page (reloading it) until the job ends
    page.click("#confirm")
    page.wait_for_url("**/admin/guardrails/job/**/change/")
    shot("4-job-queued")
    # (the job's message goes out through the outbox, as every job's does by default: the relay a deployment runs)
    from io import StringIO

    from django.core.management import call_command

    call_command("guardrails_outbox_relay", "--once", stdout=StringIO())
    seen = []
    deadline = time.monotonic() + 120
    while "succeeded" not in (state := page.inner_text(".field-state .readonly").lower()):
        assert time.monotonic() < deadline, f"the job still reads {state!r}, its progress {seen[-5:]}"
        seen.append(page.inner_text(".field-progress_done .readonly"))
        time.sleep(0.5)
        page.reload()
    shot("5-job-succeeded")
    assert page.inner_text(".field-progress_done .readonly").replace(",", "") == "1000"
    assert page.inner_text(".field-progress_total .readonly").replace(",", "") == "1000"
    connection.close()  # the ORM's connection in Playwright's thread (see above)
    # Then every record of that cause is replayed once (its own new task id), and no other record is touched
    replayed = DeadLetter.objects.filter(fingerprint=unreachable)
    assert set(replayed.values_list("status", flat=True)) == {"replayed"}
    assert len(set(replayed.values_list("replayed_task_id", flat=True))) == 1_000
    assert DeadLetter.objects.exclude(fingerprint=unreachable).filter(status="open").count() == 9_000
    # And each of the two batches wrote its entry in the admin's history
    assert LogEntry.objects.filter(change_message__startswith="Bulk replay: 500 of 500").count() == 2
