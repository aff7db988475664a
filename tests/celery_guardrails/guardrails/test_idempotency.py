"""Idempotency keys on a real worker over Redis, with the Redis store (the Django store: tests/django_app)."""

from __future__ import annotations

import json
import random
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_guardrails import DuplicateOfFailureError, IdempotencyKeyError, PermanentError, signals, tenant_context
from celery_guardrails.guardrails.idempotency import Heartbeats
from celery_guardrails.runtime.effects import provider_key
from celery_guardrails.stores import get_store
from tests.conftest import Sink, waiting_messages
from tests.proj import tasks
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env, quick_redelivery

TIMEOUT = 30


@pytest.fixture
def oid() -> int:
    """An order id of this test run only (keys live on in Redis for their retention)."""
    return random.randrange(10**9)


def effects(sink: Sink) -> int:
    return int(sink.client.get(f"{sink.key}:effects") or 0)


@pytest.mark.smoke
def test_same_message_twice_and_same_key_twice_make_one_effect(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int, received: Any
) -> None:
    skipped = received(signals.duplicate_skipped)
    with tenant_context("acme"):
        # Given a message delivered twice (same id), and a second message with the same key
        task_id = str(uuid.uuid4())
        first = tasks.charge.apply_async((oid, sink.key), task_id=task_id).get(timeout=TIMEOUT)
        tasks.charge.apply_async((oid, sink.key), task_id=task_id)  # the same message again
        wait_for("the same message skipped", lambda: skipped)
        second = tasks.charge.apply_async((oid, sink.key))
        other = second.get(timeout=TIMEOUT)
    # Then the body ran once, one effect; the duplicates were skipped, the other message got the original's
    # result
    assert (first, effects(sink), len(sink.items())) == (f"charged {oid}", 1, 1)
    assert other == f"charged {oid}"
    key = f"tests.proj.tasks.charge:acme:charge:{oid}"
    assert [(s["task_id"], s["key"], s["state"]) for s in skipped] == [
        (task_id, key, "completed"),
        (second.id, key, "completed"),
    ]
    assert sink.items()[0]["key"] == provider_key(key)  # the body sees the opaque key made from it
    assert get_store(celery_app).inspect(key)["state"] == "completed"


def test_keys_are_scoped_by_tenant(celery_worker: Any, celery_app: Any, sink: Sink, oid: int) -> None:
    for tenant in ("acme", "globex"):
        with tenant_context(tenant):
            tasks.charge.delay(oid, sink.key).get(timeout=TIMEOUT)
    assert effects(sink) == 2
    assert sorted(r["key"] for r in sink.items()) == sorted(
        provider_key(f"tests.proj.tasks.charge:{tenant}:charge:{oid}") for tenant in ("acme", "globex")
    )


@pytest.mark.parametrize("celery_worker_pool", ["threads"], indirect=True)
@pytest.mark.parametrize("celery_worker_parameters", [{"concurrency": 2}], indirect=True)
def test_a_duplicate_waits_for_the_running_delivery(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int, received: Any
) -> None:
    # Given a delivery holding the key until the test lets it finish, and a duplicate arriving meanwhile
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "retry_later_delay": 0.3}
    later = received(signals.retry_scheduled)
    gate = f"{sink.key}:gate"
    first = tasks.charge.delay(oid, sink.key, gate=gate)
    sink.wait(1)
    duplicate = tasks.charge.delay(oid, sink.key)
    # Then the duplicate comes back through RetryLater, and returns the summary once the first completed
    wait_for("the duplicate told to come back later", lambda: later)
    sink.client.rpush(gate, "go")
    assert first.get(timeout=TIMEOUT) == f"charged {oid}"
    assert duplicate.get(timeout=TIMEOUT) == f"charged {oid}"
    assert effects(sink) == 1
    assert [(s["task_id"], s["kind"], s["rule"]) for s in later][:1] == [
        (duplicate.id, "retry_later", "idempotency:busy")
    ]


def test_transient_failure_releases_and_the_retry_completes(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int
) -> None:
    assert tasks.charge.delay(oid, sink.key, ["transient", "ok"]).get(timeout=TIMEOUT) == f"charged {oid}"
    assert [r["attempt"] for r in sink.items()] == [1, 2]
    assert get_store(celery_app).inspect(f"tests.proj.tasks.charge:-:charge:{oid}")["state"] == "completed"


