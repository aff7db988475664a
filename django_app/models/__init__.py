"""Models of the guardrails app (app label ``guardrails``), one module per feature.

The modules are named as the Django store's (:mod:`django_celery_guardrails.store`), which mirror the Redis
store's files: :mod:`.budgets`, :mod:`.idempotency`, :mod:`.poison`, :mod:`.alerts`, :mod:`.ledger`,
:mod:`.checkpoint`, :mod:`.ordering`, :mod:`.slots`, :mod:`.activity` and :mod:`.waiting` hold the store's
tables; :mod:`.dead_letters`, :mod:`.outbox`, :mod:`.jobs` and :mod:`.dashboard` hold the app's own. Every model
is imported here, so ``from django_celery_guardrails.models import DeadLetter`` works and Django finds them all.
"""

from __future__ import annotations

# Imported in the order the models were declared in when they shared one module: Django registers a model as its
# class is made, and that order is the app's (apps.get_models(), hence the order its permissions are created in).
# isort: off
from .budgets import DependencyState
from .idempotency import IdempotencyKey, ProcessedMessage
from .dead_letters import DeadLetter, SealedMessage
from .poison import DeliveryCounter
from .alerts import AlertThrottle
from .ledger import ScheduledRun
from .checkpoint import Checkpoint
from .ordering import OrderingSequence
from .slots import ConcurrencyKey, ConcurrencySlot
from .dashboard import Dashboard
from .activity import ActivityBatch, ActivityCount, QueueSample
from .outbox import OutboxMessage
from .waiting import WaitingMessage
from .jobs import Job

# isort: on

__all__ = [
    "ActivityBatch",
    "ActivityCount",
    "AlertThrottle",
    "Checkpoint",
    "ConcurrencyKey",
    "ConcurrencySlot",
    "Dashboard",
    "DeadLetter",
    "DeliveryCounter",
    "DependencyState",
    "IdempotencyKey",
    "Job",
    "OrderingSequence",
    "OutboxMessage",
    "ProcessedMessage",
    "QueueSample",
    "ScheduledRun",
    "SealedMessage",
    "WaitingMessage",
]
