"""What a failure says about the wire: whether the request ever left (:func:`sent_nothing`), and the HTTP
status it carries. Read by error classification (:mod:`celery_guardrails.runtime.classification`) and by the
effect marks (:mod:`celery_guardrails.runtime.effects`), which must not import each other's rules: this module
imports nothing of the project.
"""

from __future__ import annotations

import errno
import socket

#: Statuses worth retrying: request timeout, too early, too many requests (and every 5xx).
TRANSIENT_STATUSES = frozenset({408, 425, 429})
#: Statuses that say the server did not act on the request (so any task may send it again).
UNPROCESSED_STATUSES = TRANSIENT_STATUSES
#: Failures of the HTTP libraries (HTTP_LIBRARIES) to connect at all: nothing was sent.
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
#: HTTP client libraries whose exceptions are read by name.
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
        if http_library(error) and (
            {klass.__name__ for klass in type(error).__mro__} & CONNECT_FAILURES
            or status_of(error) in UNPROCESSED_STATUSES
        ):
            return True
        wrapped = (error.__cause__, error.__context__, getattr(error, "reason", None), *error.args)
        pending.extend(item for item in wrapped if isinstance(item, BaseException))
    return False


def http_library(exc: BaseException) -> bool:
    return any(klass.__module__.partition(".")[0] in HTTP_LIBRARIES for klass in type(exc).__mro__)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (requests/httpx ``response.status_code``, urllib3 ``status``,
    urllib ``code``)."""
    response = getattr(exc, "response", None)
    for holder, attribute in ((response, "status_code"), (response, "status"), (exc, "status"), (exc, "code")):
        value = getattr(holder, attribute, None) if holder is not None else None
        if isinstance(value, int):
            return value
    return None
