"""The handlers the kit's tests put through the bad days: each wrong one beside its guarded twin.

Effects land in the test app's tables (tests.testapp.models), which the test reads once the kit's deliveries
have ended.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from django.db import DatabaseError, transaction

from celery_guardrails import GuardedTask, fault_point
from tests.kit_proj.app import app
from tests.kit_proj.effects import chunked
from tests.kit_proj.effects import effect as _effect

logger = logging.getLogger(__name__)


# -- deliver_twice: a non-idempotent increment, and the keyed one -------------------------------------------


@app.task(name="kit.record_plain", acks_late=True)
def record_plain(key: str) -> None:
    """Wrong: inserts a row per delivery, whatever came before."""
    _effect(key)


@app.task(base=GuardedTask, bind=True, name="kit.record_guarded", idempotency_key="record:{key}", atomic=True)
def record_guarded(self: GuardedTask, key: str) -> None:
    """Keyed, the effect and the key's completion in one transaction."""
    _effect(key)


# -- crash_mid_task: a job that commits half its work -------------------------------------------------------


def _items(job: str, count: int) -> None:
    from tests.testapp.models import ChunkItem

    for item in range(count):
        ChunkItem.objects.create(job=job, item=item, run=1)
        if item == count // 2:
            fault_point("half")


@app.task(name="kit.items_plain", acks_late=True)
def items_plain(job: str, count: int) -> None:
    """Wrong: each item commits on its own; a crash half-way leaves half, and the redelivery writes it again."""
    _items(job, count)


@app.task(base=GuardedTask, bind=True, name="kit.items_guarded", idempotency_key="items:{job}", atomic=True)
def items_guarded(self: GuardedTask, job: str, count: int) -> None:
    """The whole job in the key's transaction: a crash half-way leaves nothing; the redelivery does it all."""
    _items(job, count)


@app.task(base=GuardedTask, bind=True, name="kit.items_slow", idempotency_key="slow:{job}", atomic=True)
def items_slow(self: GuardedTask, job: str, count: int) -> None:
    """The guarded job, a tenth of a second per item: long enough to be killed by the clock half-way."""
    from tests.testapp.models import ChunkItem

    for item in range(count):
        ChunkItem.objects.create(job=job, item=item, run=1)
        time.sleep(0.1)


@app.task(name="kit.items_early_ack")
def items_early_ack(job: str, count: int) -> None:
    """Wrong another way: acked before it runs (Celery's default), so a crash half-way loses the rest."""
    _items(job, count)


# -- crash_mid_task after the body: a chunked job that succeeded, its worker killed before the ack ---------


@app.task(base=GuardedTask, bind=True, name="kit.chunks")
def chunks(self: GuardedTask, job: str, count: int, every: int = 100) -> dict[str, int]:
    """Resumable chunks without a key (the checkpoint is the task id's): one row per item, committed with its
    chunk's position; returns where the run started and how many items it ran."""
    return chunked(self, job, count, every)


@app.task(base=GuardedTask, bind=True, name="kit.chunks_keyed", idempotency_key="chunks:{job}")
def chunks_keyed(self: GuardedTask, job: str, count: int, every: int = 100) -> dict[str, int]:
    """The same job, keyed: its checkpoint is its idempotency key's."""
    return chunked(self, job, count, every)


# -- poison: a message that kills its worker every time ---------------------------------------------------


@app.task(name="kit.crash_plain", acks_late=True)
def crash_plain(key: str) -> None:
    _effect(key)


@app.task(base=GuardedTask, bind=True, name="kit.crash_guarded", idempotent=True, max_deliveries=2)
def crash_guarded(self: GuardedTask, key: str) -> None:
    _effect(key)


# -- out_of_order: updates that must apply in the order they were made ------------------------------------


@app.task(name="kit.status_plain", acks_late=True)
def status_plain(order_id: int, status: str) -> None:
    """Wrong: the last delivery wins, whatever order the updates were made in."""
    from tests.testapp.models import Order

    Order.objects.filter(pk=order_id).update(status=status)


@app.task(
    base=GuardedTask,
    bind=True,
    name="kit.status_guarded",
    idempotent=True,
    ordering_key="order:{order_id}",
    ordering_gap_timeout=60,
)
def status_guarded(self: GuardedTask, order_id: int, status: str) -> None:
    from tests.testapp.models import Order

    Order.objects.filter(pk=order_id).update(status=status)


# -- store_outage: a handler that acks a failure --------------------------------------------------------------


@app.task(name="kit.swallow_plain", acks_late=True)
def swallow_plain(key: str) -> None:
    """Wrong: the database error is logged and the message acked, with nothing written."""
    try:
        with transaction.atomic():
            _effect(key)
    except DatabaseError as exc:
        logger.warning("could not record %s: %s", key, exc)


@app.task(base=GuardedTask, bind=True, name="kit.swallow_guarded", idempotency_key="swallow:{key}", atomic=True)
def swallow_guarded(self: GuardedTask, key: str) -> None:
    _effect(key)


# -- deploy_during_processing: the new code (payload version 2: amounts in cents) ----------------------------


@app.task(name="kit.pay_plain", acks_late=True)
def pay_plain(order_id: int, amount_cents: int, currency: str) -> None:
    """Wrong: the new shape replaces the old one, with nothing to tell them apart."""
    _effect(f"pay:{order_id}:{amount_cents}{currency}")


@app.task(
    base=GuardedTask,
    bind=True,
    name="kit.pay_guarded",
    idempotency_key="pay:{order_id}",
    atomic=True,
    payload_version=2,
    accepts_versions=(1, 2),
)
def pay_guarded(self: GuardedTask, order_id: int, *amount: Any) -> None:
    """Version 2 sends (order_id, amount_cents, currency); version 1 sent (order_id, euros)."""
    if self.request.payload_version == 1:
        cents, currency = round(amount[0] * 100), "EUR"
    else:
        cents, currency = amount
    _effect(f"pay:{order_id}:{cents}{currency}")
