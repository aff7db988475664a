"""The trusted consumer of completions over the queue (:func:`celery_guardrails.jobs.report_completion`): the
task ``django_celery_guardrails.job_completion`` (:mod:`.tasks`) applies each with :func:`apply_completion`.

* The tenant is the message's, restored before the body reads anything (context propagation); the job is looked
  for among that tenant's jobs only, so a completion never reaches another tenant's job: one that names another
  tenant's job finds nothing, as one whose job is not committed yet, and ends the same way.
* A job not there (yet) is waited for with ``require()``: 1, 2, 4, ... s, spending no attempt, for at most
  ``record_wait``, then a dead letter ``record_missing`` naming the lookup.
* A job not terminal becomes ``succeeded`` with the output reference (its row locked). A duplicate (already
  ``succeeded`` with that reference) changes nothing. A terminal job is not moved: a completion for a
  ``cancelled``, ``failed`` or ``dead_lettered`` job, or a second one with another reference, is ignored and
  logged (a warning with the ids); the job's record says what the user was told.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.utils import timezone

from celery_guardrails.foundation.context import current_tenant
from celery_guardrails.guardrails.jobs import SUCCEEDED, TERMINAL
from celery_guardrails.guardrails.records import require
from celery_guardrails.jobs import checked_completion

from .models import Job

logger = logging.getLogger(__name__)

#: The detail written with a completion's succeeded.
COMPLETED_DETAIL = "completion reported"
#: What apply_completion answers.
APPLIED, DUPLICATE, IGNORED = "applied", "duplicate", "ignored"


def apply_completion(job_id: Any, *, output_ref: Any) -> str:
    """Apply a completion of job ``job_id`` of the current tenant (the message's, restored before the body):
    ``"applied"`` (now ``succeeded`` with ``output_ref``), ``"duplicate"`` (it already was, with this output: no
    change), or ``"ignored"`` (logged: a terminal job is not moved by a completion: ``cancelled``, ``failed``,
    ``dead_lettered``, or ``succeeded`` with another output, the first one kept).

    The job is looked for among the current tenant's jobs only: one of another tenant is not there, as one not
    committed yet is not: :class:`~celery_guardrails.exceptions.RecordNotThereYet` (the message waits for up to
    ``record_wait``, then is dead-lettered ``record_missing``). ValueError for a malformed id or reference."""
    checked = checked_completion(job_id, output_ref)
    job_id, output_ref = checked.job_id, checked.output_ref
    tenant = current_tenant()
    # A plain read first (no write lock held while the job may not be committed yet, and none for a duplicate).
    job = require(Job.objects.of_tenant(tenant), pk=job_id)
    if job.state == SUCCEEDED and job.output_ref == output_ref:
        logger.info("Job %s: completion %s again, already applied", job_id, output_ref)
        return DUPLICATE
    with transaction.atomic():
        job = Job.objects.of_tenant(tenant).select_for_update().get(pk=job_id)
        if job.state == SUCCEEDED and job.output_ref == output_ref:
            return DUPLICATE
        if job.state in TERMINAL:
            logger.warning(
                "Job %s (tenant %s) is %s: its completion with output %s is ignored",
                job_id,
                tenant or "-",
                job.state,
                output_ref,
            )
            return IGNORED
        now = timezone.now()
        job.output_ref = output_ref
        job.error = ""
        job.due_at = None
        job.record(SUCCEEDED, detail=COMPLETED_DETAIL, now=now)
        job.save()
    logger.info("Job %s (tenant %s) succeeded: completion with output %s", job_id, tenant or "-", output_ref)
    return APPLIED
