"""Effect-side helpers and the retention of idempotency records."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import transaction

from django_celery_guardrails.effects import mark_processed, transition
from django_celery_guardrails.maintenance import prune
from django_celery_guardrails.models import DeadLetter, IdempotencyKey, ProcessedMessage, ScheduledRun, SealedMessage
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db


def test_transition_changes_once() -> None:
    order = Order.objects.create(status="pending")
    orders = Order.objects.filter(pk=order.pk)
    assert [transition(orders, "status", "pending", "paid") for _ in range(3)] == [True, False, False]
    assert Order.objects.get(pk=order.pk).status == "paid"


def test_mark_processed_inside_the_effects_transaction() -> None:
    with transaction.atomic():
        assert mark_processed("msg-1") is True
        assert mark_processed("msg-1") is False
    assert ProcessedMessage.objects.filter(key="msg-1").count() == 1


def test_prune_deletes_only_what_is_past_retention() -> None:
    now = datetime.now(UTC)
    old, fresh = now - timedelta(days=8), now - timedelta(days=1)
    IdempotencyKey.objects.create(key="old-done", state="completed", finished_at=old)
    IdempotencyKey.objects.create(key="old-failed", state="failed", finished_at=old)
    IdempotencyKey.objects.create(key="fresh", state="completed", finished_at=fresh)
    IdempotencyKey.objects.create(key="running", state="claimed", lease_until=now)
    # a claim whose holder died 8 days ago and whose message never came back
    IdempotencyKey.objects.create(key="abandoned", state="claimed", lease_until=old)
    ProcessedMessage.objects.create(key="p-old")
    ProcessedMessage.objects.filter(key="p-old").update(processed_at=old)
    letters = {
        status: DeadLetter.objects.create(
            task_name="t",
            task_id=f"dl-{status}",
            reason="permanent",
            first_failed_at=now,
            last_failed_at=now,
            status=status,
            handled_at=now - timedelta(days=100),
        )
        for status in ("open", "resolved", "discarded", "replayed")
    }
    # a closed record's sealed copy goes with it
    SealedMessage.objects.create(dead_letter=letters["discarded"], token="sealed-token")
    # scheduled runs: two old records and a fresh one of one schedule; the only (old) record of another
    # schedule is its horizon and stays
    for schedule, age in (("nightly", 100), ("nightly", 95), ("nightly", 1), ("quarterly", 120)):
        ScheduledRun.objects.create(schedule=schedule, period=now - timedelta(days=age), status="ok")
    assert prune(dry_run=True) == {
        "idempotency_keys": 3,
        "processed_messages": 1,
        "dead_letters": 3,
        "scheduled_runs": 2,
        "checkpoints": 0,
        "lost_slot_holders": 0,
        "ordering_keys": 0,
        "activity_counts": 0,
        "activity_batches": 0,
        "queue_samples": 0,
        "jobs": 0,
    }
    out = StringIO()
    call_command("guardrails_prune", stdout=out)
    assert out.getvalue().strip() == (
        "Deleted 3 idempotency key(s), 1 processed-message record(s), 3 closed dead letter(s) and 2 "
        "scheduled-run record(s); 0 checkpoint(s), 0 lost slot holder(s) and 0 idle ordering key(s); 0 activity "
        "count(s), 0 activity batch id(s) and 0 queue sample(s); 0 finished job(s)."
    )
    assert sorted(ScheduledRun.objects.values_list("schedule", flat=True)) == ["nightly", "quarterly"]
    assert sorted(IdempotencyKey.objects.values_list("key", flat=True)) == ["fresh", "running"]
    assert list(DeadLetter.objects.values_list("pk", flat=True)) == [letters["open"].pk]  # open: never pruned
    assert not SealedMessage.objects.exists()
    assert prune(older_than=3600) == {
        "idempotency_keys": 1,
        "processed_messages": 0,
        "dead_letters": 0,
        "scheduled_runs": 0,
        "checkpoints": 0,
        "lost_slot_holders": 0,
        "ordering_keys": 0,
        "activity_counts": 0,
        "activity_batches": 0,
        "queue_samples": 0,
        "jobs": 0,
    }


def test_the_prune_task_for_beat() -> None:
    from django_celery_guardrails.tasks import prune_task

    IdempotencyKey.objects.create(key="old", state="completed", finished_at=datetime.now(UTC) - timedelta(days=9))
    assert prune_task.apply().get() == {
        "idempotency_keys": 1,
        "processed_messages": 0,
        "dead_letters": 0,
        "scheduled_runs": 0,
        "checkpoints": 0,
        "lost_slot_holders": 0,
        "ordering_keys": 0,
        "activity_counts": 0,
        "activity_batches": 0,
        "queue_samples": 0,
        "jobs": 0,
    }


def test_prune_takes_ages() -> None:
    # Given a completed key finished three hours ago
    IdempotencyKey.objects.create(key="3h", state="completed", finished_at=datetime.now(UTC) - timedelta(hours=3))
    # When the command is asked for what is older than 4h, then 2h
    for age, expected in (("4h", "Would delete 0 idempotency key(s)"), ("2h", "Would delete 1 idempotency key(s)")):
        out = StringIO()
        call_command("guardrails_prune", "--older-than", age, "--dry-run", stdout=out)
        # Then the age is read in hours
        assert out.getvalue().startswith(expected), out.getvalue()
