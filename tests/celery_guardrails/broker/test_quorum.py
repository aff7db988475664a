"""RabbitMQ quorum queues, on a real worker: guarded retries and waits go through Celery's native delayed
delivery (topic exchange) or are held by the worker (direct exchange), and none loops, none is lost.

Each case runs on a quorum queue of the test's own (``tests.support.quorum``), in one worker subprocess per
exchange type; the jobs of a case run side by side. Countdowns are rounded up to what native delayed delivery
takes (whole seconds, at least 1; :mod:`celery_guardrails.broker.delays`), RabbitMQ's own headers are not
copied into a re-publish, and the poison guard counts with the broker's ``x-delivery-count``: a message put off
before its body carries the count to the message that replaces it (header ``redeliv``), and a first delivery's
``x-delivery-count`` (a publisher's, not the broker's) is not trusted. A retry the publish refuses (a ``ValueError``
from native delayed delivery) is a dead letter, never a message given back to loop.
"""

from __future__ import annotations

import contextlib
import json
import random
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_guardrails.stores.redis import DELIVERIES_PREFIX
from tests.support.dead_letters import dead_letter_of, dead_letters_of, has_dead_letter
from tests.support.proxy import TcpProxy
from tests.support.quorum import delete_queue, quorum_app
from tests.support.services import REDIS_URL, require
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

#: What each job does, run by run (tests.proj.tasks.behave: backoff_base 0.05 s, so its retries wait < 1 s), and
#: what each run must see: (step, attempt, the classes of the attempt records its message carries).
SCRIPTS = {
    # Transient failures whose backoff is under a second: Celery refused them on native delayed delivery
    # ("countdown must be a positive number") and the refusal was given back to the broker: a requeue loop, the
    # body run again at once with no attempt spent.
    "transient": ["transient", "transient", "ok"],
    # A RetryLater of 0.2 s (a busy key, an ordering or a concurrency wait): the same refusal, the same loop.
    "short_wait": ["later:0.2", "ok"],
    # Waits of 1 s (celery_delayed_0) then 3 s (celery_delayed_1, then _0): the second trip through the delay
    # queues carried the first trip's x-death, and RabbitMQ, seeing a dead-letter cycle into celery_delayed_0,
    # dropped it: never run again.
    "two_waits": ["later:1", "later:3", "ok"],
}
EXPECTED = {
    "transient": [("transient", 1, []), ("transient", 2, ["transient"]), ("ok", 3, ["transient", "transient"])],
    "short_wait": [("later:0.2", 1, []), ("ok", 1, ["retry_later"])],
    "two_waits": [("later:1", 1, []), ("later:3", 1, ["retry_later"]), ("ok", 1, ["retry_later", "retry_later"])],
}


@pytest.fixture
def quorum_name() -> Any:
    require("rabbitmq")
    require("redis")
    name = f"gr-quorum-{uuid.uuid4().hex[:12]}"
    yield name
    delete_queue(name)


def run_scripts(app: Celery, sink: str) -> dict[str, Any]:
    """Publish one ``behave`` job per script; their results by name."""
    return {
        name: app.send_task("tests.proj.tasks.behave", kwargs={"sink": f"{sink}:{name}", "script": script})
        for name, script in SCRIPTS.items()
    }


def runs_of(client: redis.Redis, sink: str) -> dict[str, list[tuple[str, int, list[str]]]]:
    """Each job's runs, in order: (step, attempt, classes of its attempt records)."""
    runs = {}
    for name in SCRIPTS:
        reports = [json.loads(raw) for raw in client.lrange(f"{sink}:{name}", 0, -1)]
        runs[name] = [(r["step"], r["attempt"], [record["class"] for record in r["history"]]) for r in reports]
    return runs


@pytest.mark.timeout(180)
@pytest.mark.parametrize("exchange_type", ["topic", "direct"])
def test_retries_and_waits_on_a_quorum_queue_run_once_each_never_loop_and_never_get_lost(
    quorum_name: str, exchange_type: str, tmp_path: Path
) -> None:
    # Given a guarded worker on a quorum queue bound to a topic exchange (native delayed delivery) or a direct
    # one (the worker holds ETA messages), and jobs that retry after 0.05 s, wait 0.2 s, wait 1 s then 3 s
    app = quorum_app(quorum_name, exchange_type)
    client = redis.Redis.from_url(REDIS_URL)
    sink = f"gr-test-quorum-{uuid.uuid4().hex}"
    env = proj_env(queue=quorum_name, broker="amqp", GUARDRAILS_TEST_QUORUM=exchange_type)
    worker = WorkerProcess(app=PROJ_APP, queue=quorum_name, log_path=tmp_path / "worker.log", env=env, concurrency=3)
    try:
        with worker:
            # When they run
            results = run_scripts(app, sink)
            # Then each job succeeds, having run each step of its script exactly once, each retry spending an
            # attempt and each wait recorded (no run again at once, no attempt spent)
            with contextlib.suppress(AssertionError):  # one that never ends shows in the comparison below
                wait_for("every job ended", lambda: all(r.ready() for r in results.values()), timeout=40)
            assert (runs_of(client, sink), {name: r.state for name, r in results.items()}) == (
                EXPECTED,
                dict.fromkeys(SCRIPTS, "SUCCESS"),
            )
            # And nothing was refused, looped or dead-lettered
            assert "countdown must be a positive number" not in worker.log
            assert "given back to the broker" not in worker.log and "poison" not in worker.log
    finally:
        client.delete(*[f"{sink}:{name}" for name in SCRIPTS], *[f"{sink}:{name}:runs" for name in SCRIPTS])
        app.close()


