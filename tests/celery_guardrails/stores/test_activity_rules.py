"""Both real stores keep the activity per minute the same way: counts added (a batch once), queue samples
replaced per minute, read back by a half-open range of minutes."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_guardrails.stores.base import OutcomeCount, QueueSample
from tests.support.stores import forget

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def base(kind: str) -> Iterator[float]:
    """An hour of its own (in 2001-2011), so no other test's activity is in the hours read."""
    hour = 978_307_200 + random.randrange(0, 90_000) * 3600
    yield float(hour)
    for offset in range(-1, 4):
        forget(kind, f"guardrails:{{activity}}:{hour + offset * 3600}")


def counts(base: float, task: str, *rows: tuple[int, str, str, int]) -> list[OutcomeCount]:
    return [
        OutcomeCount(minute=base + minute * 60, task=task, queue=queue, outcome=outcome, count=n)
        for minute, queue, outcome, n in rows
    ]


def test_counts_add_up_per_minute_task_queue_and_outcome(store: Any, base: float) -> None:
    # Given two worker processes' batches for one task, over two minutes and two outcomes
    task = f"tests.activity.{uuid.uuid4().hex[:8]}"
    store.activity_add(
        counts(base, task, (0, "q", "succeeded", 3), (0, "q", "retried", 1), (1, "q", "succeeded", 2)),
        batch=uuid.uuid4().hex,
        retention=3600,
    )
    store.activity_add(
        counts(base, task, (0, "q", "succeeded", 4), (1, "other", "succeeded", 5)),
        batch=uuid.uuid4().hex,
        retention=3600,
    )
    # When the two minutes are read
    found = store.activity_read(since=base, until=base + 120)
    # Then each (minute, task, queue, outcome) holds the sum of both, oldest minute first
    assert [(c.minute - base, c.task, c.queue, c.outcome, c.count) for c in found.outcomes] == [
        (0, task, "q", "retried", 1),
        (0, task, "q", "succeeded", 7),
        (60, task, "other", "succeeded", 5),
        (60, task, "q", "succeeded", 2),
    ]
    assert found.queues == []


def test_a_batch_sent_twice_is_added_once(store: Any, base: float) -> None:
    # Given a batch the store added, whose answer the recorder never saw
    task = f"tests.activity.{uuid.uuid4().hex[:8]}"
    batch = uuid.uuid4().hex
    store.activity_add(counts(base, task, (0, "q", "succeeded", 3)), batch=batch, retention=3600)
    # When the recorder sends it again, unchanged, and then a new batch
    store.activity_add(counts(base, task, (0, "q", "succeeded", 3)), batch=batch, retention=3600)
    store.activity_add(counts(base, task, (0, "q", "succeeded", 1)), batch=uuid.uuid4().hex, retention=3600)
    # Then the repeated batch counted once
    assert [c.count for c in store.activity_read(since=base, until=base + 60).outcomes] == [4]


def test_the_range_is_half_open_and_spans_hours(store: Any, base: float) -> None:
    # Given counts in the last minute of one hour, the first of the next, and two hours on
    task = f"tests.activity.{uuid.uuid4().hex[:8]}"
    store.activity_add(
        counts(base, task, (59, "q", "succeeded", 1), (60, "q", "succeeded", 2), (180, "q", "succeeded", 3)),
        batch=uuid.uuid4().hex,
        retention=3600,
    )

    # When ranges are read that cut between them
    def minutes(since: float, until: float) -> list[float]:
        return [(c.minute - base) / 60 for c in store.activity_read(since=base + since, until=base + until).outcomes]

    # Then each holds exactly the minutes from its start (included) to its end (excluded)
    assert minutes(59 * 60, 181 * 60) == [59, 60, 180]
    assert minutes(60 * 60, 180 * 60) == [60]
    assert minutes(0, 59 * 60) == []


def test_a_queue_sample_replaces_the_minutes_earlier_one(store: Any, base: float) -> None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    # Given a sample of a queue, then a second one in the same minute, and one the next minute with no known age
    store.activity_sample([QueueSample(minute=base, queue=queue, depth=30, oldest_age=12.5)], retention=3600)
    store.activity_sample([QueueSample(minute=base, queue=queue, depth=31, oldest_age=14.0)], retention=3600)
    store.activity_sample([QueueSample(minute=base + 60, queue=queue, depth=2, oldest_age=None)], retention=3600)
    # When they are read
    found = store.activity_read(since=base, until=base + 120).queues
    # Then the minute keeps the second; an unknown age stays unknown, never 0
    assert [(s.minute - base, s.queue, s.depth, s.oldest_age) for s in found] == [
        (0, queue, 31, 14.0),
        (60, queue, 2, None),
    ]


def test_names_with_any_characters_come_back_as_they_went(store: Any, base: float) -> None:
    task = f'tests.activity."odd",[name]|{uuid.uuid4().hex[:8]}'
    store.activity_add(counts(base, task, (0, 'q"|,]', "dead_lettered", 1)), batch=uuid.uuid4().hex, retention=3600)
    [found] = store.activity_read(since=base, until=base + 60).outcomes
    assert (found.task, found.queue) == (task, 'q"|,]')


def test_the_redis_activity_expires_after_its_retention(kind: str, store: Any, base: float) -> None:
    if kind == "django":
        pytest.skip("the database keeps it until guardrails_prune")
    task = f"tests.activity.{uuid.uuid4().hex[:8]}"
    store.activity_add(counts(base, task, (0, "q", "succeeded", 1)), batch=uuid.uuid4().hex, retention=100)
    client = store.client.connected() if kind == "redis-cluster" else store.client
    ttl = client.ttl(f"guardrails:{{activity}}:{int(base)}")
    assert 100 < ttl <= 100 + 3600  # the retention plus the hour the hash spans


def test_a_stray_field_in_a_redis_hour_is_skipped_not_fatal(kind: str, store: Any, base: float) -> None:
    if kind == "django":
        pytest.skip("Redis only: a hash anyone can write to")
    task = f"tests.activity.{uuid.uuid4().hex[:8]}"
    store.activity_add(counts(base, task, (0, "q", "succeeded", 2)), batch=uuid.uuid4().hex, retention=3600)
    client = store.client.connected() if kind == "redis-cluster" else store.client
    client.hset(f"guardrails:{{activity}}:{int(base)}", "not json", "x")
    client.hset(f"guardrails:{{activity}}:{int(base)}", '["q", 1]', "[1]")
    assert [c.count for c in store.activity_read(since=base, until=base + 60).outcomes] == [2]
