"""Waiting messages (the table of the Django store's waiting half; see :mod:`celery_guardrails.guardrails.waiting`).

:class:`WaitingMessage` is one row per task id re-published with a countdown, written by
:mod:`django_celery_guardrails.store.waiting`; it mirrors the ``guardrails:{waiting}`` hash of
``celery_guardrails/stores/redis_waiting.py``.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class WaitingMessage(models.Model):
    """A message the guardrails re-published with a countdown, until its next delivery starts (see
    :mod:`celery_guardrails.guardrails.waiting`): the Django store's table, and the admin's "Waiting" page (which reads
    the configured store, this table or Redis)."""

    task_id = models.CharField(
        _("task id"), max_length=255, unique=True, help_text=_("The message's task id (one row per task id).")
    )
    task_name = models.CharField(_("task"), max_length=255, help_text=_("The task's registered name."))
    tenant = models.CharField(
        _("tenant"), max_length=100, blank=True, db_index=True, help_text=_("The message's tenant (empty: none).")
    )
    queue = models.CharField(
        _("queue"), max_length=255, blank=True, help_text=_("The queue it came from (empty: unknown).")
    )
    reason = models.CharField(
        _("reason"),
        max_length=40,
        help_text=_(
            "Why it waits: retry, later, budget, circuit, concurrency, ordering, busy, overlap or dead_letter."
        ),
    )
    detail = models.CharField(
        _("detail"),
        max_length=255,
        blank=True,
        help_text=_("What it waits on: the error class of a retry, the dependency, the key."),
    )
    attempt = models.PositiveIntegerField(
        _("attempt"), default=1, help_text=_("The attempt its next delivery makes (a wait spends none).")
    )
    due_at = models.DateTimeField(_("due at"), db_index=True, help_text=_("When the broker delivers it again."))
    since = models.DateTimeField(_("waiting since"), help_text=_("When this wait began (the first of a series)."))
    expires_at = models.DateTimeField(
        _("expires at"),
        db_index=True,
        help_text=_("When the row is forgotten although no delivery removed it (its message lost)."),
    )

    objects: models.Manager[WaitingMessage] = models.Manager()

    class Meta:
        verbose_name = _("waiting message")
        verbose_name_plural = _("waiting")
        default_permissions = ()

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}] ({self.reason})"
