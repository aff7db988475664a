"""Error classification: is a failure worth another attempt?

:func:`classify` applies these rules, in order, and the first that matches decides:

1. Celery's own control flow (``Retry``, ``Ignore``, ``Reject``) passes through untouched.
2. ``RetryLater`` -> retry later (no attempt consumed; ``RecordNotThereYet``, raised by ``require()``, waits for
   at most ``record_wait``); ``TransientError`` -> transient; ``PermanentError`` -> permanent. ``SlotLostError``
   (the delivery's concurrency slot was reaped while it ran) -> retry later under the limit, through the gate
   below (unless the body never started).
3. The task's ``permanent_errors``.
4. Django's ``ObjectDoesNotExist`` (a model's ``DoesNotExist``), by ``absent_records``: ``"wait"`` (default) ->
   a record not there yet, waited for as ``require()`` does (:mod:`celery_guardrails.guardrails.records`) but
   through the gate below; ``"fail"`` -> permanent. After ``permanent_errors`` (the task's own word wins) and
   before ``deterministic_errors`` and ``transient_errors``.
5. ``deterministic_errors`` (``ValueError``, ``TypeError``, ``KeyError``, validation errors, ...): no retry
   can fix them, so they are permanent, unless a class of ``transient_errors`` (or ``autoretry_for``) at least
   as specific names the error (``transient_errors=(KeyError,)`` wins; ``autoretry_for=(Exception,)`` does not).
6. The task's ``transient_errors``, and Celery's ``autoretry_for`` less ``dont_autoretry_for``
   (``isinstance``).
7. HTTP errors of requests, httpx, urllib3 or the standard library's urllib, by status: 408, 425, 429 and
   5xx are transient, any other 4xx is permanent; their transport errors (timeouts, refused connections)
   are transient. The libraries are recognised by the exception's module, never imported here.
8. ``error_patterns``: regular expressions matched against ``str(exc)``, for errors that crossed an RPC
   boundary as plain text (a remote "404 Not Found" must still be recognised); a pattern may map to
   ``"retry_later"`` (a remote "not yet"): a wait that spends no attempt, bounded by ``retry_later_max``, through
   the gate below.
9. ``unknown_errors``: ``"auto"`` (default) makes an unknown error transient (and the gate decides), or all
   ``"transient"`` / ``"permanent"``.

Then one gate, **retry safety by construction** (:mod:`celery_guardrails.runtime.gate`): a transient verdict (and a
retry-later one that is not the author's own ``RetryLater``: a reaped slot, an absent record, a pattern) stands
only when running the body again cannot repeat an effect (declared ``idempotent=True`` or ``retry_unsafe=True``,
a key handed downstream, an atomic key, or a failure before the body's first marked effect), or when the task's
own code raised ``TransientError`` (its author's word). Otherwise it becomes permanent with a rule ending in
``:not_idempotent`` and a note saying what would make it retryable.

:func:`sent_nothing` tells whether a failure proves the request never reached the other side; an ``effect()``
block left by such a failure counts no effect (:mod:`celery_guardrails.runtime.effects`).
"""

from __future__ import annotations

import enum
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from celery.exceptions import Ignore, Reject, Retry

from celery_guardrails.exceptions import PermanentError, RecordNotThereYet, RetryLater, SlotLostError, TransientError
from celery_guardrails.guardrails import records
from celery_guardrails.options import APP, TASK, Option, TaskOptions, checks, declare
from celery_guardrails.runtime.wire import (
    CONNECT_FAILURES,
    TRANSIENT_STATUSES,
    TRANSPORT_ERRORS,
    http_library,
    status_of,
)

#: Rules that are the task author's own word that trying again is safe.
OWN_WORD = frozenset({"TransientError"})
#: The rule of a delivery stopped because its concurrency slot was reaped (SlotLostError).
SLOT_LOST = "concurrency:slot_lost"
#: The rule of an error_patterns match (followed by the pattern).
PATTERN = "error_patterns:"
#: Kinds an error_patterns entry may map a message to.
PATTERN_KINDS = ("transient", "permanent", "retry_later")


def _patterns(value: Any) -> tuple[tuple[re.Pattern[str], str], ...]:
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        checked = tuple((re.compile(pattern), checks.choice(*PATTERN_KINDS)(kind)) for pattern, kind in pairs)
    except (TypeError, ValueError, re.error) as exc:
        raise ValueError(f"must map regular expressions to 'transient', 'permanent' or 'retry_later': {exc}") from None
    return checked


#: Errors no retry can fix (a bug, bad input): permanent at their first failure (deterministic_errors). Also
#: Django's and pydantic's ValidationError, once their module is imported (see DETERMINISTIC_MODULES).
DETERMINISTIC_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    LookupError,
    NotImplementedError,
    UnicodeError,
)
#: (module, class) of validation errors that are deterministic too, checked only when their module is imported:
#: an error of a module nobody imported cannot be raised, and nothing is imported for them.
DETERMINISTIC_MODULES = (
    ("django.core.exceptions", "ValidationError"),
    ("pydantic", "ValidationError"),
    ("pydantic_core", "ValidationError"),
)

