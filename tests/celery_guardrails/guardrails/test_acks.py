"""The completion with the ack (celery_guardrails.guardrails.acks): where the store is the broker's Redis, a keyed
task completes its key and acks its message in one script, with its result where the result backend is that
Redis too. On the store, then on real solo workers whose store and broker are the same Redis: SIGKILLed right
after that step, and with the Redis cut away as the body returns.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.backends.base import DisabledBackend
from celery.backends.redis import RedisBackend

from celery_guardrails.broker import atomic_pop
from celery_guardrails.guardrails.acks import _shared_backend, shared_records
from celery_guardrails.stores.base import BrokerAck, ResultWrite
from celery_guardrails.stores.redis import RedisStore
from tests.conftest import Sink, unacked
from tests.proj import tasks
from tests.support.proxy import TcpProxy
from tests.support.services import REDIS_URL
from tests.support.shared_redis import effects, shared_worker
from tests.support.waiting import wait_for

TIMEOUT = 60


@pytest.fixture
def store() -> RedisStore:
    return RedisStore(REDIS_URL)


@pytest.fixture
def oid() -> int:
    return random.randrange(10**9)


def recorded(client: Any, ack: BrokerAck) -> tuple[bool, bool]:
    """Whether kombu's two records of the delivery are there: (in the unacked hash, in its index)."""
    return bool(client.hexists(ack.unacked, ack.tag)), client.zscore(ack.index, ack.tag) is not None


def delivery_recorded(store: RedisStore) -> BrokerAck:
    """A delivery recorded as kombu records one handed out (in private keys of this test)."""
    run = uuid.uuid4().hex
    ack = BrokerAck(unacked=f"gr-test-unacked-{run}", index=f"gr-test-unacked-index-{run}", tag=f"tag-{run}")
    store.client.hset(ack.unacked, ack.tag, "[message]")
    store.client.zadd(ack.index, {ack.tag: 1.0})
    return ack


# -- the store ---------------------------------------------------------------------------------------------


def test_complete_and_ack_completes_the_key_and_removes_the_delivery_in_one_step(store: RedisStore) -> None:
    # Given a claimed key and its message's delivery recorded by kombu
    key, ack = f"acks-{uuid.uuid4().hex}", delivery_recorded(store)
    store.claim(key, owner="w:1:t:1", now=1000.0, lease=60, retention=600)
    # When the owner completes it with the ack
    done = store.send_complete_and_ack(key, owner="w:1:t:1", now=1001.0, summary="'ok'", retention=600, ack=ack)()
    # Then the key is completed and neither of kombu's records is left
    assert done is True
    assert store.inspect(key)["state"] == "completed"  # type: ignore[index]
    assert recorded(store.client, ack) == (False, False)
    # And a repeat by the same owner (its first answer lost) completes nothing new and finds nothing to ack
    assert (
        store.send_complete_and_ack(key, owner="w:1:t:1", now=1002.0, summary="'ok'", retention=600, ack=ack)() is True
    )
    assert store.inspect(key)["completed_at"] == "1001.0"  # type: ignore[index]


def test_a_key_taken_over_is_not_completed_but_the_message_is_acked(store: RedisStore) -> None:
    # Given a key another delivery took over
    key, ack = f"acks-{uuid.uuid4().hex}", delivery_recorded(store)
    store.claim(key, owner="w:1:t:1", now=1000.0, lease=1, retention=600)
    store.claim(key, owner="w:2:t:2", now=1010.0, lease=60, retention=600)
    # When the first owner completes it with the ack
    done = store.send_complete_and_ack(key, owner="w:1:t:1", now=1011.0, summary="'ok'", retention=600, ack=ack)()
    # Then the key stays the other delivery's, and the message is acked as the worker would ack it
    assert done is False
    assert store.inspect(key)["owner"] == "w:2:t:2"  # type: ignore[index]
    assert recorded(store.client, ack) == (False, False)


def result_of(key: str, value: str, expires: int | None = 3600) -> ResultWrite:
    return ResultWrite(key=f"celery-task-meta-{key}", value=value, expires=expires)


