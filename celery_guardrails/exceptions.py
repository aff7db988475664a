"""Exceptions raised by celery-guardrails.

Every exception the extension raises derives from one root, :class:`GuardrailsError`::

    GuardrailsError
    ├── ConfigurationError      a bad key or value in ``app.conf.guardrails`` / ``CELERY_GUARDRAILS``
    │                           or in a task's guardrail options (raised at start-up or at bind time)
    ├── ContextError            a tenant or correlation id that cannot travel in a message
    │   └── MissingTenantError  a ``tenant_required`` task published or delivered without a tenant
    ├── IdempotencyKeyError     an idempotency key that cannot be made (missing argument, too long, bad text)
    ├── ConcurrencyKeyError     a concurrency_key / exclusive_key that cannot be made (the same rules)
    ├── SlotLostError           (on the worker) this delivery's concurrency slot was reaped while it ran (it
    │                           stalled past concurrency_reap_after): stopped at its next boundary, its effect
    │                           through the helpers refused; it comes back later under the limit, or (an effect
    │                           may have landed before) ends as a final failure ``not_idempotent``
    ├── PayloadContractError    a message that breaks the payload contract (refused at publish, nothing sent)
    │   ├── PayloadTooLargeError    its serialised arguments are over max_payload_bytes
    │   ├── PayloadTooDeepError     its arguments are nested deeper than max_payload_depth
    │   ├── SensitivePayloadError   an argument name or dict key is a secret or personal data (sensitive_keys)
    │   ├── EntityInPayloadError    a Django model instance or queryset among the arguments
    │   ├── UnknownPayloadVersionError  (on the worker) a payload version the task does not accept:
    │   │                           dead-lettered ``unknown_payload_version``, never run
    │   └── UnpublishableError      (on the worker) a retry or wait whose own arguments the serializer
    │                               refuses (an object pickle will not take again): ``malformed_message``
    ├── TransientError          raise from a task: this may work if tried again (retried with backoff)
    ├── PermanentError          raise from a task: trying again cannot help (never retried)
    │   └── CheckpointError     ``self.checkpoint`` misused (outside a task run, not a sequence, state not JSON)
    ├── RetryLater              raise from a task: "not yet" (re-delivered later, no attempt consumed)
    │   └── RecordNotThereYet   ``require(queryset, **lookup)`` found no row: waited for up to record_wait,
    │                           then a final failure ``record_missing`` naming the model and the lookup
    ├── BudgetExhaustedError    a dependency's retry budget or open circuit kept a message from running
    ├── PoisonMessageError      a message whose runs kept killing their worker, dead-lettered unrun
    ├── DeadLetteredError       a message whose dead letter was recorded late (its sinks had been down)
    ├── DuplicateOfFailureError a duplicate of a message whose key failed for good: not run, it fails too
    ├── SealError               a dead letter's sealed copy cannot be made or opened (no key, wrong keys)
    ├── OrderingError           an ordered message that cannot take its turn (malformed ordering header,
    │   │                       its turn given up while it was missing)
    │   └── OrderingKeyError    an ordering key that cannot be made (missing argument, too long, bad text)
    └── StoreError              the guardrails store (Redis or the Django database) refused an operation
        └── StoreUnavailableError   ... because it cannot be reached (refused, timed out, went away): an
                                    infrastructure fault, never the message's; the message comes back later

``ConfigurationError``, ``ContextError`` and ``PayloadContractError`` are also ``ValueError`` so that code
catching bad input the usual way keeps working.
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


class TransientError(GuardrailsError):
    """Raise (or subclass) for a failure that may go away: the task is retried with backoff.

    ``retry_after`` (seconds) asks for at least that delay, like an HTTP ``Retry-After``.
    """

    def __init__(self, message: str = "", *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PermanentError(GuardrailsError):
    """Raise (or subclass) for a failure that trying again cannot fix (bad input, a refused request)."""


class CheckpointError(PermanentError):
    """``self.checkpoint`` was misused: read outside a task run, given items that are not a re-iterable sequence
    in a stable order, a ``state`` that is not small JSON, or iterated inside a transaction. A programming error:
    trying again cannot help, so it is a :class:`PermanentError` (the message is dead-lettered with it)."""


class RetryLater(GuardrailsError):
    """Raise when the message cannot be processed *yet* (a record another path writes is not readable yet).

    The same message is re-published after ``delay`` seconds (``retry_later_delay`` when None) without
    consuming an attempt; ``retry_later_max`` bounds how often.
    """

    def __init__(self, message: str = "", *, delay: float | None = None) -> None:
        super().__init__(message)
        self.delay = delay


class RecordNotThereYet(RetryLater):
    """``require(queryset, **lookup)`` found no row (see :mod:`celery_guardrails.guardrails.records`).

    The message names the model (its ``app_label.Model``) and the lookup; it is redacted where it is kept (the
    attempt history, the dead letter), like any error message.
    """

    def __init__(self, model: str = "", lookup: str = "") -> None:
        super().__init__()
        # args hold the constructor arguments so a result backend (and pickle) can rebuild the exception.
        self.args = (model, lookup)
        self.model = model
        self.lookup = lookup

    def __str__(self) -> str:
        return f"{self.model} matching {self.lookup or '(no lookup)'} does not exist (yet)"


class StoreError(GuardrailsError):
    """The guardrails store refused an operation (or cannot be reached: :class:`StoreUnavailableError`)."""


class StoreUnavailableError(StoreError):
    """The guardrails store cannot be reached: connection refused or lost, a timeout, a locked database.

    An infrastructure fault: a delivery that meets it is published again later without spending an attempt
    (see :func:`celery_guardrails.runtime.outcomes.store_unavailable`), never failed or acked away.
    """


class BudgetExhaustedError(GuardrailsError):
    """A dependency's retry budget (``reason="budget"``) or open circuit (``"circuit"``) refused a run."""

    def __init__(self, dependency: str, reason: str) -> None:
        super().__init__(dependency, reason)
        self.dependency = dependency
        self.reason = reason

    def __str__(self) -> str:
        what = "retry budget is spent" if self.reason == "budget" else "circuit is open"
        return f"dependency {self.dependency!r}: {what}"


