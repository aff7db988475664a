"""The example shop's tasks through the rubric's bad days, with celery-guardrails' test kit, as a user of the
library would test their own project: a real ``celery worker`` of the shop's app (killed and started again by
the kit), the real broker and database, and the payments provider as the one mock, at the true boundary (an
HTTP server that counts the charges its customers would see).

The rubric's five tests, for the tasks they fit:

* duplicate delivery: ``charge_order`` twice in a row and twice at once; a beat period of ``settle_payments``;
  ``ship_order`` twice (its carrier takes no key: the booking must not happen twice);
* failure mid-job: ``charge_order`` killed after the provider charged, before the ack; ``build_report`` killed
  in its body;
* poison: ``send_receipt`` and ``charge_order`` killing their worker every time; a malformed envelope;
* out of order: ``update_stock``'s counts of one SKU delivered last first;
* store outage (in place of deployment: no shop task is versioned): the database cut as ``charge_order``
  starts, before its guardrails reach the store.

Each ends with ``assert_no_loss``: every message the kit sent was handled or dead-lettered.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

# Imported at collection, for the reason test_shop.py gives (shared tasks register through a finalizer).
import example_project.shop.tasks  # noqa: F401
from celery_guardrails import tenant_context
from celery_guardrails.runtime.effects import provider_key
from celery_guardrails.testing import (
    assert_dead_lettered,
    assert_no_loss,
    assert_single_effect,
    crash_mid_task,
    deliver_twice,
    out_of_order,
    poison,
    store_outage,
)
from django_celery_guardrails.models import ScheduledRun
from example_project.celery_app import app as shop_app
from example_project.shop.fake_provider import FlakyProvider
from example_project.shop.tasks import (
    build_report,
    charge_order,
    send_receipt,
    settle_payments,
    ship_order,
    update_stock,
)
from tests.support.services import require

pytestmark = [pytest.mark.guardrails(app="example_project.celery_app:app", pool="prefork", concurrency=2)]

TENANT = "acme"


@pytest.fixture
def payments(monkeypatch: pytest.MonkeyPatch) -> Iterator[FlakyProvider]:
    """The payments provider, a real HTTP server on loopback; the worker is pointed at it (PAYMENTS_URL)."""
    require("redis")
    require("postgres")
    with FlakyProvider() as provider:
        monkeypatch.setenv("EXAMPLE_PAYMENTS_URL", provider.url)
        yield provider


@pytest.fixture
def guardrails_kit_app(payments: FlakyProvider) -> Any:
    """The shop's app, for the kit. Asking for the provider first means the kit's worker starts (and every
    restart of it) with the provider's address in its environment. Made current: the shop's tasks are shared
    tasks, and another test's app may have been left current."""
    shop_app.set_current()
    return shop_app


def charges(provider: FlakyProvider, order_id: int) -> int:
    """Distinct charges of an order, as its customer sees them on their statement."""
    return provider.charges[order_id]


# -- duplicate delivery ---------------------------------------------------------------------------------------


def test_a_charge_delivered_twice_charges_the_customer_once(payments: FlakyProvider) -> None:
    # Given an order of tenant acme to charge 42.00
    order = 101
    # When its charge message is delivered twice, the second after the first was handled (a lost ack)
    with tenant_context(TENANT):
        report = deliver_twice(charge_order, order, 4200)
    # Then the customer was charged once, and the provider asked once (the idempotency key stopped the second
    # delivery, not the provider's own deduplication)
    assert_single_effect(lambda: charges(payments, order), what=f"a charge of order {order}")
    assert payments.calls[order] == 1
    # as tenant acme: the key the provider was given is made from the task's, scoped by the tenant the publish
    # captured (an opaque UUID: it tells the provider neither the module nor the tenant)
    assert list(payments.by_key) == [provider_key(f"{charge_order.name}:{TENANT}:charge:{order}")]
    # the first delivery charged, the second was skipped as a duplicate of it
    assert report.outcomes == [("succeeded", ""), ("duplicate_skipped", "completed")]
    assert_no_loss()


def test_a_charge_delivered_twice_at_once_charges_the_customer_once(payments: FlakyProvider) -> None:
    # Given an order of tenant acme
    order = 102
    # When two copies of its charge message start at the same moment, on two pool processes
    with tenant_context(TENANT):
        report = deliver_twice(charge_order, order, 4200, concurrently=True)
    # Then the customer was charged once, and the provider asked once
    assert_single_effect(lambda: charges(payments, order), what=f"a charge of order {order}")
    assert payments.calls[order] == 1
    # the copies met (the kit holds the first in its body until the other has tried): the second found the
    # key held and came back later, then was skipped as a duplicate of the first, which charged
    assert report.outcomes[0] == ("retry_later", "")
    ended = [outcome for outcome in report.outcomes[1:] if outcome != ("retry_later", "")]
    assert sorted(ended) == [("duplicate_skipped", "completed"), ("succeeded", "")], report.outcomes
    assert_no_loss()


def test_a_shipment_delivered_twice_books_one_parcel(payments: FlakyProvider) -> None:
    # Given an order to ship, whose carrier takes no idempotency key
    order = 301
    # When its message is delivered twice, the second after the first was handled
    with tenant_context(TENANT):
        report = deliver_twice(ship_order, order)
    # Then one parcel was booked: the second delivery was skipped as a duplicate of the first
    assert_single_effect(lambda: payments.bookings[order], what=f"a parcel booked for order {order}")
    assert report.outcomes == [("succeeded", ""), ("duplicate_skipped", "completed")]
    assert_no_loss()


