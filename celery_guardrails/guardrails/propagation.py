"""Context propagation: the tenant and correlation id travel in every message and are restored on the worker.

Publish side: every message gets the guardrails header (see :mod:`celery_guardrails.runtime.headers`) with the tenant
and correlation id of the current context, on every path, because the stamping happens in Celery's
``before_task_publish`` signal: ``delay``/``apply_async``, ``app.send_task``, the signatures of chains, groups,
chords and link/link_error callbacks (published by the worker inside the parent task's context), ``self.retry``
and beat. A publish outside any correlation context gets a new correlation id. Values already in the header
(a per-call ``tenant=``/``correlation_id=``, or a retry's copy of its own header) are kept.

Worker side: ``task_prerun`` restores both values before ``GuardedTask`` runs any guardrail and before the body;
``task_postrun`` undoes it, after callbacks and errbacks were published, so one task's tenant never leaks into
the next task of the same process or thread. A message without a correlation id gets a new one on the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

from celery.signals import before_task_publish, task_postrun, task_prerun

from celery_guardrails.foundation.context import (
    Activation,
    activate,
    current_correlation_id,
    current_tenant,
    deactivate,
    new_correlation_id,
    validate_correlation_id,
    validate_tenant,
)
from celery_guardrails.log import shown
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import view
from celery_guardrails.runtime.headers import PUBLISHED
from celery_guardrails.runtime.pipeline import Guardrail, Publication

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)


def stamp(header: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Fill the tenant and correlation id a header lacks from the current context."""
    header.setdefault(headers.VERSION_FIELD, headers.VERSION)
    if headers.TENANT not in header:
        tenant = current_tenant()
        if tenant is not None:
            header[headers.TENANT] = tenant
    if not header.get(headers.CORRELATION_ID):
        header[headers.CORRELATION_ID] = current_correlation_id() or new_correlation_id()
    return header


class ContextPropagation(Guardrail):
    """Takes the per-call ``tenant=`` / ``correlation_id=`` overrides and stamps the context."""

    def on_publish(self, task: GuardedTask, publication: Publication) -> None:
        tenant = publication.overrides.get("tenant")
        if tenant is not None:
            publication.header[headers.TENANT] = validate_tenant(tenant)
        correlation_id = publication.overrides.get("correlation_id")
        if correlation_id is not None:
            publication.header[headers.CORRELATION_ID] = validate_correlation_id(correlation_id)
        stamp(publication.header)


def _stamp_every_message(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is None:
        return
    current = headers.get("guardrails")
    header = stamp(dict(current) if isinstance(current, dict) else {})
    # Every publish (a retry's too) sets it anew: the age of a queue's oldest message and a delivery's wait in
    # the queue are read from it. Real time, not the guardrails clock: a queue's age is the broker's.
    header[PUBLISHED] = round(time.time(), 3)
    headers["guardrails"] = header


# One stack per thread: the prefork child and the solo pool use one thread, the threads pool one per slot;
# an eager task applied inside a task nests.
_activations = threading.local()


def _restore(task: Any = None, task_id: str | None = None, **_: Any) -> None:
    header = view(task).header if task is not None else {}
    correlation_id = header.get(headers.CORRELATION_ID) or new_correlation_id()
    tenant = header.get(headers.TENANT)
    stack = getattr(_activations, "stack", None)
    if stack is None:
        stack = _activations.stack = []
    stack.append(activate(tenant=tenant, correlation_id=correlation_id))
    logger.debug(
        "Task %s: context restored (tenant=%s, correlation id=%s)", task_id, shown(tenant), shown(correlation_id)
    )


def _clear(task_id: str | None = None, **_: Any) -> None:
    stack: list[Activation] = getattr(_activations, "stack", None) or []
    if not stack:
        return
    try:
        deactivate(stack.pop())
    except ValueError:  # token made in another context (should not happen); never leave a tenant behind
        logger.warning("Task %s: context could not be reset; cleared instead", task_id)
        activate(tenant=None, correlation_id=None)


before_task_publish.connect(_stamp_every_message, weak=False, dispatch_uid="celery_guardrails.foundation.context.stamp")
task_prerun.connect(_restore, weak=False, dispatch_uid="celery_guardrails.foundation.context.restore")
task_postrun.connect(_clear, weak=False, dispatch_uid="celery_guardrails.foundation.context.clear")
