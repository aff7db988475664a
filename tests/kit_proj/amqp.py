"""The kit test project on RabbitMQ: an app of its own (the broker is the app's), with the handlers the
RabbitMQ tests need."""

from __future__ import annotations

from celery_guardrails import GuardedTask, fault_point
from tests.kit_proj.app import make_app
from tests.kit_proj.effects import effect

app = make_app("kit_tests_amqp", ["tests.kit_proj.amqp"], broker="amqp")


@app.task(name="kit_amqp.record_plain", acks_late=True)
def record_plain(key: str) -> None:
    effect(key)


@app.task(base=GuardedTask, bind=True, name="kit_amqp.record_guarded", idempotency_key="record:{key}", atomic=True)
def record_guarded(self: GuardedTask, key: str) -> None:
    effect(key)
    fault_point("written")
