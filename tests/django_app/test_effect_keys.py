"""A keyed atomic task's key written in its effect's own transaction (PostgreSQL): one statement, no lease, and
every way a delivery ends leaves the key and the effect agreeing (celery_guardrails.guardrails.effect_keys)."""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection

from celery_guardrails.exceptions import DuplicateOfFailureError
from tests.conftest import Sink
from tests.proj import django_tasks
from tests.support.dead_letters import held_once_recorded
from tests.support.waiting import wait_for
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True)]
TIMEOUT = 30


@pytest.fixture(autouse=True)
def postgresql_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the key is written with the effect on PostgreSQL (elsewhere it is claimed apart)")


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "store": "django"}
    return celery_app


@pytest.fixture
def celery_includes() -> list[str]:
    return ["tests.proj.tasks", "tests.proj.django_tasks"]


def key_row(name: str, key: str) -> Any:
    from django_celery_guardrails.models import IdempotencyKey

    return IdempotencyKey.objects.filter(key=f"tests.proj.django_tasks.{name}:-:{key}").first()


def test_a_retried_run_leaves_no_claim_and_its_retry_writes_the_key_with_the_one_effect(
    celery_worker: Any, sink: Sink
) -> None:
    # Given a keyed atomic task whose first run writes its effect and then fails transiently
    key = uuid.uuid4().hex
    result = django_tasks.write_effect_scripted.delay(key, sink.key, ["transient", "ok"])
    # When its retry runs
    assert result.get(timeout=TIMEOUT) == "written"
    # Then the body ran twice, the first run's effect and key were rolled back together, and the key is
    # completed once with the one effect
    assert [item["run"] for item in sink.items()] == [1, 2]
    assert Effect.objects.filter(key=key).count() == 1
    row = key_row("write_effect_scripted", f"scripted-effect:{key}")
    assert (row.state, row.lease_until) == ("completed", None)


def test_a_final_failure_writes_the_key_failed_and_a_duplicate_fails_without_running(
    celery_worker: Any, sink: Sink
) -> None:
    # Given a keyed atomic task whose run writes its effect and then fails for good
    key = uuid.uuid4().hex
    with pytest.raises(Exception, match="refused for good"):
        django_tasks.write_effect_scripted.delay(key, sink.key, ["permanent"]).get(timeout=TIMEOUT)
    # Then its effect was rolled back, and its key written failed afterwards (as a claim made apart is marked;
    # in on_failure, which Celery calls after it stored the failed result)
    assert Effect.objects.filter(key=key).count() == 0
    row = wait_for("the key failed", lambda: key_row("write_effect_scripted", f"scripted-effect:{key}"))
    assert row.state == "failed" and "refused for good" in row.reason
    # When a duplicate is delivered, Then it fails as a duplicate of that failure without running the body
    with pytest.raises(DuplicateOfFailureError):
        django_tasks.write_effect_scripted.delay(key, sink.key, ["ok"]).get(timeout=TIMEOUT)
    assert [item["run"] for item in sink.items()] == [1]


