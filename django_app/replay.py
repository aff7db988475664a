"""Replay dead letters: one function for the admin, the ``guardrails_replay`` command and Python callers.

``replay_dead_letters(queryset_or_ids, *, user=None, tenant=None)`` re-publishes each open record's task with
its original arguments, tenant, correlation id, per-call options and idempotency key (a failed key is reopened
deliberately), a fresh attempt count, and links the new task id to the record (status ``replayed``).
``replay_with_changes(pk, *, user=None, tenant=None, args=None, kwargs=None)`` replays one record with a fix
(the admin's "edit and replay"). Arguments come from the record's sealed copy when it has one
(:mod:`celery_guardrails.sealing`): a record whose secrets were redacted for display replays with the real
values. :func:`plan` says, without publishing, what a replay would do (the command's ``--dry-run``).

Safe to run twice: each record moves from ``open`` to ``replayed`` by a conditional UPDATE before anything
is published, so two concurrent replays of one record publish once. A record is left open, with the reason
in the result, when its task is no longer registered, its sealed copy cannot be opened with the configured
keys, or its arguments were not stored as JSON or had secrets redacted and no sealed copy holds them.
Without the ``guardrails.replay_deadletter`` permission, a given ``user`` gets
:class:`~django.core.exceptions.PermissionDenied`.
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
from celery_guardrails.context import validate_tenant
from celery_guardrails.exceptions import ContextError, SealError
from celery_guardrails.redaction import REDACTED
from celery_guardrails.sealing import restore_redacted, sealer_for
from celery_guardrails.stores import get_store

from .models import DeadLetter, SealedMessage

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


@dataclass(frozen=True)
class Message:
    """What a replay publishes for one record."""

    args: list[Any]
    kwargs: dict[str, Any]
    header: dict[str, Any]


class Refused(Exception):
    """A record that cannot be replayed as asked; the message says why, for the operator."""


def replay_dead_letters(
    queryset_or_ids: QuerySet[DeadLetter] | Iterable[int],
    *,
    user: Any = None,
    tenant: str | None = None,
    app: Any = None,
) -> ReplayResult:
    """Replay each open record; ``tenant`` gives every one of them that tenant (e.g. ``missing_tenant`` ones)."""
    _check_permission(user)
    app = app or current_app
    records = (
        queryset_or_ids
        if isinstance(queryset_or_ids, QuerySet)
        else DeadLetter.objects.filter(pk__in=list(queryset_or_ids))
    )
    result = ReplayResult()
    for record in records.order_by("pk"):
        _replay_one(record, app, user, result, tenant=tenant)
    return result


def replay_with_changes(
    pk: int,
    *,
    user: Any = None,
    tenant: str | None = None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    app: Any = None,
) -> ReplayResult:
    """Replay one record with a fix: another tenant, other arguments. Arguments are edited as the record shows
    them: a value left as the redaction placeholder is replayed with the original from the sealed copy. When
    the arguments change, the idempotency key is made again from the new ones."""
    _check_permission(user)
    app = app or current_app
    result = ReplayResult()
    for record in DeadLetter.objects.filter(pk=pk):
        _replay_one(record, app, user, result, tenant=tenant, args=args, kwargs=kwargs)
    if not result.replayed and not result.skipped:
        result.skipped.append((pk, "no such dead letter"))
    return result


def plan(
    record: DeadLetter,
    *,
    tenant: str | None = None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    app: Any = None,
) -> Message:
    """What replaying ``record`` would publish, or :class:`Refused` saying why it cannot be replayed (a dry run
    and the real run ask this same question)."""
    app = app or current_app
    if record.status != DeadLetter.Status.OPEN:
        raise Refused(f"status is {record.status}")
    if record.task_name not in app.tasks:
        raise Refused(f"task {record.task_name!r} is no longer registered; the record stays open")
    original = _unsealed(record, app)
    base_args, base_kwargs = (original["args"], original["kwargs"]) if original else (record.args, record.kwargs)
    header = dict(original["header"] if original else (record.header or {}))
    if original is None and record.arguments_are_repr and (args is None or kwargs is None):
        raise Refused("its arguments were not stored as JSON and no sealed copy holds them")
    new_args = base_args if args is None else restore_redacted(list(args), base_args, REDACTED)
    new_kwargs = base_kwargs if kwargs is None else restore_redacted(dict(kwargs), base_kwargs, REDACTED)
    if REDACTED in json.dumps([new_args, new_kwargs], default=str):
        raise Refused(
            "secrets were redacted from its arguments and no sealed copy holds them (set seal_keys); replaying "
            "would run it with placeholders"
        )
    header = {k: v for k, v in header.items() if k not in FRESH}
    if (new_args, new_kwargs) != (base_args, base_kwargs):
        header.pop(headers.IDEMPOTENCY_KEY, None)  # made again from the new arguments when published
    if tenant is not None:
        try:
            header[headers.TENANT] = validate_tenant(tenant)
        except ContextError as exc:
            raise Refused(str(exc)) from None
    return Message(args=list(new_args), kwargs=dict(new_kwargs), header=header)


def _check_permission(user: Any) -> None:
    if user is not None and not user.has_perm(PERMISSION):
        raise PermissionDenied(f"{user} may not replay dead letters (needs {PERMISSION})")


def _unsealed(record: DeadLetter, app: Any) -> dict[str, Any] | None:
    """The record's sealed original, None when it has none; Refused when it has one nobody can open."""
    token = SealedMessage.objects.filter(dead_letter_id=record.pk).values_list("token", flat=True).first()
    if not token:
        return None
    try:
        sealer = sealer_for(app)
        if sealer is None:
            raise SealError("no seal_keys are configured")
        return sealer.open(token)
    except SealError as exc:
        raise Refused(f"its sealed copy cannot be opened: {exc}") from None


def _replay_one(record: DeadLetter, app: Any, user: Any, result: ReplayResult, **changes: Any) -> None:
    try:
        message = plan(record, app=app, **changes)
    except Refused as why:
        result.skipped.append((record.pk, str(why)))
        return
    task_id = uuid()
    won = DeadLetter.objects.filter(pk=record.pk, status=DeadLetter.Status.OPEN).update(
        status=DeadLetter.Status.REPLAYED,
        replayed_task_id=task_id,
        handled_by=getattr(user, "username", "") or "",
        handled_at=timezone.now(),
    )
    if not won:
        result.skipped.append((record.pk, "already handled by someone else"))
        return
    try:
        _publish(record, message, task_id, app)
    except Exception as exc:  # put it back: a record must never be marked replayed for nothing
        logger.exception("Replay of dead letter %s (%s) failed", record.pk, record.task_name)
        _put_back(record.pk, task_id)
        result.skipped.append((record.pk, f"publishing failed: {exc}"))
        return
    logger.info(
        "Dead letter %s (%s[%s]) replayed as %s by %s",
        record.pk,
        record.task_name,
        record.task_id,
        task_id,
        getattr(user, "username", None) or "-",
    )
    result.replayed.append((record.pk, task_id))


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


def _publish(record: DeadLetter, message: Message, task_id: str, app: Any) -> None:
    if record.idempotency_key:
        # The key failed with the message: reopen it deliberately, or the replay would be skipped.
        get_store(app).reopen(record.idempotency_key)
    app.tasks[record.task_name].apply_async(
        args=message.args, kwargs=message.kwargs, task_id=task_id, headers={headers.HEADER: message.header}
    )
