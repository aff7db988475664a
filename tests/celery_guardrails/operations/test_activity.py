"""The activity on real workers and real stores: outcomes counted per minute by every prefork child and added
up in the store, the counts of a warm shutdown flushed at exit, a flush the store refuses kept and sent once
when it is back, queue samples taken once a minute (by a worker's watchdog thread too), and the rates the
status command derives from them."""

from __future__ import annotations

import json
import os
import random
import signal
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_guardrails.foundation.clock import set_file_clock
from celery_guardrails.operations import activity
from celery_guardrails.stores.base import OutcomeCount, QueueSample
from celery_guardrails.stores.redis import RedisStore
from tests.conftest import BOTH_BROKERS, Sink
from tests.proj import tasks
from tests.support.proxy import TcpProxy
from tests.support.services import REDIS_URL
from tests.support.stores import forget
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env


@pytest.fixture
def base() -> Any:
    """A minute in an hour of its own (2001-2011): no other test's activity is in it."""
    hour = 978_307_200 + random.randrange(0, 90_000) * 3600
    yield float(hour + 600)
    forget("redis", f"guardrails:{{activity}}:{hour}")


def outcomes_of(store: Any, base: float, task: str, queue: str) -> Counter[str]:
    found: Counter[str] = Counter()
    for item in store.activity_read(since=base, until=base + 60).outcomes:
        if item.task == task and item.queue == queue:
            found[item.outcome] += item.count
    return found


def worker(
    tmp_path: Path, queue: str, base: float, *, name: str = "worker", pool: str = "prefork", **settings: Any
) -> WorkerProcess:
    clock = tmp_path / f"{name}.clock"
    set_file_clock(clock, base + 5)
    config = {"clock": "celery_guardrails.foundation.clock.file_clock", "activity_flush_interval": 0.3, **settings}
    return WorkerProcess(
        app=PROJ_APP,
        queue=queue,
        pool=pool,
        concurrency=2 if pool == "prefork" else 1,
        log_path=tmp_path / f"{name}.log",
        env=proj_env(queue=queue, GUARDRAILS_CLOCK_FILE=str(clock), GUARDRAILS_TEST_GUARDRAILS=json.dumps(config)),
    )


def test_outcomes_of_every_prefork_child_are_added_up_per_minute(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path, base: float
) -> None:
    # Given a prefork worker with two children, metrics off and the activity on (its default), on a clock
    # standing in one minute
    store = RedisStore(REDIS_URL)
    with worker(tmp_path, queue_name, base):
        # When 16 tasks succeed, 2 fail permanently and 1 fails once (transient) and then succeeds (16: with 6, a
        # busy host once let one child run them all)
        results = [tasks.behave.delay(f"{sink.key}:ok{i}", ["ok"]) for i in range(16)]
        refused = [tasks.behave.delay(f"{sink.key}:no{i}", ["permanent"]) for i in range(2)]
        flaky = tasks.behave.delay(f"{sink.key}:flaky", ["transient", "ok"])
        for result in [*results, flaky]:
            result.get(timeout=60)
        for result in refused:
            with pytest.raises(Exception, match="refused"):
                result.get(timeout=60)
        # Then the minute holds each delivery's ending once, whichever child ran it
        expected = Counter({"succeeded": 17, "dead_lettered": 2, "retried": 1})
        wait_for("every ending added", lambda: outcomes_of(store, base, tasks.behave.name, queue_name) == expected)
    pids = {item["pid"] for item in Sink(f"{sink.key}:ok0").items()} | {
        item["pid"] for i in range(1, 16) for item in Sink(f"{sink.key}:ok{i}").items()
    }
    assert len(pids) == 2, "both children ran some"
    assert outcomes_of(store, base, tasks.behave.name, queue_name) == expected


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_warm_shutdown_flushes_what_each_child_counted(
    pool: str, celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path, base: float
) -> None:
    # Given a worker that would flush only once an hour (prefork: each child counts; solo: the main process)
    store = RedisStore(REDIS_URL)
    process = worker(tmp_path, queue_name, base, pool=pool, activity_flush_interval=3600.0)
    with process:
        for result in [tasks.behave.delay(f"{sink.key}:{i}", ["ok"]) for i in range(5)]:
            result.get(timeout=60)
        assert outcomes_of(store, base, tasks.behave.name, queue_name) == Counter()
        # When it is told to stop (SIGTERM to the main process: a warm shutdown, as a deploy does)
        assert process.process is not None
        os.kill(process.process.pid, signal.SIGTERM)
        process.wait(30)
    # Then the children's counts were added as they exited
    assert outcomes_of(store, base, tasks.behave.name, queue_name) == Counter({"succeeded": 5})