def test_a_result_rides_between_the_completion_and_the_ack_and_reaches_its_waiters(store: RedisStore) -> None:
    # Given a claimed key, its message's delivery recorded, and a client waiting on the result's channel
    key, ack = f"acks-{uuid.uuid4().hex}", delivery_recorded(store)
    store.claim(key, owner="w:1:t:1", now=1000.0, lease=60, retention=600)
    result = result_of(key, '{"status": "SUCCESS", "result": 7}')
    waiter = store.client.pubsub()
    waiter.subscribe(result.key)
    assert waiter.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
    # When the owner completes it with the ack and its result
    done = store.send_complete_and_ack(
        key, owner="w:1:t:1", now=1001.0, summary="7", retention=600, ack=ack, result=result
    )()
    # Then the key is completed, the message acked, the result stored for its expiry, and the waiter told
    assert done is True and store.inspect(key)["state"] == "completed"  # type: ignore[index]
    assert recorded(store.client, ack) == (False, False)
    assert store.client.get(result.key) == result.value.encode()  # type: ignore[union-attr]
    assert 3590 <= store.client.ttl(result.key) <= 3600
    message = waiter.get_message(timeout=5)
    assert message is not None and (message["type"], message["data"]) == ("message", result.value.encode())  # type: ignore[union-attr]
    waiter.close()
    # And a result kept for ever (no result_expires) is stored without an expiry
    forever_key, forever_ack = f"acks-{uuid.uuid4().hex}", delivery_recorded(store)
    store.claim(forever_key, owner="w:1:t:2", now=1000.0, lease=60, retention=600)
    forever = result_of(forever_key, "{}", expires=None)
    store.send_complete_and_ack(
        forever_key, owner="w:1:t:2", now=1001.0, summary="", retention=600, ack=forever_ack, result=forever
    )()
    assert store.client.ttl(forever.key) == -1
    store.client.delete(result.key, forever.key)


SUCCESS = '{"status": "SUCCESS", "result": "theirs"}'


@pytest.mark.parametrize("taken_over", [False, True], ids=["completed", "taken over"])
@pytest.mark.parametrize(
    ("stored", "kept"),
    [
        (None, False),
        ('{"status": "STARTED", "result": {"pid": 1}}', False),  # task_track_started's
        ('{"status": "RETRY", "result": null}', False),
        (SUCCESS, True),
        ("not JSON", False),  # not known to be a success
    ],
    ids=["none", "started", "retry", "a success", "not json"],
)
def test_a_result_is_written_unless_a_success_is_stored_as_celery_keeps_the_first_success(
    store: RedisStore, stored: str | None, kept: bool, taken_over: bool
) -> None:
    # Given a claimed key (or one another delivery took over), and what the result's key holds already
    key, ack = f"acks-{uuid.uuid4().hex}", delivery_recorded(store)
    store.claim(key, owner="w:1:t:1", now=1000.0, lease=1, retention=600)
    if taken_over:
        store.claim(key, owner="w:2:t:2", now=1010.0, lease=60, retention=600)
    result = result_of(key, '{"status": "SUCCESS", "result": "mine"}')
    if stored is not None:
        store.client.set(result.key, stored)
    # When the first owner completes it with the ack and its result
    done = store.send_complete_and_ack(
        key, owner="w:1:t:1", now=1011.0, summary="", retention=600, ack=ack, result=result
    )()
    # Then the key is completed unless it was taken over, the message is acked either way, and the result is
    # written unless a success was stored already (Celery's backend keeps the first success)
    assert done is (not taken_over) and recorded(store.client, ack) == (False, False)
    assert store.client.get(result.key) == (stored if kept else result.value).encode()  # type: ignore[union-attr]
    store.client.delete(result.key)


def test_ack_removes_both_records_and_says_whether_the_delivery_was_there(store: RedisStore) -> None:
    ack = delivery_recorded(store)
    assert store.send_ack(ack)() is True
    assert recorded(store.client, ack) == (False, False)
    assert store.send_ack(ack)() is False


# -- when the store is the broker's -----------------------------------------------------------------------


def app_on(broker: str, *, transport: str | None = atomic_pop.TRANSPORT, **options: Any) -> Celery:
    app = Celery(f"acks-{uuid.uuid4().hex[:6]}", broker=broker)
    app.conf.broker_transport = transport
    app.conf.broker_transport_options = options
    return app


