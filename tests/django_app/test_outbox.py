"""Transactional enqueue on real brokers and the test database: ``delay_on_commit`` publishes after a commit
and never after a rollback, with the caller's tenant; the outbox writes in the caller's transaction, its relay
publishes each committed message with the captured context and keeps what it cannot publish; and under load,
with the relay SIGKILLed twice, exactly the committed effects happen, once each."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from django.db import connection, transaction
from django.utils import timezone

from celery_guardrails import GuardedTask, tenant_context
from celery_guardrails.exceptions import MissingTenantError, SensitivePayloadError
from django_celery_guardrails.models import OutboxMessage
from django_celery_guardrails.outbox import backlog, relay
from tests.conftest import Sink
from tests.proj import django_tasks, tasks
from tests.support.proxy import TcpProxy
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


class Rollback(Exception):
    pass


def test_delay_on_commit_publishes_after_the_commit_with_the_callers_tenant(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    # Given a request of tenant acme that enqueues a task in a transaction
    with tenant_context("acme"), transaction.atomic():
        tasks.versioned.delay_on_commit(sink.key, 1)
        # Then nothing is published before the commit
        assert redis.Redis.from_url(REDIS_URL).llen(celery_app.conf.task_default_queue) == 0
    # When it commits, Then the task runs, with the tenant the caller had
    [report] = sink.wait(1)
    assert (report["order_id"], report["tenant"]) == (1, "acme")


def test_delay_on_commit_after_a_rollback_publishes_nothing(celery_app: Any, celery_worker: Any, sink: Sink) -> None:
    # Given a transaction that enqueues a task and then rolls back
    with pytest.raises(Rollback), transaction.atomic():
        tasks.versioned.delay_on_commit(sink.key, 1)
        raise Rollback
    # When a task published after it has run (one queue, one worker: the first would have run before it)
    tasks.versioned.delay(sink.key, 2).get(timeout=30)
    # Then only that one ran
    assert [r["order_id"] for r in sink.items()] == [2]


def test_delay_on_commit_checks_the_payload_and_the_tenant_in_the_caller(celery_app: Any) -> None:
    with pytest.raises(SensitivePayloadError), transaction.atomic():
        tasks.log_in.delay_on_commit(7, password="x")
    with pytest.raises(MissingTenantError), transaction.atomic():
        tasks.tenant_only.delay_on_commit("sink")


def test_the_outbox_writes_in_the_transaction_and_the_relay_publishes_once(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    # Given two transactions that enqueue through the outbox, one commits and one rolls back
    with tenant_context("acme"):
        with transaction.atomic():
            kept = tasks.versioned.enqueue_in_transaction(sink.key, 1)
        with pytest.raises(Rollback), transaction.atomic():
            tasks.versioned.apply_async((sink.key, 2), outbox=True)
            raise Rollback
    # Then only the committed one is in the outbox, with the caller's tenant, and nothing is published yet
    [row] = OutboxMessage.objects.all()
    assert (row.task_id, row.tenant, row.attempts) == (kept.id, "acme", 0)
    assert backlog()[0] == 1
    # When the relay passes
    done = relay(celery_app)
    # Then it published the one message (the caller's AsyncResult gets its result), ran with the tenant, and
    # the row is gone
    assert (done.published, done.failed) == (1, 0)
    assert kept.get(timeout=30)["tenant"] == "acme"
    assert OutboxMessage.objects.count() == 0 and backlog() == (0, None)
    assert [r["order_id"] for r in sink.items()] == [1]
    # And another pass publishes nothing more
    assert relay(celery_app).published == 0


def test_a_relay_that_cannot_reach_the_broker_keeps_the_rows_and_publishes_them_later(queue_name: str) -> None:
    # Given an app whose broker is reached through a proxy, and three messages in its outbox
    proxy = TcpProxy(6379)
    try:
        app = Celery("outbox-cut", broker=REDIS_URL.replace(":6379", f":{proxy.port}"), set_as_current=False)
        app.conf.update(
            task_default_queue=queue_name,
            broker_connection_retry=False,
            broker_connection_max_retries=0,
            task_publish_retry=False,
        )
        app.conf.guardrails = {"store": "django"}

        @app.task(base=GuardedTask, name=f"tests.outbox.{uuid.uuid4().hex[:8]}")
        def noted(n: int) -> int:
            return n

        for n in range(3):
            noted.enqueue_in_transaction(n)
        # When the relay passes while the broker is cut (the relay's clock is the test's: the backoff is exact)
        at = timezone.now()
        proxy.cut()
        done = relay(app, now=at)
        # Then nothing is lost: the first failure ends the batch, every row is kept, the failed one backed off
        assert (done.published, done.failed) == (0, 1)
        rows = list(OutboxMessage.objects.order_by("id"))
        assert [row.attempts for row in rows] == [1, 0, 0]
        assert rows[0].last_error and rows[0].available_at > rows[1].available_at
        # And once the broker is back, the relay publishes each row once (the backed-off one when it is due)
        assert rows[0].available_at == at + timedelta(seconds=1) and rows[1].available_at == at
        proxy.restore()
        assert relay(app, now=at).published == 2
        assert relay(app, now=rows[0].available_at).published == 1
        assert OutboxMessage.objects.count() == 0
        assert redis.Redis.from_url(REDIS_URL).llen(queue_name) == 3
    finally:
        proxy.close()


def test_a_row_that_cannot_be_published_is_kept_with_its_error(celery_app: Any) -> None:
    # Given a row left by a release whose task this one removed
    OutboxMessage.objects.create(
        task_name="tests.outbox.removed", task_id=uuid.uuid4().hex, body="[[], {}]", available_at=timezone.now()
    )
    # and a row whose body was damaged by hand
    OutboxMessage.objects.create(
        task_name=tasks.versioned.name, task_id=uuid.uuid4().hex, body="{not json", available_at=timezone.now()
    )
    # When the relay passes, Then each row stays, saying why, and is tried again later (nothing deleted unsent)
    assert relay(celery_app).failed == 2
    removed, damaged = OutboxMessage.objects.order_by("id")
    assert "no task 'tests.outbox.removed' is registered" in removed.last_error and removed.attempts == 1
    assert damaged.last_error.startswith(("DecodeError", "ValueError", "JSONDecodeError")) and damaged.attempts == 1


def test_options_that_cannot_be_kept_are_refused_at_enqueue(celery_app: Any) -> None:
    with pytest.raises(ValueError, match="link"):
        tasks.versioned.apply_async(("s", 1), outbox=True, link=tasks.observe.s())
    with pytest.raises(ValueError, match="'retry_policy' cannot be kept"):
        tasks.versioned.apply_async(("s", 1), outbox=True, retry_policy={"max_retries": 1})
    assert OutboxMessage.objects.count() == 0


def test_1000_transactions_half_rolled_back_the_relay_killed_twice_each_committed_effect_once(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("SKIP LOCKED and concurrent writers: the PostgreSQL pass")
    # Given 1,000 transactions that each write an order's effect through the outbox, every other one rolled back
    committed = []
    for n in range(1000):
        key = f"{sink.key}:{n}"
        try:
            with transaction.atomic():
                django_tasks.write_effect.enqueue_in_transaction(key, sink.key)
                if n % 2:
                    raise Rollback
            committed.append(key)
        except Rollback:
            pass
    assert OutboxMessage.objects.count() == 500
    # When workers relay and run them (RabbitMQ: a killed worker's deliveries come back at once), and the
    # worker, relay and all, is SIGKILLed twice on the way
    # (short leases: a key or an outbox row a killed worker held comes back in seconds, not a minute)
    settings = {
        "store": "django",
        "dead_letter_sinks": ["django"],
        "outbox_relay_lease": 2.0,
        "outbox_batch": 50,
        "idempotency_lease": 3.0,
    }
    env = proj_env(queue=queue_name, broker="amqp", django=True, GUARDRAILS_TEST_GUARDRAILS=json.dumps(settings))
    kills = 0
    for run, until in enumerate((100, 300, 500)):
        worker = WorkerProcess(
            app=PROJ_APP, queue=queue_name, concurrency=2, log_path=tmp_path / f"worker-{run}.log", env=env
        )
        with worker:
            wait_for(
                f"{until} effects",
                lambda until=until: Effect.objects.filter(key__startswith=sink.key).count() >= until,
                timeout=240,
            )
            if until < 500:
                worker.kill()
                worker.wait(30)
                kills += 1
            else:
                wait_for("the outbox empty", lambda: not OutboxMessage.objects.exists())
    # Then exactly the committed effects happened, once each
    assert kills == 2
    effects = list(Effect.objects.filter(key__startswith=sink.key).values_list("key", flat=True))
    assert sorted(effects) == sorted(committed)
