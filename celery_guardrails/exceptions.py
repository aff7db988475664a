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
        # args hold the constructor arguments so a result backend can rebuild the exception.
        super().__init__(key, problem)
        self.key = key
        self.problem = problem

    def __str__(self) -> str:
        return f"celery-guardrails setting {self.key!r}: {self.problem}"


class ContextError(GuardrailsError, ValueError):
    """A tenant id or correlation id was refused (wrong type, too long, forbidden characters)."""


class MissingTenantError(ContextError):
    """A task declared ``tenant_required=True`` was published or delivered without a tenant.

    ``where`` says which side noticed: ``"given at publish"`` or ``"in the message"``.
    """

    def __init__(self, task_name: str, task_id: str | None = None, where: str = "in the message") -> None:
        super().__init__(task_name, task_id, where)
        self.task_name = task_name
        self.task_id = task_id
        self.where = where

    def __str__(self) -> str:
        ident = f"{self.task_name}[{self.task_id}]" if self.task_id else self.task_name
        return (
            f"{ident} requires a tenant and none was {self.where}; "
            "publish it inside tenant_context(...) or pass tenant=... to apply_async"
        )
