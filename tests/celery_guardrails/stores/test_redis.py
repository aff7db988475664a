"""The Redis store's overlapped completion, when something goes wrong between sending it and reading its
answer (real Redis: a flushed script cache, a connection killed by the server)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

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


def test_an_interruption_between_send_and_read_leaves_no_answer_for_the_next_command(
    store: RedisStore, key: str
) -> None:
    from billiard.exceptions import SoftTimeLimitExceeded

    # Given a command sent on the lane, and a soft time limit raised into the thread before its answer is read
    lane = store._lane
    assert lane.call("PING") in (True, b"PONG")  # the lane's connection is open
    connection = lane._ready()
    read = connection.read_response

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        connection.read_response = read
        raise SoftTimeLimitExceeded()

    store.client.set(key, "mine")
    connection.read_response = interrupted
    with pytest.raises(SoftTimeLimitExceeded):
        lane.call("INCR", f"{key}:n")  # sent; its answer (an integer) never read
    # When the thread sends its next command, Then it reads that command's answer, not the one left behind
    assert lane.call("GET", key) == b"mine"


def test_leases_are_measured_on_the_servers_clock(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    import time

    import celery_guardrails.stores.redis_idempotency as redis_store  # (where the store reads its clock)

    # Given a worker whose clock runs 100 s behind (its store measures the offset against Redis's TIME)
    real = time.time
    behind = RedisStore(REDIS_URL)
    monkeypatch.setattr(redis_store.time, "time", lambda: real() - 100)
    claim = behind.claim(key, owner="late", now=redis_store.time.time(), lease=10, retention=600)
    monkeypatch.setattr(redis_store.time, "time", real)
    assert claim.state == "acquired"
    # When a worker with the right time looks at the key at once
    busy = RedisStore(REDIS_URL).claim(key, owner="on-time", now=time.time(), lease=10, retention=600)
    # Then the lease is live (on its own clock the slow worker's lease ended 90 s ago: it would be taken over)
    assert (busy.state, busy.owner) == ("busy", "late")
    assert busy.lease_until == pytest.approx(time.time() + 10, abs=2)


def test_a_server_in_a_failover_is_unavailable_not_refusing(store: RedisStore) -> None:
    from celery_guardrails.exceptions import StoreError, StoreUnavailableError

    # Given the errors redis-py raises for replies of a server that will answer later (the code taken out of
    # the text), for a script's error reply that keeps it, and for a reply that refuses the data
    later = [
        redis.exceptions.MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
        redis.exceptions.TryAgainError("Multiple keys request during rehashing of slot"),
        redis.exceptions.ClusterDownError("The cluster is down"),
        redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"),
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis.ResponseError("MASTERDOWN Link with MASTER is down (from a script)"),
        # and what redis-py's cluster client raises when it gives up following slots or finding a node
        redis.exceptions.ClusterError("TTL exhausted."),
        redis.exceptions.SlotNotCoveredError("Command # 1 (EVALSHA) of slot 42 is not covered by the cluster"),
        redis.exceptions.RedisClusterException("Redis Cluster cannot be connected. Please provide at least one"),
        redis.exceptions.RedisClusterException("All slots are not covered after query all startup_nodes."),
    ]
    refused = [
        redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        redis.exceptions.RedisClusterException("EVALSHA - all keys must map to the same key slot"),
    ]
    # Then the first are outages (the message comes back later), the last are refusals
    assert [type(store._failure(exc)) for exc in later] == [StoreUnavailableError] * len(later)
    assert [type(store._failure(exc)) for exc in refused] == [StoreError] * len(refused)


def test_a_ledger_written_before_the_hash_tag_is_adopted_on_upgrade(store: RedisStore) -> None:
    import json

    from celery_guardrails.stores.redis_ledger import LEGACY_INDEX_PREFIX, LEGACY_RUNS_PREFIX, index_key, runs_key

    # Given two schedules a previous release recorded under the old names (one run each, expiring in a day)
    listed, written = f"tests.legacy.{uuid.uuid4().hex}", f"tests.legacy.{uuid.uuid4().hex}"
    for schedule in (listed, written):
        record = {"schedule": schedule, "period": "1800000000", "status": "ok", "task_id": "t1", "reason": ""}
        store.client.hset(LEGACY_RUNS_PREFIX + schedule, "1800000000", json.dumps(record))
        store.client.zadd(LEGACY_INDEX_PREFIX + schedule, {"1800000000": T0})
        store.client.expire(LEGACY_RUNS_PREFIX + schedule, 86400)
    # When the new release lists one, and records the next period of the other
    runs = store.run_list(listed)
    assert store.run_dispatch(written, T0 + 60, task_id="t2", now=T0 + 60) is True
    # Then the old runs are read, and kept beside the new one, under the new names, their expiry kept
    assert [(r.period, r.status, r.task_id) for r in runs] == [(T0, "ok", "t1")]
    assert [(r.period, r.task_id) for r in store.run_list(written)] == [(T0 + 60, "t2"), (T0, "t1")]
    for schedule in (listed, written):
        assert store.client.exists(LEGACY_RUNS_PREFIX + schedule, LEGACY_INDEX_PREFIX + schedule) == 0
        assert store.client.exists(runs_key(schedule), index_key(schedule)) == 2
        assert store.client.ttl(runs_key(schedule)) > 0
        store.client.delete(runs_key(schedule), index_key(schedule))
    assert store.run_list(f"tests.legacy.{uuid.uuid4().hex}") == []  # a schedule with no record at all


def test_alert_summaries_pending_before_the_hash_tag_are_still_sent_once(store: RedisStore) -> None:
    from celery_guardrails.stores.redis import LEGACY_ALERT_PENDING, LEGACY_ALERT_PREFIX

    # Given a throttle window a previous release left open, with 4 alerts held back for its summary
    group = f"tests.legacy|{uuid.uuid4().hex}"
    store.client.hset(LEGACY_ALERT_PREFIX + group, mapping={"until": f"{T0 + 60:.6f}", "suppressed": 4})
    store.client.expire(LEGACY_ALERT_PREFIX + group, 3600)
    store.client.sadd(LEGACY_ALERT_PENDING, group)
    # When the summaries are taken during the window, after it, and again
    during, after, again = (store.due_summaries(now=now) for now in (T0 + 30, T0 + 61, T0 + 62))
    # Then the window's summary is handed out once, when it is over
    assert [(g, n) for g, n in during + again if g == group] == []
    assert [(g, n) for g, n in after if g == group] == [(group, 4)]
    assert not store.client.sismember(LEGACY_ALERT_PENDING, group)
    store.client.delete(LEGACY_ALERT_PREFIX + group)
