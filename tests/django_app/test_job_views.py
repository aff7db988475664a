"""Jobs a user can poll, over HTTP: a real view answers 202 with the job's status URL, polled with the Django test
client until ``succeeded`` while a real embedded worker runs the job; the status view answers the job's tenant
only (another tenant, an anonymous user and an unknown id all get the same 404), a ``job_reader`` hook decides
instead when set; a job not terminal is ``no-store`` with a ``Retry-After`` hint, a terminal one cacheable.
"""

from __future__ import annotations

import json
import logging
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from celery_guardrails.guardrails.jobs import QUEUED
from django_celery_guardrails.jobs import accepted
from django_celery_guardrails.models import Job
from django_celery_guardrails.scoping import tenant_permission
from tests.conftest import Sink
from tests.proj import django_tasks  # noqa: F401  (registers build_report with the embedded worker's app)
from tests.support.waiting import wait_for
from tests.testapp.models import Effect

TIMEOUT = 30


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"], "job_outbox": False}
    return celery_app


def user(**fields: Any) -> Any:
    return get_user_model().objects.create_user(f"u{uuid.uuid4().hex[:8]}", password=None, **fields)


def staff(*permissions: Permission) -> Any:
    member = user(is_staff=True)
    member.user_permissions.add(*permissions)
    return get_user_model().objects.get(pk=member.pk)  # permissions are cached on the instance


def client_of(member: Any = None) -> Client:
    client = Client()
    if member is not None:
        client.force_login(member)
    return client


def make_job(*, tenant: str = "acme", state: str = QUEUED, due_in: float | None = None) -> Job:
    """A job row as the job book writes it, moved to ``state`` (``due_in`` seconds from now when waiting)."""
    now = timezone.now()
    job = Job(
        task_name="tests.report",
        task_id=uuid.uuid4().hex,
        tenant=tenant,
        correlation_id=uuid.uuid4().hex,
        created_at=now,
        updated_at=now,
    )
    job.record(QUEUED, detail="submitted", now=now)
    if state != QUEUED:
        job.record(state, attempt=1, now=now)
    job.due_at = now + timedelta(seconds=due_in) if due_in is not None else None
    job.save(force_insert=True)
    return job


def url(job: Job) -> str:
    return reverse("guardrails:job-status", kwargs={"id": job.pk})


@pytest.mark.urls("tests.testapp.urls")
@pytest.mark.django_db(transaction=True)
def test_a_view_answers_202_with_a_location_polled_until_succeeded(celery_worker: Any, sink: Sink) -> None:
    # Given a user of tenant acme (the example project's tenant_resolver reads X-Tenant)
    client = client_of(user())
    # When they submit a report through a real view (the job holds 2 s in running, after its effect)
    report = f"report-{uuid.uuid4().hex[:8]}"
    response = client.post("/reports/", {"name": report, "sink": sink.key, "hold": "2"}, headers={"X-Tenant": "acme"})
    # Then the view answers 202, the job's status URL in Location and in the body with its id
    assert response.status_code == 202
    job = Job.objects.get()
    location = response["Location"]
    assert location == f"http://testserver/guardrails/jobs/{job.pk}/"
    assert response.json() == {"id": str(job.pk), "state": "queued", "status_url": location}
    assert job.tenant == "acme"
    # When they poll the Location until the job is terminal, while the worker runs it
    answers = []

    def poll() -> bool:
        answers.append(answer := client.get(location, headers={"X-Tenant": "acme"}))
        assert answer.status_code == 200
        return bool(answer.json()["terminal"])

    wait_for(f"job {job.pk} terminal", poll, timeout=TIMEOUT)
    # Then it succeeded, with its effect
    *polled, last = answers
    body = last.json()
    assert (body["id"], body["task"], body["state"], body["attempt"]) == (str(job.pk), job.task_name, "succeeded", 1)
    assert body["finished_at"] and body["started_at"] and body["error"] == ""
    assert Effect.objects.filter(key=report).count() == 1
    # And every answer before it was running or queued, not to be cached, with a hint of when to ask again
    assert "running" in {answer.json()["state"] for answer in polled}
    assert {(a.json()["state"], a["Cache-Control"], a["Retry-After"]) for a in polled} <= {
        ("queued", "no-store", "2"),
        ("running", "no-store", "1"),
    }
    # And the final answer has no hint, and is cacheable by this user, with an ETag that a revalidation matches
    assert not last.has_header("Retry-After")
    assert last["Cache-Control"] == "private, max-age=3600" and last["ETag"]
    again = client.get(location, headers={"X-Tenant": "acme", "If-None-Match": last["ETag"]})
    assert again.status_code == 304 and again["ETag"] == last["ETag"]


@pytest.mark.django_db
def test_another_tenant_and_an_anonymous_user_get_the_404_of_a_job_that_does_not_exist() -> None:
    # Given a job of tenant acme
    job = make_job(tenant="acme")
    member = user()
    # Then a user of acme reads it
    assert client_of(member).get(url(job), headers={"X-Tenant": "acme"}).status_code == 200
    # And a user of globex, an anonymous request naming acme and a user without a tenant get a 404
    missing = client_of(member).get(url(Job(id=uuid.uuid4())), headers={"X-Tenant": "acme"})
    refused = [
        client_of(member).get(url(job), headers={"X-Tenant": "globex"}),
        client_of().get(url(job), headers={"X-Tenant": "acme"}),
        client_of(member).get(url(job)),
    ]
    assert [answer.status_code for answer in refused] == [404, 404, 404] == [missing.status_code] * 3
    # And nothing tells them from the answer about an id that does not exist
    assert {answer.content for answer in refused} == {missing.content}


