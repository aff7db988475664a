"""Views of the test project (tests/testapp/urls.py): a view that submits a job and answers 202, the way a
project's would; job readers for the ``job_reader`` option."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_POST

from django_celery_guardrails.jobs import accepted


@require_POST
def submit_report(request: HttpRequest) -> HttpResponse:
    """Submit a report job (tests.proj.django_tasks.build_report) and answer 202 with its status URL."""
    from tests.proj import django_tasks

    options: dict[str, Any] = {"hold": float(request.POST.get("hold", 0))}
    job = django_tasks.build_report.submit(request.POST["name"], request.POST["sink"], **options)
    return accepted(job, request=request)


def reader_by_header(request: HttpRequest, job: Any) -> bool:
    """A job reader: whoever sends the job's correlation id in ``X-Job-Key`` (a capability), nobody else."""
    return bool(job.correlation_id) and request.headers.get("X-Job-Key") == job.correlation_id


def broken_reader(request: HttpRequest, job: Any) -> bool:
    raise RuntimeError("the permission service is down")
