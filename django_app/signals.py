"""Signal receivers of the Django app: a worker's database connection that broke is dropped before the next task.

Celery's Django fixup closes every connection before and after each task, unless ``CELERY_DB_REUSE_MAX`` is set
(what the system check ``guardrails.W006`` advises for the Django store: a new PostgreSQL connection per task is
most of the store's cost). With it set, a connection the server dropped (a restart, a failover, a proxy's idle
timeout) stays in the process: Django closes an unusable connection only at a request's start and end, which a
worker has none of, so every task would fail on it until Celery's count closes it (``2 x CELERY_DB_REUSE_MAX``
tasks later). Before each task, and when the store meets a database it cannot reach, a connection that has
seen an error and no longer answers is closed here, so the next query connects again. A healthy connection
costs nothing: the check asks the server only after an error.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from django.db import connections

logger = logging.getLogger(__name__)


def drop_broken_connections(**_: Any) -> None:
    """Close this thread's database connections that have seen an error and no longer answer (outside a
    transaction: one inside it is the transaction's to end). Never raises: it runs on the store's failure path,
    where an error of its own would take the place of the store's (an outage, which gives the message back)."""
    with contextlib.suppress(Exception):
        for connection in connections.all(initialized_only=True):
            if connection.connection is None or not connection.errors_occurred or connection.in_atomic_block:
                continue
            with contextlib.suppress(Exception):
                if connection.is_usable():
                    connection.errors_occurred = False
                    continue
                logger.info("Database connection %r is broken: closed, the next query connects again", connection.alias)
                connection.close()


def connect() -> None:
    """Connect the receivers (the app's ``ready``)."""
    from celery.signals import task_prerun

    task_prerun.connect(drop_broken_connections, weak=False, dispatch_uid="django_celery_guardrails.connections")
