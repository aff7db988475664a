"""Poison messages on a real prefork worker over Redis: a keyed message that kills its worker every time is
dead-lettered as ``poison``, without waiting out the claims its dead deliveries left.

(A poison message without a key, and its dead letter in the Django admin: tests/django_app/test_dead_letters.py.)
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from celery_guardrails.guardrails.idempotency import scoped_key
from celery_guardrails.stores import get_store
from tests.conftest import Sink, unacked, waiting_messages
from tests.proj import tasks
from tests.support.dead_letters import dead_letter_of
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env


def test_a_keyed_poison_message_is_dead_lettered_as_poison(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a keyed message that SIGKILLs its worker's process every time it runs (a 60 s lease: its dead
    # deliveries' claims would outlive the test), queued before an ordinary one
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_GUARDRAILS=json.dumps({"max_deliveries": 2}))
    marker = f"{sink.key}:pids"
    order_id = random.randrange(10**9)
    poison = tasks.kill_my_worker_keyed.delay(order_id, marker)
    behind = tasks.observe.delay()
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env) as worker:
        # When the worker runs it: each redelivery finds the claim of a process that is gone, and takes it over
        behind.get(timeout=60)
        wait_for("the poison message failed", lambda: poison.state == "FAILURE" and not unacked(poison.id))
    # Then it ran three times (a first delivery and two redeliveries), then was dead-lettered unrun as poison
    assert sink.client.llen(marker) == 3
    assert dead_letter_of(celery_app, poison.id)["reason"] == "poison"
    assert worker.log.count("that is over (it gave up, or its process is gone)") == 2
    assert "retry_later_exhausted" not in worker.log and waiting_messages("redis", queue_name) == 0
    # And its key is failed as poison, not left claimed by a delivery that will never end
    key = scoped_key(tasks.kill_my_worker_keyed.name, None, f"poison:{order_id}")
    state = get_store(celery_app).inspect(key)
    assert state is not None and state["state"] == "failed" and state["reason"].startswith("poison: ")
