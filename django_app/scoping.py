"""Tenant scoping of the admin (the ``admin_tenants`` option): which dead letters, ledger records and figures an
admin user sees and acts on.

Unset (the default), every user who may view dead letters sees every tenant's, as before: nothing here runs a
query or changes a page. Set, ``CELERY_GUARDRAILS["admin_tenants"]`` is one of:

* a callable, or a dotted path to one, ``admin_tenants(user)``: it returns an iterable of the tenant ids the user
  may see (``""`` among them: the records without a tenant), or :data:`ALL_TENANTS` for every tenant. It is
  asked for every user, superusers included, and its answer is final (one that wants superusers to see all says
  so: ``if user.is_superuser: return ALL_TENANTS``). A callable that raises, or returns anything else (``None``,
  a bare string, an id that is not a string), gives that user nothing, never everything; the error is logged
  with the user's id. It is asked once per request (the answer is kept on the request's user object).
* ``"permissions"``: a Django permission per tenant, ``guardrails.view_tenant_<tenant id>`` (made by
  :func:`tenant_permission`), and ``guardrails.view_all_tenants`` (made by ``migrate``) for every tenant and the
  records without one; an active superuser has every permission, so sees every tenant. A codename holds 100
  characters: a tenant id of 1 to :data:`TENANT_PERMISSION_MAX` (88) characters has its permission under its own
  name (no hash: the permissions a user holds are read back as the tenant ids a filter on the indexed tenant
  column needs); a longer one, like the records without a tenant, is seen only with ``view_all_tenants``
  (give such tenants a callable). Permissions are read with ``user.get_all_permissions()``.

What a user who does not see every tenant gets (a "scoped" user):

* dead letters: the change list, search, "select all", its filters' choices, the detail and history pages (an
  id of another tenant is a 404, exactly as an id that does not exist: existence does not leak), every action
  and its confirmation page (ids posted by hand go through the same scoped queryset), the replay and
  edit-and-replay pages, and the functions behind them: :func:`~.replay.replay_dead_letters` and
  :func:`~.replay.replay_with_changes` given a ``user`` leave out the records that user may not see, as ids
  without a record, and refuse to replay as a tenant the user may not see; :func:`~.maintenance.close_dead_letters`
  leaves them alone. The overview, the dashboard's chart and its open dead letters by owner (from the database;
  a Redis stream sink is not read for a scoped user). A replay's "failed again" link only to a record they see.
* the run ledger and schedule health: the ledger keeps no tenant; a schedule's tenant is its beat entry's
  (``options={"tenant": ...}``, a django-celery-beat row's headers, else its policy's ``tenant``: see
  :mod:`celery_guardrails.scheduling.beat`), the tenant ``""`` when it has none. A schedule that no longer has a policy
  has
  no known tenant: its records are seen only by users who see every tenant.
* concurrency slots and outbox messages, by their tenant column.
* nothing of what mixes every tenant or cannot be told apart by tenant: idempotency keys, dependency states
  (no page: 403), and on the dashboard the queues, rates, outbox backlog, dependencies and activity charts.

The tenant filter of a scoped user lists the tenants they may see that have records, one index probe each; the
filters of other columns list the distinct values among at most :data:`CHOICES_SAMPLE` of the user's records,
read through the tenant index (the indexes that give a column's values one probe each do not start with the
tenant, so an exact list would read every one of the user's records). A value past them is reached by its URL.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from django.contrib import admin
from django.db import DEFAULT_DB_ALIAS
from django.db.models import Count, Model, QuerySet
from django.http import Http404, HttpRequest

from celery_guardrails.exceptions import ConfigurationError, ContextError
from celery_guardrails.options import OPTIONS, load

from .models import DeadLetter
from .paging import DistinctValuesFilter, distinct_values

logger = logging.getLogger(__name__)

OPTION = "admin_tenants"
PERMISSIONS = "permissions"
APP_LABEL = "guardrails"
#: The permission that lets a user see every tenant with admin_tenants = "permissions".
ALL_CODENAME = "view_all_tenants"
#: A tenant's permission is this prefix and its id.
TENANT_PREFIX = "view_tenant_"
#: Longest tenant id with a permission of its own (Django's codename holds 100 characters).
TENANT_PERMISSION_MAX = 100 - len(TENANT_PREFIX)
#: Records a scoped user's filter choices (other than the tenant's) are read from at most.
CHOICES_SAMPLE = 10_000
#: Tenants probed for the tenant filter's choices at most.
PROBES = 1000
#: Records looked up per query when ids are checked against a user's scope.
BATCH = 500
#: What the dashboard says in place of the figures a scoped user does not see.
HIDDEN = "shown only to users who see every tenant (admin_tenants)"
#: Where a user's answer is kept for the rest of the request (Django keeps its permissions on the user likewise).
_CACHE = "_guardrails_visible_tenants"
_SCHEDULES_CACHE = "_guardrails_visible_schedules"
#: The setting as read when CELERY_GUARDRAILS itself cannot be (a value the cache keys the answer under).
_UNREADABLE = object()

M = TypeVar("M", bound=Model)


class AllTenants(enum.Enum):
    """The answer "every tenant" (:data:`ALL_TENANTS`)."""

    ALL_TENANTS = "all tenants"


#: What an ``admin_tenants`` callable returns for a user who sees every tenant.
ALL_TENANTS = AllTenants.ALL_TENANTS
#: The tenants a user may see: every one, or these ids ("" for the records without a tenant).
Visible = frozenset[str] | AllTenants


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """The ``admin_tenants`` option, checked and loaded: a permission per tenant, or a callable."""

    #: As set (a user's answer is kept with it: a changed setting is asked again).
    raw: Any
    by_permissions: bool
    function: Callable[[Any], Any] | None = None


def raw_option() -> Any:
    """``CELERY_GUARDRAILS["admin_tenants"]`` as set (None: unset). Read alone, so that another key set wrong
    does not change who sees what (``manage.py check`` names that one)."""
    from django.conf import settings

    configured = getattr(settings, "CELERY_GUARDRAILS", None) or {}
    if not isinstance(configured, Mapping):
        raise ConfigurationError("guardrails", f"must be a dict, got {type(configured).__name__}")
    return configured.get(OPTION)


def rule() -> Rule | None:
    """The option checked and its callable imported; None when unset. :class:`ConfigurationError` naming the
    option when it is set wrong (a bad value, a path that does not import, something that is not callable)."""
    raw = raw_option()
    if raw is None:
        return None
    try:
        OPTIONS[OPTION].check(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(OPTION, str(exc)) from None
    if raw == PERMISSIONS:
        return Rule(raw=raw, by_permissions=True)
    try:
        function = load(raw)
    except ConfigurationError as exc:
        raise ConfigurationError(OPTION, exc.problem) from None
    if not callable(function):
        raise ConfigurationError(OPTION, f"{raw!r:.80} is not callable")
    return Rule(raw=raw, by_permissions=False, function=function)


def configured() -> bool:
    """Whether ``admin_tenants`` is set at all (set wrong counts: nobody sees anything then)."""
    try:
        return raw_option() is not None
    except ConfigurationError:
        return True


def visible_tenants(user: Any) -> Visible:
    """The tenants ``user`` may see in the admin: :data:`ALL_TENANTS`, or their ids. Every tenant when the option
    is unset, and for ``user`` None (a caller acting as no user: a command, Python code); none when the option
    is set wrong or its callable fails for this user (logged)."""
    if user is None:
        return ALL_TENANTS
    user_id = getattr(user, "pk", None)
    try:
        raw = raw_option()
    except ConfigurationError:
        raw = _UNREADABLE
    if raw is None:
        return ALL_TENANTS
    # The answer is kept on the request's user, for the setting it was given under (asked once per request, even
    # when the setting is wrong: one error logged, not one per query of the page).
    kept: tuple[Any, Visible] | None = getattr(user, _CACHE, None)
    if kept is not None and kept[0] is raw:
        return kept[1]
    found: Visible
    try:
        current = rule()
    except ConfigurationError:
        logger.exception("admin_tenants is set wrong: user %s sees no tenant (manage.py check says why)", user_id)
        found = frozenset()
    else:
        assert current is not None  # (raw is set)
        found = _by_permissions(user) if current.by_permissions else _by_callable(current, user, user_id)
    setattr(user, _CACHE, (raw, found))
    return found


def _by_callable(current: Rule, user: Any, user_id: Any) -> Visible:
    assert current.function is not None
    name = current.raw if isinstance(current.raw, str) else getattr(current.raw, "__qualname__", "the callable")
    try:
        answer = current.function(user)
        if answer is ALL_TENANTS:
            return AllTenants.ALL_TENANTS
        if isinstance(answer, str | bytes) or not isinstance(answer, Iterable):
            raise TypeError(f"returned {type(answer).__name__}, not an iterable of tenant ids or ALL_TENANTS")
        tenants = frozenset(answer)
        odd = next((tenant for tenant in tenants if not isinstance(tenant, str)), None)
        if odd is not None:
            raise TypeError(f"returned a tenant id that is not a string: {type(odd).__name__}")
    except Exception:  # a failing callable must never mean "everything": this user sees nothing
        logger.exception("admin_tenants %s failed for user %s: they see no tenant", name, user_id)
        return frozenset()
    return tenants


def _by_permissions(user: Any) -> Visible:
    if user.has_perm(f"{APP_LABEL}.{ALL_CODENAME}"):
        return ALL_TENANTS
    prefix = f"{APP_LABEL}.{TENANT_PREFIX}"
    return frozenset(name[len(prefix) :] for name in user.get_all_permissions() if name.startswith(prefix)) - {""}


def sees_all(user: Any) -> bool:
    """Whether ``user`` sees every tenant (always, with the option unset)."""
    return visible_tenants(user) is ALL_TENANTS


def may_see(user: Any, tenant: str) -> bool:
    """Whether ``user`` may see the records of ``tenant`` ("": those without one)."""
    visible = visible_tenants(user)
    return visible is ALL_TENANTS or tenant in visible


def scope(queryset: QuerySet[M], user: Any, *, field: str = "tenant") -> QuerySet[M]:
    """``queryset`` limited to the records of the tenants ``user`` may see (``field`` holds a record's tenant):
    unchanged for a user who sees every tenant, empty for one who sees none."""
    visible = visible_tenants(user)
    if visible is ALL_TENANTS:
        return queryset
    if not visible:
        return queryset.none()
    return queryset.filter(**{f"{field}__in": sorted(visible)})


def visible_ids(ids: list[int], user: Any) -> list[int]:
    """The dead-letter ids among ``ids`` (in their order) whose records ``user`` may see: the others are left
    out, as ids without a record are. ``ids`` unchanged, and no query, for a user who sees every tenant."""
    if sees_all(user):
        return ids
    seen: set[int] = set()
    for start in range(0, len(ids), BATCH):
        chunk = DeadLetter.objects.filter(pk__in=ids[start : start + BATCH])
        seen.update(scope(chunk, user).values_list("pk", flat=True))
    return [pk for pk in ids if pk in seen]


def replayable(ids: list[int], *, user: Any, tenant: str | None) -> tuple[list[int], list[tuple[int, str]]]:
    """For a replay by ``user`` (optionally as ``tenant``): (the ids it may replay, the refused ones with why).
    Records the user may not see are left out (as ids without a record); replaying as a tenant the user may not
    see is refused for every record (it would run their arguments as that tenant)."""
    ids = visible_ids(ids, user)
    if tenant is not None and not may_see(user, tenant):
        return [], [(pk, f"tenant {tenant!r:.80} is not one you may see (admin_tenants)") for pk in ids]
    return ids, []


def linked(queryset: QuerySet[M], record: Any) -> QuerySet[M]:
    """``queryset`` (records a page links to from ``record``) limited to what the user the admin fetched
    ``record`` for may see; nothing when the option is set and the record came some other way."""
    viewer = getattr(record, "guardrails_viewer", None)
    if viewer is None:
        return queryset.none() if configured() else queryset
    return scope(queryset, viewer)


# The run ledger: a schedule's tenant is its beat entry's.

_WARNED: set[str] = set()


def visible_schedules(user: Any, app: Any) -> frozenset[str] | AllTenants:
    """The names of the schedules whose ledger ``user`` may see: :data:`ALL_TENANTS`, or the guarded beat entries
    (enabled or not) of a tenant they may see; none when the schedules setting cannot be read (logged)."""
    visible = visible_tenants(user)
    if visible is ALL_TENANTS:
        return ALL_TENANTS
    if not visible:
        return frozenset()
    # Kept on the request's user as the tenants are: a ledger page asks four times (its queryset, its filter, its
    # parameters' check, the filter's choices), and each read of the entries may query django-celery-beat's rows.
    kept: tuple[Any, frozenset[str], frozenset[str]] | None = getattr(user, _SCHEDULES_CACHE, None)
    if kept is not None and kept[0] is app and kept[1] == visible:
        return kept[2]
    from celery_guardrails.scheduling.beat import all_configured_entries

    try:
        entries, disabled = all_configured_entries(app, warned=_WARNED)
    except ConfigurationError:
        logger.warning("admin_tenants: the schedules setting cannot be read; user %s sees no schedule", user.pk)
        return frozenset()
    found = frozenset(name for name, entry in {**disabled, **entries}.items() if (entry.tenant or "") in visible)
    setattr(user, _SCHEDULES_CACHE, (app, visible, found))
    return found


def schedules_seen(items: list[Any], user: Any, app: Any) -> list[Any]:
    """The items (anything with a ``schedule`` name: schedule-health lines, status lines) ``user`` may see."""
    names = visible_schedules(user, app)
    return items if names is ALL_TENANTS else [item for item in items if item.schedule in names]


# The dashboard.


def status_for(app: Any, user: Any) -> Any:
    """:func:`celery_guardrails.operations.status.gather` for a user who sees every tenant; for a scoped user, their
    open
    dead letters (from the database) and their schedules, the figures of every tenant together left out and
    named in ``errors`` (:data:`HIDDEN`)."""
    from celery_guardrails.operations import status

    if sees_all(user):
        return status.gather(app)
    found = status.Status(at=time.time())
    for source in (status.QUEUES, status.DEPENDENCIES, status.OUTBOX):
        found.errors[source] = HIDDEN
    letters = status.attempt(status.DEAD_LETTERS, lambda: _open_dead_letters(user), found.errors)
    found.dead_letters = letters or status.DeadLetters(counts=[])
    schedules = status.attempt(status.SCHEDULES, lambda: status.read_schedules(app), found.errors) or []
    found.schedules = schedules_seen(schedules, user, app)
    return found


def _open_dead_letters(user: Any) -> Any:
    from celery_guardrails.operations.status import DeadLetterCount, DeadLetters

    rows = scope(DeadLetter.objects.open(), user).order_by().values("owner", "task_name").annotate(n=Count("pk"))
    counts = [DeadLetterCount(owner=row["owner"] or "", task=row["task_name"], open=row["n"]) for row in rows]
    return DeadLetters(counts=sorted(counts, key=lambda count: (count.owner, count.task)))


# Permissions (admin_tenants = "permissions").


def tenant_codename(tenant: str) -> str:
    """The codename of ``tenant``'s permission; :class:`ContextError` for "" and ids past
    :data:`TENANT_PERMISSION_MAX` characters (only ``view_all_tenants`` lets a user see those)."""
    if not isinstance(tenant, str) or not 0 < len(tenant) <= TENANT_PERMISSION_MAX:
        raise ContextError(
            f"a tenant permission needs a tenant id of 1 to {TENANT_PERMISSION_MAX} characters, got {tenant!r:.100}; "
            f"records of others are seen with {APP_LABEL}.{ALL_CODENAME} (or give admin_tenants a callable)"
        )
    return TENANT_PREFIX + tenant


def tenant_permission(tenant: str) -> Any:
    """The permission that lets a user see ``tenant`` (made when missing), e.g.
    ``group.permissions.add(tenant_permission("acme"))``."""
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType

    codename = tenant_codename(tenant)
    content_type = ContentType.objects.get_for_model(DeadLetter)
    permission, _ = Permission.objects.get_or_create(
        content_type=content_type, codename=codename, defaults={"name": f"Can view tenant {tenant}"[:255]}
    )
    return permission


def create_permissions(*, using: str = DEFAULT_DB_ALIAS, apps: Any = None, **kwargs: Any) -> None:
    """After ``migrate`` (a ``post_migrate`` receiver): make ``guardrails.view_all_tenants``, so that it can be
    given in the admin before anyone needs it."""
    from django.apps import apps as global_apps

    registry = apps or global_apps
    try:
        content_types = registry.get_model("contenttypes", "ContentType")
        permissions = registry.get_model("auth", "Permission")
    except LookupError:  # auth or contenttypes not installed: no permissions to make
        return
    content_type, _ = content_types.objects.using(using).get_or_create(app_label=APP_LABEL, model="deadletter")
    permissions.objects.using(using).get_or_create(
        content_type=content_type,
        codename=ALL_CODENAME,
        defaults={"name": "Can view every tenant's dead letters and run ledger"},
    )


# The admin.


class ScopedValuesFilter(DistinctValuesFilter):
    """:class:`~.paging.DistinctValuesFilter` for a scoped user: the values of their own records only (see the
    module docstring), asked of the ModelAdmin (:meth:`TenantScopedAdmin.scoped_choices`) when the filter is
    shown."""

    def values(self) -> list[Any]:
        return self._model_admin.scoped_choices(self._request, self._field, limit=self.limit)  # type: ignore[no-any-return]


def values_with_records(queryset: QuerySet[Any], field: str, candidates: Iterable[str], *, limit: int) -> list[str]:
    """The first ``limit`` of ``candidates`` (in order) that ``field`` holds in some record of ``queryset``: one
    index probe each, :data:`PROBES` at most."""
    found: list[str] = []
    for probed, value in enumerate(candidates):
        if len(found) >= limit or probed >= PROBES:
            break
        if queryset.filter(**{field: value}).exists():
            found.append(value)
    return found


def sampled_values(queryset: QuerySet[Any], field: str, *, limit: int) -> list[Any]:
    """The distinct non-null values of ``field`` among at most :data:`CHOICES_SAMPLE` records of ``queryset``
    (unordered: read through whichever index its filter uses), the first ``limit`` in order."""
    values = set(queryset.order_by().values_list(field, flat=True)[:CHOICES_SAMPLE])
    return sorted(value for value in values if value is not None)[:limit]


class TenantScopedAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """A ModelAdmin whose records carry a tenant (:attr:`tenant_field`), shown and acted on only within the
    tenants the user may see: its queryset (the change list, search, filters, actions, "select all"), its
    objects (another tenant's id is a 404), its filters' choices. Unchanged with the option unset."""

    #: The model field that holds a record's tenant.
    tenant_field = "tenant"

    def scope_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """The hook: ``queryset`` limited to what the request's user may see."""
        return scope(queryset, getattr(request, "user", None), field=self.tenant_field)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return self.scope_queryset(request, super().get_queryset(request))

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        found = super().get_object(request, object_id, from_field)
        if found is None and configured():
            # Django redirects with "does not exist" for a missing id; another tenant's id must not differ from
            # a missing one, and a 404 says both plainly.
            raise Http404(f"No {self.opts.verbose_name} matches the given query.")
        if found is not None:
            found.guardrails_viewer = request.user  # what its page links to is scoped for them (linked())
        return found

    def get_list_filter(self, request: HttpRequest) -> Any:
        filters = super().get_list_filter(request)
        if not configured() or sees_all(getattr(request, "user", None)):
            return filters
        return [
            (item[0], ScopedValuesFilter) if isinstance(item, tuple) and item[1] is DistinctValuesFilter else item
            for item in filters
        ]

    def allowed_values(self, request: HttpRequest, field: str) -> Iterable[str] | None:
        """The values of ``field`` a scoped user may see, when their scope is a set of them (the tenant column);
        None for the other columns."""
        visible = visible_tenants(request.user)
        return sorted(visible) if field == self.tenant_field and visible is not ALL_TENANTS else None

    def scoped_choices(self, request: HttpRequest, field: Any, *, limit: int) -> list[Any]:
        """The choices of the filter on ``field`` for the request's user (see the module docstring)."""
        if sees_all(request.user):
            return distinct_values(self.model, field.column, limit=limit)
        allowed = self.allowed_values(request, field.name)
        if allowed is not None:
            return values_with_records(self.model._default_manager.all(), field.name, allowed, limit=limit)
        return sampled_values(self.get_queryset(request), field.name, limit=limit)


class ScheduleScopedAdmin(TenantScopedAdmin):
    """The run ledger's ModelAdmin: records of the schedules whose tenant the user may see (the ledger keeps no
    tenant: a schedule's is its beat entry's, see :func:`visible_schedules`)."""

    def _schedules(self, request: HttpRequest) -> frozenset[str] | AllTenants:
        from .health import celery_app

        return visible_schedules(request.user, celery_app())

    def scope_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        names = self._schedules(request)
        if names is ALL_TENANTS:
            return queryset
        return queryset.filter(schedule__in=sorted(names)) if names else queryset.none()

    def allowed_values(self, request: HttpRequest, field: str) -> Iterable[str] | None:
        names = self._schedules(request) if field == "schedule" else ALL_TENANTS
        return None if names is ALL_TENANTS else sorted(names)


class AllTenantsOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """A ModelAdmin of a table that holds every tenant's rows together and cannot be filtered by one (idempotency
    keys, dependency states): only users who see every tenant see it (others: not listed, 403)."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return sees_all(request.user) and super().has_view_permission(request, obj)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return sees_all(request.user) and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return sees_all(request.user) and super().has_delete_permission(request, obj)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        queryset = super().get_queryset(request)
        return queryset if sees_all(request.user) else queryset.none()
