"""The worker's request for guarded tasks: two faults Celery meets in the worker's main process, outside any
task hook, and what ``GuardedTask`` makes of them.

* **A malformed envelope.** Celery reads ``expires``, ``eta`` and ``timelimit`` from the message headers
  when it builds the request, or when it hands it to the pool; a value it cannot read raises there, and the
  worker stops (``Unrecoverable error``) with the queue behind it, or the message is failed and dropped with
  no record. Here the envelope is checked as the request is built: a malformed one is dead-lettered with
  reason ``malformed_message``, then refused as an invalid task (Celery removes it and goes on). If its dead
  letter cannot be written, the message is given back to the broker instead.
* **A payload the pool cannot take.** A prefork worker hands each request to its child with pickle, in the
  main process: arguments (or headers) nested several hundred levels deep, or an object pickle refuses, raise
  there and stop the worker (``Unrecoverable error``); the message is restored, so the next worker that takes
  it stops too. Here a request nested deeper than ``max_payload_depth`` is refused as malformed when it is built
  (any pool), and on a pool that pickles, a payload that is not plain JSON data is tried with pickle before
  the hand-over: a refusal, or any exception from the hand-over itself, dead-letters the message
  ``malformed_message`` (or gives it back if that cannot be written), and the worker goes on.
* **A hard time limit.** The pool kills the process running the task; Celery marks it FAILURE and acks it.
  Here, first, the failure is handed over as any final failure is (a dead letter ``time_limit``), or, for a
  task the retry gate lets run again without seeing its body (``idempotent=True``, ``retry_unsafe``, or keyed
  and ``atomic=True``: see :func:`celery_guardrails.runtime.gate.after_kill`) with attempts left, a retry is published
  (not for a chord's part or a task with errbacks: Celery's handling of the kill still runs and would report
  the failure to them). Where no sink can record the dead letter, the message is published again carrying it
  (as any final failure is) and the result says RETRY until it is recorded; where even that fails, the message
  is given back to the broker unacked. Celery's own report of the kill (the request's ``on_failure``, which
  billiard calls before ``on_timeout``, and which would store FAILURE and ack at once) waits for that decision.
  The claim the killed process held is taken over at once by the next delivery on this host (its process is
  gone), and a breaker probe it held is given up after ``circuit_probe_timeout``.

* **A body that cannot be decoded** (bad JSON, nested past the decoder's recursion limit, a content type the
  worker does not accept): Celery's consumer logs it, with the start of the raw body (secrets and all), and
  acks it. A guarded task's strategy (:func:`strategy`) dead-letters it ``malformed_message`` instead, without
  its arguments (they could not be read), and acks it once the record is written (or gives it back).

Not intercepted: a message that names no known task is handled by Celery's consumer before any task is
involved (it logs and acks it; see the README).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import pickle
import time
from datetime import datetime
from typing import Any, NoReturn

from billiard.einfo import ExceptionWithTraceback
from celery.exceptions import InvalidTaskError, Reject, Retry, TaskRevokedError, TimeLimitExceeded
from celery.worker import state
from celery.worker.request import Request
from kombu.exceptions import ContentDisallowed, DecodeError
from kombu.serialization import registry

from celery_guardrails import signals
from celery_guardrails.foundation.context import activate, deactivate
from celery_guardrails.foundation.redaction import for_task
from celery_guardrails.options import resolve
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import view
from celery_guardrails.runtime.outcomes import ARRIVED_AS, MALFORMED_MESSAGE, TIME_LIMIT

logger = logging.getLogger(__name__)

#: Task events whose exception and traceback are redacted (:meth:`GuardedRequest.send_event`).
REDACTED_EVENTS = frozenset({"task-failed", "task-retried"})
#: Tries (a second apart) at writing a malformed message's dead letter before giving the message back.
RECORD_TRIES = 3


class GuardedRequest(Request):  # type: ignore[misc]
    """Celery's request, with the malformed envelope and the hard time limit handed over (module docstring)."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(message, *args, **kwargs)
            _check_envelope(self)
            _note_serializer(self)
        except Exception as exc:
            _refuse_malformed(message, kwargs.get("task"), exc)  # raises InvalidTaskError

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Celery makes a subclass of the task's Request class for each task (create_request_cls in
        # celery/worker/request.py) whose execute_using_pool hands the request to the pool: it is guarded here, as
        # it is defined, since an override on this class would be shadowed by it.
        hand_over = cls.__dict__.get("execute_using_pool")
        if hand_over is not None and not getattr(hand_over, "guarded", False):
            cls.execute_using_pool = _guarded_hand_over(hand_over)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        exc = getattr(exc_info, "exception", None)
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, TimeLimitExceeded) and not return_ok and not state.should_terminate:
            # The pool's report of a hard time limit: billiard calls this error callback first, then on_timeout
            # (TimeoutHandler.on_hard_timeout: job._set, then job.handle_timeout). Here Celery would store FAILURE
            # and ack the message before on_timeout hands the failure over: a pending dead letter would read
            # FAILURE with nothing recorded, and a message to give back would be acked away already. on_timeout
            # stores and acks (or gives the message back) once the guardrails have decided.
            return
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        retried = False
        if not soft and not state.should_terminate:
            try:
                retried = _time_limit_reached(self, timeout)
            except Reject:  # neither recorded nor published (logged as decided): the message goes back
                state.task_ready(self)
                self.reject(requeue=True)
                return
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
        # A task tried again (or whose dead letter is pending) already says RETRY: Celery must not store FAILURE
        # over it.
        self._guardrails_retried = retried
        super().on_timeout(soft, timeout)  # stores FAILURE (unless retried), calls on_failure, acks

    def send_event(self, type: str, **fields: Any) -> None:
        # The events of a failure and a retry carry the exception's repr and the traceback as raised (Celery's
        # on_failure / on_retry), to the broker's event exchange (Flower, `celery events`): redacted as the result
        # backend and the log keep them.
        if type in REDACTED_EVENTS:
            redaction = for_task(self.task)
            for name in ("exception", "traceback"):
                if fields.get(name) is not None:
                    fields[name] = redaction.text(fields[name])
        super().send_event(type, **fields)

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
    _check_depth(request)


