"""The broker lease heartbeat (celery_guardrails.broker.lease) on real ``celery worker`` subprocesses.

The broker is the shared Redis (this checkout's database) with a short ``visibility_timeout`` (VISIBILITY
seconds) and kombu's restore sweep turned up to every second (``unacked_restore_interval`` 1, throttle 1), so
that a delivery older than the timeout is given back within about a second, by whichever worker sweeps. Two
workers consume the test's queue: the one that does not run the task is the one a redelivery would reach. Runs
are counted by ``tests.proj.tasks.behave`` in a Redis counter and reported to a Redis list (the sink), so a
run on either worker is seen, whatever happens to the worker that ran it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_guardrails.broker.lease import BrokerLease, check_consumer_timeout, extend
from tests.conftest import Sink, unacked
from tests.proj import tasks
from tests.support.proxy import TcpProxy
from tests.support.services import BROKER_URLS, REDIS_URL, require
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env, quick_redelivery

#: Seconds a delivery may go without a heartbeat before kombu gives it back (transport option).
VISIBILITY = 3
#: The task runs three times as long.
RUN = 3 * VISIBILITY
TRANSPORT = quick_redelivery(VISIBILITY)


def workers(
    queue: str, tmp_path: Path, *, pool: str, lease: bool = True, count: int = 2, extra: tuple[str, ...] = ()
) -> list[WorkerProcess]:
    """``count`` workers of concurrency 1 on ``queue``, started side by side (each waited for until ready)."""
    settings = {} if lease else {"broker_lease": False}
    env = proj_env(
        queue=queue,
        GUARDRAILS_TEST_TRANSPORT_OPTIONS=json.dumps(TRANSPORT),
        GUARDRAILS_TEST_GUARDRAILS=json.dumps(settings),
    )
    started = [
        WorkerProcess(
            app=PROJ_APP, queue=queue, pool=pool, log_path=tmp_path / f"worker-{index}.log", env=env, extra=extra
        )
        for index in range(count)
    ]
    try:
        with ThreadPoolExecutor(count) as starting:
            list(starting.map(WorkerProcess.start, started))
    except BaseException:
        for worker in started:
            worker.kill()
        raise
    return started


def runs(sink: Sink) -> int:
    return int(sink.client.get(f"{sink.key}:runs") or 0)


@pytest.fixture
def sink_runs(sink: Sink) -> Iterator[Sink]:
    """The sink; afterwards its run counter and the test's other sinks (``<key>:<suffix>``) are removed."""
    yield sink
    left = sink.client.keys(f"{sink.key}:*")
    if left:
        sink.client.delete(*left)


@pytest.mark.parametrize("pool", ["prefork", "solo", "threads"])
def test_a_task_three_times_longer_than_the_visibility_timeout_runs_once(
    pool: str, celery_app: Any, broker_client: redis.Redis, sink_runs: Sink, queue_name: str, tmp_path: Path
) -> None:
    # Given two workers on the queue, with the heartbeat (the default), kombu giving back every second what is
    # older than the visibility timeout
    started = workers(queue_name, tmp_path, pool=pool)
    try:
        # When a guarded task runs three times as long as the visibility timeout, and another waits in a
        # worker's timer as long for its countdown (celery/celery#2599)
        result = tasks.behave.delay(sink_runs.key, [f"sleep:{RUN}"])
        later = Sink.of(f"{sink_runs.key}:eta")
        eta = tasks.behave.apply_async((later.key, ["sleep:0"]), countdown=RUN)

        # Then each completes, having run once: the other worker never got a copy
        assert result.get(timeout=RUN + 60)["run"] == 1
        assert eta.get(timeout=RUN + 60)["run"] == 1
        assert runs(sink_runs) == 1 and runs(later) == 1
        assert [report["run"] for report in sink_runs.items()] == [1]
        assert [report["run"] for report in later.items()] == [1]
        # ... its delivery is acked, and the worker that ran it said it extends its deliveries
        wait_for("the delivery acked", lambda: not unacked(str(result.id)))
        assert all("Broker lease: extending held deliveries every 1.0s" in worker.log for worker in started)
        assert not any("in unacked_index failed" in worker.log for worker in started)
    finally:
        for worker in started:
            worker.stop()


