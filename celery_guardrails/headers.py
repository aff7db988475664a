"""The message headers celery-guardrails adds: the whole contract, in one place.

Everything the extension puts on a message travels under ONE message header, ``guardrails``, whose value
is a flat mapping (an AMQP table on RabbitMQ, a JSON object on Redis)::

    headers["guardrails"] = {
        "v": 1,                 # schema version of this mapping (VERSION)
        "tenant": "acme",       # tenant id; absent when the message has no tenant
        "cid": "9f1c0c6e...",   # correlation id; every message gets one at publish
        "opts": {...},          # per-call guardrail options given to apply_async (JSON values only)
    }

Version history:

* ``1`` (0.1): ``tenant``, ``cid``, ``opts``.

Compatibility rules:

* A message without the header (published by plain Celery, another service or an older release) is handled
  as "no tenant, no per-call options"; the worker gives it a fresh correlation id.
* A malformed field (wrong type, over-long, bad characters) is logged with the task id and treated as
  missing; it never crashes the worker.
* Fields this release does not know (from a newer release) are kept as they are when the message is
  re-published (retry), so a rolling deployment does not strip them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery_guardrails.context import validate_correlation_id, validate_tenant
from celery_guardrails.exceptions import ContextError

logger = logging.getLogger(__name__)

#: Name of the one message header the extension owns.
HEADER = "guardrails"
#: Schema version written by this release.
VERSION = 1

VERSION_FIELD = "v"
TENANT = "tenant"
CORRELATION_ID = "cid"
OPTIONS = "opts"


def from_message_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The guardrails mapping found in raw message headers (a copy; empty when absent)."""
    value = (headers or {}).get(HEADER)
    return dict(value) if isinstance(value, Mapping) else {}


def from_request(request: Any) -> dict[str, Any]:
    """The guardrails mapping of the message a task request came from, sanitised.

    Celery copies custom message headers onto the request as attributes (worker) or keeps them under
    ``request.headers`` (eager ``apply``); both are looked at. Malformed fields are dropped with a warning.
    """
    raw = getattr(request, HEADER, None)
    if raw is None:
        raw = (getattr(request, "headers", None) or {}).get(HEADER)
    task_id = getattr(request, "id", None)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        logger.warning("Task %s: header %r is a %s, not a mapping; ignored", task_id, HEADER, type(raw).__name__)
        return {}
    return sanitise(raw, task_id=task_id)


def sanitise(raw: Mapping[str, Any], *, task_id: str | None = None) -> dict[str, Any]:
    """Copy of ``raw`` with every known field checked; a bad one is logged and dropped."""
    clean = dict(raw)
    for field, check in ((TENANT, validate_tenant), (CORRELATION_ID, validate_correlation_id)):
        if field in clean:
            try:
                check(clean[field])
            except ContextError as exc:
                logger.warning(
                    "Task %s: malformed %r in header %r, treated as missing: %s", task_id, field, HEADER, exc
                )
                del clean[field]
    if OPTIONS in clean and not isinstance(clean[OPTIONS], Mapping):
        logger.warning("Task %s: malformed %r in header %r, treated as missing", task_id, OPTIONS, HEADER)
        del clean[OPTIONS]
    return clean


def call_options(header: Mapping[str, Any]) -> Mapping[str, Any]:
    """The per-call guardrail options stored in a guardrails mapping."""
    opts = header.get(OPTIONS)
    return opts if isinstance(opts, Mapping) else {}