def _note_serializer(request: Any) -> None:
    """Note the serializer the message arrived in, when it is not its task's (see ``outcomes.ARRIVED_AS``)."""
    name = registry.type_to_name.get(request.content_type) if request.content_type else None
    task = request.task
    if name and name != (task.serializer or task.app.conf.task_serializer):
        request.request_dict[ARRIVED_AS] = name


def _depth_limit(task: Any) -> int:
    try:
        return int(resolve(task, "max_payload_depth", {}))
    except Exception:  # a bad setting stops the worker at start-up; here, never the message's fault
        from celery_guardrails.guardrails.contract import DEPTH_CEILING

        return DEPTH_CEILING


def _check_depth(request: Any) -> None:
    """Raise ValueError for arguments or headers nested deeper than ``max_payload_depth`` (see the module
    docstring): the pool's pickle, the record's walks and the body itself would fail on them."""
    from celery_guardrails.guardrails.contract import SCALARS, nesting_over

    # Only containers have a depth to walk; most values of a message (ids, text, numbers) are told apart by their
    # type alone, here, on every message a worker takes (loops written out: generators cost more than the walk).
    values = []
    args, kwargs = request.args, request.kwargs
    for value in args if isinstance(args, list | tuple) else (args,):
        if type(value) not in SCALARS:
            values.append(value)
    for value in kwargs.values() if isinstance(kwargs, dict) else (kwargs,):
        if type(value) not in SCALARS:
            values.append(value)
    for name, value in request.request_dict.items():
        if type(value) not in SCALARS and name != "args" and name != "kwargs":
            values.append(value)
    if not values:
        return
    limit = _depth_limit(request.task)
    depth = nesting_over(values, limit)
    if depth is not None:
        raise ValueError(
            f"arguments or headers nested more than {depth - 1} levels deep, over max_payload_depth {limit}: not "
            "handed to the pool"
        )


