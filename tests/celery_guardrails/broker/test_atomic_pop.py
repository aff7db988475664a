"""The atomic pop (celery_guardrails.broker.atomic_pop): a worker killed between a pop and its record loses nothing.

The gesture that loses a message with kombu's ``BRPOP`` (celery/kombu#305): the worker's main process is
waiting for its queue when a message is published; the server hands the message to the waiting connection;
the worker dies before it has read the reply and written the message to ``unacked``. Stopping the worker
(SIGSTOP) while the server sees it blocked on its queue, then publishing, then SIGKILLing it, does that every
time, on a real worker and the real broker. Channel-level tests drive the transport's own channel on the
broker's Redis.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Exchange, Queue

from celery_guardrails.broker import atomic_pop as broker_pop
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.proxy import TcpProxy
from tests.support.services import BROKER_URLS
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env, quick_redelivery

#: Seconds the worker's wait for its queue lasts on the server: long, so that it is still blocked when stopped.
LONG_WAIT = 60


def blocked_on(client: redis.Redis, name: str) -> str | None:
    """The command the broker connection named ``name`` is blocked in (CLIENT LIST flag ``b``), if any."""
    for entry in client.client_list():
        if entry.get("name") == name and "b" in entry.get("flags", ""):
            return str(entry["cmd"])
    return None


def a_worker(queue: str, tmp_path: Path, name: str, *, atomic: bool, label: str = "worker") -> WorkerProcess:
    options = {**quick_redelivery(3), "client_name": name, "brpop_timeout": LONG_WAIT, "guardrails_pop_wait": LONG_WAIT}
    env = proj_env(
        queue=queue,
        GUARDRAILS_TEST_TRANSPORT_OPTIONS=json.dumps(options),
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({} if atomic else {"broker_atomic_pop": False}),
    )
    return WorkerProcess(app=PROJ_APP, queue=queue, log_path=tmp_path / f"{label}.log", env=env)


def stop_while_blocked(worker: WorkerProcess, client: redis.Redis, name: str) -> str:
    """SIGSTOP the worker's main process at a moment the server sees its consumer blocked on the queue."""
    assert worker.process is not None
    while True:
        wait_for("the worker blocked on its queue", lambda: blocked_on(client, name))
        os.kill(worker.process.pid, signal.SIGSTOP)
        command = blocked_on(client, name)
        if command:  # still blocked once stopped: the wait lasts LONG_WAIT on the server
            return command
        os.kill(worker.process.pid, signal.SIGCONT)  # it had just been served: let it wait again


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic-pop", "kombu-pop"])
def test_a_worker_killed_while_a_message_is_handed_to_it_loses_nothing(
    atomic: bool, celery_app: Any, broker_client: redis.Redis, sink: Sink, queue_name: str, tmp_path: Path
) -> None:
    # Given a worker waiting for its queue, stopped while the server sees it blocked
    name = f"gr-pop-{uuid.uuid4().hex[:8]}"
    worker = a_worker(queue_name, tmp_path, name, atomic=atomic).start()
    try:
        # (the start-up summary line says which transport the worker uses, and that the extension chose it)
        summary = next(line for line in worker.log.splitlines() if "guarded task(s); broker: " in line)
        assert (
            "kombu's Redis transport replaced by celery_guardrails.broker.atomic_pop:Transport (atomic pop" in summary
        ) is atomic
        assert ("broker: transport redis as set" in summary) is not atomic
        command = stop_while_blocked(worker, broker_client, name)
        assert command == ("blmove" if atomic else "brpop")
        # When a task is published to it, and the worker is SIGKILLed before it could read the server's reply
        result = tasks.behave.delay(sink.key, ["sleep:0"])
        wait_for("the server done with the message", lambda: blocked_on(broker_client, name) is None)
        worker.kill()
        worker.wait(30)
    finally:
        worker.kill()
    queued = broker_client.llen(queue_name)
    recorded = any(str(result.id).encode() in raw for raw in broker_client.hvals("unacked"))
    if not atomic:
        # Then with kombu's BRPOP the server popped it into the dead connection: in no queue, not in unacked,
        # never to run (celery/kombu#305; this is what the atomic pop prevents, so the test can fail)
        assert (queued, recorded) == (0, False)
        return
    # Then with the atomic pop the server only woke the waiter: the message is still in the queue ...
    assert (queued, recorded) == (1, False)
    # ... and the next worker runs it, once
    with a_worker(queue_name, tmp_path, f"{name}-next", atomic=True, label="next"):
        assert result.get(timeout=60)["run"] == 1
    assert len(sink.items()) == 1


