"""The Django store on PostgreSQL cut away from a real prefork worker (through a TCP proxy): at the claim,
and at the completion that commits with the effect (``atomic=True``). After the database comes back, each
message has one committed effect; none was acked away, and the outage spent no attempt.

(The Redis store is cut the same way in tests/celery_guardrails/runtime/test_store_outage.py.)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.db import connection

from tests.conftest import Sink
from tests.proj import django_tasks
from tests.support.proxy import TcpProxy
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 60
SEAL_KEY = Fernet.generate_key().decode()


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    if connection.vendor != "postgresql":
        pytest.skip("needs a database server to take away (runs in the PostgreSQL pass)")
    proxy = TcpProxy(5432)
    yield proxy
    proxy.close()


@pytest.fixture
def reuse_max(request: pytest.FixtureRequest) -> str:
    """CELERY_DB_REUSE_MAX for the worker ("": unset, Celery closes the connections around every task)."""
    return str(getattr(request, "param", ""))


@pytest.fixture
def worker(
    celery_app: Any, proxy: TcpProxy, queue_name: str, tmp_path: Path, reuse_max: str
) -> Iterator[WorkerProcess]:
    """A prefork worker on the Django store, its database connection through ``proxy``."""
    env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_DB_PORT=str(proxy.port),
        GUARDRAILS_TEST_GUARDRAILS=json.dumps(
            {"store": "django", "dead_letter_sinks": ["django"], "seal_keys": [SEAL_KEY]}
        ),
        GUARDRAILS_TEST_DB_REUSE_MAX=reuse_max,
    )
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env) as process:
        yield process  # type: ignore[misc]


def writing_at_a_gate(sink: Sink) -> tuple[str, Any, str]:
    """A keyed atomic task that wrote its effect (uncommitted) and waits at a gate: (key, result, gate)."""
    key, gate = uuid.uuid4().hex, f"{sink.key}:gate"
    result = django_tasks.write_effect.delay(key, sink.key, gate=gate)
    # (Not sink.wait(1): the body is seen before its INSERT, and a cut in between failed the INSERT instead)
    assert sink.client.blpop([f"{gate}:written"], timeout=TIMEOUT) is not None, "the effect was never written"
    return key, result, gate


def committed_once(result: Any, key: str) -> None:
    """The task succeeded, its effect committed once, its key completed."""
    from django_celery_guardrails.models import IdempotencyKey

    assert result.get(timeout=TIMEOUT) == "written"
    assert Effect.objects.filter(key=key).count() == 1
    row = IdempotencyKey.objects.get(key=f"tests.proj.django_tasks.write_effect:-:effect:{key}")
    assert row.state == "completed"


def test_database_cut_at_the_claim_the_message_comes_back_and_runs_once(
    worker: WorkerProcess, proxy: TcpProxy, sink: Sink
) -> None:
    from django_celery_guardrails.models import DeadLetter

    key = uuid.uuid4().hex
    # Given the database out of reach when a keyed task is delivered
    proxy.cut()
    result = django_tasks.write_effect.delay(key, sink.key)
    # Then it does not run, fail or dead-letter: it is published again for later
    wait_for("the outage logged", lambda: "the guardrails store is unavailable" in worker.log)
    assert sink.items() == []
    # When the database is back, Then it runs once and its effect is committed once
    proxy.restore()
    assert result.get(timeout=TIMEOUT) == "written"
    assert [r["run"] for r in sink.items()] == [1]
    assert Effect.objects.filter(key=key).count() == 1
    assert not DeadLetter.objects.filter(task_id=result.id).exists()


@pytest.mark.parametrize("reuse_max", ["1000"], indirect=True)
def test_a_connection_kept_across_tasks_that_the_database_dropped_is_replaced_before_the_next_task(
    worker: WorkerProcess, proxy: TcpProxy, sink: Sink
) -> None:
    # Given a worker that keeps its database connection across tasks (CELERY_DB_REUSE_MAX, as guardrails.W006
    # advises), which has run a keyed task on it
    first = uuid.uuid4().hex
    committed_once(django_tasks.write_effect.delay(first, sink.key), first)
    # When the database drops every connection (a restart) and answers again at once
    proxy.cut()
    proxy.restore()
    # Then the next keyed task runs once on a new connection: its first delivery meets the dropped one at the
    # claim, before its body, and comes back (no attempt spent) once it is closed (Celery would keep it for
    # 2 x 1000 tasks, each failing on it)
    key = uuid.uuid4().hex
    committed_once(django_tasks.write_effect.delay(key, sink.key), key)
    assert [r["run"] for r in sink.items()] == [1, 2]  # (the sink's count of bodies run: one per task)


@pytest.mark.parametrize("reuse_max", ["1000"], indirect=True)
def test_a_body_that_met_a_dropped_connection_leaves_the_next_task_a_new_one(
    worker: WorkerProcess, proxy: TcpProxy
) -> None:
    key = uuid.uuid4().hex
    # Given a worker that keeps its database connection across tasks, whose plain task has read through it
    assert django_tasks.count_effects.delay(key).get(timeout=TIMEOUT) == 0
    # When the database drops every connection and answers again, and a body meets the dropped one first
    proxy.cut()
    proxy.restore()
    with pytest.raises(Exception, match=r"(?i)connection|server closed|terminat"):  # the body's OperationalError
        django_tasks.count_effects.delay(key).get(timeout=TIMEOUT)
    # Then the next task's body reads on a new connection (the broken one was closed before it began)
    assert django_tasks.count_effects.delay(key).get(timeout=TIMEOUT) == 0


def test_database_cut_at_the_completion_rolls_the_effect_back_and_the_message_commits_it_once_later(
    worker: WorkerProcess, proxy: TcpProxy, sink: Sink
) -> None:
    # Given a keyed atomic task that wrote its effect (uncommitted) and waits at a gate
    key, result, gate = writing_at_a_gate(sink)
    # When the database goes away before the transaction commits the effect with the completion mark
    proxy.cut()
    sink.client.rpush(gate, "go")
    wait_for("the outage logged", lambda: "the guardrails store is unavailable" in worker.log)
    proxy.restore()
    # Then the first effect was rolled back with its completion, and the message, back later, committed both
    committed_once(result, key)
    assert [r["run"] for r in sink.items()] == [1, 2]


@pytest.mark.timeout(240)  # the heartbeat's failure can take a minute and more on a busy host
def test_database_cut_while_an_atomic_body_runs_commits_its_effect_once_later(
    worker: WorkerProcess, proxy: TcpProxy, sink: Sink
) -> None:
    # Given a keyed atomic task running (its key and effect written, uncommitted: PostgreSQL writes the key in
    # the effect's transaction, with no lease to renew), whose database goes away: its transaction is lost
    key, result, gate = writing_at_a_gate(sink)
    proxy.cut()
    # When the database is back and the body returns
    proxy.restore()
    sink.client.rpush(gate, "go")
    # Then its commit fails as the store's outage (not the body's error), and the message, back later, committed
    # the effect once
    wait_for("the commit failed", lambda: "could not commit an effect with its key" in worker.log)
    committed_once(result, key)
    assert [r["run"] for r in sink.items()] == [1, 2]


def test_database_cut_while_a_sealed_dead_letter_is_recorded_it_is_recorded_once_with_its_seal_later(
    worker: WorkerProcess, proxy: TcpProxy, sink: Sink
) -> None:
    from django_celery_guardrails.models import DeadLetter, SealedMessage
    from tests.proj import tasks

    # Given a task with a secret, refused by its provider, holding at a gate before it fails
    secret, gate = f"tok-{uuid.uuid4().hex}", f"{sink.key}:gate"
    result = tasks.sync_account.apply_async((sink.key, sink.key), {"api_token": secret, "gate": gate}, tenant="t1")
    sink.wait(1)
    # When the database goes away just before its dead letter (and sealed copy) is written
    proxy.cut()
    sink.client.rpush(gate, "go")
    wait_for("the record deferred", lambda: "dead letter not recorded" in worker.log)
    proxy.restore()
    # Then, once it is back, one record and one sealed copy are written; the body ran once
    record = wait_for("the record", lambda: DeadLetter.objects.filter(task_id=result.id).first())
    assert record.kwargs["api_token"] == "[redacted]" and len(sink.items()) == 1
    sealed = SealedMessage.objects.get(dead_letter=record)
    assert secret not in sealed.token and secret not in repr(list(DeadLetter.objects.values()))
    # And the sealed copy holds the real token for a replay
    from celery_guardrails.foundation.sealing import Sealer

    assert Sealer(keys=[SEAL_KEY]).open(sealed.token, record=record)["kwargs"]["api_token"] == secret
