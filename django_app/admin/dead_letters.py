"""The dead letters' change list, record page and overview: which columns a person can tell rows apart by,
what a replay would do (read for a page's rows at once), the attempt history and traceback formatted, the
replay's own fate. Records are read only (no Add, no Save); the actions and the one-record replay pages are
in :mod:`.dead_letter_actions`."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Case, CharField, QuerySet, Value, When
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import mark_safe

from .. import argument_search, health
from ..display import (
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
)
from ..models import DeadLetter, SealedMessage
from ..overview import cause_title, dead_letter_overview, described
from ..paging import CappedCountPaginator, CheckedChangeList, DistinctValuesFilter
from ..replay import Outlook, outlooks
from ..scoping import TenantScopedAdmin, linked
from .common import short_html, tenant_html
from .dead_letter_actions import DeadLetterActions
from .dead_letter_bulk import DeadLetterBulk


def _parameters(task_name: str) -> list[str]:
    """The positional parameters of ``task_name`` when this process knows the task (names a list's argument
    summary: ``order_id=42``); none when it does not (the values are shown by position)."""
    try:
        task = health.celery_app().tasks.get(task_name)
    except Exception:  # an app that will not finalize: by position (a list must show)
        return []
    return argument_search.positional_parameters(task) if task is not None else []


#: The dead letter's fields on its page, each through :func:`.display.escape` (a bidi override in a key or a
#: value shows as ``\u202e``, never reverses the text). The history, traceback and replay's task id are shown
#: formatted instead; "arguments stored as text" is said in words (:meth:`DeadLetterAdmin.stored_arguments`):
#: a bare ❌ there read as "replay impossible".
_DEAD_LETTER_FIELDS = [
    (
        shown_field(DeadLetter, f.name, multiline=f.name == "exc_message")
        if f.name not in ("arguments_are_repr", "fingerprint")
        else {"arguments_are_repr": "stored_arguments", "fingerprint": "cause"}[f.name]
    )
    for f in DeadLetter._meta.fields
    if f.name not in ("history", "traceback", "replayed_task_id")
]


class CauseFilter(admin.SimpleListFilter):
    """The records of one cause (their fingerprint: :mod:`celery_guardrails.foundation.fingerprints`), reached from
    the overview's causes or a record's page. Its only choice is the cause chosen, named in words: a list of hex
    ids would tell a person nothing, and the overview lists the causes by size."""

    title = "cause"
    parameter_name = "fingerprint"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        value = self.value()
        return [(value, cause_title(value, user=request.user))] if value else []

    def queryset(self, request: HttpRequest, queryset: Any) -> Any:
        value = self.value()
        return queryset.filter(fingerprint=value) if value else queryset


@admin.register(DeadLetter)
class DeadLetterAdmin(DeadLetterBulk, DeadLetterActions, CheckedChangeList, TenantScopedAdmin):
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
        CauseFilter,
        ("reason", DistinctValuesFilter),
        ("task_name", DistinctValuesFilter),
        ("owner", DistinctValuesFilter),
        ("tenant", DistinctValuesFilter),
        ("last_failed_at", admin.DateFieldListFilter),
    )
    search_fields = ("task_id__exact", "correlation_id__exact", "idempotency_key__exact")
    search_help_text = (
        "A task id, correlation id or idempotency key (exact), or an argument: order_id=42, customer.id=7, #0=42 "
        "(redacted values never match)."
    )
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

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter], search_term: str
    ) -> tuple[QuerySet[DeadLetter], bool]:
        # Exact ids through their indexes (Django's search), or, for ``path=value``, an argument search
        # (:mod:`..argument_search`); an id may hold "=" too (a key "charge:order=42"): both are asked then.
        by_id, duplicates = super().get_search_results(request, queryset, search_term)
        try:
            term = argument_search.parse(search_term)
        except argument_search.Unsearchable as why:
            messages.warning(request, str(why))
            return by_id, duplicates
        if term is None:
            return by_id, duplicates
        found = argument_search.search(term)
        if found.bounded:
            messages.info(
                request,
                f"Arguments searched in the newest {argument_search.SCAN_LIMIT:,} records (no index for them on "
                "this database; PostgreSQL searches every record).",
            )
        # The rows the argument matched say so (a row found by its id only does not)
        marked = Case(When(found.condition, then=Value(term.text)), default=Value(""), output_field=CharField())
        either = queryset.filter(found.condition) | by_id
        return either.annotate(matched_argument=marked), duplicates

    def has_change_permission(self, request: HttpRequest, obj: DeadLetter | None = None) -> bool:
        return False  # every field is read only: no Save button; the actions check their own permissions

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
        error = short_html(error_line(obj.exc_type, obj.exc_message), 80, "dl-error")
        names = _parameters(obj.task_name)
        shown = arguments_line(obj.args, obj.kwargs, names=names, as_repr=obj.arguments_are_repr)
        matched = getattr(obj, "matched_argument", "")  # an argument search's term: what this row matched
        if matched:
            found = format_html('<mark class="dl-matched">{}</mark> ', escape(matched[:60]))
            return format_html("{}<br> {}{}", error, found, short_html(shown, 70, "dl-arguments"))
        return format_html("{}<br> {}", error, short_html(shown, 70, "dl-arguments"))

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
        owner = short_html(obj.owner, 16) if obj.owner else EMPTY
        return format_html('{}<br><span class="dl-tenant">{}</span>', owner, tenant_html(obj.tenant))

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

    @admin.display(description="cause")
    def cause(self, obj: DeadLetter) -> str:
        if not obj.fingerprint:
            return "not grouped yet (recorded before fingerprints: manage.py guardrails_deadletters fingerprint)"
        changelist = reverse("admin:guardrails_deadletter_changelist")
        fields = {name: getattr(obj, name) for name in ("task_name", "exc_type", "exc_message", "traceback")}
        return format_html(
            '<a href="{}?{}">{}</a> ({})',
            changelist,
            urlencode({"fingerprint": obj.fingerprint}),
            escape(described(fields)),
            escape(obj.fingerprint),
        )

    @admin.display(description="traceback")
    def traceback_text(self, obj: DeadLetter) -> str:
        return format_html("<pre>{}</pre>", escape(obj.traceback, multiline=True, html=True))

    # The overview page, linked from the change list; the one-record replay pages are DeadLetterActions'.

    def get_urls(self) -> list[Any]:
        overview = self.admin_site.admin_view(self.overview_view)
        return [path("overview/", overview, name="guardrails_deadletter_overview"), *super().get_urls()]

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
            "causes": summary.by_cause,
            "groups": [
                ("reason", "Open by reason", summary.by_reason),
                ("owner", "Open by owner", summary.by_owner),
                ("task_name", "Open by task", summary.by_task),
            ],
            "changelist": changelist,
        }
        return TemplateResponse(request, "admin/guardrails/deadletter/overview.html", context)
