"""Replay dead letters: one function for the admin, the ``guardrails_replay`` command and Python callers.

``replay_dead_letters(queryset_or_ids, *, user=None, tenant=None, allow_not_idempotent=False)`` re-publishes
each open record's task with its original arguments, tenant, correlation id, per-call options and idempotency
key (a failed key is reopened deliberately, even when its run writes it failed after the replay), a fresh
attempt count, and links the new task id to the record (status ``replayed``). ``replay_with_changes(pk, *,
user=None, tenant=None, args=None, kwargs=None, allow_not_idempotent=False)`` replays one record with a fix (the
admin's "edit and replay"). Arguments come from the record's sealed copy when it has one
(:mod:`celery_guardrails.foundation.sealing`): a record whose secrets were redacted for display replays with
the real values. :func:`plan` says, without publishing, what a replay would
do (the command's ``--dry-run``); :func:`outlooks` says it for the pages and ``guardrails_deadletters show``.

Safe to run twice: each record moves from ``open`` to ``replayed`` by a conditional UPDATE before anything
is published, so two concurrent replays of one record publish once. Records go :data:`BATCH` (500) at a time:
a few queries read them with their sealed copies, one UPDATE claims them (each with its own new task id), one
store call reopens their keys, one broker connection publishes them (a Redis broker: one pipeline, with kombu
5.7); ``progress`` hears of each batch.

A record is left open, with the reason in the result, when its task is not registered in this process (the
project's task modules are imported first, as a worker does: :mod:`.discovery`), its sealed copy
cannot be opened with the configured keys, or its arguments were not stored as JSON or had secrets redacted
and no sealed copy holds them; and a ``not_idempotent`` record (its task failed after it may already have
acted: charged a card, sent a mail) unless the caller says ``allow_not_idempotent=True``, having checked that
the effect did not happen (:data:`NOT_IDEMPOTENT_REFUSAL`); and an ``ordering_gap_skipped`` record, which
records a message that never came (:data:`NEVER_CAME_REFUSAL`). Without the ``guardrails.replay_deadletter``
permission, a given ``user`` gets :class:`~django.core.exceptions.PermissionDenied`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from celery import current_app
from celery.utils import uuid
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet

from celery_guardrails.exceptions import ContextError, SealError
from celery_guardrails.foundation.context import validate_tenant
from celery_guardrails.foundation.redaction import REDACTED
from celery_guardrails.foundation.sealing import restore_redacted, sealer_for
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.outcomes import NOT_IDEMPOTENT, ORDERING_GAP_SKIPPED
from celery_guardrails.stores import get_store

from .discovery import NOT_REGISTERED, import_task_modules
from .job_book import replayed
from .models import DeadLetter, SealedMessage
from .replay_claims import claim, put_back
from .scoping import replayable

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
    # Ordered work: its turn is over (its successors moved on); published again, it takes a new number.
    headers.ORDERING_KEY,
    headers.ORDERING_SEQUENCE,
    headers.ORDERING_WAITS,
)
#: Records read, claimed, reopened and published together: two queries read them with their sealed copies,
#: one UPDATE claims them, one store call reopens their keys, one broker connection publishes them.
BATCH = 500
#: Fields of a record a replay does not read.
UNREAD = ("history", "traceback", "exc_message", "exc_type")
#: ``progress(done, total)``: records handled so far, of all the records asked for.
Progress = Callable[[int, int], None]
#: Why a ``not_idempotent`` record is not replayed unless the caller allows it: its task failed after it may
#: already have acted, and a replay runs it again (the rubric: never retry a non-idempotent handler; a replay is
#: a retry a person asks for, so a person has to say they checked). One text for every path, so the admin's
#: summary groups these records under one message and the command prints the same words.
NOT_IDEMPOTENT_REFUSAL = (
    f"{NOT_IDEMPOTENT}: it may already have acted (charged a card, sent a mail) before it failed, and a replay "
    "runs it again; replay it only if you checked the effect did not happen: allow_not_idempotent=True / "
    "--allow-not-idempotent / the admin's tick"
)

#: Why an ``ordering_gap_skipped`` record is never replayed: it records sequence numbers of an ordering key that
#: never came (given up after ordering_gap_timeout), not a message: it holds no arguments to publish.
NEVER_CAME_REFUSAL = (
    f"{ORDERING_GAP_SKIPPED}: the message never came (its sequence number was given up as lost after "
    "ordering_gap_timeout), so there is nothing to replay; publish the work again if it is still wanted, then "
    "resolve this record"
)


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
    allow_not_idempotent: bool = False,
    app: Any = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay each open record; ``tenant`` gives every one of them that tenant (e.g. ``missing_tenant`` ones).
    ``not_idempotent`` records are refused (left open, in ``skipped``) unless ``allow_not_idempotent=True``.

    Records are handled :data:`BATCH` at a time, in id order; ``progress(done, total)`` is called after each
    batch (the command prints it)."""
    _check_permission(user)
    # The app itself, not Celery's proxy: each record's plan and publish read it (about 50 us a read through it).
    app = app or current_app._get_current_object()
    ids = (
        list(queryset_or_ids.order_by("pk").values_list("pk", flat=True))
        if isinstance(queryset_or_ids, QuerySet)
        else sorted({int(pk) for pk in queryset_or_ids})
    )
    ids, refused = replayable(ids, user=user, tenant=tenant)  # admin_tenants: what the user may not see
    result = ReplayResult(skipped=refused)
    for done, batch in read_batches(ids):
        _replay_batch(batch, app, user, result, tenant=tenant, allow_not_idempotent=allow_not_idempotent)
        if progress is not None:
            progress(done, len(ids))
    return result


