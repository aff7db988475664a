"""The dead letters' actions (replay, discard, resolve the selected records) and the one-record pages (replay,
edit and replay), as a mixin of :class:`~.dead_letters.DeadLetterAdmin`.

Every action that changes records checks its own permission (``guardrails.replay_deadletter``,
``discard_deadletter``, ``resolve_deadletter``; 403 without it), asks for confirmation first, writes one
LogEntry per record and reports with ``message_user``, the way Django's ``delete_selected`` does; the work
itself lives in :mod:`django_celery_guardrails.replay` and :func:`~..maintenance.close_dead_letters`. A replay
whose records include ``not_idempotent`` ones says so on its confirmation page, lists them with the note of their
last attempt, and replays them only when its unticked box ("I checked that the effect did not happen") is ticked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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

from celery_guardrails.runtime.outcomes import NOT_IDEMPOTENT

from ..forms import EditAndReplayForm
from ..maintenance import close_dead_letters
from ..models import DeadLetter, SealedMessage
from ..models.dead_letters import record_name
from ..replay import Refused, ReplayResult, plan, replay_dead_letters, replay_with_changes

#: LogEntries written per INSERT by the actions; the fields of a record its LogEntry names (``str(record)``).
LOG_BATCH = 500
LOGGED = ("pk", "task_name", "task_id", "reason", "status")
#: The confirmation pages' box that lets a replay run not_idempotent records (posted as "yes" when ticked).
ALLOW_NOT_IDEMPOTENT = "allow_not_idempotent"
#: not_idempotent records a confirmation page names (with their notes); past these, it says how many more.
NOT_IDEMPOTENT_SHOWN = 100
#: What a replayed not_idempotent record's LogEntry adds: who let it run again, and on what word.
ALLOWED_NOTE = "; not_idempotent: replayed on the user's word that the effect did not happen"


@dataclass(frozen=True, slots=True, kw_only=True)
class Logged:
    """The fields of a record its LogEntry names (:data:`LOGGED`), named as the record is."""

    pk: int
    task_name: str
    task_id: str
    reason: str
    status: str

    def __str__(self) -> str:
        return record_name(task_name=self.task_name, task_id=self.task_id, reason=self.reason, status=self.status)


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


def _changed_keys(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k, object()) != after.get(k, object()))


class DeadLetterActions(admin.ModelAdmin):  # type: ignore[type-arg]
    """The actions and one-record replay pages of the dead letters' admin, with the permissions they check."""

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("guardrails.replay_deadletter")

    def has_discard_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("guardrails.discard_deadletter")

    def has_resolve_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("guardrails.resolve_deadletter")

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

        def message(record: Logged) -> str:
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

    def _log_changes(self, request: HttpRequest, ids: list[int], message: Callable[[Logged], str]) -> None:
        """One LogEntry per record, as ``log_change`` writes it, inserted :data:`LOG_BATCH` at a time (an action
        on 10,000 records is 20 INSERTs, not 10,000), the records read as the few fields a LogEntry names (a
        model instance each cost a replay of 10,000 half a second)."""
        content_type = ContentType.objects.get_for_model(DeadLetter, for_concrete_model=False)
        for start in range(0, len(ids), LOG_BATCH):
            chunk = DeadLetter.objects.filter(pk__in=ids[start : start + LOG_BATCH]).order_by("pk")
            records = [Logged(**fields) for fields in chunk.values(*LOGGED)]
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
        return [
            path("<int:pk>/replay/", replay, name="guardrails_deadletter_replay"),
            path("<int:pk>/edit-and-replay/", edit, name="guardrails_deadletter_edit_and_replay"),
            *super().get_urls(),
        ]

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