#: Brokers named by how they differ from the store's URL (each test process has a database of its own).
BROKERS = {
    "same": lambda url: url,
    "another database": lambda url: url.rsplit("/", 1)[0] + "/15",
    "another port": lambda url: url.replace(":6379", ":6380"),
    "a failover list": lambda url: f"{url};{url}",
}


@pytest.mark.parametrize(
    ("broker", "transport", "options", "expected"),
    [
        ("same", atomic_pop.TRANSPORT, {}, ("unacked", "unacked_index")),
        ("same", atomic_pop.TRANSPORT, {"global_keyprefix": "p:"}, ("p:unacked", "p:unacked_index")),
        ("same", atomic_pop.TRANSPORT, {"unacked_key": "u", "unacked_index_key": "ui"}, ("u", "ui")),
        # another database of the same server, another port, kombu's own pop: not the broker's records
        ("another database", atomic_pop.TRANSPORT, {}, None),
        ("another port", atomic_pop.TRANSPORT, {}, None),
        ("same", None, {}, None),
        ("a failover list", atomic_pop.TRANSPORT, {}, None),
    ],
)
def test_the_store_acks_only_on_the_brokers_own_database(
    store: RedisStore, broker: str, transport: str | None, options: dict[str, str], expected: Any
) -> None:
    assert shared_records(app_on(BROKERS[broker](REDIS_URL), transport=transport, **options), store) == expected


class OtherRedisBackend(RedisBackend):
    """A subclass of Celery's Redis backend: it may write its results otherwise."""


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        (lambda app: RedisBackend(app=app, url=REDIS_URL), True),
        (lambda app: RedisBackend(app=app, url=BROKERS["another database"](REDIS_URL)), False),
        (lambda app: RedisBackend(app=app, url=BROKERS["another port"](REDIS_URL)), False),
        (lambda app: OtherRedisBackend(app=app, url=REDIS_URL), False),
        (lambda app: RedisBackend(app=app, url=REDIS_URL, serializer="pickle"), False),
        (lambda app: DisabledBackend(app=app), False),
    ],
    ids=["same", "another database", "another port", "a subclass", "pickled results", "no backend"],
)
def test_a_result_rides_only_on_celerys_redis_backend_on_the_stores_own_database(
    store: RedisStore, backend: Any, expected: bool
) -> None:
    assert _shared_backend(backend(app_on(REDIS_URL)), store) is expected


# -- on a real worker -------------------------------------------------------------------------------------------


#: Each kind of guarded task the store acks: (task name, its call, its key's prefix or None).
KINDS = {
    "keyed, results ignored (completion rides the ack)": (
        "charge_quietly",
        lambda oid, sink: (oid, sink),
        "charge",
    ),
    "keyed, results stored (the completion and the result ride the ack)": (
        "charge",
        lambda oid, sink: (oid, sink),
        "charge",
    ),
    "not keyed": ("behave", lambda oid, sink: (sink, ["ok"]), None),
}


