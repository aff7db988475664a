"""Django admin: dead letters (inspect, replay, discard, resolve) and the run ledger (read only, with the
schedule-health page, see :mod:`django_celery_guardrails.health`).

Every action that changes records checks its own permission (``guardrails.replay_deadletter``,
``discard_deadletter``, ``resolve_deadletter``; 403 without it), asks for confirmation first, writes one
LogEntry per record and reports with ``message_user``, the way Django's ``delete_selected`` does; the work
itself lives in :mod:`django_celery_guardrails.replay` and :func:`~.maintenance.close_dead_letters`, which
tests call directly. "Select all N" in the change list applies an action to everything the current filter
matches. "Edit and replay" fixes one record's tenant or arguments before replaying it. Records and internal
tables are read only (no Add, no Save); replay is offered only to users who may replay.

A replay whose records include ``not_idempotent`` ones (their task may already have acted before it failed) says
so on its confirmation page, lists them with the note of their last attempt, and replays them only when its
unticked box ("I checked that the effect did not happen") is ticked; without it the others are replayed and
these are reported not replayed, like any other refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import mark_safe

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.runtime.outcomes import NOT_IDEMPOTENT
from celery_guardrails.stores import store_url

from . import health
from .dashboard import dashboard_context
from .display import (
    EMPTY,
    REDACTED_MARK,
    arguments_line,
    error_line,
    escape,
    json_text,
    moment,
    moment_html,
    shown_field,
    span,
    time_column,
)
from .forms import EditAndReplayForm
from .maintenance import close_dead_letters
from .models import (
    ConcurrencySlot,
    Dashboard,
    DeadLetter,
    DependencyState,
    IdempotencyKey,
    OutboxMessage,
    ScheduledRun,
    SealedMessage,
    WaitingMessage,
)
from .overview import dead_letter_overview
from .paging import CappedCountPaginator, CheckedChangeList, DistinctValuesFilter
from .replay import Outlook, Refused, ReplayResult, outlooks, plan, replay_dead_letters, replay_with_changes
from .scoping import AllTenantsOnlyAdmin, ScheduleScopedAdmin, TenantScopedAdmin, linked, schedules_seen
from .waiting import waiting_context

#: LogEntries written per INSERT by the actions; the fields of a record its LogEntry names (``str(record)``).
LOG_BATCH = 500
LOGGED = ("pk", "task_name", "task_id", "reason", "status")
#: The confirmation pages' box that lets a replay run not_idempotent records (posted as "yes" when ticked).
ALLOW_NOT_IDEMPOTENT = "allow_not_idempotent"
#: not_idempotent records a confirmation page names (with their notes); past these, it says how many more.
NOT_IDEMPOTENT_SHOWN = 100
#: What a replayed not_idempotent record's LogEntry adds: who let it run again, and on what word.
ALLOWED_NOTE = "; not_idempotent: replayed on the user's word that the effect did not happen"


def _refusal(record: DeadLetter, *, allow_not_idempotent: bool = False) -> str:
    """Why a replay of ``record`` would be refused ("" when it would go through)."""
    try:
        plan(record, allow_not_idempotent=allow_not_idempotent)
    except Refused as why:
        return str(why)
    return ""


def _note(record: DeadLetter) -> str:
    """The note of the record's last attempt ("" when it has none): for a not_idempotent failure the core says
    there what the task's author can do (mark the effect with ``effect()``, hand the key downstream, or declare
    ``idempotent=True``). Records written before notes existed have none."""
    last = record.history[-1] if record.history else None
    return str(last.get("note") or "") if isinstance(last, dict) else ""


def _not_idempotent(queryset: QuerySet[DeadLetter]) -> dict[str, Any]:
    """A replay confirmation page's warning: the open not_idempotent records among ``queryset`` (how many, the
    first :data:`NOT_IDEMPOTENT_SHOWN` with their notes). Empty when there are none: the page shows no box."""
    records = queryset.filter(reason=NOT_IDEMPOTENT, status=DeadLetter.Status.OPEN).order_by("pk")
    count = records.count()
    if not count:
        return {}
    shown = [(record, _note(record)) for record in records[:NOT_IDEMPOTENT_SHOWN]]
    return {
        "not_idempotent": shown,
        "not_idempotent_count": count,
        "not_idempotent_more": count - len(shown),
        "allow_field": ALLOW_NOT_IDEMPOTENT,
    }


def _allowed(request: HttpRequest) -> bool:
    """Whether the confirmation page's not_idempotent box was ticked (unticked, a browser posts nothing)."""
    return request.POST.get(ALLOW_NOT_IDEMPOTENT) == "yes"