@pytest.fixture
def channel_on(queue_name: str) -> Iterator[Any]:
    """Opens the transport's channel on a Redis URL, consuming the test's queue (and others named)."""
    opened: list[Connection] = []

    def open_channel(url: str, *queues: str, **transport_options: Any) -> Any:
        connection = Connection(url, transport=broker_pop.TRANSPORT, transport_options=transport_options)
        opened.append(connection)
        channel = connection.channel()
        for name in (queue_name, *queues):
            Queue(name, Exchange(name, type="direct"), routing_key=name)(channel).declare()
        return connection, channel

    yield open_channel
    for connection in opened:
        connection.release()


def publish(channel: Any, queue: str, body: Any, **properties: Any) -> None:
    channel.basic_publish(channel.prepare_message(json.dumps(body), **properties), exchange=queue, routing_key=queue)


def consume(connection: Any, channel: Any, queues: list[str], count: int) -> list[Any]:
    """Consume ``count`` messages from ``queues`` (acked as they come), in the order the channel hands them out."""
    got: list[Any] = []

    def take(message: Any) -> None:
        got.append(json.loads(message.body))
        message.ack()

    for queue in queues:
        channel.basic_consume(queue, False, take, f"consumer-{queue}")
    while len(got) < count:
        with contextlib.suppress(TimeoutError, OSError):
            connection.drain_events(timeout=1)
    return got


@pytest.mark.smoke
def test_messages_come_in_order_by_priority_then_queue_and_nothing_stays_recorded(
    broker_client: redis.Redis, channel_on: Any, queue_name: str
) -> None:
    # Given 30 messages on the test's queue (one of them with priority 9: kombu's Redis priority 0 is the
    # highest, 9 the lowest), and 5 on a second queue
    other = f"{queue_name}-b"
    connection, channel = channel_on(BROKER_URLS["redis"], other, guardrails_pop_wait=0.1)
    try:
        for index in range(30):
            publish(channel, queue_name, index, priority=9 if index == 5 else 0)
        for index in range(5):
            publish(channel, other, f"b{index}")
        # When a channel consumes both
        got = consume(connection, channel, [queue_name, other], 35)
    finally:
        broker_client.delete(other)
    # Then each queue's messages came first in, first out, the low-priority one after the others of its queue
    mine = [item for item in got if isinstance(item, int)]
    assert mine == [i for i in range(30) if i != 5] + [5]
    assert [item for item in got if isinstance(item, str)] == [f"b{index}" for index in range(5)]
    # and every one of them was recorded as handed out and then acked: none is left in unacked
    assert not any(queue_name.encode() in raw for raw in broker_client.hvals("unacked"))


def test_a_delivery_that_fails_after_the_pop_stays_recorded_and_comes_back(
    broker_client: redis.Redis, channel_on: Any, queue_name: str
) -> None:
    # Given a message waiting, and a channel whose delivery to the consumer raises (a worker dying there)
    connection, channel = channel_on(BROKER_URLS["redis"], **quick_redelivery(3))
    publish(channel, queue_name, {"job": 1})

    def dies(message: Any) -> None:
        raise RuntimeError("the worker died here")

    channel.basic_consume(queue_name, False, dies, "consumer")
    # When the channel pops it and the delivery raises
    with pytest.raises(RuntimeError, match="died here"):
        for _ in range(20):
            with contextlib.suppress(TimeoutError):
                connection.drain_events(timeout=1)
    # Then the message was recorded as handed out in the pop's step: it is in kombu's unacked hash, not lost
    assert broker_client.llen(queue_name) == 0
    records = [raw for raw in broker_client.hvals("unacked") if queue_name.encode() in raw]
    assert len(records) == 1
    payload, exchange, routing_key = json.loads(records[0])
    assert (exchange, routing_key) == (queue_name, queue_name)
    assert json.loads(base64.b64decode(payload["body"])) == {"job": 1}
    # and kombu's restore gives it back to its queue once the visibility timeout has passed
    channel.qos.visibility_timeout = 0
    channel.qos.restore_visible(num=100, interval=1)
    assert broker_client.llen(queue_name) == 1
    assert not any(queue_name.encode() in raw for raw in broker_client.hvals("unacked"))


