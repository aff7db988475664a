"""The Redis store's overlapped completion, when something goes wrong between sending it and reading its
answer (real Redis: a flushed script cache, a connection killed by the server)."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from celery_guardrails.stores.redis import IDEM_PREFIX, RedisStore
from tests.support.services import REDIS_URL, require

T0 = 1_800_000_000.0


@pytest.fixture
def store() -> RedisStore:
    require("redis")
    return RedisStore(REDIS_URL)


@pytest.fixture
def key() -> str:
    return f"tests.redis:-:{uuid.uuid4().hex}"


def test_a_completion_sent_before_its_script_was_loaded_completes(store: RedisStore, key: str) -> None:
    # Given a claimed key and a server that forgot every script (a restart, SCRIPT FLUSH)
    store.claim(key, owner="a", now=T0, lease=10, retention=600)
    store.client.script_flush()
    # When the completion is started (EVALSHA answers NOSCRIPT) and its answer read
    done = store.begin_complete(key, owner="a", now=T0 + 1, summary="charged", retention=600)()
    # Then it was completed by loading the script, once
    assert done is True
    assert store.inspect(key) is not None
    assert store.inspect(key)["summary"] == "charged"


def test_a_completion_whose_connection_broke_before_its_answer_is_completed_again(key: str) -> None:
    # Given a store whose connections carry a name, a claimed key, and a server pausing writes
    require("redis")
    name = f"tests-{uuid.uuid4().hex[:8]}"
    store = RedisStore(f"{REDIS_URL}?client_name={name}")
    store.claim(key, owner="a", now=T0, lease=10, retention=600)
    admin = redis.Redis.from_url(REDIS_URL)
    admin.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
    try:
        # When the completion is sent and the server kills its connection before running it
        wait = store.begin_complete(key, owner="a", now=T0 + 1, summary="charged", retention=600)
        killed = [c["id"] for c in admin.client_list() if c["name"] == name and c["cmd"] == "evalsha"]
        for client_id in killed:
            admin.client_kill_filter(_id=client_id)
        assert killed, "the completion never reached the server"
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    # Then reading its answer completes the key over a new connection
    assert admin.hget(IDEM_PREFIX + key, "state") == b"claimed"
    assert wait() is True
    assert store.inspect(key)["summary"] == "charged"


def test_a_command_sent_while_a_completion_is_in_flight_gets_its_own_answer(store: RedisStore, key: str) -> None:
    # Given a completion sent and not read yet, on this thread's connection
    other = f"{key}-other"
    store.claim(key, owner="a", now=T0, lease=10, retention=600)
    wait = store.begin_complete(key, owner="a", now=T0 + 1, summary="charged", retention=600)
    # When another key is claimed, and then found busy, before that answer is read
    first = store.claim(other, owner="b", now=T0 + 2, lease=10, retention=600)
    second = store.claim(other, owner="c", now=T0 + 3, lease=10, retention=600)
    # Then each command got its own answer, and the completion's answer is still there for its waiter
    assert (first.state, second.state, second.lease_until) == ("acquired", "busy", T0 + 12)
    assert wait() is True
    assert store.inspect(key)["state"] == "completed"


def test_under_green_threads_the_store_keeps_to_its_pool(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    # Given threading.local patched as gevent and eventlet patch it (a local per greenlet: a lane there would
    # be a connection per task)
    require("redis")

    class GreenLocal(threading.local):
        pass

    monkeypatch.setattr(threading, "local", GreenLocal)
    name = f"tests-{uuid.uuid4().hex[:8]}"
    store = RedisStore(f"{REDIS_URL}?client_name={name}")
    # When a key is claimed and completed
    assert store.claim(key, owner="a", now=T0, lease=10, retention=600).state == "acquired"
    assert store.begin_complete(key, owner="a", now=T0 + 1, summary="charged", retention=600)() is True
    # Then that went through the pool: no lane connection, one pooled connection to the server
    assert store._lane.available is False
    assert getattr(store._lane.local, "connection", None) is None
    admin = redis.Redis.from_url(REDIS_URL)
    assert [c["name"] for c in admin.client_list()].count(name) == 1
    assert store.inspect(key)["summary"] == "charged"