def test_a_flush_the_store_refuses_is_kept_and_sent_once_when_it_is_back(base: float) -> None:
    # Given a recorder whose store is reached through a proxy, with counts of one minute
    proxy = TcpProxy(6379)
    try:
        url = REDIS_URL.replace(":6379", f":{proxy.port}")
        app = Celery("activity-cut", set_as_current=False)
        app.conf.guardrails = {"store": url, "store_timeout": 2.0, "clock": lambda: base + 1}
        recorder = activity.Recorder(app)
        task = f"tests.activity.{uuid.uuid4().hex[:8]}"
        for _ in range(3):
            recorder.count(task, "q", "succeeded")
        # When the store is cut at the flush
        proxy.cut()
        assert recorder.flush() is False
        # Then nothing is lost: the batch is kept, and more counts gather beside it
        recorder.count(task, "q", "retried")
        assert recorder.pending() == 4
        # And when the store is back, the next flush sends both batches, each once, even if sent again
        proxy.restore()
        assert recorder.flush() is True
        assert recorder.pending() == 0
        assert recorder.flush() is True
        assert outcomes_of(RedisStore(REDIS_URL), base, task, "q") == Counter({"succeeded": 3, "retried": 1})
    finally:
        proxy.close()


def test_counts_past_the_retention_are_dropped_while_the_store_stays_away(base: float) -> None:
    # Given a recorder whose store cannot be reached, holding a minute's counts
    clock = [base]
    app = Celery("activity-away", set_as_current=False)
    app.conf.guardrails = {
        "store": "redis://127.0.0.1:1/0",
        "store_timeout": 0.5,
        "clock": lambda: clock[0],
        "activity_retention": 120.0,
    }
    recorder = activity.Recorder(app)
    recorder.count("t", "q", "succeeded")
    assert recorder.flush() is False and recorder.pending() == 1
    # When more than the retention has passed, with newer counts
    clock[0] = base + 300
    recorder.count("t", "q", "succeeded")
    assert recorder.flush() is False
    # Then the old minute is dropped (bounded memory), the new one kept
    assert recorder.pending() == 1


@BOTH_BROKERS
def test_queue_samples_once_a_minute_with_depth_and_age(
    broker: str, celery_app: Any, queue_name: str, tmp_path: Path, base: float
) -> None:
    # Given 30 messages published while no worker runs
    for i in range(30):
        tasks.behave.apply_async((f"s{i}", ["ok"]), queue=queue_name)
    store = RedisStore(REDIS_URL)
    clock = tmp_path / "clock"
    set_file_clock(clock, base + 5)
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "clock": lambda: float(clock.read_text())}
    # When one worker samples, and another within the lease
    first = activity.sample_queues(celery_app, owner=f"a-{uuid.uuid4().hex}", names=[queue_name])
    second = activity.sample_queues(celery_app, owner=f"b-{uuid.uuid4().hex}", names=[queue_name])
    try:
        # Then only the first read the queues, and its sample is kept for the clock's minute
        assert first is not None and second is None
        [kept] = [s for s in store.activity_read(since=base, until=base + 60).queues if s.queue == queue_name]
        assert kept.depth == 30
        if broker == "redis":
            assert kept.oldest_age is not None and kept.oldest_age >= 0
        else:  # RabbitMQ gives no age without consuming: unknown, never 0
            assert kept.oldest_age is None
    finally:
        store.client.delete(activity.sample_key(celery_app, activity_queues(celery_app, queue_name)))


