"""A key written with its effect: the claim of an ``atomic`` task on the Django store's PostgreSQL, made as the
first statement of the body's own transaction (part of :mod:`celery_guardrails.guardrails.idempotency`).

A claim made apart costs a statement and a commit before the body, and a second statement in the body's
transaction to complete it. Here the key is written *completed* in the body's transaction, before the body: it
commits with the effect or is rolled back with it, so it needs no lease, no heartbeat and no completion. While
the transaction runs, no other delivery can see the row; a transaction-level advisory lock on the key (taken in
the same statement) tells a concurrent delivery that it is held, without waiting on the row: that one comes back
later (``RetryLater``), as it does behind any live claim. A key that exists already (completed, failed, or claimed
the usual way) is claimed the usual way, after this transaction ends with nothing written. A claim made the usual
way while such a transaction runs (a job's delivery of the same key, say) waits on the row until it ends.

What it changes: a worker that dies in the body leaves no claim behind (its transaction is rolled back with the
connection): the next delivery claims the key at once. A final failure writes the key failed afterwards, in a
statement of its own (the effect and the key rolled back together). The key keeps no summary of the result (it is
written before the body returns): a duplicate returns the original's result while the result backend keeps it.

Where: the Django store on PostgreSQL, ``atomic=True``, outside a caller's transaction (a task run inside one,
``apply()`` in a test, claims the usual way), for a delivery no later guardrail acts on before its body (no job, no
scheduled period, no concurrency or exclusive key): those decide about a delivery after its key is claimed.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, cast

from celery_guardrails.guardrails.concurrency import NAMESPACES
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import view

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask
    from celery_guardrails.stores.base import Claim, Store


class WritesWithTheEffect(Protocol):
    """A store that writes a key in the effect's own transaction (the Django store on PostgreSQL)."""

    def written_with_the_effect(self, key: str, *, owner: str, now: float) -> AbstractContextManager[Claim | None]:
        """The body's transaction, its first statement the key written completed: ACQUIRED, BUSY or None (it
        exists)."""

    def fail_with_the_effect(self, key: str, *, owner: str, now: float, reason: str) -> bool:
        """The key written failed after its effect was rolled back; False when a row is there or being written."""


def effect_store(store: Store) -> WritesWithTheEffect:
    """``store``, which :func:`with_the_effect` found able to write a key with the effect."""
    return cast(WritesWithTheEffect, store)


def with_the_effect(task: GuardedTask, store: Store) -> bool:
    """Whether this delivery's key is claimed in its body's transaction (see the module docstring)."""
    seen = view(task)
    options = seen.options
    if not options["atomic"] or not hasattr(store, "written_with_the_effect"):
        return False
    header = seen.header
    if headers.job_id(header) is not None or (headers.SCHEDULE in header and headers.PERIOD in header):
        return False
    if any(options[option] is not None for option, _ in NAMESPACES):
        return False
    from django.db import connection

    return connection.vendor == "postgresql" and not connection.in_atomic_block
