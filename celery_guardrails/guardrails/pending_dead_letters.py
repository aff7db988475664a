"""Dead letters that could not be recorded yet: the message came back carrying them; record them now.

When no sink could record a final failure (the database was down), :func:`~celery_guardrails.runtime.outcomes.
fail_finally` published the message again with the pending record in its header instead of acking it away.
This guardrail, early in ``before_run``, records it (the body never runs again) and fails the task with
:class:`~celery_guardrails.exceptions.DeadLetteredError`; if the sinks are still down, the message goes
round again, waiting twice as long each time (at most 10 minutes).

The pending record is input like any other: another producer may have written it. What the message itself
says wins over what the record claims, and what only the record can say is checked (:func:`pending_failure`):

* the record is this message's: its task id and name, arguments, header, queue, correlation id (the context
  restored from the header) and owner (:func:`~celery_guardrails.runtime.outcomes.owner_of`, never the claimed one);
* its tenant must be a valid tenant id and the message's own (the header's ``tenant``), its reason one of
  :data:`~celery_guardrails.runtime.outcomes.REASONS`, its idempotency key the one the message makes (else none);
* its history passes the checks of the header's own (:func:`~celery_guardrails.runtime.headers.attempt_records`);
  exception type, message and traceback are cut to their lengths, and every text is redacted.

A record that fails a check is still recorded, as ``malformed_message``, its exception message saying what was
wrong and keeping the claimed reason escaped; one that cannot be read at all (not a mapping) too. Never an ack
with nothing recorded, never a body run again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeGuard

from celery_guardrails.exceptions import DeadLetteredError
from celery_guardrails.foundation.context import current_correlation_id, validate_correlation_id, validate_tenant
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.dead_letters import TRACEBACK_LIMIT, storable
from celery_guardrails.runtime.delivery import redaction, view
from celery_guardrails.runtime.final_failure import FinalFailure
from celery_guardrails.runtime.outcomes import (
    MALFORMED_MESSAGE,
    PENDING_DEAD_LETTER,
    REASONS,
    hand_over,
    owner_of,
    timestamp,
)
from celery_guardrails.runtime.pipeline import Guardrail

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)

#: Characters kept of a pending record's exception type (the dead letter's column).
EXC_TYPE_LIMIT = 255
#: Characters of a claimed value shown, escaped, in the message of a malformed record.
SHOWN_LIMIT = 80


class PendingDeadLetters(Guardrail):
    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        header = view(task).header
        if PENDING_DEAD_LETTER not in header:
            return
        failure = pending_failure(task, header[PENDING_DEAD_LETTER], header, args, kwargs)
        error = DeadLetteredError(failure.reason, failure.exc_type, failure.exc_message)
        hand_over(task, failure, error)  # raises error once recorded (else the Retry or Reject that ends it)


def pending_failure(
    task: Any, pending: Any, header: Mapping[str, Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> FinalFailure:
    """The final failure to record for the pending dead letter ``pending`` carried by this message (``header``,
    sanitised; ``args``/``kwargs``, its arguments): checked as the module docstring says. Never raises for what
    the pending record holds."""
    request = task.request
    problems: list[str] = []
    data: Mapping[str, Any] = pending if isinstance(pending, Mapping) else {}
    if not isinstance(pending, Mapping):
        problems.append(f"the pending dead letter is a {type(pending).__name__}, not a mapping")
    missing = [name for name in headers.PENDING_REQUIRED if not isinstance(data.get(name), str)]
    if missing:
        problems.append(f"it lacks {', '.join(missing)} (or they are not text)")
    tenant = header.get(headers.TENANT)  # sanitised: a valid tenant id, or absent
    claimed_tenant = data.get("tenant")
    if claimed_tenant is not None and not _valid(validate_tenant, claimed_tenant):
        problems.append(f"its tenant {_shown(claimed_tenant)} is not a valid tenant id")
    elif claimed_tenant != tenant:
        problems.append(f"its tenant {_shown(claimed_tenant)} is not the message's ({_shown(tenant)})")
    reason = data.get("reason")
    if isinstance(reason, str) and reason not in REASONS:
        problems.append(f"its reason {_shown(reason)} is not one a dead letter can give")
    history = headers.attempt_records(data.get("history", []))
    if history is None:
        problems.append("its history is not a list of attempt records")
        history = []
    key = _message_key(task, header, args, kwargs)
    claimed_key = data.get("idempotency_key")
    if claimed_key is not None and claimed_key != key:
        problems.append("its idempotency key is not the one the message makes")
    exc_message = _text(task, data.get("exc_message"), headers.MESSAGE_LIMIT)
    if problems:
        note = f"[malformed pending dead letter: {'; '.join(problems)}] "
        exc_message = (note + exc_message)[: len(note) + headers.MESSAGE_LIMIT]
        logger.warning("Task %s[%s]: %s; recorded as %s", task.name, request.id, note.strip(), MALFORMED_MESSAGE)
    claimed_attempts = data.get("attempts")
    attempts: int = claimed_attempts if _attempts(claimed_attempts) else int(getattr(request, "attempt", None) or 1)
    return FinalFailure(
        task_name=task.name,
        task_id=request.id,
        reason=MALFORMED_MESSAGE if problems or not isinstance(reason, str) else reason,
        exc_type=_text(task, data.get("exc_type"), EXC_TYPE_LIMIT),
        exc_message=exc_message,
        tenant=tenant,
        correlation_id=_correlation_id(data.get("correlation_id")),
        attempts=attempts,
        history=[_redacted_record(task, record) for record in history],
        args=tuple(args),
        kwargs=dict(kwargs),
        queue=(request.delivery_info or {}).get("routing_key"),
        owner=owner_of(task),
        idempotency_key=key if claimed_key is not None and claimed_key == key else None,
        header={
            k: v for k, v in header.items() if k not in (headers.HISTORY, PENDING_DEAD_LETTER, headers.PENDING_TRIES)
        },
        traceback=_text(task, data.get("traceback"), TRACEBACK_LIMIT),
        first_failed_at=_moment(data.get("first_failed_at")),
        last_failed_at=_moment(data.get("last_failed_at")),
    )


def _valid(check: Any, value: Any) -> bool:
    try:
        check(value)
    except ValueError:
        return False
    return True


def _shown(value: Any) -> str:
    """A claimed value as a malformed record's message shows it: escaped (NUL, lone surrogates, bidi and other
    controls written out by repr), cut, and its type when it is not text."""
    if value is None or isinstance(value, str):
        return repr(value[:SHOWN_LIMIT] if isinstance(value, str) else value)
    return f"(a {type(value).__name__})"


def _text(task: Any, value: Any, limit: int) -> str:
    """Claimed text as a record keeps it: redacted and cut (the redaction reads only a margin past the cut: a
    megabyte is not walked), NUL and lone surrogates written out (they reach the log line and the task's error
    too, where a UTF-8 handler would refuse them), cut."""
    if not isinstance(value, str):
        return ""
    return str(storable(redaction(task).text(value, keep=limit)))[:limit]


def _redacted_record(task: Any, record: dict[str, Any]) -> dict[str, Any]:
    """An attempt record with its text redacted and escaped (the texts only: numbers say nothing secret)."""
    redactor = redaction(task)
    return {key: storable(redactor.text(value)) if isinstance(value, str) else value for key, value in record.items()}


def _attempts(value: Any) -> TypeGuard[int]:
    """Whether a claimed attempt count can be kept: a whole number the record's column takes (1 to 2**31 - 1)."""
    return not isinstance(value, bool) and isinstance(value, int) and 1 <= value <= 2**31 - 1