def _refuse_malformed(message: Any, task: Any, error: Exception) -> None:
    """Dead-letter a message whose envelope Celery cannot read; then refuse it as invalid (removed)."""
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
    logger.error("Message %s of %s is malformed (%s): dead-lettering it", task_id, raw.get("task"), _said(task, error))
    if task is None or not task_id:
        raise InvalidTaskError(f"malformed message {task_id or '(no id)'}: {error}") from error
    if _recorded(task, _malformed(raw, task, error, args=args, kwargs=kwargs)):
        raise Refused(f"malformed message {task_id}: {error} (dead-lettered)", requeue=False) from error
    # Not recorded: the consumer refuses it as invalid; make that refusal give the message back (Celery's own
    # consumer rejects an invalid task without requeue, should the task's strategy not be this module's).
    reject = message.reject
    message.reject = lambda requeue=False: reject(requeue=True)
    raise Refused(f"malformed message {task_id}: {error} (not recorded: given back)", requeue=True) from error


def _said(task: Any, error: BaseException) -> str:
    """``error``'s text as a log line may show it: redacted (it may quote what the message held)."""
    from celery_guardrails.foundation.redaction import exception_text
    from celery_guardrails.runtime.outcomes import kept_text

    return kept_text(task, exception_text(error), 500)


class Refused(InvalidTaskError):  # type: ignore[misc]
    """A message refused as its request was built, its dead letter written (or not: ``requeue``). The task's
    strategy settles it quietly; Celery's consumer would log the start of its raw body, secrets and all."""

    def __init__(self, text: str, *, requeue: bool) -> None:
        super().__init__(text)
        self.requeue = requeue


def _malformed(raw: dict[str, Any], task: Any, error: BaseException, *, args: Any, kwargs: Any) -> Any:
    """The final failure ``malformed_message`` of a message refused in the worker's main process."""
    from celery_guardrails.foundation.redaction import exception_name, exception_text
    from celery_guardrails.runtime.final_failure import FinalFailure
    from celery_guardrails.runtime.outcomes import kept_text, owner_of, timestamp

    task_id = str(raw.get("id") or "")[:255]
    header = headers.sanitise(headers.from_message_headers(raw), task_id=task_id)
    tenant, correlation_id = header.get(headers.TENANT), header.get(headers.CORRELATION_ID)
    return FinalFailure(
        task_name=str(raw.get("task") or getattr(task, "name", "") or "")[:200],
        task_id=task_id,
        reason=MALFORMED_MESSAGE,
        exc_type=exception_name(error),
        exc_message=kept_text(task, exception_text(error), headers.MESSAGE_LIMIT),
        tenant=tenant if isinstance(tenant, str) else None,
        correlation_id=correlation_id if isinstance(correlation_id, str) else None,
        attempts=headers.counter(header, headers.ATTEMPT) + 1,
        args=tuple(args) if isinstance(args, list | tuple) else (),
        kwargs=dict(kwargs) if isinstance(kwargs, dict) else {},
        owner=owner_of(task),
        header={k: v for k, v in header.items() if k != headers.HISTORY},
        first_failed_at=timestamp(),
        last_failed_at=timestamp(),
    )


def _recorded(task: Any, failure: Any) -> bool:
    """Write the dead letter of a message refused in the worker's main process (RECORD_TRIES tries, a second
    apart); whether it was written. Nothing escapes: an exception here would stop the consumer."""
    from celery_guardrails.runtime import dead_letters

    for attempt in range(1, RECORD_TRIES + 1):
        try:
            new = dead_letters.record(task, failure)
        except Exception as exc:  # a store error or anything else: never out of the consumer (it would stop)
            logger.error("Dead letter of malformed message %s not recorded (%r), try %d", failure.task_id, exc, attempt)
            if attempt < RECORD_TRIES:
                time.sleep(1.0)
            continue
        for signal in (signals.final_failure, *((signals.dead_lettered,) if new else ())):
            try:
                signal.send(sender=task, failure=failure)
            except Exception:  # a receiver's bug: the record stands
                logger.exception("Dead letter of malformed message %s: a receiver failed", failure.task_id)
        return True
    return False


