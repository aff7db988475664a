"""The worker's request for guarded tasks: two faults Celery meets in the worker's main process, outside any
task hook, and what ``GuardedTask`` makes of them.

* **A malformed envelope.** Celery reads ``expires``, ``eta`` and ``timelimit`` from the message headers
  when it builds the request, or when it hands it to the pool; a value it cannot read raises there, and the
  worker stops (``Unrecoverable error``) with the queue behind it, or the message is failed and dropped with
  no record. Here the envelope is checked as the request is built: a malformed one is dead-lettered with
  reason ``malformed_message``, then refused as an invalid task (Celery removes it and goes on). If its dead
  letter cannot be written, the message is given back to the broker instead.
* **A hard time limit.** The pool kills the process running the task; Celery marks it FAILURE and acks it.
  Here, first, the failure is handed over as any final failure is (a dead letter ``time_limit``), or, for a
  task the retry gate lets run again without seeing its body (``idempotent=True``, ``retry_unsafe``, or keyed
  and ``atomic=True``: see :func:`celery_guardrails.gate.after_kill`) with attempts left, a retry is published
  (not for a chord's part or a task with errbacks: Celery's handling of the kill still runs and would report
  the failure to them).
  The claim the killed process held is taken over at once by the next delivery on this host (its process is
  gone), and a breaker probe it held is given up after ``circuit_probe_timeout``.

Not intercepted: a message whose body cannot be decoded at all, or that names no known task, is handled by
Celery's consumer before any task's request exists (it logs and acks it; see the README).
"""

from __future__ import annotations

import logging
import math
import time
from datetime import datetime
from typing import Any

from celery.exceptions import InvalidTaskError, TimeLimitExceeded
from celery.worker import state
from celery.worker.request import Request

from celery_guardrails import headers, signals
from celery_guardrails.context import activate, deactivate
from celery_guardrails.outcomes import MALFORMED_MESSAGE, TIME_LIMIT

logger = logging.getLogger(__name__)

#: Tries (a second apart) at writing a malformed message's dead letter before giving the message back.
RECORD_TRIES = 3


