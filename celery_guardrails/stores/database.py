"""The store's error a Django database error stands for: shared by the Django store (``django_celery_guardrails``)
and the core's own database work (an ``atomic`` key's transaction, a checkpoint's chunk, the Django dead-letter
sink), so that the core reads a database failure without importing the Django app.

Django is imported when a database error is translated, never at import (the core runs without Django).
"""

from __future__ import annotations

from celery_guardrails.exceptions import StoreError, StoreUnavailableError


def failure(what: str, exc: BaseException) -> StoreError:
    """The store's error for a database error: unavailable when the database cannot be reached or used now
    (a lost or refused connection, a locked SQLite file: OperationalError, InterfaceError), refused for an
    error about the data (DataError, IntegrityError, ProgrammingError)."""
    from django.db import InterfaceError, OperationalError

    if isinstance(exc, OperationalError | InterfaceError):
        return StoreUnavailableError(f"Django store could not {what}: {exc}")
    return StoreError(f"Django store refused to {what}: {exc}")
