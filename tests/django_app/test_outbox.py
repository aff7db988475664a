"""Transactional enqueue on real brokers and the test database: ``delay_on_commit`` publishes after a commit
and never after a rollback, with the caller's tenant; the outbox writes in the caller's transaction, its relay
publishes each committed message with the captured context and keeps what it cannot publish; on RabbitMQ
without confirm_publish a refusal (a missing exchange, a message no queue takes) stays with its own row; a row
that cannot be published becomes a dead letter after outbox_max_attempts, replayable; and under load, with the
relay SIGKILLed twice, exactly the committed effects happen, once each."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from cryptography.fernet import Fernet
from django.core.checks import run_checks
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone
from kombu import Connection

from celery_guardrails import GuardedTask, tenant_context
from celery_guardrails.exceptions import MissingTenantError, SensitivePayloadError
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.outbox import confirms_off
from django_celery_guardrails.models import DeadLetter, OutboxMessage, SealedMessage
from django_celery_guardrails.outbox import BACKOFF_MAX, backlog, relay
from django_celery_guardrails.replay import replay_dead_letters
from tests.conftest import Sink
from tests.proj import django_tasks, tasks
from tests.support.proxy import TcpProxy
from tests.support.services import BROKER_URLS, REDIS_URL
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


class Rollback(Exception):
    pass


RABBITMQ = pytest.mark.parametrize("broker", ["amqp"], indirect=True)


def backoffs(attempts: int) -> list[float]:
    """The relay's waits after each of ``attempts`` failed publishes: 1 s doubling, at most BACKOFF_MAX."""
    return [min(BACKOFF_MAX, 2.0 ** (n - 1)) for n in range(1, attempts + 1)]


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
        # When the relay passes while the broker is cut (the relay's clock is the test's)
        at = timezone.now()
        proxy.cut()
        done = relay(app, now=at)
        # Then nothing is lost: the first failure ends the batch, every row is kept, due again at once, and no
        # attempt is spent on the broker's absence (it is no row's fault: none of them nears a dead letter)
        assert (done.published, done.failed, done.dead_lettered) == (0, 1, 0)
        rows = list(OutboxMessage.objects.order_by("id"))
        assert [row.attempts for row in rows] == [0, 0, 0]
        assert rows[0].last_error and not rows[1].last_error
        assert [row.available_at for row in rows] == [at, at, at]
        # And once the broker is back, the relay publishes each row once
        proxy.restore()
        assert relay(app, now=at).published == 3
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
    # (two tries each at most)
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "dead_letter_sinks": ["django"],
        "outbox_max_attempts": 2,
    }
    # When the relay passes, Then each row stays, saying why, and is tried again later (nothing deleted unsent)
    at = timezone.now()
    assert relay(celery_app, now=at).failed == 2
    removed, damaged = OutboxMessage.objects.order_by("id")
    assert "no task 'tests.outbox.removed' is registered" in removed.last_error and removed.attempts == 1
    assert damaged.last_error.startswith(("DecodeError", "ValueError", "JSONDecodeError")) and damaged.attempts == 1
    # When it passes again once they are due, Then both are dead letters, unpublishable, and the outbox is empty
    assert relay(celery_app, now=at + timedelta(seconds=1)).dead_lettered == 2
    assert not OutboxMessage.objects.exists()
    records = {r.task_id: r for r in DeadLetter.objects.filter(task_id__in=[removed.task_id, damaged.task_id])}
    assert {r.reason for r in records.values()} == {"unpublishable"}
    # And the damaged one keeps what its body held, flagged not replayable, never as a call without arguments
    kept = records[damaged.task_id]
    assert kept.arguments_are_repr and "{not json" in json.dumps(kept.args)
    assert replay_dead_letters([kept.pk], app=celery_app).replayed == []
    assert DeadLetter.objects.get(pk=kept.pk).status == DeadLetter.Status.OPEN


@RABBITMQ
def test_on_rabbitmq_a_row_no_queue_takes_is_kept_not_confirmed_and_dropped(
    broker: str, celery_app: Any, queue_name: str
) -> None:
    # Given an exchange that exists but that no queue is bound to, and a row sent to it
    exchange = f"gr-unbound-{uuid.uuid4().hex[:12]}"
    with Connection(BROKER_URLS["amqp"]) as conn:
        conn.default_channel.exchange_declare(exchange, "direct", durable=False, auto_delete=False)
    try:
        with transaction.atomic():
            sent = tasks.versioned.apply_async(("s", 1), outbox=True, exchange=exchange, routing_key="nowhere")
        # When the relay passes
        at = timezone.now()
        done = relay(celery_app, now=at)
        # Then RabbitMQ returned it (mandatory) instead of confirming and dropping it: the row stays, saying why
        assert (done.published, done.failed) == (0, 1)
        row = OutboxMessage.objects.get()
        assert (row.task_id, row.attempts, row.available_at) == (sent.id, 1, at + timedelta(seconds=1))
        assert row.last_error.startswith("Unroutable") and "NO_ROUTE" in row.last_error and exchange in row.last_error
    finally:
        with Connection(BROKER_URLS["amqp"]) as conn:
            conn.default_channel.exchange_delete(exchange)


