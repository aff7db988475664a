"""The Django database store (``store="django"``): the ``guardrails`` app's tables, one module per feature.

:class:`DjangoStore` is composed of one mixin per feature, as
:class:`~celery_guardrails.stores.redis.RedisStore` is (``celery_guardrails/stores/redis.py`` and its
``redis_*.py`` files): :mod:`.budgets` (retry budgets and circuits), :mod:`.idempotency` (keys and publish
reservations), :mod:`.poison` (delivery counts), :mod:`.alerts` (alert throttles), :mod:`.ledger` (the run
ledger), :mod:`.checkpoint`, :mod:`.ordering`, :mod:`.slots` (concurrency slots), :mod:`.activity` and
:mod:`.waiting`; :mod:`.database` holds what they share (database errors raised as the store's own, times).

A budget operation is one transaction that locks the dependency's row (``SELECT ... FOR UPDATE`` on PostgreSQL;
SQLite serialises writers) and applies the rules of :mod:`celery_guardrails.stores.base` as they are. On SQLite
with several worker processes, set ``"OPTIONS": {"transaction_mode": "IMMEDIATE"}`` (Django 5.1+) so concurrent
transactions wait for the lock instead of failing with "database is locked". Idempotency keys and the run
ledger take no lock: a unique INSERT and conditional UPDATEs (see their modules).
"""

from __future__ import annotations

from django.db import connection

from .activity import DjangoActivity
from .alerts import DjangoAlertThrottles
from .budgets import DjangoBudgets
from .checkpoint import DjangoCheckpoints
from .database import failure, translated
from .idempotency import DjangoIdempotency
from .ledger import DjangoRunLedger
from .ordering import DjangoOrdering
from .poison import DjangoDeliveryCounts
from .slots import DjangoSlots
from .waiting import DjangoWaiting

__all__ = ["DjangoStore", "failure", "translated"]


class DjangoStore(
    DjangoBudgets,
    DjangoIdempotency,
    DjangoDeliveryCounts,
    DjangoAlertThrottles,
    DjangoRunLedger,
    DjangoCheckpoints,
    DjangoOrdering,
    DjangoSlots,
    DjangoActivity,
    DjangoWaiting,
):
    """Store in the Django database (the ``guardrails`` app's tables)."""

    def close_thread(self) -> None:
        """A helper thread (the heartbeat) is done: close its own database connection."""
        connection.close()
