"""The Django app's job book: job records in the project's database (see :mod:`celery_guardrails.guardrails.jobs`).

Registered with the core as the app is ready. Every write locks the job's row (``select_for_update``), so a
worker's write and a user's cancel never interleave; a terminal state is final (a replay's ``queued`` only
leaves ``failed`` or ``dead_lettered``).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from celery_guardrails.foundation.context import current_correlation_id, current_tenant
from celery_guardrails.guardrails.jobs import (
    DEAD_LETTERED,
    FAILED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    TERMINAL,
    WORKER_LOST,
    JobCount,
    JobMove,
    JobStart,
    JobView,
)
from celery_guardrails.options import TaskOptions
from celery_guardrails.runtime import headers

from .models import Job
from .models.jobs import finished

logger = logging.getLogger(__name__)

#: The detail of a replay's move back to queued (the only move out of failed or dead_lettered).
REPLAYED = "replayed"


class DjangoJobBook:
    """Job records in the ``guardrails_job`` table."""

    def submit(self, task: Any, args: Any, kwargs: Any, *, task_id: str | None, options: dict[str, Any]) -> Job:
        from celery.utils import uuid

        args, kwargs = tuple(args or ()), dict(kwargs or {})
        task_id = task_id or uuid()
        # The caller's tenant and correlation id captured, and what a publish refuses refused, before the row.
        task.prepare_deferred(args, kwargs, options)
        tenant = options.get("tenant") or current_tenant() or ""
        correlation_id = options.get("correlation_id") or current_correlation_id() or ""
        through_outbox = TaskOptions(task=task, call={})["job_outbox"]
        with transaction.atomic():
            job = Job.submitted(
                task_name=task.name, task_id=task_id, tenant=tenant, correlation_id=correlation_id, detail="submitted"
            )
            message_headers = dict(options.pop("headers", None) or {})
            message_headers[headers.HEADER] = {
                **headers.from_message_headers(message_headers),
                headers.JOB: str(job.id),
            }
            if through_outbox:
                task.apply_async(args, kwargs, task_id=task_id, outbox=True, headers=message_headers, **options)
            else:
                task.apply_async_on_commit(args, kwargs, task_id=task_id, headers=message_headers, **options)
        logger.info("Job %s submitted: %s[%s], tenant %s", job.id, task.name, task_id, tenant or "-")
        return job

    def started(self, *, job_id: str, task_id: str, attempt: int, requeued: str = WORKER_LOST) -> JobStart:
        now = timezone.now()
        with transaction.atomic():
            job = Job.objects.select_for_update().filter(pk=job_id).first()
            if job is None:
                logger.warning("Job %s of message %s not found; its body runs, its state unwritten", job_id, task_id)
                return JobStart(run=True, was="")
            was = job.state
            replay = was in (FAILED, DEAD_LETTERED) and job.task_id != task_id
            if was in TERMINAL and not replay:
                # Cancelled before it ran, or this message's run already ended (a redelivery after the job's
                # final state was written, before the ack): the body does not run again.
                return JobStart(run=False, was=was)
            if replay:
                # A replay's message, started before the replay wrote queued (it writes after its publish).
                job.record(QUEUED, detail=REPLAYED, now=now)
            elif was == RUNNING and job.task_id == task_id:
                # The same message ran before and never ended: its worker died mid-body, or its time limit
                # killed it.
                job.record(QUEUED, detail=requeued, now=now)
            job.task_id = task_id
            job.started_at = job.started_at or now
            job.due_at = None
            job.record(RUNNING, attempt=attempt, now=now)
            job.save()
        return JobStart(run=True, was=was)

    def moved(self, move: JobMove) -> bool:
        now = timezone.now()
        with transaction.atomic():
            job = Job.objects.select_for_update().filter(pk=move.job_id).first()
            if job is None:
                logger.warning("Job %s of message %s not found; %s not written", move.job_id, move.task_id, move.state)
                return False
            if move.detail == REPLAYED:
                # Written after the replay's publish: a worker that started the new message first has moved
                # the job on already (see started), and it stays where it is.
                if job.state not in (FAILED, DEAD_LETTERED) or job.task_id == move.task_id:
                    return False
            elif job.state in TERMINAL:
                return False
            if job.state == RUNNING and job.task_id == move.task_id and not move.ran:
                # A wait before the body, under the message a run of which never ended: its worker died.
                job.record(QUEUED, detail=WORKER_LOST, now=now)
            job.task_id = move.task_id or job.task_id
            if move.error or move.state in (QUEUED, RUNNING, SUCCEEDED):
                job.error = move.error
            if move.dead_letter:
                job.dead_letter_task_id = move.dead_letter
            job.due_at = datetime.fromtimestamp(move.due, UTC) if move.due is not None else None
            latest = _PROGRESS.take(str(job.pk)) if move.state in TERMINAL else None
            if latest is not None:
                job.progress_done, job.progress_total = latest.done, latest.total
            job.record(move.state, attempt=move.attempt or None, detail=move.detail, now=now)
            job.save()
        if move.state in TERMINAL:
            finished(job)
        return True

    def progress(self, *, job_id: str, done: int, total: int | None) -> None:
        from django.db import connection

        if connection.in_atomic_block:
            # Written here, it would wait for the body's transaction to commit (an atomic job's progress would
            # read 0 until the end): a thread of its own writes it, on a connection of its own.
            _PROGRESS.put(job_id, done, total)
            return
        _write_progress(job_id, done, total)

    def describe(self, job_id: str) -> JobView | None:
        try:
            job = Job.objects.filter(pk=job_id).first()
        except (ValidationError, ValueError):  # not a UUID: no such job
            return None
        return None if job is None else view(job)

    def counts(self) -> list[JobCount]:
        rows = Job.objects.order_by().values("task_name", "state").annotate(n=Count("pk"))
        return [JobCount(task=row["task_name"], state=row["state"], jobs=row["n"]) for row in rows]


def iso(moment: Any) -> str | None:
    """A moment as JSON and the core's views carry it (ISO 8601), None for none."""
    return moment.isoformat() if moment is not None else None