def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """``GuardedTask.Strategy``: Celery's default strategy, with a body that cannot be decoded dead-lettered
    instead of logged (raw body included) and acked (module docstring)."""
    from celery.worker.strategy import default

    handle = default(task, app, consumer, **kwargs)

    def task_message_handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **more: Any) -> Any:
        errors = tuple(consumer.connection_errors or ())
        try:
            return handle(message, body, ack, reject, callbacks, **more)
        except Refused as refused:  # recorded (or not) by GuardedRequest: settled here, the body never logged
            if refused.requeue:
                message.reject_log_error(logger, errors, requeue=True)
            else:
                message.ack_log_error(logger, errors)
            return None
        except (DecodeError, ContentDisallowed) as exc:
            # Raised as the strategy first reads the payload, before any request exists (celery/worker/strategy.py).
            _refuse_undecodable(message, task, exc, errors=errors)
            return None

    return task_message_handler


def _refuse_undecodable(message: Any, task: Any, exc: BaseException, *, errors: tuple[Any, ...]) -> None:
    raw = dict(getattr(message, "headers", None) or {})
    error = ValueError(
        f"the body could not be decoded ({getattr(message, 'content_type', None)}): {type(exc).__name__}: {exc}"
    )
    said = _said(task, exc)
    logger.error("Message %s of %s cannot be decoded (%s): dead-lettering it", raw.get("id"), task.name, said)
    try:
        recorded = bool(raw.get("id")) and _recorded(task, _malformed(raw, task, error, args=(), kwargs={}))
    except Exception:
        logger.exception("Message %s: dead letter not built", raw.get("id"))
        recorded = False
    if recorded:
        message.ack_log_error(logger, errors)
    else:  # no id to record it under, or no sink: as Celery would, but never acked away unrecorded
        message.reject_log_error(logger, errors, requeue=bool(raw.get("id")))


#: Content types whose decoded values are plain data (str, numbers, lists, dicts, and kombu's registered JSON
#: types): pickle takes them at any depth max_payload_depth allows, so the hand-over is not tried first.
PLAIN_CONTENT = frozenset({"application/json", "application/x-msgpack"})