def test_permanent_failure_marks_the_key_failed_and_duplicates_are_ignored(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int, received: Any
) -> None:
    skipped = received(signals.duplicate_skipped)
    with pytest.raises(PermanentError):
        tasks.charge.delay(oid, sink.key, ["permanent"]).get(timeout=TIMEOUT)
    store, key = get_store(celery_app), f"tests.proj.tasks.charge:-:charge:{oid}"
    # (marked failed by on_failure, which Celery calls after it stores the result: waited for)
    wait_for("the key failed", lambda: store.inspect(key)["state"] == "failed")  # type: ignore[index]
    duplicate = tasks.charge.delay(oid, sink.key)
    wait_for("the duplicate skipped", lambda: skipped)
    assert [(s["task_id"], s["state"]) for s in skipped] == [(duplicate.id, "failed")]
    # and a client waiting on the duplicate sees the original's failure, not a result that never comes
    with pytest.raises(DuplicateOfFailureError, match="card refused"):
        duplicate.get(timeout=TIMEOUT)
    # a deliberate reopen (what a replay does) lets it run again
    assert store.reopen(key) is True
    assert tasks.charge.delay(oid, sink.key).get(timeout=TIMEOUT) == f"charged {oid}"
    assert effects(sink) == 1


def test_a_duplicate_of_a_failed_key_logs_one_line_without_a_traceback(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a charge whose key failed for good (a permanent error)
    with pytest.raises(PermanentError):
        tasks.charge.delay(oid, sink.key, ["permanent"]).get(timeout=TIMEOUT)
    store, key = get_store(celery_app), f"tests.proj.tasks.charge:-:charge:{oid}"
    wait_for("the key failed", lambda: store.inspect(key)["state"] == "failed")  # type: ignore[index]
    caplog.clear()
    # When a duplicate of it is delivered to the worker
    duplicate = tasks.charge.delay(oid, sink.key)
    with pytest.raises(DuplicateOfFailureError):
        duplicate.get(timeout=TIMEOUT)
    # Then the worker's lines about it say so once at INFO (the guardrail's) and once as Celery's "raised
    # expected" (logged after the result is stored: waited for), none above WARNING, none with a traceback
    wait_for("Celery's line", lambda: any(f"{duplicate.id}] raised expected" in r.getMessage() for r in caplog.records))
    about = [r for r in caplog.records if duplicate.id in r.getMessage()]
    assert [r.levelname for r in about if r.name != "celery.worker.strategy"] == ["INFO", "INFO"], [
        (r.name, r.levelname, r.getMessage()) for r in about
    ]
    assert [r for r in about if r.exc_info or r.exc_text] == []
    assert any("already failed; not running it again" in r.getMessage() for r in about)
    assert any("raised expected: DuplicateOfFailureError" in r.getMessage() for r in about)


def test_a_result_celery_cannot_store_leaves_the_key_completed(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int
) -> None:
    # Given a charge whose body makes its effect, then returns what the JSON result serializer refuses
    result = tasks.charge.delay(oid, sink.key, ["unencodable"])
    # When Celery fails to store that result (the task ends FAILED, through on_failure)
    with pytest.raises(Exception) as failed:
        result.get(timeout=TIMEOUT)
    assert type(failed.value).__name__ == "EncodeError"
    # Then the key is completed, not failed: a second message with the key is a duplicate, one effect in all
    key = f"tests.proj.tasks.charge:-:charge:{oid}"
    assert get_store(celery_app).inspect(key)["state"] == "completed"
    assert tasks.charge.delay(oid, sink.key).get(timeout=TIMEOUT).startswith("{'order': ")
    assert effects(sink) == 1


def test_the_heartbeat_keeps_a_short_lease_alive_after_a_long_one_let_its_thread_sleep(celery_app: Any) -> None:
    # Given a heartbeat thread that last held a 60 s claim (so it sleeps 20 s between looks), then a claim
    # with a 1.5 s lease on the real Redis store
    store, beats = get_store(celery_app), Heartbeats()
    key, other = f"tests.heartbeat:-:{uuid.uuid4().hex}", f"tests.heartbeat:-:{uuid.uuid4().hex}"
    beats.add(store, other, "long", lease=60)
    beats.remove(other, "long")
    assert store.claim(key, owner="a", now=time.time(), lease=1.5, retention=600).state == "acquired"
    beats.add(store, key, "a", lease=1.5)

    # When the heartbeat runs
    def lease_until() -> float:
        return float(store.inspect(key)["lease_until"])  # type: ignore[index]

    leases = [lease_until()]

    def renewed_three_times() -> bool:
        if (current := lease_until()) != leases[-1]:
            leases.append(current)
        return len(leases) > 3

    # Then the thread woke for the short lease and renews it, again and again, each time further (a thread
    # still asleep for 20 s would not have renewed it at all within the bound)
    deadline = time.monotonic() + 15
    while not renewed_three_times():
        assert time.monotonic() < deadline, f"the lease was not renewed three times: {leases}"
        time.sleep(0.05)
    assert leases == sorted(leases)
    # And once the beats stop, the lease is not renewed past its last one: another delivery takes over after it
    beats.remove(key, "a")
    claim = store.claim(key, owner="b", now=time.time() + 1.5 + 1, lease=1.5, retention=600)
    assert (claim.state, claim.takeover) == ("acquired", True)


def test_send_task_without_the_header_is_keyed_on_the_worker(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int
) -> None:
    celery_app.send_task("tests.proj.tasks.charge", args=(oid, sink.key)).get(timeout=TIMEOUT)
    assert (
        celery_app.send_task("tests.proj.tasks.charge", args=(oid, sink.key)).get(timeout=TIMEOUT) == f"charged {oid}"
    )
    assert effects(sink) == 1


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: tasks.behave.apply_async(("s", []), idempotency_key="x" * 201), "201 characters, over 200"),
        (lambda: tasks.behave.apply_async(("s", []), idempotency_key="has space"), "whitespace"),
        (lambda: tasks.charge.apply_async((1, "s"), idempotency_key=""), "must be a str.format template"),
    ],
)
def test_bad_keys_are_refused_at_publish(celery_app: Any, queue_name: str, call: Any, message: str) -> None:
    with pytest.raises(Exception, match=message):
        call()
    assert waiting_messages("redis", queue_name) == 0


