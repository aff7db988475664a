"""Models of the guardrails app."""

from __future__ import annotations

from datetime import timedelta

from django.db import models
from django.utils.translation import gettext_lazy as _

from celery_guardrails.scheduling import ledger

from .querysets import (
    DeadLetterQuerySet,
    DependencyStateQuerySet,
    IdempotencyKeyQuerySet,
    ProcessedMessageQuerySet,
    ScheduledRunQuerySet,
)


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
            models.Index(fields=["correlation_id"], name="guardrails_dl_correlation"),
            models.Index(fields=["idempotency_key"], name="guardrails_dl_idempotency_key"),
        ]

    def __str__(self) -> str:
        # Every page and log entry Django names a record by (its delete pages and messages, "Recent actions", the
        # action checkbox's label) shows this: control and invisible characters written out (.display).
        from .display import escape

        return escape(f"{self.task_name}[{self.task_id}] {self.reason} ({self.status})")


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


class ScheduledRun(models.Model):
    """The run ledger (the Django store): one record per (schedule, period) of scheduled work.

    The unique constraint on the pair is what lets two beat processes, a manual re-run and a catch-up race to
    dispatch a period and only one win; see :mod:`celery_guardrails.scheduling.ledger` for the statuses and who sets
    them.
    """

    class Status(models.TextChoices):
        DISPATCHED = ledger.DISPATCHED, _("dispatched")
        RUNNING = ledger.RUNNING, _("running")
        OK = ledger.OK, _("ok")
        FAILED = ledger.FAILED, _("failed")
        SKIPPED_OVERLAP = ledger.SKIPPED_OVERLAP, _("skipped (overlap)")
        SKIPPED_DISABLED = ledger.SKIPPED_DISABLED, _("skipped (disabled)")
        MISSED = ledger.MISSED, _("missed")
        OVERDUE = ledger.OVERDUE, _("overdue")

    schedule = models.CharField(
        _("schedule"),
        max_length=ledger.NAME_MAX_LENGTH,
        help_text=_("The schedule's name (a django-celery-beat periodic task's name, or the beat_schedule key)."),
    )
    period = models.DateTimeField(
        _("period"), help_text=_("The run's due instant (UTC); the run covers the period that ends then.")
    )
    status = models.CharField(
        _("status"),
        max_length=20,
        choices=Status.choices,
        help_text=_(
            "Dispatched: beat sent it. Running: a worker started it. Ok, failed: it finished. Skipped (overlap): "
            "its predecessor was still running. Skipped (disabled): its schedule was disabled when it came due. "
            "Missed: not dispatched or not started in time. Overdue: it ran past its maximum run time."
        ),
    )
    task_id = models.CharField(
        _("task id"),
        max_length=255,
        blank=True,
        default="",
        help_text=_("Id of the message sent for this period; empty when none was sent."),
    )
    dispatched_at = models.DateTimeField(
        _("dispatched at"), null=True, blank=True, help_text=_("When beat (or a catch-up) sent the message.")
    )
    started_at = models.DateTimeField(
        _("started at"), null=True, blank=True, help_text=_("When a worker started the run.")
    )
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True, help_text=_("When the run ended."))
    reason = models.TextField(
        _("reason"),
        blank=True,
        default="",
        help_text=_("Why it was missed, skipped, overdue or failed (at most 500 characters)."),
    )
    missed_at = models.DateTimeField(
        _("missed at"),
        null=True,
        blank=True,
        help_text=_(
            "When the period was first recorded missed, and its owner alerted (once). Kept when a catch-up "
            "runs it later."
        ),
    )
    overdue_at = models.DateTimeField(
        _("overdue at"),
        null=True,
        blank=True,
        help_text=_("When the run was first recorded past its maximum run time. Kept when it finishes."),
    )
    updated_at = models.DateTimeField(_("updated at"), auto_now=True, help_text=_("Last change of this record."))

    objects = ScheduledRunQuerySet.as_manager()

    class Meta:
        verbose_name = _("scheduled run")
        verbose_name_plural = _("scheduled runs")
        ordering = ("-period",)
        constraints = [models.UniqueConstraint(fields=["schedule", "period"], name="guardrails_run_once_per_period")]
        indexes = [
            models.Index(fields=["schedule", "-period"], name="guardrails_run_schedule_period"),
            models.Index(fields=["status", "period"], name="guardrails_run_status_period"),
        ]

    def __str__(self) -> str:
        from .display import escape  # as DeadLetter.__str__

        return escape(f"{self.schedule} @ {self.period.isoformat()} ({self.status})")

    @property
    def duration(self) -> timedelta | None:
        """From start to end, when both are known."""
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at


