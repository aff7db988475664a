"""Signals sent by celery-guardrails, for alerts, metrics and audits.

Connect to them like Celery's own signals::

    from celery_guardrails import signals

    @signals.missing_tenant.connect
    def page_someone(sender, task_id, task_name, reason, **kwargs): ...

``sender`` is the task object. Receivers run in the process that sends the signal (the worker, or the
publisher for publish-time signals); an exception in a receiver is logged by Celery and does not stop the
task.

missing_tenant
    A ``tenant_required`` task was delivered without a tenant and refused without running.
    Arguments: ``task_id``, ``task_name``, ``reason`` (a sentence), ``correlation_id``.

retry_scheduled
    A failed attempt will be tried again. Arguments: ``task_id``, ``attempt`` (the one that failed),
    ``delay`` (seconds), ``kind`` (``"transient"`` or ``"retry_later"``), ``rule``, ``exc``.

retry_deferred
    A retry or first attempt was put off by its dependency's retry budget or open circuit, without running.
    Arguments: ``task_id``, ``dependency``, ``reason`` (``"budget"`` or ``"circuit"``), ``delay``.

final_failure
    A message will not be tried again. Argument: ``failure``, a
    :class:`~celery_guardrails.runtime.final_failure.FinalFailure` with the reason and the whole attempt history.

dead_lettered
    A final failure was recorded as a new dead letter (sent once per message, after the record is durable).
    Argument: ``failure``. Owners' alerts hang on it.

budget_exhausted
    A dependency's retry budget refused a retry, sent once per window. Arguments: ``dependency``,
    ``window_end`` (epoch seconds), ``status`` (as :func:`~celery_guardrails.budget_status` reports it).

duplicate_skipped
    A delivery found its idempotency key done before and did not run the body. Arguments: ``task_id``,
    ``key`` (scoped), ``state`` (``"completed"``: the task returned ``summary``; ``"failed"``: ignored).

circuit_opened
    A dependency's circuit opened after consecutive transient failures. Arguments: ``dependency``,
    ``until`` (epoch seconds).

run_missed
    A scheduled period was recorded missed: beat did not dispatch it, or no worker started it, within the
    entry's ``grace`` (sent once per period, by the beat or watchdog that recorded it). ``sender`` is the
    Celery app. Arguments: ``schedule`` (entry name), ``task``, ``period`` (its due instant, an aware UTC
    datetime), ``reason``, ``owner``.

run_overdue
    A started scheduled run went past the entry's ``max_runtime`` (once per period). ``sender`` is the
    Celery app. Arguments: ``schedule``, ``task``, ``period``, ``reason``, ``owner``, ``task_id``,
    ``started_at``.

store_unavailable
    The guardrails store (Redis, or the Django database) could not be reached for a delivery, which was
    published again without running (no attempt spent). Arguments: ``task_id``, ``error`` (the
    :class:`~celery_guardrails.exceptions.StoreUnavailableError`), ``delay`` (seconds until it comes back),
    ``outages`` (how many times this message met an unavailable store).

stale_skipped
    An ordered message arrived after its key had passed its sequence number (a redelivery or duplicate of a
    message whose turn is over) and its body did not run. Arguments: ``task_id``, ``key`` (scoped),
    ``sequence``, ``done`` (the last sequence number done for the key).

ordering_gap_skipped
    Messages of an ordering key waited longer than ``ordering_gap_timeout`` for an earlier sequence number
    that never ran (lost before it was published, or failed where it could not say so): the key moved past
    the gap. Arguments: ``task_id`` (the waiting message that moved it), ``key`` (scoped), ``first`` and
    ``last`` (the sequence numbers given up), ``waited`` (seconds). The range is then recorded as a dead letter
    ``ordering_gap_skipped`` (``dead_lettered`` is sent for it, with a failure whose ``task_id`` is the
    record's own, ``ordering-gap-<uuid>``, not the running message's).

delivery_ended
    A guarded delivery ended, told once per delivery with the outcome and detail of the metric
    ``celery_guardrails_task_outcomes_total`` (see :mod:`celery_guardrails.operations.metrics`: ``succeeded``,
    ``skipped``, ``retried``, ``retry_later``, ``deferred_budget``, ``deferred_circuit``, ``dead_lettered``,
    ``duplicate_skipped``, ``failed``), whether metrics are on or not. Sent on the worker, before the ack;
    also for a message the consumer refused before it ran (``dead_lettered``). Arguments: ``task_id``,
    ``task_name``, ``queue``, ``outcome``, ``detail``. The test kit (:mod:`celery_guardrails.testing`) reads
    deliveries through it.

holder_reaped
    The reaper took a concurrency slot (``concurrency_key`` / ``exclusive_key``) from a holder whose heartbeat
    stopped (its worker died): the job is recorded as failed with reason ``lost`` (see
    :func:`~celery_guardrails.concurrency_status`). Sent once per reaped holder, by the process whose capacity
    check or timer reaped it. ``sender`` is the task whose capacity check reaped it, or the Celery app (the
    timer). Arguments: ``key`` (the store's key, ``limit:...`` or ``exclusive:...``), ``holder``, ``task_name``,
    ``task_id``, ``tenant`` (of the lost job; "" when none), ``heartbeat_at``, ``reaped_at`` (epoch seconds),
    ``reason`` (``"lost"``).

holder_fenced
    A holder whose concurrency slot was reaped (it stalled past ``concurrency_reap_after``: a stopped process,
    a long pause) went on running and was stopped at a boundary: before its body, at an effect helper
    (``effect()``, a checkpoint, ``transition`` / ``mark_processed``) or at its completion. Sent by the stalled
    holder's own process, once per refusal. ``sender`` is the task. Arguments: ``key``, ``holder``,
    ``task_name``, ``task_id``, ``tenant`` ("" when none), ``where`` (the boundary). Its message comes back
    later under the limit, or ends as a final failure when an effect may have landed before (see
    :class:`~celery_guardrails.exceptions.SlotLostError`); at ``where="completion (its effects had run)"`` the
    body had already returned outside a transaction: its effects ran unfenced, and this is their record.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

missing_tenant = Signal(name="missing_tenant")
retry_scheduled = Signal(name="retry_scheduled")
retry_deferred = Signal(name="retry_deferred")
final_failure = Signal(name="final_failure")
budget_exhausted = Signal(name="budget_exhausted")
circuit_opened = Signal(name="circuit_opened")
duplicate_skipped = Signal(name="duplicate_skipped")
dead_lettered = Signal(name="dead_lettered")
run_missed = Signal(name="run_missed")
run_overdue = Signal(name="run_overdue")
store_unavailable = Signal(name="store_unavailable")
stale_skipped = Signal(name="stale_skipped")
ordering_gap_skipped = Signal(name="ordering_gap_skipped")
holder_reaped = Signal(name="holder_reaped")
holder_fenced = Signal(name="holder_fenced")
delivery_ended = Signal(name="delivery_ended")
