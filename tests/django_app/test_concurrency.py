"""Concurrency slots in the Django store on a real (embedded) worker: a slot taken by a task whose body runs in
the key's transaction (``atomic=True``) is given back after that transaction, never inside it (where a
rollback would undo the release and leave the slot held until the reaper)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from celery_guardrails import concurrency_status, tenant_context
from tests.conftest import Sink
from tests.proj import django_tasks
from tests.support.waiting import wait_for
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "store": "django"}
    return celery_app


def test_a_slot_taken_in_an_atomic_run_is_released_after_its_rollback_and_after_its_commit(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    from django_celery_guardrails.models import ConcurrencySlot

    # Given an atomic keyed task limited to one per tenant, whose first attempt writes its row and fails
    tenant, key = f"t-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    # When it runs
    with tenant_context(tenant):
        result = django_tasks.write_effect_limited.delay(key, sink.key)
    # Then the retry found the slot free at once (no wait for a slot in its history), and one row is left
    assert result.get(timeout=60) == "written"
    assert [(r["attempt"], r["history"]) for r in sink.items()] == [(1, []), (2, ["TransientError"])]
    assert Effect.objects.filter(key=key).count() == 1
    # and nothing is held: both slots were given back, outside the transaction (the second by the success hook,
    # which Celery runs after it stores the result)
    wait_for("the slot given back", lambda: not ConcurrencySlot.objects.filter(key=f"limit:tenant:{tenant}").exists())
    status = concurrency_status(f"tenant:{tenant}", app=celery_app)
    assert (status["held"], status["acquired"], status["reaped"]) == (0, 2, 0)


def test_a_reaped_holder_stays_as_a_lost_row_shown_in_the_admin(admin_client: Any) -> None:
    from django_celery_guardrails.models import ConcurrencySlot
    from django_celery_guardrails.store import DjangoStore

    # Given a holder whose heartbeat stopped at T0, then a capacity check past its ceiling
    store, key, t0 = DjangoStore(), f"limit:admin-{uuid.uuid4().hex[:8]}", 1_800_000_000.0
    store.acquire_slot(key, holder="h1", limit=1, now=t0, reap_after=60, task_name="job", task_id="id-lost")
    answer = store.acquire_slot(key, holder="h2", limit=1, now=t0 + 61, reap_after=60, task_id="id-next")
    # Then the row is kept, marked lost, and the admin lists it among the lost
    assert answer.acquired and [h.task_id for h in answer.reaped] == ["id-lost"]
    row = ConcurrencySlot.objects.get(key=key, holder="h1")
    assert (row.state, row.reaped_at.timestamp()) == ("lost", t0 + 61)
    page = admin_client.get("/admin/guardrails/concurrencyslot/", {"state__exact": "lost", "q": key})
    assert page.status_code == 200
    assert b"id-lost" in page.content and b"id-next" not in page.content
