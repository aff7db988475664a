"""The guardrails store cut away from a real prefork worker (through a TCP proxy) at each step of a keyed task:
at the claim, during the heartbeat, at the completion. After it comes back, every message has run once;
none was acked away, failed or dead-lettered for the outage, and no attempt was spent on it.

The broker and the test's own reads go to Redis directly; only the worker's store goes through the proxy.
The Django store on PostgreSQL is cut the same way in tests/django_app/test_store_outage.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_guardrails.foundation.fingerprints import fingerprint
from celery_guardrails.stores.redis import RedisStore
from tests.conftest import Sink, unacked
from tests.proj import tasks
from tests.support.dead_letters import dead_letter_of, has_dead_letter
from tests.support.messages import publish_body, publish_raw
from tests.support.proxy import TcpProxy
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

TIMEOUT = 60


@pytest.fixture
def worker(celery_app: Any, proxy: TcpProxy, queue_name: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    """A prefork worker whose store is the test Redis through ``proxy`` (a 6 s lease: a beat every 2 s);
    the test publishes to its queue (``celery_app``)."""
    store = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_GUARDRAILS=json.dumps({"store": store, "idempotency_lease": 6.0}))
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env) as process:
        yield process  # type: ignore[misc]


@pytest.fixture
def oid() -> int:
    return random.randrange(10**9)


def effects(sink: Sink) -> int:
    return int(sink.client.get(f"{sink.key}:effects") or 0)


def key_of(oid: int) -> str:
    return f"tests.proj.tasks.charge:-:charge:{oid}"


def charging_at_a_gate(oid: int, sink: Sink) -> tuple[Any, str]:
    """A keyed charge whose body made its effect and waits at a gate (a Redis list): (its result, the gate)."""
    gate = f"{sink.key}:gate"
    result = tasks.charge.delay(oid, sink.key, gate=gate)
    sink.wait(1)
    return result, gate


def completed_once(result: Any, oid: int, sink: Sink) -> None:
    """The charge ran once, its key is completed, and a duplicate gets its result without running."""
    assert result.get(timeout=TIMEOUT) == f"charged {oid}"
    wait_for("the key completed", lambda: RedisStore(REDIS_URL).inspect(key_of(oid))["state"] == "completed")  # type: ignore[index]
    assert tasks.charge.delay(oid, sink.key).get(timeout=TIMEOUT) == f"charged {oid}"
    assert effects(sink) == 1 and [r["run"] for r in sink.items()] == [1]


def test_store_cut_at_the_claim_the_message_comes_back_and_runs_once(
    worker: WorkerProcess, proxy: TcpProxy, sink: Sink, oid: int
) -> None:
    # Given the store out of reach when a keyed task is delivered
    proxy.cut()
    result = tasks.charge.delay(oid, sink.key)
    # Then the delivery does not run, fail or dead-letter: it is published again for later
    wait_for("the outage logged", lambda: "the guardrails store is unavailable" in worker.log)
    assert sink.items() == [] and result.state in ("PENDING", "RETRY")
    # When the store is back
    proxy.restore()
    # Then the message runs, once, on its first attempt (the outage spent none)
    assert result.get(timeout=TIMEOUT) == f"charged {oid}"
    assert [(r["run"], r["attempt"]) for r in sink.items()] == [(1, 1)]
    assert effects(sink) == 1
    # (the completion goes through the proxy, the result straight to Redis: it may land just after the result)
    wait_for("the key completed", lambda: RedisStore(REDIS_URL).inspect(key_of(oid))["state"] == "completed")  # type: ignore[index]


def test_store_cut_during_the_heartbeat_the_run_completes_once(
    worker: WorkerProcess, proxy: TcpProxy, sink: Sink, oid: int
) -> None:
    # Given a keyed task running (held at a gate), and its store cut: its heartbeats fail
    result, gate = charging_at_a_gate(oid, sink)
    proxy.cut()
    wait_for("a heartbeat failed", lambda: "heartbeat failed" in worker.log)
    # When the store is back and the body returns
    proxy.restore()
    sink.client.rpush(gate, "go")
    # Then the run completes, once
    completed_once(result, oid, sink)


def test_store_cut_at_the_completion_the_worker_completes_it_when_the_store_is_back(
    worker: WorkerProcess, proxy: TcpProxy, sink: Sink, oid: int
) -> None:
    # Given a keyed task whose body makes its effect, then waits at a gate
    result, gate = charging_at_a_gate(oid, sink)
    # When the store is cut just as the body returns
    proxy.cut()
    sink.client.rpush(gate, "go")
    # Then the worker does not run the body again: it keeps asking the store to complete the key
    wait_for("the completion retried", lambda: "not completed yet" in worker.log)
    proxy.restore()
    # And the effect happened once; the key is completed; a duplicate is skipped
    completed_once(result, oid, sink)


def test_a_budget_admission_cut_away_spends_no_attempt(
    worker: WorkerProcess, proxy: TcpProxy, sink: Sink, received: Any
) -> None:
    # Given the store out of reach when a task of a dependency is delivered (its admission needs the store)
    proxy.cut()
    result = tasks.behave.apply_async((sink.key, ["ok"]), dependency=f"dep-{random.randrange(10**9)}")
    wait_for("the outage logged", lambda: "the guardrails store is unavailable" in worker.log)
    proxy.restore()
    # Then it runs once the store is back, as its first attempt, with the outage in its history
    report = result.get(timeout=TIMEOUT)
    assert report["attempt"] == 1 and len(sink.items()) == 1
    assert {r["class"] for r in report["history"]} == {"store_unavailable"}


def test_the_redis_dead_letter_sink_cut_the_failure_is_recorded_once_when_it_is_back(
    celery_app: Any, proxy: TcpProxy, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a worker whose dead-letter sink (a Redis stream) is reached through the proxy, cut
    url = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_GUARDRAILS=json.dumps({"dead_letter_sinks": [url]}))
    proxy.cut()
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env) as worker:
        # When a task fails for good
        result = tasks.behave.delay(sink.key, ["permanent"])
        # Then its dead letter is not recorded yet, and the message is kept (published again), not acked away
        wait_for("the failed write logged", lambda: "dead letter not recorded" in worker.log)
        proxy.restore()
        # And once the sink is back, it is recorded, once; the body did not run again
        wait_for("the dead letter", lambda: has_dead_letter(celery_app, result.id))
        assert len(sink.items()) == 1
    record = dead_letter_of(celery_app, result.id)
    assert record["reason"] == "permanent"
    # And the Redis sink's record has its cause, the fingerprint of what it keeps, as the Django sink's does
    parts = {name: record[name] for name in ("task_name", "exc_type", "exc_message", "traceback")}
    assert record["fingerprint"] == fingerprint(**parts)


def test_the_sink_cut_a_message_refused_before_the_pool_is_given_back_and_recorded_once_when_it_is_back(
    celery_app: Any, proxy: TcpProxy, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a prefork worker whose dead-letter sink (a Redis stream) is reached through the proxy, cut, and two
    # messages another producer wrote that it refuses in its main process: arguments nested past
    # max_payload_depth, and a body no decoder reads
    url = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_GUARDRAILS=json.dumps({"dead_letter_sinks": [url]}))
    proxy.cut()
    deep: Any = "x"
    for _ in range(150):
        deep = [deep]
    refused = [
        publish_raw(celery_app, queue_name, tasks.observe.name, args=[deep], kwargs={"sink": sink.key}),
        publish_body(celery_app, queue_name, tasks.observe.name, b'[["cut short'),
    ]
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env) as worker:
        # When the worker cannot write their dead letters, Then it says so and keeps each message (given back to
        # the broker, not acked away): none is recorded, each is still on the broker
        wait_for(
            "both writes failed", lambda: all(f"malformed message {t} not recorded" in worker.log for t in refused)
        )
        assert not any(has_dead_letter(celery_app, task_id) for task_id in refused)
        assert all(unacked(task_id) or _queued(queue_name, task_id) for task_id in refused)
        # And once the sink is back, each is recorded, once, and the queue is empty; none of them ran
        proxy.restore()
        wait_for("both recorded", lambda: all(has_dead_letter(celery_app, task_id) for task_id in refused))
        wait_for("both acked", lambda: not any(unacked(t) or _queued(queue_name, t) for t in refused))
        assert worker.process is not None and worker.process.poll() is None
    assert [dead_letter_of(celery_app, task_id)["reason"] for task_id in refused] == ["malformed_message"] * 2
    assert sink.items() == []


def _queued(queue: str, task_id: str) -> bool:
    return any(task_id.encode() in raw for raw in redis.Redis.from_url(REDIS_URL).lrange(queue, 0, -1))
