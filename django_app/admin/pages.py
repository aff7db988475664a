"""The pages in place of a change list: the dashboard (:mod:`..dashboard`) and Waiting (:mod:`..waiting`),
listed on the admin index with the app's models, shown to those who may view dead letters, changing nothing."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from .. import health
from ..dashboard import dashboard_context
from ..models import Dashboard, WaitingMessage
from ..waiting import waiting_context


class PageAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """A page in place of a change list: listed on the admin index with the app's models, shown to those who
    may view dead letters, changing nothing. A subclass names its ``title``, ``template`` and ``page_context``."""

    title = ""
    template = ""

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        raise NotImplementedError

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.has_perm("guardrails.view_deadletter"))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": self.title,
            "opts": self.model._meta,
            **self.page_context(request),
            **(extra_context or {}),
        }
        return TemplateResponse(request, self.template, context)


@admin.register(Dashboard)
class DashboardAdmin(PageAdmin):
    """The dashboard page (:mod:`.dashboard`)."""

    title, template = "Dashboard", "admin/guardrails/dashboard/dashboard.html"

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        return dashboard_context(health.celery_app(), user=request.user)


@admin.register(WaitingMessage)
class WaitingAdmin(PageAdmin):
    """The Waiting page (:mod:`.waiting`): messages re-published with a countdown, read from the configured
    store, scoped by tenant."""

    title, template = "Waiting", "admin/guardrails/waiting/waiting.html"

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        return waiting_context(request.user)