def _guarded_hand_over(hand_over: Any) -> Any:
    """``execute_using_pool`` that never lets a payload stop the worker (module docstring)."""

    @functools.wraps(hand_over)
    def execute_using_pool(self: Any, pool: Any, **kwargs: Any) -> Any:
        if not _pickles(pool):  # solo and threads run the request in this process: nothing to hand over
            return hand_over(self, pool, **kwargs)
        problem: BaseException | None = None
        if self.content_type not in PLAIN_CONTENT:
            try:
                pickle.dumps(self.request_dict, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                problem = exc
        if problem is None:
            try:
                return hand_over(self, pool, **kwargs)
            except TaskRevokedError:
                raise
            except Exception as exc:  # the pool's own pickling (or anything else) refused it
                _forget_job(pool, self.id)
                problem = exc
        _refuse_unhandable(self, problem)

    execute_using_pool.guarded = True  # type: ignore[attr-defined]
    return execute_using_pool


def _pickles(pool: Any) -> bool:
    """Whether ``pool`` hands requests to child processes (prefork)."""
    from celery.concurrency.prefork import TaskPool

    return isinstance(pool, TaskPool)


def _forget_job(pool: Any, task_id: str) -> None:
    """Drop the job a failed hand-over left in the pool's table (billiard registers it before pickling it): a job
    that never reaches a child would be waited for at shutdown."""
    with contextlib.suppress(Exception):
        cache = pool._pool._cache
        for job, result in list(cache.items()):
            if getattr(result, "correlation_id", None) == task_id:
                cache.pop(job, None)


def _refuse_unhandable(request: Any, problem: BaseException) -> NoReturn:
    """Dead-letter a request the pool cannot take (``malformed_message``) and ack it, or give it back when that
    cannot be written; then raise TaskRevokedError, the one exception Celery's hand-over expects: it frees the
    pool slot taken for the request (``WorkController._process_task``, celery#877) and goes on."""
    error = ValueError(f"the pool could not take this message: {type(problem).__name__}: {problem!s:.300}")
    logger.error(
        "Task %s[%s] cannot be handed to the pool (%s): dead-lettering it",
        request.name,
        request.id,
        _said(request.task, problem),
    )
    try:
        failure = _malformed(dict(request.request_dict), request.task, error, args=request.args, kwargs=request.kwargs)
        recorded = _recorded(request.task, failure)
    except Exception:
        logger.exception("Task %s[%s]: dead letter not built", request.name, request.id)
        recorded = False
    state.task_ready(request)
    if recorded:
        request.acknowledge()
    else:
        request.reject(requeue=True)
    raise TaskRevokedError(f"{request.id}: not handed to the pool ({type(problem).__name__})") from problem


def _time_limit_reached(request: Any, timeout: float) -> bool:
    """Hand over the final failure of a task its hard time limit killed (module docstring). Returns whether the
    message was published again (a retry; or the final failure with its dead letter pending, when no sink could
    record it): then the result says RETRY and Celery must not store FAILURE. False: the dead letter is recorded.
    Raises ``Reject`` when the message must go back to the broker instead (nothing recorded nor published)."""
    from celery_guardrails.options import settings_snapshot
    from celery_guardrails.runtime.delivery import begin
    from celery_guardrails.runtime.gate import after_kill
    from celery_guardrails.runtime.outcomes import attempt_record, fail_finally, republish

    task = request.task
    # The killed run's request, as its hooks saw it (a worker's request is not "called directly": a retry
    # from it is published, not raised).
    task.push_request({**vars(request._context), "called_directly": False})
    try:
        context = task.request
        with settings_snapshot(task.app):
            begin(context)
            seen = view(task)
            header, options = seen.header, seen.options
            activation = activate(tenant=header.get(headers.TENANT), correlation_id=header.get(headers.CORRELATION_ID))
            try:
                exc = TimeLimitExceeded(timeout)
                attempt = headers.counter(header, headers.ATTEMPT) + 1
                context.attempt, context.attempt_history = attempt, headers.history(header)
                # Not inside a chord or with errbacks: Celery's own handling of the kill, which still runs, would
                # count the chord part failed and call the errbacks while the retry goes on.
                plain = not getattr(context, "chord", None) and not getattr(context, "errbacks", None)
                # The gate, as far as this process can see: the killed process's effects died unseen with it.
                safe = after_kill(options, keyed=bool(header.get(headers.IDEMPOTENCY_KEY))).safe
                if plain and safe and attempt < options["max_attempts"]:
                    record = attempt_record(task, kind="transient", rule=TIME_LIMIT, exc=exc, delay=0.0)
                    logger.warning("Task %s[%s] killed by its time limit; retrying", task.name, request.id)
                    # RETRY stored before the retry is published, so that the retry's own result is never overwritten.
                    task.backend.mark_as_retry(request.id, exc, request=context)
                    try:
                        republish(
                            task, countdown=0.0, exc=exc, header=headers.with_record(header, record, attempt=attempt)
                        )
                    except Retry:  # published (a publish that failed raised Reject: the message goes back)
                        return True
                record = attempt_record(task, kind="permanent", rule=TIME_LIMIT, exc=exc)
                try:
                    fail_finally(task, exc, reason=TIME_LIMIT, history=[*context.attempt_history, record])
                except TimeLimitExceeded:  # raised back once the dead letter is recorded: Celery stores FAILURE
                    return False
                except Retry:
                    # Not recorded (no sink answered): the message is published again carrying its pending dead
                    # letter, to be recorded when it comes back. Until then the task is not failed: RETRY, as any
                    # pending dead letter says, and never FAILURE with nothing recorded.
                    task.backend.mark_as_retry(request.id, exc, request=context)
                    return True
            finally:
                deactivate(activation)
    finally:
        task.pop_request()


__all__ = ["MALFORMED_MESSAGE", "TIME_LIMIT", "GuardedRequest"]
