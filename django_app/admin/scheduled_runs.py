"""The run ledger, read only, and the schedule-health page linked from its change list (see
:mod:`django_celery_guardrails.health`): a changed or deleted record would let a period be dispatched twice, or
hide that it was missed. Records are scoped by the tenant of their schedule's beat entry."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.http import urlencode

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.stores import store_url

from .. import health
from ..display import shown_field, time_column
from ..models import ScheduledRun
from ..paging import CappedCountPaginator, CheckedChangeList, DistinctValuesFilter
from ..scoping import ScheduleScopedAdmin, schedules_seen
from .common import short_html


@admin.register(ScheduledRun)
class ScheduledRunAdmin(CheckedChangeList, ScheduleScopedAdmin):
    """The run ledger, to look at only: records are written by beat, workers and the watchdog, and a changed or
    deleted record would let a period be dispatched twice (or hide that it was missed)."""

    # Fits a 1,366 px screen: the dispatch and end times are on the record's page, the task id is shortened.
    # Lookups by URL: the filters and the date hierarchy below only (CheckedChangeList).
    list_display = (
        "schedule_name",
        time_column("period", "period"),
        "status",
        time_column("started_at", "started at"),
        "run_duration",
        "run_task_id",
    )
    list_filter = ("status", ("schedule", DistinctValuesFilter), ("period", admin.DateFieldListFilter))
    search_fields = ("=task_id", "schedule")
    date_hierarchy = "period"
    # Each through .display.escape, as on a dead letter's page (callables: see DeadLetterAdmin).
    readonly_fields = fields = [  # type: ignore[assignment]
        shown_field(ScheduledRun, f.name, multiline=f.name == "reason")  # type: ignore[misc]
        for f in ScheduledRun._meta.fields
    ]
    paginator = CappedCountPaginator
    show_full_result_count = False
    list_per_page = 50
    change_list_template = "admin/guardrails/scheduledrun/change_list.html"  # adds the "Schedule health" link
    change_form_template = "admin/guardrails/change_form.html"  # the record's name escaped (.display)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: ScheduledRun | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: ScheduledRun | None = None) -> bool:
        return False

    @admin.display(description="schedule", ordering="schedule")
    def schedule_name(self, obj: ScheduledRun) -> str:
        return short_html(obj.schedule, 60)

    @admin.display(description="task id", ordering="task_id")
    def run_task_id(self, obj: ScheduledRun) -> str:
        return short_html(obj.task_id, 10) if obj.task_id else "-"

    @admin.display(description="duration")
    def run_duration(self, obj: ScheduledRun) -> timedelta | None:
        return obj.duration  # None (not started or not ended) shows as the admin's empty value

    # The schedule-health page (django_celery_guardrails.health), linked from the change list.

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view(self.health_view)
        return [path("health/", view, name="guardrails_scheduledrun_health"), *super().get_urls()]

    def health_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        app = health.celery_app()
        items: list[health.ScheduleHealth] = []
        error = ""
        other_store = False
        try:
            # The page reads the ledger table: with a Redis store the ledger is elsewhere, and the page says so.
            other_store = store_url(app) != "django"
            items = schedules_seen(health.schedule_health(app), request.user, app)
        except ConfigurationError as exc:  # a bad schedules setting: show it, as beat would refuse to start
            error = str(exc)
        changelist = reverse("admin:guardrails_scheduledrun_changelist")
        context = {
            **self.admin_site.each_context(request),
            "title": "Schedule health",
            "opts": self.model._meta,
            "rows": [(item, f"{changelist}?{urlencode({'schedule': item.schedule})}") for item in items],
            "states": health.STATES,
            "window_days": health.DEFAULT_WINDOW.days,
            "error": error,
            "other_store": other_store,
        }
        return TemplateResponse(request, "admin/guardrails/scheduledrun/health.html", context)
