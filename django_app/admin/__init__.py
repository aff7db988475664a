"""Django admin: dead letters (inspect, replay, discard, resolve) and the run ledger (read only, with the
schedule-health page, see :mod:`django_celery_guardrails.health`), the internal tables, the dashboard and the
Waiting page. Importing this package (Django's admin autodiscovery imports ``django_celery_guardrails.admin``)
registers every one of them; each lives in its own module:

- :mod:`.dead_letters`: the dead letters' change list, record page and overview;
- :mod:`.dead_letter_actions`: their actions (replay, discard, resolve) and the replay, edit-and-replay pages;
- :mod:`.scheduled_runs`: the run ledger and the schedule-health page;
- :mod:`.jobs`: the jobs (``task.submit()``), read only, and their action "Cancel selected jobs";
- :mod:`.tables`: idempotency keys, concurrency slots, the outbox, the dependencies' states;
- :mod:`.pages`: the dashboard and Waiting pages, in place of a change list;
- :mod:`.common`: how every page shows a long value and a tenant.

Every action that changes records checks its own permission (``guardrails.replay_deadletter``,
``discard_deadletter``, ``resolve_deadletter``; 403 without it), asks for confirmation first, writes one
LogEntry per record and reports with ``message_user``, the way Django's ``delete_selected`` does; the work
itself lives in :mod:`django_celery_guardrails.replay` and :func:`~..maintenance.close_dead_letters`, which
tests call directly. "Select all N" in the change list applies an action to everything the current filter
matches. "Edit and replay" fixes one record's tenant or arguments before replaying it. Records and internal
tables are read only (no Add, no Save); replay is offered only to users who may replay.

A replay whose records include ``not_idempotent`` ones (their task may already have acted before it failed) says
so on its confirmation page, lists them with the note of their last attempt, and replays them only when its
unticked box ("I checked that the effect did not happen") is ticked; without it the others are replayed and
these are reported not replayed, like any other refusal.
"""

from __future__ import annotations

# In the order the single module registered them (the index sorts them by name anyway).
from .dead_letter_actions import (
    ALLOW_NOT_IDEMPOTENT,
    ALLOWED_NOTE,
    LOG_BATCH,
    LOGGED,
    NOT_IDEMPOTENT_SHOWN,
    DeadLetterActions,
)
from .dead_letters import DeadLetterAdmin
from .jobs import JobAdmin
from .pages import DashboardAdmin, PageAdmin, WaitingAdmin
from .scheduled_runs import ScheduledRunAdmin
from .tables import EPOCH_FIELDS, ConcurrencySlotAdmin, DependencyStateAdmin, IdempotencyKeyAdmin, OutboxMessageAdmin

__all__ = [
    "ALLOWED_NOTE",
    "ALLOW_NOT_IDEMPOTENT",
    "EPOCH_FIELDS",
    "LOGGED",
    "LOG_BATCH",
    "NOT_IDEMPOTENT_SHOWN",
    "ConcurrencySlotAdmin",
    "DashboardAdmin",
    "DeadLetterActions",
    "DeadLetterAdmin",
    "DependencyStateAdmin",
    "IdempotencyKeyAdmin",
    "JobAdmin",
    "OutboxMessageAdmin",
    "PageAdmin",
    "ScheduledRunAdmin",
    "WaitingAdmin",
]
