"""App configuration."""

from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class GuardrailsConfig(AppConfig):
    """celery-guardrails: system checks now; models, admin and commands as the guardrails land."""

    name = "django_celery_guardrails"
    label = "guardrails"
    verbose_name = _("Celery guardrails")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from . import checks  # noqa: F401  (registers the system checks)
        from .scoping import create_permissions

        post_migrate.connect(create_permissions, sender=self)  # guardrails.view_all_tenants (admin_tenants)
