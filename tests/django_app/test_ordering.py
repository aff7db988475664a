"""Ordering per key on the Django store (PostgreSQL or SQLite, per GUARDRAILS_TEST_DB), on a real prefork
worker: the publisher and the worker hand out and check sequence numbers in the database's rows.

The Redis store and the faults: tests/celery_guardrails/guardrails/test_ordering.py; the store rules of both:
tests/celery_guardrails/stores/test_ordering_rules.py.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Sink
from tests.proj import tasks
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 60


@pytest.fixture
def worker(celery_app: Any, queue_name: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    """A prefork worker (2 processes) on the Django store; the test publishes on the same store."""
    settings = {"store": "django", "dead_letter_sinks": ["django"]}
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, **settings}
    env = proj_env(queue=queue_name, django=True, GUARDRAILS_TEST_GUARDRAILS=json.dumps(settings))
    with WorkerProcess(
        app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env, concurrency=2
    ) as process:
        yield process  # type: ignore[misc]


def test_shuffled_messages_of_a_key_run_in_order_on_the_django_store(worker: WorkerProcess, sink: Sink) -> None:
    from django_celery_guardrails.models import OrderingSequence

    # Given 20 messages of one key published in order, delivered shuffled (a seeded random countdown each)
    stream = f"s-{uuid.uuid4().hex[:10]}"
    jitter = random.Random(20)
    results = [
        tasks.ordered_append.apply_async((stream, n, sink.key), countdown=jitter.uniform(0, 1.0)) for n in range(20)
    ]
    # Then they ran in sequence order, each once, on its first attempt
    assert [result.get(timeout=TIMEOUT) for result in results] == list(range(1, 21))
    assert [(item["seq"], item["attempt"]) for item in sink.items()] == [(n, 1) for n in range(1, 21)]
    # And the key's row says all 20 handed out and done (the last moves the key on just after its result)
    rows = OrderingSequence.objects.filter(key=f"tests.proj.tasks.ordered_append:-:stream:{stream}")
    wait_for("the last turn over", lambda: rows.get().done == 20)
    assert rows.values_list("issued", "done", "gap_since", "waiting").get() == (20, 20, 0.0, 0)