class Checkpoint(models.Model):
    """How far a long job got (``self.checkpoint.iterate``): its next delivery resumes from here."""

    key = models.CharField(
        _("key"),
        max_length=255,
        unique=True,
        help_text=_(
            "The job's scoped idempotency key (task:tenant:key), or task:tenant:task-id:<task id> for a task "
            "without one."
        ),
    )
    position = models.BigIntegerField(
        _("position"), default=0, help_text=_("Items done: a resumed run skips this many items of its sequence.")
    )
    state = models.TextField(
        _("state"), blank=True, help_text=_("The job's small JSON state saved with the position (empty: none).")
    )
    updated_at = models.DateTimeField(_("updated at"), auto_now=True, help_text=_("The last chunk's commit."))
    completed_at = models.DateTimeField(
        _("completed at"),
        null=True,
        blank=True,
        help_text=_(
            "When the job's task succeeded (empty: not yet). A redelivery of its message (the worker killed after "
            "the success, before the ack) runs none of its items again; the row is pruned with the idempotency "
            "keys."
        ),
    )

    objects: models.Manager[Checkpoint] = models.Manager()

    class Meta:
        verbose_name = _("checkpoint")
        verbose_name_plural = _("checkpoints")

    def __str__(self) -> str:
        return f"{self.key} @ {self.position}{' (done)' if self.completed_at else ''}"


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


class Dashboard(DeadLetter):
    """Not a table: the admin's dashboard page (:mod:`django_celery_guardrails.dashboard`), listed with the app's
    models on the admin index. A proxy of :class:`DeadLetter`, whose view permission it asks for."""

    class Meta:
        proxy = True
        verbose_name = _("dashboard")
        verbose_name_plural = _("dashboard")
        default_permissions = ()


class ActivityCount(models.Model):
    """Deliveries of a task from a queue that ended with one outcome in one minute (the dashboard's charts,
    the status command's rates); added by each worker process every ``activity_flush_interval`` seconds."""

    minute = models.DateTimeField(_("minute"), help_text=_("The minute's start (UTC) in which the deliveries ended."))
    task_name = models.CharField(_("task name"), max_length=255, help_text=_("The task's registered name."))
    queue = models.CharField(
        _("queue"), max_length=255, blank=True, help_text=_("The queue the deliveries came from (empty: unknown).")
    )
    outcome = models.CharField(
        _("outcome"),
        max_length=40,
        help_text=_(
            "How they ended: succeeded, retried, dead_lettered, ... (see celery_guardrails.operations.metrics)."
        ),
    )
    count = models.BigIntegerField(_("count"), default=0, help_text=_("How many deliveries."))

    objects: models.Manager[ActivityCount] = models.Manager()

    class Meta:
        verbose_name = _("activity count")
        verbose_name_plural = _("activity counts")
        constraints = [
            models.UniqueConstraint(
                fields=["minute", "task_name", "queue", "outcome"], name="guardrails_activity_count_once"
            )
        ]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.task_name} {self.outcome}: {self.count}"


class ActivityBatch(models.Model):
    """A batch of activity counts already added: the same batch sent again (its answer was lost) adds nothing."""

    batch = models.CharField(_("batch"), max_length=64, unique=True, help_text=_("The recorder's id of the batch."))
    added_at = models.DateTimeField(_("added at"), auto_now_add=True, help_text=_("When the batch was added."))

    objects: models.Manager[ActivityBatch] = models.Manager()

    class Meta:
        verbose_name = _("activity batch")
        verbose_name_plural = _("activity batches")

    def __str__(self) -> str:
        return self.batch


class QueueSample(models.Model):
    """A queue's depth and oldest message's age as read once in a minute (the dashboard's queue age chart)."""

    minute = models.DateTimeField(_("minute"), help_text=_("The minute's start (UTC) in which the queue was read."))
    queue = models.CharField(_("queue"), max_length=255, help_text=_("The queue's name."))
    depth = models.BigIntegerField(_("depth"), help_text=_("Messages waiting (not counting those delivered)."))
    oldest_age = models.FloatField(
        _("oldest age"),
        null=True,
        blank=True,
        help_text=_("Seconds since the oldest waiting message was published; empty when unknown."),
    )

    objects: models.Manager[QueueSample] = models.Manager()

    class Meta:
        verbose_name = _("queue sample")
        verbose_name_plural = _("queue samples")
        constraints = [models.UniqueConstraint(fields=["minute", "queue"], name="guardrails_queue_sample_once")]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.queue}: {self.depth}"


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
