"""The request middleware sets the tenant and correlation id for the request and what it enqueues."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory, override_settings

from celery_guardrails import ContextError, current_correlation_id, current_tenant
from django_celery_guardrails.middleware import GuardrailsContextMiddleware

SEEN: list[tuple[str | None, str | None]] = []


def view(request: HttpRequest) -> HttpResponse:
    SEEN.append((current_tenant(), current_correlation_id()))
    return HttpResponse("ok")


async def async_view(request: HttpRequest) -> HttpResponse:
    return view(request)


def tenant_from_header(request: HttpRequest) -> str | None:
    return request.headers.get("X-Tenant")


@pytest.fixture(autouse=True)
def _clear() -> None:
    SEEN.clear()


GUARDRAILS = {"tenant_resolver": f"{__name__}.tenant_from_header"}


@override_settings(CELERY_GUARDRAILS=GUARDRAILS)
def test_request_id_and_tenant_become_the_context(rf: RequestFactory) -> None:
    middleware = GuardrailsContextMiddleware(view)
    response = middleware(rf.get("/", headers={"X-Request-ID": "req-mw-1", "X-Tenant": "acme"}))
    assert SEEN == [("acme", "req-mw-1")]
    assert response["X-Request-ID"] == "req-mw-1"
    # and nothing is left behind for the next request on this thread
    assert (current_tenant(), current_correlation_id()) == (None, None)


@override_settings(CELERY_GUARDRAILS=GUARDRAILS)
def test_correlation_header_fallbacks_and_generated_id(rf: RequestFactory, caplog: pytest.LogCaptureFixture) -> None:
    middleware = GuardrailsContextMiddleware(view)
    middleware(rf.get("/", headers={"X-Correlation-ID": "corr-2"}))
    with caplog.at_level(logging.WARNING):
        bad = middleware(rf.get("/", headers={"X-Request-ID": "has spaces", "X-Correlation-ID": "corr-3"}))
    missing = middleware(rf.get("/"))
    assert [cid for _, cid in SEEN[:2]] == ["corr-2", "corr-3"]
    assert bad["X-Request-ID"] == "corr-3"
    assert "Ignoring X-Request-ID header" in caplog.text
    assert len(SEEN[2][1] or "") == 32 and missing["X-Request-ID"] == SEEN[2][1]
    assert [tenant for tenant, _ in SEEN] == [None, None, None]


@override_settings(CELERY_GUARDRAILS={"request_id_headers": ["X-Amzn-Trace-Id"]})
def test_configured_request_id_headers(rf: RequestFactory) -> None:
    response = GuardrailsContextMiddleware(view)(rf.get("/", headers={"X-Amzn-Trace-Id": "Root=1-abc"}))
    assert SEEN == [(None, "Root=1-abc")]
    assert response["X-Amzn-Trace-Id"] == "Root=1-abc"


@override_settings(CELERY_GUARDRAILS=GUARDRAILS)
def test_resolver_returning_a_bad_tenant_is_an_error(rf: RequestFactory) -> None:
    with pytest.raises(ContextError, match="may hold only"):
        GuardrailsContextMiddleware(view)(rf.get("/", headers={"X-Tenant": "no spaces allowed"}))


@override_settings(CELERY_GUARDRAILS=GUARDRAILS)
def test_async_requests(async_rf: Any) -> None:
    middleware = GuardrailsContextMiddleware(async_view)
    request = async_rf.get("/", headers={"X-Request-ID": "req-async", "X-Tenant": "acme"})
    response = asyncio.run(middleware(request))
    assert SEEN == [("acme", "req-async")]
    assert response["X-Request-ID"] == "req-async"
