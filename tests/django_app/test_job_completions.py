"""Completions over the queue, on a real embedded worker (the trusted consumer, with the Django app) and the test
database: a separate process with no database settings and no Django (``tests.proj.sandboxed``: a plain Celery app
holding the broker URL only) reports a job's completion with ``report_completion()``; delivered twice, it is
applied once; met before the job's record is committed, it waits and is applied once the record is there; a job
that never appears is a dead letter ``record_missing``; a completion sent as another tenant is never applied.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from celery_guardrails import RecordNotThereYet, signals, tenant_context
from celery_guardrails.jobs import COMPLETION_TASK
from django_celery_guardrails.completions import COMPLETED_DETAIL, apply_completion
from django_celery_guardrails.jobs import hand_off
from django_celery_guardrails.models import DeadLetter, Job
from django_celery_guardrails.tasks import job_completion
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, proj_env

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 30
#: How long after the completion's publish the job's record is committed.
COMMIT_AFTER = 2.0


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"]}
    assert job_completion.name in celery_app.tasks  # the Django app's consumer, on the embedded worker
    return celery_app


@pytest.fixture
def waits() -> Iterator[list[dict[str, Any]]]:
    """The waits the embedded worker scheduled (retry_scheduled, sent in this process), as they happen."""
    seen: list[dict[str, Any]] = []

    def keep(sender: Any = None, task_id: str = "", kind: str = "", rule: str = "", **_: Any) -> None:
        seen.append({"task_id": task_id, "kind": kind, "rule": rule})

    signals.retry_scheduled.connect(keep, weak=False)
    yield seen
    signals.retry_scheduled.disconnect(keep)


def sandboxed(queue: str, job_id: Any, output_ref: str, tenant: str | None, *, times: int = 1) -> list[str]:
    """Run the sandboxed reporter (tests.proj.sandboxed) in its own process, with the broker URL and the queue
    only: none of the test database's settings, no Django settings module. The task ids it sent."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("GUARDRAILS_TEST_DB", "PG", "DATABASE", "DJANGO"))
    }
    env.update(proj_env(queue=queue, django=False), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "tests.proj.sandboxed", str(job_id), output_ref, tenant or "", str(times)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["django_loaded"] == []  # it reported without Django's settings or database layer
    return list(report["sent"])


def make_job(*, tenant: str = "acme", state: str = "queued") -> Job:
    """A job whose work a sandboxed worker does, as the job book writes it."""
    now = timezone.now()
    job = Job(task_name="tests.render", task_id=uuid.uuid4().hex, tenant=tenant, created_at=now, updated_at=now)
    job.record("queued", detail="submitted", now=now)
    if state != "queued":
        job.record(state, now=now)
    job.save(force_insert=True)
    return job


def succeeded_entries(job: Job) -> list[dict[str, Any]]:
    job.refresh_from_db()
    return [entry for entry in job.history if entry["state"] == "succeeded"]


def test_a_completion_from_a_process_without_a_database_delivered_twice_is_applied_once(
    celery_app: Any, celery_worker: Any, queue_name: str
) -> None:
    # Given a job of tenant acme, queued while a sandboxed worker does its work
    job = make_job(tenant="acme")
    # When the sandbox, with no database settings, reports its completion twice
    first, second = sandboxed(queue_name, job.pk, "s3://reports/42.csv", "acme", times=2)
    # Then both messages are handled, and the job succeeded once, with the output's reference
    for task_id in (first, second):
        assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT) == "applied"
    (entry,) = succeeded_entries(job)
    assert (job.state, job.output_ref, entry["detail"]) == ("succeeded", "s3://reports/42.csv", COMPLETED_DETAIL)
    assert [e["state"] for e in job.history] == ["queued", "succeeded"] and job.finished_at is not None


def test_a_completion_that_meets_its_job_before_it_is_committed_waits_and_is_applied_once(
    celery_app: Any, celery_worker: Any, queue_name: str, waits: list[dict[str, Any]]
) -> None:
    # Given a job written in a transaction that stays open 2 s after the sandbox's completion was published
    with transaction.atomic():
        job = make_job(tenant="acme")
        (task_id,) = sandboxed(queue_name, job.pk, "s3://reports/7.csv", "acme")
        published = time.monotonic()
        # (the consumer looked once, found no job and scheduled a wait)
        wait_for("the consumer's first look", lambda: any(w["task_id"] == task_id for w in waits), timeout=TIMEOUT)
        time.sleep(max(0.0, COMMIT_AFTER - (time.monotonic() - published)))
    # Then once the job is committed the completion is applied, once
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT) == "applied"
    assert len(succeeded_entries(job)) == 1 and job.output_ref == "s3://reports/7.csv"
    # And every look before the commit was a wait for the record, spending no attempt
    mine = [(w["kind"], w["rule"]) for w in waits if w["task_id"] == task_id]
    assert mine and set(mine) == {("retry_later", "records:require")}
    assert not DeadLetter.objects.filter(task_id=task_id).exists()


def test_a_completion_whose_job_never_appears_is_a_dead_letter_record_missing(
    celery_app: Any, celery_worker: Any, queue_name: str
) -> None:
    # Given a record_wait of 2.5 s, and a completion for a job that does not exist
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "record_wait": 2.5}
    missing = uuid.uuid4()
    (task_id,) = sandboxed(queue_name, missing, "s3://reports/0.csv", "acme")
    # Then, the wait spent, it fails with require()'s error and one dead letter record_missing names the job
    with pytest.raises(RecordNotThereYet):
        celery_app.AsyncResult(task_id).get(timeout=TIMEOUT)
    (letter,) = DeadLetter.objects.filter(task_id=task_id)
    assert (letter.reason, letter.task_name, letter.tenant) == ("record_missing", COMPLETION_TASK, "acme")
    assert letter.exc_message == f"guardrails.Job matching pk='{missing}' does not exist (yet)"


