"""The retry budget and circuit breaker of each dependency (the table of the Django store's budget half).

:class:`DependencyState` is one row per dependency, changed under its row lock by
:mod:`django_celery_guardrails.store.budgets`; it mirrors the per-dependency hash of
``celery_guardrails/stores/redis.py``.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from ..querysets import DependencyStateQuerySet


class DependencyState(models.Model):
    """The retry budget and circuit breaker of one dependency, shared by every worker (the Django store)."""

    class Circuit(models.TextChoices):
        CLOSED = "closed", _("closed")
        OPEN = "open", _("open")
        HALF_OPEN = "half_open", _("half-open")

    dependency = models.CharField(
        _("dependency"),
        max_length=100,
        unique=True,
        help_text=_("The name tasks give in dependency=..., e.g. payments-api."),
    )
    window_index = models.BigIntegerField(
        _("window index"),
        default=0,
        help_text=_("Number of the current budget window: epoch seconds divided by the window length."),
    )
    first_current = models.PositiveIntegerField(
        _("first attempts, this window"), default=0, help_text=_("First attempts admitted in the current window.")
    )
    retries_current = models.PositiveIntegerField(
        _("retries, this window"), default=0, help_text=_("Retries admitted in the current window.")
    )
    first_previous = models.PositiveIntegerField(
        _("first attempts, previous window"), default=0, help_text=_("First attempts of the previous window.")
    )
    retries_previous = models.PositiveIntegerField(
        _("retries, previous window"), default=0, help_text=_("Retries of the previous window.")
    )
    denied_window = models.BigIntegerField(
        _("last refused window"),
        default=-1,
        help_text=_("Window index of the last budget refusal (the budget_exhausted signal fires once per window)."),
    )
    failures = models.PositiveIntegerField(
        _("consecutive failures"), default=0, help_text=_("Transient failures in a row; a success resets it.")
    )
    circuit = models.CharField(
        _("circuit"),
        max_length=10,
        choices=Circuit.choices,
        default=Circuit.CLOSED,
        help_text=_("Closed: attempts run. Open: new first attempts wait. Half-open: a few probes run."),
    )
    open_until = models.FloatField(
        _("open until"), default=0.0, help_text=_("Epoch seconds at which an open circuit lets probes through.")
    )
    probes = models.PositiveIntegerField(
        _("probes"), default=0, help_text=_("First attempts let through since the circuit became half-open.")
    )
    probe_until = models.FloatField(
        _("probes given up at"),
        default=0.0,
        help_text=_(
            "Epoch seconds after which probes that never reported (their worker was killed) are given up and "
            "another is let through."
        ),
    )
    updated_at = models.DateTimeField(_("updated at"), auto_now=True, help_text=_("Last change of this row."))

    objects = DependencyStateQuerySet.as_manager()

    class Meta:
        verbose_name = _("dependency state")
        verbose_name_plural = _("dependency states")
        ordering = ["dependency"]

    def __str__(self) -> str:
        return f"{self.dependency} ({self.circuit})"