def test_a_queue_item_that_is_not_a_kombu_message_is_moved_aside_and_the_next_one_runs(
    celery_app: Any, broker_client: redis.Redis, sink: Sink, queue_name: str, tmp_path: Path
) -> None:
    # Given garbage pushed onto a worker's queue (not JSON, and JSON without a delivery tag), then a task
    junk = [f"not json {queue_name}".encode(), json.dumps({"body": queue_name, "properties": {}}).encode()]
    broker_client.lpush(queue_name, *junk)
    result = tasks.behave.delay(sink.key, ["sleep:0"])
    # When a worker consumes the queue
    with a_worker(queue_name, tmp_path, f"gr-pop-{uuid.uuid4().hex[:8]}", atomic=True) as worker:
        # Then the task runs, the worker lives, and each item is kept in the malformed list, logged
        assert result.get(timeout=60)["run"] == 1
        kept = [item for item in broker_client.lrange(broker_pop.MALFORMED_KEY, 0, -1) if queue_name.encode() in item]
        assert sorted(kept) == sorted(junk)
        assert worker.log.count("held an item that is not a kombu message") == 2
        assert worker.process is not None and worker.process.poll() is None


def test_a_message_redis_cannot_decode_but_python_can_is_taken_back_and_delivered(
    broker_client: redis.Redis, channel_on: Any, queue_name: str
) -> None:
    # Given a message whose header holds a lone surrogate (Celery's argsrepr does when an argument has one): the
    # pop script's decoder (Redis's cjson) refuses it, Python's reads it
    connection, channel = channel_on(BROKER_URLS["redis"], guardrails_pop_wait=0.1)
    publish(channel, queue_name, {"job": 1}, headers={"argsrepr": "['\ud800']"})
    publish(channel, queue_name, {"job": 2})
    # When a channel consumes the queue
    got = consume(connection, channel, [queue_name], 2)
    # Then both are delivered in order, none is left in the malformed list, and each was recorded as handed out
    # (acked now: nothing is left in unacked)
    assert got == [{"job": 1}, {"job": 2}]
    assert not any(queue_name.encode() in item for item in broker_client.lrange(broker_pop.MALFORMED_KEY, 0, -1))
    assert not any(queue_name.encode() in raw for raw in broker_client.hvals("unacked"))


def test_a_cut_broker_connection_while_waiting_reconnects_and_loses_nothing(
    celery_app: Any, broker_client: redis.Redis, sink: Sink, queue_name: str, tmp_path: Path
) -> None:
    # Given a worker whose broker connection goes through a proxy, waiting for its queue
    proxy = TcpProxy(6379)
    url = BROKER_URLS["redis"].replace(":6379/", f":{proxy.port}/")
    name = f"gr-pop-{uuid.uuid4().hex[:8]}"
    worker = a_worker(queue_name, tmp_path, name, atomic=True)
    worker.env["GUARDRAILS_TEST_BROKER_URL"] = url
    try:
        with worker:
            wait_for("the worker blocked on its queue", lambda: blocked_on(broker_client, name) == "blmove")
            # When the connection is cut, a task published meanwhile, and the broker given back
            proxy.cut()
            result = tasks.behave.delay(sink.key, ["sleep:0"])
            proxy.restore()
            # Then the worker reconnects and runs it, once
            assert result.get(timeout=90)["run"] == 1
            assert len(sink.items()) == 1
    finally:
        proxy.close()


