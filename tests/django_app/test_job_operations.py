"""Operating jobs (#32 points 6 and 8), on a real worker and the test database: ``celery -A proj guardrails job
<id>`` run as a real command on the test Django settings; the jobs gauge and the time-to-terminal histogram in
the metrics view after real jobs ended; the prune of finished jobs past ``job_retention``; the test kit's
``assert_job``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from celery_guardrails.guardrails.jobs import JobView
from celery_guardrails.operations import metrics
from celery_guardrails.testing import assert_job
from django_celery_guardrails.maintenance import prune
from django_celery_guardrails.models import Job
from tests.conftest import Sink
from tests.django_app.test_legible_pages import MOMENT
from tests.proj import django_tasks
from tests.support import zygote
from tests.support.waiting import BOUND
from tests.support.workers import PROJ_APP, ROOT, proj_env

pytestmark = pytest.mark.django_db(transaction=True)
TASK = django_tasks.build_report.name


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"], "job_outbox": False}
    return celery_app


def name() -> str:
    return f"report-{uuid.uuid4().hex[:8]}"


# celery -A proj guardrails job <id>


def job_command(queue: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.proj.app guardrails job ...`` with the test Django settings (the app's module sets
    Django up, as a Django project's Celery app does), on this test's database."""
    return zygote.run(
        [sys.executable, "-m", "celery", "-A", PROJ_APP, "guardrails", "job", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **proj_env(queue=queue, django=True)},
        timeout=BOUND,
    )


def test_the_job_command_prints_a_job_its_history_and_json_and_exits_1_for_none(
    celery_worker: Any, queue_name: str, sink: Sink
) -> None:
    # Given a job that waited once, then ran to succeeded with 3 steps of progress, on a real worker
    job = django_tasks.build_report.submit(name(), sink.key, later=1, items=3)
    assert_job(job, state="succeeded", timeout=BOUND)
    # When `celery -A tests.proj.app guardrails job <id>` runs
    done = job_command(queue_name, str(job.id))
    # Then it exits 0 and prints the job: its task, state, progress, times one way, and its history in order
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines[: lines.index("")])
    assert (fields["job"], fields["task"]) == (str(job.id), f"{TASK}[{job.task_id}]")
    assert (fields["state"], fields["progress"], fields["tenant"]) == ("succeeded (attempt 1) — final", "3/3", "-")
    assert MOMENT.fullmatch(fields["submitted"]) and fields["submitted"].endswith(" UTC")
    assert MOMENT.fullmatch(fields["finished"]) and fields["dead letter"] == "-"
    # (the history as stored: under load a retry may also wait for the first run's key)
    stored = [entry["state"] for entry in Job.objects.get(pk=job.pk).history]
    assert stored[:3] == ["queued", "running", "waiting"] and stored[-2:] == ["running", "succeeded"]
    history = lines[lines.index("history:") + 2 :]
    assert [line.split()[3] for line in history] == stored
    assert "RetryLater" in history[2]
    # And --json prints the same as JSON
    printed = json.loads(job_command(queue_name, str(job.id), "--json").stdout)
    assert (printed["id"], printed["state"], printed["terminal"]) == (str(job.id), "succeeded", True)
    assert (printed["progress_done"], printed["progress_total"], printed["dead_letter_task_id"]) == (3, 3, "")
    assert [entry["state"] for entry in printed["history"]] == stored
    # And an id of no job, or not a job id at all, exits 1 and says so
    for missing in (str(uuid.uuid4()), "not-a-job"):
        none = job_command(queue_name, missing)
        assert (none.returncode, none.stdout) == (1, ""), none.stderr
        assert f"error: no job {missing}" in none.stderr


# Metrics


def scrape(client: Client) -> str:
    page = client.get(reverse("guardrails:metrics"))
    assert page.status_code == 200
    return page.content.decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def test_the_metrics_count_jobs_by_state_and_observe_their_time_to_terminal(
    celery_app: Any, celery_worker: Any, sink: Sink, admin_client: Client
) -> None:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "metrics": True}
    # Given the metrics view scraped before any job: both job families are named already
    first = scrape(admin_client)
    assert f"# TYPE {metrics.JOBS} gauge" in first
    assert f"# TYPE {metrics.JOB_TIME_TO_TERMINAL} histogram" in first
    before = samples(first)
    # When a real worker runs a job to succeeded and another to a dead letter, and a third is cancelled
    succeeded = django_tasks.build_report.submit(name(), sink.key)
    assert_job(succeeded, state="succeeded", timeout=BOUND)
    broken = Sink()
    broken.client.set(f"{broken.key}:broken", 1)
    dead = django_tasks.build_report.submit(name(), broken.key)
    assert_job(dead, state="dead_lettered", timeout=BOUND)
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "job_outbox": True}
    cancelled = django_tasks.build_report.submit(name(), sink.key)  # its message stays in the outbox
    queued = django_tasks.build_report.submit(name(), sink.key)
    assert cancelled.cancel() is True
    after = samples(scrape(admin_client))
    # Then the gauge counts the jobs in each state, every state of the task named
    gauge = {
        state: value(after, metrics.JOBS, task=TASK, state=state)
        for state in ("queued", "running", "retrying", "waiting", "succeeded", "failed", "dead_lettered", "cancelled")
    }
    assert gauge == {**dict.fromkeys(gauge, 0.0), "queued": 1, "succeeded": 1, "dead_lettered": 1, "cancelled": 1}
    assert queued.state == "queued"
    # And the histogram observed each final state once, by task and state, none still queued
    count = f"{metrics.JOB_TIME_TO_TERMINAL}_count"
    observed = {
        state: value(after, count, task=TASK, state=state) - value(before, count, task=TASK, state=state)
        for state in ("succeeded", "dead_lettered", "cancelled", "queued")
    }
    assert observed == {"succeeded": 1, "dead_lettered": 1, "cancelled": 1, "queued": 0}
    # And the time observed is the job's own, from submit to its final state (a +Inf bucket holds it, and the
    # sum is no less than the succeeded job's recorded span)
    succeeded.refresh_from_db()
    span = (succeeded.finished_at - succeeded.created_at).total_seconds()  # type: ignore[operator]
    total = f"{metrics.JOB_TIME_TO_TERMINAL}_sum"
    added = value(after, total, task=TASK, state="succeeded") - value(before, total, task=TASK, state="succeeded")
    assert added == pytest.approx(span)