@pytest.mark.django_db
def test_a_job_without_a_tenant_is_read_by_a_signed_in_user_without_one() -> None:
    # Given a job without a tenant
    job = make_job(tenant="")
    # Then a signed-in request without a tenant reads it; one with a tenant, or anonymous, does not
    assert client_of(user()).get(url(job)).status_code == 200
    assert client_of(user()).get(url(job), headers={"X-Tenant": "acme"}).status_code == 404
    assert client_of().get(url(job)).status_code == 404


@pytest.mark.django_db
def test_staff_read_the_jobs_of_the_tenants_the_admin_shows_them(settings: Any) -> None:
    # Given tenant scoping by permission, jobs of acme and globex, and staff who may view jobs
    settings.CELERY_GUARDRAILS = {**settings.CELERY_GUARDRAILS, "admin_tenants": "permissions"}
    acme, globex = make_job(tenant="acme"), make_job(tenant="globex")
    view_job = Permission.objects.get(content_type__app_label="guardrails", codename="view_job")
    every_tenant = Permission.objects.get(content_type__app_label="guardrails", codename="view_all_tenants")
    # Then staff with view_all_tenants read every tenant's job, without a tenant of their own
    everyone = client_of(staff(view_job, every_tenant))
    assert [everyone.get(url(job)).status_code for job in (acme, globex)] == [200, 200]
    # And staff who see acme only read acme's job only
    acme_staff = client_of(staff(view_job, tenant_permission("acme")))
    assert [acme_staff.get(url(job)).status_code for job in (acme, globex)] == [200, 404]
    # And staff who see every tenant but may not view jobs, or a user with the permissions who is not staff, read none
    no_view = client_of(staff(every_tenant))
    not_staff = user()
    not_staff.user_permissions.add(view_job, every_tenant)
    assert [c.get(url(acme)).status_code for c in (no_view, client_of(not_staff))] == [404, 404]


@pytest.mark.django_db
def test_a_job_reader_hook_decides_who_reads_a_job(settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    # Given a job of acme and a job_reader that lets read whoever sends the job's correlation id, nobody else
    settings.CELERY_GUARDRAILS = {**settings.CELERY_GUARDRAILS, "job_reader": "tests.testapp.views.reader_by_header"}
    job = make_job(tenant="acme")
    # Then an anonymous request with the key reads it, and its own tenant's user without the key does not
    assert client_of().get(url(job), headers={"X-Job-Key": job.correlation_id}).status_code == 200
    assert client_of(user()).get(url(job), headers={"X-Tenant": "acme"}).status_code == 404
    # And a hook that fails lets nobody read it (a 404, not a 500), and says why in the log
    settings.CELERY_GUARDRAILS = {**settings.CELERY_GUARDRAILS, "job_reader": "tests.testapp.views.broken_reader"}
    with caplog.at_level(logging.ERROR, logger="django_celery_guardrails.jobs"):
        assert client_of().get(url(job), headers={"X-Job-Key": job.correlation_id}).status_code == 404
    assert f"job_reader tests.testapp.views.broken_reader failed for job {job.pk}" in caplog.text


@pytest.mark.django_db
def test_retry_after_is_hinted_while_a_job_is_not_terminal_and_a_terminal_one_is_cacheable() -> None:
    client = client_of(user())

    def answer(job: Job) -> Any:
        response = client.get(url(job), headers={"X-Tenant": "acme"})
        assert response.status_code == 200
        return response

    # Given jobs in each state that is not terminal, Then none may be cached and each says when to ask again:
    # queued 2 s, running 1 s, waiting or retrying when due (at least 1 s, at most 60 s), 2 s when not known
    hints = {
        ("queued", None): "2",
        ("running", None): "1",
        ("waiting", 3600.0): "60",
        ("retrying", -5.0): "1",
        ("waiting", None): "2",
    }
    for (state, due_in), hint in hints.items():
        response = answer(make_job(state=state, due_in=due_in))
        assert (response["Cache-Control"], response["Retry-After"]) == ("no-store", hint), state
    due = int(answer(make_job(state="waiting", due_in=20.0))["Retry-After"])
    assert 10 < due <= 20
    # And terminal ones have no hint: a succeeded or cancelled one is cached an hour, a failed or dead-lettered
    # one (a replay may move it again) a minute, each with an ETag
    cached = {"succeeded": 3600, "cancelled": 3600, "failed": 60, "dead_lettered": 60}
    for state, max_age in cached.items():
        response = answer(make_job(state=state))
        assert not response.has_header("Retry-After"), state
        assert (response["Cache-Control"], response.json()["terminal"]) == (f"private, max-age={max_age}", True)
        assert response["ETag"].startswith('"')


@pytest.mark.django_db
def test_accepted_answers_202_with_the_status_url() -> None:
    # Given a job
    job = make_job(tenant="acme")
    # When a view hands it over with accepted(), Then 202, Location the status path, the body its id and state
    response = accepted(job)
    assert (response.status_code, response["Location"], response["Cache-Control"]) == (202, url(job), "no-store")
    assert json.loads(response.content) == {"id": str(job.pk), "state": "queued", "status_url": url(job)}
