"""The Redis store on a real three-node Redis Cluster (started by tests/support/redis_cluster.py).

The store rules (tests/celery_guardrails/stores/test_*_rules.py) run on it as the ``redis-cluster`` kind;
here: that keys really spread over the nodes (a pass on one slot would prove nothing), that every script
and command of the store runs there with its keys in one slot, and that a cluster that is down is an outage.
"""

from __future__ import annotations

import json
import uuid

import pytest

from celery_guardrails.exceptions import StoreUnavailableError
from celery_guardrails.runtime.dead_letters import MARKER, STREAM, RedisStreamSink
from celery_guardrails.stores.base import FAILURE, SUCCESS, BudgetPolicy
from celery_guardrails.stores.redis import (
    ALERT_PENDING,
    ALERT_PREFIX,
    DELIVERIES_PREFIX,
    IDEM_PREFIX,
    KEY_PREFIX,
    PUBLISH_PREFIX,
    RedisStore,
)
from celery_guardrails.stores.redis_ledger import index_key, runs_key
from tests.support import redis_cluster as harness
from tests.support.redis_cluster import Cluster
from tests.support.waiting import wait_for

T0 = 1_800_000_000.0
POLICY = BudgetPolicy(window=60.0, ratio=0.5, floor=2, threshold=2, open_seconds=30.0, probes=1)


@pytest.fixture
def store(redis_cluster: Cluster) -> RedisStore:
    return RedisStore(redis_cluster.url)


@pytest.fixture
def name() -> str:
    return f"tests.cluster.{uuid.uuid4().hex}"


def slot(cluster: Cluster, key: str) -> int:
    return int(cluster.client().keyslot(key))


def test_the_cluster_spreads_the_stores_keys_over_its_three_nodes(store: RedisStore, redis_cluster: Cluster) -> None:
    # Given 60 idempotency keys and 30 schedules
    keys = [f"tests.spread:-:{uuid.uuid4().hex}" for _ in range(60)]
    schedules = [f"tests.spread.{uuid.uuid4().hex}" for _ in range(30)]
    # When each key is claimed and each schedule dispatched once
    for key in keys:
        assert store.claim(key, owner="a", now=T0, lease=10, retention=600).state == "acquired"
    for schedule in schedules:
        assert store.run_dispatch(schedule, T0, task_id="t", now=T0) is True
    # Then every node holds some of them, as each node lists its own keys (SCAN does not follow slots)
    claims, ledgers = set(), set()
    for port in redis_cluster.ports:
        node = redis_cluster.node(port)
        held = {k.decode() for k in node.scan_iter(match=f"{IDEM_PREFIX}tests.spread:*", count=1000)}
        runs = {k.decode() for k in node.scan_iter(match="guardrails:{runs:tests.spread.*", count=1000)}
        assert held & {IDEM_PREFIX + key for key in keys}, f"no idempotency key on node {port}"
        assert runs & {runs_key(s) for s in schedules}, f"no ledger on node {port}"
        claims |= held
        ledgers |= runs
    # and a schedule's hash and index are on one node: every key was found once
    assert {IDEM_PREFIX + key for key in keys} <= claims
    assert {runs_key(s) for s in schedules} | {index_key(s) for s in schedules} <= ledgers


def test_the_keys_of_each_script_share_one_slot(redis_cluster: Cluster, name: str) -> None:
    # Given the keys the multi-key scripts are given, for names with and without braces
    for odd in (name, f"{name}{{x}}", f"}}{name}", f"{{{name}", ""):
        # Then a schedule's hash and index, and an alert group's key and the pending set, share a slot
        assert slot(redis_cluster, runs_key(odd)) == slot(redis_cluster, index_key(odd))
        assert slot(redis_cluster, ALERT_PREFIX + odd) == slot(redis_cluster, ALERT_PENDING)
        # and so do a dead letter's marker and the stream
        assert slot(redis_cluster, MARKER + odd) == slot(redis_cluster, STREAM)
    # while two schedules are not forced into one slot
    assert len({slot(redis_cluster, runs_key(f"{name}-{i}")) for i in range(10)}) > 1


