"""Replay dead letters: one function for the admin, the ``guardrails_replay`` command and Python callers.

``replay_dead_letters(queryset_or_ids, user=None)`` re-publishes each open record's task with its original
arguments, tenant, correlation id, per-call options and idempotency key (a failed key is reopened
deliberately), a fresh attempt count, and links the new task id to the record (status ``replayed``).

Safe to run twice: each record moves from ``open`` to ``replayed`` by a conditional UPDATE before anything
is published, so two concurrent replays of one record publish once. A record is left open, with the reason
in the result, when its task is no longer registered, its arguments were not stored as JSON, or secrets were
redacted from them (the task would run with placeholders). Without the ``guardrails.replay_deadletter``
permission, a given ``user`` gets :class:`~django.core.exceptions.PermissionDenied`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from celery import current_app
from celery.utils import uuid
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.utils import timezone

from celery_guardrails import headers
from celery_guardrails.redaction import REDACTED
from celery_guardrails.stores import get_store

from .models import DeadLetter

logger = logging.getLogger(__name__)

PERMISSION = "guardrails.replay_deadletter"
#: Header fields a replay starts afresh: attempt and wait counters, history, what an earlier delivery held.
FRESH = (
    headers.ATTEMPT,
    headers.LATER,
    headers.DEFERRED,
    headers.OUTAGES,
    headers.BUSY,
    headers.GAVE_UP,
    headers.HISTORY,
    headers.HISTORY_TOTAL,
    headers.PENDING_DEAD_LETTER,
    headers.PENDING_TRIES,
)
#: Tries at putting a record back to open when its replay could not be published (a second apart).
PUT_BACK_TRIES = 3


@dataclass
class ReplayResult:
    replayed: list[tuple[int, str]] = field(default_factory=list)  # (record id, new task id)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (record id, why it was left alone)


def replay_dead_letters(
    queryset_or_ids: QuerySet[DeadLetter] | Iterable[int], *, user: Any = None, app: Any = None
) -> ReplayResult:
    if user is not None and not user.has_perm(PERMISSION):
        raise PermissionDenied(f"{user} may not replay dead letters (needs {PERMISSION})")
    app = app or current_app
    records = (
        queryset_or_ids
        if isinstance(queryset_or_ids, QuerySet)
        else DeadLetter.objects.filter(pk__in=list(queryset_or_ids))
    )
    result = ReplayResult()
    for record in records.order_by("pk"):
        why = _why_not(record, app)
        if why:
            result.skipped.append((record.pk, why))
            continue
        task_id = uuid()
        won = DeadLetter.objects.filter(pk=record.pk, status=DeadLetter.Status.OPEN).update(
            status=DeadLetter.Status.REPLAYED,
            replayed_task_id=task_id,
            handled_by=getattr(user, "username", "") or "",
            handled_at=timezone.now(),
        )
        if not won:
            result.skipped.append((record.pk, "already handled by someone else"))
            continue
        try:
            _publish(record, task_id, app)
        except Exception as exc:  # put it back: a record must never be marked replayed for nothing
            logger.exception("Replay of dead letter %s (%s) failed", record.pk, record.task_name)
            _put_back(record.pk, task_id)
            result.skipped.append((record.pk, f"publishing failed: {exc}"))
            continue
        logger.info(
            "Dead letter %s (%s[%s]) replayed as %s by %s",
            record.pk,
            record.task_name,
            record.task_id,
            task_id,
            getattr(user, "username", None) or "-",
        )
        result.replayed.append((record.pk, task_id))
    return result


def _put_back(pk: int, task_id: str) -> None:
    """Open a record whose replay was not published again. The database may be what failed: a few tries,
    then an error that names the record and the task id it claims, for someone to reopen it by hand."""
    from django.db import DatabaseError, close_old_connections

    for attempt in range(1, PUT_BACK_TRIES + 1):
        try:
            DeadLetter.objects.filter(pk=pk, replayed_task_id=task_id).update(
                status=DeadLetter.Status.OPEN, replayed_task_id="", handled_by="", handled_at=None
            )
            return
        except DatabaseError:
            close_old_connections()
            if attempt < PUT_BACK_TRIES:
                time.sleep(1.0)
    logger.error(
        "Dead letter %s says it was replayed as %s, but nothing was published: reopen it (the database could "
        "not be reached to put it back)",
        pk,
        task_id,
    )


def _why_not(record: DeadLetter, app: Any) -> str:
    if record.status != DeadLetter.Status.OPEN:
        return f"status is {record.status}"
    if record.task_name not in app.tasks:
        return f"task {record.task_name!r} is no longer registered; the record stays open"
    if record.arguments_are_repr:
        return "its arguments were not stored as JSON"
    if REDACTED in json.dumps([record.args, record.kwargs]):
        return "secrets were redacted from its arguments; replaying would run it with placeholders"
    return ""


def _publish(record: DeadLetter, task_id: str, app: Any) -> None:
    header = {k: v for k, v in (record.header or {}).items() if k not in FRESH}
    if record.idempotency_key:
        # The key failed with the message: reopen it deliberately, or the replay would be skipped.
        get_store(app).reopen(record.idempotency_key)
    app.tasks[record.task_name].apply_async(
        args=record.args, kwargs=record.kwargs, task_id=task_id, headers={headers.HEADER: header}
    )
