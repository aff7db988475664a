"""The two ways a guardrail ends a delivery other than letting it succeed: re-publish it, or fail it finally.

Both happen before the current delivery is acked (``GuardedTask`` acks late): the new message is published,
or the final failure is handed to the dead-letter hook, and only then does Celery ack the message.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from celery_guardrails import headers, signals
from celery_guardrails.context import current_correlation_id, current_tenant

logger = logging.getLogger(__name__)

#: Final-failure reasons.
PERMANENT = "permanent"
NOT_IDEMPOTENT = "not_idempotent"
ATTEMPTS_EXHAUSTED = "attempts_exhausted"
RETRY_LATER_EXHAUSTED = "retry_later_exhausted"
RETRY_BUDGET_EXHAUSTED = "retry_budget_exhausted"
CIRCUIT_OPEN = "circuit_open"
MISSING_TENANT = "missing_tenant"


def timestamp(seconds: float | None = None) -> str:
    """ISO 8601, UTC, milliseconds: how times are written in attempt records."""
    moment = datetime.fromtimestamp(time.time() if seconds is None else seconds, UTC)
    return moment.isoformat(timespec="milliseconds")


def attempt_record(
    task: Any,
    *,
    kind: str,
    rule: str,
    exc: BaseException | None = None,
    delay: float | None = None,
    started: float | None = None,
) -> dict[str, Any]:
    """One attempt record for the history (see :mod:`celery_guardrails.headers`)."""
    request = task.request
    return {
        "n": getattr(request, "attempt", 1),
        "start": timestamp(started if started is not None else getattr(request, "guardrails_started", None)),
        "end": timestamp(),
        "host": request.hostname,
        "exc": f"{type(exc).__module__}.{type(exc).__qualname__}" if exc is not None else None,
        "msg": str(exc)[: headers.MESSAGE_LIMIT] if exc is not None else None,
        "class": kind,
        "rule": rule,
        "delay": None if delay is None else round(delay, 3),
    }


def republish(
    task: Any, *, countdown: float, header: dict[str, Any], exc: BaseException | None = None
) -> BaseException:
    """Publish the running message again after ``countdown`` seconds with ``header``; return Celery's Retry.

    Every other header of the message is kept (tenant included: it is in ``header``). The caller raises the
    returned exception so Celery records RETRY and acks the current delivery after the publish.
    """
    request = task.request
    # Guardrails that hold something for this delivery (an idempotency claim) give it up first, so the new
    # delivery never finds it held by the old one.
    for give_up in getattr(request, "guardrails_before_republish", ()):
        give_up()
    request.guardrails_republishing = True
    message_headers = {**(request.headers or {}), headers.HEADER: header}
    # max_retries: the guardrails count attempts themselves; Celery's own limit must not interfere.
    retry: BaseException = task.retry(
        exc=exc, countdown=max(0.0, countdown), max_retries=request.retries + 1, headers=message_headers, throw=False
    )
    return retry


@dataclass(frozen=True, slots=True, kw_only=True)
class FinalFailure:
    """Everything known about a message that will not be tried again (what a dead letter stores)."""

    task_name: str
    task_id: str
    reason: str
    exc_type: str
    exc_message: str
    tenant: str | None
    correlation_id: str | None
    attempts: int
    history: list[dict[str, Any]] = field(default_factory=list)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    queue: str | None = None


def fail_finally(
    task: Any, exc: BaseException, *, reason: str, history: list[dict[str, Any]] | None = None
) -> FinalFailure:
    """Log the final failure at ERROR, send ``final_failure`` and hand it to the dead-letter hook."""
    request = task.request
    failure = FinalFailure(
        task_name=task.name,
        task_id=request.id,
        reason=reason,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        exc_message=str(exc)[: headers.MESSAGE_LIMIT],
        tenant=current_tenant(),
        correlation_id=current_correlation_id(),
        attempts=getattr(request, "attempt", 1),
        history=list(history or ()),
        args=tuple(request.args or ()),
        kwargs=dict(request.kwargs or {}),
        queue=(request.delivery_info or {}).get("routing_key"),
    )
    logger.error(
        "Task %s[%s] failed finally (%s) after %d attempt(s): %s: %s (tenant %s, correlation id %s)",
        failure.task_name,
        failure.task_id,
        reason,
        failure.attempts,
        failure.exc_type,
        failure.exc_message,
        failure.tenant,
        failure.correlation_id,
    )
    signals.final_failure.send(sender=task, failure=failure)
    dead_letter(failure)
    return failure


def dead_letter(failure: FinalFailure) -> None:
    """The dead-letter hook. Records are not stored yet (the dead-letter guardrail will); it logs."""
    logger.info(
        "Task %s[%s]: dead letter (%s) not stored: no dead-letter sink yet",
        failure.task_name,
        failure.task_id,
        failure.reason,
    )
