"""Retry budgets and circuit breakers in the Django database (the budget half of the Django store, mixed in).

One row per dependency (:class:`~django_celery_guardrails.models.DependencyState`), changed under its row lock
(``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite serialises writers): each operation is one transaction that
applies the rules of :mod:`celery_guardrails.stores.base` as they are. It mirrors the budget half of
``celery_guardrails/stores/redis.py`` (``RedisStore.admit``, ``record_outcome``, ``budget_status``, ``reset``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

from django.db import DatabaseError, transaction

from celery_guardrails.stores.base import (
    Admission,
    BudgetPolicy,
    DependencyState,
    decide_admission,
    decide_outcome,
    status,
)

from ..models import DependencyState as Row
from .database import failure, translated

_FIELDS = [f.name for f in fields(DependencyState)]
T = TypeVar("T")


def _state(row: Row) -> DependencyState:
    return DependencyState(**{name: getattr(row, name) for name in _FIELDS})


def _save(row: Row, state: DependencyState) -> None:
    for name in _FIELDS:
        setattr(row, name, getattr(state, name))
    row.save()


class DjangoBudgets:
    """The budget and circuit operations of :class:`~django_celery_guardrails.store.DjangoStore` (mixed in)."""

    def _change(self, dependency: str, rule: Callable[[DependencyState], T]) -> T:
        """Apply ``rule`` to the dependency's state under its row lock; save; return what the rule said."""
        try:
            with transaction.atomic():
                row = Row.objects.locked(dependency)
                state = _state(row)
                result = rule(state)
                _save(row, state)
        except DatabaseError as exc:
            raise failure(f"change the state of {dependency!r}", exc) from exc
        return result

    def admit(self, dependency: str, policy: BudgetPolicy, *, retry: bool, now: float) -> Admission:
        return self._change(dependency, lambda state: decide_admission(state, policy, retry=retry, now=now))

    def record_outcome(self, dependency: str, policy: BudgetPolicy, *, outcome: str, now: float) -> bool:
        return self._change(dependency, lambda state: decide_outcome(state, policy, outcome=outcome, now=now))

    @translated("read a dependency's state")
    def budget_status(self, dependency: str, policy: BudgetPolicy, *, now: float) -> dict[str, Any]:
        row = Row.objects.filter(dependency=dependency).first()
        return status(dependency, _state(row) if row else DependencyState(), policy, now)

    @translated("reset a dependency")
    def reset(self, dependency: str) -> None:
        Row.objects.filter(dependency=dependency).delete()
