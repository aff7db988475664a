"""System checks: ``manage.py check`` grades the guardrails configuration.

guardrails.E001  ``CELERY_GUARDRAILS`` has an unknown key or a bad value (the message names it).
guardrails.W001  the context middleware is not installed: requests will not stamp their correlation id and
                 tenant on the tasks they enqueue.
guardrails.W002  no ``seal_keys``: dead letters keep no sealed copy, so a record whose arguments had a secret
                 redacted cannot be replayed.
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


@register(Tags.security)
def check_seal_keys(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    try:
        keys = django_settings().get("seal_keys")
    except ConfigurationError:
        return []  # E001 says it
    if keys:
        return []
    return [
        Warning(
            "CELERY_GUARDRAILS has no seal_keys: a dead letter whose arguments had a secret redacted cannot be "
            "replayed.",
            hint="Set CELERY_GUARDRAILS['seal_keys'] to a list of Fernet keys read from the environment (README, "
            "Dead letters: Sealed for replay).",
            id="guardrails.W002",
        )
    ]