def _short(text: str, limit: int, css: str = "") -> str:
    """``text`` cut to ``limit`` characters, whole in its title (hover, copy from the detail page); control and
    invisible characters escaped in both (:mod:`.display`); ``css`` is the span's class, when it needs one."""
    shown = text if len(text) <= limit else text[: limit - 1] + "…"
    if css:
        return format_html('<span class="{}" title="{}">{}</span>', css, escape(text), escape(shown, html=True))
    return format_html('<span title="{}">{}</span>', escape(text), escape(shown, html=True))


def _changed_keys(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k, object()) != after.get(k, object()))


def _tenant(tenant: str | None, limit: int = 16) -> str:
    """A tenant as every page shows it: shortened (whole on hover), and an absent one as ``-``."""
    return _short(tenant, limit) if tenant else EMPTY


def _parameters(task_name: str) -> list[str]:
    """The positional parameters of ``task_name`` when this process knows the task (names a list's argument
    summary: ``order_id=42``); none when it does not (the values are shown by position)."""
    import inspect

    try:
        task = health.celery_app().tasks.get(task_name)
        parameters = inspect.signature(task.run).parameters.values() if task is not None else ()
    except Exception:  # an app that will not finalize, no signature to read: by position (a list must show)
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


#: The dead letter's fields on its page, each through :func:`.display.escape` (a bidi override in a key or a
#: value shows as ``\u202e``, never reverses the text). The history, traceback and replay's task id are shown
#: formatted instead; "arguments stored as text" is said in words (:meth:`DeadLetterAdmin.stored_arguments`):
#: a bare ❌ there read as "replay impossible".
_DEAD_LETTER_FIELDS = [
    (
        shown_field(DeadLetter, f.name, multiline=f.name == "exc_message")
        if f.name != "arguments_are_repr"
        else "stored_arguments"
    )
    for f in DeadLetter._meta.fields
    if f.name not in ("history", "traceback", "replayed_task_id")
]