class GuardedRequest(Request):  # type: ignore[misc]
    """Celery's request, with the malformed envelope and the hard time limit handed over (module docstring)."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(message, *args, **kwargs)
            _check_envelope(self)
        except Exception as exc:
            _refuse_malformed(message, kwargs.get("task"), exc)  # raises InvalidTaskError

    def on_timeout(self, soft: bool, timeout: float) -> None:
        retried = False
        if not soft and not state.should_terminate:
            try:
                retried = _time_limit_reached(self, timeout)
            except Exception:
                # Neither a dead letter (or its pending re-publish) nor a retry is sure: Celery would store FAILURE
                # and ack. The message goes back to the broker instead (its redeliveries are counted: poison).
                logger.exception(
                    "Task %s[%s]: its hard time limit could not be handed over; the message goes back",
                    self.name,
                    self.id,
                )
                state.task_ready(self)
                self.reject(requeue=True)
                return
        # A task tried again already says RETRY (stored before the retry was published, so that the retry's own
        # result is never overwritten): Celery must not store FAILURE over it.
        self._guardrails_retried = retried
        super().on_timeout(soft, timeout)  # stores FAILURE (unless retried), calls on_failure, acks

    @property
    def store_errors(self) -> bool:
        if getattr(self, "_guardrails_retried", False):
            return False
        return bool(super().store_errors)


def _number(value: Any) -> bool:
    return value is None or (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    )


def _check_envelope(request: Any) -> None:
    """Raise ValueError for what Celery would fail on later, in the main process."""
    limits = request.time_limits
    if not (isinstance(limits, list | tuple) and len(limits) == 2 and all(_number(v) for v in limits)):
        raise ValueError(f"timelimit must be [hard, soft] seconds (or null), got {limits!r:.80}")
    eta = request.eta
    if eta is not None:
        if not isinstance(eta, datetime):
            raise ValueError(f"eta must be an ISO 8601 date and time, got {eta!r:.80}")
        eta.timestamp()  # OverflowError / ValueError for an instant Celery cannot wait for


def _refuse_malformed(message: Any, task: Any, error: Exception) -> None:
    """Dead-letter a message whose envelope Celery cannot read; then refuse it as invalid (removed)."""
    from celery_guardrails.outcomes import FinalFailure, timestamp

    raw = dict(getattr(message, "headers", None) or {})
    task_id = str(raw.get("id") or "")[:255]
    args: Any = ()
    kwargs: Any = {}
    try:
        body = message.decode()
        if isinstance(body, list | tuple) and len(body) >= 2:
            args, kwargs = body[0], body[1]
    except Exception:
        logger.debug("Malformed message %s: body not decoded", task_id, exc_info=True)
    header = headers.sanitise(headers.from_message_headers(raw), task_id=task_id)
    failure = FinalFailure(
        task_name=str(raw.get("task") or getattr(task, "name", "") or "")[:200],
        task_id=task_id,
        reason=MALFORMED_MESSAGE,
        exc_type=f"{type(error).__module__}.{type(error).__qualname__}",
        exc_message=str(error)[: headers.MESSAGE_LIMIT],
        tenant=header.get(headers.TENANT) if isinstance(header.get(headers.TENANT), str) else None,
        correlation_id=header.get(headers.CORRELATION_ID)
        if isinstance(header.get(headers.CORRELATION_ID), str)
        else None,
        attempts=headers.counter(headers.sanitise(header, task_id=task_id), headers.ATTEMPT) + 1,
        args=tuple(args) if isinstance(args, list | tuple) else (),
        kwargs=dict(kwargs) if isinstance(kwargs, dict) else {},
        header={k: v for k, v in header.items() if k != headers.HISTORY},
        first_failed_at=timestamp(),
        last_failed_at=timestamp(),
    )
    logger.error("Message %s of %s is malformed (%s): dead-lettering it", task_id, failure.task_name, error)
    if task is None or not task_id:
        raise InvalidTaskError(f"malformed message {task_id or '(no id)'}: {error}") from error
    from celery_guardrails import dead_letters
    from celery_guardrails.outcomes import owner_of

    failure = FinalFailure.from_dict({**failure.to_dict(), "owner": owner_of(task)})
    for attempt in range(1, RECORD_TRIES + 1):
        try:
            new = dead_letters.record(task, failure)
        except Exception as exc:  # a store error or anything else: never out of the consumer (it would stop)
            logger.error("Dead letter of malformed message %s not recorded (%s), try %d", task_id, exc, attempt)
            if attempt < RECORD_TRIES:
                time.sleep(1.0)
            continue
        signals.final_failure.send(sender=task, failure=failure)
        if new:
            signals.dead_lettered.send(sender=task, failure=failure)
        raise InvalidTaskError(f"malformed message {task_id}: {error} (dead-lettered)") from error
    # Not recorded: the consumer refuses it as invalid; make that refusal give the message back.
    reject = message.reject
    message.reject = lambda requeue=False: reject(requeue=True)
    raise InvalidTaskError(f"malformed message {task_id}: {error} (not recorded: given back)") from error


def _time_limit_reached(request: Any, timeout: float) -> bool:
    """Hand over the final failure of a task its hard time limit killed (module docstring); whether a retry
    was published instead."""
    from celery_guardrails.delivery import begin
    from celery_guardrails.gate import after_kill
    from celery_guardrails.options import resolve, settings_snapshot
    from celery_guardrails.outcomes import attempt_record, fail_finally, republish

    task = request.task
    # The killed run's request, as its hooks saw it (a worker's request is not "called directly": a retry
    # from it is published, not raised).
    task.push_request({**vars(request._context), "called_directly": False})
    try:
        context = task.request
        with settings_snapshot(task.app):
            begin(context)
            header = headers.from_request(context)
            activation = activate(tenant=header.get(headers.TENANT), correlation_id=header.get(headers.CORRELATION_ID))
            try:
                exc = TimeLimitExceeded(timeout)
                attempt = headers.counter(header, headers.ATTEMPT) + 1
                context.attempt, context.attempt_history = attempt, headers.history(header)
                call = task.call_options()
                # Not inside a chord or with errbacks: Celery's own handling of the kill, which still runs, would
                # count the chord part failed and call the errbacks while the retry goes on.
                plain = not getattr(context, "chord", None) and not getattr(context, "errbacks", None)
                # The gate, as far as this process can see: the killed process's effects died unseen with it.
                safe = after_kill(task, call, keyed=bool(header.get(headers.IDEMPOTENCY_KEY))).safe
                if plain and safe and attempt < resolve(task, "max_attempts", call):
                    record = attempt_record(task, kind="transient", rule=TIME_LIMIT, exc=exc, delay=0.0)
                    logger.warning("Task %s[%s] killed by its time limit; retrying", task.name, request.id)
                    task.backend.mark_as_retry(request.id, exc, request=context)
                    republish(task, countdown=0.0, exc=exc, header=headers.with_record(header, record, attempt=attempt))
                    return True
                record = attempt_record(task, kind="permanent", rule=TIME_LIMIT, exc=exc)
                fail_finally(task, exc, reason=TIME_LIMIT, history=[*context.attempt_history, record])
                return False
            finally:
                deactivate(activation)
    finally:
        task.pop_request()


__all__ = ["MALFORMED_MESSAGE", "TIME_LIMIT", "GuardedRequest"]
