"""The shop's background work, every task guarded."""

import logging
from typing import Any

from celery import shared_task

from celery_guardrails import GuardedTask, current_correlation_id, current_tenant

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
