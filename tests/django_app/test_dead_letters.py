"""Dead letters on a real worker, recorded in the Django database (PostgreSQL or SQLite)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from celery_guardrails import signals, tenant_context
from django_celery_guardrails.models import DeadLetter
from tests.conftest import Sink, unacked, waiting_messages
from tests.proj import django_tasks, tasks
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 30


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "dead_letter_sinks": ["django"],
        "owners": {"tests.proj.tasks.*": "platform"},
    }
    return celery_app


def run_to_failure(result: Any) -> None:
    with pytest.raises(Exception):  # noqa: B017 (each case fails with its own exception)
        result.get(timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("publish", "reason", "owner", "attempts"),
    [
        (
            lambda: django_tasks.fail_with.delay("permanent", card_number="4111 1111 1111 1111", api_token="s3cr3t"),
            "permanent",
            "payments",
            1,
        ),
        (
            lambda: django_tasks.fail_with.apply_async(("transient",), max_attempts=3),
            "attempts_exhausted",
            "payments",
            3,
        ),
        (
            lambda: django_tasks.fail_with.apply_async(("later",), retry_later_max=2),
            "retry_later_exhausted",
            "payments",
            1,
        ),
        (lambda: django_tasks.not_idempotent.delay(), "not_idempotent", "", 1),
        (
            lambda: tasks.behave.apply_async(
                (f"dl-{uuid.uuid4().hex}", ["transient"]), dependency=f"d-{uuid.uuid4().hex[:6]}", max_attempts=5
            ),
            "retry_budget_exhausted",
            "platform",
            2,
        ),
    ],
)
def test_each_reason_makes_exactly_one_record(
    celery_worker: Any, celery_app: Any, publish: Any, reason: str, owner: str, attempts: int
) -> None:
    if reason == "retry_budget_exhausted":
        celery_app.conf.guardrails = {
            **celery_app.conf.guardrails,
            "retry_budget_floor": 0,
            "retry_budget_ratio": 0,
            "retry_budget_policy": "fail",
        }
    recorded = []
    signals.dead_lettered.connect(
        lambda sender, failure, **_: recorded.append(failure), weak=False, dispatch_uid="test-dead-lettered"
    )
    try:
        with tenant_context("acme"):
            result = publish()
        run_to_failure(result)
    finally:
        signals.dead_lettered.disconnect(dispatch_uid="test-dead-lettered")
    (record,) = DeadLetter.objects.filter(task_id=result.id)
    assert (record.reason, record.owner, record.status, record.tenant) == (reason, owner, "open", "acme")
    assert record.attempts == attempts and len(record.correlation_id) == 32
    assert record.exc_type and record.exc_message and record.exc_message in record.traceback
    assert record.history and record.history[-1]["class"] in (
        "permanent",
        "transient",
        "retry_later",
        "deferred_budget",
    )
    assert record.first_failed_at <= record.last_failed_at
    assert [f.task_id for f in recorded] == [result.id]


def test_a_secret_never_reaches_the_database(celery_worker: Any) -> None:
    with tenant_context("acme"):
        result = django_tasks.fail_with.delay(
            "permanent",
            card_number="4111111111111111",
            customer={"name": "Ada", "password": "hunter2"},
            api_token="s3cr3t",
        )
    run_to_failure(result)
    with connection.cursor() as cursor:
        cursor.execute("SELECT args, kwargs, header FROM guardrails_deadletter WHERE task_id = %s", [result.id])
        raw = " ".join(str(column) for column in cursor.fetchone())
    for secret in ("4111111111111111", "hunter2", "s3cr3t"):
        assert secret not in raw
    record = DeadLetter.objects.get(task_id=result.id)
    assert record.kwargs == {
        "card_number": "[redacted]",
        "customer": {"name": "Ada", "password": "[redacted]"},
        "api_token": "[redacted]",
    }


def test_a_nul_character_is_recorded_escaped_once_not_retried_for_ever(celery_worker: Any) -> None:
    # Given a final failure whose arguments and message hold a NUL character (PostgreSQL refuses it in text)
    result = django_tasks.fail_with.delay("permanent", note="before\x00after", nested={"list": ["x\x00"]})
    # When its dead letter is written
    run_to_failure(result)
    # Then it is recorded, once, with the NUL written out
    (record,) = DeadLetter.objects.filter(task_id=result.id)
    assert record.kwargs == {"note": "before\\x00after", "nested": {"list": ["x\\x00"]}}
    assert (record.reason, record.status) == ("permanent", "open")


def test_a_huge_argument_is_not_kept_whole(celery_worker: Any) -> None:
    # Given a final failure whose arguments are 200 KB
    result = django_tasks.fail_with.delay("permanent", blob="x" * 200_000)
    run_to_failure(result)
    # Then the record keeps a cut repr of them, flagged (not replayable), not 200 KB of them
    record = DeadLetter.objects.get(task_id=result.id)
    assert record.arguments_are_repr is True
    assert len(json.dumps([record.args, record.kwargs])) < 10_000
    assert record.kwargs["bytes"] > 200_000


def test_what_the_database_refuses_in_text_is_written_out_or_cut() -> None:
    from celery_guardrails.runtime.dead_letters import storable
    from django_celery_guardrails.sinks import DjangoSink

    # Given a record with a NUL, a lone surrogate (not UTF-8) and a routing key longer than its column
    task_id = uuid.uuid4().hex
    fields = storable(
        {
            "task_name": "tests.odd",
            "task_id": task_id,
            "queue": "q" * 300,
            "routing_key": "q" * 300,
            "args": ["a\x00b", "c\udcffd"],
            "kwargs": {},
            "arguments_are_repr": False,
            "tenant": "",
            "correlation_id": "",
            "idempotency_key": "",
            "header": {},
            "reason": "permanent",
            "exc_type": "builtins.ValueError",
            "exc_message": "bad \x00 byte",
            "traceback": "",
            "history": [],
            "attempts": 1,
            "first_failed_at": "2026-11-30T08:00:00.000+00:00",
            "last_failed_at": "2026-11-30T08:00:01.000+00:00",
            "owner": "",
        }
    )
    # When the Django sink records it, twice
    assert (DjangoSink().record(fields), DjangoSink().record(fields)) == (True, False)
    # Then it is one record, the text written out, the long value cut to its column
    record = DeadLetter.objects.get(task_id=task_id)
    assert record.args == ["a\\x00b", "c\\udcffd"] and record.exc_message == "bad \\x00 byte"
    assert (len(record.queue), len(record.routing_key)) == (200, 200)


def test_a_secret_in_an_error_message_never_reaches_the_database(celery_worker: Any) -> None:
    # Given a task that fails (twice: a transient error, then its last attempt) with an error that echoes a
    # password, a bearer token and a card number back
    result = django_tasks.fail_with.apply_async(("leak", "4111 1111 1111 1111"), max_attempts=2)
    run_to_failure(result)
    # Then neither the message, the traceback nor the attempt history stored holds them
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT exc_message, traceback, history FROM guardrails_deadletter WHERE task_id = %s", [result.id]
        )
        raw = " ".join(str(column) for column in cursor.fetchone())
    for secret in ("hunter2", "s3cr3t-t0ken", "4111 1111 1111 1111"):
        assert secret not in raw
    record = DeadLetter.objects.get(task_id=result.id)
    assert record.exc_message == (
        "login refused: password=[redacted] Authorization: [redacted] [redacted], card [redacted] declined"
    )
    assert len(record.history) == 2 and all("[redacted]" in r["msg"] for r in record.history)


def test_missing_tenant_is_dead_lettered(celery_worker: Any, celery_app: Any) -> None:
    result = celery_app.send_task("tests.proj.django_tasks.needs_tenant")
    run_to_failure(result)
    record = DeadLetter.objects.get(task_id=result.id)
    assert (record.reason, record.owner, record.tenant) == ("missing_tenant", "accounts", "")


@pytest.mark.smoke
def test_poison_message_is_dead_lettered_and_the_queue_goes_on(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a message that SIGKILLs its worker process, queued before three ordinary ones
    env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({"dead_letter_sinks": ["django"], "max_deliveries": 2}),
    )
    poison = django_tasks.kill_my_worker.delay(f"{sink.key}:pids")
    behind = [tasks.observe.delay() for _ in range(3)]
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env):
        # Then the ordinary ones are processed...
        for result in behind:
            result.get(timeout=60)
        wait_for("the dead letter", lambda: DeadLetter.objects.filter(task_id=poison.id).exists())
        # the poison delivery ends FAILED and is acked after its result is stored: let that happen before the
        # worker is stopped (a warm shutdown gives unacked messages back to the queue)
        wait_for("the poison message acked", lambda: poison.state == "FAILURE" and not unacked(poison.id))
    # ...the poison one ran 3 times (first delivery and 2 redeliveries), then was dead-lettered unrun
    assert sink.client.llen(f"{sink.key}:pids") == 3
    record = DeadLetter.objects.get(task_id=poison.id)
    assert (record.reason, record.owner) == ("poison", "ops")
    assert "redelivered 3 times without finishing" in record.exc_message
    assert waiting_messages("redis", queue_name) == 0


def test_database_down_at_the_final_failure_loses_nothing(celery_app: Any, queue_name: str, tmp_path: Path) -> None:
    # Given a worker whose database connection goes through a proxy the test controls (PostgreSQL only: an
    # SQLite file cannot be taken away)
    if connection.vendor != "postgresql":
        pytest.skip("needs a database server to take away (runs in the PostgreSQL pass)")
    from tests.support.proxy import TcpProxy

    proxy = TcpProxy(5432)
    env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_DB_PORT=str(proxy.port),
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({"dead_letter_sinks": ["django"]}),
    )
    try:
        with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env) as worker:
            # When the database is down while a task fails finally
            proxy.cut()
            result = django_tasks.fail_with.delay("permanent")
            wait_for("the failed write logged", lambda: "dead letter not recorded" in worker.log)
            assert not DeadLetter.objects.filter(task_id=result.id).exists()
            # Then, once it is back, the message comes back and is recorded, once
            proxy.restore()
            wait_for("the dead letter", lambda: DeadLetter.objects.filter(task_id=result.id).exists())
            wait_for("the message acked", lambda: result.state == "FAILURE" and not unacked(result.id))
    finally:
        proxy.close()
    record = DeadLetter.objects.get(task_id=result.id)
    assert (record.reason, record.exc_message) == ("permanent", "card refused")
    assert worker.log.count("Traceback") >= 1 and waiting_messages("redis", queue_name) == 0


def test_a_key_that_cannot_be_made_on_the_worker_is_dead_lettered(celery_worker: Any, celery_app: Any) -> None:
    # Given a message sent by name without the argument the key template needs (published without the
    # extension, so nothing checked it at publish)
    result = celery_app.send_task("tests.proj.tasks.charge", kwargs={"sink": "s"})
    with pytest.raises(Exception, match="arguments do not fit the task"):
        result.get(timeout=TIMEOUT)
    record = DeadLetter.objects.get(task_id=result.id)
    assert (record.reason, record.owner, record.exc_type) == (
        "bad_idempotency_key",
        "platform",
        "celery_guardrails.exceptions.IdempotencyKeyError",
    )


def test_a_record_with_missing_times_or_a_value_json_refuses_is_still_recorded() -> None:
    from django_celery_guardrails.sinks import DjangoSink

    # Given what a pending dead letter may carry back in a header: the required fields only, no times, and a
    # header value the JSON column cannot take
    fields: dict[str, Any] = {
        "task_name": "tests.proj.tasks.charge",
        "task_id": f"pending-{uuid.uuid4().hex}",
        "reason": "permanent",
        "exc_type": "PermanentError",
        "exc_message": "card refused",
        "first_failed_at": "",
        "header": {"raw": b"\x00bytes"},
    }
    # When it is recorded, Then it is, cut of the message's contents, at the time it was written
    assert DjangoSink().record(fields) is True
    record = DeadLetter.objects.get(task_id=fields["task_id"])
    assert (record.reason, record.header) == ("permanent", {})
    assert record.exc_message.startswith("[record cut: the store refused it:")
    assert record.first_failed_at is not None and record.last_failed_at is not None
