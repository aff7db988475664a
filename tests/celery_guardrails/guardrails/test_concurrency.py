"""Per-key concurrency limits, exclusive keys and the reaper, on real ``celery worker`` processes over Redis.

Each task body counts itself in and out of Redis counters of the tasks running now (per tenant or entity)
and reports the count it saw as it started: the overlap, sampled at every start, kept durably.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_guardrails import ConcurrencyKeyError, concurrency_status, signals, tenant_context
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.dead_letters import dead_letter_of, has_dead_letter
from tests.support.proxy import TcpProxy
from tests.support.services import REDIS_URL, require
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

TIMEOUT = 90
WAITED = ("retry_later", "concurrency:full")


@pytest.fixture(scope="module")
def shared_queue() -> str:
    return f"gr-test-slots-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def two_workers(shared_queue: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    """Two worker processes, threads pool, four threads each (8 threads), sharing one queue."""
    require("redis")
    folder = tmp_path_factory.mktemp("slots")
    env = proj_env(queue=shared_queue)
    workers = [
        WorkerProcess(
            app=PROJ_APP, queue=shared_queue, pool="threads", concurrency=4, log_path=folder / f"w{i}.log", env=env
        )
        for i in range(2)
    ]
    try:
        for worker in workers:
            worker.start()
        yield workers
    finally:
        for worker in workers:
            worker.stop()


def publish(task: Any, tenant: str, *args: Any, queue: str, **kwargs: Any) -> Any:
    with tenant_context(tenant):
        return task.apply_async(args, kwargs, queue=queue)


def test_two_per_tenant_across_two_workers_no_attempt_spent_and_another_tenant_not_held_back(
    celery_app: Any, two_workers: list[WorkerProcess], shared_queue: str, sink: Sink
) -> None:
    # Given tenant_limited: concurrency_key="tenant:{tenant}", concurrency_limit=2, on 8 threads in 2 processes
    busy, other = f"busy-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    # When 20 tasks of one tenant are published, then 4 of another
    results = [publish(tasks.tenant_limited, busy, sink.key, 0.3, queue=shared_queue) for _ in range(20)]
    results += [publish(tasks.tenant_limited, other, sink.key, 0.3, queue=shared_queue) for _ in range(4)]
    # Then all finish
    for result in results:
        result.get(timeout=TIMEOUT)
    reports = sink.items()
    assert len(reports) == 24 and len({r["task_id"] for r in reports}) == 24
    by_tenant = {tenant: [r for r in reports if r["tenant"] == tenant] for tenant in (busy, other)}
    # never more than 2 of one tenant ran at once (and 2 did: the limit was reached, not merely unused)
    assert max(r["running"][0] for r in by_tenant[busy]) == 2
    assert max(r["running"][0] for r in by_tenant[other]) <= 2
    # both worker processes ran them
    assert len({r["pid"] for r in reports}) == 2
    # waiting spent no attempt: every run was a first attempt, and its history holds only waits for a slot
    assert {r["attempt"] for r in reports} == {1}
    assert {tuple(entry) for r in reports for entry in r["history"]} == {WAITED}
    assert sum(len(r["history"]) for r in by_tenant[busy]) > 0  # the busy tenant's tasks did wait
    # the other tenant was not held back: its 4 ended before the busy tenant's last one
    ended = [json.loads(raw)["tenant"] for raw in sink.client.lrange(f"{sink.key}:ended", 0, -1)]
    assert len(ended) == 24
    assert max(i for i, tenant in enumerate(ended) if tenant == other) < max(
        i for i, tenant in enumerate(ended) if tenant == busy
    )
    # and every slot was given back
    status = concurrency_status(f"tenant:{busy}", app=celery_app)
    assert (status["held"], status["acquired"], status["reaped"]) == (0, 20, 0)


def test_exclusive_key_one_at_a_time_per_entity_different_entities_overlap(
    celery_app: Any, two_workers: list[WorkerProcess], shared_queue: str, sink: Sink
) -> None:
    # Given entity_exclusive: exclusive_key="entity:{entity}"
    entities = [f"e-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    # When 6 tasks act on each of two entities
    results = [
        tasks.entity_exclusive.apply_async((entity, sink.key, 0.2), queue=shared_queue)
        for _ in range(6)
        for entity in entities
    ]
    for result in results:
        result.get(timeout=TIMEOUT)
    reports = sink.items()
    assert len(reports) == 12
    # Then two tasks on one entity never overlapped, while tasks on the two entities did
    assert max(r["running"][0] for r in reports) == 1
    assert max(r["running"][1] for r in reports) >= 2
    assert {r["attempt"] for r in reports} == {1}
    assert all(concurrency_status(f"entity:{e}", exclusive=True, app=celery_app)["held"] == 0 for e in entities)


def test_holders_killed_with_their_worker_are_reaped_recorded_lost_and_the_waiters_proceed(
    celery_app: Any, sink: Sink, tmp_path: Path
) -> None:
    # Given worker A (its own queue) running two tasks of a tenant limited to 2, held at a gate, and worker B
    # (another queue) with two more of that tenant waiting for a slot; the reap ceiling is 2 s
    tenant = f"killed-{uuid.uuid4().hex[:8]}"
    queue_a, queue_b = (f"gr-test-slots-{uuid.uuid4().hex[:12]}" for _ in range(2))
    reaped_sink = Sink(f"{sink.key}:reaped")
    config = json.dumps({"concurrency_reap_after": 2.0})
    workers = {
        name: WorkerProcess(
            app=PROJ_APP,
            queue=queue,
            pool="threads",
            concurrency=2,
            log_path=tmp_path / f"{name}.log",
            env=proj_env(queue=queue, GUARDRAILS_TEST_GUARDRAILS=config, GUARDRAILS_TEST_REAPED_SINK=reaped_sink.key),
        )
        for name, queue in (("a", queue_a), ("b", queue_b))
    }
    try:
        for worker in workers.values():
            worker.start()
        gate = f"{sink.key}:gate"
        holders = [publish(tasks.tenant_limited, tenant, sink.key, 0, gate, queue=queue_a) for _ in range(2)]
        sink.wait(2)
        waiters = [publish(tasks.tenant_limited, tenant, sink.key, 0, queue=queue_b) for _ in range(2)]
        wait_for("the waiters waiting for a slot", lambda: workers["b"].log.count("cannot run yet") >= 2)
        assert len(sink.items()) == 2  # nobody got past the limit
        # When worker A is SIGKILLed, its two tasks mid-body (their slots held, their heartbeats stopped)
        workers["a"].kill()
        workers["a"].wait(30)
        # Then the waiters' next capacity checks reap the dead holders, and the waiters run, on their first attempt
        for waiter in waiters:
            assert waiter.get(timeout=TIMEOUT)["attempt"] == 1
        held_ids = {result.id for result in holders}
        # the reaped holders are recorded lost (the record kept), counted, and holder_reaped was sent for each
        status = concurrency_status(f"tenant:{tenant}", app=celery_app)
        assert status["reaped"] == 2
        assert {(h.task_id, h.state) for h in status["recent_lost"]} == {(task_id, "lost") for task_id in held_ids}
        signalled = reaped_sink.wait(2)
        assert {(s["task_id"], s["reason"], s["key"]) for s in signalled} == {
            (task_id, "lost", f"limit:tenant:{tenant}") for task_id in held_ids
        }
        assert status["held"] == 0
    finally:
        for worker in workers.values():
            worker.stop()
        reaped_sink.client.delete(reaped_sink.key)


def test_a_holder_stopped_past_the_ceiling_is_fenced_when_it_resumes_and_runs_again_under_the_limit(
    celery_app: Any, sink: Sink, tmp_path: Path
) -> None:
    # Given worker A (solo) and worker B (2 threads), each on its own queue, a reap ceiling of 1.5 s, and a task
    # limited to 2 per tenant that lands its effect through self.effect() once its gate opens
    require("redis")
    tenant = f"stalled-{uuid.uuid4().hex[:8]}"
    fenced_sink, effects = Sink(f"{sink.key}:fenced"), Sink(f"{sink.key}:effects")
    gate_a, gate_b = f"{sink.key}:gate-a", f"{sink.key}:gate-b"
    config = json.dumps({"concurrency_reap_after": 1.5})
    queues = {name: f"gr-test-slots-{uuid.uuid4().hex[:12]}" for name in ("a", "b")}
    workers = {
        name: WorkerProcess(
            app=PROJ_APP,
            queue=queues[name],
            pool=pool,
            concurrency=concurrency,
            log_path=tmp_path / f"{name}.log",
            env=proj_env(
                queue=queues[name], GUARDRAILS_TEST_GUARDRAILS=config, GUARDRAILS_TEST_FENCED_SINK=fenced_sink.key
            ),
        )
        for name, pool, concurrency in (("a", "solo", 1), ("b", "threads", 2))
    }
    try:
        for worker in workers.values():
            worker.start()
        stalled = publish(tasks.limited_effect, tenant, sink.key, gate_a, queue=queues["a"])
        sink.wait(1)  # in its body, holding a slot, before its effect
        # When worker A is stopped (SIGSTOP: the body and the heartbeat thread alike) past the ceiling, its gate
        # opening meanwhile, and two more deliveries on worker B take both slots (reaping A's holder)
        workers["a"].kill(signal.SIGSTOP)
        sink.client.set(gate_a, 1)
        time.sleep(2.0)
        others = [publish(tasks.limited_effect, tenant, sink.key, gate_b, queue=queues["b"]) for _ in range(2)]
        sink.wait(3)
        # and worker A resumes
        workers["a"].kill(signal.SIGCONT)
        wait_for(
            "the stalled holder fenced, or its effect landed",
            lambda: "fenced at effect" in workers["a"].log or effects.client.llen(effects.key) > 0,
        )
        # Then its effect did not land beside the two holders of the slots (they are still in their bodies)
        assert effects.client.lrange(effects.key, 0, -1) == []
        (signalled,) = fenced_sink.wait(1)
        assert (signalled["task_id"], signalled["key"], signalled["where"], signalled["tenant"]) == (
            stalled.id,
            f"limit:tenant:{tenant}",
            "effect",
            tenant,
        )
        (line,) = [line for line in workers["a"].log.splitlines() if "fenced at effect" in line]
        assert stalled.id in line and f"limit:tenant:{tenant}" in line and signalled["holder"] in line
        # and when the holders finish, its message runs again under the limit (no attempt spent) and lands its
        # effect once: three effects, one per message, the stalled one last
        sink.client.set(gate_b, 1)
        for other in others:
            other.get(timeout=TIMEOUT)
        report = stalled.get(timeout=TIMEOUT)
        assert [raw.decode() for raw in effects.client.lrange(effects.key, 0, -1)][2:] == [stalled.id]
        assert sorted(raw.decode() for raw in effects.client.lrange(effects.key, 0, -1)) == sorted(
            [stalled.id, *(other.id for other in others)]
        )
        assert report["attempt"] == 1 and ["retry_later", "concurrency:slot_lost"] in report["history"]
        # (the slot is released as the delivery ends, just after its result is stored)
        status = wait_for(
            "every slot released",
            lambda: (s := concurrency_status(f"tenant:{tenant}", app=celery_app))["held"] == 0 and s,
        )
        assert (status["held"], status["reaped"]) == (0, 1)
        assert [h.task_id for h in status["recent_lost"]] == [stalled.id]
    finally:
        workers["a"].kill(signal.SIGCONT)
        for worker in workers.values():
            worker.stop()
        sink.client.delete(fenced_sink.key, effects.key, gate_a, gate_b)


def test_store_cut_at_a_fence_check_in_the_body_the_message_comes_back_no_attempt_spent(
    celery_app: Any, sink: Sink, tmp_path: Path
) -> None:
    # Given a worker whose store goes through a proxy (reap ceiling 1 s), running a limited task held at its gate
    require("redis")
    proxy = TcpProxy(6379)
    store = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
    queue = f"gr-test-slots-{uuid.uuid4().hex[:12]}"
    config = {"store": store, "backoff_base": 0.2, "concurrency_reap_after": 1.0}
    env = proj_env(queue=queue, GUARDRAILS_TEST_GUARDRAILS=json.dumps(config))
    tenant, gate, effects = f"cut-{uuid.uuid4().hex[:8]}", f"{sink.key}:gate", f"{sink.key}:effects"
    try:
        with WorkerProcess(app=PROJ_APP, queue=queue, log_path=tmp_path / "worker.log", env=env) as worker:
            result = publish(tasks.limited_effect, tenant, sink.key, gate, queue=queue)
            sink.wait(1)
            # When the store is cut, its slot unconfirmed for longer than half the ceiling, and the gate opens:
            # its effect() block must ask the store whether the slot is still its own
            proxy.cut()
            time.sleep(0.8)
            sink.client.set(gate, 1)
            wait_for("the outage logged", lambda: "the guardrails store is unavailable" in worker.log)
            # Then the effect did not land, and the message is neither failed nor lost: it comes back
            assert sink.client.llen(effects) == 0 and result.state in ("PENDING", "RETRY")
            proxy.restore()
            report = result.get(timeout=TIMEOUT)
            landed = [raw.decode() for raw in sink.client.lrange(effects, 0, -1)]
    finally:
        proxy.close()
        sink.client.delete(gate, effects)
    # and runs again on its first attempt, the outage in its history; its effect landed once
    assert report["attempt"] == 1 and ["store_unavailable", "store"] in report["history"]
    assert landed == [result.id]


def test_store_cut_at_the_capacity_check_the_message_comes_back_no_attempt_spent(
    celery_app: Any, sink: Sink, tmp_path: Path
) -> None:
    # Given a worker whose store goes through a proxy, and the store cut
    require("redis")
    proxy = TcpProxy(6379)
    store = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
    queue = f"gr-test-slots-{uuid.uuid4().hex[:12]}"
    env = proj_env(queue=queue, GUARDRAILS_TEST_GUARDRAILS=json.dumps({"store": store, "backoff_base": 0.2}))
    tenant = f"cut-{uuid.uuid4().hex[:8]}"
    try:
        with WorkerProcess(app=PROJ_APP, queue=queue, log_path=tmp_path / "worker.log", env=env) as worker:
            proxy.cut()
            # When a limited task is delivered: its capacity check cannot reach the store
            result = publish(tasks.tenant_limited, tenant, sink.key, 0, queue=queue)
            wait_for("the outage logged", lambda: "the guardrails store is unavailable" in worker.log)
            # Then it does not run, fail or get lost: it comes back
            assert sink.items() == [] and result.state in ("PENDING", "RETRY")
            proxy.restore()
            report = result.get(timeout=TIMEOUT)
    finally:
        proxy.close()
    # and runs once, on its first attempt, the outage in its history; no slot is left held
    assert [r["task_id"] for r in sink.items()] == [result.id]
    assert report["attempt"] == 1 and ["store_unavailable", "store"] in report["history"]
    assert concurrency_status(f"tenant:{tenant}", app=celery_app)["held"] == 0


@pytest.mark.usefixtures("celery_worker")
def test_the_slot_is_released_before_a_retry_is_published(celery_app: Any, sink: Sink) -> None:
    # Given limited_flaky (one per tenant), whose first attempt fails transiently; the slot count is read
    # as each retry is scheduled (before it is published)
    tenant = f"flaky-{uuid.uuid4().hex[:8]}"
    held_at_retry: list[int] = []

    def count(sender: Any = None, **kwargs: Any) -> None:
        held_at_retry.append(concurrency_status(f"tenant:{tenant}", app=celery_app)["held"])

    signals.retry_scheduled.connect(count, weak=False)
    try:
        with tenant_context(tenant):
            result = tasks.limited_flaky.delay(sink.key)
        report = result.get(timeout=TIMEOUT)
    finally:
        signals.retry_scheduled.disconnect(count)
    # Then the retry was scheduled with the slot already given back, and it ran at once on its second attempt
    assert held_at_retry == [0]
    assert report["attempt"] == 2 and "concurrency:full" not in report["history"]
    assert concurrency_status(f"tenant:{tenant}", app=celery_app)["held"] == 0


def test_a_malformed_key_template_is_a_clear_error_at_publish(celery_app: Any) -> None:
    # Given a task whose concurrency_key names an argument it does not take
    # When it is published, Then the publisher hears of it, naming the option; nothing is sent
    with pytest.raises(ConcurrencyKeyError, match=r"concurrency_key 'x:\{no_such_argument\}' names 'no_such_argument'"):
        tasks.bad_concurrency_key.delay()
    # and a key that renders to something unusable is refused the same way
    with pytest.raises(ConcurrencyKeyError, match="exclusive key 'entity:has space' has whitespace"):
        tasks.entity_exclusive.delay("has space", "sink")


def test_the_reaper_on_the_watchdog_timer_reaps_a_dead_holder_once(celery_app: Any, received: Any) -> None:
    # Given a holder of a key whose heartbeat stopped long past its ceiling (its worker died), and one that beats
    require("redis")
    from celery_guardrails.scheduling.watchdog import WatchdogStep
    from celery_guardrails.stores import get_store

    key = f"tenant:timer-{uuid.uuid4().hex[:8]}"
    store = get_store(celery_app)
    now = time.time()
    # (the live one first: a capacity check at "now" would reap the dead one itself)
    store.acquire_slot(f"limit:{key}", holder="alive", limit=2, now=now, reap_after=30, task_id="id-alive")
    store.acquire_slot(f"limit:{key}", holder="dead", limit=2, now=now - 100, reap_after=30, task_id="id-dead")
    reaped = received(signals.holder_reaped)
    # When the watchdog's timer ticks in a worker, twice
    step = WatchdogStep.__new__(WatchdogStep)
    step.tick(celery_app, owner="test")
    step.tick(celery_app, owner="test")
    # Then the dead holder was reaped once, recorded lost and signalled; the live one keeps its slot
    mine = [r for r in reaped if r["key"] == f"limit:{key}"]
    assert [(r["holder"], r["task_id"], r["reason"], r["sender"]) for r in mine] == [
        ("dead", "id-dead", "lost", celery_app)
    ]
    status = concurrency_status(key, app=celery_app)
    assert (status["held"], status["reaped"]) == (1, 1)
    assert [h.holder for h in status["holders"]] == ["alive"]
    store.release_slot(f"limit:{key}", holder="alive")


@pytest.mark.usefixtures("celery_worker")
def test_a_key_that_cannot_be_made_on_the_worker_is_a_final_failure_not_a_crash(celery_app: Any, sink: Sink) -> None:
    # Given a message sent without the extension (send_task: no publish-time check) whose exclusive key would
    # hold a space
    result = celery_app.send_task("tests.proj.tasks.entity_exclusive", args=("has space", sink.key))
    # Then it fails for good with the reason, its dead letter recorded; the body never ran
    with pytest.raises(ConcurrencyKeyError, match="exclusive key"):
        result.get(timeout=TIMEOUT)
    wait_for("the dead letter", lambda: has_dead_letter(celery_app, result.id))
    assert dead_letter_of(celery_app, result.id)["reason"] == "permanent"
    assert sink.items() == []
