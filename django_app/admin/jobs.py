"""The jobs (``task.submit()``): their change list (filter by tenant, state, task and age; search by job or task
id), each job's page (read only: jobs are written by workers, with the history as a table and a link to its
dead letter), and the action "Cancel selected jobs".

The action checks its permission (``guardrails.change_job``: a cancel changes the job; 403 without it), asks for
confirmation first, writes one LogEntry per job it changed and reports with ``message_user``; the work itself is
:func:`~..maintenance.cancel_jobs`, which calls :meth:`~..models.Job.cancel` on each. Jobs are tenant-scoped as
the dead letters are (``admin_tenants``, :mod:`..scoping`).
"""

from __future__ import annotations

import contextlib
import re
import uuid
from datetime import timedelta
from typing import Any, cast

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.db.models import OuterRef, Q, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from celery_guardrails.jobs import TERMINAL

from ..display import EMPTY, escape, moment, moment_html, shown_field
from ..maintenance import JobCancels, cancel_jobs
from ..models import DeadLetter, Job
from ..paging import CappedCountPaginator, CheckedChangeList, DistinctValuesFilter
from ..scoping import TenantScopedAdmin, linked, scope
from .common import short_html, tenant_html

#: A job's id as the change list posts it (a UUID).
JOB_ID = re.compile(r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}")
#: Jobs a confirmation page names; past these, it says how many more.
CONFIRM_SHOWN = 100
#: LogEntries written per INSERT by the action.
LOG_BATCH = 500