def test_a_completion_sent_as_another_tenant_is_never_applied(
    celery_app: Any, celery_worker: Any, queue_name: str
) -> None:
    # Given a job of acme, and a record_wait of 2.5 s
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "record_wait": 2.5}
    job = make_job(tenant="acme")
    # When a completion for it arrives as tenant globex
    (task_id,) = sandboxed(queue_name, job.pk, "s3://globex/forged.csv", "globex")
    # Then globex's jobs hold no such job: it is a dead letter record_missing of globex, and acme's job is unchanged
    with pytest.raises(RecordNotThereYet):
        celery_app.AsyncResult(task_id).get(timeout=TIMEOUT)
    (letter,) = DeadLetter.objects.filter(task_id=task_id)
    assert (letter.reason, letter.tenant) == ("record_missing", "globex")
    job.refresh_from_db()
    assert (job.state, job.output_ref, job.finished_at) == ("queued", "", None)
    # And acme's own completion of it is still applied (globex's failed key is globex's alone)
    (own,) = sandboxed(queue_name, job.pk, "s3://acme/real.csv", "acme")
    assert celery_app.AsyncResult(own).get(timeout=TIMEOUT) == "applied"
    job.refresh_from_db()
    assert (job.state, job.output_ref) == ("succeeded", "s3://acme/real.csv")


def test_a_terminal_job_is_not_moved_by_a_completion() -> None:
    # Given a succeeded job (its completion applied), and a cancelled one
    done, cancelled = make_job(tenant="acme"), make_job(tenant="acme", state="cancelled")
    with tenant_context("acme"):
        assert apply_completion(done.pk, output_ref="s3://a.csv") == "applied"
        # When the same completion comes again (its key long gone), Then nothing changes
        assert apply_completion(done.pk, output_ref="s3://a.csv") == "duplicate"
        # And another output for it, or any for the cancelled job, is ignored
        assert apply_completion(done.pk, output_ref="s3://b.csv") == "ignored"
        assert apply_completion(cancelled.pk, output_ref="s3://c.csv") == "ignored"
    assert len(succeeded_entries(done)) == 1 and done.output_ref == "s3://a.csv"
    cancelled.refresh_from_db()
    assert (cancelled.state, cancelled.output_ref) == ("cancelled", "")
    # And as no tenant, or another, the job is not there at all
    for tenant in (None, "globex"):
        with tenant_context(tenant), pytest.raises(RecordNotThereYet):
            apply_completion(done.pk, output_ref="s3://a.csv")


@pytest.mark.parametrize("job_id, output_ref", [("../42", "s3://a.csv"), (None, "s3://a.csv"), ("JOB", "a\x00b")])
def test_a_malformed_completion_is_a_dead_letter_and_changes_no_job(
    celery_app: Any, celery_worker: Any, job_id: Any, output_ref: str
) -> None:
    # Given a job, and a completion sent by hand (not through report_completion) with a bad id or reference (as a
    # tenant of this test's own: the idempotency keys of the same bad ids, failed in earlier runs, are kept)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    job = make_job(tenant=tenant)
    job_id = str(job.pk) if job_id == "JOB" else job_id
    with tenant_context(tenant):
        result = celery_app.send_task(COMPLETION_TASK, args=(job_id,), kwargs={"output_ref": output_ref})
    # Then it fails at once: one dead letter, permanent, and the job is unchanged
    with pytest.raises(ValueError):
        result.get(timeout=TIMEOUT)
    (letter,) = DeadLetter.objects.filter(task_id=result.id)
    assert (letter.reason, letter.attempts) == ("permanent", 1)
    job.refresh_from_db()
    assert (job.state, job.output_ref) == ("queued", "")


def test_a_job_handed_off_to_a_sandboxed_worker_reads_queued_until_its_completion_is_applied(
    celery_app: Any, celery_worker: Any, queue_name: str, tmp_path: Path
) -> None:
    # Given a sandboxed worker (a plain Celery app: no Django, no database settings) on a queue of its own
    sandbox_queue = f"{queue_name}-sandbox"
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("GUARDRAILS_TEST_DB", "PG", "DATABASE", "DJANGO"))
    }
    env.update(proj_env(queue=sandbox_queue, django=False), GUARDRAILS_TEST_COMPLETIONS=queue_name)
    with WorkerProcess(
        app="tests.proj.sandbox_worker", queue=sandbox_queue, log_path=tmp_path / "sandbox.log", env=env
    ):
        # When the shop hands a job over to it, in a transaction of tenant acme
        with tenant_context("acme"), transaction.atomic():
            job = hand_off("tests.sandbox.render", (7, "acme"), queue=sandbox_queue, app=celery_app)
            # Then the job is written with the transaction, queued, and nothing was sent yet
            assert (job.state, job.tenant, job.task_name) == ("queued", "acme", "tests.sandbox.render")
        # And once committed, the sandbox does the work and reports it; the trusted worker applies it once
        wait_for("the job succeeded", lambda: Job.objects.get(pk=job.pk).state == "succeeded", timeout=TIMEOUT)
    job.refresh_from_db()
    assert job.output_ref == "renders/acme/7.pdf"
    assert [(e["state"], e.get("detail", "")) for e in job.history] == [
        ("queued", "handed off"),
        ("succeeded", COMPLETED_DETAIL),
    ]
