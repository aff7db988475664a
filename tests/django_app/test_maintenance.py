"""Prune at scale: closed records deleted a batch per transaction, walking the ids once; what must stay stays."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.db.models.signals import pre_delete
from django.test.utils import CaptureQueriesContext

from celery_guardrails.stores.base import OutcomeCount, QueueSample
from django_celery_guardrails.maintenance import delete_in_batches, prune
from django_celery_guardrails.models import (
    ActivityBatch,
    ActivityCount,
    Checkpoint,
    ConcurrencySlot,
    DeadLetter,
    IdempotencyKey,
    OrderingSequence,
    SealedMessage,
)
from django_celery_guardrails.models import QueueSample as QueueSampleRow
from django_celery_guardrails.store import DjangoStore

pytestmark = pytest.mark.django_db(transaction=True)
NOW = datetime(2026, 11, 30, 8, tzinfo=UTC)


def letters(count: int, *, status: str, handled_days_ago: float | None) -> list[DeadLetter]:
    handled = None if handled_days_ago is None else NOW - timedelta(days=handled_days_ago)
    return DeadLetter.objects.bulk_create(
        DeadLetter(
            task_name="shop.tasks.charge",
            task_id=f"prune-{uuid.uuid4()}",
            reason="permanent",
            first_failed_at=NOW - timedelta(days=200),
            last_failed_at=NOW - timedelta(days=200),
            status=status,
            handled_at=handled,
        )
        for _ in range(count)
    )


def deletes_of(queries: CaptureQueriesContext, table: str) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if q["sql"].startswith(f'DELETE FROM "{table}"')]


def test_prune_deletes_closed_records_a_batch_per_transaction_and_leaves_the_rest() -> None:
    # Given 25 records closed long ago (interleaved with 3 open ones and 4 closed lately), 5 with sealed copies
    old = letters(10, status="resolved", handled_days_ago=100)
    open_ = letters(3, status="open", handled_days_ago=None)
    old += letters(15, status="discarded", handled_days_ago=120)
    recent = letters(4, status="replayed", handled_days_ago=1)
    SealedMessage.objects.bulk_create(SealedMessage(dead_letter=record, token="t") for record in old[::5])
    SealedMessage.objects.create(dead_letter=recent[0], token="kept")
    # When prune runs with batches of 10
    with CaptureQueriesContext(connection) as queries:
        counts = prune(older_than=90 * 86400, now=NOW, batch=10)
    # Then the 25 went in three DELETEs of at most 10 records, each in its own transaction
    assert counts["dead_letters"] == 25
    deletes = deletes_of(queries, "guardrails_deadletter")
    assert [len(re.findall(r"\d+", sql.split(" IN ", 1)[1].split(")")[0])) for sql in deletes] == [10, 10, 5]
    # And the open records, the recent ones and the recent one's sealed copy stay; the old copies went
    left = set(DeadLetter.objects.values_list("pk", flat=True))
    assert left == {r.pk for r in open_ + recent}
    assert list(SealedMessage.objects.values_list("token", flat=True)) == ["kept"]


def test_each_batch_is_its_own_transaction() -> None:
    # Given 25 records closed long ago, and a record of the second batch whose deletion fails
    old = letters(25, status="resolved", handled_days_ago=100)
    doomed = old[13].pk

    def refuse(sender: object, instance: DeadLetter, **_: object) -> None:
        if instance.pk == doomed:
            raise RuntimeError("the database went away")

    pre_delete.connect(refuse, sender=DeadLetter)
    try:
        # When prune runs with batches of 10
        with pytest.raises(RuntimeError, match="went away"):
            prune(older_than=90 * 86400, now=NOW, batch=10)
    finally:
        pre_delete.disconnect(refuse, sender=DeadLetter)
    # Then the first batch is gone for good, and the failed batch was rolled back whole
    assert set(DeadLetter.objects.values_list("pk", flat=True)) == {r.pk for r in old[10:]}


def test_the_ids_are_read_a_batch_at_a_time_walking_upwards_once() -> None:
    # Given 30 failed keys finished long ago
    IdempotencyKey.objects.bulk_create(
        IdempotencyKey(key=f"k-{n:02d}", state="failed", finished_at=NOW - timedelta(days=30)) for n in range(30)
    )
    stale = IdempotencyKey.objects.filter(state="failed", finished_at__lt=NOW - timedelta(days=7))
    # When they are deleted 12 at a time
    with CaptureQueriesContext(connection) as queries:
        deleted = delete_in_batches(stale, batch=12)
    # Then all 30 went in three batches, and each read of ids starts after the last batch (never from the
    # lowest id again)
    assert deleted == 30 and not IdempotencyKey.objects.exists()
    reads = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT") and " LIMIT 12" in q["sql"]]
    assert len(reads) == 3
    assert '"id" >' not in reads[0] and all('"id" >' in sql for sql in reads[1:]), reads


def test_prune_deletes_stale_checkpoints_old_lost_holders_and_idle_finished_ordering_keys() -> None:
    # Given checkpoints saved 10 days and 1 hour ago (updated_at is set on save: moved back by an UPDATE)
    Checkpoint.objects.create(key="job:old", position=500)
    Checkpoint.objects.create(key="job:fresh", position=100)
    Checkpoint.objects.filter(key="job:old").update(updated_at=NOW - timedelta(days=10))
    Checkpoint.objects.filter(key="job:fresh").update(updated_at=NOW - timedelta(hours=1))
    # and slot holders: one lost 100 days ago, one lost yesterday, one held (whatever its age)
    long_ago = NOW - timedelta(days=100)
    for holder, state, reaped in (("a", "lost", long_ago), ("b", "lost", NOW - timedelta(days=1)), ("c", "held", None)):
        ConcurrencySlot.objects.create(
            key="limit:tenant:acme",
            holder=holder,
            state=state,
            acquired_at=long_ago,
            heartbeat_at=long_ago,
            reaped_at=reaped,
        )
    # and ordering keys idle 40 days: one with every number done, one with a message still to run; one fresh
    for key, issued, done, idle_days in (("ord:done", 7, 7, 40), ("ord:pending", 8, 7, 40), ("ord:fresh", 3, 3, 1)):
        OrderingSequence.objects.create(key=key, issued=issued, done=done)
        OrderingSequence.objects.filter(key=key).update(updated_at=NOW - timedelta(days=idle_days))
    # When prune runs with the default retentions
    counts = prune(now=NOW)
    # Then only what is past its retention and finished went
    assert (counts["checkpoints"], counts["lost_slot_holders"], counts["ordering_keys"]) == (1, 1, 1)
    assert list(Checkpoint.objects.values_list("key", flat=True)) == ["job:fresh"]
    assert sorted(ConcurrencySlot.objects.values_list("holder", flat=True)) == ["b", "c"]
    assert sorted(OrderingSequence.objects.values_list("key", flat=True)) == ["ord:fresh", "ord:pending"]


def test_prune_deletes_the_activity_past_its_retention() -> None:
    # Given outcome counts, their batch ids and queue samples of 3 days ago and of an hour ago
    store = DjangoStore()
    for age, batch in ((timedelta(days=3), "old"), (timedelta(hours=1), "fresh")):
        minute = (NOW - age).replace(second=0, microsecond=0).timestamp()
        store.activity_add(
            [OutcomeCount(minute=minute, task="t", queue="q", outcome="succeeded", count=2)], batch=batch, retention=1
        )
        store.activity_sample([QueueSample(minute=minute, queue="q", depth=1, oldest_age=2.0)], retention=1)
    ActivityBatch.objects.filter(batch="old").update(added_at=NOW - timedelta(days=3))
    ActivityBatch.objects.filter(batch="fresh").update(added_at=NOW - timedelta(hours=1))
    # When prune runs with the default activity_retention (2 days)
    counts = prune(now=NOW)
    # Then the old day's records went, the last hour's stay
    assert (counts["activity_counts"], counts["activity_batches"], counts["queue_samples"]) == (1, 1, 1)
    assert [row.minute for row in ActivityCount.objects.all()] == [
        (NOW - timedelta(hours=1)).replace(second=0, microsecond=0)
    ]
    assert list(ActivityBatch.objects.values_list("batch", flat=True)) == ["fresh"]
    assert QueueSampleRow.objects.count() == 1
