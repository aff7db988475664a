"""The transactional outbox (see :mod:`django_celery_guardrails.outbox`).

:class:`OutboxMessage` is a task message written in the caller's transaction and published by the relay after
the commit. It is a table of the database the caller writes to, whatever the store: no Redis store file
mirrors it.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class OutboxMessage(models.Model):
    """A task message written in the caller's database transaction (``enqueue_in_transaction``,
    ``apply_async(outbox=True)``) and published by the relay once that transaction committed: a rollback
    publishes nothing, a crash after the commit loses nothing (see :mod:`django_celery_guardrails.outbox`)."""

    task_name = models.CharField(_("task name"), max_length=255, help_text=_("The task's registered name."))
    task_id = models.CharField(
        _("task id"), max_length=255, help_text=_("The id the message is published with (known to the caller).")
    )
    body = models.TextField(_("body"), help_text=_("The arguments and keyword arguments, serialised as JSON."))
    options = models.JSONField(
        _("options"),
        default=dict,
        blank=True,
        help_text=_("apply_async options (queue, countdown, eta, priority, guardrail options) as JSON."),
    )
    tenant = models.CharField(
        _("tenant"), max_length=255, blank=True, help_text=_("The caller's tenant when it enqueued (empty: none).")
    )
    correlation_id = models.CharField(
        _("correlation id"), max_length=255, blank=True, help_text=_("The caller's correlation id when it enqueued.")
    )
    created_at = models.DateTimeField(_("created at"), auto_now_add=True, help_text=_("When it was enqueued."))
    available_at = models.DateTimeField(
        _("available at"),
        help_text=_("The relay publishes it from then on (later after a failed publish: a backoff)."),
    )
    attempts = models.PositiveIntegerField(
        _("attempts"),
        default=0,
        help_text=_(
            "Publishes that failed so far for the message's own sake (an unknown task, a refusal); the broker out "
            "of reach spends none. At outbox_max_attempts it becomes a dead letter (unpublishable)."
        ),
    )
    last_error = models.TextField(_("last error"), blank=True, help_text=_("Why the last publish failed."))

    objects: models.Manager[OutboxMessage] = models.Manager()

    class Meta:
        verbose_name = _("outbox message")
        verbose_name_plural = _("outbox messages")
        indexes = [models.Index(fields=["available_at", "id"], name="guardrails_outbox_due")]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}]"