def _correlation_id(claimed: Any) -> str | None:
    """The claimed correlation id when it is a valid one (it was the message's when recorded), else the one the
    delivery runs with (restored from the header, or made for it)."""
    return claimed if _valid(validate_correlation_id, claimed) else current_correlation_id()


def _moment(value: Any) -> str:
    """A claimed time when it is ISO 8601 (as attempt records write it), else now."""
    if isinstance(value, str) and len(value) <= 40:
        try:
            datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            return value
    return timestamp()


def _message_key(task: Any, header: Mapping[str, Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    """The scoped idempotency key this message makes (as the idempotency guardrail makes it), or None: none, or
    one that cannot be made."""
    from celery_guardrails.guardrails.keys import render_key, scoped_key
    from celery_guardrails.scheduling.ledger import period_key

    key = header.get(headers.IDEMPOTENCY_KEY)
    try:
        if key is None and headers.SCHEDULE in header and headers.PERIOD in header:
            key = period_key(header[headers.SCHEDULE], header[headers.PERIOD])
        if key is None:
            spec = view(task).options["idempotency_key"]
            key = None if spec is None else render_key(task, spec, args, dict(kwargs))
    except Exception:  # a key that cannot be made is no key: the record keeps none
        return None
    return None if key is None else scoped_key(task.name, header.get(headers.TENANT), key)
