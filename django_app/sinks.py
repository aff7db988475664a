"""The ``"django"`` dead-letter sink: the ``DeadLetter`` table, with its sealed copy in the same transaction.

Registered with the core when the app is ready (:func:`celery_guardrails.runtime.dead_letters.register_sink`):
the core records, counts, finds and replays dead letters through its ``Sink`` protocol, without importing this app.
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from django.db import DatabaseError, transaction
from django.db.models import Count

from celery_guardrails.exceptions import StoreError, StoreUnavailableError
from celery_guardrails.runtime.dead_letters import OpenCounts, minimal
from celery_guardrails.stores.database import failure

from .models import DeadLetter, SealedMessage

logger = logging.getLogger(__name__)


class DjangoSink:
    """Dead letters in the ``DeadLetter`` table (see the module docstring)."""

    def record(self, fields: dict[str, Any]) -> bool:
        try:
            return self._write(fields)
        except StoreUnavailableError:
            raise
        except Exception as refused:
            # Refused as data (a StoreError), or a value the driver could not even adapt (a RecursionError in its
            # JSON encoding): keep what can be kept, never retry it for ever.
            logger.error("Dead letter of %s refused by the database (%r); recording it cut", fields["task_id"], refused)
            return self._write(minimal(fields, refused))

    @staticmethod
    def _write(fields: dict[str, Any]) -> bool:
        values = {**fields}
        sealed = values.pop("sealed", "")
        for name in ("first_failed_at", "last_failed_at"):
            values[name] = _moment(values.get(name))
        for column in DeadLetter._meta.concrete_fields:  # a value longer than its column is cut, not refused
            value = values.get(column.name)
            if isinstance(value, str) and column.max_length and len(value) > column.max_length:
                values[column.name] = value[: column.max_length]
        try:
            with transaction.atomic():  # a refused INSERT leaves the caller's transaction usable
                record, created = DeadLetter.objects.get_or_create(task_id=values.pop("task_id"), defaults=values)
                if created and sealed:  # in the record's transaction: a record never misses its sealed copy
                    SealedMessage.objects.create(dead_letter=record, token=sealed)
        except DatabaseError as exc:
            raise failure("record a dead letter", exc) from exc
        except (TypeError, ValueError) as exc:  # a value the JSON columns cannot take: refused as data
            raise StoreError(f"dead letter not recorded: {exc}") from exc
        return bool(created)

    def find(self, task_id: str) -> dict[str, Any] | None:
        found = DeadLetter.objects.filter(task_id=task_id).values().first()
        return dict(found) if found is not None else None

    def open_counts(self, *, limit: int) -> OpenCounts:
        # One grouped query: every open record counts, whatever the limit (a limit is for sinks read entry by entry).
        rows = DeadLetter.objects.open().order_by().values("owner", "task_name").annotate(n=Count("pk"))
        return OpenCounts(counts=Counter({(row["owner"] or "", row["task_name"]): row["n"] for row in rows}))

    def replay(self, task_ids: list[str], *, reason: str, app: Any) -> dict[str, str]:
        from .replay import replay_dead_letters

        records = DeadLetter.objects.filter(task_id__in=task_ids, reason=reason)
        if not records.exists():
            return {}
        replay_dead_letters(records, app=app)
        replays = DeadLetter.objects.filter(task_id__in=task_ids).exclude(replayed_task_id="")
        return dict(replays.values_list("task_id", "replayed_task_id"))


def _moment(value: Any) -> datetime:
    """A record's time, read back from ISO 8601; now when it is missing or unreadable (a pending dead letter
    carried in a header needs only its task, id, reason and exception: see headers.PENDING_REQUIRED)."""
    try:
        return datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return datetime.now(UTC)
