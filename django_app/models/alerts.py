"""Alert throttle windows (the table of the Django store's alert throttling).

:class:`AlertThrottle` is one row per (owner, task, reason) group, changed by
:mod:`django_celery_guardrails.store.alerts`; it mirrors the ``guardrails:{alerts}:`` keys of
``RedisIdempotency.throttle`` in ``celery_guardrails/stores/redis.py``.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class AlertThrottle(models.Model):
    """The alert throttle window of one (owner, task, reason) group."""

    # owner (100) | task or schedule name (200) | reason (at most 40): 400 holds the longest.
    group = models.CharField(
        _("group"), max_length=400, unique=True, help_text=_("owner|task|reason, or owner|schedule|run_<kind>")
    )
    until = models.FloatField(_("window ends"), default=0.0, help_text=_("Epoch seconds the window ends."))
    opened = models.FloatField(
        _("opened"),
        default=0.0,
        help_text=_("Epoch seconds of the alert that opened the window (an extending window grows only so far)."),
    )
    suppressed = models.PositiveIntegerField(
        _("suppressed"), default=0, help_text=_("Dead letters in the window not alerted one by one yet.")
    )

    objects: models.Manager[AlertThrottle] = models.Manager()

    class Meta:
        verbose_name = _("alert throttle")
        verbose_name_plural = _("alert throttles")

    def __str__(self) -> str:
        return self.group