#: The options error classification reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="transient_errors",
        default=(),
        doc="Exception classes (or dotted paths) retried with backoff, where the retry gate finds a re-run "
        "safe. Celery's autoretry_for (less dont_autoretry_for) on a GuardedTask counts as these.",
        check=checks.exception_types,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="permanent_errors",
        default=(),
        doc="Exception classes (or dotted paths) never retried; checked before transient_errors.",
        check=checks.exception_types,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="deterministic_errors",
        default=DETERMINISTIC_ERRORS,
        doc="Exception classes (or dotted paths) no retry can fix: permanent at their first failure, even "
        "when a broader transient_errors or autoretry_for class (Exception) matches; a class of "
        "transient_errors at least as specific wins. Default: ValueError, TypeError, KeyError, "
        "AttributeError, LookupError, NotImplementedError, UnicodeError, and Django's and pydantic's "
        "ValidationError; () turns it off.",
        check=checks.exception_types,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="error_patterns",
        default=(),
        doc="Ordered {regex: 'transient'|'permanent'|'retry_later'} matched against the error message, for "
        "errors that crossed an RPC boundary as text; 'retry_later' waits without spending an attempt "
        "(retry_later_delay, at most retry_later_max times) where the retry gate finds a re-run safe.",
        check=_patterns,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="unknown_errors",
        default="auto",
        doc="'auto': an unclassified error is transient, retried only where the retry gate finds a re-run "
        "safe (celery_guardrails.runtime.gate); or 'transient' / 'permanent' for all tasks (the gate still applies "
        "to 'transient').",
        check=checks.choice("auto", "transient", "permanent"),
        scopes=frozenset({TASK, APP}),
    ),
)