def test_the_key_prefix_applies_to_every_key_the_pop_uses(
    broker_client: redis.Redis, channel_on: Any, queue_name: str
) -> None:
    # Given a channel with kombu's global_keyprefix, and three messages published through it
    prefix = f"gr-test-prefix-{uuid.uuid4().hex[:8]}:"
    connection, channel = channel_on(BROKER_URLS["redis"], global_keyprefix=prefix, guardrails_pop_wait=0.1)
    try:
        for index in range(3):
            publish(channel, queue_name, index)
        assert broker_client.llen(prefix + queue_name) == 3
        # When it consumes them, without acking yet
        held: list[Any] = []
        channel.basic_consume(queue_name, False, held.append, "consumer")
        while len(held) < 3:
            with contextlib.suppress(TimeoutError):
                connection.drain_events(timeout=1)
        # Then they were popped from the prefixed list, and recorded in the prefixed unacked keys
        assert [json.loads(message.body) for message in held] == [0, 1, 2]
        assert broker_client.llen(prefix + queue_name) == 0
        assert (broker_client.hlen(f"{prefix}unacked"), broker_client.zcard(f"{prefix}unacked_index")) == (3, 3)
        # and their acks remove those records
        for message in held:
            message.ack()
        assert (broker_client.hlen(f"{prefix}unacked"), broker_client.zcard(f"{prefix}unacked_index")) == (0, 0)
    finally:
        for key in broker_client.keys(f"{prefix}*"):
            broker_client.delete(key)


@pytest.mark.parametrize(
    ("conf", "settings", "chosen"),
    [
        ({"broker_url": "redis://127.0.0.1:6379/0"}, {}, True),
        ({"broker_url": "redis://a:6379/0;redis://b:6379/0"}, {}, True),
        ({"broker_url": "amqp://guest@127.0.0.1//"}, {}, False),
        ({"broker_url": "amqp://guest@127.0.0.1//", "broker_read_url": "redis://127.0.0.1:6379/0"}, {}, True),
        ({"broker_url": "rediss://127.0.0.1:6380/0"}, {}, False),
        ({"broker_url": "sentinel://127.0.0.1:26379"}, {}, False),
        ({"broker_url": "redis://127.0.0.1:6379/0", "broker_transport": "my.transport:Transport"}, {}, False),
        ({"broker_url": "redis://127.0.0.1:6379/0"}, {"broker_atomic_pop": False}, False),
    ],
)
def test_the_worker_chooses_the_transport_only_for_a_plain_redis_broker(
    conf: dict[str, str], settings: dict[str, Any], chosen: bool
) -> None:
    # Given an app with this broker and settings
    app = Celery(set_as_current=False)
    app.conf.update(conf, guardrails=settings)
    before = app.conf.broker_transport
    # When the worker starts, Then the transport is chosen only for redis:// with nothing else chosen
    assert broker_pop.configure(app) is chosen
    assert app.conf.broker_transport == (broker_pop.TRANSPORT if chosen else before)


def test_the_broker_cut_between_the_wait_and_the_pop_leaves_the_message_in_its_queue(
    broker_client: redis.Redis, queue_name: str
) -> None:
    # Given a channel reaching the broker through a proxy, and a message waiting
    proxy = TcpProxy(6379)
    url = BROKER_URLS["redis"].replace(":6379/", f":{proxy.port}/")
    cuts: list[bool] = []

    class CutBeforePop(broker_pop.Channel):  # type: ignore[misc]
        def _run_pop(self, keys: list[str], arguments: list[Any], *, script: str) -> Any:
            if not cuts:  # the first pop: the wait's reply is read, the script not sent yet
                cuts.append(True)
                proxy.cut()
            return super()._run_pop(keys, arguments, script=script)

    class Transport(broker_pop.Transport):  # type: ignore[misc]
        Channel = CutBeforePop

    got: list[Any] = []
    try:
        with Connection(url, transport=Transport, transport_options={"guardrails_pop_wait": 0.1}) as connection:
            channel = connection.channel()
            Queue(queue_name, Exchange(queue_name, type="direct"), routing_key=queue_name)(channel).declare()
            publish(channel, queue_name, {"job": 7})
            channel.basic_consume(queue_name, False, lambda message: got.append(message), "consumer")
            # When the connection is cut after the wait and before the pop script is sent
            with pytest.raises(connection.connection_errors):
                for _ in range(20):
                    with contextlib.suppress(TimeoutError):
                        connection.drain_events(timeout=1)
            # Then the pop raised the connection error (kombu's consumer reconnects on it), nothing was
            # delivered, and the message is still in its queue, recorded nowhere
            assert got == []
            assert broker_client.llen(queue_name) == 1
            assert not any(queue_name.encode() in raw for raw in broker_client.hvals("unacked"))
            # and once the broker is back, the next drain takes it
            proxy.restore()
            while not got:
                with contextlib.suppress(TimeoutError, *connection.connection_errors):
                    connection.drain_events(timeout=1)
            assert json.loads(got[0].body) == {"job": 7}
            got[0].ack()
    finally:
        proxy.close()