def test_without_the_heartbeat_the_same_task_runs_again_while_it_still_runs(
    celery_app: Any, broker_client: redis.Redis, sink_runs: Sink, queue_name: str, tmp_path: Path
) -> None:
    # Given the same two workers with the heartbeat turned off (broker_lease=False): kombu's fixed timeout; each
    # prefetches one message only, so that the one running the task cannot take its copy back for later
    started = workers(queue_name, tmp_path, pool="prefork", lease=False, extra=("--prefetch-multiplier", "1"))
    try:
        # When the same task runs three times as long as the visibility timeout
        tasks.behave.delay(sink_runs.key, [f"sleep:{RUN}"])

        # Then kombu gives its message back while it runs, and the other worker runs it a second time (this is
        # what the test above would see without the heartbeat: it can fail)
        reports = sink_runs.wait(2, timeout=RUN + 60)
        assert [report["run"] for report in reports[:2]] == [1, 2]
        assert reports[0]["pid"] != reports[1]["pid"]
        assert not any("Broker lease:" in worker.log for worker in started)
    finally:
        for worker in started:
            worker.kill()


@pytest.mark.parametrize("pool", ["prefork", "solo", "threads"])
def test_the_worker_running_it_is_killed_and_the_message_is_redelivered_to_the_other(
    pool: str, celery_app: Any, broker_client: redis.Redis, sink_runs: Sink, queue_name: str, tmp_path: Path
) -> None:
    # Given two workers with the heartbeat, and a long task running on one of them past its visibility timeout
    started = workers(queue_name, tmp_path, pool=pool)
    try:
        result = tasks.behave.delay(sink_runs.key, ["sleep:600", "sleep:0"])
        sink_runs.wait(1)
        running = wait_for("the worker that runs it", lambda: [w for w in started if str(result.id) in w.log])[0]
        other = next(worker for worker in started if worker is not running)
        began = time.monotonic()
        wait_for("the run past its visibility timeout", lambda: time.monotonic() - began > VISIBILITY + 1)
        assert runs(sink_runs) == 1

        # When that worker is SIGKILLed (main process and pool children)
        running.kill()
        killed = time.monotonic()

        # Then the message is given back and the other worker runs it again, to completion
        reports = sink_runs.wait(2)
        print(f"{pool}: redelivered {time.monotonic() - killed:.1f}s after the SIGKILL (visibility {VISIBILITY}s)")
        assert [report["run"] for report in reports] == [1, 2]
        assert result.get(timeout=60)["run"] == 2
        assert str(result.id) in other.log
    finally:
        for worker in started:
            worker.kill()


