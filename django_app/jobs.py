"""Jobs a user can poll, in a Django project: the 202 that hands a job over, and its status view.

* :func:`accepted`: the answer of a view that submitted a job: ``202 Accepted``, ``Location`` the job's status
  URL, a small JSON body (``id``, ``state``, ``status_url``).
* :class:`JobStatusView` (``guardrails/jobs/<id>/``, name ``guardrails:job-status``, served by
  ``include("django_celery_guardrails.urls")``): the job as JSON, to whoever may read it (:func:`may_read`) and
  a 404 to anyone else, exactly as for a job that does not exist. While the job is not terminal the answer is
  ``Cache-Control: no-store`` with a ``Retry-After`` hint (:func:`retry_after`); a terminal one is cacheable
  (private, :data:`FINAL_MAX_AGE` or :data:`REPLAYABLE_MAX_AGE`) with an ``ETag``.

The trusted consumer of :func:`celery_guardrails.jobs.report_completion` is in :mod:`.completions`.
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.cache import get_conditional_response
from django.views import View

from celery_guardrails.foundation.context import current_tenant
from celery_guardrails.guardrails.jobs import CANCELLED, RETRYING, RUNNING, SUCCEEDED, TERMINAL, WAITING
from celery_guardrails.options import django_settings, load

from .job_book import DjangoJobBook, hand_off, iso
from .models import Job
from .scoping import may_see

logger = logging.getLogger(__name__)

#: The URL name of the status view (in the app's namespace, ``guardrails``).
STATUS_URL_NAME = "guardrails:job-status"
#: Retry-After of a running job, in seconds (its progress moves).
RUNNING_RETRY_AFTER = 1
#: Retry-After of a queued job, and of a waiting or retrying one whose due time is unknown, in seconds.
QUEUED_RETRY_AFTER = 2
#: Retry-After at most, in seconds: a job due in an hour is still polled, so a cancel or a replay shows.
MAX_RETRY_AFTER = 60
#: Cache lifetime of a job that no path moves again (succeeded, cancelled), in seconds.
FINAL_MAX_AGE = 3600
#: Cache lifetime of a failed or dead-lettered job, in seconds: a replay moves it back to queued.
REPLAYABLE_MAX_AGE = 60

__all__ = [
    "DjangoJobBook",
    "JobStatusView",
    "accepted",
    "default_reader",
    "hand_off",
    "may_read",
    "retry_after",
    "status",
]


def status_url(job: Any) -> str:
    """The path of ``job``'s status view; ImproperlyConfigured when the app's URLs are not included."""
    try:
        return reverse(STATUS_URL_NAME, kwargs={"id": job.pk})
    except NoReverseMatch:
        raise ImproperlyConfigured(
            'The job status view has no URL: add path("guardrails/", include("django_celery_guardrails.urls")) '
            "to the project's urls"
        ) from None


def accepted(job: Any, *, request: HttpRequest | None = None) -> JsonResponse:
    """``202 Accepted`` for ``job``: ``Location`` its status URL (absolute when ``request`` is given), the body
    ``{"id", "state", "status_url"}``. Never cached: the next answer about the job is the status view's."""
    url = status_url(job)
    if request is not None:
        url = request.build_absolute_uri(url)
    response = JsonResponse({"id": str(job.pk), "state": job.state, "status_url": url}, status=202)
    response["Location"] = url
    response["Retry-After"] = str(QUEUED_RETRY_AFTER)
    response["Cache-Control"] = "no-store"
    return response


# Who may read a job.


def default_reader(request: HttpRequest, job: Any) -> bool:
    """The rule when ``job_reader`` is unset: an active, authenticated user, and either the request's tenant
    (``tenant_resolver``, set by GuardrailsContextMiddleware) is the job's (no tenant reads a job without one),
    or the user is staff with ``guardrails.view_job`` who sees the job's tenant in the admin (``admin_tenants``:
    with it unset, every tenant; with ``"permissions"``, ``guardrails.view_all_tenants`` or the tenant's own)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated or not user.is_active:
        return False
    if (current_tenant() or "") == job.tenant:
        return True
    return bool(user.is_staff and user.has_perm("guardrails.view_job") and may_see(user, job.tenant))


def may_read(request: HttpRequest, job: Any) -> bool:
    """Whether the request may read ``job``: ``job_reader(request, job)`` returns True (anything else, or an
    error, is no: logged, never a 500 that would tell the job exists), else :func:`default_reader`."""
    configured = django_settings().get("job_reader")
    if configured is None:
        return default_reader(request, job)
    try:
        return load(configured)(request, job) is True
    except Exception:
        logger.exception("job_reader %s failed for job %s: not readable", configured, job.pk)
        return False


# The status.


def status(job: Any) -> dict[str, Any]:
    """What the status view answers about ``job`` (JSON values)."""
    return {
        "id": str(job.pk),
        "task": job.task_name,
        "state": job.state,
        "terminal": job.state in TERMINAL,
        "attempt": job.attempt,
        "progress": {"done": job.progress_done, "total": job.progress_total},
        "detail": job.detail,
        "error": job.error,
        "output_ref": job.output_ref,
        "submitted_at": iso(job.created_at),
        "started_at": iso(job.started_at),
        "updated_at": iso(job.updated_at),
        "finished_at": iso(job.finished_at),
        "due_at": iso(job.due_at),
    }


def retry_after(job: Any, *, now: Any = None) -> int | None:
    """Seconds a client should wait before it polls ``job`` again (None: terminal, no need): a waiting or
    retrying job until it is due (1 to MAX_RETRY_AFTER s), a running one RUNNING_RETRY_AFTER, otherwise
    QUEUED_RETRY_AFTER."""
    if job.state in TERMINAL:
        return None
    if job.state in (WAITING, RETRYING) and job.due_at is not None:
        left: float = (job.due_at - (now or timezone.now())).total_seconds()
        return max(1, min(MAX_RETRY_AFTER, math.ceil(left)))
    return RUNNING_RETRY_AFTER if job.state == RUNNING else QUEUED_RETRY_AFTER


def _etag(job: Any) -> str:
    seen = f"{job.pk}|{job.state}|{iso(job.updated_at)}|{job.output_ref}|{job.progress_done}|{job.attempt}"
    return '"' + hashlib.sha256(seen.encode()).hexdigest()[:32] + '"'


class JobStatusView(View):
    """``GET guardrails/jobs/<id>/``: the job as JSON (:func:`status`) to whoever :func:`may_read` it; a 404 to
    anyone else, the same as for an id that does not exist (a job's existence does not leak)."""

    http_method_names = ["get", "head", "options"]

    def get(self, request: HttpRequest, id: Any) -> HttpResponse:
        job = Job.objects.filter(pk=id).first()
        if job is None or not may_read(request, job):
            raise Http404("No job matches the given query.")
        wait = retry_after(job)
        if wait is not None:
            response = JsonResponse(status(job))
            response["Cache-Control"] = "no-store"
            response["Retry-After"] = str(wait)
            return response
        # Terminal: final, cacheable by this user's client only (it was read under their rights). A failed or
        # dead-lettered job may still be replayed, so it is cached briefly.
        max_age = FINAL_MAX_AGE if job.state in (SUCCEEDED, CANCELLED) else REPLAYABLE_MAX_AGE
        etag = _etag(job)
        final: HttpResponse = get_conditional_response(request, etag=etag) or JsonResponse(status(job))
        final["ETag"] = etag
        final["Cache-Control"] = f"private, max-age={max_age}"
        return final