def test_every_idempotency_script_runs(store: RedisStore, redis_cluster: Cluster, name: str) -> None:
    # Given a cluster store and one key; When each operation is run in turn, Then each answers as on one server
    key = f"{name}:-:charge"
    assert store.claim(key, owner="a", now=T0, lease=10, retention=600).state == "acquired"
    assert store.extend(key, owner="a", now=T0 + 1, lease=10) is True
    assert store.begin_complete(key, owner="a", now=T0 + 2, summary="charged", retention=600)() is True
    assert store.complete(key, owner="a", now=T0 + 2, summary="charged", retention=600) is True
    assert store.claim(key, owner="b", now=T0 + 3, lease=10, retention=600).summary == "charged"
    other = f"{name}:-:refund"
    assert store.claim(other, owner="a", now=T0, lease=10, retention=600).state == "acquired"
    assert store.release(other, owner="a") is True
    assert store.claim(other, owner="b", now=T0, lease=10, retention=600).state == "acquired"
    assert store.fail(other, owner="b", now=T0 + 1, reason="refused", retention=600) is True
    assert store.reopen(other) is True
    assert store.inspect(other) is None
    # and the key lives where the cluster says its slot is
    assert redis_cluster.node(redis_cluster.port_of(IDEM_PREFIX + key)).hget(IDEM_PREFIX + key, "state") == b"completed"


def test_delivery_counters_and_publish_reservations(store: RedisStore, redis_cluster: Cluster, name: str) -> None:
    # When a message's starts are counted, and a key's publish reserved twice
    assert [store.count_delivery(name, ttl=60) for _ in range(3)] == [1, 2, 3]
    counter = DELIVERIES_PREFIX + name
    ttl = redis_cluster.node(redis_cluster.port_of(counter)).ttl(counter)
    store.clear_delivery(name)
    first, second = store.reserve_publish(name, task_id="t1", ttl=60), store.reserve_publish(name, task_id="t2", ttl=60)
    # Then the counter counted with its expiry set, is gone when cleared, and the first publish is remembered
    assert 0 < ttl <= 60
    assert store.count_delivery(name, ttl=60) == 1
    assert (first, second) == (None, "t1")
    assert redis_cluster.client().get(PUBLISH_PREFIX + name) == b"t1"


def test_budget_admission_and_outcomes(store: RedisStore, redis_cluster: Cluster, name: str) -> None:
    # When a dependency gets first attempts, retries and failures
    assert store.admit(name, POLICY, retry=False, now=T0).allowed
    assert [store.admit(name, POLICY, retry=True, now=T0 + 1).allowed for _ in range(4)] == [True, True, False, False]
    opened = [store.record_outcome(name, POLICY, outcome=o, now=T0 + 2) for o in (SUCCESS, FAILURE, FAILURE)]
    # Then the budget and the circuit work as on one server, and the state is one hash on its slot's node
    assert opened == [False, False, True]
    assert store.budget_status(name, POLICY, now=T0 + 3)["circuit"] == "open"
    assert redis_cluster.node(redis_cluster.port_of(KEY_PREFIX + name)).hget(KEY_PREFIX + name, "circuit") == b"open"
    store.reset(name)
    assert store.budget_status(name, POLICY, now=T0 + 3)["circuit"] == "closed"


def test_the_run_ledger(store: RedisStore, name: str) -> None:
    # When a period is dispatched, started and finished, and another recorded missed then caught up
    assert store.run_dispatch(name, T0, task_id="t1", now=T0) is True
    store.run_start(name, T0, task_id="t1", now=T0 + 1)
    store.run_finish(name, T0, status="ok", now=T0 + 2)
    assert store.run_record(name, T0 + 60, status="missed", now=T0 + 200, reason="beat was down") is True
    assert store.run_dispatch(name, T0 + 60, task_id="t2", now=T0 + 201) is True
    assert store.run_undispatch(name, T0 + 60, task_id="t2") is True
    assert store.run_transition(name, T0, from_=("ok",), to="failed", now=T0 + 3, reason="late") is True
    # Then the listing reads both keys of the schedule back
    assert [(r.period, r.status) for r in store.run_list(name)] == [(T0, "failed")]


