"""Queue depth and oldest age (celery_guardrails.broker.queues), read from the real broker without consuming."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_guardrails.broker.queues import QueueDepth, declared_queues, read_queues, tail_published_at
from celery_guardrails.runtime.headers import published_at
from tests.conftest import BOTH_BROKERS
from tests.proj import tasks
from tests.support.messages import publish_raw
from tests.support.services import BROKER_URLS, REDIS_URL, require
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

#: Seconds the reading clock is moved past the last publish (a controllable clock: nothing sleeps).
LATER = 30.0


def queue_of(app: Any, name: str, **kwargs: Any) -> QueueDepth:
    return next(queue for queue in read_queues(app, [name], **kwargs) if queue.queue == name)


@BOTH_BROKERS
def test_thirty_waiting_messages_then_drained_by_a_real_worker(
    broker: str, celery_app: Any, queue_name: str, tmp_path: Path
) -> None:
    # Given 30 messages published to the test's queue while no worker runs
    for index in range(30):
        tasks.log_line.delay(f"line {index}")
    published = time.time()

    # When the queue is read with a clock LATER seconds past the last publish
    queue = queue_of(celery_app, queue_name, now=published + LATER)

    # Then it holds 30; on Redis the oldest is at least LATER seconds old, on RabbitMQ its age is unknown
    assert queue.depth == 30
    if broker == "redis":
        assert queue.unknown_age is False
        assert queue.oldest_age is not None and queue.oldest_age >= LATER
        assert queue.oldest_published_at is not None and queue.oldest_published_at <= published
    else:
        assert queue.unknown_age is True and queue.oldest_age is None

    # When a real worker consumes the queue
    env = proj_env(queue=queue_name, broker=broker)
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env):
        # Then the depth falls to 0, and an empty queue's oldest age is 0 and known
        drained = wait_for("the queue drained", lambda: (q := queue_of(celery_app, queue_name)).depth == 0 and q)
    assert drained.oldest_age == 0.0 and drained.unknown_age is False


def test_a_raw_message_without_pub_is_counted_and_makes_the_age_unknown(
    broker: str, celery_app: Any, queue_name: str
) -> None:
    # Given a message published raw (no guardrails header, as plain Celery or another producer sends it),
    # then a guarded one behind it
    publish_raw(celery_app, queue_name, "tests.proj.tasks.log_line", args=["raw"])
    tasks.log_line.delay("guarded")

    # When the queue is read
    queue = queue_of(celery_app, queue_name)

    # Then both are counted, and the oldest's age is unknown: not 0, not the younger one's age
    assert queue.depth == 2
    assert queue.unknown_age is True and queue.oldest_age is None and queue.oldest_published_at is None


def test_a_tail_that_is_not_a_kombu_message_is_counted_with_an_unknown_age(
    broker: str, celery_app: Any, queue_name: str
) -> None:
    # Given a queue whose oldest entry is not a kombu message at all, and a guarded message after it
    client = redis.Redis.from_url(BROKER_URLS["redis"])
    client.lpush(queue_name, b"\xff not json")
    tasks.log_line.delay("guarded")

    # When the queue is read
    queue = queue_of(celery_app, queue_name)

    # Then both are counted and the age is unknown
    assert queue.depth == 2 and queue.unknown_age is True and queue.oldest_age is None


@pytest.fixture
def prefixed_app(queue_name: str) -> Iterator[tuple[Celery, str]]:
    """An app on the Redis broker with kombu's global_keyprefix; afterwards its keys are removed."""
    require("redis")
    prefix = f"gr-prefix-{uuid.uuid4().hex[:8]}:"
    app = Celery("gr-prefixed", set_as_current=False)
    app.conf.update(
        broker_url=BROKER_URLS["redis"],
        task_default_queue=queue_name,
        broker_transport_options={"global_keyprefix": prefix},
        guardrails={"store": REDIS_URL},
    )
    yield app, prefix
    client = redis.Redis.from_url(BROKER_URLS["redis"])
    left = client.keys(f"{prefix}*")
    if left:
        client.delete(*left)


def test_priority_lists_under_a_global_keyprefix_are_all_counted(prefixed_app: tuple[Celery, str]) -> None:
    app, prefix = prefixed_app
    queue_name = app.conf.task_default_queue
    client = redis.Redis.from_url(BROKER_URLS["redis"])
    # Given a message at priority 9 (the oldest), then one each at priorities 0, 3 and 6, published after it
    app.send_task("tests.proj.tasks.log_line", args=["first"], priority=9)
    lists = [key for key in client.keys(f"{prefix}{queue_name}*")]
    assert len(lists) == 1
    first = published_at(json.loads(client.lindex(lists[0], -1))["headers"]["guardrails"])
    assert first is not None
    wait_for("the clock to move past the first publish", lambda: round(time.time(), 3) > first)
    for priority in (0, 3, 6):
        app.send_task("tests.proj.tasks.log_line", args=[f"p{priority}"], priority=priority)
    # (kombu made one list per priority step, each under the prefix)
    keys = sorted(client.keys(f"{prefix}{queue_name}*"))
    assert len(keys) == 4 and all(key.startswith(prefix.encode()) for key in keys)
    assert any(key.endswith(b"\x06\x163") for key in keys)

    # When the queue is read through the app's connection
    queue = queue_of(app, queue_name)

    # Then the four lists are counted, and the oldest is the first message, whatever its list
    assert queue.depth == 4
    assert queue.unknown_age is False and queue.oldest_published_at == first
    others = [tail_published_at(client.lindex(key, -1)) for key in keys]
    assert min(p for p in others if p is not None) == first


def test_the_app_declared_queues_and_named_ones_are_read(broker: str, celery_app: Any, queue_name: str) -> None:
    # Given an app whose default queue is the test's, and another queue named by the caller
    other = f"{queue_name}-other"
    tasks.log_line.apply_async(args=["elsewhere"], queue=other)
    try:
        # When the queues are read with the other one named
        read = {queue.queue: queue for queue in read_queues(celery_app, [other])}

        # Then both are there: the default one empty, the named one with its message
        assert declared_queues(celery_app, [other]) == [queue_name, other]
        assert read[queue_name].depth == 0 and read[other].depth == 1
    finally:
        redis.Redis.from_url(BROKER_URLS["redis"]).delete(other)
