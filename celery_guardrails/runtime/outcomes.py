"""The ways a guardrail ends a delivery other than letting it succeed: re-publish it, or fail it finally.

Both happen before the current delivery is acked (``GuardedTask`` acks late): the new message is published,
or the final failure is handed to the dead-letter hook, and only then does Celery ack the message. A store
that cannot be reached re-publishes the message without spending an attempt (:func:`store_unavailable`);
where even that fails, the message is given back to the broker unacked.

Each function here that ends a delivery raises what ends it (``NoReturn``): Celery's ``Retry`` (a message
published again), the exception the task fails with (its dead letter recorded), or a ``Reject`` that gives
the message back to the broker. No caller decides whether to raise, so none can forget to.
"""

from __future__ import annotations

import logging
import random
import time
import traceback as traceback_module
from collections.abc import Mapping
from datetime import UTC, datetime
from fnmatch import fnmatchcase
from typing import Any, NoReturn

from celery.exceptions import Reject, Retry

from celery_guardrails import signals
from celery_guardrails.broker.delays import countdown_for, delay_rule, republishable_headers
from celery_guardrails.foundation.context import current_correlation_id, current_tenant
from celery_guardrails.foundation.redaction import exception_name, exception_text
from celery_guardrails.guardrails import waiting
from celery_guardrails.log import shown
from celery_guardrails.options import app_value, task_attribute
from celery_guardrails.runtime import dead_letters, headers
from celery_guardrails.runtime.delivery import delivery, redaction, view
from celery_guardrails.runtime.final_failure import FinalFailure

logger = logging.getLogger(__name__)

#: Final-failure reasons.
PERMANENT = "permanent"
NOT_IDEMPOTENT = "not_idempotent"
ATTEMPTS_EXHAUSTED = "attempts_exhausted"
RETRY_LATER_EXHAUSTED = "retry_later_exhausted"
RETRY_BUDGET_EXHAUSTED = "retry_budget_exhausted"
CIRCUIT_OPEN = "circuit_open"
MISSING_TENANT = "missing_tenant"
BAD_IDEMPOTENCY_KEY = "bad_idempotency_key"
POISON = "poison"
STORE_REFUSED = "store_refused"
MALFORMED_MESSAGE = "malformed_message"
TIME_LIMIT = "time_limit"
#: An ordered message that arrived after its key had moved past it (its turn was given up as lost).
ORDERING_GAP = "ordering_gap"
#: Sequence numbers of an ordering key that never came and were given up after ``ordering_gap_timeout``: the
#: record of the gap (no message, nothing to replay), not of a message.
ORDERING_GAP_SKIPPED = "ordering_gap_skipped"
#: A message of a payload version its task does not accept (accepts_versions): a replay on newer workers runs it.
UNKNOWN_PAYLOAD_VERSION = "unknown_payload_version"
#: An exception that no guardrail settled (a guardrail's own failure on this message, or a body's error where no
#: guardrail classifies errors): recorded so that nothing is acked away unseen; replay it once the cause is fixed.
GUARDRAIL_ERROR = "guardrail_error"
#: A transactional outbox message its relay could not publish in ``outbox_max_attempts`` tries (its task unknown
#: where the relay runs, the broker refusing it, its arguments not encodable): removed from the outbox in the
#: record's transaction; replay it once the cause is fixed (see django_celery_guardrails.outbox).
UNPUBLISHABLE = "unpublishable"
#: A record the task needs (``require(queryset, **lookup)``, or the body's ``ObjectDoesNotExist`` with
#: ``absent_records="wait"``) was still not there once ``record_wait`` was spent: the message names the model and
#: the lookup; replay it once the record exists (see celery_guardrails.guardrails.records).
RECORD_MISSING = "record_missing"
#: Every reason a dead letter can give (the commands check ``--reason`` against it).
REASONS = (
    PERMANENT,
    NOT_IDEMPOTENT,
    ATTEMPTS_EXHAUSTED,
    RETRY_LATER_EXHAUSTED,
    RETRY_BUDGET_EXHAUSTED,
    CIRCUIT_OPEN,
    MISSING_TENANT,
    BAD_IDEMPOTENCY_KEY,
    POISON,
    STORE_REFUSED,
    MALFORMED_MESSAGE,
    TIME_LIMIT,
    ORDERING_GAP,
    ORDERING_GAP_SKIPPED,
    UNKNOWN_PAYLOAD_VERSION,
    GUARDRAIL_ERROR,
    UNPUBLISHABLE,
    RECORD_MISSING,
)

