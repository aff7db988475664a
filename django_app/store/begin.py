"""The first statement of a transaction sent with its ``BEGIN``: one round trip for both (PostgreSQL, psycopg 3).

Inside ``transaction.atomic()`` Django turns autocommit off, and psycopg sends ``BEGIN`` on its own, waiting for its
answer, before the transaction's first statement (``BaseConnection._start_query``; in pipeline mode too, which
syncs after it). A keyed ``atomic=True`` task writes its key as the first statement of its body's transaction
(:mod:`celery_guardrails.guardrails.effect_keys`): sent through a cursor, the key would cost that round trip and
its own, where plain Celery's transaction has only the latter's counterpart. :func:`first_with_begin` sends
``BEGIN`` and the statement as one simple-protocol message (the statement's arguments bound as literals by
psycopg's ``ClientCursor.mogrify``, as Django's default client-side binding does): psycopg then finds the
transaction open and sends no ``BEGIN`` of its own, and Django's ``atomic()`` commits or rolls it back as usual.

It is used only where nothing would miss the statement or its ``BEGIN``: psycopg 3 under Django's default
transaction (no isolation level, read-only or deferrable setting of the connection's own, which psycopg's
``BEGIN`` would carry), no ``connection.execute_wrapper()`` installed and no query logging (``DEBUG``), and the
transaction not begun yet. Elsewhere it returns None and the caller executes the statement through a cursor. A
database error is raised as Django's (``connection.wrap_database_errors``), as a cursor would raise it.

The Redis store's counterpart is the key's completion riding the message's ack (``send_complete_and_ack`` in
``celery_guardrails/stores/redis.py``): a key's write carried by a message the worker sends anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import connection

__all__ = ["first_with_begin"]


def first_with_begin(sql: str, params: Sequence[Any]) -> int | None:
    """Send ``sql`` with ``params`` (``%s`` placeholders) as the first statement of the transaction the caller's
    ``atomic()`` has just opened, in one message with its ``BEGIN``; the statement's row count. None when it cannot
    be sent so (see the module docstring): nothing was sent, and the caller executes it through a cursor."""
    if connection.vendor != "postgresql" or connection.execute_wrappers or connection.queries_logged:
        return None
    # As Django's own cursor does first: a connection kept across tasks that fails its health check is replaced.
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    raw = connection.connection
    pgconn = getattr(raw, "pgconn", None)  # psycopg 3 (psycopg2 has none)
    if pgconn is None or not _opening(raw, pgconn):
        return None
    # Imported here, not with the module: only a psycopg 3 connection comes this far (a project on SQLite, or on
    # psycopg2, that has psycopg 3 installed does not import it at start-up for this).
    import psycopg
    from psycopg import errors, generators, pq

    # The binding too raises as Django's: a value the database cannot hold (a NUL in a text) is refused here, as a
    # cursor's execute refuses it.
    with connection.wrap_database_errors, raw.lock:
        statement = psycopg.ClientCursor(raw).mogrify(sql, params)
        pgconn.send_query(b"BEGIN; " + statement.encode(raw.info.encoding))
        results = raw.wait(generators.execute(pgconn))
        for result in results:
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise errors.error_from_result(result, encoding=raw.info.encoding)
    return int(results[-1].command_tuples or 0)


def _opening(raw: Any, pgconn: Any) -> bool:
    """Whether psycopg would send a plain ``BEGIN`` before the next statement: autocommit off, no transaction
    begun, no transaction characteristics of the connection's own, not in pipeline mode."""
    from psycopg import pq

    if raw.autocommit or pgconn.transaction_status != pq.TransactionStatus.IDLE:
        return False
    if raw.isolation_level is not None or raw.read_only is not None or raw.deferrable is not None:
        return False
    try:
        return bool(pgconn.pipeline_status == pq.PipelineStatus.OFF)
    except Exception:  # a libpq without pipeline mode (before 14) cannot be in it
        return True
