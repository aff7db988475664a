"""Concurrency slots in the Django store on real workers: a slot taken by a task whose body runs in the key's
transaction (``atomic=True``) is given back after that transaction, never inside it (where a rollback would undo
the release and leave the slot held until the reaper); a holder stopped past the ceiling is fenced when it
resumes, its effect rolled back in its own transaction."""

from __future__ import annotations

import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_guardrails import concurrency_status, tenant_context
from tests.conftest import Sink
from tests.proj import django_tasks
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env
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


def test_a_holder_stopped_past_the_ceiling_rolls_its_effect_back_when_it_resumes_and_runs_again(
    celery_app: Any, sink: Sink, tmp_path: Path
) -> None:
    from django.db import connection

    if connection.vendor != "postgresql":
        # SQLite has one writer: a process stopped inside its transaction (BEGIN IMMEDIATE) keeps every other
        # writer out, the reaper included, until it resumes; there is nothing to fence.
        pytest.skip("needs row locks: a stopped SQLite writer locks the whole database (runs in the PostgreSQL pass)")
    # Given worker A (solo) and worker B (2 threads) on the Django store, each on its own queue, a reap ceiling of
    # 1.5 s, and an atomic task limited to 2 per tenant that, once its gate opens, inserts an Effect row and marks
    # its key processed through mark_processed (the effect helper), in its one transaction
    tenant = f"stalled-{uuid.uuid4().hex[:8]}"
    gate_a, gate_b = f"{sink.key}:gate-a", f"{sink.key}:gate-b"
    config = json.dumps({"store": "django", "concurrency_reap_after": 1.5})
    queues = {name: f"gr-test-slots-{uuid.uuid4().hex[:12]}" for name in ("a", "b")}
    workers = {
        name: WorkerProcess(
            app=PROJ_APP,
            queue=queues[name],
            pool=pool,
            concurrency=concurrency,
            log_path=tmp_path / f"{name}.log",
            env=proj_env(queue=queues[name], django=True, GUARDRAILS_TEST_GUARDRAILS=config),
        )
        for name, pool, concurrency in (("a", "solo", 1), ("b", "threads", 2))
    }
    keys = [f"{tenant}-{n}" for n in range(3)]

    def publish(key: str, gate: str, queue: str) -> Any:
        with tenant_context(tenant):
            return django_tasks.limited_atomic_effect.apply_async((key, sink.key, gate), queue=queue)

    try:
        for worker in workers.values():
            worker.start()
        stalled = publish(keys[0], gate_a, queues["a"])
        sink.wait(1)  # in its body, holding a slot, before its effect
        # When worker A is stopped past the ceiling (its gate opening meanwhile) and two deliveries on worker B
        # take both slots (reaping A's holder), then A resumes
        workers["a"].kill(signal.SIGSTOP)
        sink.client.set(gate_a, 1)
        time.sleep(2.0)
        others = [publish(key, gate_b, queues["b"]) for key in keys[1:]]
        sink.wait(3)
        workers["a"].kill(signal.SIGCONT)
        wait_for(
            "the stalled holder fenced, or its effect committed",
            lambda: "fenced at mark_processed" in workers["a"].log or Effect.objects.filter(key=keys[0]).exists(),
        )
        # Then its effect did not commit beside the two holders of the slots (its row rolled back); the log names it
        assert not Effect.objects.filter(key__in=keys).exists()
        (line,) = [line for line in workers["a"].log.splitlines() if "fenced at mark_processed" in line]
        assert stalled.id in line and f"limit:tenant:{tenant}" in line
        # and when the holders finish, its message runs again under the limit (no attempt spent) and commits once
        sink.client.set(gate_b, 1)
        for other in others:
            other.get(timeout=90)
        report = stalled.get(timeout=90)
        assert report["attempt"] == 1 and ["retry_later", "concurrency:slot_lost"] in report["history"]
        rows = list(Effect.objects.filter(key__in=keys).order_by("created_at", "pk").values_list("key", flat=True))
        assert sorted(rows) == keys and rows[-1] == keys[0]
        # (the slot is released as the delivery ends, just after its result is stored)
        status = wait_for(
            "every slot released",
            lambda: (s := concurrency_status(f"tenant:{tenant}", app=celery_app))["held"] == 0 and s,
        )
        assert (status["held"], status["reaped"], [h.task_id for h in status["recent_lost"]]) == (0, 1, [stalled.id])
    finally:
        workers["a"].kill(signal.SIGCONT)
        for worker in workers.values():
            worker.stop()
        sink.client.delete(gate_a, gate_b)


