"""Exceptions raised by celery-guardrails.

Every exception the extension raises derives from one root, :class:`GuardrailsError`::

    GuardrailsError
    ├── ConfigurationError      a bad key or value in ``app.conf.guardrails`` / ``CELERY_GUARDRAILS``
    │                           or in a task's guardrail options (raised at start-up or at bind time)
    └── ContextError            a tenant or correlation id that cannot travel in a message
        └── MissingTenantError  a ``tenant_required`` task published or delivered without a tenant

``ConfigurationError`` and ``ContextError`` are also ``ValueError`` so that code catching bad input the usual
way keeps working.
"""

from __future__ import annotations


class GuardrailsError(Exception):
    """Root of every exception raised by celery-guardrails."""


class ConfigurationError(GuardrailsError, ValueError):
    """A guardrails setting or task option is unknown or has a bad value; the message names the key."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"celery-guardrails setting {key!r}: {problem}")


class ContextError(GuardrailsError, ValueError):
    """A tenant id or correlation id was refused (wrong type, too long, forbidden characters)."""


class MissingTenantError(ContextError):
    """A task declared ``tenant_required=True`` was published or delivered without a tenant."""

    def __init__(self, task_name: str, task_id: str | None = None, *, where: str) -> None:
        self.task_name = task_name
        self.task_id = task_id
        self.where = where
        ident = f"{task_name}[{task_id}]" if task_id else task_name
        super().__init__(
            f"{ident} requires a tenant and none was {where}; "
            "publish it inside tenant_context(...) or pass tenant=... to apply_async"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Keeps the exception picklable/serialisable for the result backend (keyword-only argument).
        return (_rebuild_missing_tenant, (self.task_name, self.task_id, self.where))


def _rebuild_missing_tenant(task_name: str, task_id: str | None, where: str) -> MissingTenantError:
    return MissingTenantError(task_name, task_id, where=where)
