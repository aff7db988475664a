"""A key's completion made on its own, asked again until the store answers: what a delivery does when the
completion sent as its body returned, or the one that was to ride its ack, got no answer. Made of values, not of
the task's request: the answer of the store's ack is read at the message's ack, after the delivery's hooks
(:mod:`celery_guardrails.guardrails.acks`), where the task runs another request or none.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from celery_guardrails.exceptions import StoreError

logger = logging.getLogger("celery_guardrails.guardrails.idempotency")  # the lines it logged before


@dataclass(frozen=True, slots=True, kw_only=True)
class Completing:
    """A completion to make: the key, its owner and what it keeps, the store, and for how long it is asked again
    (the claim's lease); the task's name and id for the log."""

    store: Any
    key: str
    owner: str
    summary: str
    #: Seconds the completed key is kept.
    retention: float
    #: Seconds the store is asked again, at most.
    lease: float
    task_name: str
    task_id: str


def taken_over(task_name: str, task_id: str, key: str) -> None:
    logger.warning(
        "Task %s[%s]: key %s was taken over before completion; the effect may have run twice", task_name, task_id, key
    )


def complete_alone(completing: Completing, error: BaseException) -> None:
    """A completion that was to ride the ack, made on its own (the ack could not carry it: ``error``); the worker
    acks afterwards."""
    done: bool | None
    logger.info(
        "Task %s[%s]: key %s completed without the ack (%s)",
        completing.task_name,
        completing.task_id,
        completing.key,
        error,
    )
    try:
        done = _complete(completing)
    except Exception as exc:  # whatever it is, the effect happened: asked again until the lease is over
        done = complete_when_back(completing, exc)
    if done is False:
        taken_over(completing.task_name, completing.task_id, completing.key)


def complete_when_back(completing: Completing, error: BaseException) -> bool | None:
    """Ask the store to complete the key until it answers (whether it did) or the lease is over (None)."""
    give_up_at = time.monotonic() + completing.lease
    pause = 0.1
    while True:
        logger.warning(
            "Task %s[%s]: key %s not completed yet (%s); asking the store again in %.1fs",
            completing.task_name,
            completing.task_id,
            completing.key,
            error,
            pause,
        )
        time.sleep(pause)
        try:
            return _complete(completing)
        except StoreError as exc:
            error = exc
        if time.monotonic() + pause > give_up_at:
            logger.error(
                "Task %s[%s]: key %s left claimed, its completion not recorded (%s): a duplicate arriving after its "
                "lease may run the effect again",
                completing.task_name,
                completing.task_id,
                completing.key,
                error,
            )
            return None
        pause = min(pause * 2, 5.0)


def _complete(completing: Completing) -> bool:
    return bool(
        completing.store.complete(
            completing.key,
            owner=completing.owner,
            now=time.time(),
            summary=completing.summary,
            retention=completing.retention,
        )
    )


__all__ = ["Completing", "complete_alone", "complete_when_back", "taken_over"]
