"""RabbitMQ quorum queues for the tests: a queue of the test's own, on an exchange of its own (topic or direct).

Celery's worker declares the native delayed delivery exchanges and queues (``celery_delayed_0`` to ``_27``,
``celery_delayed_delivery``; its ``DelayedDelivery`` bootstep, included when a queue is a quorum queue, with
``broker_native_delayed_delivery_queue_type``, quorum by default) and binds the test's exchange to them. Those
are shared by every Celery app on the vhost (their names are fixed in Celery), so a test leaves them; it deletes
its own queue and exchange, which removes their bindings.
"""

from __future__ import annotations

import contextlib
from typing import Any

from celery import Celery
from kombu import Connection, Exchange, Queue

from tests.support.services import BROKER_URLS, REDIS_URL


def quorum_queues(name: str, exchange_type: str) -> list[Queue]:
    """``task_queues`` with one quorum queue ``name`` bound to an exchange ``name`` of ``exchange_type``."""
    return [
        Queue(
            name,
            Exchange(name, type=exchange_type),
            routing_key=name,
            queue_arguments={"x-queue-type": "quorum"},
        )
    ]


def quorum_app(name: str, exchange_type: str, **guardrails: Any) -> Celery:
    """A publishing app of the test's own with the worker's queues (``tests.proj.app`` with GUARDRAILS_TEST_QUORUM)."""
    app = Celery(f"quorum-{name}", set_as_current=False)
    app.conf.update(
        broker_url=BROKER_URLS["amqp"],
        result_backend=REDIS_URL,
        task_default_queue=name,
        task_queues=quorum_queues(name, exchange_type),
        broker_connection_retry_on_startup=False,
        guardrails={"store": REDIS_URL, "dead_letter_sinks": ["redis"], "activity": False, **guardrails},
    )
    return app


def delete_queue(name: str) -> None:
    """Delete the test's queue and exchange (both named ``name``); nothing when they were never declared."""
    with Connection(BROKER_URLS["amqp"]) as connection:
        for delete in ("queue_delete", "exchange_delete"):
            with contextlib.suppress(*connection.channel_errors):
                getattr(connection.channel(), delete)(name)
