"""Faults Celery meets in the worker's main process, on a real prefork worker over Redis: a malformed envelope
is dead-lettered and the worker goes on; a task killed by its hard time limit is dead-lettered as
``time_limit``, or retried when it may run again."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import Sink, unacked, waiting_messages
from tests.proj import tasks
from tests.support.dead_letters import dead_letter_of, has_dead_letter
from tests.support.messages import publish_body, publish_raw
from tests.support.proxy import TcpProxy
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env


@pytest.fixture
def worker(celery_app: Any, queue_name: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_GUARDRAILS=json.dumps({"backoff_base": 0.05}))
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env) as process:
        yield process  # type: ignore[misc]


@pytest.mark.parametrize(
    ("envelope", "problem"),
    [
        ({"expires": "the day after tomorrow"}, "expires"),
        ({"eta": "soon"}, "eta"),
        ({"timelimit": "abc"}, "timelimit"),
        ({"timelimit": [-5, None]}, "timelimit"),
    ],
)
def test_a_malformed_envelope_is_dead_lettered_and_the_worker_goes_on(
    worker: WorkerProcess,
    celery_app: Any,
    sink: Sink,
    queue_name: str,
    envelope: dict[str, Any],
    problem: str,
) -> None:
    # Given a message whose envelope Celery cannot read (another producer wrote it), before an ordinary one
    bad = publish_raw(celery_app, queue_name, "tests.proj.tasks.observe", kwargs={"sink": sink.key}, **envelope)
    good = tasks.observe.delay()
    # When the worker meets it, Then the next message still runs (the worker did not stop) ...
    assert good.get(timeout=60)["task"] == "tests.proj.tasks.observe"
    wait_for("the malformed message gone", lambda: not unacked(bad) and waiting_messages("redis", queue_name) == 0)
    # ... and the malformed one did not run: it is a dead letter that says why
    assert sink.items() == []
    record = dead_letter_of(celery_app, bad)
    assert (record["reason"], record["task_name"], record["kwargs"]) == (
        "malformed_message",
        "tests.proj.tasks.observe",
        {"sink": sink.key},
    )
    assert problem in record["exc_message"].lower() or "date" in record["exc_message"].lower()
    assert worker.process is not None and worker.process.poll() is None


def test_a_task_killed_by_its_hard_time_limit_is_a_dead_letter(
    worker: WorkerProcess, celery_app: Any, sink: Sink
) -> None:
    # Given a task that is not idempotent, running longer than its hard time limit
    result = tasks.behave_not_idempotent.apply_async((sink.key, ["sleep:30"]), time_limit=1)
    # When the pool kills it, Then it is a dead letter time_limit (before Celery acks it), and the worker goes on
    with pytest.raises(Exception, match=r"TimeLimitExceeded|Time limit"):
        result.get(timeout=60)
    wait_for("the dead letter", lambda: has_dead_letter(celery_app, result.id))
    record = dead_letter_of(celery_app, result.id)
    assert (record["reason"], record["attempts"]) == ("time_limit", 1)
    assert record["history"][-1]["rule"] == "time_limit"
    assert tasks.observe.delay().get(timeout=60)["task"] == "tests.proj.tasks.observe"


def test_an_idempotent_task_killed_by_its_hard_time_limit_is_retried(worker: WorkerProcess, sink: Sink) -> None:
    # Given an idempotent task whose first run outlives its hard time limit, and whose second is quick
    result = tasks.behave.apply_async((sink.key, ["sleep:30", "ok"]), time_limit=3)
    # Then it is tried again, as its second attempt, and succeeds (the first run's FAILURE, stored by Celery
    # as the pool killed it, is RETRY a moment later: waited for, not read at once; and read afresh each time,
    # since an AsyncResult that once read FAILURE, a ready state, keeps it cached)
    wait_for("the retry's success", lambda: tasks.behave.AsyncResult(result.id).state == "SUCCESS")
    report = result.get(timeout=10)
    assert (report["run"], report["attempt"]) == (2, 2)
    assert [r["rule"] for r in report["history"]] == ["time_limit"]


def test_a_task_killed_by_its_hard_time_limit_is_not_failed_before_its_dead_letter_is_recorded(
    celery_app: Any, proxy: TcpProxy, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a prefork worker whose dead-letter sink (a Redis stream) is reached through a proxy, cut, and every
    # state the result backend stores for a task id, in order (the Redis backend publishes each on the key)
    url = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_GUARDRAILS=json.dumps({"dead_letter_sinks": [url]}))
    proxy.cut()
    task_id = str(uuid.uuid4())
    backend = redis.Redis.from_url(REDIS_URL)
    stored = backend.pubsub()
    stored.subscribe(f"celery-task-meta-{task_id}")
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env) as worker:
        # When a task that is not idempotent outlives its hard time limit, and its dead letter cannot be written
        tasks.behave_not_idempotent.apply_async((sink.key, ["sleep:30"]), time_limit=1, task_id=task_id)
        wait_for("the failed write logged", lambda: "dead letter not recorded" in worker.log)
        proxy.restore()
        # Then the message came back with it (not acked away): it is recorded once the sink is back, as time_limit
        # after one attempt, and the body did not run again
        wait_for("the dead letter", lambda: has_dead_letter(celery_app, task_id))
        wait_for("the failure stored", lambda: _state_of(backend, task_id) == "FAILURE")
        wait_for("the message acked", lambda: not unacked(task_id))
    record = dead_letter_of(celery_app, task_id)
    assert (record["reason"], record["attempts"]) == ("time_limit", 1)
    assert len(sink.items()) == 1
    # And until then the result said RETRY, as any pending dead letter does: FAILURE was stored once, last, as the
    # record was written (not as the pool killed the task, with nothing recorded)
    states = _states_published(stored)
    assert states[-1] == "FAILURE" and "FAILURE" not in states[:-1] and "RETRY" in states, states


def _state_of(backend: redis.Redis, task_id: str) -> str | None:
    raw = backend.get(f"celery-task-meta-{task_id}")
    return None if raw is None else str(json.loads(raw)["status"])


def _states_published(stored: Any) -> list[str]:
    """The states published on the subscription ``stored`` so far, oldest first (each is published with the
    write that stores it: the last one the test read is there already)."""
    states: list[str] = []
    while (message := stored.get_message(timeout=1.0)) is not None:
        if message["type"] == "message":  # not the subscription's confirmation
            states.append(str(json.loads(message["data"])["status"]))
    stored.close()
    return states


def nested(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_payload_the_pool_cannot_take_is_dead_lettered_and_the_worker_goes_on(
    celery_app: Any, sink: Sink, queue_name: str, tmp_path: Path, pool: str
) -> None:
    # Given a worker that takes pickle as well as JSON, and messages another producer wrote: arguments 700 levels
    # deep, a header 700 levels deep (prefork pickles both to hand them to its child: past the recursion limit
    # that stopped the worker's main process, and every worker after it), and a pickled object that refuses to
    # be pickled again
    # (C_FORCE_ROOT: Celery refuses pickle to a worker running as root, as CI's does)
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_ACCEPT=json.dumps(["json", "pickle"]), C_FORCE_ROOT="1")
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env, pool=pool) as worker:
        observe = "tests.proj.tasks.observe"
        bad = [
            publish_raw(celery_app, queue_name, observe, args=[nested(700)], kwargs={"sink": sink.key}),
            publish_raw(celery_app, queue_name, observe, kwargs={"sink": sink.key}, deep_header=nested(700)),
        ]
        undecodable = [
            publish_body(celery_app, queue_name, observe, b"[[" + b"[" * 3000 + b"1" + b"]" * 3000 + b"], {}, {}]"),
            publish_body(celery_app, queue_name, observe, b'[["sink", {"password": "hunter2"'),
        ]
        if pool == "prefork":  # the other pools hand nothing over: an object that pickles once runs there
            once = tasks.TravelsOnce()
            bad.append(
                publish_raw(
                    celery_app, queue_name, observe, args=[once], kwargs={"sink": sink.key}, serializer="pickle"
                )
            )
        # and pickled messages of a task that retries (idempotent, 2 attempts): a set JSON cannot carry, and (solo
        # runs it) an object that will not pickle again for its retry
        loud = tasks.fail_loudly.name
        pickled = [
            publish_raw(
                celery_app, queue_name, loud, args=["down", {1, 2}], kwargs={"kind": "runtime"}, serializer="pickle"
            )
        ]
        if pool == "solo":
            once = tasks.TravelsOnce()
            pickled.append(
                publish_raw(
                    celery_app, queue_name, loud, args=["down", once], kwargs={"kind": "runtime"}, serializer="pickle"
                )
            )
        good = tasks.observe.delay()
        # When the worker meets them, Then the next message still runs: the worker did not stop
        assert good.get(timeout=60)["task"] == observe
        settled = [*bad, *undecodable, *pickled]
        wait_for(
            "every bad message settled",
            lambda: waiting_messages("redis", queue_name) == 0 and not any(map(unacked, settled)),
        )
        # And none of them ran: each is a dead letter malformed_message that says why
        assert sink.items() == []
        records = [dead_letter_of(celery_app, task_id) for task_id in bad]
        assert [r["reason"] for r in records] == ["malformed_message"] * len(bad)
        assert "over max_payload_depth 100" in records[0]["exc_message"]
        assert "over max_payload_depth 100" in records[1]["exc_message"]
        if pool == "prefork":
            assert "the pool could not take this message: TypeError: TravelsOnce" in records[2]["exc_message"]
        # And a body no decoder reads (nested past the JSON decoder's recursion limit, or cut short) is a dead letter
        # too, without its arguments; Celery would have logged its raw body, and acked it with nothing recorded
        for task_id in undecodable:
            record = dead_letter_of(celery_app, task_id)
            assert (record["reason"], record["args"], record["kwargs"]) == ("malformed_message", [], {})
            assert record["exc_message"].startswith("the body could not be decoded (application/json): DecodeError")
        # And a pickled message is retried as pickle (Celery would re-publish it as JSON, which refuses the set: it
        # came back unacked until the poison guard took it), and one whose retry cannot be encoded at all is a dead
        # letter malformed_message at once
        wait_for("the pickled ones recorded", lambda: all(has_dead_letter(celery_app, task_id) for task_id in pickled))
        retried = dead_letter_of(celery_app, pickled[0])
        assert (retried["reason"], retried["attempts"]) == ("attempts_exhausted", 2)
        if pool == "solo":
            unpublishable = dead_letter_of(celery_app, pickled[1])
            assert unpublishable["reason"] == "malformed_message"
            assert "its retry could not be encoded" in unpublishable["exc_message"]
        assert "redelivered 2 times" not in worker.log and "given back to the broker" not in worker.log
        assert worker.process is not None and worker.process.poll() is None
        assert "Unrecoverable error" not in worker.log
        assert "hunter2" not in worker.log and "Can't decode message body" not in worker.log
