"""Checkpoints of long jobs (the table of the Django store's checkpoint half).

:class:`Checkpoint` is one row per job, saved in the chunk's transaction by
:mod:`django_celery_guardrails.store.checkpoint`; it mirrors the per-job hash of
``celery_guardrails/stores/redis_checkpoint.py``.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class Checkpoint(models.Model):
    """How far a long job got (``self.checkpoint.iterate``): its next delivery resumes from here."""

    key = models.CharField(
        _("key"),
        max_length=255,
        unique=True,
        help_text=_(
            "The job's scoped idempotency key (task:tenant:key), or task:tenant:task-id:<task id> for a task "
            "without one."
        ),
    )
    position = models.BigIntegerField(
        _("position"), default=0, help_text=_("Items done: a resumed run skips this many items of its sequence.")
    )
    state = models.TextField(
        _("state"), blank=True, help_text=_("The job's small JSON state saved with the position (empty: none).")
    )
    updated_at = models.DateTimeField(_("updated at"), auto_now=True, help_text=_("The last chunk's commit."))
    completed_at = models.DateTimeField(
        _("completed at"),
        null=True,
        blank=True,
        help_text=_(
            "When the job's task succeeded (empty: not yet). A redelivery of its message (the worker killed after "
            "the success, before the ack) runs none of its items again; the row is pruned with the idempotency "
            "keys."
        ),
    )

    objects: models.Manager[Checkpoint] = models.Manager()

    class Meta:
        verbose_name = _("checkpoint")
        verbose_name_plural = _("checkpoints")

    def __str__(self) -> str:
        return f"{self.key} @ {self.position}{' (done)' if self.completed_at else ''}"