@RABBITMQ
def test_on_rabbitmq_a_refused_row_is_kept_with_its_own_error_then_dead_lettered_and_replayable(
    broker: str, celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    # Given an app on RabbitMQ without publisher confirms (Celery's default), at most 3 publishes per row
    assert not (celery_app.conf.broker_transport_options or {}).get("confirm_publish")
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "dead_letter_sinks": ["django"],
        "outbox_max_attempts": 3,
    }
    # and two committed rows: the first sent to an exchange that does not exist, the second to the task's queue
    missing = f"gr-missing-{uuid.uuid4().hex[:12]}"
    with tenant_context("acme"), transaction.atomic():
        refused = tasks.versioned.apply_async((sink.key, 1), outbox=True, exchange=missing, routing_key="x")
        fine = tasks.versioned.enqueue_in_transaction(sink.key, 2)
    # When the relay passes
    at = timezone.now()
    done = relay(celery_app, now=at)
    # Then the refusal is pinned to its own row: the first is kept with the broker's 404 and backed off, the second
    # is published, delivered and run (main's code deleted the first as sent, and failed the second in its place)
    assert (done.published, done.failed, done.dead_lettered) == (1, 1, 0)
    [row] = OutboxMessage.objects.all()
    assert (row.task_id, row.attempts, row.available_at) == (refused.id, 1, at + timedelta(seconds=1))
    assert "NotFound" in row.last_error and "404" in row.last_error and missing in row.last_error
    assert fine.get(timeout=30)["order_id"] == 2
    # When the relay passes again half-way to its due time, at it, half-way to the next and at that one
    halfway, second = (
        relay(celery_app, now=at + timedelta(seconds=0.5)),
        relay(celery_app, now=at + timedelta(seconds=1)),
    )
    row = OutboxMessage.objects.get()
    assert (halfway.handled, second.failed, row.attempts, row.available_at) == (0, 1, 2, at + timedelta(seconds=3))
    assert relay(celery_app, now=at + timedelta(seconds=2)).handled == 0
    done = relay(celery_app, now=at + timedelta(seconds=3))
    # Then its third refusal makes it a dead letter, unpublishable, recorded as the row's removal commits
    assert (done.published, done.failed, done.dead_lettered) == (0, 0, 1)
    assert not OutboxMessage.objects.exists()
    record = DeadLetter.objects.get(task_id=refused.id)
    assert (record.reason, record.attempts, record.tenant, record.args) == ("unpublishable", 3, "acme", [sink.key, 1])
    assert record.exc_type.endswith("NotFound") and missing in record.exc_message
    # And only the second ever ran
    assert [r["order_id"] for r in sink.items()] == [2]
    # When it is replayed (to the task's own route), Then it runs, with its tenant
    result = replay_dead_letters([record.pk], app=celery_app)
    [(_, new_id)] = result.replayed
    assert celery_app.AsyncResult(new_id).get(timeout=30)["tenant"] == "acme"
    assert sorted(r["order_id"] for r in sink.items()) == [1, 2]


@RABBITMQ
def test_a_row_whose_task_is_unknown_becomes_a_dead_letter_after_max_attempts_and_replays_once_it_is_known(
    broker: str, celery_app: Any, queue_name: str
) -> None:
    # Given an app that seals its dead letters and dead-letters an outbox row at its 4th failed publish
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "dead_letter_sinks": ["django"],
        "outbox_max_attempts": 4,
        "seal_keys": [Fernet.generate_key().decode()],
    }
    # and a committed row of a task no module of this process defines (a release that has not reached it yet),
    # carrying a secret and a per-call guardrail option
    name = f"tests.outbox.later{uuid.uuid4().hex[:8]}"
    task_id = uuid.uuid4().hex
    body = json.dumps([[7], {"api_token": "tok-s3cret"}])
    OutboxMessage.objects.create(
        task_name=name,
        task_id=task_id,
        body=body,
        options={"tenant_required": True},
        tenant="acme",
        correlation_id="req-1",
        available_at=timezone.now(),
    )
    # When the relay passes at each due time
    at = moment = timezone.now()
    seen = []
    for wait in [0.0, *backoffs(3)]:
        moment += timedelta(seconds=wait)
        done = relay(celery_app, now=moment)
        row = OutboxMessage.objects.filter(task_id=task_id).first()
        seen.append((done.failed, done.dead_lettered, row and row.attempts, row and row.available_at))
    # Then it was tried 4 times, 1, 2 and 4 s apart, and the 4th made it a dead letter (not retried for ever)
    assert seen == [
        (1, 0, 1, at + timedelta(seconds=1)),
        (1, 0, 2, at + timedelta(seconds=3)),
        (1, 0, 3, at + timedelta(seconds=7)),
        (0, 1, None, None),
    ]
    record = DeadLetter.objects.get(task_id=task_id)
    assert (record.reason, record.task_name, record.attempts, record.exc_type) == (
        "unpublishable",
        name,
        4,
        "builtins.LookupError",
    )
    assert "is registered in this process" in record.exc_message
    # with the secret redacted, the row's context in its header, and a sealed copy
    assert record.args == [7] and record.kwargs == {"api_token": "[redacted]"}
    assert (record.tenant, record.correlation_id) == ("acme", "req-1")
    assert record.header[headers.OPTIONS] == {"tenant_required": True}
    assert SealedMessage.objects.filter(dead_letter=record).exists()

    # When the release that defines the task arrives, and the record is replayed
    @celery_app.task(base=GuardedTask, name=name, shared=False)
    def later(n: int, api_token: str) -> None: ...

    result = replay_dead_letters([record.pk], app=celery_app)
    [(_, new_id)] = result.replayed
    # Then its message is on the task's queue with the original arguments (the token from the sealed copy) and
    # the row's tenant, correlation id and options
    with Connection(BROKER_URLS["amqp"]) as conn:
        message = conn.default_channel.basic_get(queue_name, no_ack=True)
    assert message is not None
    sent = message.properties["application_headers"]
    args, kwargs, _ = json.loads(message.body)
    assert (sent["id"], sent["task"], args, kwargs) == (new_id, name, [7], {"api_token": "tok-s3cret"})
    guardrails = sent[headers.HEADER]
    assert (guardrails[headers.TENANT], guardrails[headers.CORRELATION_ID]) == ("acme", "req-1")
    assert guardrails[headers.OPTIONS] == {"tenant_required": True}


