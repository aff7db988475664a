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
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connection, models
from django.utils.functional import cached_property


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
        # A list of values where Django has a queryset of them: the filter only iterates it.
        self.lookup_choices = distinct_values(model, field.column, limit=self.limit)  # type: ignore[assignment]


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
