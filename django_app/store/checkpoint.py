"""Checkpoints of long jobs in the Django database (the checkpoint half of the Django store, mixed in).

One row per job (:class:`~django_celery_guardrails.models.Checkpoint`). Saved on the caller's connection, in
its transaction (the chunk's ``transaction.atomic()``), so the chunk's effects and its position commit together
or not at all: exactly once per chunk for database effects. The save is a conditional UPDATE from the expected
position (an INSERT for the first, in a savepoint that a concurrent first insert refuses): of two deliveries
running one job at once, one moves it. It mirrors ``celery_guardrails/stores/redis_checkpoint.py``.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.utils import timezone

from celery_guardrails.stores.base import StoredCheckpoint

from ..models import Checkpoint
from .database import translated


class DjangoCheckpoints:
    """The checkpoint operations of :class:`~django_celery_guardrails.store.DjangoStore` (mixed in)."""

    @translated("read a checkpoint")
    def load_checkpoint(self, key: str) -> StoredCheckpoint:
        row = Checkpoint.objects.filter(key=key).values_list("position", "state", "completed_at").first()
        if row is None:
            return StoredCheckpoint()
        return StoredCheckpoint(position=int(row[0]), state=row[1], done=row[2] is not None)

    @translated("save a checkpoint")
    def save_checkpoint(self, key: str, *, expected: int, position: int, state: str, ttl: float) -> bool:
        moved = Checkpoint.objects.filter(key=key, position=expected).update(
            position=position, state=state, updated_at=timezone.now()
        )
        if moved or expected != 0:
            return bool(moved)
        try:
            with transaction.atomic():
                Checkpoint.objects.create(key=key, position=position, state=state)
        except IntegrityError:  # another delivery saved first
            return False
        return True

    @translated("complete a checkpoint")
    def complete_checkpoint(self, key: str, *, ttl: float) -> None:
        # Kept until guardrails_prune removes it (updated_at older than idempotency_retention), as a completed key.
        now = timezone.now()
        if not Checkpoint.objects.filter(key=key).update(completed_at=now, updated_at=now):
            Checkpoint.objects.get_or_create(key=key, defaults={"completed_at": now})

    @translated("clear a checkpoint")
    def clear_checkpoint(self, key: str) -> None:
        Checkpoint.objects.filter(key=key).delete()