@RABBITMQ
def test_the_relay_command_publishes_with_confirms_and_says_what_it_did(
    broker: str, celery_app: Any, queue_name: str
) -> None:
    # Given a committed row and a row sent to an exchange that does not exist, on RabbitMQ without confirm_publish
    with transaction.atomic():
        kept = tasks.versioned.apply_async(
            ("s", 1), outbox=True, exchange=f"gr-missing-{uuid.uuid4().hex[:12]}", routing_key="x"
        )
        sent = tasks.versioned.enqueue_in_transaction("s", 2)
    # When the command relays once
    out = StringIO()
    call_command("guardrails_outbox_relay", "--once", stdout=out)
    # Then it says what it did, the refused row stays, and the other is on the queue
    assert out.getvalue().strip() == (
        "Published 1 outbox message(s); 1 failed (kept, backed off); 0 dead-lettered (unpublishable)."
    )
    assert [row.task_id for row in OutboxMessage.objects.all()] == [kept.id]
    with Connection(BROKER_URLS["amqp"]) as conn:
        message = conn.default_channel.basic_get(queue_name, no_ack=True)
    assert message is not None and message.properties["application_headers"]["id"] == sent.id


def test_rabbitmq_without_publisher_confirms_is_an_audit_finding_and_a_deploy_check(celery_app: Any) -> None:
    # Given apps on RabbitMQ with and without confirm_publish, and one on Redis
    def off(broker: str, **options: Any) -> bool:
        app = Celery("confirms", broker=broker, set_as_current=False)
        app.conf.broker_transport_options = options
        return confirms_off(app)

    # Then only RabbitMQ without confirms has them off
    assert (off(BROKER_URLS["amqp"]), off(BROKER_URLS["amqp"], confirm_publish=True), off(REDIS_URL)) == (
        True,
        False,
        False,
    )
    # And the project's app on RabbitMQ without confirms is the audit's GA005, the deployment check W105
    celery_app.conf.broker_url = BROKER_URLS["amqp"]
    [warning] = [m for m in run_checks(include_deployment_checks=True) if m.id == "guardrails.W105"]
    assert warning.obj == "broker_transport_options" and "(GA005)" in warning.msg
    assert "confirm_publish" in (warning.hint or "")
    # Which confirm_publish silences
    celery_app.conf.broker_transport_options = {"confirm_publish": True}
    assert [m for m in run_checks(include_deployment_checks=True) if m.id == "guardrails.W105"] == []


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


def test_a_workers_relay_meeting_a_task_no_worker_has_leaves_the_workers_log_as_it_was(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given an outbox row of a task no process has (a web process of the next release wrote it)
    row = OutboxMessage.objects.create(
        task_name="tests.proj.tasks.of_the_next_release",
        task_id=str(uuid.uuid4()),
        body="[[], {}]",
        available_at=timezone.now(),
    )
    env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({"store": "django", "outbox_relay_interval": 0.2}),
    )
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env) as worker:
        # When the worker's relay has tried to publish it (and failed: the task is unknown)
        wait_for("the relay's try", lambda: OutboxMessage.objects.get(pk=row.pk).attempts >= 1)
        # Then the worker's log still gets its lines: a task run after it is logged as it ends (importing the
        # task modules again, in a worker, re-applied Django's LOGGING onto the stderr the worker had redirected)
        result = tasks.observe.apply_async(kwargs={"sink": sink.key})
        result.get(timeout=30)
        wait_for("the task's line in the worker's log", lambda: f"{result.id}] succeeded" in worker.log, timeout=15)
        # And the system checks did not run again in the worker
        assert "System check identified" not in worker.log
