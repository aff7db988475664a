"""Dead letters and their sealed originals (see :mod:`celery_guardrails.runtime.dead_letters`).

:class:`DeadLetter` is the record of a message that will not be tried again, :class:`SealedMessage` the
encrypted original a replay opens. They are written by the ``django`` dead-letter sink
(``dead_letter_sinks``), not by the store: no Redis store file mirrors them (the core's Redis stream sink is its
counterpart).
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from ..querysets import DeadLetterQuerySet


def record_name(*, task_name: str, task_id: str, reason: str, status: str) -> str:
    """A record's name: every page and log entry Django names a record by (its delete pages and messages, "Recent
    actions", the action checkbox's label) shows this, control and invisible characters written out
    (.display). The actions' LogEntries name many records read without their model (``str(record)``)."""
    from ..display import escape

    return escape(f"{task_name}[{task_id}] {reason} ({status})")


class DeadLetter(models.Model):
    """A message that will not be tried again: what it was, why it failed, every attempt, and who owns it."""

    class Status(models.TextChoices):
        OPEN = "open", _("open")
        REPLAYED = "replayed", _("replayed")
        DISCARDED = "discarded", _("discarded")
        RESOLVED = "resolved", _("resolved")

    task_name = models.CharField(_("task"), max_length=200, help_text=_("Registered task name."))
    task_id = models.CharField(
        _("task id"), max_length=255, unique=True, help_text=_("Id of the message that failed; one record per id.")
    )
    queue = models.CharField(_("queue"), max_length=200, blank=True, help_text=_("Queue it was consumed from."))
    routing_key = models.CharField(
        _("routing key"), max_length=200, blank=True, help_text=_("Routing key it was delivered with.")
    )
    args = models.JSONField(
        _("arguments"), default=list, blank=True, help_text=_("Positional arguments, with secrets redacted.")
    )
    kwargs = models.JSONField(
        _("keyword arguments"), default=dict, blank=True, help_text=_("Keyword arguments, with secrets redacted.")
    )
    arguments_are_repr = models.BooleanField(
        _("arguments stored as text"),
        default=False,
        help_text=_(
            "The arguments could not be stored as JSON: args holds their repr. A replay sends the originals from the "
            "sealed copy when there is one; without it the record cannot be replayed."
        ),
    )
    tenant = models.CharField(_("tenant"), max_length=128, blank=True, help_text=_("Tenant id."))
    correlation_id = models.CharField(
        _("correlation id"), max_length=128, blank=True, help_text=_("Request or workflow id.")
    )
    idempotency_key = models.CharField(
        _("idempotency key"), max_length=255, blank=True, help_text=_("Scoped idempotency key.")
    )
    header = models.JSONField(
        _("guardrails header"),
        default=dict,
        blank=True,
        help_text=_("The message's guardrails header (context, per-call options), for replay."),
    )
    reason = models.CharField(
        _("reason"),
        max_length=40,
        help_text=_(
            "permanent, attempts_exhausted, retry_later_exhausted, retry_budget_exhausted, circuit_open, "
            "not_idempotent, missing_tenant, bad_idempotency_key or poison."
        ),
    )
    exc_type = models.CharField(_("exception type"), max_length=255, blank=True, help_text=_("module.Class"))
    exc_message = models.TextField(_("exception message"), blank=True, help_text=_("At most 500 characters."))
    traceback = models.TextField(_("traceback"), blank=True, help_text=_("Of the final failure."))
    fingerprint = models.CharField(
        _("fingerprint"),
        max_length=16,
        blank=True,
        help_text=_(
            "The failure's cause: the same for every record of this task, exception type, message (numbers, ids "
            "and quoted values aside) and frame of the task's own code. Empty for a record made before "
            "fingerprints until `guardrails_deadletters fingerprint` fills it in."
        ),
    )
    history = models.JSONField(
        _("attempt history"), default=list, blank=True, help_text=_("Every attempt record, oldest first.")
    )
    attempts = models.PositiveIntegerField(_("attempts"), default=1, help_text=_("Attempts consumed."))
    first_failed_at = models.DateTimeField(_("first failure"), help_text=_("Start of the first attempt."))
    last_failed_at = models.DateTimeField(_("last failure"), db_index=True, help_text=_("The final failure."))
    owner = models.CharField(_("owner"), max_length=100, blank=True, help_text=_("Who is alerted and fixes it."))
    status = models.CharField(
        _("status"),
        max_length=10,
        choices=Status.choices,
        default=Status.OPEN,
        help_text=_("Open until someone replays, discards or resolves it."),
    )
    replayed_task_id = models.CharField(
        _("replayed as"), max_length=255, blank=True, help_text=_("Task id of the replay, when replayed.")
    )
    handled_by = models.CharField(
        _("handled by"), max_length=150, blank=True, help_text=_("User who replayed, discarded or resolved it.")
    )
    handled_at = models.DateTimeField(_("handled at"), null=True, blank=True, help_text=_("When that happened."))
    created_at = models.DateTimeField(_("recorded at"), auto_now_add=True, help_text=_("When it was recorded."))

    objects = DeadLetterQuerySet.as_manager()

    class Meta:
        verbose_name = _("dead letter")
        verbose_name_plural = _("dead letters")
        ordering = ["-last_failed_at"]
        permissions = [
            ("replay_deadletter", _("Can replay dead letters")),
            ("discard_deadletter", _("Can discard dead letters")),
            ("resolve_deadletter", _("Can mark dead letters resolved")),
        ]
        # Each change-list filter (the admin's, the commands') leads an index that goes on with the status and the
        # newest failure first: a filter, with or without a status, finds its first page and counts up to the
        # paginator's cap through one index, and lists its distinct values one probe each. Ids are looked up
        # by equality only: plain indexes (db_index would add a second, LIKE-pattern index on PostgreSQL).
        indexes = [
            models.Index(fields=["status", "-last_failed_at"], name="guardrails_dl_status_last"),
            models.Index(fields=["reason", "status", "-last_failed_at"], name="guardrails_dl_reason_status"),
            models.Index(fields=["owner", "status", "-last_failed_at"], name="guardrails_dl_owner_status"),
            models.Index(fields=["task_name", "status", "-last_failed_at"], name="guardrails_dl_task_status"),
            models.Index(fields=["tenant", "status", "-last_failed_at"], name="guardrails_dl_tenant_status"),
            models.Index(fields=["fingerprint", "status", "-last_failed_at"], name="guardrails_dl_fingerprint"),
            models.Index(fields=["correlation_id"], name="guardrails_dl_correlation"),
            models.Index(fields=["idempotency_key"], name="guardrails_dl_idempotency_key"),
        ]

    def __str__(self) -> str:
        return record_name(task_name=self.task_name, task_id=self.task_id, reason=self.reason, status=self.status)


class SealedMessage(models.Model):
    """The original arguments and header of one dead letter, encrypted with ``seal_keys`` (see
    :mod:`celery_guardrails.foundation.sealing`): only a replay opens it. Deleted with its record."""

    dead_letter = models.OneToOneField(
        DeadLetter,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="sealed",
        verbose_name=_("dead letter"),
        help_text=_("The record this is the sealed original of."),
    )
    token = models.TextField(
        _("sealed copy"), help_text=_("Fernet token of the original arguments and header (JSON); never shown.")
    )
    sealed_at = models.DateTimeField(
        _("sealed at"), auto_now=True, help_text=_("When it was sealed, or sealed again with a newer key.")
    )
    dead_letter_id: int

    objects: models.Manager[SealedMessage] = models.Manager()

    class Meta:
        verbose_name = _("sealed message")
        verbose_name_plural = _("sealed messages")

    def __str__(self) -> str:
        return f"sealed copy of dead letter {self.dead_letter_id}"