# Pruning


def finished_job(state: str, *, days: float) -> Job:
    """A job that reached ``state`` ``days`` ago (submitted an hour before that)."""
    finished = timezone.now() - timedelta(days=days)
    job = Job(
        task_name=TASK,
        task_id=str(uuid.uuid4()),
        created_at=finished - timedelta(hours=1),
        updated_at=finished,
    )
    job.record("queued", attempt=0, detail="submitted", now=job.created_at)
    job.record(state, attempt=1, now=finished)
    job.save(force_insert=True)
    return job


def test_finished_jobs_past_job_retention_are_pruned_and_counted(settings: Any) -> None:
    # Given jobs finished 40, 31, 10 and 1 days ago, and jobs not finished that were submitted 60 days ago
    old = [finished_job("succeeded", days=40), finished_job("cancelled", days=31)]
    ten_days = finished_job("dead_lettered", days=10)
    recent = finished_job("failed", days=1)
    unfinished = [finished_job(state, days=60) for state in ("queued", "running", "waiting", "retrying")]
    # When the prune runs with the default retention (30 days)
    assert prune(dry_run=True)["jobs"] == 2
    out = StringIO()
    call_command("guardrails_prune", stdout=out)
    # Then the jobs finished more than 30 days ago are gone, reported in its counts
    assert out.getvalue().strip().endswith("; 2 finished job(s).")
    kept = set(Job.objects.values_list("pk", flat=True))
    assert kept == {ten_days.pk, recent.pk, *(job.pk for job in unfinished)}
    assert not kept & {job.pk for job in old}
    # When job_retention is 7 days, Then the prune task (for beat) takes the 10-day-old one too, never the
    # jobs that did not finish however old
    settings.CELERY_GUARDRAILS = {**settings.CELERY_GUARDRAILS, "job_retention": 7 * 86400}
    from django_celery_guardrails.tasks import prune_task

    assert prune_task.apply().get()["jobs"] == 1
    assert set(Job.objects.values_list("pk", flat=True)) == {recent.pk, *(job.pk for job in unfinished)}
    # And --older-than applies to jobs as to every table
    assert prune(older_than=3600)["jobs"] == 1
    assert set(Job.objects.values_list("state", flat=True)) == {"queued", "running", "waiting", "retrying"}


# The test kit: assert_job


def test_assert_job_waits_for_the_state_and_fails_with_the_jobs_history(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    # Given a job that runs to succeeded on a real worker
    job = django_tasks.build_report.submit(name(), sink.key, fail=1)
    # When the test asserts it succeeded, Then assert_job waits for it, returns the job as read, refreshes it
    found = assert_job(job, state="succeeded", timeout=BOUND)
    assert isinstance(found, JobView) and found.state == "succeeded" and job.state == "succeeded"
    assert list(found.history) == job.history and found.history[2]["state"] == "retrying"
    # And it takes the job's id as well
    assert assert_job(str(job.id), state="succeeded").id == str(job.id)
    # Given a job that ends dead-lettered
    broken = Sink()
    broken.client.set(f"{broken.key}:broken", 1)
    dead = django_tasks.build_report.submit(name(), broken.key)
    # When the test asserts it succeeded, Then it fails as soon as the job is final, showing its history
    with pytest.raises(AssertionError) as failed:
        assert_job(dead, state="succeeded", timeout=BOUND)
    message = str(failed.value)
    assert f"job {dead.id} ({TASK}) ended dead_lettered, not succeeded" in message
    stored = [entry["state"] for entry in Job.objects.get(pk=dead.pk).history]
    assert stored[0] == "queued" and stored[-1] == "dead_lettered"
    assert [line.split()[3] for line in message.splitlines()[1 : 1 + len(stored)]] == stored
    assert "PermanentError: the report's template is broken" in message and "dead letter: " in message
    # Given a job whose message never goes out (left in the outbox)
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "job_outbox": True}
    stuck = django_tasks.build_report.submit(name(), sink.key)
    # Then asserting it succeeded fails after the timeout, naming the state it is in and its history
    with pytest.raises(AssertionError, match=r"is queued, not succeeded, after 0.3s:\n.* queued +attempt 0 +submitted"):
        assert_job(stuck, state="succeeded", timeout=0.3)
    # And an id of no job, and a state that is none, are said plainly
    with pytest.raises(AssertionError, match="no job"):
        assert_job(str(uuid.uuid4()), state="succeeded")
    with pytest.raises(ValueError, match="state must be one of"):
        assert_job(job, state="done")
