"""Poison-message protection in the Django database (the delivery counts of the Django store, mixed in).

One row per redelivered message (:class:`~django_celery_guardrails.models.DeliveryCounter`): the starts of a
message that never finished, counted under the row's lock. It mirrors ``RedisIdempotency.count_delivery`` and
``clear_delivery`` in ``celery_guardrails/stores/redis.py`` (a counter key there).
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import F

from ..models import DeliveryCounter
from .database import translated


class DjangoDeliveryCounts:
    """The delivery count operations of :class:`~django_celery_guardrails.store.DjangoStore` (mixed in)."""

    @translated("count a delivery")
    def count_delivery(self, message_id: str, *, ttl: float) -> int:
        with transaction.atomic():
            counter, created = DeliveryCounter.objects.select_for_update().get_or_create(message_id=message_id)
            if not created:
                counter.starts = F("starts") + 1
                counter.save(update_fields=["starts", "updated_at"])
                counter.refresh_from_db(fields=["starts"])
        return int(counter.starts)

    @translated("clear a delivery count")
    def clear_delivery(self, message_id: str) -> None:
        DeliveryCounter.objects.filter(message_id=message_id).delete()