def read_batches(ids: list[int]) -> Iterator[tuple[int, list[tuple[DeadLetter, str | None]]]]:
    """(records read so far, [(record, its sealed copy or None)]) for ``ids``, :data:`BATCH` at a time: two
    queries a batch, whatever its size. Ids without a record are left out."""
    for start in range(0, len(ids), BATCH):
        chunk = ids[start : start + BATCH]
        tokens = dict(SealedMessage.objects.filter(dead_letter_id__in=chunk).values_list("dead_letter_id", "token"))
        # Without what a replay never reads: the attempt history (JSON, often the largest field) and the error.
        records = DeadLetter.objects.filter(pk__in=chunk).defer(*UNREAD).order_by("pk")
        yield start + len(chunk), [(record, tokens.get(record.pk)) for record in records]


def replay_with_changes(
    pk: int,
    *,
    user: Any = None,
    tenant: str | None = None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    allow_not_idempotent: bool = False,
    app: Any = None,
) -> ReplayResult:
    """Replay one record with a fix: another tenant, other arguments. Arguments are edited as the record shows
    them: a value left as the redaction placeholder is replayed with the original from the sealed copy. When
    the arguments change, the idempotency key is made again from the new ones. A ``not_idempotent`` record is
    refused unless ``allow_not_idempotent=True``: new arguments do not undo what the failed run may have done."""
    _check_permission(user)
    app = app or current_app._get_current_object()  # the app, not the proxy (as above)
    ids, refused = replayable([pk], user=user, tenant=tenant)  # admin_tenants: what the user may not see
    result = ReplayResult(skipped=refused)
    for _, batch in read_batches(ids):
        _replay_batch(
            batch, app, user, result, tenant=tenant, args=args, kwargs=kwargs, allow_not_idempotent=allow_not_idempotent
        )
    if not result.replayed and not result.skipped:
        result.skipped.append((pk, "no such dead letter"))
    return result


def plan(
    record: DeadLetter,
    *,
    tenant: str | None = None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    allow_not_idempotent: bool = False,
    app: Any = None,
) -> Message:
    """What replaying ``record`` would publish, or :class:`Refused` saying why it cannot be replayed (a dry run
    and the real run ask this same question)."""
    token = SealedMessage.objects.filter(dead_letter_id=record.pk).values_list("token", flat=True).first()
    return _plan(
        record,
        token,
        app or current_app,
        tenant=tenant,
        args=args,
        kwargs=kwargs,
        allow_not_idempotent=allow_not_idempotent,
    )


def _plan(
    record: DeadLetter,
    token: str | None,
    app: Any,
    *,
    tenant: str | None = None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    allow_not_idempotent: bool = False,
) -> Message:
    """:func:`plan`, with the record's sealed copy (``token``) read already."""
    if record.status != DeadLetter.Status.OPEN:
        raise Refused(f"status is {record.status}")
    if record.reason == ORDERING_GAP_SKIPPED:
        raise Refused(NEVER_CAME_REFUSAL)
    if record.task_name not in app.tasks:
        # A web process has not imported the modules autodiscover_tasks() finds: import them as a worker does.
        found = import_task_modules(app)
        if record.task_name not in app.tasks:
            why = "" if found.ok else f"; {found}"
            raise Refused(f"task {record.task_name!r} is {NOT_REGISTERED}{why}; the record stays open")
    original = _unsealed(token, app, record)
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
    header[headers.REPLAY_OF] = record.task_id  # its key, failed by that run even after this, is reopened
    if (new_args, new_kwargs) != (base_args, base_kwargs):
        header.pop(headers.IDEMPOTENCY_KEY, None)  # made again from the new arguments when published
    if tenant is not None:
        try:
            header[headers.TENANT] = validate_tenant(tenant)
        except ContextError as exc:
            raise Refused(str(exc)) from None
    # Asked last, once nothing else stands in the way: this refusal then means "it goes through once you say
    # you checked", so the admin's tick and the command's flag are the whole answer to it.
    if record.reason == NOT_IDEMPOTENT and not allow_not_idempotent:
        raise Refused(NOT_IDEMPOTENT_REFUSAL)
    return Message(args=list(new_args), kwargs=dict(new_kwargs), header=header)