@admin.register(DeadLetter)
class DeadLetterAdmin(CheckedChangeList, TenantScopedAdmin):
    # Rows a person can tell apart: the record's id (and its task id's first characters) over its task, the
    # error over the arguments. Five columns, as many as fit beside the admin's navigation and the filters on a
    # 1,366 px screen (with seven, the browser squeezed the task to a letter a line). Long values are shortened,
    # whole in their title: the full task name and id are in the task's (and searchable by the exact id). The
    # status is under the reason (and under it, for an open record, whether a replay would go through), the
    # tenant under the owner, the attempts on the record's page. Lookups by URL: the filters below only
    # (CheckedChangeList).
    list_display = ("record", "error_and_arguments", "reason_and_status", "owner_and_tenant", "last_failure")
    # Built for millions of records (bench/scale.py): filter choices one index probe per value, a count capped
    # at 10,000 (the whole table estimated), no facet counts, search by exact ids through their indexes. An
    # "=field" search would be iexact, UPPER(field) = UPPER(%s): no index serves it, every search a full scan.
    list_filter = (
        "status",
        ("reason", DistinctValuesFilter),
        ("task_name", DistinctValuesFilter),
        ("owner", DistinctValuesFilter),
        ("tenant", DistinctValuesFilter),
        ("last_failed_at", admin.DateFieldListFilter),
    )
    search_fields = ("task_id__exact", "correlation_id__exact", "idempotency_key__exact")
    date_hierarchy = None
    paginator = CappedCountPaginator
    show_full_result_count = False  # no second COUNT(*) of the whole table on a filtered page
    if hasattr(admin, "ShowFacets"):  # Django 5.0+: facet counts are a COUNT per filter value, over the filter
        show_facets = admin.ShowFacets.NEVER
    list_per_page = 50
    actions = ["replay_selected", "discard_selected", "resolve_selected"]
    # The raw history and traceback are shown formatted (a table, a <pre>) instead. (Django takes callables here;
    # its stubs say names only.)
    readonly_fields = fields = [  # type: ignore[assignment]
        *_DEAD_LETTER_FIELDS,  # type: ignore[list-item]
        "replay_outlook",
        "attempt_history",
        "traceback_text",
        "replayed_as",
    ]
    change_form_template = "admin/guardrails/deadletter/change_form.html"
    object_history_template = "admin/guardrails/deadletter/object_history.html"
    change_list_template = "admin/guardrails/deadletter/change_list.html"  # adds the "Overview" link

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # dead letters are recorded by workers, never typed in

    def has_change_permission(self, request: HttpRequest, obj: DeadLetter | None = None) -> bool:
        return False  # every field is read only: no Save button; the actions check their own permissions

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("guardrails.replay_deadletter")

    def has_discard_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("guardrails.discard_deadletter")

    def has_resolve_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("guardrails.resolve_deadletter")

    @admin.display(description="attempt history")
    def attempt_history(self, obj: DeadLetter) -> str:
        def cell(value: Any) -> str:
            return escape("" if value is None else value, html=True)

        # Times as every page writes them; the table wraps its cells to the page (Django's form rows hide what
        # overflows them), in a box that scrolls should a cell still not fit.
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
            '<td class="note">{}</td></tr>',
            (
                (
                    cell(r.get("n")),
                    cell(moment(r["start"]) if r.get("start") else ""),
                    cell(moment(r["end"]) if r.get("end") else ""),
                    *map(cell, (r.get("host"), r.get("class"), r.get("rule"))),
                    cell(r.get("exc") or ""),
                    cell(span(r["delay"]) if isinstance(r.get("delay"), int | float) else r.get("delay")),
                    cell(r.get("note") or ""),  # the core's advice on a not_idempotent failure; older records have none
                )
                for r in (obj.history if isinstance(obj.history, list) else [])
                if isinstance(r, dict)
            ),
        )
        return format_html(
            '<div class="gr-scroll" tabindex="0"><table class="attempt-history"><thead><tr><th>#</th><th>start</th>'
            "<th>end</th><th>worker</th><th>class</th><th>rule</th><th>exception</th><th>delay</th><th>note</th>"
            "</tr></thead><tbody>{}</tbody></table></div>",
            rows,
        )

    @admin.display(description="dead letter, task", ordering="pk")
    def record(self, obj: DeadLetter) -> str:
        # The record's number (the link to its page, the id an action's message names) and the start of its
        # task id (whole on hover): two rows of the same task and error still differ here. Under them the
        # task, its full name on hover.
        short = obj.task_name.rpartition(".")[2]
        return format_html(
            '#{} <span class="dl-task-id" title="{}">{}</span><br> <span class="dl-task" title="{}">{}</span>',
            obj.pk,
            escape(obj.task_id),
            escape(obj.task_id[:8], html=True),
            escape(obj.task_name),
            escape(short if len(short) <= 30 else short[:29] + "…", html=True),
        )

    @admin.display(description="error, arguments")
    def error_and_arguments(self, obj: DeadLetter) -> str:
        # The exception's class and the first words of its (redacted) message, and under it the stored arguments,
        # redacted as stored (a redacted value stays "[redacted]"), named as the call named them when this
        # process knows the task; each whole on hover, and on the record's page.
        error = _short(error_line(obj.exc_type, obj.exc_message), 80, "dl-error")
        names = _parameters(obj.task_name)
        shown = arguments_line(obj.args, obj.kwargs, names=names, as_repr=obj.arguments_are_repr)
        return format_html("{}<br> {}", error, _short(shown, 70, "dl-arguments"))

    @admin.display(description="last failure", ordering="last_failed_at")
    def last_failure(self, obj: DeadLetter) -> str:
        # As every page writes a moment (in the user's current time zone), how long ago under it
        return moment_html(obj.last_failed_at, relative=True)

    @admin.display(description="reason, status", ordering="reason")
    def reason_and_status(self, obj: DeadLetter) -> str:
        # The reason may break after its underscores (unknown_payload_/version): a narrower column
        shown = escape(obj.reason, html=True).replace("_", "_<wbr>")  # escaped HTML, whose marks hold no "_"
        reason = format_html('<span title="{}">{}</span>', escape(obj.reason), mark_safe(shown))
        status = format_html('{}<br><span class="dl-status">{}</span>', reason, escape(obj.status))
        if obj.status != DeadLetter.Status.OPEN:
            return status
        # What a replay would do (yes, after a check, no), the reason on hover: the replay's own answer
        outlook = self._outlook(obj)
        return format_html(
            '{}<br><span class="dl-replay replay-{}" title="{}">replay: {}</span>',
            status,
            outlook.summary.replace(" ", "-"),
            escape(str(outlook)),
            outlook.summary,
        )

    @admin.display(description="owner, tenant", ordering="owner")
    def owner_and_tenant(self, obj: DeadLetter) -> str:
        # Owners may be 100 characters long, tenants 128: both shortened, the tenant under the owner
        owner = _short(obj.owner, 16) if obj.owner else EMPTY
        return format_html('{}<br><span class="dl-tenant">{}</span>', owner, _tenant(obj.tenant))

    @admin.display(description="replay")
    def replay_outlook(self, obj: DeadLetter) -> str:
        """The record page's sentence: would replay (from the sealed copy or as shown), or why not."""
        return format_html('<span class="replay-outlook">{}</span>', escape(str(self._outlook(obj)), html=True))

    @admin.display(description="stored arguments")
    def stored_arguments(self, obj: DeadLetter) -> str:
        """What the arguments above are, and what a replay would send: in words, since a bare ❌ for "stored as
        text" read as "replay impossible". A sealed copy holds the original arguments (redaction and cuts apply
        to the shown ones only); the "replay" field says whether a replay would go through."""
        sealed = SealedMessage.objects.filter(dead_letter_id=obj.pk).exists()
        redacted = REDACTED_MARK in json_text([obj.args, obj.kwargs])
        if obj.arguments_are_repr:
            shown = "As text (they were not JSON, or too large): the values above are their repr."
        elif redacted:
            shown = "As JSON, with secrets redacted."
        else:
            shown = "As JSON, as the task received them."
        if sealed:
            replay = "Sealed copy: yes — a replay sends the original arguments."
        elif obj.arguments_are_repr or redacted:
            replay = 'Sealed copy: no — a replay cannot send the original arguments (see "replay").'
        else:
            replay = "Sealed copy: no — a replay sends the arguments above."
        return format_html('<span class="stored-arguments">{}<br> {}</span>', shown, replay)

    def _outlook(self, obj: DeadLetter) -> Outlook:
        # The change list reads every row's at once (changelist_view); the record page asks for its own.
        found = getattr(obj, "replay_outlook_", None)
        return found if found is not None else outlooks([obj.pk]).get(obj.pk, Outlook(refusal="no such dead letter"))

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        response = super().changelist_view(request, extra_context)
        changelist = getattr(response, "context_data", None) and response.context_data.get("cl")  # type: ignore[attr-defined]
        if changelist is not None:  # the page's rows, before they are drawn: two queries for all of them
            rows = list(changelist.result_list)
            found = outlooks([row.pk for row in rows if row.status == DeadLetter.Status.OPEN])
            for row in rows:
                row.replay_outlook_ = found.get(row.pk)
        return response

    @admin.display(description="replayed as")
    def replayed_as(self, obj: DeadLetter) -> str:
        """The replay's task id, its state in the result backend, and its own dead letter if it failed again."""
        if not obj.replayed_task_id:
            return "-"
        failed_again = linked(DeadLetter.objects.filter(task_id=obj.replayed_task_id), obj)  # admin_tenants
        again = failed_again.values_list("pk", flat=True).first()
        if again is not None:
            url = reverse("admin:guardrails_deadletter_change", args=[again])
            link = '{} (<a href="{}" class="replayed-again">failed again: dead letter {}</a>)'
            return format_html(link, escape(obj.replayed_task_id, html=True), url, again)
        try:
            state = health.celery_app().AsyncResult(obj.replayed_task_id).state
        except Exception:  # no result backend, or it is out of reach: the id is still worth showing
            state = "unknown"
        return format_html(
            '{} <span class="replay-state">({})</span>', escape(obj.replayed_task_id, html=True), escape(state)
        )

    @admin.display(description="traceback")
    def traceback_text(self, obj: DeadLetter) -> str:
        return format_html("<pre>{}</pre>", escape(obj.traceback, multiline=True, html=True))

    # The three actions: confirmation page first, then the work, a LogEntry each, a summary message.

    def _confirm(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter], action: str, verb: str, *, replay: bool = False
    ) -> HttpResponse | None:
        if request.POST.get("post"):
            return None
        context = {
            # A replay warns of the not_idempotent records it holds, and asks for the tick that lets them run.
            **(_not_idempotent(queryset) if replay else {}),
            **self.admin_site.each_context(request),
            "title": f"Are you sure you want to {verb}?",
            "queryset": queryset,
            "count": queryset.count(),
            "action": action,
            "verb": verb,
            "opts": self.model._meta,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            # The change list always posts select_across, "0" unless "select all" was chosen: a non-empty
            # string is not the answer (read as true, it made an action on one row act on every row).
            "select_across": request.POST.get("select_across") == "1",
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
        }
        return TemplateResponse(request, "admin/guardrails/deadletter/confirm_action.html", context)

    @admin.action(description="Replay selected dead letters", permissions=["replay"])
    def replay_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> HttpResponse | None:
        if not self.has_replay_permission(request):
            raise PermissionDenied
        confirm = self._confirm(request, queryset, "replay_selected", "replay these dead letters", replay=True)
        if confirm is not None:
            return confirm
        self._replay(request, queryset)
        return None

    def _replay(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        result = replay_dead_letters(queryset, user=request.user, allow_not_idempotent=_allowed(request))
        self._report(request, result)

    def _report(self, request: HttpRequest, result: ReplayResult, changes: str = "") -> None:
        replayed_as = dict(result.replayed)

        def message(record: DeadLetter) -> str:
            # A not_idempotent record was replayed only because this user ticked the box: the log says so.
            allowed = ALLOWED_NOTE if record.reason == NOT_IDEMPOTENT else ""
            return f"Replayed as task {replayed_as[record.pk]}{changes}{allowed}"

        self._log_changes(request, list(replayed_as), message)
        if result.replayed:
            self.message_user(request, f"Replayed {len(result.replayed)} dead letter(s).", messages.SUCCESS)
        # One message per reason, not per record: replaying 500 records of a task that is gone says so once.
        refused: dict[str, list[int]] = {}
        for pk, why in result.skipped:
            refused.setdefault(why, []).append(pk)
        for why, pks in refused.items():
            shown = ", ".join(map(str, pks[:20])) + (f" and {len(pks) - 20} more" if len(pks) > 20 else "")
            self.message_user(request, f"{len(pks)} dead letter(s) not replayed ({shown}): {why}", messages.WARNING)

    def _close(self, request: HttpRequest, queryset: QuerySet[DeadLetter], status: str, verb: str) -> None:
        ids = list(queryset.filter(status=DeadLetter.Status.OPEN).values_list("pk", flat=True))
        changed = close_dead_letters(DeadLetter.objects.filter(pk__in=ids), status, user=request.user)
        closed = list(DeadLetter.objects.filter(pk__in=ids, status=status).values_list("pk", flat=True))
        self._log_changes(request, closed, lambda record: f"Marked {status}")
        self.message_user(request, f"{verb} {changed} dead letter(s).", messages.SUCCESS)

    def _log_changes(self, request: HttpRequest, ids: list[int], message: Callable[[DeadLetter], str]) -> None:
        """One LogEntry per record, as ``log_change`` writes it, inserted :data:`LOG_BATCH` at a time (an action
        on 10,000 records is 20 INSERTs, not 10,000)."""
        content_type = ContentType.objects.get_for_model(DeadLetter, for_concrete_model=False)
        for start in range(0, len(ids), LOG_BATCH):
            records = DeadLetter.objects.filter(pk__in=ids[start : start + LOG_BATCH]).only(*LOGGED).order_by("pk")
            LogEntry.objects.bulk_create(
                LogEntry(
                    user_id=cast(int, request.user.pk),  # an admin view's user is logged in
                    content_type_id=content_type.pk,
                    object_id=str(record.pk),
                    object_repr=str(record)[:200],  # shown on the admin's index and history pages (escaped)
                    action_flag=CHANGE,
                    change_message=message(record),
                )
                for record in records
            )

    @admin.action(description="Discard selected dead letters", permissions=["discard"])
    def discard_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> HttpResponse | None:
        if not self.has_discard_permission(request):
            raise PermissionDenied
        confirm = self._confirm(request, queryset, "discard_selected", "discard these dead letters")
        if confirm is None:
            self._close(request, queryset, DeadLetter.Status.DISCARDED, "Discarded")
        return confirm

    @admin.action(description="Mark selected dead letters resolved", permissions=["resolve"])
    def resolve_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> HttpResponse | None:
        if not self.has_resolve_permission(request):
            raise PermissionDenied
        confirm = self._confirm(request, queryset, "resolve_selected", "mark these dead letters resolved")
        if confirm is None:
            self._close(request, queryset, DeadLetter.Status.RESOLVED, "Resolved")
        return confirm

    # One record: a replay page reachable from its detail page (403 without the permission).

    def get_urls(self) -> list[Any]:
        replay = self.admin_site.admin_view(self.replay_view)
        edit = self.admin_site.admin_view(self.edit_and_replay_view)
        overview = self.admin_site.admin_view(self.overview_view)
        return [
            path("overview/", overview, name="guardrails_deadletter_overview"),
            path("<int:pk>/replay/", replay, name="guardrails_deadletter_replay"),
            path("<int:pk>/edit-and-replay/", edit, name="guardrails_deadletter_edit_and_replay"),
            *super().get_urls(),
        ]

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        """Open records by reason, owner and task, and the last 24 hours by hour (see :mod:`.overview`)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        changelist = reverse("admin:guardrails_deadletter_changelist")
        summary = dead_letter_overview(user=request.user)
        context = {
            **self.admin_site.each_context(request),
            "title": "Dead letters: overview",
            "opts": self.model._meta,
            "overview": summary,
            "groups": [
                ("reason", "Open by reason", summary.by_reason),
                ("owner", "Open by owner", summary.by_owner),
                ("task_name", "Open by task", summary.by_task),
            ],
            "changelist": changelist,
        }
        return TemplateResponse(request, "admin/guardrails/deadletter/overview.html", context)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # The Replay and Edit-and-replay buttons are shown only to users who may use them.
        context = {**(extra_context or {}), "may_replay": self.has_replay_permission(request)}
        return super().change_view(request, object_id, form_url, context)

    def edit_and_replay_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        """Fix one record (tenant, arguments) and replay it: one LogEntry names what changed, never values."""
        if not self.has_replay_permission(request):
            raise PermissionDenied
        record = get_object_or_404(self.get_queryset(request), pk=pk)
        initial = {"tenant": record.tenant, "args": record.args, "kwargs": record.kwargs}
        warning = _not_idempotent(DeadLetter.objects.filter(pk=pk))
        form = EditAndReplayForm(
            request.POST if request.method == "POST" else None, initial=initial, not_idempotent=bool(warning)
        )
        if request.method == "POST" and form.is_valid():
            tenant = form.cleaned_data["tenant"] or None
            args = form.cleaned_data["args"] if form.cleaned_data["args"] != record.args else None
            kwargs = form.cleaned_data["kwargs"] if form.cleaned_data["kwargs"] != record.kwargs else None
            if tenant == record.tenant:
                tenant = None
            changes = [
                *([f"tenant {record.tenant!r} -> {tenant!r}"] if tenant else []),
                *(["arguments"] if args is not None else []),
                *([f"keyword arguments ({', '.join(_changed_keys(record.kwargs, kwargs))})"] if kwargs else []),
            ]
            allow = bool(form.cleaned_data.get(ALLOW_NOT_IDEMPOTENT))
            result = replay_with_changes(
                pk, user=request.user, tenant=tenant, args=args, kwargs=kwargs, allow_not_idempotent=allow
            )
            self._report(request, result, f"; changed {', '.join(changes)}" if changes else "")
            if result.replayed:
                return redirect(reverse("admin:guardrails_deadletter_change", args=[pk]))
        context = {
            **self.admin_site.each_context(request),
            "title": f"Edit and replay {record.task_name}[{record.task_id}]",
            "record": record,
            "form": form,
            "sealed": SealedMessage.objects.filter(dead_letter_id=record.pk).exists(),
            # Other obstacles only: the not_idempotent one is the warning and the form's box.
            "refusal": _refusal(record, allow_not_idempotent=True),
            "opts": self.model._meta,
            **warning,
        }
        return TemplateResponse(request, "admin/guardrails/deadletter/edit_and_replay.html", context)

    def replay_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        if not self.has_replay_permission(request):
            raise PermissionDenied
        record = get_object_or_404(self.get_queryset(request), pk=pk)
        queryset = self.get_queryset(request).filter(pk=pk)
        if request.method == "POST" and request.POST.get("post"):
            self._replay(request, queryset)
            return redirect(reverse("admin:guardrails_deadletter_change", args=[pk]))
        context = {
            **self.admin_site.each_context(request),
            "title": "Are you sure you want to replay this dead letter?",
            "queryset": queryset,
            "count": 1,
            "action": "",
            "verb": "replay this dead letter",
            "record": record,
            # Other obstacles only: the not_idempotent one is the warning and its box.
            "refusal": _refusal(record, allow_not_idempotent=True),
            "opts": self.model._meta,
            **_not_idempotent(queryset),
        }
        return TemplateResponse(request, "admin/guardrails/deadletter/confirm_action.html", context)


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(AllTenantsOnlyAdmin):
    # Times as every page writes them (.display.moment)
    list_display = (
        "key",
        "state",
        time_column("lease_until", "lease until"),
        time_column("finished_at", "finished at", relative=True),
    )
    list_filter = ("state",)
    search_fields = ("key__exact",)  # through the unique index ("=key" is iexact: a full scan)
    readonly_fields = [f.name for f in IdempotencyKey._meta.fields]
    show_full_result_count = False
    paginator = CappedCountPaginator

    def get_queryset(self, request: HttpRequest) -> QuerySet[IdempotencyKey]:
        return super().get_queryset(request).of_tasks()  # type: ignore[attr-defined,no-any-return]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # keys are claimed by workers; one typed in would make a task skip its work

    def has_change_permission(self, request: HttpRequest, obj: IdempotencyKey | None = None) -> bool:
        return False  # to look at (and delete: a key deleted by hand lets its task run again)


@admin.register(ConcurrencySlot)
class ConcurrencySlotAdmin(TenantScopedAdmin):
    """The holders of concurrency slots, and the reaped ones (``lost``: their record, kept)."""

    list_display = (
        "key",
        "state",
        "task_name",
        "task_id",
        "tenant_shown",
        time_column("acquired_at", "acquired at"),
        time_column("heartbeat_at", "heartbeat at", relative=True),
        time_column("reaped_at", "reaped at"),
    )
    list_filter = ("state",)
    search_fields = ("key__exact", "task_id__exact")
    readonly_fields = [f.name for f in ConcurrencySlot._meta.fields]
    show_full_result_count = False
    paginator = CappedCountPaginator

    @admin.display(description="tenant", ordering="tenant")
    def tenant_shown(self, obj: ConcurrencySlot) -> str:
        return _tenant(obj.tenant)  # "-" when absent, as on every page

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # slots are taken by workers

    def has_change_permission(self, request: HttpRequest, obj: ConcurrencySlot | None = None) -> bool:
        return False  # to look at (and delete: a held slot deleted by hand frees it at once)


@admin.register(OutboxMessage)
class OutboxMessageAdmin(TenantScopedAdmin):
    """Messages waiting in the transactional outbox: a row here long after its transaction committed is the
    relay's lag, or a message it cannot publish (``last_error`` says why). Its arguments are not shown: a
    message in flight may carry what dead letters would redact."""

    list_display = (
        "task_name",
        "task_id",
        "tenant_shown",
        time_column("created_at", "created at", relative=True),
        time_column("available_at", "available at"),
        "attempts",
        "last_error",
    )
    list_filter = ("task_name",)
    search_fields = ("task_id__exact",)
    exclude = ("body",)
    readonly_fields = [f.name for f in OutboxMessage._meta.fields if f.name != "body"]
    show_full_result_count = False
    paginator = CappedCountPaginator

    @admin.display(description="tenant", ordering="tenant")
    def tenant_shown(self, obj: OutboxMessage) -> str:
        return _tenant(obj.tenant)  # "-" when absent, as on every page

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # rows are written by enqueue_in_transaction

    def has_change_permission(self, request: HttpRequest, obj: OutboxMessage | None = None) -> bool:
        return False  # to look at (and delete: a row deleted by hand is never published)


#: DependencyState's fields that hold epoch seconds (the stores' clock): shown as moments.
EPOCH_FIELDS = ("open_until", "probe_until")


def _epoch(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


@admin.register(DependencyState)
class DependencyStateAdmin(AllTenantsOnlyAdmin):
    list_display = (
        "dependency",
        "circuit_shown",
        "failures",
        "retries_current",
        "first_current",
        time_column("updated_at", "updated at", relative=True),
    )
    # The epoch-second fields (open_until, probe_until) as moments, like every other time on the pages.
    readonly_fields = fields = [  # type: ignore[assignment]
        f.name if f.name not in EPOCH_FIELDS else f"{f.name}_shown" for f in DependencyState._meta.fields
    ]

    @admin.display(description="circuit", ordering="circuit")
    def circuit_shown(self, obj: DependencyState) -> str:
        # An open circuit says until when (the store keeps epoch seconds)
        if obj.circuit != DependencyState.Circuit.OPEN or not obj.open_until:
            return escape(obj.get_circuit_display())  # type: ignore[attr-defined]
        return format_html("open until {}", moment_html(_epoch(obj.open_until), relative=True))

    @admin.display(description="open until")
    def open_until_shown(self, obj: DependencyState) -> str:
        return moment_html(_epoch(obj.open_until)) if obj.open_until else EMPTY

    @admin.display(description="probes given up at")
    def probe_until_shown(self, obj: DependencyState) -> str:
        return moment_html(_epoch(obj.probe_until)) if obj.probe_until else EMPTY

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # rows are made by the breakers and budgets that need them

    def has_change_permission(self, request: HttpRequest, obj: DependencyState | None = None) -> bool:
        return False


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
        return _short(obj.schedule, 60)

    @admin.display(description="task id", ordering="task_id")
    def run_task_id(self, obj: ScheduledRun) -> str:
        return _short(obj.task_id, 10) if obj.task_id else "-"

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


class _PageAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
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
class DashboardAdmin(_PageAdmin):
    """The dashboard page (:mod:`.dashboard`)."""

    title, template = "Dashboard", "admin/guardrails/dashboard/dashboard.html"

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        return dashboard_context(health.celery_app(), user=request.user)


@admin.register(WaitingMessage)
class WaitingAdmin(_PageAdmin):
    """The Waiting page (:mod:`.waiting`): messages re-published with a countdown, read from the configured
    store, scoped by tenant."""

    title, template = "Waiting", "admin/guardrails/waiting/waiting.html"

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        return waiting_context(request.user)