@pytest.mark.parametrize("celery_worker_pool", ["threads"], indirect=True)
@pytest.mark.parametrize("celery_worker_parameters", [{"concurrency": 2}], indirect=True)
def test_a_duplicate_delivered_while_the_key_is_being_written_comes_back_later_without_waiting_on_it(
    celery_worker: Any, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a keyed atomic task holding at a gate, its key and effect written and not committed yet
    key, gate = uuid.uuid4().hex, f"{sink.key}:gate"
    first = django_tasks.write_effect.delay(key, sink.key, gate=gate)
    assert sink.client.blpop([f"{gate}:written"], timeout=TIMEOUT) is not None
    # When a duplicate is delivered to the other thread meanwhile
    caplog.set_level("INFO")
    duplicate = django_tasks.write_effect.delay(key, sink.key)
    # Then it does not wait on the uncommitted row: it is put off (the lock of the writing transaction is taken)
    wait_for("the duplicate put off", lambda: "held by another delivery (a transaction)" in caplog.text, timeout=10)
    # When the first commits, Then the duplicate, back later, is skipped as completed: one effect, one run
    sink.client.rpush(gate, "go")
    assert first.get(timeout=TIMEOUT) == "written"
    assert duplicate.get(timeout=TIMEOUT) == "written"
    assert [item["run"] for item in sink.items()] == [1]
    assert Effect.objects.filter(key=key).count() == 1


def test_the_store_writes_a_key_with_the_effect_busy_while_another_transaction_writes_it_and_none_once_it_exists() -> (
    None
):
    import threading

    from django_celery_guardrails.store import DjangoStore

    store, key = DjangoStore(), f"tests.with-effect:-:{uuid.uuid4().hex}"
    seen: list[Any] = []

    def another_delivery() -> None:
        try:
            with store.written_with_the_effect(key, owner="other", now=1.0) as claim:
                seen.append(claim)
        finally:
            connection.close()

    def other_thread() -> None:
        thread = threading.Thread(target=another_delivery)
        thread.start()
        thread.join(TIMEOUT)

    # Given a transaction that wrote a new key with its effect, not committed yet
    with store.written_with_the_effect(key, owner="first", now=1.0) as claim:
        assert claim is not None and claim.state == "acquired"
        # When another connection asks meanwhile, Then it is told the key is busy at once (no wait on the row)
        other_thread()
        assert seen[-1] is not None and seen[-1].state == "busy"
    # When the first commits, Then the key is there, completed, and another delivery is told it exists
    assert key_row_of(key).state == "completed"
    other_thread()
    assert seen[-1] is None
    # And a failure written with the effect writes a key that is not there, and never over one that is
    failed = f"tests.with-effect:-:{uuid.uuid4().hex}"
    assert store.fail_with_the_effect(failed, owner="o", now=2.0, reason="refused") is True
    assert (key_row_of(failed).state, key_row_of(failed).reason) == ("failed", "refused")
    assert store.fail_with_the_effect(key, owner="o", now=2.0, reason="refused") is False
    assert key_row_of(key).state == "completed"


def key_row_of(key: str) -> Any:
    from django_celery_guardrails.models import IdempotencyKey

    return IdempotencyKey.objects.get(key=key)


def test_a_replay_published_before_the_failed_run_wrote_its_key_reopens_it_and_writes_the_effect_once(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    from django_celery_guardrails.models import DeadLetter
    from django_celery_guardrails.replay import replay_dead_letters

    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"]}
    # Given a keyed atomic task whose run fails for good, its worker held once the dead letter is durable: its
    # effect and key were rolled back together, and the key is written failed only after the replay's publish
    key, first_id = uuid.uuid4().hex, str(uuid.uuid4())
    with held_once_recorded(first_id, timeout=TIMEOUT) as recorded:
        first = django_tasks.write_effect_scripted.apply_async((key, sink.key, ["permanent", "ok"]), task_id=first_id)
        assert recorded.wait(TIMEOUT)
        assert key_row("write_effect_scripted", f"scripted-effect:{key}") is None  # nothing yet to reopen
        # When it is replayed then, and the worker goes on to write the key failed
        ((_, task_id),) = replay_dead_letters([DeadLetter.objects.get(task_id=first_id).pk]).replayed
    with pytest.raises(Exception, match="refused for good"):
        first.get(timeout=TIMEOUT)
    # Then the replay reopens the key its original failed, runs, and writes the one effect with its key
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT) == "written"
    assert [item["run"] for item in sink.items()] == [1, 2]
    assert Effect.objects.filter(key=key).count() == 1
    assert key_row("write_effect_scripted", f"scripted-effect:{key}").state == "completed"


@contextmanager
def traced() -> Iterator[list[str]]:
    """The messages this connection sends to PostgreSQL while the block runs (libpq's trace of the protocol): the
    text of each simple-protocol Query, in order."""
    from psycopg import pq

    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    sent: list[str] = []
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield sent
        finally:
            pgconn.untrace()
            trace.seek(0)
            for line in trace.read().splitlines():
                direction, _, kind, *rest = line.split("\t")
                if direction == "F" and kind in ("Query", "Parse"):
                    sent.append(" ".join(rest).strip())


def test_the_key_is_sent_with_its_transactions_begin_in_one_message() -> None:
    from django_celery_guardrails.store import DjangoStore

    store, key = DjangoStore(), f"tests.with-effect:-:{uuid.uuid4().hex}"
    # Given a keyed atomic delivery's transaction on a connection with Django's default settings
    # When its key is written and its body writes the effect, and the transaction commits
    with traced() as sent, store.written_with_the_effect(key, owner="first", now=1.0) as claim:
        assert claim is not None and claim.state == "acquired"
        Effect.objects.create(key=key)
    # Then BEGIN and the key's statement went as one message, no BEGIN was sent apart, and both were committed
    assert sent[0].startswith('"BEGIN; INSERT INTO "guardrails_idempotencykey"'), sent
    assert not any(text.strip('"') == "BEGIN" for text in sent), sent
    assert sent[-1] == '"COMMIT"', sent
    assert key_row_of(key).state == "completed" and Effect.objects.filter(key=key).count() == 1


@pytest.mark.parametrize("watcher", ["execute_wrapper", "query_log"])
def test_a_watched_connection_sees_the_keys_statement_through_djangos_cursor(watcher: str) -> None:
    from django.test.utils import CaptureQueriesContext

    from django_celery_guardrails.store import DjangoStore

    store, key = DjangoStore(), f"tests.with-effect:-:{uuid.uuid4().hex}"
    seen: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    # Given a connection something watches: an execute wrapper (APM, tests), or Django's query log (DEBUG)
    watching = connection.execute_wrapper(record) if watcher == "execute_wrapper" else CaptureQueriesContext(connection)
    # When a key is written with its effect
    with watching as captured, store.written_with_the_effect(key, owner="first", now=1.0) as claim:
        assert claim is not None and claim.state == "acquired"
    # Then its statement went through Django's cursor, where the watcher saw it, and the key was committed
    if watcher == "query_log":
        seen = [query["sql"] for query in captured.captured_queries]
    assert any("guardrails_idempotencykey" in sql and "pg_try_advisory_xact_lock" in sql for sql in seen), seen
    assert key_row_of(key).state == "completed"


def test_a_connection_with_its_own_isolation_level_keeps_it_for_the_keys_transaction() -> None:
    from psycopg import IsolationLevel

    from django_celery_guardrails.store import DjangoStore

    store, key = DjangoStore(), f"tests.with-effect:-:{uuid.uuid4().hex}"
    # Given a connection set to SERIALIZABLE (Django's OPTIONS["isolation_level"] sets psycopg's, as here)
    connection.ensure_connection()
    connection.connection.isolation_level = IsolationLevel.SERIALIZABLE
    try:
        # When a key is written with its effect
        with traced() as sent, store.written_with_the_effect(key, owner="first", now=1.0), connection.cursor() as cur:
            cur.execute("SHOW transaction_isolation")
            (isolation,) = cur.fetchone()
    finally:
        connection.connection.isolation_level = None
    # Then its transaction began as psycopg begins it on that connection, and was serializable
    assert sent[0] == '"BEGIN ISOLATION LEVEL SERIALIZABLE"', sent
    assert isolation == "serializable" and key_row_of(key).state == "completed"


def test_a_key_refused_with_its_begin_is_the_stores_error_and_leaves_the_connection_usable() -> None:
    from celery_guardrails.exceptions import StoreError, StoreUnavailableError
    from django_celery_guardrails.store import DjangoStore

    store = DjangoStore()
    # Given a key longer than its column holds (a store given data it cannot keep)
    key = f"tests.with-effect:-:{'x' * 300}"
    # When it is written with its effect
    with pytest.raises(StoreError) as raised, store.written_with_the_effect(key, owner="first", now=1.0):
        pytest.fail("the body ran without its key")  # pragma: no cover
    # Then the store refused the data (not an outage), the transaction was rolled back, and the connection is usable
    assert not isinstance(raised.value, StoreUnavailableError)
    assert "value too long" in str(raised.value.__cause__)
    assert not connection.in_atomic_block
    assert Effect.objects.filter(key=key).count() == 0


@pytest.mark.parametrize("path", ["with_its_begin", "through_djangos_cursor"])
def test_a_value_the_database_cannot_hold_is_the_stores_refusal_on_either_path(path: str) -> None:
    from celery_guardrails.exceptions import StoreError, StoreUnavailableError
    from django_celery_guardrails.store import DjangoStore

    store, key = DjangoStore(), f"tests.with-effect:-:{uuid.uuid4().hex}"

    def passing(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        return execute(sql, params, many, context)

    # Given an owner with a NUL in it (a malformed task id: PostgreSQL's text cannot hold it), on the path that
    # sends the key with its BEGIN, or through Django's cursor (an execute wrapper watching)
    watching = connection.execute_wrapper(passing) if path == "through_djangos_cursor" else contextlib.nullcontext()
    # When the key is written with its effect
    with watching, pytest.raises(StoreError) as raised, store.written_with_the_effect(key, owner="a\x00b", now=1.0):
        pytest.fail("the body ran without its key")  # pragma: no cover
    # Then either way the store refused the data (a final failure with its reason, not an outage to wait out), and
    # the connection is usable
    assert not isinstance(raised.value, StoreUnavailableError)
    assert "NUL" in str(raised.value.__cause__)
    assert not connection.in_atomic_block and Effect.objects.filter(key=key).count() == 0
