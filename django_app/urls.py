"""URLs of the guardrails app outside the admin: ``path("guardrails/", include("django_celery_guardrails.urls"))``
serves the metrics at ``guardrails/metrics`` (see :mod:`django_celery_guardrails.views`)."""

from __future__ import annotations

from django.urls import path

from . import views

app_name = "guardrails"

urlpatterns = [
    path("metrics", views.metrics, name="metrics"),
]