def test_a_tick_against_a_cut_broker_logs_and_the_next_one_extends(
    broker: str, broker_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a lease on a real kombu Redis channel reached through a TCP proxy, and two deliveries in kombu's
    # unacked index scored long ago, plus a tag that is not there (acked, or given back already)
    proxy = TcpProxy(6379)
    url = BROKER_URLS["redis"].replace(":6379/", f":{proxy.port}/")
    held, gone = f"gr-test-{uuid.uuid4().hex}", f"gr-test-{uuid.uuid4().hex}"
    broker_client.zadd("unacked_index", {held: 1000.0})
    try:
        with Connection(url, transport_options={"visibility_timeout": VISIBILITY}) as connection:
            channel = connection.default_channel
            with channel.conn_or_acquire() as client:
                lease = BrokerLease(interval=1.0)
                lease.target = (client, channel.unacked_index_key)

                # When the broker is cut away, twice
                proxy.cut()
                with caplog.at_level(logging.INFO, logger="celery_guardrails.broker.lease"):
                    assert lease.tick([held, gone]) is None
                    assert lease.tick([held, gone]) is None

                    # Then nothing is raised, one warning says so, the score is untouched ...
                    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
                    assert (
                        len(warnings) == 1
                        and "extending 2 delivery(ies) in unacked_index failed" in warnings[0].msg % warnings[0].args
                    )
                    assert broker_client.zscore("unacked_index", held) == 1000.0

                    # ... and once it is back the next tick extends the held one, and does not create the other
                    proxy.restore()
                    before = time.time()
                    assert lease.tick([held, gone]) == 1
                    assert any("extending deliveries again" in r.getMessage() for r in caplog.records)
                score = broker_client.zscore("unacked_index", held)
                assert score is not None and score >= before
                assert broker_client.zscore("unacked_index", gone) is None
    finally:
        broker_client.zrem("unacked_index", held, gone)
        proxy.close()


def test_extend_moves_only_tags_that_are_there(broker: str, broker_client: redis.Redis) -> None:
    # Given one tag in the index, scored long ago
    there, absent = f"gr-test-{uuid.uuid4().hex}", f"gr-test-{uuid.uuid4().hex}"
    broker_client.zadd("unacked_index", {there: 1000.0})
    try:
        # When both are extended (also: nothing at all)
        assert extend(broker_client, "unacked_index", []) == 0
        assert extend(broker_client, "unacked_index", [there, absent]) == 1

        # Then only the one there moved; the other was not re-created
        assert (broker_client.zscore("unacked_index", there) or 0) > 1000.0
        assert broker_client.zscore("unacked_index", absent) is None
    finally:
        broker_client.zrem("unacked_index", there, absent)


def test_rabbitmq_start_up_check_names_tasks_that_may_outlive_the_consumer_timeout(
    celery_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an app on RabbitMQ whose guarded tasks have no time limit, or one longer than the consumer timeout
    from celery_guardrails import GuardedTask

    celery_app.conf.broker_url = BROKER_URLS["amqp"]

    @celery_app.task(base=GuardedTask, bind=True, time_limit=60, shared=False)
    def short(self: Any) -> None: ...

    @celery_app.task(base=GuardedTask, bind=True, time_limit=7200, shared=False)
    def long_one(self: Any) -> None: ...

    # When the worker start-up check runs
    with caplog.at_level(logging.WARNING, logger="celery_guardrails.broker.lease"):
        named = check_consumer_timeout(celery_app)

    # Then the long one and those without a limit are named, not the short one
    assert long_one.name in named and short.name not in named
    assert tasks.behave.name in named
    assert "may run longer than RabbitMQ's consumer_timeout (1800s)" in caplog.text

    # ... and a queue declaring a shorter x-consumer-timeout makes the short one too long
    from kombu import Queue

    celery_app.conf.task_queues = [Queue("q", queue_arguments={"x-consumer-timeout": 30_000})]
    assert short.name in check_consumer_timeout(celery_app)
    # ... and on Redis there is nothing to check
    celery_app.conf.broker_url = REDIS_URL
    assert check_consumer_timeout(celery_app) == []


def test_the_heartbeat_outlives_a_broker_connection_cut_under_a_running_task(
    celery_app: Any, broker_client: redis.Redis, sink_runs: Sink, queue_name: str, tmp_path: Path
) -> None:
    # Given a worker whose broker connection goes through a TCP proxy, heartbeat every half second, running a
    # task four times as long as the visibility timeout, and a second worker, reached directly, to take a copy
    proxy = TcpProxy(6379)
    through = BROKER_URLS["redis"].replace(":6379/", f":{proxy.port}/")
    env = proj_env(
        queue=queue_name,
        GUARDRAILS_TEST_BROKER_URL=through,
        GUARDRAILS_TEST_TRANSPORT_OPTIONS=json.dumps(TRANSPORT),
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({"broker_lease_interval": 0.5}),
    )
    cut = WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "through-proxy.log", env=env).start()
    started = [cut]
    try:
        result = tasks.behave.delay(sink_runs.key, [f"sleep:{4 * VISIBILITY}"])
        sink_runs.wait(1)
        started += workers(queue_name, tmp_path, pool="prefork", count=1)

        # When its broker connection is cut until the consumer has seen it go (and failed to give back the
        # running task's message, as Celery does on a connection loss) and a heartbeat has failed; then the
        # consumer reconnects
        proxy.cut()
        for text in ("Connection to broker lost", "Cannot connect to", "in unacked_index failed"):
            wait_for(repr(text), lambda text=text: text in cut.log)
        proxy.restore()

        # Then the heartbeat goes on (the worker's thread said it failed, then extends again, and moves to the
        # new connection) and the task completes, having run once
        wait_for("the heartbeat back", lambda: "Broker lease: extending deliveries again" in cut.log)
        wait_for("the consumer back", lambda: cut.log.count("Connected to ") == 2)
        wait_for("the heartbeat moved", lambda: "extending through the new broker connection" in cut.log)
        assert result.get(timeout=60)["run"] == 1
        assert runs(sink_runs) == 1
        assert cut.process is not None and cut.process.poll() is None
        assert "Unrecoverable error" not in cut.log
    finally:
        for worker in started:
            worker.kill()
        proxy.close()


def test_a_worker_on_rabbitmq_warns_about_the_consumer_timeout_and_runs_no_heartbeat(
    queue_name: str, tmp_path: Path
) -> None:
    # Given a worker on RabbitMQ (which acks for real: no unacked index to extend)
    require("rabbitmq")
    env = proj_env(queue=queue_name, broker="amqp")
    worker = WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "amqp.log", env=env)

    # When it starts
    with worker:
        # Then it names the guarded tasks without a time limit, and starts no heartbeat
        assert "tests.proj.tasks.behave," in worker.log
        assert "may run longer than RabbitMQ's consumer_timeout (1800s)" in worker.log
        assert "Broker lease:" not in worker.log
    with Connection(BROKER_URLS["amqp"]) as connection, contextlib.suppress(*connection.channel_errors):
        connection.default_channel.queue_delete(queue_name)
