"""QuerySets of the guardrails models."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import models

from celery_guardrails.scheduling.ledger import OPEN
from celery_guardrails.stores.base import INTERNAL_KEY_PREFIX


class DependencyStateQuerySet(models.QuerySet[Any]):
    def locked(self, dependency: str) -> Any:
        """The row of ``dependency``, created if missing, locked until the end of the transaction."""
        row, _ = self.select_for_update().get_or_create(dependency=dependency)
        return row


class IdempotencyKeyQuerySet(models.QuerySet[Any]):
    def finished_before(self, moment: datetime) -> models.QuerySet[Any]:
        """Completed or failed keys whose retention has run out at ``moment``, and claims whose lease ran out
        before it (their holder died long ago, and no delivery came back for them)."""
        return self.filter(
            models.Q(state__in=["completed", "failed"], finished_at__lt=moment)
            | models.Q(state="claimed", lease_until__lt=moment)
        )

    def of_tasks(self) -> models.QuerySet[Any]:
        """Keys of tasks, without the guardrails' own (the watchdog's turn, schedule slots)."""
        return self.exclude(key__startswith=INTERNAL_KEY_PREFIX)


class ProcessedMessageQuerySet(models.QuerySet[Any]):
    def processed_before(self, moment: datetime) -> models.QuerySet[Any]:
        return self.filter(processed_at__lt=moment)


class DeadLetterQuerySet(models.QuerySet[Any]):
    def open(self) -> models.QuerySet[Any]:
        return self.filter(status="open")

    def closed_before(self, moment: datetime) -> models.QuerySet[Any]:
        """Replayed, discarded or resolved records handled before ``moment`` (open ones are never pruned)."""
        return self.filter(status__in=["replayed", "discarded", "resolved"], handled_at__lt=moment)


class ScheduledRunQuerySet(models.QuerySet[Any]):
    def of(self, schedule: str) -> models.QuerySet[Any]:
        """Records of one schedule (newest period first, by the model's ordering)."""
        return self.filter(schedule=schedule)

    def open(self) -> models.QuerySet[Any]:
        """Records whose run has not ended: dispatched, running or overdue."""
        return self.filter(status__in=OPEN)

    def superseded(self) -> models.QuerySet[Any]:
        """Records that are not their schedule's newest (the newest is the schedule's horizon): an index
        probe on (schedule, period) per record, not a scan."""
        newer = self.model.objects.filter(schedule=models.OuterRef("schedule"), period__gt=models.OuterRef("period"))
        return self.filter(models.Exists(newer))


class JobQuerySet(models.QuerySet[Any]):
    def of_tenant(self, tenant: str | None) -> models.QuerySet[Any]:
        """Jobs of ``tenant`` ("" or None: jobs with no tenant)."""
        return self.filter(tenant=tenant or "")

    def terminal(self) -> models.QuerySet[Any]:
        """Jobs in a final state."""
        from celery_guardrails.guardrails.jobs import TERMINAL

        return self.filter(state__in=sorted(TERMINAL))

    def finished_before(self, moment: datetime) -> models.QuerySet[Any]:
        """Jobs that reached a final state before ``moment`` (what pruning removes)."""
        return self.terminal().filter(finished_at__lt=moment)
