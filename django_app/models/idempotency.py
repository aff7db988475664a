"""Idempotency keys and processed messages (the tables of the Django store's idempotency half).

:class:`IdempotencyKey` is one row per key (and per publish reservation), claimed and finished by
:mod:`django_celery_guardrails.store.idempotency`; it mirrors the key hashes of ``RedisIdempotency`` in
``celery_guardrails/stores/redis.py``. :class:`ProcessedMessage` is the handlers' own record of a message whose
effect has no natural unique key (:mod:`django_celery_guardrails.effects`), which has no Redis counterpart: it
commits in the effect's transaction.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from ..querysets import IdempotencyKeyQuerySet, ProcessedMessageQuerySet


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
