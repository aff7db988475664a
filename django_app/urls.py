"""URLs of the guardrails app outside the admin: ``path("guardrails/", include("django_celery_guardrails.urls"))``
serves the metrics at ``guardrails/metrics`` (see :mod:`django_celery_guardrails.views`) and a job's status at
``guardrails/jobs/<id>/`` (name ``guardrails:job-status``, see :mod:`django_celery_guardrails.jobs`)."""

from __future__ import annotations

from django.urls import path

from . import views
from .jobs import JobStatusView

app_name = "guardrails"

urlpatterns = [
    path("metrics", views.metrics, name="metrics"),
    path("jobs/<uuid:id>/", JobStatusView.as_view(), name="job-status"),
]
