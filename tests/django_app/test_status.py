"""Status and scrape-time gauges (celery_guardrails.operations.status, .collectors) read from the Django app's
tables."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest

from celery_guardrails.operations import status
from celery_guardrails.operations.collectors import StateCollector
from celery_guardrails.scheduling.ledger import MISSED, OK, OVERDUE
from celery_guardrails.stores import get_store
from django_celery_guardrails.models import DeadLetter

pytestmark = pytest.mark.django_db(transaction=True)


def letter(number: int, **fields: object) -> DeadLetter:
    moment = datetime(2026, 11, 30, 8, number, tzinfo=UTC)
    values = {
        "task_name": "shop.tasks.charge",
        "task_id": f"task-{number}",
        "reason": "permanent",
        "owner": "payments",
        "first_failed_at": moment,
        "last_failed_at": moment,
        **fields,
    }
    return DeadLetter.objects.create(**values)


@pytest.fixture
def django_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {
        "store": "django",
        "dead_letter_sinks": ["django"],
        "schedules": {"nightly": {}},
    }
    return celery_app


def test_open_dead_letters_are_counted_per_owner_and_task(django_app: Any) -> None:
    # Given two open records of payments' charge, one resolved, one open of ops' refund, one without an owner
    letter(1)
    letter(2)
    letter(3, status="resolved")
    letter(4, owner="ops", task_name="shop.tasks.refund")
    letter(5, owner="", task_name="shop.tasks.sync")

    # When the status is gathered and the collector scraped
    read = status.gather(django_app)
    scraped = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in StateCollector(django_app).collect()
        for sample in family.samples
    }

    # Then only open records count, by owner and by (owner, task)
    assert read.errors == {}
    assert read.dead_letters.by_owner() == {"": 1, "ops": 1, "payments": 2}
    key = ("celery_guardrails_dead_letters_open", (("owner", "payments"), ("task", "shop.tasks.charge")))
    assert scraped[key] == 2
    assert "(no owner)" in status.render(read)


def test_schedule_health_from_the_django_ledger(django_app: Any) -> None:
    # Given the ledger of "nightly": a success two days ago, a missed period and an overdue run after it
    store = get_store(django_app)
    now = time.time()
    ok, missed, overdue = now - 2 * 86400, now - 86400, now - 600
    store.run_dispatch("nightly", ok, task_id="t-ok", now=ok)
    store.run_start("nightly", ok, task_id="t-ok", now=ok)
    store.run_finish("nightly", ok, status=OK, now=ok + 5)
    store.run_record("nightly", missed, status=MISSED, now=missed + 120, reason="test: beat was down")
    store.run_dispatch("nightly", overdue, task_id="t-long", now=overdue)
    store.run_start("nightly", overdue, task_id="t-long", now=overdue)
    store.run_transition("nightly", overdue, from_=("running",), to=OVERDUE, now=now, reason="test: too long")

    # When the schedules are read
    (schedule,) = status.read_schedules(django_app)

    # Then one run was missed, one is overdue, the newest record is the overdue one, the success two days old
    assert (schedule.schedule, schedule.missed, schedule.overdue) == ("nightly", 1, 1)
    assert schedule.last_status == OVERDUE
    assert schedule.last_success == pytest.approx(ok, abs=1)
    assert schedule.last_success_age is not None and schedule.last_success_age >= 2 * 86400 - 1