class SubmittedFilter(admin.SimpleListFilter):
    """How long ago a job was submitted: in the last hour, day or week, or before that (through the
    (tenant, state, created_at) and created_at indexes)."""

    title = "submitted"
    parameter_name = "submitted"
    #: Choice -> (newer than, older than) in seconds before now.
    SPANS: dict[str, tuple[float | None, float | None]] = {
        "hour": (3600, None),
        "day": (86400, None),
        "week": (7 * 86400, None),
        "older": (None, 7 * 86400),
    }

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("hour", "in the last hour"),
            ("day", "in the last day"),
            ("week", "in the last week"),
            ("older", "more than a week ago"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        span = self.SPANS.get(self.value() or "")
        if span is None:
            return queryset
        newer, older = span
        now = timezone.now()
        if newer is not None:
            return queryset.filter(created_at__gte=now - timedelta(seconds=newer))
        return queryset.filter(created_at__lt=now - timedelta(seconds=cast(float, older)))


def _job_fields() -> list[Any]:
    """The job's fields on its page, each through :func:`.display.escape`; the history and the dead letter are
    shown formatted instead (a table, a link)."""
    return [
        shown_field(Job, f.name, multiline=f.name == "error")
        for f in Job._meta.fields
        if f.name not in ("history", "dead_letter_task_id")
    ]


@admin.register(Job)
class JobAdmin(CheckedChangeList, TenantScopedAdmin):
    # Four columns: what fits beside the navigation and the filters at 1,366 px (with the dead letter in a
    # fifth, the browser pushed it off the screen). The job's id (its first characters, whole on hover) over its
    # task; the state and its detail over the attempt and progress, and a dead-lettered job's link to its
    # record; the tenant; submitted over finished. Lookups by URL: the filters below only (CheckedChangeList).
    list_display = ("job", "state_and_progress", "tenant_shown", "times")
    list_filter = (
        "state",
        ("tenant", DistinctValuesFilter),
        ("task_name", DistinctValuesFilter),
        SubmittedFilter,
    )
    search_fields = ("id", "task_id")  # exact ids only: see get_search_results
    search_help_text = "A job id or a task id (exact)."
    paginator = CappedCountPaginator
    show_full_result_count = False
    if hasattr(admin, "ShowFacets"):
        show_facets = admin.ShowFacets.NEVER
    list_per_page = 50
    actions = ["cancel_selected"]
    readonly_fields = fields = [*_job_fields(), "dead_letter_link", "history_table"]  # type: ignore[assignment]
    change_form_template = "admin/guardrails/change_form.html"  # the job's name escaped (.display)
    #: What a selected row's id looks like (CheckedChangeList refuses anything else).
    selected_id_pattern = JOB_ID

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # jobs are submitted by code (task.submit())

    def has_change_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        return False  # written by the worker: every field is read only (a cancel is the action)

    def has_delete_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        return False  # a user polls it; the prune removes finished ones after job_retention

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("guardrails.change_job"))

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # A job still going has a Cancel button on its page (the list's cancel action, for this job: its
        # confirmation, its permission): how a bulk action started from the dead letters is stopped.
        job = self.get_object(request, object_id)
        going = job is not None and job.state not in TERMINAL and self.has_cancel_permission(request)
        context = {**(extra_context or {}), "cancel_job": going}
        return super().change_view(request, object_id, form_url, extra_context=context)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        # Each row's dead letter (the one recorded for its message), looked up with the rows of the page: one
        # probe of the task_id index per row, among the dead letters the user may see.
        letters = scope(DeadLetter.objects.filter(task_id=OuterRef("dead_letter_task_id")), request.user)
        jobs: QuerySet[Job] = super().get_queryset(request)
        return cast(QuerySet[Job], jobs.annotate(dead_letter_pk=Subquery(letters.values("pk")[:1])))

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Job], search_term: str
    ) -> tuple[QuerySet[Job], bool]:
        # Exact ids through their indexes; a term that is not a UUID is no job id (the UUID column would refuse
        # it, a 500), but may still be a task id.
        term = search_term.strip()
        if not term:
            return queryset, False
        found = Q(task_id=term)
        with contextlib.suppress(ValueError):
            found |= Q(pk=uuid.UUID(term))
        return queryset.filter(found), False

    # The list's columns.

    @admin.display(description="job, task", ordering="created_at")
    def job(self, obj: Job) -> str:
        short = obj.task_name.rpartition(".")[2]
        return format_html(
            '<span class="job-id" title="{}">{}</span><br> <span class="job-task" title="{}">{}</span>',
            str(obj.pk),
            str(obj.pk)[:8],
            escape(obj.task_name),
            escape(short if len(short) <= 30 else short[:29] + "…", html=True),
        )

    @admin.display(description="state, progress, dead letter", ordering="state")
    def state_and_progress(self, obj: Job) -> str:
        progress = EMPTY
        if obj.progress_done is not None:
            total = "?" if obj.progress_total is None else obj.progress_total
            progress = f"{obj.progress_done}/{total}"
        detail = format_html(' <span class="job-detail">{}</span>', short_html(obj.detail, 24)) if obj.detail else ""
        letter = getattr(obj, "dead_letter_pk", None)
        link = format_html("<br>dead letter {}", self._letter_html(letter, obj.dead_letter_task_id)) if letter else ""
        return format_html(
            '<span class="job-state state-{}">{}</span>{}<br><span class="job-attempt">attempt {}</span>, '
            '<span class="job-progress">{}</span>{}',
            obj.state,
            obj.get_state_display(),  # type: ignore[attr-defined]
            detail,
            obj.attempt,
            progress,
            link,
        )

    @admin.display(description="tenant", ordering="tenant")
    def tenant_shown(self, obj: Job) -> str:
        return tenant_html(obj.tenant)  # "-" when absent, as on every page

    @admin.display(description="submitted, finished", ordering="created_at")
    def times(self, obj: Job) -> str:
        # As every page writes a moment, how long ago on hover
        return format_html("{}<br>{}", moment_html(obj.created_at), moment_html(obj.finished_at))

    # The job's page.

    @admin.display(description="dead letter")
    def dead_letter_link(self, obj: Job) -> str:
        if not obj.dead_letter_task_id:
            return EMPTY
        pk = linked(DeadLetter.objects.filter(task_id=obj.dead_letter_task_id), obj).values_list("pk", flat=True)
        return self._letter_html(pk.first(), obj.dead_letter_task_id, whole=True)

    @staticmethod
    def _letter_html(pk: int | None, task_id: str, *, whole: bool = False) -> str:
        if not task_id:
            return EMPTY
        shown = task_id if whole else task_id[:8]
        if pk is None:  # pruned, or one the user may not see: its task id only
            return format_html('<span class="job-dead-letter" title="{}">{}</span>', escape(task_id), escape(shown))
        return format_html(
            '<a class="job-dead-letter" href="{}" title="{}">#{} {}</a>',
            reverse("admin:guardrails_deadletter_change", args=[pk]),
            escape(task_id),
            pk,
            escape(shown, html=True),
        )

    @admin.display(description="history")
    def history_table(self, obj: Job) -> str:
        def cell(value: Any) -> str:
            return escape("" if value is None else value, html=True)

        rows = format_html_join(
            "",
            '<tr><td>{}</td><td>{}</td><td>{}</td><td class="note">{}</td></tr>',
            (
                (
                    cell(moment(entry.get("at"))),
                    cell(entry.get("state")),
                    cell(entry.get("attempt")),
                    cell(entry.get("detail") or ""),
                )
                for entry in (obj.history if isinstance(obj.history, list) else [])
                if isinstance(entry, dict)
            ),
        )
        return format_html(
            '<div class="gr-scroll" tabindex="0"><table class="job-history"><thead><tr><th>at</th><th>state</th>'
            "<th>attempt</th><th>detail</th></tr></thead><tbody>{}</tbody></table></div>",
            rows,
        )

    # The action: confirmation page first, then the work, a LogEntry per job changed, a summary message.

    @admin.action(description="Cancel selected jobs", permissions=["cancel"])
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        if not self.has_cancel_permission(request):
            raise PermissionDenied
        if not request.POST.get("post"):
            return self._confirm(request, queryset)
        done = cancel_jobs(queryset, user=request.user)
        self._log(request, done)
        if done.cancelled:
            self.message_user(request, f"Cancelled {len(done.cancelled)} job(s).", messages.SUCCESS)
        if done.requested:
            self.message_user(
                request,
                f"{len(done.requested)} running job(s) asked to cancel: each runs to its end.",
                messages.WARNING,
            )
        if done.unchanged:
            self.message_user(
                request,
                f"{len(done.unchanged)} job(s) left as they were (already final, or a cancel already asked).",
                messages.INFO,
            )
        return None

    def _confirm(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse:
        count = queryset.count()
        shown = list(queryset.order_by("created_at", "pk")[:CONFIRM_SHOWN])
        context = {
            **self.admin_site.each_context(request),
            "title": "Are you sure you want to cancel these jobs?",
            "action": "cancel_selected",
            "jobs": shown,
            "count": count,
            "more": count - len(shown),
            "running": queryset.filter(state=Job.State.RUNNING).count(),
            "opts": self.model._meta,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            # "0" unless "select all" was chosen (a non-empty string is not the answer: see the dead letters')
            "select_across": request.POST.get("select_across") == "1",
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
        }
        return TemplateResponse(request, "admin/guardrails/job/confirm_cancel.html", context)

    def _log(self, request: HttpRequest, done: JobCancels) -> None:
        """One LogEntry per job changed (cancelled, or asked to cancel), :data:`LOG_BATCH` per INSERT."""
        content_type = ContentType.objects.get_for_model(Job, for_concrete_model=False)
        changes: list[tuple[str, str]] = [
            *((pk, "Cancelled") for pk in done.cancelled),
            *((pk, "Cancel requested while running") for pk in done.requested),
        ]
        for start in range(0, len(changes), LOG_BATCH):
            batch = dict(changes[start : start + LOG_BATCH])
            jobs = Job.objects.filter(pk__in=list(batch)).only("pk", "task_name", "state")
            LogEntry.objects.bulk_create(
                LogEntry(
                    user_id=cast(int, request.user.pk),  # an admin view's user is logged in
                    content_type_id=content_type.pk,
                    object_id=str(job.pk),
                    object_repr=str(job)[:200],
                    action_flag=CHANGE,
                    change_message=batch[str(job.pk)],
                )
                for job in jobs
            )
