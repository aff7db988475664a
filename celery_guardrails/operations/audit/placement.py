"""The placement axis (GA0xx): what runs in the background and how a request hands it over. The app's config
(``task_always_eager``, RabbitMQ without publisher confirms, the Django store on a database whose connections
Celery closes around every task) and the project's source as :mod:`celery_guardrails.operations.audit_source`
reads it (publishes inside a database transaction, waits on a task's result in a request or in a script), one
finding per file with its lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from celery_guardrails.operations import audit_source
from celery_guardrails.operations.audit.model import ERROR, INFO, WARNING, Finding, finding
from celery_guardrails.runtime.outbox import confirms_off

#: Sites a file-level finding lists before "and N more".
SHOWN_SITES = 10


def _sites(sites: Iterable[audit_source.Site]) -> dict[str, list[audit_source.Site]]:
    by_file: dict[str, list[audit_source.Site]] = {}
    for site in sites:
        by_file.setdefault(site.path, []).append(site)
    return by_file


def _lines(sites: list[audit_source.Site]) -> str:
    shown = ", ".join(
        f"{site.line}" + ("" if site.function == "<module>" else f" ({site.function})") for site in sites[:SHOWN_SITES]
    )
    more = f" and {len(sites) - SHOWN_SITES} more" if len(sites) > SHOWN_SITES else ""
    return ("line " if len(sites) == 1 else "lines ") + shown + more


def connection_rules(app: Any, *, pool: Any = None, database: Mapping[str, Any] | None = None) -> list[Finding]:
    """GA006: the Django store on a database server while Celery's Django fixup closes the database connections
    before and after every task: ``CELERY_DB_REUSE_MAX`` unset, and no Django pool (Django 5.1+, ``OPTIONS:
    {"pool": True}``) that the close hands the connection back to; under prefork, Celery closes that pool with
    every task too (celery/celery#10554). Each guarded task then opens a connection of its own (docs/performance.md
    measures it). ``pool``: the worker's pool (its ``pool_cls``), else the app's ``worker_pool``; ``database``:
    the settings of the store's database, else Django's ``DATABASES["default"]``. The audit's finding, the system
    check ``guardrails.W006`` and a worker's start-up warning."""
    from celery_guardrails.exceptions import ConfigurationError
    from celery_guardrails.operations.alert_channels import django_configured
    from celery_guardrails.stores import store_url

    try:
        if store_url(app) != "django" or not django_configured():
            return []
    except ConfigurationError:
        return []
    # (Celery keeps its fixups in app._fixups, no public name; without its Django fixup nothing closes them)
    fixups = getattr(app, "_fixups", None) or []
    if app.conf.get("CELERY_DB_REUSE_MAX") or not any(type(f).__name__ == "DjangoFixup" for f in fixups):
        return []
    if database is None:
        from django.conf import settings

        database = settings.DATABASES.get("default", {})
    if "sqlite" in str(database.get("ENGINE", "")):
        return []  # a file opened, not a server's connection
    # A name ("prefork") or the worker's class (celery.concurrency.prefork.TaskPool), as Celery tells them apart.
    prefork = "prefork" in str(pool if pool is not None else app.conf.worker_pool).lower()
    pooled = bool((database.get("OPTIONS") or {}).get("pool"))
    if pooled and not prefork:
        return []
    why = (
        "Django's pool is on, but under the prefork pool Celery closes the pool itself after every task "
        "(celery/celery#10554)"
        if pooled
        else "no Django pool takes the closed connection back"
    )
    return [
        finding(
            "GA006",
            WARNING,
            "CELERY_DB_REUSE_MAX",
            "the guardrails store is the Django database, and Celery's Django fixup closes its connections before "
            f"and after every task (CELERY_DB_REUSE_MAX is unset; {why}): each guarded task opens a new "
            "connection, milliseconds of its own on PostgreSQL (docs/performance.md)",
            "set CELERY_DB_REUSE_MAX (e.g. 1000: Celery then closes them every 2,000 tasks; the guardrails drop a "
            "broken connection before each task); or, with a threads or solo pool, Django's pool "
            "(DATABASES['default']['OPTIONS']['pool'] = True, Django 5.1+ and psycopg 3)",
        )
    ]


def placement_rules(app: Any, walked: audit_source.Walk) -> list[Finding]:
    """Placement (GA0xx): eager tasks, publishers without confirms, the Django store's connections closed around
    every task, and the source's publishes inside a transaction and waits on a result, one finding per file."""
    found = connection_rules(app)
    if app.conf.task_always_eager:
        found.append(
            finding(
                "GA001",
                ERROR,
                "task_always_eager",
                "task_always_eager is on: .delay() and .apply_async() run the task in the caller (the request), "
                "not on a worker: no queue, no ack, no redelivery",
                "turn task_always_eager off outside tests (CELERY_TASK_ALWAYS_EAGER); to test tasks on a real "
                "worker, use the test kit (celery_guardrails.testing)",
            )
        )
    if not walked.complete:
        found.append(
            finding(
                "GA009",
                INFO,
                "source",
                f"the source under {walked.root} was not read whole ({walked.why_incomplete}): what was not read "
                "is not graded",
                "point --source (or BASE_DIR) at the project's own code, without virtualenvs or data folders",
            )
        )
    if confirms_off(app):
        found.append(
            finding(
                "GA005",
                WARNING,
                "broker_transport_options",
                "RabbitMQ without publisher confirms: a publish the broker refuses (an exchange that does not "
                "exist, a message over max_message_size) returns as if it were sent; the message is lost and the "
                "refusal fails the next publish on the channel instead. The outbox relay confirms its own "
                "publishes; .delay() and .apply_async() do not",
                "set broker_transport_options = {'confirm_publish': True} (CELERY_BROKER_TRANSPORT_OPTIONS): each "
                "publish then waits for the broker's confirm (a round trip) and a refusal raises in it",
            )
        )
    placement = audit_source.read_placement(walked)
    for path, sites in sorted(_sites(placement.in_transaction).items()):
        found.append(
            finding(
                "GA002",
                WARNING,
                path,
                f"publishes a task inside a database transaction, {_lines(sites)}: the worker can run it before "
                "the commit (the rows it reads are not there yet), or for a transaction that rolls back",
                "publish after the commit: task.delay_on_commit(...) / apply_async_on_commit(...), "
                "transaction.on_commit(lambda: task.delay(...)), or the outbox (task.enqueue_in_transaction(...)) "
                "for a message that must not be lost",
            )
        )
    for path, sites in sorted(_sites(placement.waits).items()):
        found.append(
            finding(
                "GA003",
                WARNING,
                path,
                f"waits on a task's result, {_lines(sites)}: the caller (a request) is held until a worker has "
                "run the task, and fails when the queue is slow or the worker down",
                "return at once with the task id (202 Accepted) and let the client ask for the result later; or "
                "do the work in the request if it must finish there",
            )
        )
    for path, sites in sorted(_sites(placement.waits_in_scripts).items()):
        found.append(
            finding(
                "GA004",
                INFO,
                path,
                f"waits on a task's result, {_lines(sites)}, in a script or management command (no request is held)",
                "fine outside a request: give each wait a timeout (result.get(timeout=...))",
            )
        )
    return found
