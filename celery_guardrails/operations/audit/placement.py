"""The placement axis (GA0xx): what runs in the background and how a request hands it over. The app's config
(``task_always_eager``, RabbitMQ without publisher confirms) and the project's source as
:mod:`celery_guardrails.operations.audit_source` reads it (publishes inside a database transaction, waits on a
task's result in a request or in a script), one finding per file with its lines.
"""

from __future__ import annotations

from collections.abc import Iterable
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


def placement_rules(app: Any, walked: audit_source.Walk) -> list[Finding]:
    """Placement (GA0xx): eager tasks, publishers without confirms, and the source's publishes inside a
    transaction and waits on a result, one finding per file."""
    found = []
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