@pytest.mark.timeout(120)
def test_a_poison_message_on_a_quorum_queue_is_counted_by_the_broker(quorum_name: str, tmp_path: Path) -> None:
    # Given a keyed message that SIGKILLs its worker's process every time it runs, on a quorum queue, with
    # max_deliveries 1
    app = quorum_app(quorum_name, "topic")
    client = redis.Redis.from_url(REDIS_URL)
    marker = f"gr-test-quorum-pids-{uuid.uuid4().hex}"
    guardrails = json.dumps({"max_deliveries": 1})
    env = proj_env(
        queue=quorum_name, broker="amqp", GUARDRAILS_TEST_QUORUM="topic", GUARDRAILS_TEST_GUARDRAILS=guardrails
    )
    worker = WorkerProcess(app=PROJ_APP, queue=quorum_name, log_path=tmp_path / "worker.log", env=env)
    try:
        with worker:
            # When it runs, kills its process, is redelivered (x-delivery-count 1) and kills it again
            poison = app.send_task("tests.proj.tasks.kill_my_worker_keyed", args=(random.randrange(10**9), marker))
            wait_for("the poison message failed", lambda: poison.state == "FAILURE", timeout=60)
            # Then it ran twice, and its third delivery (x-delivery-count 2 > 1) was dead-lettered unrun as poison
            assert client.llen(marker) == 2
            record = dead_letter_of(app, poison.id)
            assert (record["reason"], record["exc_message"]) == (
                "poison",
                f"tests.proj.tasks.kill_my_worker_keyed[{poison.id}] redelivered 2 times without finishing: poison",
            )
            # And the store kept no count of its starts: the broker counted them
            assert not client.exists(DELIVERIES_PREFIX + poison.id)
    finally:
        client.delete(marker)
        app.close()


def test_the_countdown_and_headers_of_a_republish_are_what_rabbitmq_takes() -> None:
    from celery_guardrails.broker.delays import countdown_for, republishable_headers

    # Given an app with a quorum queue on RabbitMQ, one with classic queues, and one on Redis
    quorum = quorum_app("gr-quorum-rule", "topic")
    classic = Celery("classic", broker="amqp://guest:guest@127.0.0.1:5672//", set_as_current=False)
    on_redis = Celery("redis", broker="sentinel://127.0.0.1:26379", set_as_current=False)
    on_redis.conf.broker_transport_options = {"visibility_timeout": 100}
    waits = [0.0, 0.05, 0.999, 1.0, 1.5, 2.0, 500.0]
    # Then native delayed delivery gets whole seconds of at least 1 (0 stays 0: published at once), rounded up
    assert [countdown_for(quorum, w) for w in waits] == [0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 500.0]
    # And classic queues keep the countdown; Redis (a sentinel:// URL too) caps it at 9/10 of its visibility
    assert [countdown_for(classic, w) for w in waits] == waits
    assert [countdown_for(on_redis, w) for w in waits] == [0.0, 0.05, 0.999, 1.0, 1.5, 2.0, 90.0]
    # And RabbitMQ's own headers are never copied into a re-publish; the application's own x- headers are
    raw = {
        "x-death": [{"queue": "celery_delayed_0"}],
        "x-first-death-queue": "celery_delayed_0",
        "x-last-death-reason": "expired",
        "X-Delivery-Count": 2,
        "x-request-id": "abc",
        "guardrails": {"v": 1},
    }
    assert republishable_headers(raw) == {"x-request-id": "abc", "guardrails": {"v": 1}}