#: Field of the worker's request naming the serializer a message arrived in, when it is not its task's own
#: (set by :class:`celery_guardrails.runtime.request.GuardedRequest`): its retries are published in it too, so that a
#: message another producer pickled does not fail to re-publish as JSON.
ARRIVED_AS = "guardrails_serializer"

#: Header field of a final failure whose dead letter could not be recorded yet (the message came back).
PENDING_DEAD_LETTER = headers.PENDING_DEAD_LETTER


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
    """One attempt record for the history (see :mod:`celery_guardrails.runtime.headers`)."""
    request = task.request
    return {
        "n": getattr(request, "attempt", 1),
        "start": timestamp(started if started is not None else delivery(task).started),
        "end": timestamp(),
        "host": request.hostname,
        "exc": exception_name(exc) if exc is not None else None,
        "msg": kept_text(task, exception_text(exc), headers.MESSAGE_LIMIT) if exc is not None else None,
        "class": kind,
        "rule": rule,
        "delay": None if delay is None else round(delay, 3),
    }


def formatted_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as text, or a line saying why there is none (a chain too deep to format)."""
    try:
        return "".join(traceback_module.format_exception(exc))
    except Exception as error:
        return f"(traceback not kept: formatting it raised {type(error).__name__})"


def kept_text(task: Any, text: str, limit: int, *, tail: bool = False) -> str:
    """Text about a failure (a message, a traceback) as it may be kept: redacted with the task's settings
    (``redact_keys``, ``redact_patterns``), cut to ``limit`` characters (the last ones when ``tail``; the redaction
    reads past the cut, so a secret the cut falls into is still found). Never raises: text that cannot be
    redacted is not kept (:meth:`celery_guardrails.foundation.redaction.Redactor.text`)."""
    return redaction(task).text(text, keep=limit, tail=tail)


def republish(
    task: Any,
    *,
    countdown: float,
    header: dict[str, Any],
    exc: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    options: Mapping[str, Any] | None = None,
) -> NoReturn:
    """Publish the running message again after ``countdown`` seconds with ``header``; raise Celery's Retry.

    Every other header of the message is kept (tenant included: it is in ``header``), except those the broker
    set (``x-death``, ``x-delivery-count``, ...). ``countdown`` is rounded to what the broker accepts (whole
    seconds on RabbitMQ's native delayed delivery; see :mod:`celery_guardrails.broker.delays`). ``args``,
    ``kwargs`` and ``options`` are what a body's ``self.retry(...)`` asked for (None: the message's own). The
    Retry is raised (from ``exc``, when given) so that Celery records RETRY and acks the current delivery after the
    publish. A publish that fails raises what :meth:`celery_guardrails.runtime.task.GuardedTask.retry` raises
    (a ``Reject`` that gives the message back, as a rule).
    """
    request = task.request
    state = delivery(task)
    # Guardrails that hold something for this delivery (an idempotency claim) give it up first, so the new
    # delivery never finds it held by the old one; what could not be let go, the new delivery may take over.
    kept = state.give_up(request.id)
    if kept:
        header = {**header, headers.GAVE_UP: [*header.get(headers.GAVE_UP, ()), *kept][-headers.GAVE_UP_LIMIT :]}
    state.republishing = True
    extra = dict(options or {})
    arrived_as = getattr(request, ARRIVED_AS, None)
    if arrived_as:
        extra.setdefault("serializer", arrived_as)
    # The broker's own headers (x-death, x-delivery-count, ...) are never copied: see celery_guardrails.broker.delays.
    message_headers = {
        **republishable_headers(request.headers),
        **(extra.pop("headers", None) or {}),
        headers.HEADER: header,
    }
    countdown = countdown_for(task.app, countdown)
    # Shown as waiting until it runs again (never raises; written first, so a delivery that starts at once finds
    # the row to remove): see celery_guardrails.guardrails.waiting.
    waiting.note(task, header=header, countdown=countdown)
    # max_retries: the guardrails count attempts themselves; Celery's own limit must not interfere.
    retry: BaseException = task.retry(
        args=args,
        kwargs=kwargs,
        exc=exc,
        countdown=countdown,
        max_retries=request.retries + 1,
        throw=False,
        headers=message_headers,
        **extra,
    )
    state.ended = "republished"
    _raise(retry, cause=exc)


def longest_countdown(app: Any) -> float:
    """The longest countdown a re-published message may have: on a Redis broker (kombu's Redis transport, whatever
    the URL's scheme), nine tenths of its ``visibility_timeout`` (a message held by a worker for longer is
    delivered to another one as well: kombu takes it for lost); elsewhere no bound."""
    return delay_rule(app).longest


def store_unavailable(task: Any, exc: BaseException) -> NoReturn:
    """The guardrails store could not be reached for this delivery: publish the message again later without
    spending an attempt, and raise Celery's Retry (or, when even publishing fails, a Reject that gives the
    message back to the broker unacked), both from ``exc``. Logged with ids; ``store_unavailable``.

    The delay doubles with each outage the message meets (``backoff_base`` to ``backoff_max``, half of it
    random, so the messages of one outage do not all come back at once).
    """
    request = task.request
    seen = view(task)
    header, options = seen.header, seen.options
    outages = headers.counter(header, headers.OUTAGES) + 1
    ceiling = min(options["backoff_max"], options["backoff_base"] * 2.0 ** min(outages, 30))
    delay = ceiling * (0.5 + random.random() / 2)
    logger.error(
        "Task %s[%s]: the guardrails store is unavailable (%s); not run now, back in %.1fs without spending an "
        "attempt (outage %d)",
        task.name,
        request.id,
        exc,
        delay,
        outages,
    )
    signals.store_unavailable.send(sender=task, task_id=request.id, error=exc, delay=delay, outages=outages)
    record = attempt_record(task, kind="store_unavailable", rule="store", exc=exc, delay=delay)
    try:
        republish(
            task, countdown=delay, exc=exc, header=headers.with_record(header, record, **{headers.OUTAGES: outages})
        )
    except Retry:  # published: the delivery ends as a retry
        raise
    except Exception as error:  # the broker is out of reach too: the message stays with it, unacked
        logger.error(
            "Task %s[%s]: could not be published again (%s); given back to the broker unacked",
            task.name,
            request.id,
            error,
        )
    raise Reject(exc, requeue=True) from exc


def owner_of(task: Any) -> str | None:
    """The task's ``owner``, else the first ``owners`` pattern its name matches."""
    owner = task_attribute(task, "owner")
    if owner:
        return str(owner)
    for pattern, name in app_value(task.app, "owners").items():
        if fnmatchcase(task.name, pattern):
            return str(name)
    return None


