"""Request middleware: the request's correlation id and tenant become the context of everything it enqueues.

* Correlation id: the first valid value of the headers in ``request_id_headers`` (default ``X-Request-ID``,
  then ``X-Correlation-ID``); a malformed value is logged and replaced; none makes a new id. It is echoed
  in the response under the first of those header names and set as ``request.correlation_id``.
* Tenant: ``tenant_resolver`` (a callable or dotted path taking the request, returning a tenant id or None).
  A resolver that returns an unacceptable tenant id is a bug in the project: the ContextError propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase

from celery_guardrails.exceptions import ContextError
from celery_guardrails.foundation.context import correlation_context, tenant_context, validate_correlation_id
from celery_guardrails.options import OPTIONS, django_settings, load

logger = logging.getLogger(__name__)


class GuardrailsContextMiddleware:
    """Sets ``tenant_context`` and ``correlation_context`` for the duration of each request."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        settings = django_settings()
        self.header_names: tuple[str, ...] = settings.get("request_id_headers", OPTIONS["request_id_headers"].default)
        resolver = settings.get("tenant_resolver")
        self.resolver: Callable[[HttpRequest], str | None] | None = load(resolver) if resolver else None
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def correlation_id_of(self, request: HttpRequest) -> str | None:
        for name in self.header_names:
            value = request.headers.get(name)
            if not value:
                continue
            try:
                return validate_correlation_id(value)
            except ContextError as exc:
                logger.warning("Ignoring %s header of %s %s: %s", name, request.method, request.path, exc)
        return None

    def tenant_of(self, request: HttpRequest) -> str | None:
        return self.resolver(request) if self.resolver is not None else None

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        with (
            correlation_context(self.correlation_id_of(request)) as cid,
            tenant_context(self.tenant_of(request)),
        ):
            request.correlation_id = cid  # type: ignore[attr-defined]
            response: HttpResponseBase = self.get_response(request)
        response[self.header_names[0]] = cid
        return response

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]] = self.get_response
        with (
            correlation_context(self.correlation_id_of(request)) as cid,
            tenant_context(self.tenant_of(request)),
        ):
            request.correlation_id = cid  # type: ignore[attr-defined]
            response = await get_response(request)
        response[self.header_names[0]] = cid
        return response
