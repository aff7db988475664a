"""The tasks of tests.kit_proj.tasks that change in the deployment, as they were before it (version 1:
amounts in euros)."""

from __future__ import annotations

from celery_guardrails import GuardedTask
from tests.kit_proj.effects import effect as _effect
from tests.kit_proj.old_app import app


@app.task(name="kit.pay_plain", acks_late=True)
def pay_plain(order_id: int, euros: float) -> None:
    _effect(f"pay:{order_id}:{round(euros * 100)}EUR")


@app.task(base=GuardedTask, bind=True, name="kit.pay_guarded", idempotency_key="pay:{order_id}", atomic=True)
def pay_guarded(self: GuardedTask, order_id: int, euros: float) -> None:
    _effect(f"pay:{order_id}:{round(euros * 100)}EUR")
