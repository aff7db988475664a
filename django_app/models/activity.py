"""Activity per minute (the tables of the Django store's activity half).

:class:`ActivityCount` holds delivery outcomes per minute, task, queue and outcome, :class:`ActivityBatch` the
batches already added, :class:`QueueSample` a queue's depth and oldest age per minute; all are written by
:mod:`django_celery_guardrails.store.activity`. They mirror the hourly hashes of
``celery_guardrails/stores/redis_activity.py``.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class ActivityCount(models.Model):
    """Deliveries of a task from a queue that ended with one outcome in one minute (the dashboard's charts,
    the status command's rates); added by each worker process every ``activity_flush_interval`` seconds."""

    minute = models.DateTimeField(_("minute"), help_text=_("The minute's start (UTC) in which the deliveries ended."))
    task_name = models.CharField(_("task name"), max_length=255, help_text=_("The task's registered name."))
    queue = models.CharField(
        _("queue"), max_length=255, blank=True, help_text=_("The queue the deliveries came from (empty: unknown).")
    )
    outcome = models.CharField(
        _("outcome"),
        max_length=40,
        help_text=_(
            "How they ended: succeeded, retried, dead_lettered, ... (see celery_guardrails.operations.metrics)."
        ),
    )
    count = models.BigIntegerField(_("count"), default=0, help_text=_("How many deliveries."))

    objects: models.Manager[ActivityCount] = models.Manager()

    class Meta:
        verbose_name = _("activity count")
        verbose_name_plural = _("activity counts")
        constraints = [
            models.UniqueConstraint(
                fields=["minute", "task_name", "queue", "outcome"], name="guardrails_activity_count_once"
            )
        ]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.task_name} {self.outcome}: {self.count}"


class ActivityBatch(models.Model):
    """A batch of activity counts already added: the same batch sent again (its answer was lost) adds nothing."""

    batch = models.CharField(_("batch"), max_length=64, unique=True, help_text=_("The recorder's id of the batch."))
    added_at = models.DateTimeField(_("added at"), auto_now_add=True, help_text=_("When the batch was added."))

    objects: models.Manager[ActivityBatch] = models.Manager()

    class Meta:
        verbose_name = _("activity batch")
        verbose_name_plural = _("activity batches")

    def __str__(self) -> str:
        return self.batch


class QueueSample(models.Model):
    """A queue's depth and oldest message's age as read once in a minute (the dashboard's queue age chart)."""

    minute = models.DateTimeField(_("minute"), help_text=_("The minute's start (UTC) in which the queue was read."))
    queue = models.CharField(_("queue"), max_length=255, help_text=_("The queue's name."))
    depth = models.BigIntegerField(_("depth"), help_text=_("Messages waiting (not counting those delivered)."))
    oldest_age = models.FloatField(
        _("oldest age"),
        null=True,
        blank=True,
        help_text=_("Seconds since the oldest waiting message was published; empty when unknown."),
    )

    objects: models.Manager[QueueSample] = models.Manager()

    class Meta:
        verbose_name = _("queue sample")
        verbose_name_plural = _("queue samples")
        constraints = [models.UniqueConstraint(fields=["minute", "queue"], name="guardrails_queue_sample_once")]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.queue}: {self.depth}"
