"""Context propagation on a real worker: the tenant and correlation id arrive unchanged on every path."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import chain, chord, group

from celery_guardrails import correlation_context, current_tenant, tenant_context
from tests.conftest import BOTH_BROKERS, Sink
from tests.proj import tasks
from tests.support.workers import PROJ_APP, BeatProcess, WorkerProcess, proj_env

TIMEOUT = 30


def assert_context(report: dict[str, Any], tenant: str | None, cid: str) -> None:
    assert (report["tenant"], report["cid"]) == (tenant, cid), report


@BOTH_BROKERS
def test_delay_carries_tenant_and_correlation_id(celery_worker: Any, broker: str) -> None:
    # Given a tenant and a correlation context
    with tenant_context("acme"), correlation_context("req-delay-1"):
        # When the task is published with delay
        result = tasks.observe.delay()
    # Then the worker saw both, unchanged
    assert_context(result.get(timeout=TIMEOUT), "acme", "req-delay-1")


@BOTH_BROKERS
def test_apply_async_and_per_call_overrides(celery_worker: Any, broker: str) -> None:
    with tenant_context("acme"), correlation_context("req-apply-1"):
        inherited = tasks.observe.apply_async()
        overridden = tasks.observe.apply_async(tenant="globex", correlation_id="req-other")
    assert_context(inherited.get(timeout=TIMEOUT), "acme", "req-apply-1")
    assert_context(overridden.get(timeout=TIMEOUT), "globex", "req-other")


@BOTH_BROKERS
def test_send_task_by_name(celery_worker: Any, celery_app: Any, broker: str) -> None:
    with tenant_context("acme"), correlation_context("req-send-1"):
        result = celery_app.send_task("tests.proj.tasks.observe")
    assert_context(result.get(timeout=TIMEOUT), "acme", "req-send-1")


@pytest.mark.smoke
def test_chain_every_step(celery_worker: Any, sink: Sink) -> None:
    with tenant_context("acme"), correlation_context("req-chain-1"):
        chain(
            tasks.observe.s(sink=sink.key), tasks.observe.s(sink=sink.key), tasks.observe.s(sink=sink.key)
        ).delay().get(timeout=TIMEOUT)
    reports = sink.wait(3)
    assert [(r["tenant"], r["cid"]) for r in reports] == [("acme", "req-chain-1")] * 3


def test_group_every_member(celery_worker: Any) -> None:
    with tenant_context("acme"), correlation_context("req-group-1"):
        reports = group(tasks.observe.s() for _ in range(3)).delay().get(timeout=TIMEOUT)
    assert [(r["tenant"], r["cid"]) for r in reports] == [("acme", "req-group-1")] * 3


def test_chord_header_and_callback(celery_worker: Any) -> None:
    with tenant_context("acme"), correlation_context("req-chord-1"):
        report = chord([tasks.observe.s(), tasks.observe.s()], tasks.collect.s()).delay().get(timeout=TIMEOUT)
    assert_context(report, "acme", "req-chord-1")
    for part in report["parts"]:
        assert_context(part, "acme", "req-chord-1")


def test_link_callback(celery_worker: Any, sink: Sink) -> None:
    with tenant_context("acme"), correlation_context("req-link-1"):
        tasks.observe.apply_async(link=tasks.observe.s(sink=sink.key)).get(timeout=TIMEOUT)
    (report,) = sink.wait(1)
    assert_context(report, "acme", "req-link-1")


def test_link_error_errback(celery_worker: Any, sink: Sink) -> None:
    with tenant_context("acme"), correlation_context("req-errback-1"):
        failed = tasks.explode.apply_async(link_error=tasks.record_errback.s(sink=sink.key))
    with pytest.raises(ValueError, match="boom"):
        failed.get(timeout=TIMEOUT)
    (report,) = sink.wait(1)
    assert report["failed_task_id"] == failed.id
    assert_context(report, "acme", "req-errback-1")


@BOTH_BROKERS
@pytest.mark.smoke
def test_three_retries_keep_the_context(celery_worker: Any, sink: Sink, broker: str) -> None:
    with tenant_context("acme"), correlation_context("req-retry-1"):
        final = tasks.retry_thrice.delay(sink=sink.key).get(timeout=TIMEOUT)
    attempts = sink.wait(4)
    assert [a["retries"] for a in attempts] == [0, 1, 2, 3]
    assert [(a["tenant"], a["cid"]) for a in attempts] == [("acme", "req-retry-1")] * 4
    assert final["retries"] == 3


@BOTH_BROKERS
def test_child_task_inherits_unless_overridden(celery_worker: Any, celery_app: Any, broker: str) -> None:
    with tenant_context("acme"), correlation_context("req-child-1"):
        parent = tasks.spawn_child.delay().get(timeout=TIMEOUT)
        overriding = tasks.spawn_child.delay(child_tenant="globex").get(timeout=TIMEOUT)
    child = celery_app.AsyncResult(parent["child_id"]).get(timeout=TIMEOUT)
    assert_context(parent, "acme", "req-child-1")
    assert_context(child, "acme", "req-child-1")
    other = celery_app.AsyncResult(overriding["child_id"]).get(timeout=TIMEOUT)
    assert_context(other, "globex", "req-child-1")


def test_publish_outside_any_context_gets_one_id_its_children_keep(celery_worker: Any, celery_app: Any) -> None:
    # Given no tenant and no correlation context
    assert current_tenant() is None
    # When a task is published twice, each publishing a child
    first = tasks.spawn_child.delay().get(timeout=TIMEOUT)
    second = tasks.spawn_child.delay().get(timeout=TIMEOUT)
    first_child = celery_app.AsyncResult(first["child_id"]).get(timeout=TIMEOUT)
    # Then each publish got its own new id, and the child kept its parent's
    assert first["cid"] and second["cid"] and first["cid"] != second["cid"]
    assert first_child["cid"] == first["cid"]
    assert first["tenant"] is None and first_child["tenant"] is None


def test_plain_celery_message_and_malformed_header(celery_worker: Any, celery_app: Any, queue_name: str) -> None:
    # Given messages published without going through the extension: one with no guardrails header (plain
    # Celery, an older release), one whose header is not a mapping, one with malformed fields
    results = {}
    for label, header in (("absent", None), ("junk", "junk"), ("bad-fields", {"tenant": 42, "cid": "a b"})):
        task_id = str(uuid.uuid4())
        message = celery_app.amqp.create_task_message(task_id, "tests.proj.tasks.observe", (), {})
        if header is not None:
            message.headers["guardrails"] = header
        with celery_app.producer_or_acquire() as producer:
            producer.publish(
                message.body,
                exchange="",
                routing_key=queue_name,
                headers=message.headers,
                serializer="json",
                declare=[celery_app.amqp.queues[queue_name]],
                **message.properties,
            )
        results[label] = celery_app.AsyncResult(task_id)
    # Then each runs with no tenant and a fresh, well-formed correlation id: nothing crashes
    for label, result in results.items():
        report = result.get(timeout=TIMEOUT)
        assert report["tenant"] is None, label
        assert len(report["cid"]) == 32, label


def test_beat_dispatch_carries_the_entry_tenant(
    celery_worker: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a beat entry for tenant "acme", dispatched every second by a real beat process
    schedule = {
        "observe": {
            "task": "tests.proj.tasks.spawn_child",
            "schedule": 1.0,
            "kwargs": {"sink": sink.key},
            "options": {"tenant": "acme", "queue": queue_name},
        }
    }
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_BEAT=json.dumps(schedule))
    with BeatProcess(app=PROJ_APP, workdir=tmp_path, env=env):
        # When two runs have happened (each spawning a child)
        reports = sink.wait(4, timeout=45)
    runs = {r["task_id"]: r for r in reports if r["task"] == "tests.proj.tasks.spawn_child"}
    children = [r for r in reports if r["task"] == "tests.proj.tasks.observe"]
    # Then every run and child ran as "acme"; each run has its own correlation id, kept by its child
    assert all(r["tenant"] == "acme" for r in reports), reports
    assert len({r["cid"] for r in runs.values()}) == len(runs)
    run_cids = {r["child_id"]: r["cid"] for r in runs.values()}
    for child in children:
        if child["task_id"] in run_cids:
            assert child["cid"] == run_cids[child["task_id"]]


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_consecutive_tasks_in_one_worker_process_never_share_context(
    pool: str, queue_name: str, celery_app: Any, tmp_path: Path, broker: str
) -> None:
    # Given a real worker process with one execution slot
    env = proj_env(queue=queue_name, broker="redis")
    with WorkerProcess(app=PROJ_APP, queue=queue_name, pool=pool, log_path=tmp_path / "w.log", env=env):
        # When a task for "acme" runs, then one without any tenant
        with tenant_context("acme"), correlation_context("req-first"):
            first = tasks.observe.delay().get(timeout=TIMEOUT)
        second = tasks.observe.delay().get(timeout=TIMEOUT)
    # Then the second, in the same process, saw neither the tenant nor the correlation id of the first
    assert first["pid"] == second["pid"]
    assert_context(first, "acme", "req-first")
    assert second["tenant"] is None and second["cid"] not in (None, "req-first")


@pytest.mark.parametrize("celery_worker_pool", ["threads"], indirect=True)
def test_threads_pool_never_shares_context(celery_worker: Any) -> None:
    with tenant_context("acme"), correlation_context("req-thread-1"):
        first = tasks.observe.delay().get(timeout=TIMEOUT)
    second = tasks.observe.delay().get(timeout=TIMEOUT)
    assert_context(first, "acme", "req-thread-1")
    assert second["tenant"] is None and second["cid"] != "req-thread-1"


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_redelivery_after_sigkill_keeps_the_context(
    celery_app: Any, broker: str, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given an acks_late task running on a real worker over RabbitMQ, for tenant "acme"
    env = proj_env(queue=queue_name, broker="amqp")
    first = WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "first.log", env=env)
    with first:
        with tenant_context("acme"), correlation_context("req-kill-1"):
            tasks.hold_until_redelivered.apply_async(kwargs={"sink": sink.key})
        sink.wait(1)
        # When the worker is SIGKILLed mid-task
        first.kill()
        first.wait(15)
    # Then a new worker gets the message again, with the same tenant and correlation id
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "second.log", env=env):
        before, after = sink.wait(2)
    assert (before["redelivered"], after["redelivered"]) == (False, True)
    assert before["task_id"] == after["task_id"]
    assert_context(before, "acme", "req-kill-1")
    assert_context(after, "acme", "req-kill-1")
