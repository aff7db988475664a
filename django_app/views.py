"""Views of the guardrails app that are not admin pages.

``metrics``: the Prometheus exposition (:func:`celery_guardrails.operations.metrics.metrics_registry`: every process's
metrics summed from ``PROMETHEUS_MULTIPROC_DIR`` when it is set, else this web process's own, plus the state
of the deployment read at scrape time by :class:`celery_guardrails.operations.collectors.StateCollector`: queues, open
dead letters, dependencies, schedules; here and not on the workers' endpoints, which would each export the
same cluster-wide numbers), for staff users
or a scraper that sends ``Authorization: Bearer <metrics_token>``; 403 for anyone else (never a redirect to a
login page a scraper cannot follow). The project's task modules are imported first, as a worker imports them
(:mod:`.discovery`): the dependencies' gauges come from the guarded tasks. Mounted by
``django_celery_guardrails.urls``.
"""

from __future__ import annotations

import functools
import hmac
import logging
from typing import Any

from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from celery_guardrails.options import django_settings

from .discovery import import_task_modules
from .scoping import sees_all

logger = logging.getLogger(__name__)


def _allowed(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    # Staff who see every tenant (admin_tenants): the figures mix every tenant's, as the dashboard's hidden ones do.
    if user is not None and user.is_active and user.is_staff and sees_all(user):
        return True
    token = django_settings().get("metrics_token")
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if not token or scheme.lower() != "bearer" or not given:
        return False
    return hmac.compare_digest(given.strip().encode(), str(token).encode())  # no timing hint about the token


@functools.cache
def _state_collector(app: Any) -> Any:
    """One per app and process: its error counter must count across scrapes."""
    from celery_guardrails.operations.collectors import StateCollector

    # The request's database connection is Django's to manage: the collector leaves it open.
    return StateCollector(app, close_database=False)


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """The metrics in Prometheus' text format, for staff or the bearer of ``metrics_token``."""
    if not _allowed(request):
        return HttpResponseForbidden("Forbidden: staff, or Authorization: Bearer <metrics_token>\n")
    from celery import current_app

    from celery_guardrails.operations.metrics import exposition, metrics_registry

    app = current_app._get_current_object()
    # The budget and circuit gauges come from the guarded tasks' dependencies: import the task modules as a
    # worker does, once (a module that fails to import is logged once and leaves those gauges out, not a 500).
    import_task_modules(app)
    try:
        registry = metrics_registry()
        registry.register(_state_collector(app))
        body, content_type = exposition(registry)
    except Exception:  # a multiprocess directory that is gone, say: the scraper sees it as down, the log says why
        logger.exception("Metrics could not be collected")
        return HttpResponse("Metrics could not be collected; see the server log\n", status=503)
    return HttpResponse(body, content_type=content_type)