@pytest.mark.timeout(120)
def test_a_poison_message_put_off_twice_before_its_body_keeps_its_count_and_dead_letters_at_max_deliveries(
    quorum_name: str, proxy: TcpProxy, tmp_path: Path
) -> None:
    # Given a keyed message that SIGKILLs its worker's process every time it runs (once the test opens its gate),
    # on a quorum queue (topic exchange), max_deliveries 1, on a worker whose store goes through a proxy
    app = quorum_app(quorum_name, "topic")
    client = redis.Redis.from_url(REDIS_URL)
    marker, gate = (f"gr-test-quorum-{what}-{uuid.uuid4().hex}" for what in ("pids", "gate"))
    store = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
    guardrails = json.dumps({"store": store, "max_deliveries": 1})
    env = proj_env(
        queue=quorum_name, broker="amqp", GUARDRAILS_TEST_QUORUM="topic", GUARDRAILS_TEST_GUARDRAILS=guardrails
    )
    worker = WorkerProcess(app=PROJ_APP, queue=quorum_name, log_path=tmp_path / "worker.log", env=env)
    try:
        with worker:
            poison = app.send_task(
                "tests.proj.tasks.kill_my_worker_at_a_gate", args=(random.randrange(10**9), marker, gate)
            )
            wait_for("its first run", lambda: client.llen(marker) == 1)
            # When its first run kills its process with the store cut, so that its redelivery (x-delivery-count 1)
            # is put off before its body, and so is the message that replaces it (a first delivery, which carries the
            # count in its header: the broker counted nothing of it)
            proxy.cut()
            client.rpush(gate, "die")
            wait_for("two deliveries put off", lambda: "(outage 2)" in worker.log, timeout=60)
            # and the store comes back: the next message runs, kills its process, and is redelivered
            client.rpush(gate, "die")
            proxy.restore()
            wait_for("the poison message failed", lambda: poison.state == "FAILURE", timeout=60)
            # Then it ran twice, not once more for each message that replaced it: the redelivery of the second run
            # (1 carried + x-delivery-count 1 = 2 > 1) was dead-lettered unrun as poison
            assert client.llen(marker) == 2
            record = dead_letter_of(app, poison.id)
            assert (record["reason"], record["exc_message"]) == (
                "poison",
                f"tests.proj.tasks.kill_my_worker_at_a_gate[{poison.id}] redelivered 2 times without finishing: poison",
            )
    finally:
        client.delete(marker, gate)
        app.close()


@pytest.mark.timeout(120)
def test_a_first_delivery_carrying_a_forged_delivery_count_runs_normally(quorum_name: str, tmp_path: Path) -> None:
    # Given a guarded worker on a quorum queue (topic exchange), max_deliveries 3 (the default)
    app = quorum_app(quorum_name, "topic")
    client = redis.Redis.from_url(REDIS_URL)
    sink = f"gr-test-quorum-{uuid.uuid4().hex}"
    env = proj_env(queue=quorum_name, broker="amqp", GUARDRAILS_TEST_QUORUM="topic")
    worker = WorkerProcess(app=PROJ_APP, queue=quorum_name, log_path=tmp_path / "worker.log", env=env)
    try:
        with worker:
            # When a publisher sends a message carrying its own x-delivery-count of 7 (on a first delivery the header
            # is the publisher's: the broker has counted nothing)
            forged = app.send_task("tests.proj.tasks.behave", args=(sink, ["ok"]), headers={"x-delivery-count": 7})
            # Then it runs once and succeeds: not taken for a message redelivered 7 times, not dead-lettered poison
            assert forged.get(timeout=40)["step"] == "ok"
            assert (client.get(f"{sink}:runs"), has_dead_letter(app, forged.id)) == (b"1", False)
            assert "poison" not in worker.log
    finally:
        client.delete(sink, f"{sink}:runs")
        app.close()


@pytest.mark.timeout(120)
def test_a_retry_the_publish_refuses_is_one_guardrail_error_dead_letter_and_never_given_back(
    quorum_name: str, tmp_path: Path
) -> None:
    # Given a guarded worker on a quorum queue (topic exchange: Celery's native delayed delivery carries
    # countdowns), and a task composed without the Retries guardrail whose body asks Celery for a retry in 0.5 s
    # (nothing rounds it up: kombu's calculate_routing_key refuses it, "countdown must be a positive number", a
    # ValueError from the publish of the retry)
    app = quorum_app(quorum_name, "topic")
    client = redis.Redis.from_url(REDIS_URL)
    sink = f"gr-test-quorum-{uuid.uuid4().hex}"
    env = proj_env(queue=quorum_name, broker="amqp", GUARDRAILS_TEST_QUORUM="topic")
    worker = WorkerProcess(app=PROJ_APP, queue=quorum_name, log_path=tmp_path / "worker.log", env=env)
    try:
        with worker:
            # When it runs
            job = app.send_task("tests.proj.tasks.retry_as_asked", args=(sink, 0.5))
            # Then it ends as a final failure: one dead letter guardrail_error naming the refusal
            wait_for("the job failed", lambda: job.state == "FAILURE", timeout=40)
            records = dead_letters_of(app, job.id)
            assert [(r["reason"], r["exc_type"]) for r in records] == [
                ("guardrail_error", "celery_guardrails.exceptions.GuardrailsError")
            ], records
            assert "countdown must be a positive number" in records[0]["exc_message"]
            # And it was never given back to the broker to run again at once: its body ran once, and no "given back"
            # line (its record's message says it was not)
            assert client.get(f"{sink}:runs") == b"1"
            assert "given back to the broker unacked" not in worker.log
    finally:
        client.delete(f"{sink}:runs")
        app.close()
