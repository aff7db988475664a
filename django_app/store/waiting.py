"""Waiting messages in the Django database (the waiting half of the Django store, mixed in; see
:mod:`celery_guardrails.guardrails.waiting`).

One row per task id (:class:`~django_celery_guardrails.models.WaitingMessage`). A note is one
``INSERT ... ON CONFLICT UPDATE`` (no lock, no read first: concurrent notes of one task id end as the last one);
the next delivery's start deletes the row; expired rows (a lost message's) are deleted by the read. It mirrors
``celery_guardrails/stores/redis_waiting.py``.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Count

from celery_guardrails.stores.base import Wait, Waits

from ..models import WaitingMessage
from .database import to_datetime, translated

#: The fields of a Wait its row keeps as they are (the task id first: the row's key), and its times.
_WAIT_COPIED = ("task_id", "task_name", "tenant", "queue", "reason", "detail", "attempt")
_WAIT_TIMES = ("due_at", "since", "expires_at")


class DjangoWaiting:
    """The waiting operations of :class:`~django_celery_guardrails.store.DjangoStore` (mixed in)."""

    @translated("keep a waiting message")
    def wait_note(self, wait: Wait) -> None:
        values = {name: getattr(wait, name) for name in _WAIT_COPIED}
        row = WaitingMessage(
            **values, due_at=to_datetime(wait.due), since=to_datetime(wait.since), expires_at=to_datetime(wait.expires)
        )
        with transaction.atomic():  # a savepoint inside a caller's transaction: a failed write leaves it usable
            WaitingMessage.objects.bulk_create(
                [row], update_conflicts=True, unique_fields=["task_id"], update_fields=[*_WAIT_COPIED[1:], *_WAIT_TIMES]
            )

    @translated("forget a waiting message")
    def wait_done(self, task_id: str) -> None:
        WaitingMessage.objects.filter(task_id=task_id).delete()

    @translated("read the waiting messages")
    def waiting(self, *, now: float, limit: int, tenants: frozenset[str] | None = None) -> Waits:
        WaitingMessage.objects.filter(expires_at__lte=to_datetime(now)).delete()
        rows = WaitingMessage.objects.all()
        if tenants is not None:
            rows = rows.filter(tenant__in=sorted(tenants))
        by_reason = {row["reason"]: row["n"] for row in rows.order_by().values("reason").annotate(n=Count("pk"))}
        soonest = tuple(
            Wait(
                **{name: row[name] for name in _WAIT_COPIED},
                due=row["due_at"].timestamp(),
                since=row["since"].timestamp(),
                expires=row["expires_at"].timestamp(),
            )
            for row in rows.order_by("due_at", "task_id").values(*_WAIT_COPIED, *_WAIT_TIMES)[:limit]
        )
        return Waits(count=sum(by_reason.values()), by_reason=by_reason, soonest=soonest)
