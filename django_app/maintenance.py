"""Housekeeping and record handling shared by the admin, the management commands and the beat task."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone

from celery_guardrails.ledger import RETENTION
from celery_guardrails.options import OPTIONS, django_settings

from .models import DeadLetter, IdempotencyKey, ProcessedMessage, ScheduledRun


def _setting(name: str) -> float:
    return float(django_settings().get(name, OPTIONS[name].default))


def prune(*, older_than: float | None = None, now: datetime | None = None, dry_run: bool = False) -> dict[str, int]:
    """Delete what is past its retention: completed or failed idempotency keys and processed-message records
    (``idempotency_retention``, 7 days), discarded or resolved dead letters (``dead_letter_retention``, 90
    days), scheduled-run records whose period is older than the ledger's retention (90 days; the newest
    record of a schedule is its horizon, so it is kept whatever its age). Open dead letters are never
    pruned. ``older_than`` (seconds) overrides all three. Counts by table.
    """
    moment = now or datetime.now(UTC)
    keys_age = older_than if older_than is not None else _setting("idempotency_retention")
    letters_age = older_than if older_than is not None else _setting("dead_letter_retention")
    found = {
        "idempotency_keys": IdempotencyKey.objects.finished_before(moment - timedelta(seconds=keys_age)),
        "processed_messages": ProcessedMessage.objects.processed_before(moment - timedelta(seconds=keys_age)),
        "dead_letters": DeadLetter.objects.closed_before(moment - timedelta(seconds=letters_age)),
        "scheduled_runs": ScheduledRun.objects.superseded().filter(
            period__lt=moment - timedelta(seconds=older_than if older_than is not None else RETENTION)
        ),
    }
    if dry_run:
        return {name: queryset.count() for name, queryset in found.items()}
    # Counted by table: a dead letter's sealed copy goes with it, and is not a record of its own.
    return {name: queryset.delete()[1].get(queryset.model._meta.label, 0) for name, queryset in found.items()}


def close_dead_letters(queryset: QuerySet[DeadLetter], status: str, *, user: Any = None, by: str = "") -> int:
    """Mark open records discarded or resolved (a conditional update: only open ones); how many changed.
    ``by`` names who did it when there is no ``user`` (a command)."""
    return queryset.filter(status=DeadLetter.Status.OPEN).update(
        status=status, handled_by=getattr(user, "username", "") or by, handled_at=timezone.now()
    )
