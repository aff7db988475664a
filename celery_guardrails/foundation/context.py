"""Tenant and correlation context.

Two context variables hold the tenant and the correlation id of the work in progress: a web request (set by
the Django middleware), a block of code (``tenant_context`` / ``correlation_context``) or a task on a worker
(restored from the message before the task body and before any guardrail reads a store, cleared afterwards).
Every message published while they are set carries them (see :mod:`celery_guardrails.runtime.headers`).

Context variables are per thread and per asyncio task, so the solo, prefork and threads pools each see only
the task they are running.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

from celery_guardrails.exceptions import ContextError
from celery_guardrails.options import APP, Option, checks, declare

#: Longest tenant id accepted, in characters.
TENANT_MAX_LENGTH = 128
#: Longest correlation id accepted, in characters (X-Request-ID values from proxies fit easily).
CORRELATION_ID_MAX_LENGTH = 128

# Word characters plus a few separators used by real tenant ids (slugs, "org:42", e-mail-like ids).
_TENANT_RE = re.compile(r"[\w.:@+-]+")
# What request-id generators emit: UUIDs, hex, base64/base64url, dotted or colon-separated ids.
_CORRELATION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+/=-]*")

_tenant: ContextVar[str | None] = ContextVar("celery_guardrails.tenant", default=None)
_correlation_id: ContextVar[str | None] = ContextVar("celery_guardrails.correlation_id", default=None)


#: A header name is an RFC 9110 token.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _header_names(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple) else None
    if items is None or not all(isinstance(v, str) and _TOKEN.fullmatch(v) for v in items):
        raise ValueError(f"must be a list of HTTP header names, got {value!r:.80}")
    return tuple(items)


def _admin_tenants(value: Any) -> Any:
    if value is None or value == "permissions" or callable(value) or (isinstance(value, str) and "." in value):
        return value
    raise ValueError(
        "must be a callable from a user to the tenants they may see, a dotted path 'package.module.name' to one, "
        f"or 'permissions' (a Django permission per tenant), got {value!r:.80}"
    )


#: The options the Django app reads to find and scope a request's context, declared into the one schema
#: (celery_guardrails.options) here, in the core, so that a worker validating CELERY_GUARDRAILS knows them without
#: importing Django.
DECLARED = declare(
    Option(
        name="tenant_resolver",
        default=None,
        doc="Django: callable (or dotted path) taking the HttpRequest and returning its tenant id or None.",
        check=checks.callable_or_path,
        scopes=frozenset({APP}),
    ),
    Option(
        name="request_id_headers",
        default=("X-Request-ID", "X-Correlation-ID"),
        doc="Django: request headers read, in order, for the correlation id of a request.",
        check=_header_names,
        scopes=frozenset({APP}),
    ),
    Option(
        name="admin_tenants",
        default=None,
        doc="Django admin: which dead letters, ledger records and figures a user sees. A callable (or dotted "
        "path) user -> iterable of tenant ids, or ALL_TENANTS (django_celery_guardrails.scoping); or "
        "'permissions': a permission guardrails.view_tenant_<tenant> per tenant, guardrails.view_all_tenants "
        "for every one. A user the callable fails for sees nothing. None: every user sees every tenant.",
        check=_admin_tenants,
        scopes=frozenset({APP}),
    ),
)


def validate_tenant(value: object) -> str:
    """Return ``value`` if it can travel as a tenant id, else raise :class:`ContextError`."""
    if not isinstance(value, str):
        raise ContextError(f"tenant id must be a str, got {type(value).__name__} {value!r:.80}")
    if not 0 < len(value) <= TENANT_MAX_LENGTH:
        raise ContextError(f"tenant id must be 1 to {TENANT_MAX_LENGTH} characters, got {len(value)}")
    if not _TENANT_RE.fullmatch(value):
        raise ContextError(f"tenant id {value!r:.80} may hold only letters, digits and . : @ + - _")
    return value


def validate_correlation_id(value: object) -> str:
    """Return ``value`` if it can travel as a correlation id, else raise :class:`ContextError`."""
    if not isinstance(value, str):
        raise ContextError(f"correlation id must be a str, got {type(value).__name__} {value!r:.80}")
    if not 0 < len(value) <= CORRELATION_ID_MAX_LENGTH:
        raise ContextError(f"correlation id must be 1 to {CORRELATION_ID_MAX_LENGTH} characters, got {len(value)}")
    if not _CORRELATION_RE.fullmatch(value):
        raise ContextError(f"correlation id {value!r:.80} may hold only ASCII letters, digits and . _ : + / = -")
    return value


def new_correlation_id() -> str:
    """Make a fresh correlation id (32 hex digits)."""
    return uuid.uuid4().hex


def current_tenant() -> str | None:
    """The tenant of the work in progress, or ``None``."""
    return _tenant.get()


def current_correlation_id() -> str | None:
    """The correlation id of the work in progress, or ``None`` outside any context."""
    return _correlation_id.get()


@contextmanager
def tenant_context(tenant_id: str | None) -> Iterator[str | None]:
    """Run the block, and every task it publishes, as ``tenant_id``.

    ``tenant_context(None)`` runs the block explicitly without a tenant: a task published from inside another
    tenant's task then carries no tenant instead of inheriting it.
    """
    if tenant_id is not None:
        validate_tenant(tenant_id)
    token = _tenant.set(tenant_id)
    try:
        yield tenant_id
    finally:
        _tenant.reset(token)


@contextmanager
def correlation_context(correlation_id: str | None = None) -> Iterator[str]:
    """Run the block under ``correlation_id`` (a new id when none is given) and yield the id."""
    cid = new_correlation_id() if correlation_id is None else validate_correlation_id(correlation_id)
    token = _correlation_id.set(cid)
    try:
        yield cid
    finally:
        _correlation_id.reset(token)


@dataclass(frozen=True, slots=True)
class Activation:
    """What :func:`activate` changed, for :func:`deactivate` to undo."""

    tenant: Token[str | None]
    correlation_id: Token[str | None]


def activate(*, tenant: str | None, correlation_id: str | None) -> Activation:
    """Set both variables at once (the worker does this from a message); values are trusted as given."""
    return Activation(_tenant.set(tenant), _correlation_id.set(correlation_id))


def deactivate(activation: Activation) -> None:
    """Undo :func:`activate`, so nothing of one task's context is left for the next."""
    _correlation_id.reset(activation.correlation_id)
    _tenant.reset(activation.tenant)