def refusals(
    ids: list[int], *, tenant: str | None = None, allow_not_idempotent: bool = False, app: Any = None
) -> Iterator[tuple[DeadLetter, str]]:
    """Each record of ``ids`` (in id order) with why a replay would refuse it, "" when it would go through:
    :func:`plan` for many records, read in batches (the command's ``--dry-run``)."""
    for record, _, why in _verdicts(ids, app or current_app, tenant=tenant, allow_not_idempotent=allow_not_idempotent):
        yield record, why


def _verdicts(ids: list[int], app: Any, **plan: Any) -> Iterator[tuple[DeadLetter, str | None, str]]:
    """(record, its sealed copy's token, why a replay would refuse it or "") of each record of ``ids``, in id
    order, read in batches as a replay reads them: the one loop behind :func:`refusals` and :func:`outlooks`."""
    for _, batch in read_batches(ids):
        for record, token in batch:
            try:
                _plan(record, token, app, **plan)
            except Refused as why:
                yield record, token, str(why)
            else:
                yield record, token, ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Outlook:
    """What a replay of one record would do, as the replay decides it (:func:`_plan`, the question the real run
    asks): the admin's list and record page and ``guardrails_deadletters show`` say this, never a rule of
    their own (a record cut to a repr replays from its sealed copy; one with redacted values and no sealed copy
    does not)."""

    #: Why it would be refused, "" when it would be replayed. :data:`NOT_IDEMPOTENT_REFUSAL` alone means it goes
    #: through once the caller says the effect did not happen.
    refusal: str
    #: It would replay the original arguments of its sealed copy (not the redacted or cut ones shown).
    from_sealed_copy: bool = False

    @property
    def replayable(self) -> bool:
        return not self.refusal

    @property
    def needs_confirmation(self) -> bool:
        return self.refusal == NOT_IDEMPOTENT_REFUSAL

    @property
    def summary(self) -> str:
        """A word or two, for a list column: ``yes``, ``after a check`` or ``no``."""
        return "yes" if self.replayable else "after a check" if self.needs_confirmation else "no"

    def __str__(self) -> str:
        if self.replayable:
            source = "the original arguments of its sealed copy" if self.from_sealed_copy else "its arguments as shown"
            return f"would replay, with {source}"
        if self.needs_confirmation:
            return f"would replay only once the caller confirms: {self.refusal}"
        return f"would refuse: {self.refusal}"


def outlooks(ids: list[int], *, app: Any = None) -> dict[int, Outlook]:
    """:class:`Outlook` of each record of ``ids`` (those that exist), read in batches as a replay reads them."""
    return {
        record.pk: Outlook(refusal=why, from_sealed_copy=not why and bool(token))
        for record, token, why in _verdicts(sorted(set(ids)), app or current_app)
    }


def _check_permission(user: Any) -> None:
    if user is not None and not user.has_perm(PERMISSION):
        raise PermissionDenied(f"{user} may not replay dead letters (needs {PERMISSION})")


def _unsealed(token: str | None, app: Any, record: DeadLetter) -> dict[str, Any] | None:
    """The record's sealed original, None when it has none; Refused when it has one nobody can open."""
    if not token:
        return None
    try:
        sealer = sealer_for(app)
        if sealer is None:
            raise SealError("no seal_keys are configured")
        return sealer.open(token, record=record)  # refused when sealed for another record
    except SealError as exc:
        raise Refused(f"its sealed copy cannot be opened: {exc}") from None


@dataclass(frozen=True)
class _Claimed:
    record: DeadLetter
    message: Message
    task_id: str


