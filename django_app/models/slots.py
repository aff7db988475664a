"""Concurrency keys and their slots (the tables of the Django store's slot half).

:class:`ConcurrencyKey` is one row per key (the lock every capacity check takes first, and its counters),
:class:`ConcurrencySlot` one per holder, held or lost; both are changed by
:mod:`django_celery_guardrails.store.slots`. They mirror the sorted set, info and meta hashes and lost list of
``celery_guardrails/stores/redis_slots.py``.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class ConcurrencyKey(models.Model):
    """One concurrency key (``concurrency_key`` / ``exclusive_key``): the row every capacity check of the key
    locks first, so two workers can never both take its last slot; and its counters."""

    key = models.CharField(
        _("key"),
        max_length=255,
        unique=True,
        help_text=_("limit:<rendered concurrency_key> or exclusive:<rendered exclusive_key>, e.g. limit:tenant:acme."),
    )
    reap_after = models.FloatField(
        _("reap after"),
        default=300.0,
        help_text=_(
            "Seconds without a heartbeat after which a holder is reaped (recorded lost), as the last capacity "
            "check of the key used it; the reaper on a timer uses it too."
        ),
    )
    checks = models.PositiveBigIntegerField(
        _("capacity checks"), default=0, help_text=_("Capacity checks made for this key, slot taken or not.")
    )
    acquired = models.PositiveBigIntegerField(_("slots taken"), default=0, help_text=_("Slots taken so far."))
    reaped = models.PositiveBigIntegerField(
        _("holders reaped"), default=0, help_text=_("Holders reaped so far (their jobs recorded lost).")
    )

    objects: models.Manager[ConcurrencyKey] = models.Manager()

    class Meta:
        verbose_name = _("concurrency key")
        verbose_name_plural = _("concurrency keys")
        ordering = ["key"]

    def __str__(self) -> str:
        return self.key


class ConcurrencySlot(models.Model):
    """A delivery holding a concurrency slot of a key, or one that held it and was reaped (``lost``: its
    heartbeat stopped, its worker died). A released slot's row is deleted; a lost one is kept as the record."""

    class State(models.TextChoices):
        HELD = "held", _("held")
        LOST = "lost", _("lost")

    key = models.CharField(_("key"), max_length=255, help_text=_("The concurrency key (see concurrency keys)."))
    holder = models.CharField(
        _("holder"),
        max_length=300,
        help_text=_("The delivery holding the slot: worker host, process, task id and a nonce."),
    )
    task_name = models.CharField(_("task"), max_length=200, blank=True, help_text=_("The task the holder runs."))
    task_id = models.CharField(_("task id"), max_length=255, blank=True, help_text=_("The holder's task id."))
    tenant = models.CharField(_("tenant"), max_length=100, blank=True, help_text=_("The holder's tenant, if any."))
    acquired_at = models.DateTimeField(_("acquired at"), help_text=_("When the holder took the slot."))
    heartbeat_at = models.DateTimeField(
        _("last heartbeat"), help_text=_("The holder's last heartbeat; a stale one is reaped.")
    )
    state = models.CharField(
        _("state"),
        max_length=10,
        choices=State.choices,
        default=State.HELD,
        help_text=_("Held: running. Lost: reaped after its heartbeat stopped (the job is recorded as failed)."),
    )
    reaped_at = models.DateTimeField(
        _("reaped at"), null=True, blank=True, help_text=_("When the reaper took the slot away.")
    )

    objects: models.Manager[ConcurrencySlot] = models.Manager()

    class Meta:
        verbose_name = _("concurrency slot")
        verbose_name_plural = _("concurrency slots")
        constraints = [
            models.UniqueConstraint(
                fields=["key", "holder"], condition=models.Q(state="held"), name="guardrails_slot_held_once"
            )
        ]
        indexes = [models.Index(fields=["key", "state", "heartbeat_at"], name="guardrails_slot_key_state")]

    def __str__(self) -> str:
        return f"{self.key}: {self.holder} ({self.state})"
