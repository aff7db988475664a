"""Retries: classify each failure, retry the transient ones with jittered backoff, keep the attempt history.

* ``before_run``: reads the attempt counters and history from the message into ``self.request.attempt``
  (1 for the first run) and ``self.request.attempt_history`` (the earlier attempts, oldest first).
* Around the body: a failure is classified (:mod:`celery_guardrails.classification`):

  - transient, attempts left (``max_attempts`` counts the first run): re-published after the backoff delay
    (:mod:`celery_guardrails.backoff`), one attempt consumed, ``retry_scheduled`` sent;
  - ``RetryLater``: re-published after its delay with no attempt consumed, ``retry_later_max`` times at
    most; then a final failure ``retry_later_exhausted``;
  - permanent, or transient with no attempt left: a final failure (``permanent``, ``not_idempotent``,
    ``attempts_exhausted``) through :func:`celery_guardrails.outcomes.fail_finally`, and the task fails
    with the original exception.

  Every outcome appends an attempt record to the history the next delivery (or the final failure) carries.
* ``on_publish``: a manual ``self.retry()`` in the task body counts as an attempt too and is recorded as
  ``"manual"``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from celery_guardrails import headers, signals
from celery_guardrails.backoff import backoff_for
from celery_guardrails.classification import Kind, Verdict, classify
from celery_guardrails.delivery import delivery
from celery_guardrails.exceptions import StoreError
from celery_guardrails.options import resolve
from celery_guardrails.outcomes import (
    ATTEMPTS_EXHAUSTED,
    NOT_IDEMPOTENT,
    PERMANENT,
    RETRY_LATER_EXHAUSTED,
    attempt_record,
    fail_finally,
    republish,
)
from celery_guardrails.pipeline import Guardrail, Publication

if TYPE_CHECKING:
    from celery_guardrails.task import GuardedTask

logger = logging.getLogger(__name__)


class Retries(Guardrail):
    """Classified retries with backoff, RetryLater, attempt history."""

    def on_publish(self, task: GuardedTask, publication: Publication) -> None:
        request = task.request
        is_own_redelivery = publication.task_id is not None and publication.task_id == request.id
        if not is_own_redelivery or request.called_directly or delivery(task).republishing:
            return
        # The body called self.retry() itself: that is an attempt, and the history says so. What this delivery
        # holds (its idempotency claim, a run slot) is given up first, so the retry does not find it held and
        # wait out its lease.
        delivery(task).give_up(request.id)
        exc = sys.exc_info()[1]
        attempt = headers.counter(publication.header, headers.ATTEMPT) + 1
        record = attempt_record(task, kind="manual", rule="self.retry", exc=exc)
        publication.header.clear()
        publication.header.update(headers.with_record(headers.from_request(request), record, attempt=attempt))

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = task.request
        header = headers.from_request(request)
        request.attempt = headers.counter(header, headers.ATTEMPT) + 1
        request.attempt_history = headers.history(header)

    def body_context(self, task: GuardedTask) -> AbstractContextManager[Any]:
        return self._classified(task)

    @contextmanager
    def _classified(self, task: GuardedTask) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            # The guardrails' own store failed (a commit after the body, a transaction that would not open): not
            # the task's doing, GuardedTask settles it. One the body raised (a guarded publish from the task's own
            # code, say) is classified like any error: retried only when that is safe.
            if isinstance(exc, StoreError) and exc is not delivery(task).body_error:
                raise
            retry = self.handle(task, exc)
            if retry is not None:
                raise retry from exc
            raise

    def handle(self, task: GuardedTask, exc: Exception) -> BaseException | None:
        """Decide about ``exc``: return Celery's Retry to raise, or None to let ``exc`` fail the task."""
        call = task.call_options()
        verdict = classify(exc, task, call)
        request = task.request
        delivery(task).verdict = verdict
        if verdict.kind is Kind.CONTROL:
            return None
        header = headers.from_request(request)
        if verdict.kind is Kind.RETRY_LATER:
            return retry_later(task, exc, delay=verdict.retry_after, rule=verdict.rule)
        attempt = request.attempt
        if verdict.kind is Kind.TRANSIENT and attempt < resolve(task, "max_attempts", call):
            previous = next((r.get("delay") for r in reversed(request.attempt_history) if r.get("delay")), None)
            delay = backoff_for(task, call).delay(failures=attempt, previous=previous, retry_after=verdict.retry_after)
            record = attempt_record(task, kind=verdict.kind.value, rule=verdict.rule, exc=exc, delay=delay)
            logger.warning(
                "Task %s[%s] attempt %d failed (%s, %s); retrying in %.3fs: %s: %s",
                task.name,
                request.id,
                attempt,
                verdict.kind.value,
                verdict.rule,
                delay,
                type(exc).__name__,
                record["msg"],  # redacted, as kept in the history
            )
            signals.retry_scheduled.send(
                sender=task,
                task_id=request.id,
                attempt=attempt,
                delay=delay,
                kind=verdict.kind.value,
                rule=verdict.rule,
                exc=exc,
            )
            return republish(
                task, countdown=delay, exc=exc, header=headers.with_record(header, record, attempt=attempt)
            )
        record = attempt_record(task, kind=verdict.kind.value, rule=verdict.rule, exc=exc)
        # None: recorded, the exception fails the task; else the Retry carrying the pending dead letter.
        return fail_finally(task, exc, reason=_reason(verdict), history=[*request.attempt_history, record])


def retry_later(
    task: GuardedTask, exc: Exception, *, delay: float | None, rule: str, counter: str = headers.LATER
) -> BaseException | None:
    """Deliver the running message again after ``delay`` (``retry_later_delay`` when None) without consuming
    an attempt; return Celery's Retry to raise, or None once ``retry_later_max`` is spent (then the final
    failure ``retry_later_exhausted`` has been handed over and the caller lets ``exc`` fail the task).

    ``counter``: the header counter of this kind of wait; only ``later`` (the task's own ``RetryLater`` and
    the guardrails' "not yet") is bounded by ``retry_later_max``; ``busy`` (a wait behind another delivery's
    live lease) is bounded by that lease.
    """
    request = task.request
    call = task.call_options()
    header = headers.from_request(request)
    later = headers.counter(header, counter) + 1
    kind = Kind.RETRY_LATER.value
    if counter == headers.LATER and later > resolve(task, "retry_later_max", call):
        record = attempt_record(task, kind=kind, rule=rule, exc=exc)
        return fail_finally(task, exc, reason=RETRY_LATER_EXHAUSTED, history=[*request.attempt_history, record])
    asked = delay if delay is not None else resolve(task, "retry_later_delay", call)
    delay = min(asked, resolve(task, "backoff_max", call))
    record = attempt_record(task, kind=kind, rule=rule, exc=exc, delay=delay)
    logger.info(
        "Task %s[%s] cannot run yet (%s %d); again in %.3fs: %s",
        task.name,
        request.id,
        counter,
        later,
        delay,
        exc,
    )
    signals.retry_scheduled.send(
        sender=task, task_id=request.id, attempt=request.attempt, delay=delay, kind=kind, rule=rule, exc=exc
    )
    # No attempt consumed: the attempt counter is left as it is.
    return republish(task, countdown=delay, exc=exc, header=headers.with_record(header, record, **{counter: later}))


def _reason(verdict: Verdict) -> str:
    if verdict.kind is Kind.TRANSIENT:
        return ATTEMPTS_EXHAUSTED
    return NOT_IDEMPOTENT if verdict.rule.endswith("not_idempotent") else PERMANENT
