"""Views of the guardrails app that are not admin pages.

``metrics``: the Prometheus exposition (:func:`celery_guardrails.metrics.metrics_registry`: every process's
metrics summed from ``PROMETHEUS_MULTIPROC_DIR`` when it is set, else this web process's own), for staff users
or a scraper that sends ``Authorization: Bearer <metrics_token>``; 403 for anyone else (never a redirect to a
login page a scraper cannot follow). Mounted by ``django_celery_guardrails.urls``.
"""

from __future__ import annotations

import hmac
import logging

from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from celery_guardrails.options import django_settings

logger = logging.getLogger(__name__)


def _allowed(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        return True
    token = django_settings().get("metrics_token")
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if not token or scheme.lower() != "bearer" or not given:
        return False
    return hmac.compare_digest(given.strip().encode(), str(token).encode())  # no timing hint about the token


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """The metrics in Prometheus' text format, for staff or the bearer of ``metrics_token``."""
    if not _allowed(request):
        return HttpResponseForbidden("Forbidden: staff, or Authorization: Bearer <metrics_token>\n")
    from celery_guardrails.metrics import exposition

    try:
        body, content_type = exposition()
    except Exception:  # a multiprocess directory that is gone, say: the scraper sees it as down, the log says why
        logger.exception("Metrics could not be collected")
        return HttpResponse("Metrics could not be collected; see the server log\n", status=503)
    return HttpResponse(body, content_type=content_type)