@pytest.mark.parametrize("store_acks", [True, False], ids=["store_acks", "celery_acks"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_worker_killed_after_the_last_hook_leaves_no_message_to_deliver_again(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path, store_acks: bool, kind: str
) -> None:
    # Given a solo worker whose store is the broker's Redis, SIGKILLed once a guarded task's hooks have all run
    # (Celery's task_postrun: after the completion, before Celery's own ack)
    name, call, key = KINDS[kind]
    task = getattr(tasks, name)
    with shared_worker(
        queue_name, tmp_path, store_acks=store_acks, env={"GUARDRAILS_TEST_KILL_AFTER": task.name}
    ) as worker:
        # When the task runs there
        result = task.apply_async(call(oid, sink.key))
        wait_for("the worker killed", lambda: worker.process.poll() is not None, timeout=TIMEOUT)  # type: ignore[union-attr]
    # Then the body ran once, and a keyed task's key is completed (and its result stored, where it keeps one)
    assert len(sink.items()) == 1
    if key is not None:
        assert RedisStore(REDIS_URL).inspect(f"{task.name}:-:{key}:{oid}")["state"] == "completed"  # type: ignore[index]
    if not task.ignore_result:
        assert result.get(timeout=TIMEOUT) is not None
    if store_acks:
        # and the store acked the message: nothing of it is left to deliver again
        assert not unacked(result.id)
    else:
        # (Celery's ack had not come: the broker delivers the message again later, a keyed one is then skipped)
        assert unacked(result.id)
        client = redis.Redis.from_url(REDIS_URL)
        client.hdel("unacked", *[tag for tag, raw in client.hgetall("unacked").items() if result.id.encode() in raw])


# (results stored: in the smoke subset, run on the oldest and newest Celery, whose result backends it writes as)
@pytest.mark.parametrize("kind", ["results ignored", pytest.param("results stored", marks=pytest.mark.smoke)])
def test_the_redis_cut_as_the_body_returns_the_completion_lands_once_it_is_back(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path, proxy: TcpProxy, kind: str
) -> None:
    # Given a solo worker whose broker, store and result backend are the same Redis, through a proxy, running a
    # keyed task held at a gate after its effect (its result ignored, or stored: riding the ack with its completion)
    url = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
    gate = f"{sink.key}:gate"
    task = tasks.charge_quietly if kind == "results ignored" else tasks.charge
    with shared_worker(queue_name, tmp_path, url=url, env={"GUARDRAILS_TEST_RESULT_URL": url}) as worker:
        result = task.apply_async((oid, sink.key), {"gate": gate})
        wait_for("the body ran", lambda: effects(sink) == 1, timeout=TIMEOUT)
        # When the Redis is cut away just as the body returns
        proxy.cut()
        sink.client.rpush(gate, "go")
        # Then the worker keeps asking to complete the key, and completes it once the Redis is back
        wait_for("the completion retried", lambda: "not completed yet" in worker.log, timeout=TIMEOUT)
        proxy.restore()
        key = f"{task.name}:-:charge:{oid}"
        wait_for(
            "the key completed",
            lambda: (RedisStore(REDIS_URL).inspect(key) or {}).get("state") == "completed",
            timeout=TIMEOUT,
        )
        # And the message is gone from the broker without a second run (a redelivery is skipped as a duplicate)
        wait_for("the message acked", lambda: not unacked(result.id), timeout=TIMEOUT)
        # (the completion was to ride the ack: it was made on its own once the ack could not carry it)
        assert "completed without the ack" in worker.log
        # and a stored result is there, as Celery stores it
        if kind == "results stored":
            assert result.get(timeout=TIMEOUT) == f"charged {oid}"
    assert effects(sink) == 1 and [item["run"] for item in sink.items()] == [1]


@pytest.fixture(autouse=True)
def _no_leftover_gates(sink: Sink) -> Iterator[None]:
    yield
    sink.client.delete(f"{sink.key}:gate")


@pytest.mark.parametrize(("pool", "concurrency"), [("threads", 4), ("prefork", 2)])
def test_on_threads_and_prefork_every_message_is_acked_once_and_every_key_completed_once(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path, pool: str, concurrency: int
) -> None:
    # Given a worker of that pool whose store is the broker's Redis (threads: the store acks, each thread on its
    # own connection; prefork: the children complete their keys, the main process acks as Celery does)
    oids = [random.randrange(10**9) for _ in range(40)]
    with shared_worker(queue_name, tmp_path, pool=pool, concurrency=concurrency) as worker:
        # When keyed tasks whose results are ignored, and keyed tasks whose results are stored, run there at once
        quiet = [tasks.charge_quietly.delay(oid, sink.key) for oid in oids[:20]]
        stored = [tasks.charge.delay(oid, sink.key) for oid in oids[20:]]
        assert [result.get(timeout=TIMEOUT) for result in stored] == [f"charged {oid}" for oid in oids[20:]]
        wait_for("every body ran", lambda: effects(sink) == 40, timeout=TIMEOUT)
        # Then every message is acked, and the worker met no error on the way (the start-up audit logs its own)
        wait_for("every message acked", lambda: not any(unacked(r.id) for r in quiet + stored), timeout=TIMEOUT)
        for trouble in ("Traceback", "not acked on the store", "not completed yet", "taken over"):
            assert trouble not in worker.log
    # And each key is completed, each body ran once
    store = RedisStore(REDIS_URL)
    names = ["charge_quietly"] * 20 + ["charge"] * 20
    assert all(
        (store.inspect(f"tests.proj.tasks.{name}:-:charge:{oid}") or {}).get("state") == "completed"
        for name, oid in zip(names, oids, strict=True)
    )
    assert effects(sink) == 40 and len(sink.items()) == 40