def test_template_naming_a_missing_argument_is_refused_at_publish(celery_app: Any, queue_name: str) -> None:
    from celery import shared_task

    from celery_guardrails import GuardedTask

    @shared_task(base=GuardedTask, bind=True, idempotency_key="pay:{order}", name="tests.missing_arg")
    def pay(self: GuardedTask, order_id: int) -> None: ...

    with pytest.raises(IdempotencyKeyError, match="names 'order', which is not an argument of the task"):
        pay.delay(1)
    assert waiting_messages("redis", queue_name) == 0


def test_dedupe_on_publish_returns_the_first_result(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int, queue_name: str
) -> None:
    first = tasks.charge.apply_async((oid, sink.key), dedupe_on_publish=True)
    second = tasks.charge.apply_async((oid, sink.key), dedupe_on_publish=True)
    assert second.id == first.id
    assert first.get(timeout=TIMEOUT) == f"charged {oid}"
    assert len(sink.items()) == 1


def test_sigkill_mid_body_redelivery_takes_over_the_expired_lease(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path
) -> None:
    # Given a worker (Redis store, 2 s lease, 3 s visibility timeout) that dies after the effect, before
    # completing the key
    config = {"idempotency_lease": 2.0}
    env = proj_env(
        queue=queue_name,
        GUARDRAILS_TEST_GUARDRAILS=json.dumps(config),
        GUARDRAILS_TEST_TRANSPORT_OPTIONS=json.dumps(quick_redelivery()),
    )
    result = tasks.charge.delay(oid, sink.key, hold=60)
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "first.log", env=env) as first:
        # (the effect, not the run's report: the body reports first, and a kill between the two made no effect)
        wait_for("the first run's effect", lambda: effects(sink) == 1)
        first.kill()
        first.wait(15)
    # When another worker starts: the message comes back after the visibility timeout, the lease has expired
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "second.log", env=env) as second:
        assert result.get(timeout=TIMEOUT) == f"charged {oid}"
        time.sleep(0.5)
    # Then the new delivery took over and ran the body: with the Redis store the effect ran twice. This is
    # the documented window (effect done, completion mark not): a natural key or the provider's
    # idempotency key closes it; the Django store with atomic=True does (tests/django_app/test_store.py).
    assert [r["run"] for r in sink.items()] == [1, 2]
    assert effects(sink) == 2
    assert f"took over key tests.proj.tasks.charge:-:charge:{oid}" in second.log
    assert get_store(celery_app).inspect(f"tests.proj.tasks.charge:-:charge:{oid}")["state"] == "completed"


def test_a_manual_retry_of_a_keyed_task_releases_its_claim(celery_worker: Any, celery_app: Any, sink: Sink) -> None:
    # Given a keyed task (a 60 s lease) whose first run calls self.retry(countdown=0.2)
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "idempotency_lease": 60.0}
    oid = random.randrange(10**9)
    # When it runs
    report = tasks.retry_keyed.delay(oid, sink.key).get(timeout=TIMEOUT)
    # Then the retry found the key free (released before it was published): it ran at once, with no wait
    # behind the first run's lease and no takeover, its history saying only that the body asked for a retry
    assert report["run"] == 2
    assert [r["class"] for r in report["history"]] == ["manual"]
    assert get_store(celery_app).inspect(f"tests.proj.tasks.retry_keyed:-:retry:{oid}")["state"] == "completed"
