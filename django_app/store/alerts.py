"""Alert throttling in the Django database (the alert throttles of the Django store, mixed in).

One row per (owner, task, reason) group (:class:`~django_celery_guardrails.models.AlertThrottle`): the window
an alert opened and the dead letters it suppressed since, changed under the row's lock; the summaries due are
taken and reset in one transaction. It mirrors ``RedisIdempotency.throttle`` and ``due_summaries`` in
``celery_guardrails/stores/redis.py`` (the ``guardrails:{alerts}:`` keys there).
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import F

from ..models import AlertThrottle
from .database import translated


class DjangoAlertThrottles:
    """The alert throttle operations of :class:`~django_celery_guardrails.store.DjangoStore` (mixed in)."""

    @translated("throttle an alert")
    def throttle(self, group: str, *, window: float, now: float, extend_for: float = 0.0) -> bool:
        with transaction.atomic():
            row, _ = AlertThrottle.objects.select_for_update().get_or_create(group=group)
            if row.until > now:
                row.suppressed = F("suppressed") + 1
                if extend_for > 0:
                    row.until = max(row.until, min(now + window, row.opened + extend_for))
                row.save(update_fields=["suppressed", "until"])
                return False
            row.until, row.opened = now + window, now
            row.save(update_fields=["until", "opened"])
            return True

    @translated("read the alert summaries due")
    def due_summaries(self, *, now: float) -> list[tuple[str, int]]:
        due = []
        with transaction.atomic():
            for row in AlertThrottle.objects.select_for_update().filter(until__lte=now, suppressed__gt=0):
                due.append((row.group, row.suppressed))
                row.suppressed = 0
                row.save(update_fields=["suppressed"])
        return due
