"""The carrier's and the warehouse's clients: one HTTP call each (the fake provider stands in for both)."""

from __future__ import annotations

import json
import urllib.request

from django.conf import settings


def _post(path: str, order_id: int) -> None:
    request = urllib.request.Request(
        f"{settings.PAYMENTS_URL}{path}",
        data=json.dumps({"order_id": order_id}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10):
        pass


def book_parcel(order_id: int) -> None:
    """POST /shipments: the carrier books a parcel (it takes no idempotency key: booking twice ships twice)."""
    _post("/shipments", order_id)


def tell_warehouse(order_id: int) -> None:
    """POST /warehouse: the warehouse picks the order."""
    _post("/warehouse", order_id)
