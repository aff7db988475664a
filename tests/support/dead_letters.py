"""Dead letters in the Redis stream sink (the sink of workers without Django), as a test reads them."""

from __future__ import annotations

import json
from typing import Any

from celery_guardrails.runtime.dead_letters import STREAM
from celery_guardrails.stores import get_store


def dead_letter_of(app: Any, task_id: str) -> dict[str, Any]:
    """The record of ``task_id`` in the stream of ``app``'s store; AssertionError when there is none."""
    client = get_store(app).client  # type: ignore[attr-defined]
    for _, entry in client.xrevrange(STREAM, count=2000):
        record = json.loads(entry[b"record"])
        if record["task_id"] == task_id:
            return dict(record)
    raise AssertionError(f"no dead letter for {task_id}")


def dead_letters_of(app: Any, task_id: str) -> list[dict[str, Any]]:
    """Every record of ``task_id`` in the stream of ``app``'s store (the last 2,000), newest first."""
    client = get_store(app).client  # type: ignore[attr-defined]
    records = [json.loads(entry[b"record"]) for _, entry in client.xrevrange(STREAM, count=2000)]
    return [dict(record) for record in records if record["task_id"] == task_id]


def has_dead_letter(app: Any, task_id: str) -> bool:
    try:
        dead_letter_of(app, task_id)
    except AssertionError:
        return False
    return True
