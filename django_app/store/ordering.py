"""Ordering per key in the Django database (the ordering half of the Django store, mixed in).

One row per key (:class:`~django_celery_guardrails.models.OrderingSequence`). Every change is one conditional
UPDATE (compare and set on ``done``) or the INSERT of a new key, which the unique constraint settles between two
publishers; each runs in the operation's transaction, so the sequence number read back is the one this UPDATE
made (its row stays locked until the commit on PostgreSQL; SQLite has one writer at a time). Retention:
``updated_at`` says when a key was last used; idle rows are small and are not deleted here. It mirrors
``celery_guardrails/stores/redis_ordering.py``, whose script has the same rules.
"""

from __future__ import annotations

from dataclasses import fields

from django.db import IntegrityError, transaction
from django.db.models import Case, F, FloatField, Value, When
from django.utils import timezone

from celery_guardrails.stores.base import OrderState, OrderWait, OrderWaits

from ..models import OrderingSequence
from .database import translated


class DjangoOrdering:
    """The ordering operations of :class:`~django_celery_guardrails.store.DjangoStore` (mixed in)."""

    @translated("hand out a sequence number")
    def order_next(self, key: str, *, now: float, retention: float) -> int:
        rows = OrderingSequence.objects.filter(key=key)
        with transaction.atomic():
            if not rows.update(issued=F("issued") + 1, updated_at=timezone.now()):
                try:
                    with transaction.atomic():  # a savepoint: a refused INSERT leaves the transaction usable
                        OrderingSequence.objects.create(key=key, issued=1)
                    return 1
                except IntegrityError:  # another publisher made the key first: count on it
                    rows.update(issued=F("issued") + 1, updated_at=timezone.now())
            return int(rows.values_list("issued", flat=True).get())

    @translated("read an ordering key")
    def order_check(self, key: str, *, sequence: int, now: float, retention: float) -> OrderState:
        rows = OrderingSequence.objects.filter(key=key)
        names = [field.name for field in fields(OrderState)]
        with transaction.atomic():
            # Touch the row first: the UPDATE takes its lock (SQLite: the write lock), so the read and the
            # change below see no advance in between (one in between would leave a gap clock that is unset).
            if not rows.update(updated_at=timezone.now()):
                return OrderState()
            state = dict(rows.values(*names).get())
            if sequence > state["done"] + 1:
                # Written when the wait starts or a lower waiter shows up, not at every look of one that waits on.
                lowest = min(state["waiting"] or sequence, sequence)
                waiting = {"gap_since": state["gap_since"] or now, "waiting": lowest}
                if waiting != {name: state[name] for name in waiting}:
                    state.update(waiting)
                    rows.update(**waiting)
            elif sequence <= state["done"]:
                state["stale"] += 1
                rows.update(stale=F("stale") + 1)
        return OrderState(**state)

    @translated("advance an ordering key")
    def order_advance(self, key: str, *, sequence: int, now: float, retention: float) -> bool:
        changed = OrderingSequence.objects.filter(key=key, done=sequence - 1).update(
            done=sequence, gap_since=0.0, waiting=0, updated_at=timezone.now()
        )
        return bool(changed)

    @translated("skip a gap of an ordering key")
    def order_skip(self, key: str, *, done: int, to: int, now: float, retention: float) -> bool:
        if to <= done:
            return False
        gap = Case(When(gap_since=0.0, then=Value(now)), default=F("gap_since"), output_field=FloatField())
        changed = OrderingSequence.objects.filter(key=key, done=done).update(
            done=to,
            skipped_from=done + 1,
            skipped_to=to,
            skipped_since=gap,
            skipped_at=now,
            skip_owed=True,
            gap_since=0.0,
            waiting=0,
            updated_at=timezone.now(),
        )
        return bool(changed)

    @translated("record a skipped gap of an ordering key")
    def order_recorded(self, key: str, *, to: int, now: float, retention: float) -> bool:
        changed = OrderingSequence.objects.filter(key=key, skipped_to=to, skip_owed=True).update(
            skip_owed=False, updated_at=timezone.now()
        )
        return bool(changed)

    @translated("alert for an ordering key's wait")
    def order_alert(self, key: str, *, since: float, now: float, retention: float) -> bool:
        changed = (
            OrderingSequence.objects.filter(key=key, gap_since=since)
            .exclude(alerted=since)
            .update(alerted=since, updated_at=timezone.now())
        )
        return bool(changed)

    @translated("read the ordering keys that wait")
    def order_waits(self, *, now: float, limit: int) -> OrderWaits:
        waiting = OrderingSequence.objects.filter(gap_since__gt=0)  # the partial index guardrails_order_waiting
        oldest = tuple(
            OrderWait(key=row["key"], waiting_for=row["done"] + 1, lowest=row["waiting"], since=row["gap_since"])
            for row in waiting.order_by("gap_since").values("key", "done", "waiting", "gap_since")[:limit]
        )
        return OrderWaits(count=waiting.count() if len(oldest) >= limit else len(oldest), oldest=oldest)
