"""The run ledger of scheduled work (the table of the Django store's run ledger).

:class:`ScheduledRun` is one row per (schedule, period), written by :mod:`django_celery_guardrails.store.ledger`;
it mirrors the per-schedule hash and index of ``celery_guardrails/stores/redis_ledger.py``.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import models
from django.utils.translation import gettext_lazy as _

from celery_guardrails.scheduling import ledger

from ..querysets import ScheduledRunQuerySet


class ScheduledRun(models.Model):
    """The run ledger (the Django store): one record per (schedule, period) of scheduled work.

    The unique constraint on the pair is what lets two beat processes, a manual re-run and a catch-up race to
    dispatch a period and only one win; see :mod:`celery_guardrails.scheduling.ledger` for the statuses and who sets
    them.
    """

    class Status(models.TextChoices):
        DISPATCHED = ledger.DISPATCHED, _("dispatched")
        RUNNING = ledger.RUNNING, _("running")
        OK = ledger.OK, _("ok")
        FAILED = ledger.FAILED, _("failed")
        SKIPPED_OVERLAP = ledger.SKIPPED_OVERLAP, _("skipped (overlap)")
        SKIPPED_DISABLED = ledger.SKIPPED_DISABLED, _("skipped (disabled)")
        MISSED = ledger.MISSED, _("missed")
        OVERDUE = ledger.OVERDUE, _("overdue")

    schedule = models.CharField(
        _("schedule"),
        max_length=ledger.NAME_MAX_LENGTH,
        help_text=_("The schedule's name (a django-celery-beat periodic task's name, or the beat_schedule key)."),
    )
    period = models.DateTimeField(
        _("period"), help_text=_("The run's due instant (UTC); the run covers the period that ends then.")
    )
    status = models.CharField(
        _("status"),
        max_length=20,
        choices=Status.choices,
        help_text=_(
            "Dispatched: beat sent it. Running: a worker started it. Ok, failed: it finished. Skipped (overlap): "
            "its predecessor was still running. Skipped (disabled): its schedule was disabled when it came due. "
            "Missed: not dispatched or not started in time. Overdue: it ran past its maximum run time."
        ),
    )
    task_id = models.CharField(
        _("task id"),
        max_length=255,
        blank=True,
        default="",
        help_text=_("Id of the message sent for this period; empty when none was sent."),
    )
    dispatched_at = models.DateTimeField(
        _("dispatched at"), null=True, blank=True, help_text=_("When beat (or a catch-up) sent the message.")
    )
    started_at = models.DateTimeField(
        _("started at"), null=True, blank=True, help_text=_("When a worker started the run.")
    )
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True, help_text=_("When the run ended."))
    reason = models.TextField(
        _("reason"),
        blank=True,
        default="",
        help_text=_("Why it was missed, skipped, overdue or failed (at most 500 characters)."),
    )
    missed_at = models.DateTimeField(
        _("missed at"),
        null=True,
        blank=True,
        help_text=_(
            "When the period was first recorded missed, and its owner alerted (once). Kept when a catch-up "
            "runs it later."
        ),
    )
    overdue_at = models.DateTimeField(
        _("overdue at"),
        null=True,
        blank=True,
        help_text=_("When the run was first recorded past its maximum run time. Kept when it finishes."),
    )
    updated_at = models.DateTimeField(_("updated at"), auto_now=True, help_text=_("Last change of this record."))

    objects = ScheduledRunQuerySet.as_manager()

    class Meta:
        verbose_name = _("scheduled run")
        verbose_name_plural = _("scheduled runs")
        ordering = ("-period",)
        constraints = [models.UniqueConstraint(fields=["schedule", "period"], name="guardrails_run_once_per_period")]
        indexes = [
            models.Index(fields=["schedule", "-period"], name="guardrails_run_schedule_period"),
            models.Index(fields=["status", "period"], name="guardrails_run_status_period"),
        ]

    def __str__(self) -> str:
        from ..display import escape  # as DeadLetter.__str__

        return escape(f"{self.schedule} @ {self.period.isoformat()} ({self.status})")

    @property
    def duration(self) -> timedelta | None:
        """From start to end, when both are known."""
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at
