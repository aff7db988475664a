"""What every part of the Django store shares: database errors raised as the store's own, and times.

A database error becomes :class:`~celery_guardrails.exceptions.StoreUnavailableError` when the database cannot
be reached or used now, :class:`~celery_guardrails.exceptions.StoreError` when it refuses the data (the rule is
the core's, :func:`celery_guardrails.stores.database.failure`, which the core's own database work uses too); the store
keeps epoch seconds (floats) where the tables keep aware datetimes. It mirrors ``failure()`` in
``celery_guardrails/stores/redis.py`` and the connection helpers of ``celery_guardrails/stores/redis_client.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import UTC, datetime
from typing import ParamSpec, TypeVar

from django.db import DatabaseError

from celery_guardrails.exceptions import StoreUnavailableError
from celery_guardrails.stores.database import failure

from ..signals import drop_broken_connections

__all__ = ["failure", "to_datetime", "to_seconds", "translated"]

T = TypeVar("T")
P = ParamSpec("P")


def translated(what: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Every database error of the decorated operation raised as the store's own (see :func:`failure`)."""

    def decorate(operation: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(operation)
        def run(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return operation(*args, **kwargs)
            except DatabaseError as exc:
                error = failure(what, exc)
                if isinstance(error, StoreUnavailableError):
                    drop_broken_connections()  # kept by CELERY_DB_REUSE_MAX, it would fail every task after
                raise error from exc

        return run

    return decorate


def to_datetime(seconds: float) -> datetime:
    """The aware (UTC) datetime of epoch ``seconds``, as the tables keep times."""
    return datetime.fromtimestamp(seconds, UTC)


def to_seconds(moment: datetime | None) -> float | None:
    """Epoch seconds of a table's time (None stays None)."""
    return None if moment is None else moment.timestamp()
