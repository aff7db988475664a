"""The Django store on real workers: the completion mark commits with the effect (atomic=True)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_guardrails import signals
from tests.conftest import Sink
from tests.proj import django_tasks
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env
from tests.testapp.models import Effect

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
    assert (row.state, row.summary, row.lease_until) == ("completed", "'written'", None)


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
        GUARDRAILS_TEST_TRANSPORT_OPTIONS=json.dumps(
            {"visibility_timeout": 3, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
        ),
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
    assert "took over key" in second.log
