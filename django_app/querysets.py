"""QuerySets of the guardrails models."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import models


class DependencyStateQuerySet(models.QuerySet[Any]):
    def locked(self, dependency: str) -> Any:
        """The row of ``dependency``, created if missing, locked until the end of the transaction."""
        row, _ = self.select_for_update().get_or_create(dependency=dependency)
        return row


class IdempotencyKeyQuerySet(models.QuerySet[Any]):
    def finished_before(self, moment: datetime) -> models.QuerySet[Any]:
        """Completed or failed keys whose retention has run out at ``moment``."""
        return self.filter(state__in=["completed", "failed"], finished_at__lt=moment)


class ProcessedMessageQuerySet(models.QuerySet[Any]):
    def processed_before(self, moment: datetime) -> models.QuerySet[Any]:
        return self.filter(processed_at__lt=moment)


class DeadLetterQuerySet(models.QuerySet[Any]):
    def open(self) -> models.QuerySet[Any]:
        return self.filter(status="open")

    def closed_before(self, moment: datetime) -> models.QuerySet[Any]:
        """Discarded or resolved records handled before ``moment`` (open ones are never pruned)."""
        return self.filter(status__in=["discarded", "resolved"], handled_at__lt=moment)