def view(job: Job) -> JobView:
    """``job`` as the core's read-only :class:`JobView`."""
    return JobView(
        id=str(job.id),
        task_name=job.task_name,
        task_id=job.task_id,
        tenant=job.tenant,
        state=job.state,
        attempt=job.attempt,
        detail=job.detail,
        progress_done=job.progress_done,
        progress_total=job.progress_total,
        output_ref=job.output_ref,
        error=job.error,
        dead_letter_task_id=job.dead_letter_task_id,
        created_at=job.created_at.isoformat(),
        started_at=iso(job.started_at),
        finished_at=iso(job.finished_at),
        due_at=iso(job.due_at),
        cancel_requested_at=iso(job.cancel_requested_at),
        history=tuple(entry for entry in (job.history or []) if isinstance(entry, dict)),
    )


def _write_progress(job_id: str, done: int, total: int | None) -> None:
    Job.objects.filter(pk=job_id).exclude(state__in=sorted(TERMINAL)).update(
        progress_done=done, progress_total=total, updated_at=timezone.now()
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """How far a job's body is, as it reported."""

    done: int
    total: int | None


class _ProgressWriter:
    """Writes the progress bodies report from inside a transaction, from one thread per process, the latest of
    each job at once (a view of the work: a write that fails is one warning; on SQLite, which has one writer,
    it lands when the body's transaction ends)."""

    def __init__(self) -> None:
        self._pending: dict[str, Progress] = {}
        #: The latest progress put of each job, until its final state is written (which takes it along).
        self._latest: dict[str, Progress] = {}
        self._ready = threading.Condition()
        self._pid: int | None = None

    def put(self, job_id: str, done: int, total: int | None) -> None:
        with self._ready:
            self._pending[job_id] = self._latest[job_id] = Progress(done=done, total=total)
            if self._pid != os.getpid():  # none yet, or the parent's (a forked child has none running)
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="guardrails-job-progress", daemon=True).start()
            self._ready.notify()

    def take(self, job_id: str) -> Progress | None:
        """The latest progress put of ``job_id`` (None: none), forgotten: its final state is being written with
        it (a write the thread has yet to make then finds the job final and changes nothing)."""
        with self._ready:
            self._pending.pop(job_id, None)
            return self._latest.pop(job_id, None)

    def _run(self) -> None:
        from django.db import connection

        from celery_guardrails.foundation.forks import quiet

        while True:
            with self._ready:
                while not self._pending:
                    self._ready.wait()
                batch, self._pending = self._pending, {}
            with quiet():
                for job_id, progress in batch.items():
                    try:
                        _write_progress(job_id, progress.done, progress.total)
                    except Exception as exc:
                        logger.warning("Job %s: progress %s not written (%r)", job_id, progress, exc)
                connection.close()


_PROGRESS = _ProgressWriter()


def replayed(*, job_id: str, task_id: str) -> bool:
    """A dead letter of job ``job_id`` was replayed as message ``task_id``: the same job, ``queued`` again."""
    return DjangoJobBook().moved(JobMove(job_id=job_id, task_id=task_id, state=QUEUED, detail=REPLAYED))


def hand_off(
    name: str,
    args: Any = (),
    kwargs: Any = None,
    *,
    queue: str,
    app: Any = None,
    tenant: str | None = None,
) -> Job:
    """Submit a job whose work runs where the job records are not: a sandboxed worker with no database, another
    service. The job is written in the caller's transaction, with the caller's tenant (or ``tenant``) and
    correlation id, and the message of task ``name`` is sent to ``queue`` once that transaction commits, with the
    job's id and the tenant in its ``guardrails`` header and the job's id as the keyword argument ``job_id`` (what
    the worker there passes to ``report_completion``). No guardrail runs there to move the job: it reads
    ``queued`` until its completion arrives (``celery_guardrails.jobs.report_completion``), which the trusted
    consumer applies once."""
    from celery import current_app
    from celery.utils import uuid

    from celery_guardrails.foundation.context import validate_tenant

    app = app or current_app
    tenant = tenant or current_tenant() or ""
    if tenant:
        validate_tenant(tenant)
    correlation_id = current_correlation_id() or ""
    task_id = uuid()
    with transaction.atomic():
        job = Job.submitted(
            task_name=name, task_id=task_id, tenant=tenant, correlation_id=correlation_id, detail="handed off"
        )
        header = {**headers.context(tenant=tenant, correlation_id=correlation_id), headers.JOB: str(job.id)}

        def send() -> None:
            app.send_task(
                name,
                args=tuple(args),
                kwargs={**(kwargs or {}), "job_id": str(job.id)},
                task_id=task_id,
                queue=queue,
                headers={headers.HEADER: header},
            )

        transaction.on_commit(send)
    logger.info("Job %s handed off: %s[%s] on %s, tenant %s", job.id, name, task_id, queue, tenant or "-")
    return job
