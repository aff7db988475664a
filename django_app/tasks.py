"""Celery tasks of the guardrails app (found by ``app.autodiscover_tasks()``)."""

from __future__ import annotations

from celery import shared_task

from celery_guardrails import GuardedTask
from celery_guardrails.jobs import COMPLETION_TASK

from .maintenance import prune


def prune_task() -> dict[str, int]:
    """Delete idempotency keys and processed-message records past their retention.

    Schedule it with beat, e.g. daily::

        CELERY_BEAT_SCHEDULE = {"guardrails-prune": {"task": "django_celery_guardrails.prune",
                                                     "schedule": crontab(hour=3, minute=17)}}
    """
    return prune()


prune_task = shared_task(name="django_celery_guardrails.prune")(prune_task)


def job_completion(self: GuardedTask, job_id: str, output_ref: str) -> str:
    """Apply a completion sent with ``celery_guardrails.jobs.report_completion`` (see
    :func:`django_celery_guardrails.completions.apply_completion`): "applied", "duplicate" or "ignored"."""
    from .completions import apply_completion

    return apply_completion(job_id, output_ref=output_ref)


job_completion = shared_task(
    base=GuardedTask,
    bind=True,
    name=COMPLETION_TASK,
    # Applying a completion twice changes nothing (the job's row is read and written locked): safe to run again.
    # The key skips a duplicate before any read; it is scoped by the message's tenant, so another tenant's
    # completion for the same id (never applied) does not fail the key of the job's own.
    idempotent=True,
    idempotency_key="job-completion:{job_id}",
)(job_completion)