def test_a_flushed_script_cache_is_loaded_again(broker_client: redis.Redis, channel_on: Any, queue_name: str) -> None:
    # Given a channel that has popped once (its script loaded on the server)
    connection, channel = channel_on(BROKER_URLS["redis"], guardrails_pop_wait=0.1)
    publish(channel, queue_name, 1)
    publish(channel, queue_name, 2)
    got: list[Any] = []

    def take(message: Any) -> None:
        got.append(json.loads(message.body))
        message.ack()
        if len(got) == 1:
            # When the server's script cache is emptied (a restart, SCRIPT FLUSH) before the next pop
            broker_client.script_flush()

    channel.basic_consume(queue_name, False, take, "consumer")
    while len(got) < 2:
        with contextlib.suppress(TimeoutError):
            connection.drain_events(timeout=1)
    # Then the next pop loaded the script again and took the message
    assert got == [1, 2]


@pytest.mark.parametrize("refused", [["-blmove"], ["-evalsha", "-script"]], ids=["blmove", "script"])
def test_a_redis_that_refuses_the_atomic_pop_gets_kombus_pop_and_one_warning(
    refused: list[str],
    broker_client: redis.Redis,
    channel_on: Any,
    queue_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a broker user whose ACL refuses BLMOVE, or the pop script (as Redis before 6.2 has no BLMOVE)
    user, password = f"gr-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    broker_client.acl_setuser(
        user,
        enabled=True,
        passwords=[f"+{password}"],
        keys=["*"],
        channels=["*"],
        categories=["+@all"],
        commands=refused,
    )
    try:
        url = BROKER_URLS["redis"].replace("redis://", f"redis://{user}:{password}@")
        connection, channel = channel_on(url, guardrails_pop_wait=0.1)
        for index in range(3):
            publish(channel, queue_name, index)
        # When a channel consumes through it
        with caplog.at_level(logging.WARNING, logger="celery_guardrails.broker.atomic_pop"):
            got = consume(connection, channel, [queue_name], 3)
        # Then it pops as kombu does: every message, in order, none left recorded; and it said so once
        assert got == [0, 1, 2] and channel._atomic is False
        assert not any(queue_name.encode() in raw for raw in broker_client.hvals("unacked"))
        assert [r.getMessage()[:43] for r in caplog.records] == ["The broker's Redis refused the atomic pop ("]
    finally:
        broker_client.acl_deluser(user)


