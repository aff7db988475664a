"""Records that are not there yet, on a real worker and the test database (PostgreSQL or SQLite): a task
published with a plain ``delay`` inside ``transaction.atomic`` whose row is committed 2 s later waits for it
(``self.require()``, or a plain ``get`` with ``absent_records="wait"``) and applies its effect once; a row that
never comes is a dead letter ``record_missing`` naming the model and the lookup, recorded in the database.

The waits' arithmetic, the header, classification and ``error_patterns``:
tests/celery_guardrails/guardrails/test_records.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.core.exceptions import MultipleObjectsReturned
from django.db import transaction

from celery_guardrails import RecordNotThereYet, require
from celery_guardrails.guardrails import records
from django_celery_guardrails.models import DeadLetter
from tests.conftest import Sink
from tests.proj import django_tasks
from tests.testapp.models import Effect, Order

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 30
#: How long after its publish the row is committed.
COMMIT_AFTER = 2.0


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"]}
    return celery_app


def committed_later(task: Any, sink: Sink, **options: Any) -> tuple[Order, Any]:
    """Create an order and publish ``task`` for it with a plain ``apply_async`` in the same transaction, wait until
    the task has run once (and found no row), then commit COMMIT_AFTER seconds after the publish."""
    with transaction.atomic():
        order = Order.objects.create(status="paid")
        result = task.apply_async((order.pk, sink.key), **options)
        published = time.monotonic()
        sink.wait(1)  # its first run looked before the commit
        time.sleep(max(0.0, COMMIT_AFTER - (time.monotonic() - published)))
    return order, result


def test_require_returns_the_row_of_a_queryset_a_manager_or_a_model() -> None:
    # Given an order, Then require() finds it however the rows are named
    order = Order.objects.create(status="paid")
    assert require(Order, pk=order.pk) == order
    assert require(Order.objects, pk=order.pk) == order
    assert require(Order.objects.filter(status="paid"), pk=order.pk) == order
    # And a missing row raises RecordNotThereYet naming the model and the lookup
    with pytest.raises(RecordNotThereYet, match=r"^testapp\.Order matching pk=0, status='paid' does not exist"):
        require(Order.objects, pk=0, status="paid")
    # And more than one row is not a missing record: Django's own error, as it is
    Order.objects.create(status="paid")
    with pytest.raises(MultipleObjectsReturned):
        require(Order, status="paid")


def test_a_record_committed_2_s_after_the_publish_is_waited_for_and_applied_once(
    celery_worker: Any, sink: Sink
) -> None:
    # Given a task that require()s an order, published with a plain delay inside the transaction that creates the
    # order, which commits 2 s after the publish
    order, result = committed_later(django_tasks.ship_order, sink)
    # When the row is there, Then the task succeeds, and its effect landed once
    final = result.get(timeout=TIMEOUT)
    assert Effect.objects.filter(key=f"shipped:{order.pk}").count() == 1
    # And every look before the commit was a wait in the history, spending no attempt: 1 s, then 2 s, ...
    history = final["history"]
    assert [r["delay"] for r in history] == records.delays(60.0)[: len(history)] and history
    assert {(r["n"], r["class"], r["rule"], r["msg"]) for r in history} == {
        (1, "retry_later", "records:require", f"testapp.Order matching pk={order.pk} does not exist (yet)")
    }
    # And the body ran once per look, the last one finding the row
    assert [r["attempt"] for r in sink.items()] == [1] * (len(history) + 1) and final["runs"] == len(history) + 1
    assert not DeadLetter.objects.filter(task_id=result.id).exists()


def test_a_record_that_never_comes_is_a_dead_letter_record_missing_in_the_database(
    celery_worker: Any, sink: Sink
) -> None:
    # Given an order that was deleted (its id will never be found), and a task that require()s it, record_wait 2.5 s
    order = Order.objects.create(status="paid")
    missing = order.pk
    order.delete()
    result = django_tasks.ship_order.apply_async((missing, sink.key), record_wait=2.5)
    # When the wait is spent, Then the task fails with require()'s error
    with pytest.raises(RecordNotThereYet):
        result.get(timeout=TIMEOUT)
    # And one dead letter records_missing, naming the model and the lookup, with every wait in its history
    (letter,) = DeadLetter.objects.filter(task_id=result.id)
    assert (letter.reason, letter.attempts) == ("record_missing", 1)
    assert letter.exc_message == f"testapp.Order matching pk={missing} does not exist (yet)"
    assert letter.exc_type == "celery_guardrails.exceptions.RecordNotThereYet"
    assert [r["rule"] for r in letter.history] == ["records:require"] * len(letter.history)
    delays = [r["delay"] for r in letter.history]
    assert delays[0] == 1.0 and delays[-1] is None and sum(delays[:-1]) <= 2.5
    # And nothing was applied
    assert not Effect.objects.filter(key=f"shipped:{missing}").exists()


def test_a_plain_get_waits_too_where_running_the_body_again_is_safe(celery_worker: Any, sink: Sink) -> None:
    # Given a task that reads its order with a plain get() before its marked effect (absent_records="wait", the
    # default), published inside the transaction that creates the order, committed 2 s later
    order, result = committed_later(django_tasks.ship_order_by_get, sink)
    # Then it waited for the row as require() does, and applied its effect once
    final = result.get(timeout=TIMEOUT)
    assert Effect.objects.filter(key=f"shipped:{order.pk}").count() == 1
    history = final["history"]
    assert history and [r["delay"] for r in history] == records.delays(60.0)[: len(history)]
    assert {(r["n"], r["class"], r["rule"], r["exc"]) for r in history} == {
        (1, "retry_later", "absent_records:wait", "tests.testapp.models.Order.DoesNotExist")
    }


def test_a_plain_get_in_a_body_that_marks_nothing_is_not_run_again(celery_worker: Any, sink: Sink) -> None:
    # Given a task whose body marks no effect (it counts as one from its first line), and no such order
    result = django_tasks.ship_order_unmarked.delay(0, sink.key)
    # Then its DoesNotExist is not waited for: a dead letter not_idempotent after one run, saying to use require()
    with pytest.raises(Order.DoesNotExist):
        result.get(timeout=TIMEOUT)
    (letter,) = DeadLetter.objects.filter(task_id=result.id)
    assert letter.reason == "not_idempotent"
    assert "self.require(queryset, **lookup)" in letter.history[-1]["note"]
    assert len(sink.items()) == 1


def test_absent_records_fail_makes_does_not_exist_permanent(celery_worker: Any, celery_app: Any, sink: Sink) -> None:
    # Given absent_records="fail" for the app, and a task whose marked body reads an order that is not there
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "absent_records": "fail"}
    result = django_tasks.ship_order_by_get.apply_async((0, sink.key))
    # Then it is a permanent failure at its first run
    with pytest.raises(Order.DoesNotExist):
        result.get(timeout=TIMEOUT)
    (letter,) = DeadLetter.objects.filter(task_id=result.id)
    assert (letter.reason, letter.history[-1]["rule"]) == ("permanent", "absent_records:fail")
    assert len(sink.items()) == 1