def test_a_settlement_period_delivered_twice_runs_once() -> None:
    # Given the message beat sends for one period of "settle-payments": its schedule and period in the
    # guardrails header, which makes the period key its idempotency key (published as the guarded beat does,
    # with apply_async(headers=...): every helper passes ``publish_options`` on to apply_async)
    period = 1_800_000_000
    beat = {"headers": {"guardrails": {"sched": "settle-payments", "period": period}}}
    # When it is delivered twice
    report = deliver_twice(settle_payments, publish_options=beat)
    # Then the period ran once: the second delivery was skipped as its duplicate, and the ledger holds one
    # successful run of it
    assert report.outcomes == [("succeeded", ""), ("duplicate_skipped", "completed")]
    runs = ScheduledRun.objects.filter(schedule="settle-payments")
    assert list(runs.values_list("period", "status")) == [(datetime.fromtimestamp(period, UTC), "ok")]
    assert_no_loss()


# -- failure mid-job ------------------------------------------------------------------------------------------


def test_a_worker_killed_after_the_charge_before_the_ack_charges_once(payments: FlakyProvider) -> None:
    # Given an order of tenant acme
    order = 103
    # When the worker is SIGKILLed after the provider charged and the key was marked done, before the ack,
    # and the broker delivers the message again to the restarted worker
    with tenant_context(TENANT):
        report = crash_mid_task(charge_order, order, 4200, at="after_body")
    # Then the customer was charged once, and the provider asked once
    assert_single_effect(lambda: charges(payments, order), what=f"a charge of order {order}")
    assert payments.calls[order] == 1
    # the worker died once; of the two deliveries the crashed one never ended, the redelivery was skipped as
    # a duplicate of it
    assert report.crashes == 1
    assert report.of().starts == 2
    assert report.outcomes == [("duplicate_skipped", "completed")]
    assert_no_loss()


def test_a_report_whose_worker_dies_in_its_body_is_built_again() -> None:
    # Given a report of tenant acme
    # When the worker is SIGKILLed in the report's body, and the broker delivers the message again
    with tenant_context(TENANT):
        report = crash_mid_task(build_report, 7, seconds=0.0, at="body")
    # Then the message came back and the report was built, once, by the restarted worker
    assert report.crashes == 1
    assert report.of().starts == 2
    assert report.outcomes == [("succeeded", "")]
    assert_no_loss()


# -- poison ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("task", "args"), [(send_receipt, (104,)), (charge_order, (105, 4200))])
def test_a_message_that_kills_its_worker_every_time_is_dead_lettered(
    payments: FlakyProvider, task: Any, args: tuple[Any, ...]
) -> None:
    # Given a message whose body kills the worker every time it runs
    # When it is delivered, and delivered again after each death
    with tenant_context(TENANT):
        report = poison(task, *args, how="crash")
    # Then the first delivery and max_deliveries (3, the default) redeliveries killed the worker; the next
    # redelivery was not run but dead-lettered as poison, with the tenant it was published for
    assert report.crashes == 4
    assert report.outcomes == [("dead_lettered", "poison")]
    record = assert_dead_lettered(report.task_id, reason="poison")
    assert record["tenant"] == TENANT
    # and nothing reached the provider
    assert sum(payments.calls.values()) == 0
    assert_no_loss()


def test_a_malformed_charge_message_is_dead_lettered(payments: FlakyProvider) -> None:
    # Given a charge message whose envelope is damaged (an eta no one can read)
    # When it is delivered
    with tenant_context(TENANT):
        report = poison(charge_order, 106, 4200, how="malformed")
    # Then it is dead-lettered as malformed, without running: the provider was never asked
    assert report.outcomes == [("dead_lettered", "malformed_message")]
    assert report.of().starts == 0
    assert_dead_lettered(report.task_id, reason="malformed_message")
    assert payments.calls[106] == 0
    assert_no_loss()


# -- out of order ---------------------------------------------------------------------------------------------


def test_stock_counts_delivered_last_first_are_set_in_the_order_they_were_counted() -> None:
    # Given three counts of one SKU, published in the order the warehouse counted them
    counts = [("SKU-7", "c1", 12), ("SKU-7", "c2", 9), ("SKU-7", "c3", 4)]
    # When the broker delivers them last first
    with tenant_context(TENANT):
        report = out_of_order(update_stock, counts)
    # Then their bodies ran in the order they were counted (the last count is the level that stays): the early
    # ones came back later, no attempt spent, until their turn
    assert report.order == [0, 1, 2]
    assert report.outcomes.count(("succeeded", "")) == 3
    assert set(report.outcomes) == {("succeeded", ""), ("retry_later", "")}, report.outcomes
    assert_no_loss()


# -- store outage ---------------------------------------------------------------------------------------------


def test_a_charge_during_a_database_outage_charges_once_when_it_is_back(payments: FlakyProvider) -> None:
    # Given an order of tenant acme
    order = 107
    # When the database (the guardrails' store) is cut as the charge starts, and comes back once that
    # delivery has ended its attempt
    with tenant_context(TENANT):
        report = store_outage(charge_order, order, 4200)
    # Then the customer was charged once, and the provider asked once
    assert_single_effect(lambda: charges(payments, order), what=f"a charge of order {order}")
    assert payments.calls[order] == 1
    # each delivery while the store was gone charged nothing and put the message off (no attempt spent; how
    # many came before it was back is the outage's length), and the first after it charged
    *put_off, last = report.outcomes
    assert put_off and set(put_off) == {("retried", "store_unavailable")}, report.outcomes
    assert last == ("succeeded", "")
    assert_no_loss()