def fail_finally(
    task: Any, exc: BaseException, *, reason: str, history: list[dict[str, Any]] | None = None
) -> NoReturn:
    """End the delivery as a final failure: record its dead letter durably, log at ERROR, send ``final_failure``.

    Raises one of three, and nothing else, whatever the exception or the message holds (a ``__str__`` that
    raises, arguments nested past the recursion limit):

    * ``exc`` itself once the dead letter is recorded: the task fails with it (and Celery acks);
    * Celery's ``Retry`` (from ``exc``) when no sink can record it: the message is published again carrying the
      pending dead letter (no body will run for it), so nothing is acked away unrecorded;
    * a ``Reject`` (from ``exc``) that gives the message back to the broker, where even that publish fails.
    """
    try:
        failure = _final_failure(task, exc, reason=reason, history=history)
    except Exception:  # a failure that cannot even be described: its message goes back, not acked away
        logger.exception("Task %s: final failure (%s) not described; the message goes back", _name(task), reason)
        failure = None
    if failure is None:
        _given_back(task, exc)
    logger.error(
        "Task %s[%s] failed finally (%s) after %d attempt(s): %s: %s (tenant %s, correlation id %s)",
        failure.task_name,
        failure.task_id,
        reason,
        failure.attempts,
        failure.exc_type,
        failure.exc_message,
        shown(failure.tenant),  # "-" for none, as the log context and the admin show it
        shown(failure.correlation_id),
    )
    hand_over(task, failure, exc)


