"""The broker's Redis restarts under a prefork worker with acks-late tasks in flight
(celery_guardrails.broker.restart_guard).

A private redis-server with an append-only file is the broker (the shared one is never restarted); the
guardrails store and the results stay on the shared Redis. Tasks are in flight when the broker is SIGKILLed:
two running (held at a gate, a Redis list on the shared Redis), the others prefetched by the worker, and, when
it has its fill, more in the queue. The broker is started again on the same port, with the same data, once the
worker has seen it go.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_guardrails.broker.restart_guard import affected
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.private_redis import PrivateRedis
from tests.support.services import REDIS_URL, require
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, CeleryProcess, WorkerProcess, proj_env

TIMEOUT = 60
#: Messages a worker of concurrency 2 takes before it stops fetching (Celery's prefetch multiplier 4 x 2).
PREFETCH = 8
#: Six in flight: the worker still fetches, a BRPOP waits on the broker when it goes (the crash).
#: Ten: the worker has its fill, no BRPOP is waiting (no crash; the prefetched ones still wait in Redis).
FETCHING, FULL = 6, 10
CRASH = "Unrecoverable error: AttributeError(\"'NoneType' object has no attribute 'hostname'\")"


@pytest.fixture
def broker_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    require("redis")  # the store and the results stay on the shared Redis
    server = PrivateRedis(workdir=tmp_path / "broker").start()
    yield server
    server.kill()


@pytest.fixture
def celery_config(broker_redis: PrivateRedis, queue_name: str) -> dict[str, Any]:
    """The test publishes to the private broker (this replaces the suite's fixture of the same name)."""
    return {
        "broker_url": broker_redis.url,
        "result_backend": REDIS_URL,
        "task_default_queue": queue_name,
        "result_expires": 600,
        "broker_connection_retry_on_startup": False,
        "worker_hijack_root_logger": False,
        "guardrails": {"store": REDIS_URL, "dead_letter_sinks": ["redis"]},
    }


@pytest.fixture
def sinks(sink: Sink) -> Iterator[list[Sink]]:
    """One report list per task; their keys are removed afterwards, with the run counters and the gate."""
    yield [Sink.of(f"{sink.key}:{index}") for index in range(FULL)]
    left = sink.client.keys(f"{sink.key}:*")  # reports, run counters, the gate
    if left:
        sink.client.delete(*left)


def worker_on(broker: PrivateRedis, queue: str, log_path: Path, *, guard: bool) -> WorkerProcess:
    settings = {} if guard else {"broker_restart_guard": False}
    env = proj_env(queue=queue, GUARDRAILS_TEST_BROKER_URL=broker.url, GUARDRAILS_TEST_GUARDRAILS=json.dumps(settings))
    return WorkerProcess(app=PROJ_APP, queue=queue, concurrency=2, log_path=log_path, env=env)


def in_flight(broker: PrivateRedis, sinks: list[Sink], gate: str) -> list[Any]:
    """Acks-late tasks, one per sink: two running at the gate, the others prefetched (up to PREFETCH) and the
    rest waiting in the queue."""
    results = [tasks.behave.delay(sink.key, [f"gate:{gate}"]) for sink in sinks]
    wait_for("two tasks running", lambda: sum(len(sink.items()) for sink in sinks) == 2)
    delivered = min(len(sinks), PREFETCH)
    wait_for(f"{delivered} messages delivered, none acked", lambda: broker.client().hlen("unacked") == delivered)
    return results


def blocked_fetch(broker: PrivateRedis) -> bool:
    """Whether a client of the broker is blocked in a fetch now (Redis flags a blocked client ``b``)."""
    return any("b" in client.get("flags", "") for client in broker.client().client_list())


def restart(broker: PrivateRedis, worker: CeleryProcess) -> None:
    """SIGKILL the broker; start it again (same port, same data) once the worker has seen it go."""
    broker.kill()
    wait_for("the worker to see its broker go", lambda: "Connection to broker lost" in worker.log)
    broker.start()


def reconnected(worker: CeleryProcess) -> None:
    def probe() -> bool:
        assert worker.process is not None and worker.process.poll() is None, "the worker stopped"
        return worker.log.count("Connected to ") == 2

    wait_for("the worker to reconnect", probe)


@pytest.mark.skipif(not affected(), reason="the guard is installed for Celery 5.7 with kombu 5 only")
@pytest.mark.parametrize("count", [FETCHING, FULL], ids=["brpop-waiting", "prefetch-full"])
def test_worker_outlives_a_broker_restart_and_every_message_in_flight_runs_once(
    count: int, celery_app: Any, broker_redis: PrivateRedis, sinks: list[Sink], queue_name: str, tmp_path: Path
) -> None:
    # Given a prefork worker with two tasks running, the others prefetched (and, when it has its fill, two
    # more in the queue)
    sinks, gate = sinks[:count], f"{sinks[0].key}:gate"
    with worker_on(broker_redis, queue_name, tmp_path / "worker.log", guard=True) as worker:
        results = in_flight(broker_redis, sinks, gate)

        # When the broker's Redis is killed and started again
        restart(broker_redis, worker)
        reconnected(worker)
        sinks[0].client.rpush(gate, *["open"] * count)

        # Then every task runs to completion, each once: the two that ran on through the restart ack, the
        # prefetched ones are given back as the worker reconnects and run (not an hour later, at the
        # visibility_timeout)
        assert [result.get(timeout=TIMEOUT)["run"] for result in results] == [1] * count
        assert [[report["run"] for report in sink.items()] for sink in sinks] == [[1]] * count
        wait_for("every message acked", lambda: broker_redis.client().hlen("unacked") == 0)
        assert broker_redis.client().llen(queue_name) == 0
        given_back = min(count, PREFETCH) - 2
        assert f"Gave back {given_back} message(s) delivered before the broker connection was lost" in worker.log
        # ... and the worker is still there
        assert worker.process is not None and worker.process.poll() is None
        assert "Unrecoverable error" not in worker.log


@pytest.mark.skipif(not affected(), reason="the crash is Celery 5.7's (celery/celery#10242)")
def test_without_the_guard_a_broker_restart_stops_the_worker_and_the_messages_wait_in_redis(
    celery_app: Any, broker_redis: PrivateRedis, sinks: list[Sink], queue_name: str, tmp_path: Path
) -> None:
    # Given the worker still fetching (a BRPOP waiting), the guard turned off (broker_restart_guard=False)
    sinks, gate = sinks[:FETCHING], f"{sinks[0].key}:gate"
    with worker_on(broker_redis, queue_name, tmp_path / "worker.log", guard=False) as worker:
        in_flight(broker_redis, sinks, gate)
        # (Celery's crash needs a fetch blocked on the broker as it goes: a CI run killed it between two fetches,
        # and the worker reconnected instead)
        wait_for("a fetch blocked on the broker", lambda: blocked_fetch(broker_redis))

        # When the broker's Redis is killed and started again
        restart(broker_redis, worker)

        # Then the worker stops on kombu's restore_unacked (what the soak saw) ...
        wait_for("the worker to stop", lambda: CRASH in worker.log)
        assert "in restore_unacked" in worker.log
        # ... the messages still unacked in the broker (the append-only file kept them), where kombu gives
        # them back after the visibility_timeout (an hour by default) ...
        assert broker_redis.client().hlen("unacked") == FETCHING
        # ... and once the two running tasks end (a warm shutdown waits for them), the worker exits
        sinks[0].client.rpush(gate, *["open"] * FETCHING)
        assert worker.wait(TIMEOUT) == 1


@pytest.mark.skipif(not affected(), reason="the guard is installed for Celery 5.7 with kombu 5 only")
def test_without_the_guard_prefetched_messages_wait_in_redis_for_the_visibility_timeout(
    celery_app: Any, broker_redis: PrivateRedis, sinks: list[Sink], queue_name: str, tmp_path: Path
) -> None:
    # Given the worker with its fill (no BRPOP waiting: it does not crash), the guard turned off
    gate = f"{sinks[0].key}:gate"
    with worker_on(broker_redis, queue_name, tmp_path / "worker.log", guard=False) as worker:
        results = in_flight(broker_redis, sinks, gate)
        ran = [index for index, sink in enumerate(sinks) if sink.items()]

        # When the broker's Redis is killed and started again, and the worker is back
        restart(broker_redis, worker)
        reconnected(worker)
        sinks[0].client.rpush(gate, *["open"] * FULL)

        # Then the two that ran and the two left in the queue (the last published) complete ...
        completed = sorted({*ran, *range(PREFETCH, FULL)})
        assert [results[index].get(timeout=TIMEOUT)["run"] for index in completed] == [1] * 4
        # ... and the six it had prefetched are in no queue but unacked in Redis, none of them run: kombu gives
        # them back only after the visibility_timeout
        wait_for("the four runs acked", lambda: broker_redis.client().hlen("unacked") == PREFETCH - 2)
        assert broker_redis.client().llen(queue_name) == 0
        waiting = [index for index in range(FULL) if index not in completed]
        assert len(waiting) == PREFETCH - 2
        assert [sinks[index].items() for index in waiting] == [[]] * len(waiting)


@pytest.mark.parametrize(
    ("celery_version", "kombu_version", "installed"),
    [
        ((5, 6, 3, "", ""), (5, 7, 0, "", ""), False),  # Celery before #10242 does not close what it collected
        ((5, 7, 0, "", ""), (5, 7, 0, "", ""), True),
        ((5, 7, 2, "rc1", ""), (5, 6, 0, "", ""), True),
        ((6, 0, 0, "", ""), (5, 7, 0, "", ""), False),  # not checked yet: no patch
        ((5, 7, 0, "", ""), (6, 0, 0, "", ""), False),
    ],
)
def test_the_guard_is_installed_only_for_the_releases_checked(
    celery_version: tuple[Any, ...], kombu_version: tuple[Any, ...], installed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a Celery and a kombu release
    import celery
    import kombu

    monkeypatch.setattr(celery, "VERSION", celery_version)
    monkeypatch.setattr(kombu, "VERSION", kombu_version)
    # Then the guard is installed only where the crash was reproduced
    assert affected() is installed


def test_a_retry_that_cannot_be_published_gives_the_message_back_instead_of_acking_it_away(
    celery_app: Any, broker_redis: PrivateRedis, sinks: list[Sink], queue_name: str, tmp_path: Path
) -> None:
    # Given a task whose first run waits at a gate, then fails transiently (its second run succeeds)
    sink, gate = sinks[0], f"{sinks[0].key}:gate"
    with worker_on(broker_redis, queue_name, tmp_path / "worker.log", guard=True) as worker:
        result = tasks.behave.delay(sink.key, [f"gate_then_transient:{gate}", "ok"])
        wait_for("the first run at its gate", lambda: len(sink.items()) == 1)

        # When the broker goes away while it runs, so that its retry cannot be published
        broker_redis.kill()
        wait_for("the worker to see its broker go", lambda: "Connection to broker lost" in worker.log)
        sink.client.rpush(gate, "open")
        # (Celery logs the rejection either way)
        wait_for("the retry's publish to fail", lambda: "Reject(" in worker.log or "rejected" in worker.log)
        broker_redis.start()

        # Then the message was not acked away (Celery rejects it without requeue): it comes back and runs again
        assert result.get(timeout=TIMEOUT)["run"] == 2
        assert [report["run"] for report in sink.items()] == [1, 2]
        assert "given back to the broker unacked" in worker.log
        wait_for("every message acked", lambda: broker_redis.client().hlen("unacked") == 0)
