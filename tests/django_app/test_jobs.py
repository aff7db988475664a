"""Jobs a user can poll, on a real worker and the test database: ``submit()`` writes the job in the caller's
transaction and sends its message once that commits; the job's state follows the message through a wait, a
retry, a dead letter and its replay, a SIGKILL mid-body and a cancel; an atomic job never reads ``succeeded``
before its effect committed (read from a second connection while the body holds its transaction open).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction

from celery_guardrails.guardrails import jobs
from django_celery_guardrails.models import DeadLetter, Job, OutboxMessage
from django_celery_guardrails.outbox import relay
from django_celery_guardrails.replay import replay_dead_letters
from tests.conftest import Sink
from tests.proj import django_tasks
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env, quick_redelivery
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 30


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"], "job_outbox": False}
    return celery_app


def states(job: Job) -> list[str]:
    job.refresh_from_db()
    return [entry["state"] for entry in job.history]


def settled(job: Job, state: str) -> Job:
    """The job once it reached ``state`` (polled as a user would)."""
    wait_for(f"job {job.id} {state}", lambda: Job.objects.get(pk=job.pk).state == state, timeout=TIMEOUT)
    job.refresh_from_db()
    return job


def name() -> str:
    return f"report-{uuid.uuid4().hex[:8]}"


def test_a_job_is_written_in_the_callers_transaction_and_sent_through_the_outbox_once_it_commits(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "job_outbox": True}
    # Given a submit in a transaction that rolls back
    with pytest.raises(RuntimeError), transaction.atomic():
        django_tasks.build_report.submit(name(), sink.key)
        raise RuntimeError("the request failed")
    # Then neither the job nor its message is left
    assert not Job.objects.exists() and not OutboxMessage.objects.exists()
    # When a submit commits
    with transaction.atomic():
        job = django_tasks.build_report.submit(report := name(), sink.key)
        assert isinstance(job, Job) and job.state == "queued"
    # Then the job and its message were written together, the message with the job's id in its header
    (row,) = OutboxMessage.objects.all()
    assert row.task_id == job.task_id and json.loads(json.dumps(row.options))
    assert Job.objects.get(pk=job.pk).state == "queued"
    # And once the relay publishes it, the job runs to succeeded, with its effect
    assert relay(celery_app).published == 1
    job = settled(job, "succeeded")
    assert states(job) == ["queued", "running", "succeeded"]
    assert (job.attempt, job.error, job.finished_at is not None) == (1, "", True)
    assert Effect.objects.filter(key=report).count() == 1
    assert [item["job"] for item in sink.items()] == [str(job.id)]


def test_an_atomic_job_never_reads_succeeded_before_its_effect_committed(celery_worker: Any, sink: Sink) -> None:
    # Given an atomic job whose body holds its transaction open 3 s after writing its effect
    job = django_tasks.build_report.submit(report := name(), sink.key, hold=3.0)
    wait_for("the body holding", lambda: sink.client.llen(f"{sink.key}:holding") == 1, timeout=TIMEOUT)
    # When a user polls it from another connection (this test's) while the body holds
    polled = set()
    while sink.client.llen(f"{sink.key}:holding") and not Effect.objects.filter(key=report).exists():
        row = Job.objects.get(pk=job.pk)
        polled.add(row.state)
        if row.state == "succeeded":
            # Then succeeded is only ever read together with the effect it reports
            assert Effect.objects.filter(key=report).exists()
            break
    job = settled(job, "succeeded")
    assert "running" in polled and Effect.objects.filter(key=report).count() == 1
    # And the state and the effect committed together: the job's final write is no earlier than the effect's
    assert states(job) == ["queued", "running", "succeeded"]


def test_a_wait_a_retry_and_progress_are_followed_to_succeeded(celery_worker: Any, sink: Sink) -> None:
    # Given a job that first asks to run later, then fails transiently once, then reports 5 steps
    job = django_tasks.build_report.submit(name(), sink.key, later=1, fail=1, items=5)
    # Then the job went through each state, in order, with the attempt each delivery made
    job = settled(job, "succeeded")
    assert states(job) == ["queued", "running", "waiting", "running", "retrying", "running", "succeeded"]
    assert [entry["attempt"] for entry in job.history] == [0, 1, 1, 1, 1, 2, 2]
    details = [entry.get("detail", "") for entry in job.history]
    assert details == ["submitted", "", "RetryLater", "", "TransientError", "", ""]
    # And its progress is the last step reported, its error cleared by the success
    assert (job.progress_done, job.progress_total, job.error, job.due_at) == (5, 5, "", None)


def test_a_job_deferred_by_an_open_circuit_reads_waiting_until_it_runs(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    from celery_guardrails import budget_status
    from tests.celery_guardrails.guardrails.test_budget import fail_twice

    # Given a dependency whose breaker two transient failures opened, for 2 s of the guardrails' clock (which
    # stands still until the test moves it)
    clock = [float(int(time.time()))]
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "circuit_threshold": 2,
        "circuit_open_seconds": 2.0,
        "clock": lambda: clock[0],
    }
    dependency = f"storage-{uuid.uuid4().hex[:8]}"
    fail_twice(sink, dependency)
    wait_for("the circuit open", lambda: budget_status(dependency, app=celery_app)["circuit"] == "open")
    # When a job of that dependency is submitted
    job = django_tasks.build_report.apply_async((name(), sink.key), job=True, dependency=dependency)
    # Then it waits for the circuit, no attempt spent, its body not run
    job = settled(job, "waiting")
    assert (job.detail, job.attempt) == ("circuit", 1) and job.due_at is not None
    # And once the open time has passed, it runs as the probe and succeeds
    clock[0] += 2.0
    job = settled(job, "succeeded")
    seen = states(job)
    assert seen[0] == "queued" and set(seen[1:-2]) == {"waiting"} and seen[-2:] == ["running", "succeeded"]


def test_progress_is_written_at_most_once_an_interval_and_at_once_when_it_reaches_its_total(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    # Given progress written at most once an hour
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "job_progress_interval": 3600.0}
    # When a job reports steps 1 to 4 of 5, then stalls
    job = django_tasks.build_report.submit(name(), sink.key, items=5, stall_at=4, hold=2.0)
    wait_for("the body stalled", lambda: sink.client.llen(f"{sink.key}:holding") == 1, timeout=TIMEOUT)
    # Then only the first report was written, though the body's transaction is still open (a thread of its own
    # writes it; SQLite has one writer: there it lands when the transaction ends)
    if connection.vendor != "sqlite":
        wait_for("the first report", lambda: Job.objects.get(pk=job.pk).progress_done is not None, timeout=TIMEOUT)
        row = Job.objects.get(pk=job.pk)
        assert (row.progress_done, row.progress_total) == (1, 5)
    # And the last, which reaches the total, is written at once
    job = settled(job, "succeeded")
    assert (job.progress_done, job.progress_total) == (5, 5)


def test_a_dead_lettered_job_links_its_dead_letter_and_its_replay_is_the_same_job(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    # Given a job whose body fails permanently
    sink.client.set(f"{sink.key}:broken", 1)
    job = django_tasks.build_report.submit(report := name(), sink.key)
    # Then it is dead_lettered, linked to its dead letter, with the error's summary
    job = settled(job, "dead_lettered")
    letter = DeadLetter.objects.get(task_id=job.task_id)
    assert job.dead_letter_task_id == letter.task_id and letter.reason == "permanent"
    assert job.error == "PermanentError: the report's template is broken"
    first_task_id = job.task_id
    # When the cause is fixed and the dead letter replayed
    sink.client.delete(f"{sink.key}:broken")
    admin = get_user_model().objects.create_superuser(f"u{uuid.uuid4().hex[:8]}", password=None)
    ((_, task_id),) = replay_dead_letters([letter.pk], user=admin, app=celery_app).replayed
    # Then the same job is queued again, runs under the replay's task id, and succeeds with one effect
    job = settled(job, "succeeded")
    assert job.task_id == task_id != first_task_id
    assert states(job) == ["queued", "running", "dead_lettered", "queued", "running", "succeeded"]
    assert job.history[3]["detail"] == "replayed"
    assert Effect.objects.filter(key=report).count() == 1


def test_a_job_cancelled_before_it_started_does_not_run_and_a_running_one_records_the_request(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    from celery.exceptions import TaskRevokedError

    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "job_outbox": True}
    # Given a job whose message is still in the outbox
    job = django_tasks.build_report.submit(report := name(), sink.key)
    # When it is cancelled, Then it is cancelled, and a cancel again changes nothing
    assert job.cancel() is True and job.state == "cancelled" and job.finished_at is not None
    assert job.cancel() is False and states(job) == ["queued", "cancelled"]
    # And when its message is published all the same, the worker (told of the revoke) does not run it
    assert relay(celery_app).published == 1
    with pytest.raises(TaskRevokedError):
        celery_app.AsyncResult(job.task_id).get(timeout=TIMEOUT)
    assert sink.items() == [] and not Effect.objects.filter(key=report).exists()
    assert states(job) == ["queued", "cancelled"]
    # Given a cancelled job whose revoke no worker heard (a worker started after the cancel forgets it)
    unheard = django_tasks.build_report.submit(other := name(), sink.key)
    Job.objects.filter(pk=unheard.pk).update(state="cancelled")
    # When its message is delivered, Then its body does not run: the job says it is cancelled
    relay(celery_app)
    assert celery_app.AsyncResult(unheard.task_id).get(timeout=TIMEOUT) is None
    assert sink.items() == [] and not Effect.objects.filter(key=other).exists()
    if connection.vendor == "sqlite":
        return  # (SQLite has one writer: a cancel waits for the running body's transaction, then finds it ended)
    # Given a running job (held 3 s in its body)
    running = django_tasks.build_report.submit(name(), sink.key, hold=3.0)
    relay(celery_app)
    wait_for("the body holding", lambda: sink.client.llen(f"{sink.key}:holding") == 1, timeout=TIMEOUT)
    # When it is cancelled, Then it is not (it runs to its end), and the request is recorded
    assert running.cancel() is False and running.cancel_requested_at is not None
    running = settled(running, "succeeded")
    assert [e.get("detail", "") for e in running.history] == ["submitted", "", "cancel requested", ""]


def test_a_job_whose_worker_is_sigkilled_mid_body_is_queued_again_then_runs_once(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a worker on the Django store, and a job whose first run holds its body (its effect written,
    # uncommitted)
    env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_GUARDRAILS=json.dumps(
            {"store": "django", "dead_letter_sinks": ["django"], "idempotency_lease": 2.0}
        ),
        GUARDRAILS_TEST_TRANSPORT_OPTIONS=json.dumps(quick_redelivery()),
    )
    celery_app.conf.broker_transport_options = quick_redelivery()
    job = django_tasks.build_report.submit(report := name(), sink.key, hold=60.0)
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "first.log", env=env) as first:
        wait_for("the body holding", lambda: sink.client.llen(f"{sink.key}:holding") == 1, timeout=TIMEOUT)
        # When the whole worker is SIGKILLed mid-body
        first.kill()
        first.wait(15)
    # Then the job still reads running: nothing was left to say otherwise
    assert Job.objects.get(pk=job.pk).state == "running"
    # When a worker is started again and the message is redelivered
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "second.log", env=env):
        job = settled(job, "succeeded")
    # Then the job was queued again ("worker lost"), ran again (after waiting for the dead run's key to lapse,
    # if it came back before its 2 s lease ran out), and its effect landed once
    seen = states(job)
    assert seen[:3] == ["queued", "running", "queued"] and job.history[2]["detail"] == "worker lost"
    assert seen[-2:] == ["running", "succeeded"] and set(seen[3:-2]) <= {"waiting"}
    assert Effect.objects.filter(key=report).count() == 1
    assert [item["run"] for item in sink.items()] == [1, 2]


def test_a_job_killed_by_its_hard_time_limit_is_retried_and_followed_to_succeeded(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a prefork worker on the Django store, and an atomic keyed job whose first run holds past its hard
    # time limit of 2 s (its effect written, uncommitted)
    env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({"store": "django", "dead_letter_sinks": ["django"]}),
    )
    job = django_tasks.build_report.apply_async((report := name(), sink.key), {"hold": 30.0}, job=True, time_limit=2)
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env):
        # When the pool kills the run at its time limit (the worker's main process records it)
        job = settled(job, "succeeded")
    # Then the job was queued again after the kill (time_limit), ran again, and its effect landed once
    assert states(job) == ["queued", "running", "queued", "running", "succeeded"], job.history
    assert job.history[2]["detail"] == "time_limit"
    assert Effect.objects.filter(key=report).count() == 1 and [item["run"] for item in sink.items()] == [1, 2]


def test_jobs_states_are_the_models_choices() -> None:
    # Then the core's states and the model's choices are one list
    assert list(jobs.STATES) == list(Job.State.values)