def test_a_holder_inside_its_fenced_effect_is_neither_reaped_nor_waited_for_until_it_ends() -> None:
    import threading

    from django.db import connection, connections, transaction

    from django_celery_guardrails.store import DjangoStore

    if connection.vendor != "postgresql":
        pytest.skip("row locks (runs in the PostgreSQL pass)")
    # Given a holder of a key limited to one, whose effect transaction has checked its slot (the fence's UPDATE
    # locks the row) and is still open
    store, key, t0 = DjangoStore(), f"limit:locked-{uuid.uuid4().hex[:8]}", 1_800_000_000.0
    assert store.acquire_slot(key, holder="a", limit=1, now=t0, reap_after=60).acquired
    checked, finish, steps = threading.Event(), threading.Event(), []

    def effect() -> None:
        try:
            with transaction.atomic():
                steps.append(("fence", store.heartbeat_slot(key, holder="a", now=t0 + 1)))
                checked.set()
                finish.wait(30)
            steps.append(("committed", True))
        finally:
            connections.close_all()

    holder = threading.Thread(target=effect)
    holder.start()
    assert checked.wait(30)
    # When its heartbeat thread beats and another delivery's capacity check comes long past the ceiling
    beat = store.heartbeat_slot(key, holder="a", now=t0 + 500)
    refused = store.acquire_slot(key, holder="b", limit=1, now=t0 + 1000, reap_after=60)
    steps.append(("checked meanwhile", (beat, refused.acquired, refused.reaped)))
    finish.set()
    holder.join(30)
    # Then neither waited for the effect: the beat says held, the capacity check reaps nothing and is refused
    assert steps == [("fence", True), ("checked meanwhile", (True, False, ())), ("committed", True)]
    # and once the effect's transaction ended, the holder (silent since its fence) is reaped as usual
    answer = store.acquire_slot(key, holder="b", limit=1, now=t0 + 1000, reap_after=60)
    assert answer.acquired and [h.holder for h in answer.reaped] == ["a"]


def test_a_chunk_saved_after_the_slot_was_reaped_rolls_back_and_the_job_resumes_under_the_limit(
    celery_app: Any, celery_worker: Any, received: Any
) -> None:
    from django.db import connection

    from celery_guardrails import signals
    from celery_guardrails.stores import get_store
    from tests.testapp.models import ChunkItem

    if connection.vendor != "postgresql":
        # SQLite has one writer: the other delivery cannot take the slot while the chunk's transaction is open.
        pytest.skip("a reap inside an open chunk needs a second writer (runs in the PostgreSQL pass)")

    # Given a chunked job of 6 items (2 a chunk) limited to one per tenant, whose slot another delivery takes
    # (reaping it, as after a stall) while its second chunk runs
    tenant, job, thief = f"t-{uuid.uuid4().hex[:8]}", f"job-{uuid.uuid4().hex[:8]}", f"thief-{uuid.uuid4().hex[:8]}"
    fenced = received(signals.holder_fenced)
    with tenant_context(tenant):
        result = django_tasks.limited_chunks.delay(job, 6, thief)
    # When its second chunk is saved: the save is fenced, the chunk rolls back
    wait_for("the holder fenced", lambda: len(fenced) == 1)
    assert [(f["task_id"], f["key"], f["where"]) for f in fenced] == [
        (result.id, f"limit:tenant:{tenant}", "checkpoint")
    ]
    assert sorted(ChunkItem.objects.filter(job=job).values_list("item", "run")) == [(0, 1), (1, 1)]
    # Then, once the other delivery gives the slot back, the job runs again under the limit, resuming at item 2,
    # on its first attempt: each item's row exactly once
    get_store(celery_app).release_slot(f"limit:tenant:{tenant}", holder=thief)
    report = result.get(timeout=60)
    assert report["run"] == 2 and report["attempt"] == 1
    assert ["retry_later", "concurrency:slot_lost"] in report["history"]
    rows = sorted(ChunkItem.objects.filter(job=job).values_list("item", "run"))
    assert rows == [(0, 1), (1, 1), (2, 2), (3, 2), (4, 2), (5, 2)]
