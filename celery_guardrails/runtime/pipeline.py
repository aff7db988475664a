"""The guardrail hooks and the order ``GuardedTask`` runs them in.

A guardrail is a small class with no-op hooks; override the ones you need (the way Dramatiq's middleware
are written). ``GuardedTask.guardrails`` is the ordered tuple of guardrail instances. Order:

* ``on_publish`` and ``before_run``: in tuple order (first guardrail first);
* ``body_context``: entered in tuple order around the task body (the first is outermost);
* ``on_success``, ``on_failure``, ``on_retry``: in reverse order (the first guardrail sees the outcome last,
  like unwinding a stack).

A hook a guardrail does not override is not called at all (:func:`overriding`): every task pays only for
the hooks that do something.

Before any ``before_run`` hook runs, the worker has already restored the message's tenant and correlation
id (see :mod:`celery_guardrails.guardrails.propagation`), so every hook reads stores as the right tenant.
A ``before_run`` hook refuses a message by raising; the body then does not run.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


class Task(Protocol):
    """What a guardrail needs of the task it guards: the guardrails import this, not
    :class:`~celery_guardrails.runtime.task.GuardedTask`, which composes them (no import runs back up to it)."""

    name: str
    #: Celery's serializer of the task's messages (None: the app's).
    serializer: Any
    guardrails: ClassVar[tuple[Guardrail, ...]]

    @property
    def app(self) -> Any: ...

    @property
    def request(self) -> Any: ...

    def call_options(self) -> Mapping[str, Any]: ...


@dataclass(slots=True, kw_only=True)
class Publication:
    """A message about to be published through ``GuardedTask.apply_async``.

    ``header`` is the guardrails header (see :mod:`celery_guardrails.runtime.headers`) and may be changed in place;
    ``call`` holds the per-call guardrail options (validated, as stored in the header); ``overrides`` the
    per-call ``tenant=`` / ``correlation_id=`` arguments, not yet validated; ``later`` the signatures the message
    carries for a worker to publish after it.
    """

    task_id: str | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    header: dict[str, Any]
    call: dict[str, Any]
    overrides: dict[str, Any]
    #: Signatures this message carries for a worker to publish later: the rest of its chain, its chord's body,
    #: its link and link_error callbacks (read-only; canvas signatures, which may nest groups and chords).
    later: tuple[Any, ...] = ()


#: The class attribute that marks a task class as guarded (GuardedTask sets it).
GUARDED = "guardrails_composed"


def is_guarded(task: Any) -> bool:
    """Whether ``task`` is a guarded task (``GuardedTask`` or a subclass), asked without importing
    :mod:`celery_guardrails.runtime.task`: the modules below it (the log filters, the broker lease, the wiring)
    must not import their way back up to it."""
    return getattr(task, GUARDED, False) is True


class Guardrail:
    """Base class of every guardrail: all hooks do nothing."""

    def on_publish(self, task: Task, publication: Publication) -> None:
        """Called in the publisher before the message is sent (delay, apply_async, retry, signatures)."""

    def before_run(self, task: Task, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Called on the worker before the body; raise to refuse the message."""

    def body_context(self, task: Task) -> AbstractContextManager[Any] | None:
        """A context manager entered around the task body (after every ``before_run``); None: nothing."""
        return None

    def on_success(self, task: Task, retval: Any) -> None:
        """Called on the worker after the body returned."""

    def on_failure(self, task: Task, exc: BaseException, einfo: Any) -> None:
        """Called on the worker after the task failed for good (Celery's ``on_failure``)."""

    def on_retry(self, task: Task, exc: BaseException, einfo: Any) -> None:
        """Called on the worker after a retry was published (Celery's ``on_retry``)."""


_OVERRIDING: dict[tuple[int, str], tuple[tuple[Guardrail, ...], tuple[Guardrail, ...]]] = {}


def overriding(guardrails: tuple[Guardrail, ...], hook: str) -> tuple[Guardrail, ...]:
    """The guardrails whose class overrides ``hook``, in pipeline order.

    Computed once per tuple, found by identity: a guardrail need not be hashable (a plain ``@dataclass`` is
    not). A ``guardrails`` made anew on every access is computed every time (the cache stays small).
    """
    cached = _OVERRIDING.get((id(guardrails), hook))
    if cached is not None and cached[0] is guardrails:
        return cached[1]
    found = tuple(g for g in guardrails if getattr(type(g), hook) is not getattr(Guardrail, hook))
    if len(_OVERRIDING) > 256:
        _OVERRIDING.clear()
    _OVERRIDING[(id(guardrails), hook)] = (guardrails, found)
    return found


class SkipBody(Exception):
    """Raised by a ``before_run`` hook: do not run the body; the task returns ``result`` (a success)."""

    def __init__(self, result: Any) -> None:
        super().__init__(result)
        self.result = result


class SkipPublish(Exception):
    """Raised by an ``on_publish`` hook: do not publish; ``apply_async`` returns the result of ``task_id``."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id)
        self.task_id = task_id
