"""Jobs a user can poll, for code that runs where the job records are not: completions over the queue.

A worker that has no database credentials (a sandbox holding only the broker URL: a plain ``Celery(broker=...)``
app, no Django) reports that it finished a job's work with :func:`report_completion`. It publishes one message of
the task ``django_celery_guardrails.job_completion`` (:data:`COMPLETION_TASK`) on ``job_completion_queue``: the
job's id and the reference to its output as arguments, the tenant in the ``guardrails`` header
(:mod:`celery_guardrails.runtime.headers`) with a correlation id. The trusted consumer (the Django app registers
it: ``django_celery_guardrails.tasks``, see ``django_celery_guardrails.completions``) restores that tenant before
it reads, looks for the job among that tenant's jobs only, waits for a job not readable yet (``record_wait``, then
a dead letter ``record_missing``) and marks it ``succeeded`` with the output reference, once: a duplicate changes
nothing, a terminal job is not moved.

Run the consumer only where the job records are: ``job_completion_queue`` is a queue the sandboxed worker does not
consume (a worker without the consumer would take the message and drop it as an unregistered task).

The job states are those of :mod:`celery_guardrails.guardrails.jobs`, re-exported here.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from celery_guardrails.foundation.context import (
    current_correlation_id,
    new_correlation_id,
    tenant_context,
    validate_tenant,
)
from celery_guardrails.guardrails.jobs import (
    CANCELLED,
    DEAD_LETTERED,
    FAILED,
    QUEUED,
    RETRYING,
    RUNNING,
    STATES,
    SUCCEEDED,
    TERMINAL,
    WAITING,
)
from celery_guardrails.options import APP, Option, app_value, checks, declare
from celery_guardrails.runtime import headers

#: The name the trusted consumer of completions is registered under (the Django app's, named as its prune task: the
#: audit grades the project's tasks, not the extension's).
COMPLETION_TASK = "django_celery_guardrails.job_completion"
#: Characters of an output reference at most (the job record's column holds 500).
OUTPUT_REF_LIMIT = 500
#: Control characters (NUL among them) a database may refuse: an output reference never holds them.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: A queue name as Celery and the brokers take it.
_QUEUE = re.compile(r"[^\s\x00-\x1f\x7f]{1,255}")


def _queue(value: Any) -> str:
    if not isinstance(value, str) or not _QUEUE.fullmatch(value):
        raise ValueError(f"must be a queue name of 1 to 255 characters, no space or control one, got {value!r:.80}")
    return value


DECLARED = declare(
    Option(
        name="job_completion_queue",
        default=None,
        doc="The queue report_completion() publishes a job's completion on; only trusted workers (with the "
        "Django app and its database) may consume it. None: the publishing app's default queue "
        "(task_default_queue).",
        check=checks.optional(_queue),
        scopes=frozenset({APP}),
    ),
    Option(
        name="job_reader",
        default=None,
        doc="Django: a callable (or dotted path) (request, job) -> bool deciding who may read a job's status "
        "(JobStatusView); anything but True is a 404. None: the default rule of django_celery_guardrails.jobs "
        "(an authenticated user of the job's tenant, or staff who see that tenant in the admin).",
        check=checks.callable_or_path,
        scopes=frozenset({APP}),
    ),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """A job's completion as it travels: the job's id (a UUID, in its canonical text) and its output reference."""

    job_id: str
    output_ref: str


def checked_completion(job_id: Any, output_ref: Any) -> Completion:
    """The completion of ``job_id`` with ``output_ref``, checked: the id a UUID, the reference 1 to
    OUTPUT_REF_LIMIT characters with no control character; ValueError otherwise. Both ends check: the consumer
    cannot trust what a sandbox sent."""
    try:
        canonical = str(uuid.UUID(str(job_id)))
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"job id must be a UUID, got {job_id!r:.80}") from None
    if not isinstance(output_ref, str) or not 0 < len(output_ref) <= OUTPUT_REF_LIMIT:
        raise ValueError(f"output_ref must be a str of 1 to {OUTPUT_REF_LIMIT} characters, got {output_ref!r:.80}")
    if _CONTROL.search(output_ref):
        raise ValueError(f"output_ref may not hold control characters, got {output_ref!r:.80}")
    return Completion(job_id=canonical, output_ref=output_ref)


def report_completion(
    job_id: Any, *, output_ref: str, tenant: str | None, app: Any = None, queue: str | None = None
) -> Any:
    """Report that job ``job_id`` of ``tenant`` is done, its output at ``output_ref`` (a storage key, a URL: a
    reference, not the output). Needs only a broker: ``app`` (default: the current app) may be a plain
    ``Celery(broker=...)`` with no result backend, no database and no Django. The message goes to ``queue``, else
    ``job_completion_queue``, else the app's default queue; its AsyncResult is returned (the consumer's outcome
    is on the job, not in a result the sandbox can read).

    ``tenant`` is the job's tenant (None: a job without one); the consumer looks for the job among that tenant's
    only. ValueError for a job id that is not a UUID or a bad output reference,
    :class:`~celery_guardrails.exceptions.ContextError` for a tenant id that cannot travel: nothing is sent."""
    completion = checked_completion(job_id, output_ref)
    if tenant is not None:
        validate_tenant(tenant)
    if app is None:
        from celery import current_app

        app = current_app._get_current_object()
    target = queue or app_value(app, "job_completion_queue") or app.conf.task_default_queue
    header = headers.context(tenant=tenant, correlation_id=current_correlation_id() or new_correlation_id())
    # The tenant is the caller's word, not the context's: tenant_context(None) keeps a tenant of the code around
    # the call (another tenant's task) out of a completion for a job without one.
    with tenant_context(tenant):
        return app.send_task(
            COMPLETION_TASK,
            args=(completion.job_id,),
            kwargs={"output_ref": completion.output_ref},
            queue=target,
            headers={headers.HEADER: header},
        )


__all__ = [
    "CANCELLED",
    "COMPLETION_TASK",
    "DEAD_LETTERED",
    "DECLARED",
    "FAILED",
    "OUTPUT_REF_LIMIT",
    "QUEUED",
    "RETRYING",
    "RUNNING",
    "STATES",
    "SUCCEEDED",
    "TERMINAL",
    "WAITING",
    "Completion",
    "checked_completion",
    "report_completion",
]
