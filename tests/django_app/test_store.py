"""The Django store on real workers: the completion mark commits with the effect (atomic=True), in few statements."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from celery_guardrails import signals
from tests.conftest import Sink
from tests.proj import django_tasks
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env, quick_redelivery
from tests.testapp.models import Effect

T0 = 1_800_000_000.0

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "store": "django"}
    return celery_app


def test_one_row_for_a_message_delivered_twice(celery_worker: Any, sink: Sink, received: Any) -> None:
    from django_celery_guardrails.models import IdempotencyKey

    skipped = received(signals.duplicate_skipped)
    key = uuid.uuid4().hex
    assert django_tasks.write_effect.delay(key, sink.key).get(timeout=30) == "written"
    assert django_tasks.write_effect.delay(key, sink.key).get(timeout=30) == "written"
    assert Effect.objects.filter(key=key).count() == 1
    assert [s["state"] for s in skipped] == ["completed"]
    row = IdempotencyKey.objects.get(key=f"tests.proj.django_tasks.write_effect:-:effect:{key}")
    # (On PostgreSQL the key is written with the effect, before the body returns: it keeps no summary)
    summary = "" if connection.vendor == "postgresql" else "'written'"
    assert (row.state, row.summary, row.lease_until) == ("completed", summary, None)


def test_sigkill_mid_transaction_leaves_exactly_one_row(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a worker (Django store, 2 s lease, 3 s visibility timeout) killed after inserting the row,
    # inside the transaction that also holds the completion mark
    key = uuid.uuid4().hex
    env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({"idempotency_lease": 2.0, "store": "django"}),
        GUARDRAILS_TEST_TRANSPORT_OPTIONS=json.dumps(quick_redelivery()),
    )
    result = django_tasks.write_effect.delay(key, sink.key, hold=60)
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "first.log", env=env) as first:
        sink.wait(1)
        first.kill()
        first.wait(15)
    # When the message comes back to another worker after its visibility timeout
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "second.log", env=env) as second:
        assert result.get(timeout=30) == "written"
    # Then the body ran twice, but its first transaction died with the worker: exactly one row
    assert [r["run"] for r in sink.items()] == [1, 2]
    assert Effect.objects.filter(key=key).count() == 1
    # And the second took the key over from the dead claim, or (PostgreSQL: the key was written in the
    # transaction that died) found none to take over
    assert ("took over key" in second.log) is (connection.vendor != "postgresql")


def statements(queries: CaptureQueriesContext) -> list[str]:
    """The first word of each statement sent (BEGIN and COMMIT included)."""
    return [query["sql"].split()[0].upper() for query in queries.captured_queries]


def test_a_keyed_atomic_delivery_adds_one_statement_on_postgresql_and_two_elsewhere(
    celery_app: Any, sink: Sink
) -> None:
    from django_celery_guardrails.models import IdempotencyKey

    # Given a keyed task with atomic=True on the Django store, run on this connection so its statements count
    key = uuid.uuid4().hex
    # When a message with a new key runs
    with CaptureQueriesContext(connection) as queries:
        assert django_tasks.write_effect.apply(args=(key, sink.key)).get() == "written"
    # Then on PostgreSQL the key is written completed as the first statement of the effect's transaction:
    # BEGIN, the key, the effect, COMMIT (plain Celery sends the three of them alone); elsewhere the claim is one
    # statement outside any transaction and the completion rides in the effect's transaction
    if connection.vendor == "postgresql":
        assert statements(queries) == ["BEGIN", "INSERT", "INSERT", "COMMIT"]
    else:
        assert statements(queries) == ["INSERT", "BEGIN", "INSERT", "UPDATE", "COMMIT"]
    assert Effect.objects.filter(key=key).count() == 1
    assert IdempotencyKey.objects.get(key=f"tests.proj.django_tasks.write_effect:-:effect:{key}").state == "completed"


def synchronous_commit() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return str(cursor.fetchone()[0])


def test_an_atomic_claim_does_not_wait_for_the_disk_and_changes_no_other_commit() -> None:
    from django_celery_guardrails.store import DjangoStore

    if connection.vendor != "postgresql":
        pytest.skip("synchronous_commit is PostgreSQL's")
    store, keys = DjangoStore(), [f"tests.relaxed:-:{uuid.uuid4().hex}" for _ in range(3)]
    # Given the server's setting: every commit waits for the disk
    assert synchronous_commit() == "on"
    # When an atomic task's key is claimed outside a transaction
    with CaptureQueriesContext(connection) as atomic:
        assert store.claim(keys[0], owner="o", now=T0, lease=30, retention=60, atomic=True).state == "acquired"
    # Then that claim's own commit does not wait (its completion's commit flushes it), and nothing after it
    assert "set_config('synchronous_commit', 'off', true)" in atomic.captured_queries[0]["sql"]
    assert synchronous_commit() == "on"
    # When one is claimed inside the caller's transaction, or without atomic
    with transaction.atomic(), CaptureQueriesContext(connection) as nested:
        assert store.claim(keys[1], owner="o", now=T0, lease=30, retention=60, atomic=True).state == "acquired"
        assert synchronous_commit() == "on"
    with CaptureQueriesContext(connection) as plain:
        assert store.claim(keys[2], owner="o", now=T0, lease=30, retention=60).state == "acquired"
    # Then it waits for the disk: the caller's transaction keeps its setting; a claim whose effect may be
    # outside the database must be durable on its own
    assert not [q for q in nested.captured_queries + plain.captured_queries if "set_config" in q["sql"]]
