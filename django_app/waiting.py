"""The admin's "Waiting" page: messages the guardrails re-published with a countdown, until they run again
(retries waiting for their countdown, deliveries deferred by a retry budget or circuit, waiting for a concurrency
slot, an ordering turn, a busy key, a store outage; see :mod:`celery_guardrails.guardrails.waiting`).

Read from the configured store (the Django store's table, or Redis), the soonest due first, with the counts per
reason on top. Shown to those who may view dead letters; a scoped user (``admin_tenants``) sees the waits of the
tenants they may see, counts included (see :mod:`django_celery_guardrails.scoping`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from celery_guardrails.foundation.redaction import exception_text, for_app
from celery_guardrails.guardrails import waiting
from celery_guardrails.operations import status

from . import health
from .scoping import ALL_TENANTS, visible_tenants

#: Rows the page lists at most (the soonest due); the counts cover every wait.
SHOWN = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One waiting message as the page shows it."""

    wait: status.WaitingMessage
    due_iso: str
    since_iso: str
    since_text: str


def waiting_context(user: Any) -> dict[str, Any]:
    """The page's context: ``waiting`` (a :class:`celery_guardrails.operations.status.Waiting`, None when it could not
    be
    read), ``rows`` and ``error`` (why it could not be read)."""
    app = health.celery_app()
    now = time.time()
    visible = visible_tenants(user)
    tenants = None if visible is ALL_TENANTS else frozenset(visible)
    found: status.Waiting | None = None
    error = ""
    try:
        found = status.read_waiting(app, now=now, tenants=tenants, limit=SHOWN)
    except Exception as exc:  # the store is down: the page says so instead of a 500
        error = for_app(app).text(f"{type(exc).__name__}: {exception_text(exc)}", keep=300)
    rows = [
        Row(
            wait=wait,
            due_iso=waiting.iso(wait.due),
            since_iso=waiting.iso(wait.since),
            since_text=f"{waiting.in_words(now - wait.since)} ago",
        )
        for wait in (found.soonest if found else [])
    ]
    return {
        "waiting": found,
        "rows": rows,
        "error": error,
        "overdue_minutes": round(waiting.OVERDUE_AFTER / 60),
    }
