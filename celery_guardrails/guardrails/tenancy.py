"""Tenancy: refuse tenant-less messages for ``tenant_required`` tasks, activate the tenant around the body.

* At publish (``GuardedTask.apply_async``): a ``tenant_required`` task with no tenant in the context and none
  given per call raises :class:`~celery_guardrails.exceptions.MissingTenantError` in the caller.
* On the worker: a message that arrives without a tenant (``app.send_task`` from outside any tenant, a plain
  Celery publisher, a malformed header) is refused before the body: the ``missing_tenant`` signal, then the
  final-failure path (an ERROR log with task id and correlation id, ``final_failure``, the dead-letter hook;
  reason ``missing_tenant``), and the task ends FAILED with ``MissingTenantError``. It is acked, never
  requeued, so it cannot loop.
* ``tenant_activator``: a callable taking the tenant id and returning a context manager, entered around the
  body (switch a django-tenants schema, pick a database router). It is not entered without a tenant.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from celery_guardrails import signals
from celery_guardrails.exceptions import MissingTenantError
from celery_guardrails.foundation.context import current_correlation_id, current_tenant
from celery_guardrails.options import APP, CALL, TASK, Option, checks, declare, load, resolve
from celery_guardrails.runtime.delivery import view
from celery_guardrails.runtime.headers import TENANT
from celery_guardrails.runtime.outcomes import MISSING_TENANT, fail_finally
from celery_guardrails.runtime.pipeline import Guardrail, Publication

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)


#: The options the tenant guard reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="tenant_required",
        default=False,
        doc="Refuse to publish or run the task without a tenant.",
        check=checks.boolean,
        scopes=frozenset({CALL, TASK, APP}),
    ),
    Option(
        name="tenant_activator",
        default=None,
        doc="Callable (or dotted path) taking a tenant id and returning a context manager entered "
        "around the task body, e.g. to switch a django-tenants schema. Not called without a tenant.",
        check=checks.callable_or_path,
        scopes=frozenset({TASK, APP}),
    ),
)


class TenantGuard(Guardrail):
    """Enforces ``tenant_required`` and enters ``tenant_activator``."""

    def on_publish(self, task: GuardedTask, publication: Publication) -> None:
        if not publication.header.get(TENANT) and resolve(task, "tenant_required", publication.call):
            raise MissingTenantError(task.name, where="given at publish")

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if current_tenant() is not None or not view(task).options["tenant_required"]:
            return
        error = MissingTenantError(task.name, task.request.id, where="in the message")
        signals.missing_tenant.send(
            sender=task,
            task_id=task.request.id,
            task_name=task.name,
            reason=str(error),
            correlation_id=current_correlation_id(),
        )
        # The final-failure path logs at ERROR with ids and records the dead letter before the ack.
        fail_finally(task, error, reason=MISSING_TENANT)

    def body_context(self, task: GuardedTask) -> AbstractContextManager[Any] | None:
        tenant = current_tenant()
        activator = view(task).options["tenant_activator"]
        if tenant is None or activator is None:
            return None
        manager: AbstractContextManager[Any] = load(activator)(tenant)
        return manager
