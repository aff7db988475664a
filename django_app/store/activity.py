"""Activity per minute in the Django database (the activity half of the Django store, mixed in; see
:mod:`celery_guardrails.operations.activity`).

One row per (minute, task, queue, outcome) (:class:`~django_celery_guardrails.models.ActivityCount`) and per
(minute, queue) (:class:`~django_celery_guardrails.models.QueueSample`). A batch of counts is one transaction
that first records its id (:class:`~django_celery_guardrails.models.ActivityBatch`: a batch sent again, its
answer lost, meets the unique id and adds nothing), then adds each count to its row (an UPDATE, or an INSERT in
a savepoint when the row is new; a concurrent first INSERT makes it an UPDATE again). The rows are written in
one order, their unique key's, whatever order the process counted them in: each write locks its row until the
commit, and two processes flushing the same rows in different orders (a prefork worker's children, each flushing
its own counts) would each wait for the other's lock, which PostgreSQL ends with "deadlock detected" and the
batch refused (issue #29). In one order, the later flush only waits for the earlier one's commit. It mirrors
``celery_guardrails/stores/redis_activity.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from datetime import datetime

from django.db import IntegrityError, transaction
from django.db.models import F

from celery_guardrails.stores.base import Activity, OutcomeCount, QueueSample

from ..models import ActivityBatch, ActivityCount
from ..models import QueueSample as QueueSampleRow
from .database import to_datetime, translated


class DjangoActivity:
    """The activity operations of :class:`~django_celery_guardrails.store.DjangoStore` (mixed in)."""

    @translated("add activity counts")
    def activity_add(self, counts: Iterable[OutcomeCount], *, batch: str, retention: float) -> None:
        rows: Counter[tuple[datetime, str, str, str]] = Counter()
        for count in counts:
            if count.count:
                rows[(to_datetime(count.minute), count.task[:255], count.queue[:255], count.outcome[:40])] += (
                    count.count
                )
        if not rows:
            return
        with transaction.atomic():
            try:
                with transaction.atomic():
                    ActivityBatch.objects.create(batch=batch)
            except IntegrityError:
                return  # added before
            for (minute, task_name, queue, outcome), added in sorted(rows.items()):
                match = {"minute": minute, "task_name": task_name, "queue": queue, "outcome": outcome}
                if ActivityCount.objects.filter(**match).update(count=F("count") + added):
                    continue
                try:
                    with transaction.atomic():
                        ActivityCount.objects.create(**match, count=added)
                except IntegrityError:
                    ActivityCount.objects.filter(**match).update(count=F("count") + added)

    @translated("keep queue samples")
    def activity_sample(self, samples: Iterable[QueueSample], *, retention: float) -> None:
        # In one order too (minute, queue), as the counts are.
        with transaction.atomic():
            for sample in sorted(samples, key=lambda sample: (sample.minute, sample.queue[:255])):
                values = {"depth": sample.depth, "oldest_age": sample.oldest_age}
                match = {"minute": to_datetime(sample.minute), "queue": sample.queue[:255]}
                if QueueSampleRow.objects.filter(**match).update(**values):
                    continue
                try:
                    with transaction.atomic():
                        QueueSampleRow.objects.create(**match, **values)
                except IntegrityError:
                    QueueSampleRow.objects.filter(**match).update(**values)

    @translated("read the activity")
    def activity_read(self, *, since: float, until: float) -> Activity:
        span = {"minute__gte": to_datetime(since), "minute__lt": to_datetime(until)}
        outcomes = [
            OutcomeCount(
                minute=row.minute.timestamp(), task=row.task_name, queue=row.queue, outcome=row.outcome, count=row.count
            )
            for row in ActivityCount.objects.filter(**span).order_by("minute", "task_name", "queue", "outcome")
        ]
        queues = [
            QueueSample(minute=row.minute.timestamp(), queue=row.queue, depth=row.depth, oldest_age=row.oldest_age)
            for row in QueueSampleRow.objects.filter(**span).order_by("minute", "queue")
        ]
        return Activity(outcomes=outcomes, queues=queues)
