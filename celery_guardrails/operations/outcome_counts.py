"""Delivery outcomes told by the guardrails' signals: a retry scheduled or deferred, a store out of reach, a
duplicate or stale message skipped, a dead letter recorded, a final failure, a message published. Each is
counted once per delivery (in the Prometheus outcomes counter, the activity counts, and ``delivery_ended`` for
its receivers), and marks the delivery counted so that :class:`~.metrics.Metrics` does not count its ending
again. Importing this module connects the receivers.
"""

from __future__ import annotations

from typing import Any

from celery.signals import after_task_publish

from celery_guardrails import signals
from celery_guardrails.operations import activity
from celery_guardrails.operations.instruments import (
    DEAD_LETTERED,
    DEFERRED_BUDGET,
    DEFERRED_CIRCUIT,
    DUPLICATE_SKIPPED,
    RETRIED,
    RETRY_LATER,
    SKIPPED,
    enabled,
    instruments,
    label_values,
    queue_of,
    recording_failed,
)
from celery_guardrails.runtime.delivery import delivery
from celery_guardrails.runtime.outcomes import TIME_LIMIT


def activity_counts(task: Any) -> bool:
    """Whether the activity counts ``task``'s deliveries: a worker's, not a call in the caller's process."""
    request = getattr(task, "request", None)
    if request is None or request.called_directly or request.is_eager:
        return False
    return activity.enabled(task.app)


def _count(
    task: Any, task_id: str | None, outcome: str, detail: str = "", *, name: str | None = None, queue: str = ""
) -> None:
    """Count ``outcome`` for the delivery ``task_id`` of ``task`` and mark it counted (when it is the delivery
    ``task`` runs now: a signal sent outside a run, for a message the consumer refused, marks nothing)."""
    app = getattr(task, "app", None)
    if app is None:
        return
    metrics_on, activity_on, told = enabled(app), activity.enabled(app), ending_told(task, task_id)
    if not (metrics_on or activity_on or told):
        return
    try:
        current = _mark(task, task_id)
        if told:
            tell_ended(task, task_id, name or task.name, queue_of(task.request) if current else queue, outcome, detail)
        where = queue_of(task.request) if current else queue
        name_label, queue_label, detail_label = label_values(app, name or task.name, where, detail)
        if metrics_on:
            instruments(app).outcomes.labels(name_label, outcome, detail_label).inc()
        if activity_on and (not current or activity_counts(task)):
            activity.count(app, name_label, queue_label, outcome)
    except Exception as error:
        recording_failed(error, f"outcome {outcome}", task_id)


def ending_told(task: Any, task_id: str | None = None) -> bool:
    """Whether ``delivery_ended`` has receivers for the delivery ``task_id`` of ``task`` (default: the one it
    runs now) on a worker: not a call in the caller's process, which no queue delivered. A message told of
    outside its run (refused by the consumer) is told."""
    if not signals.delivery_ended.receivers:
        return False
    request = getattr(task, "request", None)
    if request is None or (task_id is not None and getattr(request, "id", None) != task_id):
        return True
    return not (request.called_directly or request.is_eager)


def tell_ended(task: Any, task_id: str | None, name: str, queue: str, outcome: str, detail: str) -> None:
    signals.delivery_ended.send(
        sender=task, task_id=task_id, task_name=name, queue=queue, outcome=outcome, detail=detail
    )


def _mark(task: Any, task_id: str | None) -> bool:
    """Mark the delivery ``task_id`` counted when ``task`` runs it now; whether it does."""
    request = getattr(task, "request", None)
    if task_id and getattr(request, "id", None) == task_id:
        delivery(task).outcome_counted = True
        return True
    return False


def _on_retry_scheduled(sender: Any = None, task_id: str | None = None, kind: str = "", **_: Any) -> None:
    if kind == "transient":
        _count(sender, task_id, RETRIED, "transient")
    else:
        _count(sender, task_id, RETRY_LATER)


def _on_retry_deferred(sender: Any = None, task_id: str | None = None, reason: str = "", **_: Any) -> None:
    _count(sender, task_id, DEFERRED_CIRCUIT if reason == "circuit" else DEFERRED_BUDGET)


def _on_store_unavailable(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    _count(sender, task_id, RETRIED, "store_unavailable")


def _on_duplicate_skipped(sender: Any = None, task_id: str | None = None, state: str = "", **_: Any) -> None:
    _count(sender, task_id, DUPLICATE_SKIPPED, str(state))


def _on_stale_skipped(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    _count(sender, task_id, SKIPPED)


def _on_dead_lettered(sender: Any = None, failure: Any = None, **_: Any) -> None:
    _count(sender, failure.task_id, DEAD_LETTERED, failure.reason, name=failure.task_name, queue=failure.queue or "")
    if failure.reason == TIME_LIMIT:
        _killed(sender, failure)


def _killed(task: Any, failure: Any) -> None:
    """A delivery its hard time limit killed ended in the main process, where no after-hook of the delivery
    runs: it is counted completed here (its duration, the time limit, is not observed)."""
    app = getattr(task, "app", None)
    if app is None or not enabled(app):
        return
    try:
        instruments(app).completed.labels(*label_values(app, failure.task_name, failure.queue or "")).inc()
    except Exception as error:
        recording_failed(error, "a killed delivery", failure.task_id)


def _on_final_failure(sender: Any = None, failure: Any = None, **_: Any) -> None:
    # Sent for every final failure whose dead letter is recorded; ``dead_lettered`` counts the new ones. One
    # recorded before (a redelivery after the record, before the ack) is not counted again, nor as failed.
    app = getattr(sender, "app", None)
    if app is not None and (enabled(app) or activity.enabled(app) or ending_told(sender, failure.task_id)):
        try:
            _mark(sender, failure.task_id)
        except Exception as error:
            recording_failed(error, "a final failure", getattr(failure, "task_id", None))


def _on_published(sender: Any = None, routing_key: str | None = None, headers: Any = None, **_: Any) -> None:
    from celery._state import get_current_app

    app = get_current_app()
    if not enabled(app):
        return
    try:
        name = sender if isinstance(sender, str) else getattr(sender, "name", str(sender))
        instruments(app).published.labels(*label_values(app, name, routing_key or "")).inc()
    except Exception as error:
        recording_failed(error, "a publish", (headers or {}).get("id") if isinstance(headers, dict) else None)


signals.retry_scheduled.connect(
    _on_retry_scheduled, weak=False, dispatch_uid="celery_guardrails.operations.metrics.retry"
)
signals.retry_deferred.connect(
    _on_retry_deferred, weak=False, dispatch_uid="celery_guardrails.operations.metrics.deferred"
)
signals.store_unavailable.connect(
    _on_store_unavailable, weak=False, dispatch_uid="celery_guardrails.operations.metrics.store"
)
signals.duplicate_skipped.connect(
    _on_duplicate_skipped, weak=False, dispatch_uid="celery_guardrails.operations.metrics.dup"
)
signals.stale_skipped.connect(_on_stale_skipped, weak=False, dispatch_uid="celery_guardrails.operations.metrics.stale")
signals.dead_lettered.connect(_on_dead_lettered, weak=False, dispatch_uid="celery_guardrails.operations.metrics.dead")
signals.final_failure.connect(_on_final_failure, weak=False, dispatch_uid="celery_guardrails.operations.metrics.final")
after_task_publish.connect(_on_published, weak=False, dispatch_uid="celery_guardrails.operations.metrics.published")
