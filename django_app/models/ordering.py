"""Ordering per key (the table of the Django store's ordering half).

:class:`OrderingSequence` is one row per ordering key, its counters changed by
:mod:`django_celery_guardrails.store.ordering`; it mirrors the per-key hash of
``celery_guardrails/stores/redis_ordering.py``.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class OrderingSequence(models.Model):
    """The counters of one ordering key (``ordering_key``): the sequence numbers handed out at publish and the
    last one whose turn is over (see ``celery_guardrails.guardrails.ordering``)."""

    key = models.CharField(
        _("ordering key"), max_length=255, unique=True, help_text=_("task name:tenant:key, as the worker scopes it.")
    )
    issued = models.BigIntegerField(
        _("issued"), default=0, help_text=_("The last sequence number handed out at publish (1, 2, ...).")
    )
    done = models.BigIntegerField(
        _("done"),
        default=0,
        help_text=_("The last sequence number whose turn is over: it ran, failed finally, or was given up as lost."),
    )
    gap_since = models.FloatField(
        _("waiting since"),
        default=0.0,
        help_text=_("Epoch seconds a message first waited for a missing earlier one (0: none waiting)."),
    )
    waiting = models.BigIntegerField(
        _("lowest waiting"),
        default=0,
        help_text=_("The lowest sequence number seen waiting since the key last moved (0: none)."),
    )
    skipped_from = models.BigIntegerField(
        _("skipped from"), default=0, help_text=_("First sequence number of the last range given up as lost.")
    )
    skipped_to = models.BigIntegerField(
        _("skipped to"), default=0, help_text=_("Last sequence number of the last range given up as lost.")
    )
    stale = models.PositiveIntegerField(
        _("stale deliveries"),
        default=0,
        help_text=_("Deliveries that came after their turn was over (skipped without running)."),
    )
    skipped_since = models.FloatField(
        _("skipped gap opened"),
        default=0.0,
        help_text=_("Epoch seconds the wait for the last range given up as lost began (0: none given up)."),
    )
    skipped_at = models.FloatField(
        _("skipped at"),
        default=0.0,
        help_text=_("Epoch seconds the last range was given up as lost, after ordering_gap_timeout (0: none)."),
    )
    skip_owed = models.BooleanField(
        _("skip record owed"),
        default=False,
        help_text=_(
            "The last range given up is not yet recorded as a dead letter (ordering_gap_skipped); the next "
            "message of the key records it before it goes on."
        ),
    )
    alerted = models.FloatField(
        _("alerted for the wait of"),
        default=0.0,
        help_text=_("The 'waiting since' of the last wait that alerted (ordering_gap_alert_after); 0: none."),
    )
    updated_at = models.DateTimeField(
        _("updated at"), auto_now=True, help_text=_("Last change: a key idle past ordering_retention may be pruned.")
    )

    objects: models.Manager[OrderingSequence] = models.Manager()

    class Meta:
        verbose_name = _("ordering sequence")
        verbose_name_plural = _("ordering sequences")
        # The keys that wait, oldest wait first (the status command and the metrics), from the few rows that do.
        indexes = [
            models.Index(fields=["gap_since"], name="guardrails_order_waiting", condition=models.Q(gap_since__gt=0))
        ]

    def __str__(self) -> str:
        return f"{self.key}: {self.done}/{self.issued}"
