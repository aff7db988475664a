"""The jobs' admin (#32 point 6): the list with its columns, filters (tenant, state, task, age) and search, the
link to a job's dead letter, tenant scoping (``admin_tenants = "permissions"``), the read-only job page with its
history, and "Cancel selected jobs" (its permission, confirmation page, LogEntry and message; on a real worker,
the cancelled job's message does not run)."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

import pytest
from celery.exceptions import TaskRevokedError
from django.conf import LazySettings
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_celery_guardrails.maintenance import cancel_jobs
from django_celery_guardrails.models import DeadLetter, Job
from django_celery_guardrails.outbox import relay
from django_celery_guardrails.scoping import tenant_permission
from tests.conftest import Sink
from tests.django_app.test_legible_pages import DJANGO_FORMAT, MOMENT
from tests.proj import django_tasks
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db
LIST = "admin:guardrails_job_changelist"
TIMEOUT = 30


def job(
    *,
    task: str = "shop.tasks.build_report",
    tenant: str = "",
    state: str = "queued",
    age: timedelta = timedelta(minutes=5),
    **fields: Any,
) -> Job:
    """A job as the worker leaves it, submitted ``age`` ago, with a history that ends in ``state``."""
    submitted = timezone.now() - age
    row = Job(task_name=task, task_id=str(uuid.uuid4()), tenant=tenant, created_at=submitted, updated_at=submitted)
    row.record("queued", attempt=0, detail="submitted", now=submitted)
    if state != "queued":
        row.record("running", attempt=1, now=submitted + timedelta(seconds=1))
        if state != "running":
            row.record(state, attempt=fields.pop("attempt", 1), detail=fields.pop("detail", ""), now=timezone.now())
    for name, value in fields.items():
        setattr(row, name, value)
    row.save(force_insert=True)
    return row


def listed(client: Client, **query: str) -> set[str]:
    """The ids of the jobs the change list shows for ``query``."""
    page = client.get(reverse(LIST), query)
    assert page.status_code == 200, page.content[:500]
    return set(re.findall(r'name="_selected_action" value="([0-9a-f-]{36})"', page.content.decode()))


def test_the_list_shows_each_jobs_columns_and_links_its_dead_letter(admin_client: Client) -> None:
    # Given a running job with progress, and a dead-lettered one whose dead letter was recorded
    running = job(state="running", progress_done=3, progress_total=5, tenant="acme")
    failed = job(state="dead_lettered", detail="permanent", attempt=2, error="PermanentError: broken")
    now = timezone.now()
    letter = DeadLetter.objects.create(
        task_name=failed.task_name, task_id=failed.task_id, reason="permanent", first_failed_at=now, last_failed_at=now
    )
    Job.objects.filter(pk=failed.pk).update(dead_letter_task_id=failed.task_id)
    # When an admin opens the list
    html = admin_client.get(reverse(LIST)).content.decode()
    # Then each job shows its id (start), task, state, attempt, progress and tenant
    assert str(running.pk)[:8] in html and "build_report" in html
    assert 'attempt 1</span>, <span class="job-progress">3/5' in html
    assert "attempt 2</span>" in html and "dead-lettered" in html
    assert 'title="acme">acme<' in html
    # And its times one way (submitted and finished), never Django's format
    assert len(MOMENT.findall(html)) >= 3 and not DJANGO_FORMAT.findall(html)
    # And the dead-lettered job links its dead letter's page
    link = reverse("admin:guardrails_deadletter_change", args=[letter.pk])
    assert f'href="{link}"' in html


def test_the_filters_take_tenant_state_task_and_age(admin_client: Client) -> None:
    # Given jobs of two tenants, two tasks, in several states, submitted minutes, hours and weeks ago
    fresh = job(tenant="acme", state="running", age=timedelta(minutes=5))
    today = job(tenant="globex", state="succeeded", age=timedelta(hours=5), task="shop.tasks.export")
    last_week = job(tenant="acme", state="failed", age=timedelta(days=3))
    old = job(tenant="", state="cancelled", age=timedelta(days=40), task="shop.tasks.export")
    every = {str(j.pk) for j in (fresh, today, last_week, old)}
    # Then each filter keeps its own jobs
    assert listed(admin_client) == every
    assert listed(admin_client, tenant="acme") == {str(fresh.pk), str(last_week.pk)}
    assert listed(admin_client, state__exact="succeeded") == {str(today.pk)}
    assert listed(admin_client, task_name="shop.tasks.export") == {str(today.pk), str(old.pk)}
    assert listed(admin_client, submitted="hour") == {str(fresh.pk)}
    assert listed(admin_client, submitted="day") == {str(fresh.pk), str(today.pk)}
    assert listed(admin_client, submitted="week") == {str(fresh.pk), str(today.pk), str(last_week.pk)}
    assert listed(admin_client, submitted="older") == {str(old.pk)}
    # And the side bar offers them (the tenants and tasks that have jobs, the ages)
    html = admin_client.get(reverse(LIST)).content.decode()
    for choice in ("?tenant=globex", "?task_name=shop.tasks.export", "?submitted=older", "?state__exact=waiting"):
        assert choice in html.replace("&amp;", "&"), choice
    # And a filter the list does not have is a 400, not a query
    assert admin_client.get(reverse(LIST), {"error__contains": "x"}).status_code == 400


def test_search_finds_a_job_by_its_id_or_its_task_id(admin_client: Client) -> None:
    # Given two jobs
    first, second = job(), job()
    # Then the exact job id or task id finds one; anything else none (never a 500 on the UUID column)
    assert listed(admin_client, q=str(first.pk)) == {str(first.pk)}
    assert listed(admin_client, q=second.task_id) == {str(second.pk)}
    assert listed(admin_client, q="not-a-job") == set()


def staff_user(name: str, *extra: Permission) -> User:
    user = User.objects.create_user(name, is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="guardrails", codename__in=["view_job", "change_job"]),
        *extra,
    )
    return User.objects.get(pk=user.pk)


def test_a_user_without_view_all_tenants_sees_and_cancels_their_tenants_jobs_only(settings: LazySettings) -> None:
    # Given jobs of acme, globex and none, and acme's staff scoped by a permission per tenant
    settings.CELERY_GUARDRAILS = {**settings.CELERY_GUARDRAILS, "admin_tenants": "permissions"}
    mine = job(tenant="acme")
    theirs = job(tenant="globex")
    nobodys = job(tenant="")
    client = Client()
    client.force_login(staff_user("acme-staff", tenant_permission("acme")))
    # Then the list, the tenant filter's choices and a search show acme's jobs only
    assert listed(client) == {str(mine.pk)}
    html = client.get(reverse(LIST)).content.decode()
    assert "?tenant=acme" in html and "globex" not in html
    assert listed(client, q=str(theirs.pk)) == set()
    # And another tenant's job page is a 404, as a job that does not exist
    assert client.get(reverse("admin:guardrails_job_change", args=[theirs.pk])).status_code == 404
    assert client.get(reverse("admin:guardrails_job_change", args=[mine.pk])).status_code == 200
    # And an action posted with another tenant's id by hand leaves that job alone
    action = {"action": "cancel_selected", "_selected_action": [str(theirs.pk), str(nobodys.pk)], "post": "yes"}
    client.post(reverse(LIST), action)
    assert set(Job.objects.values_list("state", flat=True)) == {"queued"}
    # And the function behind it, given the user, does the same
    user = User.objects.get(username="acme-staff")
    done = cancel_jobs(Job.objects.all(), user=user)
    assert (done.cancelled, done.requested, done.unchanged) == ((str(mine.pk),), (), ())
    assert Job.objects.get(pk=theirs.pk).state == "queued"


def test_the_job_page_is_read_only_with_its_history_as_a_table_and_its_dead_letter(admin_client: Client) -> None:
    # Given a job dead-lettered after a retry, its dead letter recorded
    row = job(state="dead_lettered", detail="permanent", attempt=2, error="PermanentError: broken\u202etxt")
    row.history.insert(2, {"state": "retrying", "at": timezone.now().isoformat(), "attempt": 1, "detail": "503"})
    now = timezone.now()
    letter = DeadLetter.objects.create(
        task_name=row.task_name, task_id=row.task_id, reason="permanent", first_failed_at=now, last_failed_at=now
    )
    Job.objects.filter(pk=row.pk).update(dead_letter_task_id=row.task_id, history=row.history)
    # When an admin opens its page
    page = admin_client.get(reverse("admin:guardrails_job_change", args=[row.pk]))
    html = page.content.decode()
    # Then it has no Save, no Delete, and its fields are read only
    assert page.status_code == 200
    assert 'name="_save"' not in html and "deletelink" not in html
    # And the history is a table, a row per transition, oldest first, moments one way
    table = re.search(r'<table class="job-history">(.*?)</table>', html, re.S)
    assert table is not None
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", table.group(1))][1:]
    assert [c[1:] for c in cells] == [
        ["queued", "0", "submitted"],
        ["running", "1", ""],
        ["retrying", "1", "503"],
        ["dead_lettered", "2", "permanent"],
    ]
    assert all(MOMENT.fullmatch(c[0]) for c in cells) and not DJANGO_FORMAT.findall(html)
    # And the error's control character is written out, and the dead letter is a link to its page
    assert "\u202e" not in html and "\\u202e" in html
    assert f'href="{reverse("admin:guardrails_deadletter_change", args=[letter.pk])}"' in html


def test_cancel_is_offered_only_with_the_permission(settings: LazySettings) -> None:
    # Given a queued job and a staff user who may view jobs, not change them
    row = job()
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(content_type__app_label="guardrails", codename="view_job"))
    client = Client()
    client.force_login(viewer)
    # Then the list has no cancel action, and posting it by hand changes nothing
    assert "cancel_selected" not in client.get(reverse(LIST)).content.decode()
    client.post(reverse(LIST), {"action": "cancel_selected", "_selected_action": [str(row.pk)], "post": "yes"})
    assert Job.objects.get(pk=row.pk).state == "queued"
    # And the action itself refuses a user without the permission, whoever calls it
    from django.contrib import admin
    from django.core.exceptions import PermissionDenied
    from django.test import RequestFactory

    request = RequestFactory().post(reverse(LIST), {"post": "yes"})
    request.user = viewer
    with pytest.raises(PermissionDenied):
        admin.site._registry[Job].cancel_selected(request, Job.objects.all())  # type: ignore[attr-defined]


@pytest.mark.django_db(transaction=True)
def test_cancel_selected_jobs_confirms_then_cancels_logs_and_reports_and_the_worker_skips_them(
    celery_app: Any, celery_worker: Any, sink: Sink, admin_client: Client
) -> None:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"], "job_outbox": True}
    # Given a job whose message is still in the outbox, a running one (held in its body), and a finished one
    waiting = django_tasks.build_report.submit(report := f"report-{uuid.uuid4().hex[:8]}", sink.key)
    done = job(state="succeeded")
    running = job(state="running")
    ids = [str(waiting.pk), str(done.pk), str(running.pk)]
    # When an admin picks "Cancel selected jobs"
    asked = admin_client.post(reverse(LIST), {"action": "cancel_selected", "_selected_action": ids})
    # Then a confirmation page names the jobs and says a running one runs to its end; nothing changed yet
    page = asked.content.decode()
    assert asked.status_code == 200 and "Are you sure you want to cancel these jobs?" in page
    assert all(pk in page for pk in ids) and "1 of them is running" in page
    assert Job.objects.get(pk=waiting.pk).state == "queued"
    # When they confirm
    answer = {"action": "cancel_selected", "_selected_action": ids, "post": "yes"}
    confirmed = admin_client.post(reverse(LIST), answer, follow=True)
    # Then the queued job is cancelled, the running one asked to cancel, the finished one untouched
    waiting.refresh_from_db()
    assert waiting.state == "cancelled" and [e["state"] for e in waiting.history] == ["queued", "cancelled"]
    assert Job.objects.get(pk=running.pk).cancel_requested_at is not None
    assert Job.objects.get(pk=running.pk).state == "running" and Job.objects.get(pk=done.pk).state == "succeeded"
    # And one LogEntry per job changed says what was done, and the messages say it too
    logged = {e.object_id: e.change_message for e in LogEntry.objects.filter(action_flag=CHANGE)}
    assert logged == {str(waiting.pk): "Cancelled", str(running.pk): "Cancel requested while running"}
    shown = [str(m) for m in confirmed.context["messages"]]
    assert "Cancelled 1 job(s)." in shown
    assert "1 running job(s) asked to cancel: each runs to its end." in shown
    assert "1 job(s) left as they were (already final, or a cancel already asked)." in shown
    # And when the cancelled job's message is published all the same, the worker does not run its body
    assert relay(celery_app).published == 1
    with pytest.raises(TaskRevokedError):
        celery_app.AsyncResult(waiting.task_id).get(timeout=TIMEOUT)
    assert sink.items() == [] and not Effect.objects.filter(key=report).exists()
    assert Job.objects.get(pk=waiting.pk).state == "cancelled"
