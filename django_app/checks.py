"""System checks: ``manage.py check`` grades the guardrails configuration.

guardrails.E001  ``CELERY_GUARDRAILS`` has an unknown key or a bad value (the message names it).
guardrails.W001  the context middleware is not installed: requests will not stamp their correlation id and
                 tenant on the tasks they enqueue.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.options import django_settings

MIDDLEWARE_PATH = "django_celery_guardrails.middleware.GuardrailsContextMiddleware"


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    try:
        django_settings()
    except ConfigurationError as exc:
        return [Error(str(exc), hint="See the settings table in the README.", id="guardrails.E001")]
    return []


@register(Tags.compatibility)
def check_middleware(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    if MIDDLEWARE_PATH in getattr(settings, "MIDDLEWARE", ()):
        return []
    return [
        Warning(
            "GuardrailsContextMiddleware is not in MIDDLEWARE.",
            hint=f"Add {MIDDLEWARE_PATH!r} so tasks enqueued by a request carry its tenant and request id.",
            id="guardrails.W001",
        )
    ]
