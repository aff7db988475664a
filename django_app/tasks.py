"""Celery tasks of the guardrails app (found by ``app.autodiscover_tasks()``)."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from celery_guardrails import GuardedTask, PermanentError
from celery_guardrails.jobs import COMPLETION_TASK

from .bulk import TASK as BULK_TASK
from .bulk import Matching, run
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


def bulk_dead_letters(
    self: GuardedTask,
    action: str,
    matching: dict[str, Any],
    user_id: int | None = None,
    allow_not_idempotent: bool = False,
) -> dict[str, Any]:
    """Replay, discard or resolve every open dead letter ``matching`` takes, as a job with its progress; stops
    between batches when the job's cancel is asked (see :mod:`django_celery_guardrails.bulk`). Submitted by
    :func:`django_celery_guardrails.bulk.start`."""
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.filter(pk=user_id).first() if user_id is not None else None
    if user_id is not None and user is None:
        raise PermanentError(f"user {user_id} is gone: a bulk action runs with its asker's permissions only")
    result = run(
        action,
        Matching.from_dict(matching),
        user=user,
        allow_not_idempotent=allow_not_idempotent,
        progress=self.job.progress,
        stop=self.job.cancel_requested,
    )
    return result.to_dict()


bulk_dead_letters = shared_task(
    base=GuardedTask,
    bind=True,
    name=BULK_TASK,
    # Every step is conditional (a record moves from open once, a replay claims it first): run again after a
    # crash, it acts on what is still open.
    idempotent=True,
)(bulk_dead_letters)
