"""Django's PostgreSQL backend for the test settings, with one change: a test that commits
(``django_db(transaction=True)``: every test with a real worker) leaves its tables emptied by ``DELETE``, not
``TRUNCATE``.

Django's flush truncates every table of the project (about 60, with their indexes) after each such test:
PostgreSQL gives each a new file and syncs them at commit, about 0.3 s on a quiet host and seconds under the
suite's load. The tables a test leaves hold a few rows, which ``DELETE`` removes in a few milliseconds. Nothing
else differs (the foreign keys are deferred, so the order of the tables does not matter within the flush's
transaction); sequences are not reset either way (``reset_sequences`` asks for Django's own flush). The content
types and permissions, which the flush's ``post_migrate`` signal would write again the same, are kept.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.postgresql import base, operations

#: Rows the migrations make and the flush's post_migrate signal makes again, the same, after every flush: kept.
KEPT = frozenset({"django_content_type", "auth_permission"})


class DatabaseOperations(operations.DatabaseOperations):  # type: ignore[misc]
    def sql_flush(
        self, style: Any, tables: Any, *, reset_sequences: bool = False, allow_cascade: bool = False
    ) -> list[str]:
        if reset_sequences or not tables:
            return super().sql_flush(  # type: ignore[no-any-return]
                style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
            )
        return [
            f"{style.SQL_KEYWORD('DELETE FROM')} {style.SQL_FIELD(self.quote_name(table))};"
            for table in tables
            if table not in KEPT
        ]


class DatabaseWrapper(base.DatabaseWrapper):  # type: ignore[misc]
    ops_class = DatabaseOperations
