"""Change lists over big tables: a paginator that never counts a whole table, and a list filter that never scans
one (the dead-letter table holds millions of records; see ``bench/scale.py``).

:class:`CappedCountPaginator` counts at most :attr:`~CappedCountPaginator.cap` rows (10,000): one ``SELECT
COUNT(*) FROM (SELECT ... LIMIT 10001)``, which reads at most that many index entries whatever the filter
matches, and is exact below the cap. Past it the count shows as ``10000+``: the pages reach the first 10,000
records, enough to look through; a narrower filter or a search finds the rest. The unfiltered list on
PostgreSQL shows the planner's estimate of the table's rows instead (``pg_class.reltuples``, kept by
autovacuum's ANALYZE; shown as ``~1000000``) and runs no COUNT at all: a whole-table count is what makes an
admin page slow at a million rows, and the estimate is what a look at the whole table needs. An estimate of a
filter (EXPLAIN's row guess) was not taken: it can be off by orders of magnitude, and a cap is exact where it
matters (a few records).

:class:`DistinctValuesFilter` replaces Django's ``AllValuesFieldListFilter``, whose choices are a ``SELECT
DISTINCT`` over the whole table on every page view: it reads one index entry per distinct value (a loose index
scan written as a recursive query, on PostgreSQL and SQLite alike) and lists at most
:attr:`~DistinctValuesFilter.limit` values, in order; a value past them is reached by its URL
(``?tenant=acme``).

:class:`CheckedChangeList` (a ModelAdmin mixin) takes from a change list's URL only what the list declares: its
filters' own parameters and equality on each filtered field (``?status=open``: the filter's index), the date
hierarchy's, and Django's search, paging and ordering ones. Any other lookup (``?exc_message__icontains=``,
``?kwargs__has_key=``: a scan of the whole table, through no index) is a 400 naming the parameter (its
``lookup_allowed``, Django's own hook, says no as well, for any other path), and so is a value no query can
take: a NUL character (PostgreSQL refuses it in text: a 500 otherwise), a date hierarchy or date filter
outside the years 2 to 9998 (Django computes the next day or year, past the calendar), a selected row that is
not a whole number. 400 rather than Django's redirect with ``?e=1``: the URL was made by hand, not by a link
of the page, and a redirect would hide which parameter was wrong.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import get_fields_from_path
from django.contrib.admin.views.main import ERROR_FLAG, IGNORED_PARAMS, PAGE_VAR
from django.core.exceptions import BadRequest
from django.core.paginator import Paginator
from django.db import connection, models
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.utils.dateparse import parse_date, parse_datetime
from django.utils.functional import cached_property

from .display import escape
from .management.arguments import DIGITS, YEARS

# YEARS, the years a date in a change list's URL may name: Django adds a day or a year to it (the date hierarchy's
# upper bound) and converts it between time zones, which must stay inside datetime's years 1 to 9999; DIGITS, a
# row id an action may name (a whole number a bigint holds): the commands' own rules (management.arguments).
#: The parameters of every change list that are no lookup: search, ordering, paging, "show all", facets...
TAKEN = frozenset({*IGNORED_PARAMS, PAGE_VAR, ERROR_FLAG})


class AtLeast(int):
    """A count that stopped at its cap: shown as ``10000+`` (in the paginator, "Select all", "All selected")."""

    def __str__(self) -> str:
        return f"{int(self)}+"

    __repr__ = __str__


class About(int):
    """The planner's estimate of a table's rows: shown as ``~1000000``."""

    def __str__(self) -> str:
        return f"~{int(self)}"

    __repr__ = __str__


def estimated_rows(model: type[models.Model]) -> int:
    """PostgreSQL's estimate of the rows of ``model``'s table (-1: never analyzed, or not PostgreSQL)."""
    if connection.vendor != "postgresql":
        return -1
    with connection.cursor() as cursor:
        cursor.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%s)", [model._meta.db_table])
        row = cursor.fetchone()
    return int(row[0]) if row and row[0] is not None else -1


class CappedCountPaginator(Paginator):  # type: ignore[type-arg]
    """Counts at most ``cap`` rows; the unfiltered table on PostgreSQL is estimated (see the module docstring)."""

    cap = 10_000

    @cached_property
    def count(self) -> int:
        if not isinstance(self.object_list, models.QuerySet):
            return len(self.object_list)
        if not self.object_list.query.where and (estimate := estimated_rows(self.object_list.model)) > self.cap:
            return About(estimate)
        # Unordered: any cap + 1 matching rows will do, read from whichever index the filter uses.
        found = self.object_list.order_by()[: self.cap + 1].count()
        return AtLeast(self.cap) if found > self.cap else int(found)


class DistinctValuesFilter(admin.AllValuesFieldListFilter):
    """A column's distinct values, one index probe each, at most ``limit`` (see the module docstring). The column
    needs an index that starts with it."""

    limit = 100

    def __init__(
        self,
        field: Any,
        request: Any,
        params: dict[str, Any],
        model: type[models.Model],
        model_admin: Any,
        field_path: str,
    ) -> None:
        super().__init__(field, request, params, model, model_admin, field_path)
        self._model, self._field, self._request, self._model_admin = model, field, request, model_admin

    def values(self) -> list[Any]:
        """The values offered (the hook a scoped admin's filter overrides: see ``scoping.ScopedValuesFilter``)."""
        return distinct_values(self._model, self._field.column, limit=self.limit)

    def choices(self, changelist: Any) -> Any:
        # Read when the filter is shown, not when it is made (CheckedChangeList makes one to learn its
        # parameters): a list of values where Django has a queryset of them, which the filter only iterates.
        self.lookup_choices = self.values()  # type: ignore[assignment]
        for choice in super().choices(changelist):
            # A stored value, shown with its control and invisible characters written out (.display)
            yield {**choice, "display": escape(choice["display"], html=True)}


def distinct_values(model: type[models.Model], column: str, *, limit: int) -> list[Any]:
    """The first ``limit`` distinct non-null values of ``column``, in order: each found by one probe of an index
    on it (the smallest value greater than the last one found)."""
    table, name = connection.ops.quote_name(model._meta.db_table), connection.ops.quote_name(column)
    sql = (
        f"WITH RECURSIVE found(value) AS ("
        f" SELECT (SELECT {name} FROM {table} WHERE {name} IS NOT NULL ORDER BY {name} LIMIT 1)"
        f" UNION ALL"
        f" SELECT (SELECT {name} FROM {table} WHERE {name} > found.value ORDER BY {name} LIMIT 1)"
        f" FROM found WHERE found.value IS NOT NULL"
        f") SELECT value FROM found WHERE value IS NOT NULL LIMIT %s"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [limit])
        return [row[0] for row in cursor.fetchall()]


class CheckedChangeList:
    """A ModelAdmin mixin: the change list takes only the parameters it declares, with values a query can take
    (see the module docstring); anything else is a 400."""

    def lookup_allowed(self, lookup: str, value: Any, request: HttpRequest | None = None) -> bool:
        allowed = lookup in declared_parameters(self, request)
        return allowed and super().lookup_allowed(lookup, value, request)  # type: ignore[misc]

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        try:
            check_parameters(self, request)
        except BadRequest as why:  # answered here: Django would log a traceback for a URL typed by hand
            return HttpResponseBadRequest(f"Bad request: {why}\n", content_type="text/plain; charset=utf-8")
        return super().changelist_view(request, extra_context)  # type: ignore[misc,no-any-return]


def declared_parameters(model_admin: Any, request: HttpRequest | None) -> frozenset[str]:
    """The lookups a change list's URL may use: each list filter's expected parameters (each filter made with no
    parameters: no query), equality on each filtered field (``?status=open`` as well as the filter's own
    ``?status__exact=open``: the same index), and the date hierarchy's year, month and day."""
    model = model_admin.model
    names: set[str] = set()
    for item in model_admin.get_list_filter(request):
        if isinstance(item, str | tuple | list):
            field_path, kind = (item, admin.FieldListFilter.create) if isinstance(item, str) else item
            field = get_fields_from_path(model, field_path)[-1]
            names.update(kind(field, request, {}, model, model_admin, field_path=field_path).expected_parameters())
            names.update((field_path, f"{field_path}__exact"))
        else:  # a SimpleListFilter
            names.update(item(request, {}, model, model_admin).expected_parameters())
    if model_admin.date_hierarchy:
        names.update(f"{model_admin.date_hierarchy}__{part}" for part in ("year", "month", "day"))
    return frozenset(names)


def check_parameters(model_admin: Any, request: HttpRequest) -> None:
    """:class:`~django.core.exceptions.BadRequest` (400) naming the first parameter of ``request`` that no query
    of the change list could take (see the module docstring)."""
    for key, values in [*request.GET.lists(), *request.POST.lists()]:
        if "\x00" in key or any("\x00" in value for value in values):
            raise BadRequest(f"the parameter {key!r} holds a NUL character, which no stored value holds")
    declared = declared_parameters(model_admin, request)
    for key in request.GET:
        if key not in declared and key not in TAKEN:  # (lookup_allowed would refuse it too, unexplained)
            raise BadRequest(f"the list has no filter {key!r} (its filters are the ones in its side bar)")
    if request.method == "POST":
        # A model whose ids are not numbers (a job's UUID) says what its ids look like.
        ids = getattr(model_admin, "selected_id_pattern", DIGITS)
        for value in request.POST.getlist(ACTION_CHECKBOX_NAME):
            if not ids.fullmatch(value):
                raise BadRequest(f"a selected row {value[:40]!r} is not a record id")
    hierarchy = model_admin.date_hierarchy
    # (Django reads month and day only with a year; without one they would be lookups of their own.)
    if hierarchy and any(f"{hierarchy}__{part}" in request.GET for part in ("year", "month", "day")):
        parts = [
            request.GET.get(f"{hierarchy}__{part}", "" if part == "year" else "1") for part in ("year", "month", "day")
        ]
        try:
            day = date(*(int(part) for part in parts)) if all(p.isascii() and p.isdigit() for p in parts) else None
        except (ValueError, OverflowError):
            day = None
        if day is None or day.year not in YEARS:
            raise BadRequest(f"the date {'-'.join(parts)!r} is not a day of the years {YEARS[0]} to {YEARS[-1]}")
    for key in declared:
        if key.endswith(("__gte", "__lt")) and key in request.GET:
            value = request.GET[key].strip()
            try:
                moment: date | datetime | None = parse_datetime(value) or parse_date(value)
            except ValueError:  # a date-like text that is no date: Django's filter refuses it (?e=1)
                moment = None
            if moment is not None and moment.year not in YEARS:
                raise BadRequest(f"the parameter {key!r} names a year outside {YEARS[0]} to {YEARS[-1]}")