@pytest.fixture
def consumer_qos(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The QoS of a real channel of the atomic pop on the Redis broker, this thread taken for its consumer's (as
    ``_brpop_start`` takes it on a solo worker)."""
    import threading

    monkeypatch.setattr(broker_pop, "_consumer_pid", os.getpid())
    monkeypatch.setattr(broker_pop, "_consumer_thread", threading.get_ident())
    with Connection(BROKER_URLS["redis"], transport=broker_pop.TRANSPORT) as connection:
        yield connection.default_channel.qos


def _recorded(client: redis.Redis, tag: str) -> None:
    client.hset("unacked", tag, '[{}, "", ""]')
    client.zadd("unacked_index", {tag: 1.0})


@pytest.mark.parametrize(
    ("answer", "removed_by_the_worker"),
    [("acked", False), ("not acked", True), ("raises", True)],
)
def test_the_store_s_answer_is_read_as_the_worker_acks_and_a_doubt_lets_the_worker_ack(
    consumer_qos: Any, answer: str, removed_by_the_worker: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a delivery whose store ack was sent on the consumer's thread, its answer left to read at the ack
    client = redis.Redis.from_url(BROKER_URLS["redis"])
    tag = f"tests-{uuid.uuid4().hex}"
    _recorded(client, tag)  # (still recorded: the worker's own ack would remove it, the store's did not here)
    reads: list[str] = []

    def read() -> bool:
        reads.append(tag)
        if answer == "raises":
            raise RuntimeError("the answer could not be read")
        return answer == "acked"

    broker_pop.ACKED_BY_STORE.add(tag)
    assert broker_pop.read_at_ack(tag, read) is True
    assert reads == []  # nothing read yet

    # When the worker acks the delivery
    with caplog.at_level(logging.ERROR, logger="celery_guardrails.broker.atomic_pop"):
        consumer_qos.ack(tag)

    # Then the answer was read once, there; the worker's own ack removes the message only when the store's is in
    # doubt (not acked, or the answer could not be read: logged)
    assert reads == [tag]
    assert bool(client.hexists("unacked", tag)) is not removed_by_the_worker
    assert tag not in broker_pop.ACKED_BY_STORE and tag not in broker_pop.UNREAD
    assert ("could not be read" in caplog.text) is (answer == "raises")
    client.hdel("unacked", tag)
    client.zrem("unacked_index", tag)


def test_an_answer_sent_off_the_consumer_s_thread_is_read_at_once_and_unread_ones_are_bounded(
    consumer_qos: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    # Given answers of store acks
    reads: list[str] = []

    def reader(tag: str) -> Any:
        def read() -> bool:
            reads.append(tag)
            return True

        return read

    # When one is sent on another thread (a threads pool's), Then it is not kept to read at the ack
    kept: list[bool] = []
    other = threading.Thread(target=lambda: kept.append(broker_pop.read_at_ack("elsewhere", reader("elsewhere"))))
    other.start()
    other.join()
    assert kept == [False] and "elsewhere" not in broker_pop.UNREAD

    # And when more are left unread than the bound (deliveries the worker never acked), the oldest are read first,
    # in order, on this thread
    monkeypatch.setattr(broker_pop, "UNREAD_MAX", 3)
    tags = [f"tests-{uuid.uuid4().hex}" for _ in range(5)]
    for tag in tags:
        broker_pop.ACKED_BY_STORE.add(tag)
        assert broker_pop.read_at_ack(tag, reader(tag))
    assert reads == tags[:2] and list(broker_pop.UNREAD) == tags[2:]
    for tag in tags[2:]:
        consumer_qos.ack(tag)
    assert reads == tags and not broker_pop.UNREAD
    for tag in tags[:2]:
        broker_pop.ACKED_BY_STORE.discard(tag)


def test_at_shutdown_a_delivery_the_store_acked_is_not_given_back_and_its_answer_is_read(
    consumer_qos: Any,
) -> None:
    # Given a delivery still held by the channel (the worker's own ack has not come), whose store ack was sent and
    # its answer left to read
    client = redis.Redis.from_url(BROKER_URLS["redis"])
    tag = f"tests-{uuid.uuid4().hex}"
    _recorded(client, tag)
    reads: list[str] = []

    def read() -> bool:
        reads.append(tag)
        return True

    consumer_qos._delivered[tag] = None
    broker_pop.ACKED_BY_STORE.add(tag)
    broker_pop.read_at_ack(tag, read)

    # When the channel gives back what it holds (a worker shutting down)
    consumer_qos.restore_unacked()

    # Then the answer was read, and the delivery is not given back: it ran and its message is acked
    assert reads == [tag] and tag not in consumer_qos._delivered
    assert client.hexists("unacked", tag)  # (the store's script removes it; here, no restore touched it)
    assert tag not in broker_pop.ACKED_BY_STORE and tag not in broker_pop.UNREAD
    client.hdel("unacked", tag)
    client.zrem("unacked_index", tag)
