"""Celery tasks of the guardrails app (found by ``app.autodiscover_tasks()``)."""

from __future__ import annotations

from celery import shared_task

from .maintenance import prune


def prune_task() -> dict[str, int]:
    """Delete idempotency keys and processed-message records past their retention.

    Schedule it with beat, e.g. daily::

        CELERY_BEAT_SCHEDULE = {"guardrails-prune": {"task": "django_celery_guardrails.prune",
                                                     "schedule": crontab(hour=3, minute=17)}}
    """
    return prune()


prune_task = shared_task(name="django_celery_guardrails.prune")(prune_task)
