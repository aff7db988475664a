"""Housekeeping shared by the management commands and the beat task."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from celery_guardrails.options import OPTIONS, django_settings

from .models import IdempotencyKey, ProcessedMessage


def prune(*, older_than: float | None = None, now: datetime | None = None, dry_run: bool = False) -> dict[str, int]:
    """Delete completed or failed idempotency keys, and processed-message records, older than the retention.

    ``older_than`` (seconds) defaults to ``idempotency_retention`` (7 days). Returns counts by table.
    """
    seconds = (
        older_than
        if older_than is not None
        else django_settings().get("idempotency_retention", OPTIONS["idempotency_retention"].default)
    )
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    keys = IdempotencyKey.objects.finished_before(cutoff)
    messages = ProcessedMessage.objects.processed_before(cutoff)
    if dry_run:
        return {"idempotency_keys": keys.count(), "processed_messages": messages.count()}
    return {"idempotency_keys": keys.delete()[0], "processed_messages": messages.delete()[0]}
