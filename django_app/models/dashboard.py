"""The admin dashboard's entry on the admin index (:mod:`django_celery_guardrails.dashboard`).

:class:`Dashboard` is a proxy of :class:`~django_celery_guardrails.models.DeadLetter`, not a table: no store
writes it and no Redis store file mirrors it.
"""

from __future__ import annotations

from django.utils.translation import gettext_lazy as _

from .dead_letters import DeadLetter


class Dashboard(DeadLetter):
    """Not a table: the admin's dashboard page (:mod:`django_celery_guardrails.dashboard`), listed with the app's
    models on the admin index. A proxy of :class:`DeadLetter`, whose view permission it asks for."""

    class Meta:
        proxy = True
        verbose_name = _("dashboard")
        verbose_name_plural = _("dashboard")
        default_permissions = ()
