"""Effect-side helpers: make the effect itself refuse to happen twice.

The idempotency key guards the task; these guard the effect, inside the same transaction as it:

* :func:`transition` moves a row from one state to another with a conditional UPDATE and says whether this
  call made the change (``paid`` only from ``pending``: a second delivery changes nothing).
* :func:`mark_processed` records a message key in :class:`~django_celery_guardrails.models.ProcessedMessage`;
  a second delivery finds it there. For handlers with no natural unique key.

Both are fenced: in a body holding a concurrency slot (``concurrency_key`` / ``exclusive_key``) they first
check, in the same transaction as the change, that the slot is still this delivery's; a holder whose slot was
reaped while it stalled changes nothing (:class:`~celery_guardrails.exceptions.SlotLostError`). On the Django
store the check locks the slot's row until the transaction ends, so the reaper waits for the change to commit
or roll back.

The natural-key pattern needs no helper: a unique constraint on what must exist once (``UniqueConstraint(
fields=["order", "kind"])``) and ``get_or_create`` / ``IntegrityError`` handling.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, models, transaction

from celery_guardrails.guardrails.concurrency import fence_running

from .models import ProcessedMessage


def transition(queryset: models.QuerySet[Any], field: str, from_: Any, to: Any, **also: Any) -> bool:
    """``UPDATE ... SET field = to WHERE field = from_``, on ``queryset``; True when a row changed here."""
    with transaction.atomic(using=queryset.db):
        fence_running("transition")
        return bool(queryset.filter(**{field: from_}).update(**{field: to}, **also))


def mark_processed(key: str) -> bool:
    """Record ``key`` as processed; False when it was already (call it inside the effect's transaction)."""
    try:
        with transaction.atomic():
            fence_running("mark_processed")
            ProcessedMessage.objects.create(key=key)
    except IntegrityError:
        return False
    return True
