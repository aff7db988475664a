"""Jobs a user can poll (see :mod:`celery_guardrails.guardrails.jobs`): one row per submitted job.

Written by :mod:`django_celery_guardrails.job_book` (the job book the app registers with the core): the row in the
caller's transaction by ``task.submit()``, its state by the worker as the message runs.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db import models, transaction
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from celery_guardrails.guardrails.jobs import CANCELLED, QUEUED, RETRYING, RUNNING, STATES, TERMINAL, WAITING

from ..querysets import JobQuerySet

#: Transitions kept in a job's history (the oldest are dropped).
HISTORY_LIMIT = 50


class Job(models.Model):
    """A job submitted with ``task.submit()``: what it runs, for whom, where it is, and how it ended."""

    class State(models.TextChoices):
        QUEUED = "queued", _("queued")
        RUNNING = "running", _("running")
        RETRYING = "retrying", _("retrying")
        WAITING = "waiting", _("waiting")
        SUCCEEDED = "succeeded", _("succeeded")
        FAILED = "failed", _("failed")
        DEAD_LETTERED = "dead_lettered", _("dead-lettered")
        CANCELLED = "cancelled", _("cancelled")

    id = models.UUIDField(
        _("job id"), primary_key=True, default=uuid.uuid4, editable=False, help_text=_("The id a user polls.")
    )
    task_name = models.CharField(_("task"), max_length=200, db_index=True, help_text=_("Registered task name."))
    task_id = models.CharField(
        _("task id"),
        max_length=255,
        db_index=True,
        help_text=_("The id of the job's message (a replay gives it a new one)."),
    )
    tenant = models.CharField(
        _("tenant"), max_length=128, blank=True, db_index=True, help_text=_("Tenant id (empty: none).")
    )
    correlation_id = models.CharField(
        _("correlation id"), max_length=64, blank=True, help_text=_("Correlation id of the request that submitted it.")
    )
    state = models.CharField(
        _("state"),
        max_length=20,
        choices=State.choices,
        default=State.QUEUED,
        db_index=True,
        help_text=_("Where the job is: queued, running, retrying, waiting, or how it ended."),
    )
    attempt = models.PositiveIntegerField(
        _("attempt"), default=0, help_text=_("The attempt its latest delivery made (0: none ran yet).")
    )
    detail = models.CharField(
        _("detail"),
        max_length=255,
        blank=True,
        help_text=_("Why it is in its state: the wait's reason, the dead letter's reason, 'worker lost'."),
    )
    progress_done = models.PositiveBigIntegerField(
        _("done"), null=True, blank=True, help_text=_("Items done, as the body reported (empty: none reported).")
    )
    progress_total = models.PositiveBigIntegerField(
        _("total"), null=True, blank=True, help_text=_("Items in all, as the body reported (empty: unknown).")
    )
    output_ref = models.CharField(
        _("output reference"),
        max_length=500,
        blank=True,
        help_text=_("Where the job's output is (a storage key, a URL), not the output itself."),
    )
    error = models.TextField(
        _("error"), blank=True, help_text=_("A short summary of its latest error, redacted (empty: none).")
    )
    dead_letter_task_id = models.CharField(
        _("dead letter"),
        max_length=255,
        blank=True,
        help_text=_("Task id of the dead letter recorded for it (empty: none)."),
    )
    due_at = models.DateTimeField(
        _("due at"), null=True, blank=True, help_text=_("When a waiting or retrying job runs again.")
    )
    created_at = models.DateTimeField(_("submitted at"), db_index=True, help_text=_("When it was submitted."))
    started_at = models.DateTimeField(
        _("started at"), null=True, blank=True, help_text=_("When its body first started.")
    )
    updated_at = models.DateTimeField(_("updated at"), help_text=_("When its state or progress last changed."))
    finished_at = models.DateTimeField(
        _("finished at"), null=True, blank=True, db_index=True, help_text=_("When it reached a final state.")
    )
    cancel_requested_at = models.DateTimeField(
        _("cancel requested at"),
        null=True,
        blank=True,
        help_text=_("When a cancel was asked while it ran (it runs to its end)."),
    )
    history = models.JSONField(
        _("history"),
        default=list,
        blank=True,
        help_text=_("Its transitions, oldest first: state, when, attempt, detail (the last 50)."),
    )

    objects: JobQuerySet = JobQuerySet.as_manager()  # type: ignore[assignment]

    class Meta:
        verbose_name = _("job")
        verbose_name_plural = _("jobs")
        ordering = ("-created_at",)
        indexes = [models.Index(fields=["tenant", "state", "created_at"], name="guardrails_job_tenant_state")]

    def __str__(self) -> str:
        return f"job {self.id} {self.task_name} ({self.state})"

    @classmethod
    def submitted(
        cls, *, task_name: str, task_id: str, tenant: str, correlation_id: str, detail: str, **fields: Any
    ) -> Job:
        """A new job, ``queued`` with ``detail``, inserted (in the caller's transaction when there is one)."""
        now = timezone.now()
        job = cls(
            task_name=task_name,
            task_id=task_id,
            tenant=tenant,
            correlation_id=correlation_id,
            created_at=now,
            updated_at=now,
            **fields,
        )
        job.record(QUEUED, attempt=0, detail=detail, now=now)
        job.save(force_insert=True)
        return job

    @property
    def terminal(self) -> bool:
        """Whether the job is in a final state (a replay may still move a failed or dead-lettered one)."""
        return self.state in TERMINAL

    def record(self, state: str, *, attempt: int | None = None, detail: str = "", now: Any = None) -> None:
        """Set ``state`` and add the transition to the history (not saved)."""
        now = now or timezone.now()
        self.state = state
        if attempt is not None:
            self.attempt = attempt
        self.detail = detail[:255]
        self.updated_at = now
        entry = {"state": state, "at": now.isoformat(timespec="milliseconds"), "attempt": self.attempt}
        if detail:
            entry["detail"] = detail[:255]
        self.history = [*(self.history or [])[-(HISTORY_LIMIT - 1) :], entry]
        if state in TERMINAL:
            self.finished_at = now
        elif state in (QUEUED, RUNNING):
            self.finished_at = None

    def cancel(self, *, app: Any = None) -> bool:
        """Cancel the job: one not started yet (queued, waiting, retrying) is ``cancelled`` and its message
        revoked, and a delivery of it does not run its body; one running is left to end, the request recorded
        (``cancel_requested_at``). Whether it was cancelled. The instance is refreshed."""
        with transaction.atomic():
            row = Job.objects.select_for_update().get(pk=self.pk)
            cancelled = row.state in (QUEUED, WAITING, RETRYING)
            now = timezone.now()
            if cancelled:
                row.record(CANCELLED, detail=f"cancelled while {row.state}", now=now)
                task_id = row.task_id
                transaction.on_commit(lambda: _revoke(app, task_id))
                finished(row)
            elif row.state == RUNNING and row.cancel_requested_at is None:
                row.cancel_requested_at = now
                entry = {"state": RUNNING, "at": now.isoformat(timespec="milliseconds"), "attempt": row.attempt}
                row.history = [*(row.history or [])[-(HISTORY_LIMIT - 1) :], {**entry, "detail": "cancel requested"}]
            row.save()
        self.refresh_from_db()
        return cancelled


def finished(job: Job) -> None:
    """``job`` was written in a final state: its time from submit to that state is observed in the metrics once
    the write commits (at once outside a transaction; never if it rolls back). Never raises."""
    from celery import current_app

    from celery_guardrails.operations.instruments import job_finished

    if job.finished_at is None:
        return
    task, state, job_id = job.task_name, job.state, str(job.id)
    seconds = (job.finished_at - job.created_at).total_seconds()
    app = current_app._get_current_object()
    transaction.on_commit(lambda: job_finished(app, task=task, state=state, seconds=seconds, job_id=job_id))


def _revoke(app: Any, task_id: str) -> None:
    """Revoke a cancelled job's message on the workers (best effort: a worker that starts it anyway finds the job
    cancelled and does not run its body)."""
    import logging

    from celery import current_app

    try:
        (app or current_app).control.revoke(task_id)
    except Exception as exc:
        logging.getLogger(__name__).warning("Job message %s not revoked (%r); its delivery will skip it", task_id, exc)


assert set(Job.State.values) == set(STATES)