def _name(task: Any) -> str:
    return f"{getattr(task, 'name', '?')}[{getattr(task.request, 'id', '?')}]"


def _final_failure(task: Any, exc: BaseException, *, reason: str, history: list[dict[str, Any]] | None) -> FinalFailure:
    request = task.request
    history = list(history or ())
    header = view(task).header
    return FinalFailure(
        task_name=task.name,
        task_id=request.id,
        reason=reason,
        exc_type=exception_name(exc),
        exc_message=kept_text(task, exception_text(exc), headers.MESSAGE_LIMIT),
        tenant=current_tenant(),
        correlation_id=current_correlation_id(),
        attempts=getattr(request, "attempt", 1),
        history=history,
        args=tuple(request.args or ()),
        kwargs=dict(request.kwargs or {}),
        queue=(request.delivery_info or {}).get("routing_key"),
        owner=owner_of(task),
        idempotency_key=delivery(task).key,  # the scoped key (replay reopens it), not the body's opaque one
        header={k: v for k, v in header.items() if k not in (headers.HISTORY, PENDING_DEAD_LETTER)},
        traceback=kept_text(task, formatted_traceback(exc), dead_letters.TRACEBACK_LIMIT, tail=True),
        first_failed_at=history[0]["start"] if history and history[0].get("start") else timestamp(),
        last_failed_at=timestamp(),
    )


def hand_over(task: Any, failure: FinalFailure, exc: BaseException) -> NoReturn:
    """Record ``failure``'s dead letter, then send the signals and raise ``exc`` (the task fails with it); else
    re-publish it pending (or, when that fails too, give the message back to the broker). Raises one of the
    three, nothing else: see :func:`fail_finally`."""
    outage: BaseException | None = None
    try:
        new = dead_letters.record(task, failure)
    except Exception as error:
        # A store error (down, or refusing even the cut record) or anything else at all: the message must not be
        # acked with nothing recorded. dead_letters.record already fell back to a cut record for data it could
        # not store, so what is left is an outage: try again later.
        outage = error
    if outage is not None:
        _pending(task, failure, exc, outage)
    delivery(task).ended = "recorded"
    for signal in (signals.final_failure, *((signals.dead_lettered,) if new else ())):
        try:
            signal.send(sender=task, failure=failure)
        except Exception:  # a receiver's bug: the record stands, the delivery ends as recorded
            logger.exception("Task %s[%s]: a receiver of %s failed", failure.task_name, failure.task_id, signal.name)
    raise exc


def _pending(task: Any, failure: FinalFailure, exc: BaseException, error: BaseException) -> NoReturn:
    """Publish the message again carrying its pending dead letter (raise Celery's Retry); raise a Reject when
    that cannot be done."""
    try:
        seen = view(task)
        header = dict(seen.header)
        tries = headers.counter(header, headers.PENDING_TRIES) + 1
        delay = min(2.0 ** min(tries, 30), seen.options["backoff_max"])
        logger.error(
            "Task %s[%s]: dead letter not recorded (%s); the message comes back in %.0fs to try again",
            failure.task_name,
            failure.task_id,
            error,
            delay,
        )
        header.update({PENDING_DEAD_LETTER: failure.to_dict(), headers.PENDING_TRIES: tries})
        republish(task, countdown=delay, header=header, exc=exc)
    except Retry:  # published: the pending dead letter travels with the message
        raise
    except Exception:
        logger.exception("Task %s[%s]: pending dead letter not published", failure.task_name, failure.task_id)
    _given_back(task, exc)


def _given_back(task: Any, exc: BaseException) -> NoReturn:
    """Raise a Reject (from ``exc``) that gives the running message back to the broker unacked (it is delivered
    again; its redeliveries are counted by the poison guard)."""
    logger.error("Task %s: given back to the broker unacked", _name(task))
    raise Reject(exc, requeue=True) from exc


def _raise(error: BaseException, *, cause: BaseException | None) -> NoReturn:
    """Raise ``error`` from ``cause``; with no cause, as a plain ``raise`` would (``from None`` would hide the
    exception being handled)."""
    if cause is None:
        raise error
    raise error from cause