def test_alert_throttles_and_their_summaries(store: RedisStore, name: str) -> None:
    # Given alerts in ten groups (their keys spread nowhere: one tag), three of each
    groups = [f"{name}|{i}" for i in range(10)]
    sent = [store.throttle(group, window=60, now=T0 + i) for group in groups for i in range(3)]
    # When the windows are over and the summaries taken, twice
    first = store.due_summaries(now=T0 + 61)
    again = store.due_summaries(now=T0 + 62)
    # Then the first alert of each group went out, and each summary counts the other two, once
    assert sent == [True, False, False] * 10
    assert sorted((g, n) for g, n in first if g in groups) == [(group, 2) for group in sorted(groups)]
    assert [g for g, _ in again if g in groups] == []


def test_a_dead_letter_is_recorded_once_in_the_stream(redis_cluster: Cluster, name: str) -> None:
    # Given the Redis stream sink on the cluster
    sink = RedisStreamSink(redis_cluster.url, timeout=5.0)
    fields = {"task_id": name, "task_name": "tests.cluster", "reason": "permanent"}
    # When one task's dead letter is recorded twice
    results = sink.record(fields), sink.record(fields)
    # Then one entry is in the stream, its marker beside it
    assert results == (True, False)
    client = redis_cluster.client()
    entries = [json.loads(e[b"record"]) for _, e in client.xrevrange(STREAM, count=100)]
    assert [e["task_id"] for e in entries].count(name) == 1
    assert client.exists(MARKER + name) == 1


def test_a_store_made_while_no_node_answers_reports_an_outage_when_used() -> None:
    # Given a cluster URL where nothing listens (made, not connected)
    nowhere = harness.free_ports(1)[0]
    store = RedisStore(f"redis+cluster://127.0.0.1:{nowhere}", timeout=1.0)
    # When it is used, Then it is unavailable: the message comes back later
    with pytest.raises(StoreUnavailableError, match="not reachable"):
        store.claim("tests.cluster:-:nowhere", owner="a", now=T0, lease=10, retention=600)
    with pytest.raises(StoreUnavailableError):
        RedisStreamSink(f"redis+cluster://127.0.0.1:{nowhere}", timeout=1.0).record({"task_id": "x"})


def test_a_cluster_that_lost_a_node_is_an_outage_until_it_is_back() -> None:
    # Given a cluster of its own (a node will die) and a store that has used it
    cluster = harness.start(node_timeout_ms=1000)
    try:
        store = RedisStore(cluster.url, timeout=2.0)
        keys = [f"tests.down:-:{uuid.uuid4().hex}" for _ in range(30)]
        assert all(store.claim(key, owner="a", now=T0, lease=10, retention=600).state == "acquired" for key in keys)
        dead, alive = cluster.ports[1], cluster.ports[0]
        on_dead = next(key for key in keys if cluster.port_of(IDEM_PREFIX + key) == dead)
        on_alive = next(key for key in keys if cluster.port_of(IDEM_PREFIX + key) == alive)
        # When one node is killed and the others mark the cluster down (its slots have no replica)
        cluster.kill(dead)
        wait_for("cluster_state:fail", lambda: cluster.state(alive) == "fail")
        # Then a key on the dead node and one on a live node (CLUSTERDOWN) are both outages, not refusals
        for key in (on_dead, on_alive):
            with pytest.raises(StoreUnavailableError):
                store.claim(key, owner="b", now=T0 + 1, lease=10, retention=600)
        # When the node comes back (empty: no persistence here), Then the same store works again
        cluster.restart(dead)
        wait_for("cluster_state:ok", lambda: all(cluster.state(port) == "ok" for port in cluster.ports))
        assert store.claim(on_alive, owner="b", now=T0 + 1, lease=10, retention=600).state == "busy"
        assert store.claim(on_dead, owner="b", now=T0 + 1, lease=10, retention=600).state == "acquired"
    finally:
        harness.stop(cluster)
