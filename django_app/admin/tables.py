"""The internal tables, to look at (and to delete a row from, as a last resort): idempotency keys, concurrency
slots, the transactional outbox and the dependencies' circuit and budget states. Rows are written by workers,
never typed in (no Add, no Save); the tables that hold every tenant's rows together are shown only to users who
see every tenant."""

from __future__ import annotations

from datetime import UTC, datetime

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from ..display import EMPTY, escape, moment_html, time_column
from ..models import ConcurrencySlot, DependencyState, IdempotencyKey, OutboxMessage
from ..paging import CappedCountPaginator
from ..scoping import AllTenantsOnlyAdmin, TenantScopedAdmin
from .common import tenant_html


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
        return tenant_html(obj.tenant)  # "-" when absent, as on every page

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
        return tenant_html(obj.tenant)  # "-" when absent, as on every page

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
