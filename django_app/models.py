"""Models of the guardrails app."""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from .querysets import DependencyStateQuerySet, IdempotencyKeyQuerySet, ProcessedMessageQuerySet


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
    updated_at = models.DateTimeField(_("updated at"), auto_now=True, help_text=_("Last change of this row."))

    objects = DependencyStateQuerySet.as_manager()

    class Meta:
        verbose_name = _("dependency state")
        verbose_name_plural = _("dependency states")
        ordering = ["dependency"]

    def __str__(self) -> str:
        return f"{self.dependency} ({self.circuit})"


class IdempotencyKey(models.Model):
    """One idempotency key: claimed by the delivery running its task, then completed or failed."""

    class State(models.TextChoices):
        CLAIMED = "claimed", _("claimed")
        COMPLETED = "completed", _("completed")
        FAILED = "failed", _("failed")

    key = models.CharField(
        _("key"),
        max_length=255,
        unique=True,
        help_text=_("Task name, tenant and the task's own key: task:tenant:key (hashed past 255 characters)."),
    )
    state = models.CharField(
        _("state"),
        max_length=10,
        choices=State.choices,
        default=State.CLAIMED,
        help_text=_(
            "Claimed: a delivery is running it. Completed: done, duplicates are skipped. "
            "Failed: failed for good; a replay reopens it."
        ),
    )
    owner = models.CharField(
        _("owner"),
        max_length=200,
        blank=True,
        help_text=_("The delivery holding the claim: worker host, process, task id and a nonce."),
    )
    lease_until = models.DateTimeField(
        _("lease until"),
        null=True,
        blank=True,
        help_text=_("A claim whose lease ran out (its worker died) is taken over by the next delivery."),
    )
    summary = models.CharField(
        _("result summary"),
        max_length=200,
        blank=True,
        help_text=_("Short text of the result, returned to duplicates instead of running the task again."),
    )
    reason = models.CharField(
        _("failure reason"), max_length=200, blank=True, help_text=_("Why the key failed for good.")
    )
    created_at = models.DateTimeField(_("created at"), auto_now_add=True, help_text=_("First claim."))
    finished_at = models.DateTimeField(
        _("finished at"),
        null=True,
        blank=True,
        help_text=_("When it completed or failed; retention counts from here."),
    )

    objects = IdempotencyKeyQuerySet.as_manager()

    class Meta:
        verbose_name = _("idempotency key")
        verbose_name_plural = _("idempotency keys")
        indexes = [models.Index(fields=["state", "finished_at"], name="guardrails_idem_state_finished")]

    def __str__(self) -> str:
        return f"{self.key} ({self.state})"


class ProcessedMessage(models.Model):
    """Messages a handler has processed, for handlers whose effect has no natural unique key.

    Insert the message's key in the same transaction as the effect (``mark_processed``): a second delivery
    hits the unique constraint and knows it has nothing to do.
    """

    key = models.CharField(
        _("key"), max_length=255, unique=True, help_text=_("The idempotency key of the processed message.")
    )
    processed_at = models.DateTimeField(
        _("processed at"), auto_now_add=True, help_text=_("When the effect was committed.")
    )

    objects = ProcessedMessageQuerySet.as_manager()

    class Meta:
        verbose_name = _("processed message")
        verbose_name_plural = _("processed messages")

    def __str__(self) -> str:
        return self.key
