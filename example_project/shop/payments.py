"""The payments provider's client: one HTTP call, with the provider's own idempotency key header."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from django.conf import settings


def charge(order_id: int, amount_cents: int, *, idempotency_key: str, card_token: str = "") -> dict[str, Any]:
    """POST /charges. Raises urllib's HTTPError on an error status (the guardrails classify it by status)."""
    request = urllib.request.Request(
        f"{settings.PAYMENTS_URL}/charges",
        data=json.dumps({"order_id": order_id, "amount_cents": amount_cents, "card_token": card_token}).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": idempotency_key},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        result: dict[str, Any] = json.load(response)
        return result
