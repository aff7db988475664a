"""Dead letters in the Redis stream sink (the sink of workers without Django), as a test reads them."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery_guardrails import signals
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


@contextmanager
def held_once_recorded(task_id: str, *, timeout: float) -> Iterator[threading.Event]:
    """While the block runs, the worker that fails ``task_id`` finally waits once its dead letter is durable
    (``final_failure``), before the rest of its failure (the key written failed, Celery's ``on_failure``): the
    window a replay made at once falls into. Yields the event set when the worker got there."""
    recorded, released = threading.Event(), threading.Event()

    def hold(sender: Any = None, failure: Any = None, **_: Any) -> None:
        if failure.task_id == task_id:
            recorded.set()
            released.wait(timeout)

    signals.final_failure.connect(hold, weak=False)
    try:
        yield recorded
    finally:
        released.set()
        signals.final_failure.disconnect(hold)
