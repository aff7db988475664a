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


@pytest.fixture
def gap_worker(celery_app: Any, queue_name: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    """A prefork worker (2 processes) on the Django store that gives a missing number up after 2 s."""
    settings = {"store": "django", "dead_letter_sinks": ["django"], "ordering_gap_timeout": 2.0}
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


def test_a_replayed_ordered_message_takes_a_new_number_after_its_successors(
    celery_worker: Any, celery_app: Any, sink: Sink
) -> None:
    from django.contrib.auth.models import User

    from django_celery_guardrails.models import DeadLetter
    from django_celery_guardrails.replay import replay_dead_letters

    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"]}
    stream = f"s-{uuid.uuid4().hex[:10]}"
    # Given message 1 of a key dead-lettered in its turn (its first run fails), and message 2 run after it
    first = tasks.ordered_append.apply_async((stream, 1, sink.key), {"fail": "first"})
    first.get(timeout=TIMEOUT, propagate=False)
    assert tasks.ordered_append.delay(stream, 2, sink.key).get(timeout=TIMEOUT) == 2
    record = DeadLetter.objects.get(task_id=first.id)
    assert (record.reason, record.header["ord_seq"]) == ("permanent", 1)
    # When it is replayed (the cause fixed)
    admin = User.objects.create_superuser(f"u{uuid.uuid4().hex[:8]}", password="pw")
    ((_, task_id),) = replay_dead_letters(DeadLetter.objects.filter(pk=record.pk), user=admin).replayed
    # Then it is not skipped as stale: it takes the next number, so it runs after the messages published before
    # the replay, one at a time with its key's others
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT) == 3
    assert [(item["n"], item["seq"]) for item in sink.items()] == [(2, 2), (1, 3)]


def test_a_gap_given_up_on_the_django_store_leaves_a_dead_letter_that_refuses_replay(
    gap_worker: WorkerProcess, celery_app: Any, sink: Sink
) -> None:
    from django.contrib.auth.models import User
    from django.test import Client
    from django.urls import reverse

    from celery_guardrails.operations import status as status_module
    from celery_guardrails.stores import get_store
    from django_celery_guardrails.models import DeadLetter, OrderingSequence
    from django_celery_guardrails.replay import NEVER_CAME_REFUSAL, replay_dead_letters

    stream = f"s-{uuid.uuid4().hex[:10]}"
    key = f"tests.proj.tasks.ordered_append:-:stream:{stream}"
    # Given number 1 of a key handed out and never published, and 2 published, waiting for it on the worker
    get_store(celery_app).order_next(key, now=0.0, retention=3600.0)
    second = tasks.ordered_append.delay(stream, 2, sink.key)
    row = OrderingSequence.objects.filter(key=key)
    wait_for("2 waiting", lambda: row.get().gap_since > 0)
    # Then the wait shows in the status, read from the database
    read = status_module.gather(celery_app)
    assert read.ordering is not None
    assert [(w.key, w.waiting_for, w.lowest) for w in read.ordering.oldest if w.key == key] == [(key, 1, 2)]
    # When ordering_gap_timeout (2 s on this worker) passes: 2 gives 1 up and runs
    assert second.get(timeout=TIMEOUT) == 2
    # Then the number that never came is a dead letter in the database: the task, the key, the number, when
    # the gap opened and when it was given up; nothing to replay, and a replay says why
    record = DeadLetter.objects.get(reason="ordering_gap_skipped", header__ord=f"stream:{stream}")
    assert (record.task_name, record.header, record.attempts, record.args, record.kwargs) == (
        "tests.proj.tasks.ordered_append",
        {"ord": f"stream:{stream}", "ord_seq": 1, "ord_seq_last": 1},
        0,
        [],
        {},
    )
    assert (record.last_failed_at - record.first_failed_at).total_seconds() >= 2.0
    wait_for("2's turn over", lambda: row.get().done == 2)
    assert row.values_list("skipped_from", "skipped_to", "skip_owed", "gap_since").get() == (1, 1, False, 0.0)
    admin = User.objects.create_superuser(f"u{uuid.uuid4().hex[:8]}", password=None)
    result = replay_dead_letters([record.pk], user=admin)
    assert (result.replayed, result.skipped) == ([], [(record.pk, NEVER_CAME_REFUSAL)])
    assert DeadLetter.objects.get(pk=record.pk).status == DeadLetter.Status.OPEN
    # And the admin shows it, saying it would refuse a replay
    client = Client()
    client.force_login(admin)
    page = client.get(reverse("admin:guardrails_deadletter_change", args=[record.pk]))
    assert page.status_code == 200
    assert "never came" in page.content.decode()
