"""The dead letters' "all matching" pages: replay, discard or resolve every open record the change list's filter
matches, in the background (:mod:`..bulk`).

The change list links them when it is filtered (``bulk/<action>/`` with its own query string). The page says how
many open records the filter matches and, for a replay, what the replay's own check refuses among the first
:data:`DRY_RUN_LIMIT` of them, by reason (the job reports every refusal); the ``not_idempotent`` ones need the
page's tick. Confirmed, it starts the job (the permission checked, the filter frozen to the records the page
counted) and opens the job's page: its progress, its state, its cancel (the jobs' own page and action).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import BadRequest, PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest, QueryDict
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse

from ..bulk import ACTIONS, Matching, start
from ..paging import check_parameters
from ..replay import refusals
from .dead_letter_actions import _allowed, _not_idempotent

#: Records the page's dry run asks the replay about (the job asks about every one as it runs).
DRY_RUN_LIMIT = 2_000
#: The change list's parameters a bulk action takes, and the filter field each sets; the paging and ordering ones
#: are left out, and the status (a bulk action takes the open records).
PARAMETERS = {
    "reason": "reason",
    "reason__exact": "reason",
    "task_name": "task_name",
    "task_name__exact": "task_name",
    "owner": "owner",
    "owner__exact": "owner",
    "tenant": "tenant",
    "tenant__exact": "tenant",
    "fingerprint": "fingerprint",
    "q": "search",
    "last_failed_at__gte": "failed_since",
    "last_failed_at__lt": "failed_before",
}
IGNORED = frozenset({"status", "status__exact", "o", "p", "all", "_changelist_filters"})


def filters_of(query: QueryDict) -> dict[str, str]:
    """The bulk filter a change list's query string says; BadRequest naming a parameter it cannot take."""
    found: dict[str, str] = {}
    for name, value in query.items():  # (the last value of each, as Django's change list reads it)
        # An empty search is no search; an empty filter value is one (the list's "-": no owner, no tenant)
        if name in IGNORED or (value == "" and name == "q"):
            continue
        if name not in PARAMETERS:
            raise BadRequest(f"{name!r} is not a filter an action on all matching records takes")
        found[PARAMETERS[name]] = str(value)
    return found


class DeadLetterBulk(admin.ModelAdmin):  # type: ignore[type-arg]
    """The "all matching" pages of the dead letters' admin (see the module docstring)."""

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view(self.bulk_view)
        return [path("bulk/<str:action>/", view, name="guardrails_deadletter_bulk"), *super().get_urls()]

    def bulk_view(self, request: HttpRequest, action: str) -> HttpResponse:
        if action not in ACTIONS:
            raise Http404(f"no bulk action {action!r}")
        if not request.user.has_perm(ACTIONS[action][0]):
            raise PermissionDenied
        try:
            check_parameters(self, request)  # what the change list itself takes (NUL, unknown lookups, bad dates)
            filters = filters_of(request.GET)
        except BadRequest as why:
            return HttpResponseBadRequest(f"Bad request: {why}\n", content_type="text/plain; charset=utf-8")
        matching = Matching.now(**filters)
        if request.method == "POST" and request.POST.get("post"):
            try:  # the records the page counted: none recorded since
                matching = replace(matching, up_to=min(matching.up_to, int(request.POST["up_to"])))
            except (KeyError, ValueError):
                return HttpResponseBadRequest("Bad request: up_to\n", content_type="text/plain; charset=utf-8")
            job = start(action, matching, user=request.user, allow_not_idempotent=_allowed(request))
            self.message_user(
                request,
                f"Started job {job.pk}: {action} of the open dead letters matching {matching.described()}.",
                messages.SUCCESS,
            )
            return redirect(reverse("admin:guardrails_job_change", args=[job.pk]))
        records = matching.records(request.user)
        count = records.count()
        refused: Counter[str] = Counter()
        looked = 0
        if action == "replay":
            # The replay's own check, as the job will ask it (the not_idempotent ones are the tick's business)
            ids = list(records.order_by("pk").values_list("pk", flat=True)[:DRY_RUN_LIMIT])
            looked = len(ids)
            refused.update(why for _, why in refusals(ids, allow_not_idempotent=True) if why)
        context = {
            **(_not_idempotent(records) if action == "replay" else {}),
            **self.admin_site.each_context(request),
            "title": f"Are you sure you want to {action} all {count} matching dead letters?",
            "verb": f"{action} all {count} in the background",
            "opts": self.model._meta,
            "action": "",
            "bulk_action": action,
            "count": count,
            "described": matching.described(),
            "up_to": matching.up_to,
            "refused": refused.most_common(),
            "looked": looked,
            "select_across": False,
            "selected": [],
        }
        return TemplateResponse(request, "admin/guardrails/deadletter/bulk_confirm.html", context)
