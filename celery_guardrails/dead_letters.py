"""Dead letters: every final failure is recorded durably, with an owner, before its message is acked.

Sinks (``dead_letter_sinks``, in order, all of them must succeed):

* ``"django"``: the ``DeadLetter`` model of the Django app (the default when it is installed), browsable and
  replayable in the Django admin;
* ``"redis"`` (the store's Redis) or a Redis URL: an entry in the stream ``guardrails:dead_letters``
  (``XADD``, one JSON field ``record``), for deployments without Django.

Arguments are redacted first (:mod:`celery_guardrails.redaction`). Recording is idempotent per task id: a
message recorded and then delivered again (its worker died before the ack) does not make a second record.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from celery_guardrails.exceptions import StoreError
from celery_guardrails.options import app_value, resolve
from celery_guardrails.redaction import redact, redact_arguments
from celery_guardrails.stores import django_apps_installed, store_url

if TYPE_CHECKING:
    from celery_guardrails.outcomes import FinalFailure

logger = logging.getLogger(__name__)

STREAM = "guardrails:dead_letters"


def record_fields(task: Any, failure: FinalFailure) -> dict[str, Any]:
    """The record of ``failure`` as stored: redacted, JSON-ready."""
    keys = resolve(task, "redact_keys", {})
    args, kwargs, as_repr = redact_arguments(task.run, failure.args, failure.kwargs, keys)
    return {
        "task_name": failure.task_name,
        "task_id": failure.task_id,
        "queue": failure.queue or "",
        "routing_key": failure.queue or "",
        "args": args,
        "kwargs": kwargs,
        "arguments_are_repr": as_repr,
        "tenant": failure.tenant or "",
        "correlation_id": failure.correlation_id or "",
        "idempotency_key": failure.idempotency_key or "",
        "header": redact(failure.header, keys),
        "reason": failure.reason,
        "exc_type": failure.exc_type,
        "exc_message": failure.exc_message,
        "traceback": failure.traceback,
        "history": failure.history,
        "attempts": failure.attempts,
        "first_failed_at": failure.first_failed_at,
        "last_failed_at": failure.last_failed_at,
        "owner": failure.owner or "",
    }


class Sink(Protocol):
    def record(self, fields: dict[str, Any]) -> bool:
        """Store the record durably; True if new, False if this task id was recorded already."""


class DjangoSink:
    def record(self, fields: dict[str, Any]) -> bool:
        from django.db import DatabaseError

        from django_celery_guardrails.models import DeadLetter

        values = {**fields}
        for name in ("first_failed_at", "last_failed_at"):
            values[name] = datetime.fromisoformat(values[name])
        try:
            _, created = DeadLetter.objects.get_or_create(task_id=values.pop("task_id"), defaults=values)
        except DatabaseError as exc:
            raise StoreError(f"dead letter not recorded in the database: {exc}") from exc
        return bool(created)


class RedisStreamSink:
    def __init__(self, url: str) -> None:
        import redis

        self.url = url
        self.client = redis.Redis.from_url(url)

    def record(self, fields: dict[str, Any]) -> bool:
        import redis

        try:
            # One entry per task id: a marker set with NX decides whether this one is new.
            if not self.client.set(f"{STREAM}:seen:{fields['task_id']}", 1, nx=True, ex=30 * 24 * 3600):
                return False
            self.client.xadd(STREAM, {"record": json.dumps(fields, default=str)})
        except redis.RedisError as exc:
            raise StoreError(f"dead letter not recorded in Redis at {self.url}: {exc}") from exc
        return True


def sinks_for(app: Any) -> list[Sink]:
    names = app_value(app, "dead_letter_sinks")
    if names is None:
        names = ["django"] if django_apps_installed() else ["redis"]
    sinks: list[Sink] = []
    for name in names:
        if name == "django":
            sinks.append(DjangoSink())
        else:
            sinks.append(RedisStreamSink(store_url(app) if name == "redis" else name))
    return sinks


def record(task: Any, failure: FinalFailure) -> bool:
    """Record ``failure`` in every sink; raises StoreError when one cannot; True when it was new."""
    fields = record_fields(task, failure)
    new = [sink.record(fields) for sink in sinks_for(task.app)]
    return any(new)
