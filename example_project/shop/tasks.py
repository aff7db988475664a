"""The shop's background work, every task guarded."""

import logging
import time
from datetime import datetime
from typing import Any

from celery import shared_task

from celery_guardrails import GuardedTask, current_correlation_id, current_tenant
from example_project.shop import payments, shipping

logger = logging.getLogger(__name__)


@shared_task(base=GuardedTask, bind=True, tenant_required=True)
def send_receipt(self: GuardedTask, order_id: int) -> dict[str, Any]:
    """Mail the receipt of an order; tells what context it ran in."""
    logger.info("Sending the receipt of order %s", order_id)
    return {
        "order_id": order_id,
        "tenant": current_tenant(),
        "correlation_id": current_correlation_id(),
        "worker": self.request.hostname,
    }


class InvalidAmount(ValueError):
    """The order's amount cannot be charged: no retry can fix that."""


# The idempotency key makes the charge run once per order and tenant however often its message is delivered;
# the same key goes to the provider, which deduplicates by it too (the window a worker crash leaves between
# the provider's answer and our completion mark is closed there). The provider's 5xx and 429 are retried
# with jittered backoff, its other 4xx and InvalidAmount are not; "payments-api" shares one retry budget and
# circuit breaker across workers.
@shared_task(
    base=GuardedTask,
    bind=True,
    tenant_required=True,
    idempotency_key="charge:{order_id}",
    dependency="payments-api",
    owner="payments",
    permanent_errors=(InvalidAmount,),
    max_attempts=5,
    backoff_base=0.3,
)
def charge_order(self: GuardedTask, order_id: int, amount_cents: int, card_token: str = "") -> dict[str, Any]:
    """Charge an order through the payments provider; tells how many attempts it took. ``card_token`` is a
    secret: a dead letter shows it redacted, and keeps it only in its sealed copy, for replay."""
    if amount_cents <= 0:
        raise InvalidAmount(f"order {order_id}: amount must be positive, got {amount_cents}")
    charge = payments.charge(
        order_id, amount_cents, idempotency_key=self.request.idempotency_key, card_token=card_token
    )
    logger.info("Charged order %s: %s", order_id, charge["id"])
    return {
        "order_id": order_id,
        "charge": charge["id"],
        "attempt": self.request.attempt,
        "history": self.request.attempt_history,
    }


# The carrier takes no idempotency key: booking a parcel twice ships two parcels, so this task must never run
# its booking again. The key makes a second delivery of a shipped order a duplicate skipped. The booking is
# marked as the task's effect: a failure before it, or one inside it that proves the carrier never got the
# request (a refused connection, a 429), is retried; any failure after it (the warehouse answering 503) is final
# (not_idempotent), with a note saying so, and the booking stands once. (A worker killed between the booking and
# the key's completion leaves the one window the key cannot close: the carrier would need a key of its own.)
@shared_task(
    base=GuardedTask,
    bind=True,
    tenant_required=True,
    idempotency_key="ship:{order_id}",
    owner="shipping",
    backoff_base=0.3,
)
def ship_order(self: GuardedTask, order_id: int) -> dict[str, Any]:
    """Book the order's parcel with the carrier, then tell the warehouse."""
    with self.effect():
        shipping.book_parcel(order_id)
    shipping.tell_warehouse(order_id)
    return {"order_id": order_id, "attempt": self.request.attempt, "history": self.request.attempt_history}


# Scheduled every minute by beat (CELERY_BEAT_SCHEDULE) with the policy in CELERY_GUARDRAILS["schedules"]:
# the period key is its idempotency key, and since=True hands it the end of the last successful period.
@shared_task(base=GuardedTask, bind=True, owner="payments")
def settle_payments(self: GuardedTask, since: datetime | None = None) -> dict[str, Any]:
    """Settle the payments captured from ``since`` (the last settlement) to this period's due time."""
    logger.info("Settling payments from %s to %s", since, self.request.period)
    return {
        "period": self.request.period.isoformat() if self.request.period else None,
        "since": since.isoformat() if since else None,
    }


# Reports are heavy: at most two run at once per tenant, across every worker, so one tenant's burst cannot take
# all the workers from the others. A report that finds both slots taken comes back later (no attempt spent).
@shared_task(
    base=GuardedTask,
    bind=True,
    tenant_required=True,
    concurrency_key="tenant:{tenant}",
    concurrency_limit=2,
    retry_later_delay=0.3,
)
def build_report(self: GuardedTask, report_id: int, seconds: float = 1.0) -> dict[str, Any]:
    """Build a tenant's report (a sleep here, in four steps, each reported to its job when it is one: see
    views.report_view); tells when it ran, for the demo's timeline."""
    started = time.time()
    for step in range(1, 5):
        time.sleep(seconds / 4)
        self.job.progress(step, 4)
    return {
        "report_id": report_id,
        "tenant": current_tenant(),
        "started": started,
        "ended": time.time(),
        "attempt": self.request.attempt,
    }


# The warehouse counts each SKU's stock and sends the counts in order: a later count must never be overwritten
# by an earlier one that ran late. ordering_key runs the counts of one SKU one after another, in publish order
# (other SKUs run freely beside them); a count whose predecessor has not come waits, looking back less and less
# often, shows in `celery guardrails status`, alerts the owner after ordering_gap_alert_after, and after
# ordering_gap_timeout the SKU moves past the missing number, recorded as a dead letter ordering_gap_skipped.
# Setting a level (not adding to it) is safe to run twice (idempotent=True); the key skips a redelivered count
# whose run completed.
@shared_task(
    base=GuardedTask,
    bind=True,
    tenant_required=True,
    ordering_key="sku:{sku}",
    idempotency_key="stock:{sku}:{count_id}",
    idempotent=True,
    retry_later_delay=0.1,
)
def update_stock(self: GuardedTask, sku: str, count_id: str, level: int) -> dict[str, Any]:
    """Set a SKU's stock level to a warehouse count; tells its place in the SKU's order and its waits."""
    logger.info("Stock of %s set to %s (count %s)", sku, level, count_id)
    return {
        "sku": sku,
        "level": level,
        "sequence": getattr(self.request, "ordering_sequence", None),
        "history": self.request.attempt_history,
    }
