"""Error classification: is a failure worth another attempt?

:func:`classify` applies these rules, in order, and the first that matches decides:

1. Celery's own control flow (``Retry``, ``Ignore``, ``Reject``) passes through untouched.
2. ``RetryLater`` -> retry later (no attempt consumed); ``TransientError`` -> transient;
   ``PermanentError`` -> permanent.
3. The task's ``permanent_errors``, then its ``transient_errors`` (``isinstance``).
4. HTTP errors of requests, httpx, urllib3 or the standard library's urllib, by status: 408, 425, 429 and
   5xx are transient, any other 4xx is permanent; their transport errors (timeouts, refused connections)
   are transient. The libraries are recognised by the exception's module, never imported here.
5. ``error_patterns``: regular expressions matched against ``str(exc)``, for errors that crossed an RPC
   boundary as plain text (a remote "404 Not Found" must still be recognised).
6. ``unknown_errors``: ``"auto"`` (default) makes an unknown error transient for an idempotent task
   (``idempotent=True`` or an ``idempotency_key``) or one marked ``retry_unsafe=True``, and permanent, never
   retried, for any other task.

Then one gate, **retry safety by construction**: a transient verdict for a task that is neither idempotent
(``idempotent=True`` or an ``idempotency_key``) nor ``retry_unsafe=True`` stands only when the failure proves
the request never reached the dependency (:func:`sent_nothing`: connection refused, a name that does not
resolve, an unreachable network, a connect timeout, HTTP 408, 425 or 429) or when the task's own code raised
``TransientError`` (its author's word). Anything ambiguous (a read timeout, a reset after sending, a 5xx, an
error a pattern or ``transient_errors`` calls transient) becomes permanent with a rule ending in
``:not_idempotent``: the dependency may have acted on it, and running a task that is not idempotent again
could act twice (charge a card twice).
"""

from __future__ import annotations

import enum
import errno
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from celery.exceptions import Ignore, Reject, Retry

from celery_guardrails.exceptions import PermanentError, RetryLater, TransientError
from celery_guardrails.options import resolve, task_attribute

