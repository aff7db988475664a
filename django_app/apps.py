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
        from .signals import connect as connect_signals

        post_migrate.connect(create_permissions, sender=self)
        connect_signals()
        # The core reaches this app's store, dead-letter sink, outbox and job book through what it registers
        # here: the core does not import this app.
        from celery_guardrails import stores
        from celery_guardrails.runtime import dead_letters
        from celery_guardrails.runtime import outbox as core_outbox

        from .outbox import backlog, enqueue, relay_loop
        from .sinks import DjangoSink
        from .store import DjangoStore

        stores.register_store("django", DjangoStore)
        dead_letters.register_sink("django", DjangoSink)
        core_outbox.register(core_outbox.Outbox(enqueue=enqueue, relay_loop=relay_loop, backlog=backlog))
        from celery_guardrails.guardrails import jobs

        from .job_book import DjangoJobBook

        jobs.register_book(DjangoJobBook())
        from django.apps import apps

        if apps.is_installed("django_celery_beat"):
            # Beat, the watchdog, status and the audit read django-celery-beat's rows through the core.
            from celery_guardrails.scheduling import entries

            from .schedulers import periodic_task_rows

            entries.register_rows(periodic_task_rows)  # guardrails.view_all_tenants (admin_tenants)