class Kind(enum.Enum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"
    RETRY_LATER = "retry_later"
    CONTROL = "control"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do about one failure, and which rule said so (for logs and the attempt history)."""

    kind: Kind
    rule: str
    retry_after: float | None = None
    #: Why a transient failure was not retried, and what would make it retryable (the gate's note).
    note: str | None = None


def classify(exc: BaseException, options: TaskOptions, state: Any = None) -> Verdict:
    """Classify ``exc`` raised by ``options.task`` (with these options) in the delivery ``state`` (the running
    one when None): the rules, then the retry gate."""
    verdict = _rules(exc, options)
    return gated(verdict, options, state)


def gated(verdict: Verdict, options: TaskOptions, state: Any = None) -> Verdict:
    """``verdict`` through the retry gate: a transient one stands only where a re-run is safe."""
    slot_lost = verdict.rule == SLOT_LOST
    # A wait the author did not ask for (a reaped slot, an absent record, a pattern) re-runs the body too.
    unasked_wait = verdict.kind is Kind.RETRY_LATER and (
        slot_lost or verdict.rule == records.ABSENT_RULE or verdict.rule.startswith(PATTERN)
    )
    if (verdict.kind is not Kind.TRANSIENT or verdict.rule in OWN_WORD) and not unasked_wait:
        return verdict
    from celery_guardrails.runtime import gate
    from celery_guardrails.runtime.delivery import delivery

    state = state if state is not None else delivery(options.task)
    if slot_lost and not state.body_ran:  # stopped before its body: nothing of it ran
        return verdict
    safety = gate.judge(options, state)
    if safety.safe:
        return verdict
    note = safety.note
    if verdict.rule == records.ABSENT_RULE:
        note += "; or fetch the row with self.require(queryset, **lookup) before the body acts"
    return Verdict(Kind.PERMANENT, f"{verdict.rule}:not_idempotent", note=note)


def _rules(exc: BaseException, options: TaskOptions) -> Verdict:
    if isinstance(exc, Retry | Ignore | Reject):
        return Verdict(Kind.CONTROL, "celery")
    if isinstance(exc, RecordNotThereYet):
        return Verdict(Kind.RETRY_LATER, records.REQUIRE_RULE)
    if isinstance(exc, RetryLater):
        return Verdict(Kind.RETRY_LATER, "RetryLater", exc.delay)
    if isinstance(exc, SlotLostError):  # not the message's fault: no attempt spent, when a re-run is safe
        return Verdict(Kind.RETRY_LATER, SLOT_LOST)
    if isinstance(exc, TransientError):
        return Verdict(Kind.TRANSIENT, "TransientError", exc.retry_after)
    if isinstance(exc, PermanentError):
        return Verdict(Kind.PERMANENT, "PermanentError")
    if isinstance(exc, options["permanent_errors"]):
        return Verdict(Kind.PERMANENT, "permanent_errors")
    if records.absent(exc):
        if options["absent_records"] == "wait":
            return Verdict(Kind.RETRY_LATER, records.ABSENT_RULE)
        return Verdict(Kind.PERMANENT, "absent_records:fail")
    transient, rule = _transient_class(exc, options)
    deterministic = _deterministic_class(exc, options)
    if (
        deterministic is not None
        and not (transient is not None and issubclass(transient, deterministic))
        and not _transport_failure(exc)  # urllib3's ResponseNotChunked is a ProtocolError and a ValueError
    ):
        return Verdict(Kind.PERMANENT, "deterministic_errors")
    if transient is not None:
        return Verdict(Kind.TRANSIENT, rule, retry_after_of(exc))
    http = _http_verdict(exc)
    if http is not None:
        return http
    patterns = options["error_patterns"]
    message = _text(exc) if patterns else ""
    for pattern, kind in patterns:
        if pattern.search(message):
            return Verdict(Kind(kind), f"{PATTERN}{pattern.pattern}")
    unknown = options["unknown_errors"]
    return Verdict(Kind(unknown if unknown != "auto" else "transient"), f"unknown_errors:{unknown}")


def _text(exc: BaseException) -> str:
    """``str(exc)``, or "" for an exception whose ``__str__`` itself fails (it is still classified)."""
    try:
        return str(exc)
    except Exception:
        return ""


def _transient_class(exc: BaseException, options: TaskOptions) -> tuple[type | None, str]:
    """The most specific class of ``transient_errors`` (or Celery's ``autoretry_for``) ``exc`` is, and its rule."""
    task = options.task
    matches = [(k, "transient_errors") for k in options["transient_errors"] if isinstance(exc, k)]
    autoretry = tuple(getattr(task, "autoretry_for", None) or ())
    if (
        autoretry
        and isinstance(exc, autoretry)
        and not isinstance(exc, tuple(getattr(task, "dont_autoretry_for", None) or ()))
    ):
        matches += [(k, "autoretry_for") for k in autoretry if isinstance(exc, k)]
    if not matches:
        return None, ""
    # The nearest in the error's own class hierarchy: (KeyError,) over (Exception,).
    order = type(exc).__mro__
    return min(matches, key=lambda match: order.index(match[0]) if match[0] in order else len(order))


def _deterministic_class(exc: BaseException, options: TaskOptions) -> type | None:
    """The most specific ``deterministic_errors`` class ``exc`` is (the default's optional validation errors
    included, once their module is imported), or None."""
    classes = options["deterministic_errors"]
    if classes is DETERMINISTIC_ERRORS:
        classes = (*classes, *_imported_validation_errors())
    order = type(exc).__mro__
    found = [klass for klass in classes if klass in order]
    return min(found, key=order.index) if found else None


def _imported_validation_errors() -> tuple[type, ...]:
    found = []
    for module_name, name in DETERMINISTIC_MODULES:
        module = sys.modules.get(module_name)
        klass = getattr(module, name, None) if module is not None else None
        if isinstance(klass, type) and issubclass(klass, BaseException):
            found.append(klass)
    return tuple(found)


def _transport_failure(exc: BaseException) -> bool:
    """A failure of an HTTP library to get an answer at all (its own transport error classes)."""
    names = {klass.__name__ for klass in type(exc).__mro__}
    return bool(names & (TRANSPORT_ERRORS | CONNECT_FAILURES)) and http_library(exc)


def _http_verdict(exc: BaseException) -> Verdict | None:
    if not http_library(exc):
        return None
    status = status_of(exc)
    if status is None:
        names = {klass.__name__ for klass in type(exc).__mro__}
        return Verdict(Kind.TRANSIENT, "http:transport") if names & TRANSPORT_ERRORS else None
    if status in TRANSIENT_STATUSES or 500 <= status <= 599:
        return Verdict(Kind.TRANSIENT, f"http:{status}", retry_after_of(exc))
    if 400 <= status <= 499:
        return Verdict(Kind.PERMANENT, f"http:{status}")
    return None


def retry_after_of(exc: BaseException) -> float | None:
    """Seconds asked for by a ``Retry-After`` header on the exception's response (seconds or HTTP date)."""
    explicit = getattr(exc, "retry_after", None)
    if isinstance(explicit, int | float) and not isinstance(explicit, bool):
        return max(0.0, float(explicit))
    headers = getattr(getattr(exc, "response", None), "headers", None) or getattr(exc, "headers", None)
    value = headers.get("Retry-After") if headers is not None and hasattr(headers, "get") else None
    return parse_retry_after(value) if isinstance(value, str) else None


def parse_retry_after(value: str, *, now: float | None = None) -> float | None:
    """``Retry-After: 7`` -> 7.0; ``Retry-After: Wed, 21 Oct 2015 07:28:00 GMT`` -> seconds until then."""
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