def activity_queues(app: Any, queue: str) -> list[str]:
    from celery_guardrails.broker.queues import declared_queues

    return declared_queues(app, [queue])


def test_a_workers_watchdog_thread_samples_its_queue(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path, base: float
) -> None:
    # Given a worker whose watchdog ticks every half second
    store = RedisStore(REDIS_URL)
    key = activity.sample_key(celery_app, activity_queues(celery_app, queue_name))
    store.client.delete(key)
    with worker(tmp_path, queue_name, base, watchdog_interval=0.5):
        # Then a sample of the queue it consumes is kept for its clock's minute
        wait_for(
            "a sample of the worker's queue",
            lambda: any(s.queue == queue_name for s in store.activity_read(since=base, until=base + 60).queues),
        )
    store.client.delete(key)


def test_rates_in_and_out_per_queue_from_the_last_whole_minutes(celery_app: Any, base: float) -> None:
    # Given five whole minutes in which 50 deliveries from a queue ended (10 a minute), its depth sampled at
    # 40 at the first and 60 at the last (arrivals outran them by 4 a minute), and a minute still counting
    store = RedisStore(REDIS_URL)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    task = f"tests.activity.{uuid.uuid4().hex[:8]}"
    start = base - 5 * 60
    store.activity_add(
        [OutcomeCount(minute=start + m * 60, task=task, queue=queue, outcome="succeeded", count=10) for m in range(5)]
        + [OutcomeCount(minute=base, task=task, queue=queue, outcome="succeeded", count=99)],
        batch=uuid.uuid4().hex,
        retention=3600,
    )
    store.activity_sample([QueueSample(minute=start, queue=queue, depth=40, oldest_age=3.0)], retention=3600)
    store.activity_sample([QueueSample(minute=base, queue=queue, depth=60, oldest_age=9.0)], retention=3600)
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "store": REDIS_URL}
    # When the rates are read 30 s into the current minute
    found = activity.rates(celery_app, current=base + 30)[queue]
    # Then out is 10 a minute (the current minute left out) and in is out plus the depth's change, 4 a minute
    assert (found.completed, found.arrived, found.minutes) == (10.0, 14.0, 5)


def test_hours_of_outcomes_and_of_queue_ages_for_the_charts(base: float) -> None:
    hour = base - 600
    starts = activity.hour_starts(hour + 3 * 3600 + 5, 3)
    assert starts == [hour + 3600, hour + 7200, hour + 10800]
    data = activity.Activity(
        outcomes=[
            OutcomeCount(minute=hour, task="t", queue="q", outcome="succeeded", count=9),  # before the first hour
            OutcomeCount(minute=hour + 3600, task="t", queue="q", outcome="succeeded", count=2),
            OutcomeCount(minute=hour + 3660, task="t", queue="r", outcome="succeeded", count=3),
            OutcomeCount(minute=hour + 10800, task="t", queue="q", outcome="retried", count=1),
        ],
        queues=[
            QueueSample(minute=hour + 3600, queue="q", depth=1, oldest_age=4.0),
            QueueSample(minute=hour + 3660, queue="q", depth=1, oldest_age=7.0),
            QueueSample(minute=hour + 7200, queue="q", depth=1, oldest_age=None),
        ],
    )
    assert activity.hourly_outcomes(data, starts) == {
        "t": [Counter({"succeeded": 5}), Counter(), Counter({"retried": 1})]
    }
    assert activity.hourly_queue_ages(data, starts) == {"q": [7.0, None, None]}
