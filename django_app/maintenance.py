"""Housekeeping shared by the management commands and the beat task."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

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
    return {name: queryset.delete()[0] for name, queryset in found.items()}
