"""Retries: classify each failure, retry the transient ones with jittered backoff, keep the attempt history.

* ``before_run``: reads the attempt counters and history from the message into ``self.request.attempt``
  (1 for the first run) and ``self.request.attempt_history`` (the earlier attempts, oldest first).
* Around the body: a failure is classified (:mod:`celery_guardrails.runtime.classification`) and every re-run goes
  through the retry gate (:mod:`celery_guardrails.runtime.gate`):

  - transient, safe to run again, attempts left (``max_attempts`` counts the first run): re-published after
    the backoff delay (:mod:`celery_guardrails.runtime.backoff`), one attempt consumed, ``retry_scheduled`` sent;
  - ``RetryLater``: re-published after its delay with no attempt consumed, ``retry_later_max`` times at
    most; then a final failure ``retry_later_exhausted``;
  - a record not there yet (``require()``, or the body's ``ObjectDoesNotExist`` with ``absent_records="wait"``):
    re-published with no attempt consumed after 1 s, 2 s, 4 s, ... for at most ``record_wait`` from the first
    miss; then a final failure ``record_missing`` (:mod:`celery_guardrails.guardrails.records`);
  - permanent, transient but not safe to run again, or transient with no attempt left: a final failure
    (``permanent``, ``not_idempotent``, ``attempts_exhausted``) through
    :func:`celery_guardrails.runtime.outcomes.fail_finally`, and the task fails with the original exception.

  Every outcome appends an attempt record to the history the next delivery (or the final failure) carries.
* Celery's own retry paths come here too. ``autoretry_for`` on a GuardedTask is classified as
  ``transient_errors`` (``GuardedTask`` runs the body without Celery's autoretry wrapper); ``self.retry()`` in
  the body raises :class:`RetryRequested`, handled here as a transient failure of the body: the gate decides,
  it counts in ``max_attempts`` (and in its own ``max_retries`` when given), its ``countdown`` / ``eta`` is the
  delay (else the backoff), and past the last attempt it is a final failure ``attempts_exhausted`` with the
  history. Its record's class is ``"manual"``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import MaxRetriesExceededError, Retry

from celery_guardrails import signals
from celery_guardrails.exceptions import StoreError
from celery_guardrails.guardrails import records
from celery_guardrails.options import APP, CALL, TASK, Option, checks, declare
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.backoff import backoff_for
from celery_guardrails.runtime.classification import Kind, Verdict, classify, gated
from celery_guardrails.runtime.delivery import delivery, view
from celery_guardrails.runtime.outcomes import (
    ATTEMPTS_EXHAUSTED,
    NOT_IDEMPOTENT,
    PERMANENT,
    RECORD_MISSING,
    RETRY_LATER_EXHAUSTED,
    attempt_record,
    fail_finally,
    republish,
)
from celery_guardrails.runtime.pipeline import Guardrail, SkipBody

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)

#: The rule and record class of a retry the body asked for with ``self.retry()``.
SELF_RETRY = "self.retry"
MANUAL = "manual"


#: The options retries reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="max_attempts",
        default=5,
        doc="Runs at most, the first one included, however the retries come (classified failures, "
        "autoretry_for, self.retry()). Unset on a task that sets Celery's max_retries (or retry_kwargs="
        "{'max_retries': n}): that plus one.",
        check=checks.positive_int,
        scopes=frozenset({CALL, TASK, APP}),
    ),
    Option(
        name="retry_later_delay",
        default=5.0,
        doc="Seconds before a RetryLater without its own delay is delivered again.",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="retry_later_max",
        default=10,
        doc="RetryLater deliveries at most; one more is a final failure (retry_later_exhausted).",
        check=checks.positive_int,
        scopes=frozenset({CALL, TASK, APP}),
    ),
)


class RetryRequested(Retry):  # type: ignore[misc]
    """``self.retry()`` called in a guarded body: handed to the Retries guardrail (never to Celery, which would
    take it for a retry already published). A ``Retry``, so that code catching Celery's keeps working."""

    def __init__(
        self,
        *,
        cause: BaseException | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        args: Any = None,
        kwargs: Any = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__("self.retry() in the task body", cause, countdown)
        self.cause = cause
        self.countdown = countdown
        self.max_retries = max_retries
        self.new_args = args
        self.new_kwargs = kwargs
        self.options = dict(options or {})

    def __reduce__(self) -> tuple[Any, ...]:
        # Celery's Retry rebuilds itself from (message, exc, when); this one takes keywords only.
        return (type(self), (), dict(self.__dict__))

    @classmethod
    def from_call(
        cls,
        *,
        cause: BaseException | None,
        eta: Any,
        countdown: float | None,
        max_retries: int | None,
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
    ) -> RetryRequested:
        """The request of a ``Task.retry(...)`` call (its ``eta`` made a countdown)."""
        if countdown is None and isinstance(eta, datetime):
            now = datetime.now(eta.tzinfo) if eta.tzinfo else datetime.now()
            countdown = max(0.0, (eta - now).total_seconds())
        return cls(
            cause=cause,
            countdown=None if countdown is None else max(0.0, float(countdown)),
            max_retries=max_retries,
            args=args,
            kwargs=kwargs,
            options=options,
        )

    def failure(self, task: Any) -> BaseException:
        """What the task fails with when this retry is not made: the cause, else Celery's own error."""
        cause: BaseException | None = self.cause
        if cause is not None:
            return cause
        exhausted: BaseException = MaxRetriesExceededError(f"Can't retry {task.name}[{task.request.id}] any more")
        return exhausted


class Retries(Guardrail):
    """Classified retries with backoff, RetryLater, attempt history; the one gate for every re-run."""

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = task.request
        header = view(task).header
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
            # A guardrail inside decided before the body (a key claimed as the body's transaction began: a
            # duplicate skipped, or of a failure): nothing ran to classify.
            if isinstance(exc, SkipBody) or (delivery(task).ended and not delivery(task).body_ran):
                raise
            self.handle(task, exc)  # raises what ends the delivery, unless exc is Celery's own control flow
            if isinstance(exc, RetryRequested):
                # Never let it reach Celery, which would mark the task RETRY (and ack) with no retry published.
                raise exc.failure(task) from exc
            raise

    def handle(self, task: GuardedTask, exc: Exception) -> None:
        """Decide about ``exc`` and end the delivery accordingly, raising what ends it: Celery's Retry (a retry or
        a wait published, or a final failure whose dead letter is pending), the exception the task fails with once
        its dead letter is recorded (``exc``; for a refused ``self.retry()``, its cause), or a Reject that gives
        the message back. Returns (None) only for Celery's own control-flow exceptions (``Kind.CONTROL``: nothing
        to decide), which the caller lets through as they are."""
        seen = view(task)
        options = seen.options
        state = delivery(task)
        requested = exc if isinstance(exc, RetryRequested) else None
        if requested is not None:
            asked = Verdict(Kind.TRANSIENT, SELF_RETRY, requested.countdown)
            verdict = gated(asked, options, state)
        else:
            verdict = classify(exc, options, state)
        request = task.request
        state.verdict = verdict
        if verdict.kind is Kind.CONTROL:
            return
        header = seen.header
        if verdict.kind is Kind.RETRY_LATER and verdict.rule in records.RULES:
            wait_for_record(task, exc, rule=verdict.rule)
        if verdict.kind is Kind.RETRY_LATER:
            retry_later(task, exc, delay=verdict.retry_after, rule=verdict.rule)
        attempt = request.attempt
        limit = options["max_attempts"]
        if requested is not None and requested.max_retries is not None:
            limit = min(limit, requested.max_retries + 1)
        error: BaseException = requested.failure(task) if requested is not None else exc
        kind = MANUAL if requested is not None else verdict.kind.value
        if verdict.kind is Kind.TRANSIENT and attempt < limit:
            if requested is not None and requested.countdown is not None:
                delay = min(requested.countdown, options["backoff_max"])
            else:
                previous = next((r.get("delay") for r in reversed(request.attempt_history) if r.get("delay")), None)
                delay = backoff_for(options).delay(failures=attempt, previous=previous, retry_after=verdict.retry_after)
            record = attempt_record(task, kind=kind, rule=verdict.rule, exc=error, delay=delay)
            logger.warning(
                "Task %s[%s] attempt %d failed (%s, %s); retrying in %.3fs: %s: %s",
                task.name,
                request.id,
                attempt,
                kind,
                verdict.rule,
                delay,
                type(error).__name__,
                record["msg"],  # redacted, as kept in the history
            )
            signals.retry_scheduled.send(
                sender=task,
                task_id=request.id,
                attempt=attempt,
                delay=delay,
                kind=kind,
                rule=verdict.rule,
                exc=error,
            )
            republish(
                task,
                countdown=delay,
                exc=error,
                header=headers.with_record(header, record, attempt=attempt),
                args=requested.new_args if requested is not None else None,
                kwargs=requested.new_kwargs if requested is not None else None,
                options=requested.options if requested is not None else None,
            )
        record = attempt_record(task, kind=kind, rule=verdict.rule, exc=error)
        if verdict.note:
            record["note"] = verdict.note
            logger.warning("Task %s[%s] %s", task.name, request.id, verdict.note)
        # Raises error once recorded (the task fails with it), else the Retry carrying the pending dead letter.
        fail_finally(task, error, reason=_reason(verdict), history=[*request.attempt_history, record])


def retry_later(
    task: GuardedTask,
    exc: Exception,
    *,
    delay: float | None,
    rule: str,
    counter: str = headers.LATER,
    fields: Mapping[str, Any] | None = None,
) -> NoReturn:
    """Deliver the running message again after ``delay`` (``retry_later_delay`` when None) without consuming
    an attempt: raise Celery's Retry (from ``exc``). Once ``retry_later_max`` is spent, end it as the final
    failure ``retry_later_exhausted`` instead (:func:`celery_guardrails.runtime.outcomes.fail_finally`: the task
    fails with ``exc`` once its dead letter is recorded).

    ``counter``: the header counter of this kind of wait; only ``later`` (the task's own ``RetryLater`` and
    the guardrails' "not yet") is bounded by ``retry_later_max``; ``busy`` (a wait behind another delivery's
    live lease) is bounded by that lease; ``rec_wait`` (a record not there yet) by ``record_wait``
    (:func:`wait_for_record`). ``fields``: other header fields the next message carries (when a wait began).
    """
    request = task.request
    seen = view(task)
    header, options = seen.header, seen.options
    later = headers.counter(header, counter) + 1
    kind = Kind.RETRY_LATER.value
    if counter == headers.LATER and later > options["retry_later_max"]:
        record = attempt_record(task, kind=kind, rule=rule, exc=exc)
        fail_finally(task, exc, reason=RETRY_LATER_EXHAUSTED, history=[*request.attempt_history, record])
    asked = delay if delay is not None else options["retry_later_delay"]
    delay = min(asked, options["backoff_max"])
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
    header = {**header, **(fields or {})}
    republish(task, countdown=delay, exc=exc, header=headers.with_record(header, record, **{counter: later}))


def wait_for_record(task: GuardedTask, exc: Exception, *, rule: str) -> NoReturn:
    """A record the body needs is not there yet (``require()``, or its ``ObjectDoesNotExist``): deliver the
    message again after the next wait of :func:`celery_guardrails.guardrails.records.next_wait`, no attempt
    consumed; once ``record_wait`` is spent, the final failure ``record_missing`` (the task fails with ``exc``,
    which names the model, once its dead letter is recorded)."""
    request = task.request
    seen = view(task)
    record_wait = seen.options["record_wait"]
    now = time.time()
    wait = records.next_wait(seen.header, record_wait=record_wait, started=delivery(task).started, now=now)
    if wait is None:
        record = attempt_record(task, kind=Kind.RETRY_LATER.value, rule=rule, exc=exc)
        since = headers.record_since(seen.header)
        waited = now - since if since is not None else 0.0
        record["note"] = f"not there after {waited:.1f} s of record_wait {record_wait:g} s"
        logger.warning("Task %s[%s] gives up on its record: %s", task.name, request.id, record["note"])
        fail_finally(task, exc, reason=RECORD_MISSING, history=[*request.attempt_history, record])
    retry_later(
        task, exc, delay=wait.delay, rule=rule, counter=headers.RECORD_WAITS, fields={headers.RECORD_SINCE: wait.since}
    )


def _reason(verdict: Verdict) -> str:
    if verdict.kind is Kind.TRANSIENT:
        return ATTEMPTS_EXHAUSTED
    return NOT_IDEMPOTENT if verdict.rule.endswith("not_idempotent") else PERMANENT
