"""The Django database store (``store="django"``): one row per dependency, changed under a row lock.

Each operation is one transaction that locks the dependency's row (``SELECT ... FOR UPDATE`` on
PostgreSQL; SQLite serialises writers) and applies the rules of :mod:`celery_guardrails.stores.base`
as they are. On SQLite with several worker processes, set ``"OPTIONS": {"transaction_mode": "IMMEDIATE"}``
(Django 5.1+) so concurrent transactions wait for the lock instead of failing with "database is locked".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

from django.db import DatabaseError, transaction

from celery_guardrails.exceptions import StoreError
from celery_guardrails.stores.base import (
    Admission,
    BudgetPolicy,
    DependencyState,
    decide_admission,
    decide_outcome,
    status,
)

from .models import DependencyState as Row

_FIELDS = [f.name for f in fields(DependencyState)]
T = TypeVar("T")


def _state(row: Row) -> DependencyState:
    return DependencyState(**{name: getattr(row, name) for name in _FIELDS})


def _save(row: Row, state: DependencyState) -> None:
    for name in _FIELDS:
        setattr(row, name, getattr(state, name))
    row.save()


class DjangoStore:
    """Store in the Django database (the ``guardrails`` app's tables)."""

    def _change(self, dependency: str, rule: Callable[[DependencyState], T]) -> T:
        """Apply ``rule`` to the dependency's state under its row lock; save; return what the rule said."""
        try:
            with transaction.atomic():
                row = Row.objects.locked(dependency)
                state = _state(row)
                result = rule(state)
                _save(row, state)
        except DatabaseError as exc:
            raise StoreError(f"Django store failed for {dependency!r}: {exc}") from exc
        return result

    def admit(self, dependency: str, policy: BudgetPolicy, *, retry: bool, now: float) -> Admission:
        return self._change(dependency, lambda state: decide_admission(state, policy, retry=retry, now=now))

    def record_outcome(self, dependency: str, policy: BudgetPolicy, *, failed: bool, now: float) -> bool:
        return self._change(dependency, lambda state: decide_outcome(state, policy, failed=failed, now=now))

    def budget_status(self, dependency: str, policy: BudgetPolicy, *, now: float) -> dict[str, Any]:
        row = Row.objects.filter(dependency=dependency).first()
        return status(dependency, _state(row) if row else DependencyState(), policy, now)

    def reset(self, dependency: str) -> None:
        Row.objects.filter(dependency=dependency).delete()
