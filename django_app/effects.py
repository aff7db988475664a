"""Effect-side helpers: make the effect itself refuse to happen twice.

The idempotency key guards the task; these guard the effect, inside the same transaction as it:

* :func:`transition` moves a row from one state to another with a conditional UPDATE and says whether this
  call made the change (``paid`` only from ``pending``: a second delivery changes nothing).
* :func:`mark_processed` records a message key in :class:`~django_celery_guardrails.models.ProcessedMessage`;
  a second delivery finds it there. For handlers with no natural unique key.

The natural-key pattern needs no helper: a unique constraint on what must exist once (``UniqueConstraint(
fields=["order", "kind"])``) and ``get_or_create`` / ``IntegrityError`` handling.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, models, transaction

from .models import ProcessedMessage


def transition(queryset: models.QuerySet[Any], field: str, from_: Any, to: Any, **also: Any) -> bool:
    """``UPDATE ... SET field = to WHERE field = from_``, on ``queryset``; True when a row changed here."""
    return bool(queryset.filter(**{field: from_}).update(**{field: to}, **also))


def mark_processed(key: str) -> bool:
    """Record ``key`` as processed; False when it was already (call it inside the effect's transaction)."""
    try:
        with transaction.atomic():
            ProcessedMessage.objects.create(key=key)
    except IntegrityError:
        return False
    return True