class IdempotencyKeyError(GuardrailsError, ValueError):
    """An idempotency key could not be made from the task's arguments, or is not acceptable."""


class ConcurrencyKeyError(GuardrailsError, ValueError):
    """A ``concurrency_key`` or ``exclusive_key`` could not be made from the task's arguments, or is not
    acceptable (the rules of idempotency keys)."""


class SlotLostError(GuardrailsError):
    """A slot of ``concurrency_key`` / ``exclusive_key`` this delivery held was reaped while it ran: its holder
    stalled (a stopped process, a long pause) past ``concurrency_reap_after``, and the slot may be another
    delivery's now. Raised at the body's boundaries and by the effect helpers (see
    :mod:`celery_guardrails.guardrails.concurrency`), so that the stalled holder stops instead of running beside
    the new one. ``where`` says which boundary noticed (``"before the body"``, ``"effect"``, ``"checkpoint"``,
    ``"transition"``, ``"completion"``, ...)."""

    def __init__(self, key: str, holder: str, where: str) -> None:
        super().__init__(key, holder, where)
        self.key, self.holder, self.where = key, holder, where

    def __str__(self) -> str:
        return f"concurrency slot {self.key} of {self.holder} was reaped while it ran (stopped at: {self.where})"


class PoisonMessageError(GuardrailsError):
    """A message was delivered again and again without its run ever finishing (it kills its worker)."""

    def __init__(self, task_name: str, task_id: str, starts: int) -> None:
        super().__init__(task_name, task_id, starts)
        self.task_name, self.task_id, self.starts = task_name, task_id, starts

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}] redelivered {self.starts} times without finishing: poison"


class DuplicateOfFailureError(GuardrailsError):
    """A duplicate of a message whose idempotency key failed for good: its body does not run, and a client
    waiting on it sees the original's failure (the original has the dead letter)."""

    def __init__(self, key: str, original: str, reason: str) -> None:
        super().__init__(key, original, reason)
        self.key, self.original, self.reason = key, original, reason

    def __str__(self) -> str:
        return f"duplicate of {self.original or 'a message'} whose key {self.key} failed: {self.reason}"


class DeadLetteredError(GuardrailsError):
    """The final failure of a message whose dead letter could only be recorded on a later delivery."""

    def __init__(self, reason: str, exc_type: str, exc_message: str) -> None:
        super().__init__(reason, exc_type, exc_message)
        self.reason, self.exc_type, self.exc_message = reason, exc_type, exc_message

    def __str__(self) -> str:
        return f"dead-lettered ({self.reason}): {self.exc_type}: {self.exc_message}"


class SealError(GuardrailsError):
    """A dead letter's sealed copy could not be made or opened: no ``seal_keys``, none of them opens it, or the
    cryptography package is missing. The message never holds the sealed content or a key."""


class OrderingError(GuardrailsError):
    """An ordered message cannot take its turn: its ordering header is malformed, or its key moved past it
    while it was missing (see :mod:`celery_guardrails.guardrails.ordering`). It is dead-lettered, not run."""


class OrderingKeyError(OrderingError, ValueError):
    """An ordering key could not be made from the task's arguments, or is not acceptable (raised at publish)."""


class PayloadContractError(GuardrailsError, ValueError):
    """A message breaks the payload contract (see :mod:`celery_guardrails.guardrails.contract`); at publish,
    nothing was sent. ``task_name`` names the task."""

    def __init__(self, task_name: str, problem: str) -> None:
        super().__init__(task_name, problem)
        self.task_name = task_name
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.task_name}: {self.problem}"


class PayloadTooLargeError(PayloadContractError):
    """The serialised arguments are larger than ``max_payload_bytes``."""


class PayloadTooDeepError(PayloadContractError):
    """The arguments are nested deeper than ``max_payload_depth`` (levels of lists and dicts)."""


class SensitivePayloadError(PayloadContractError):
    """An argument name or dict key matches ``sensitive_keys`` (and the task gives no
    ``allow_sensitive_payload`` reason)."""


class EntityInPayloadError(PayloadContractError):
    """A Django model instance or queryset is among the arguments: send identifiers, not entities."""


class UnknownPayloadVersionError(PayloadContractError):
    """A delivered message's payload version is not one the task accepts (``accepts_versions``)."""


class UnpublishableError(PayloadContractError):
    """A retry or wait of the running message cannot be published: the serializer refuses the message's own
    arguments (kombu's ``EncodeError``). The message's fault, not the broker's: dead-lettered ``malformed_message``
    instead of given back to the broker (it would come back and fail the same way)."""
