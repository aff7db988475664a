"""celery-guardrails: guardrails for Celery tasks.

Switch a task's base class to :class:`GuardedTask`; publish inside :func:`tenant_context` /
:func:`correlation_context`; read :func:`current_tenant` / :func:`current_correlation_id` anywhere; mark the
call that acts on the world with :func:`effect` (``with self.effect():`` in a bound body); fetch a row another path
may not have committed yet with :func:`require` (``self.require(...)``).
"""

# The option schema is declared by the modules that own the options (celery_guardrails.options.schema): most are
# imported through GuardedTask; broker, gate, jobs (completions), outbox and watchdog are not, and are imported here
# so that the schema is complete once the package is.
from celery_guardrails import broker, jobs  # noqa: F401
from celery_guardrails.exceptions import (
    BudgetExhaustedError,
    ConcurrencyKeyError,
    ConfigurationError,
    ContextError,
    DuplicateOfFailureError,
    GuardrailsError,
    IdempotencyKeyError,
    MissingTenantError,
    PermanentError,
    RecordNotThereYet,
    RetryLater,
    SlotLostError,
    StoreError,
    StoreUnavailableError,
    TransientError,
)
from celery_guardrails.foundation.context import (
    correlation_context,
    current_correlation_id,
    current_tenant,
    tenant_context,
)
from celery_guardrails.foundation.faults import fault_point
from celery_guardrails.guardrails.budget import budget_status
from celery_guardrails.guardrails.concurrency import concurrency_status
from celery_guardrails.guardrails.records import require
from celery_guardrails.operations import alerts  # noqa: F401  (connects the owners' alerts)
from celery_guardrails.runtime import gate, outbox  # noqa: F401
from celery_guardrails.runtime.effects import effect
from celery_guardrails.runtime.pipeline import Guardrail
from celery_guardrails.runtime.task import GuardedTask
from celery_guardrails.scheduling import watchdog  # noqa: F401

__version__ = "0.1.0.dev0"

__all__ = [
    "BudgetExhaustedError",
    "ConcurrencyKeyError",
    "ConfigurationError",
    "ContextError",
    "DuplicateOfFailureError",
    "GuardedTask",
    "Guardrail",
    "GuardrailsError",
    "IdempotencyKeyError",
    "MissingTenantError",
    "PermanentError",
    "RecordNotThereYet",
    "RetryLater",
    "SlotLostError",
    "StoreError",
    "StoreUnavailableError",
    "TransientError",
    "budget_status",
    "concurrency_status",
    "correlation_context",
    "current_correlation_id",
    "current_tenant",
    "effect",
    "fault_point",
    "require",
    "tenant_context",
]