def _replay_batch(
    batch: list[tuple[DeadLetter, str | None]], app: Any, user: Any, result: ReplayResult, **changes: Any
) -> None:
    """Plan each record, claim the planned ones with one conditional UPDATE (open -> replayed, each with its new
    task id), reopen their idempotency keys with one store call, publish them on one broker connection. A record
    is told replayed once its message is on the broker; one whose message may not be goes back to open.

    Where kombu batches publishes (``Producer.batch()``, kombu 5.7: a Redis broker whose options never send a
    pipeline twice), the batch's messages are buffered and sent as one pipeline when the block ends: a publish of
    its own costs a round trip and a Redis client kombu makes for it, about a third of plain Celery's publish
    (bench/scale.py). Its size is never reached, so nothing goes out before the end: the pipeline goes out, or
    the whole batch goes back to open (delivery uncertain, as for a single publish whose answer was lost: a
    keyed replay's key stops a second run). Elsewhere (RabbitMQ, an older kombu) each message goes out as it is
    published."""
    planned: list[_Claimed] = []
    for record, token in batch:
        try:
            planned.append(_Claimed(record, _plan(record, token, app, **changes), uuid()))
        except Refused as why:
            result.skipped.append((record.pk, str(why)))
    won = _claim(planned, user)
    won_ids = {item.record.pk for item in won}
    result.skipped.extend(
        (item.record.pk, "already handled by someone else") for item in planned if item.record.pk not in won_ids
    )
    pending = {item.record.pk: item for item in won}  # claimed, and not (yet) on the broker
    sent: list[_Claimed] = []
    failure: BaseException | None = None
    try:
        # The keys failed with their messages: reopened deliberately, or the replays would be skipped.
        keys = [item.record.idempotency_key for item in won if item.record.idempotency_key]
        if keys:
            get_store(app).reopen_keys(keys)
        with app.producer_or_acquire() as producer:
            batched = bool(getattr(producer, "supports_batch_publish", False))
            with producer.batch(max_size=BATCH * 20) if batched else nullcontext():
                for item in won:
                    try:
                        _publish(item, app, producer)
                    except Exception as exc:  # put it back: a record must never be marked replayed for nothing
                        logger.exception("Replay of dead letter %s (%s) failed", item.record.pk, item.record.task_name)
                        put_back({item.record.pk: item.task_id})
                        result.skipped.append((item.record.pk, f"publishing failed: {exc}"))
                        del pending[item.record.pk]
                        continue
                    sent.append(item)
                    if not batched:
                        del pending[item.record.pk]  # on the broker already
            # (a batch's pipeline went out as its block ended: only now are its messages on the broker)
            pending.clear()
    except BaseException as exc:  # the store or the broker out of reach, or anything else: reopened
        failure = exc
        logger.exception("Replay of %s dead letter(s) failed", len(pending))
        put_back({pk: item.task_id for pk, item in pending.items()})
        if isinstance(exc, Exception):
            result.skipped.extend((pk, f"publishing failed: {exc}") for pk in pending)
    for item in sent:
        if item.record.pk not in pending:
            _replayed(item, user)
            result.replayed.append((item.record.pk, item.task_id))
    if failure is not None and not isinstance(failure, Exception):
        raise failure


def _claim(planned: list[_Claimed], user: Any) -> list[_Claimed]:
    """The planned records this call moved from open to replayed (:func:`.replay_claims.claim`)."""
    if not planned:
        return []
    won = claim({item.record.pk: item.task_id for item in planned}, getattr(user, "username", "") or "")
    return [item for item in planned if item.record.pk in won]


def _replayed(item: _Claimed, user: Any) -> None:
    """Its message is on the broker: the log line, and its job (when it works for one) queued again."""
    logger.info(
        "Dead letter %s (%s[%s]) replayed as %s by %s%s",
        item.record.pk,
        item.record.task_name,
        item.record.task_id,
        item.task_id,
        getattr(user, "username", None) or "-",
        # Only a caller that allowed it gets here with one: the log says whose word let it run again.
        " (not_idempotent, allowed by the caller)" if item.record.reason == NOT_IDEMPOTENT else "",
    )
    job_id = headers.job_id(item.message.header)
    if job_id is not None:
        # The same job, queued again (written after the publish: see job_book.replayed).
        try:
            replayed(job_id=job_id, task_id=item.task_id)
        except Exception as exc:  # the job's state is a view; the replay went out
            logger.warning("Replay %s: job %s not marked queued (%r)", item.task_id, job_id, exc)


def _publish(item: _Claimed, app: Any, producer: Any) -> None:
    message = item.message
    app.tasks[item.record.task_name].apply_async(
        args=message.args,
        kwargs=message.kwargs,
        task_id=item.task_id,
        headers={headers.HEADER: message.header},
        producer=producer,
    )
