"""Delivery counts of redelivered messages (the table of the Django store's poison-message protection).

:class:`DeliveryCounter` is one row per message that never finished, counted by
:mod:`django_celery_guardrails.store.poison`; it mirrors the counter keys of ``RedisIdempotency.count_delivery``
in ``celery_guardrails/stores/redis.py``.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class DeliveryCounter(models.Model):
    """Starts of a redelivered message that never finished (poison-message protection)."""

    message_id = models.CharField(_("message id"), max_length=255, unique=True, help_text=_("The task id."))
    starts = models.PositiveIntegerField(_("starts"), default=1, help_text=_("Redelivered starts so far."))
    updated_at = models.DateTimeField(_("updated at"), auto_now=True, help_text=_("Last start."))

    objects: models.Manager[DeliveryCounter] = models.Manager()

    class Meta:
        verbose_name = _("delivery counter")
        verbose_name_plural = _("delivery counters")

    def __str__(self) -> str:
        return f"{self.message_id}: {self.starts}"