#: Statuses worth retrying: request timeout, too early, too many requests (and every 5xx).
TRANSIENT_STATUSES = frozenset({408, 425, 429})
#: Statuses that say the server did not act on the request (so any task may send it again).
UNPROCESSED_STATUSES = TRANSIENT_STATUSES
#: Failures of those libraries to connect at all: nothing was sent.
CONNECT_FAILURES = frozenset(
    {
        "ConnectTimeout",  # requests, httpx
        "ConnectError",  # httpx (refused, DNS, TLS handshake)
        "NewConnectionError",
        "NameResolutionError",
        "ConnectTimeoutError",  # urllib3
    }
)
#: Socket errors of a connection that was never made.
CONNECT_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH})
#: Rules that are the task author's own word that trying again is safe.
OWN_WORD = frozenset({"TransientError"})
HTTP_LIBRARIES = frozenset({"requests", "httpx", "urllib3", "urllib"})
# Transport-level failures of those libraries (no response at all): always worth another try.
TRANSPORT_ERRORS = frozenset(
    {
        "ConnectionError",
        "Timeout",
        "ConnectTimeout",
        "ReadTimeout",  # requests
        "TransportError",
        "TimeoutException",
        "NetworkError",
        "RemoteProtocolError",  # httpx
        "ProtocolError",
        "NewConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "MaxRetryError",  # urllib3
        "URLError",  # urllib (an HTTPError, which carries a status, is classified by it first)
    }
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


def classify(exc: BaseException, task: Any, call: Mapping[str, Any]) -> Verdict:
    """Classify ``exc`` raised by ``task`` (per-call options ``call``): the rules, then the safety gate."""
    verdict = _rules(exc, task, call)
    if verdict.kind is not Kind.TRANSIENT or verdict.rule in OWN_WORD or retry_is_safe(task, call):
        return verdict
    if sent_nothing(exc):
        return verdict
    return Verdict(Kind.PERMANENT, f"{verdict.rule}:not_idempotent")


def _rules(exc: BaseException, task: Any, call: Mapping[str, Any]) -> Verdict:
    if isinstance(exc, Retry | Ignore | Reject):
        return Verdict(Kind.CONTROL, "celery")
    if isinstance(exc, RetryLater):
        return Verdict(Kind.RETRY_LATER, "RetryLater", exc.delay)
    if isinstance(exc, TransientError):
        return Verdict(Kind.TRANSIENT, "TransientError", exc.retry_after)
    if isinstance(exc, PermanentError):
        return Verdict(Kind.PERMANENT, "PermanentError")
    if isinstance(exc, resolve(task, "permanent_errors", call)):
        return Verdict(Kind.PERMANENT, "permanent_errors")
    if isinstance(exc, resolve(task, "transient_errors", call)):
        return Verdict(Kind.TRANSIENT, "transient_errors", retry_after_of(exc))
    http = _http_verdict(exc)
    if http is not None:
        return http
    message = str(exc)
    for pattern, kind in resolve(task, "error_patterns", call):
        if pattern.search(message):
            return Verdict(Kind(kind), f"error_patterns:{pattern.pattern}")
    unknown = resolve(task, "unknown_errors", call)
    if unknown == "auto":
        if is_idempotent(task, call):
            return Verdict(Kind.TRANSIENT, "unknown_errors:auto:idempotent")
        if resolve(task, "retry_unsafe", call):
            return Verdict(Kind.TRANSIENT, "unknown_errors:auto:retry_unsafe")
        return Verdict(Kind.PERMANENT, "unknown_errors:auto:not_idempotent")
    return Verdict(Kind(unknown), f"unknown_errors:{unknown}")


def is_idempotent(task: Any, call: Mapping[str, Any]) -> bool:
    """Declared idempotent, or given an idempotency key (which makes a second run change nothing)."""
    return bool(resolve(task, "idempotent", call) or task_attribute(task, "idempotency_key"))


def retry_is_safe(task: Any, call: Mapping[str, Any]) -> bool:
    """Idempotent, or ``retry_unsafe=True`` (the author accepts that an ambiguous failure runs it again)."""
    return is_idempotent(task, call) or bool(resolve(task, "retry_unsafe", call))


def sent_nothing(exc: BaseException) -> bool:
    """Whether the failure proves the request never reached the dependency.

    Looks through the exception and what it wraps (``__cause__``, ``__context__``, ``reason``, exception
    arguments: requests wraps urllib3, urllib wraps the socket error): a refused connection, a name that
    does not resolve, an unreachable network, an HTTP library's connect failure or connect timeout, or a
    status saying the request was not processed (408, 425, 429).
    """
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending and len(seen) < 32:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, ConnectionRefusedError | socket.gaierror):
            return True
        if isinstance(error, OSError) and error.errno in CONNECT_ERRNOS:
            return True
        if _http_library(error) and (
            {klass.__name__ for klass in type(error).__mro__} & CONNECT_FAILURES
            or status_of(error) in UNPROCESSED_STATUSES
        ):
            return True
        wrapped = (error.__cause__, error.__context__, getattr(error, "reason", None), *error.args)
        pending.extend(item for item in wrapped if isinstance(item, BaseException))
    return False


def _http_library(exc: BaseException) -> bool:
    return any(klass.__module__.partition(".")[0] in HTTP_LIBRARIES for klass in type(exc).__mro__)


def _http_verdict(exc: BaseException) -> Verdict | None:
    if not _http_library(exc):
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


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (requests/httpx ``response.status_code``, urllib3 ``status``,
    urllib ``code``)."""
    response = getattr(exc, "response", None)
    for holder, attribute in ((response, "status_code"), (response, "status"), (exc, "status"), (exc, "code")):
        value = getattr(holder, attribute, None) if holder is not None else None
        if isinstance(value, int):
            return value
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
