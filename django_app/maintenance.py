"""Housekeeping and record handling shared by the admin, the management commands and the beat task."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F, QuerySet
from django.utils import timezone

from celery_guardrails.foundation.fingerprints import fingerprint
from celery_guardrails.options import OPTIONS, django_settings
from celery_guardrails.scheduling.ledger import RETENTION

from .models import (
    ActivityBatch,
    ActivityCount,
    Checkpoint,
    ConcurrencySlot,
    DeadLetter,
    IdempotencyKey,
    Job,
    OrderingSequence,
    ProcessedMessage,
    QueueSample,
    ScheduledRun,
)
from .scoping import scope

#: Rows deleted per transaction by prune: a few milliseconds of row locks each.
PRUNE_BATCH = 1000


def _setting(name: str) -> float:
    return float(django_settings().get(name, OPTIONS[name].default))


def prune(
    *,
    older_than: float | None = None,
    now: datetime | None = None,
    dry_run: bool = False,
    batch: int = PRUNE_BATCH,
) -> dict[str, int]:
    """Delete what is past its retention: completed or failed idempotency keys and processed-message records
    (``idempotency_retention``, 7 days), discarded or resolved dead letters (``dead_letter_retention``, 90
    days), scheduled-run records whose period is older than the ledger's retention (90 days; the newest
    record of a schedule is its horizon, so it is kept whatever its age). Open dead letters are never
    pruned. Long jobs' records too: checkpoints not saved for ``idempotency_retention`` (a job that never
    succeeded; a replay after that starts it over, as the Redis store's expiry does), concurrency slot holders
    recorded ``lost`` (an audit trail, kept as long as closed dead letters), and ordering keys idle for
    ``ordering_retention`` (30 days) with no message left to run (every number handed out is done). The
    activity (outcome counts, their batch ids, queue samples) older than ``activity_retention`` (2 days). Jobs
    (``task.submit()``) that reached a final state more than ``job_retention`` (30 days) ago; a job not finished
    is never pruned. ``older_than`` (seconds) overrides every age. Counts by table.

    Deleted ``batch`` rows at a time, each batch its own short transaction (see :func:`delete_in_batches`): a
    prune of a million records never holds a lock for long, and workers recording dead letters meanwhile
    never wait for it.
    """
    moment = now or datetime.now(UTC)
    keys_age = older_than if older_than is not None else _setting("idempotency_retention")
    letters_age = older_than if older_than is not None else _setting("dead_letter_retention")
    ordering_age = older_than if older_than is not None else _setting("ordering_retention")
    jobs_age = older_than if older_than is not None else _setting("job_retention")
    activity_before = moment - timedelta(
        seconds=older_than if older_than is not None else _setting("activity_retention")
    )
    found = {
        "idempotency_keys": IdempotencyKey.objects.finished_before(moment - timedelta(seconds=keys_age)),
        "processed_messages": ProcessedMessage.objects.processed_before(moment - timedelta(seconds=keys_age)),
        "dead_letters": DeadLetter.objects.closed_before(moment - timedelta(seconds=letters_age)),
        "scheduled_runs": ScheduledRun.objects.superseded().filter(
            period__lt=moment - timedelta(seconds=older_than if older_than is not None else RETENTION)
        ),
        "checkpoints": Checkpoint.objects.filter(updated_at__lt=moment - timedelta(seconds=keys_age)),
        "lost_slot_holders": ConcurrencySlot.objects.filter(
            state=ConcurrencySlot.State.LOST, reaped_at__lt=moment - timedelta(seconds=letters_age)
        ),
        "ordering_keys": OrderingSequence.objects.filter(
            done__gte=F("issued"), updated_at__lt=moment - timedelta(seconds=ordering_age)
        ),
        "activity_counts": ActivityCount.objects.filter(minute__lt=activity_before),
        "activity_batches": ActivityBatch.objects.filter(added_at__lt=activity_before),
        "queue_samples": QueueSample.objects.filter(minute__lt=activity_before),
        "jobs": Job.objects.finished_before(moment - timedelta(seconds=jobs_age)),
    }
    if dry_run:
        return {name: queryset.count() for name, queryset in found.items()}
    return {name: delete_in_batches(queryset, batch=batch) for name, queryset in found.items()}


def delete_in_batches(queryset: QuerySet[Any], *, batch: int = PRUNE_BATCH) -> int:
    """Delete what ``queryset`` matches, ``batch`` rows a transaction; how many rows of its model went.

    The next batch's ids are read outside any transaction, walking the primary key upwards from the last batch
    (each row is looked at once however many batches there are; starting from the lowest id each time would
    look at every row deleted before again). Each batch is deleted with ``queryset``'s own conditions, so a
    row that stopped matching meanwhile stays; its sealed copies go with it (counted by the model's label, so
    a dead letter's sealed copy is not a record of its own).
    """
    label = queryset.model._meta.label
    deleted, after = 0, None
    while True:
        remaining = queryset if after is None else queryset.filter(pk__gt=after)
        ids = list(remaining.order_by("pk").values_list("pk", flat=True)[:batch])
        if not ids:
            return deleted
        with transaction.atomic():
            deleted += queryset.filter(pk__in=ids).delete()[1].get(label, 0)
        if len(ids) < batch:
            return deleted
        after = ids[-1]


def fill_fingerprints(*, batch: int = PRUNE_BATCH) -> int:
    """Give each record made before fingerprints its fingerprint, from what it keeps (the worker computes it the
    same way: :mod:`celery_guardrails.foundation.fingerprints`); how many were filled. ``batch`` records a
    transaction, walking the primary key upwards; one UPDATE per cause in a batch (a batch of one outage's records
    is one statement). Safe to stop and run again, and beside running workers (only empty ones are written)."""
    filled, after = 0, 0
    while True:
        rows = list(
            DeadLetter.objects.filter(fingerprint="", pk__gt=after)
            .order_by("pk")
            .values_list("pk", "task_name", "exc_type", "exc_message", "traceback")[:batch]
        )
        if not rows:
            return filled
        by_cause: dict[str, list[int]] = {}
        for pk, task_name, exc_type, exc_message, traceback in rows:
            cause = fingerprint(task_name=task_name, exc_type=exc_type, exc_message=exc_message, traceback=traceback)
            by_cause.setdefault(cause, []).append(pk)
        with transaction.atomic():
            for cause, ids in by_cause.items():
                filled += DeadLetter.objects.filter(pk__in=ids, fingerprint="").update(fingerprint=cause)
        after = rows[-1][0]


def close_dead_letters(queryset: QuerySet[DeadLetter], status: str, *, user: Any = None, by: str = "") -> int:
    """Mark open records discarded or resolved (a conditional update: only open ones); how many changed.
    ``by`` names who did it when there is no ``user`` (a command). A ``user`` closes only the records of the
    tenants they may see (``admin_tenants``, :mod:`.scoping`)."""
    return (
        scope(queryset, user)
        .filter(status=DeadLetter.Status.OPEN)
        .update(status=status, handled_by=getattr(user, "username", "") or by, handled_at=timezone.now())
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class JobCancels:
    """What a cancel of several jobs did, by job id (in the order asked)."""

    #: Not started yet (queued, waiting, retrying): cancelled, their messages revoked.
    cancelled: tuple[str, ...]
    #: Running: the request recorded (``cancel_requested_at``); each runs to its end.
    requested: tuple[str, ...]
    #: Left as they were: already final, or a cancel already asked while it runs.
    unchanged: tuple[str, ...]


def cancel_jobs(queryset: QuerySet[Any], *, user: Any = None, app: Any = None) -> JobCancels:
    """Cancel the jobs of ``queryset`` with :meth:`~.models.Job.cancel`, each in its own transaction (a job's row
    is locked while it is decided, so a worker's write and the cancel never interleave). A ``user`` cancels only
    the jobs of the tenants they may see (``admin_tenants``, :mod:`.scoping`); the others are left out."""
    cancelled: list[str] = []
    requested: list[str] = []
    unchanged: list[str] = []
    # The ids first, then the jobs a batch at a time: no cursor held open across the cancels' transactions.
    ids = list(scope(queryset, user).order_by("created_at", "pk").values_list("pk", flat=True))
    for start in range(0, len(ids), PRUNE_BATCH):
        for job in Job.objects.filter(pk__in=ids[start : start + PRUNE_BATCH]).order_by("created_at", "pk"):
            asked_before = job.cancel_requested_at is not None
            if job.cancel(app=app):
                cancelled.append(str(job.pk))
            elif job.state == Job.State.RUNNING and not asked_before and job.cancel_requested_at is not None:
                requested.append(str(job.pk))
            else:
                unchanged.append(str(job.pk))
    return JobCancels(cancelled=tuple(cancelled), requested=tuple(requested), unchanged=tuple(unchanged))
