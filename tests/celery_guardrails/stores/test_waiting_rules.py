"""Both real stores keep waiting messages the same way (see celery_guardrails.guardrails.waiting): one row per task id,
removed by the next delivery, forgotten once expired, read per tenant with counts per reason.

Each scenario runs against Redis, the local Redis Cluster and the Django database. Times are real (the stores
forget every expired row a read finds, other tests' too: a time in the future would take theirs), and each test
has a tenant of its own, so the rows of tests running beside it are not counted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from celery_guardrails.stores.base import Wait, Waits

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def wait(tenant: str, task_id: str, *, reason: str = "retry", due: float, **fields: Any) -> Wait:
    values: dict[str, Any] = {
        "task_name": "shop.tasks.charge",
        "tenant": tenant,
        "queue": "celery",
        "detail": "HTTPError",
        "attempt": 2,
        "since": due - 10,
        "expires": due + 3600,
        **fields,
    }
    return Wait(task_id=task_id, reason=reason, due=due, **values)


def read(store: Any, tenant: str, *, limit: int = 10) -> Waits:
    found: Waits = store.waiting(now=time.time(), limit=limit, tenants=frozenset({tenant}))
    return found


def test_one_row_per_task_id_replaced_by_each_note_and_removed_by_the_next_delivery(store: Any, tenant: str) -> None:
    # Given a message retried once, then deferred by its budget three times (each re-publish notes its wait)
    now = time.time()
    task_id = f"{tenant}-a"
    store.wait_note(wait(tenant, task_id, due=now + 5))
    for n in range(3):
        store.wait_note(wait(tenant, task_id, reason="budget", detail="payments-api", due=now + 60 + n, since=now))

    # Then it is one row: the last wait, with its own due time and since
    found = read(store, tenant)
    assert (found.count, found.by_reason) == (1, {"budget": 1})
    (row,) = found.soonest
    assert (row.task_id, row.reason, row.detail, row.attempt) == (task_id, "budget", "payments-api", 2)
    assert row.due == pytest.approx(now + 62, abs=0.001)
    assert row.since == pytest.approx(now, abs=0.001)

    # When its next delivery starts, Then the row is gone (and a second removal is harmless)
    store.wait_done(task_id)
    store.wait_done(task_id)
    assert read(store, tenant) == Waits(count=0, by_reason={}, soonest=())


def test_counts_per_reason_soonest_first_and_only_the_tenants_asked_for(store: Any, tenant: str) -> None:
    # Given five waits of this tenant and one of another
    now = time.time()
    other = f"{tenant}-other"
    reasons = ["retry", "budget", "budget", "circuit", "concurrency"]
    for n, reason in enumerate(reasons):
        store.wait_note(wait(tenant, f"{tenant}-{n}", reason=reason, due=now + 100 - n))
    store.wait_note(wait(other, f"{other}-0", due=now + 1))

    # When the three soonest are read for this tenant
    found = read(store, tenant, limit=3)

    # Then every wait of the tenant is counted, per reason, and the soonest due come first
    assert found.count == 5
    assert found.by_reason == {"retry": 1, "budget": 2, "circuit": 1, "concurrency": 1}
    assert [row.task_id for row in found.soonest] == [f"{tenant}-4", f"{tenant}-3", f"{tenant}-2"]
    # And the other tenant's wait is read with its own tenant only
    assert [row.task_id for row in read(store, other).soonest] == [f"{other}-0"]
    for n in range(5):
        store.wait_done(f"{tenant}-{n}")
    store.wait_done(f"{other}-0")


def test_a_row_no_delivery_removed_is_forgotten_once_it_expires(store: Any, tenant: str) -> None:
    # Given a wait whose message was lost: due two days ago, expired a day later; and one still due
    now = time.time()
    store.wait_note(wait(tenant, f"{tenant}-lost", due=now - 2 * 86400, expires=now - 86400))
    store.wait_note(wait(tenant, f"{tenant}-due", due=now + 30))

    # When the waits are read, Then the expired one is not counted, and it is gone from the store
    found = read(store, tenant)
    assert [row.task_id for row in found.soonest] == [f"{tenant}-due"]
    assert found.count == 1
    store.wait_note(wait(tenant, f"{tenant}-due", due=now + 40))  # (a later note does not bring it back)
    assert [row.task_id for row in read(store, tenant).soonest] == [f"{tenant}-due"]
    store.wait_done(f"{tenant}-due")
