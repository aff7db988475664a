"""Effects, marked: what a task body did before it failed, for the retry gate (:mod:`celery_guardrails.runtime.gate`).

A failure says nothing about what the body did before it: a charge POSTed, then a second service refusing the
connection, is a refused connection that came *after* an effect. So the body says where its effects are::

    @shared_task(base=GuardedTask, bind=True)
    def charge(self, order_id):
        order = load(order_id)                    # a failure here: nothing happened yet, retried
        with self.effect():                       # (or celery_guardrails.effect())
            payments.charge(order)                # a failure in here is retried only if it proves nothing
                                                  # was sent (refused, DNS, connect timeout, 408/425/429)
        notify(order)                             # a failure after it: not retried (not_idempotent)

* A block that completes counts as one effect; so does a block that ends in an error that does not prove
  nothing was sent (the provider may have acted). A block left by an error that proves it (a refused connection)
  counts nothing. After one effect, no failure of this delivery is retried automatically, unless the task is
  safe to run again by construction (see the gate).
* A body that marks nothing counts as one effect from its first line: it is never retried automatically.
  GuardedTask tells from the body's own code whether it marks (``self.effect()``, ``effect()`` or
  ``celery_guardrails.effect()`` in the task function or a function of its module it calls);
  ``marks_effects=True`` says so for a body whose blocks are elsewhere (a client library of the project's).
* ``effect()`` also works as a decorator; outside a guarded task's body it does nothing.
* A body holding a concurrency slot (``concurrency_key`` / ``exclusive_key``) is fenced as a block begins: if
  the slot was reaped while the holder stalled, the block does not run
  (:class:`~celery_guardrails.exceptions.SlotLostError`, see :mod:`celery_guardrails.guardrails.concurrency`).

The key a body hands downstream: ``self.request.idempotency_key`` of a keyed task is an opaque string made from
the scoped key (a UUID: it tells a provider neither the task's module nor the tenant), the same on every
delivery, retry and replay of the message. Reading it in the body is recorded: a body that handed its key to
the provider (or to a unique row) may run again after an ambiguous failure, since the effect cannot land twice.
"""

from __future__ import annotations

import dis
import inspect
import logging
import uuid
from contextlib import ContextDecorator
from types import CodeType, FunctionType
from typing import Any

from celery import current_task
from celery.app.task import Context
from celery.local import Proxy

from celery_guardrails.options import TASK, Option, TaskOptions, checks, declare
from celery_guardrails.runtime.delivery import ATTRIBUTE, Delivery
from celery_guardrails.runtime.wire import sent_nothing

logger = logging.getLogger(__name__)

#: The namespace of the opaque keys (uuid5 of the scoped key): fixed, so a key never changes across releases.
KEY_NAMESPACE = uuid.UUID("6f3c1d52-8a0e-5b7e-9c41-2d8f0b6a9e13")
#: How deep the body's own module functions are followed when looking for effect blocks.
FOLLOW_DEPTH = 3


#: The options effect marks read, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="marks_effects",
        default=None,
        doc="Whether the body marks its effects with effect() (then a failure before the first one is "
        "retried); None: told from the task function's own code. Set True when the blocks are in code the "
        "body calls from another module.",
        check=checks.boolean,
        scopes=frozenset({TASK}),
    ),
)


def provider_key(scoped: str) -> str:
    """The opaque key handed to a body for ``scoped`` (``task:tenant:key``): a UUID, stable for ever."""
    return str(uuid.uuid5(KEY_NAMESPACE, scoped))


def _running() -> Delivery | None:
    """The delivery state of the guarded task whose body runs in this thread, or None."""
    task = current_task._get_current_object()
    if task is None:
        return None
    state: Delivery | None = getattr(task.request, ATTRIBUTE, None)
    return state if state is not None and state.in_body else None


class effect(ContextDecorator):  # lower case: used like a function, ``with effect():``
    """Mark the call that acts on the world (a POST, a mail, a write to another system); see the module
    docstring. ``state``: the delivery to count in (``GuardedTask.effect`` passes its own); by default the one
    of the guarded body running in this thread."""

    __slots__ = ("explicit", "state")

    def __init__(self, *, state: Delivery | None = None) -> None:
        self.explicit = state
        self.state: Delivery | None = None

    def __enter__(self) -> effect:
        state = self.explicit if self.explicit is not None else _running()
        if state is not None and not state.in_body:
            state = None
        if state is not None and state.concurrency and state.fence is not None:
            # A holder whose concurrency slot was reaped while it stalled does not act beside the slot's new
            # holder: SlotLostError here, before the block (no effect counted).
            state.fence("effect")
        self.state = state
        return self

    def _recreate_cm(self) -> effect:
        # As a decorator, one block per call: the instance holds the state of the call it is in (threads, nesting).
        return type(self)(state=self.explicit)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        state, self.state = self.state, None
        if state is None:
            return
        # A block left by an error that proves nothing reached the other side counts nothing; any other end
        # (done, or an error after the request may have gone out) is an effect that may have happened.
        if exc is None or not _proves_nothing_sent(exc):
            state.effects += 1


def _proves_nothing_sent(exc: BaseException) -> bool:
    """:func:`sent_nothing`, never raising (an exception with a broken attribute): unknown counts as sent, and
    the body's own exception is the one that goes on."""
    try:
        return sent_nothing(exc)
    except Exception:
        return False


class GuardedContext(Context):  # type: ignore[misc]
    """Celery's request context of a guarded delivery: ``idempotency_key`` is the opaque key to hand
    downstream, and reading it in the body is recorded (see the module docstring)."""

    @property
    def idempotency_key(self) -> str | None:
        state: Delivery | None = self.__dict__.get(ATTRIBUTE)
        if state is None or state.key is None:
            return None
        if state.in_body and state.key_read_at is None:
            state.key_read_at = state.effects
        return provider_key(state.key)


def guard_request(request: Any) -> None:
    """Make Celery's request of a delivery a :class:`GuardedContext` (it adds nothing but the property)."""
    if type(request) is Context:
        request.__class__ = GuardedContext


# What the body's code shows (computed once per task class).
_MARKS: dict[type, bool] = {}
_READS_KEY: dict[type, bool] = {}


def body_function(task: Any) -> Any:
    """The task's own function (through a decorator's ``__wrapped__``), or None."""
    if isinstance(task, Proxy):
        task = task._get_current_object()
    run = getattr(type(task), "run", None)
    run = getattr(run, "__func__", run)
    try:
        return inspect.unwrap(run) if run is not None else None
    except ValueError:  # a wrapper cycle
        return run


def code_objects(code: CodeType) -> list[CodeType]:
    """``code`` and the code of every function, lambda and comprehension defined inside it."""
    found = [code]
    for const in code.co_consts:
        if isinstance(const, CodeType):
            found.extend(code_objects(const))
    return found


def _uses_effect(function: Any, seen: set[int], depth: int) -> bool:
    if not isinstance(function, FunctionType) or id(function) in seen:
        return False
    seen.add(id(function))
    namespace = function.__globals__
    for code in code_objects(function.__code__):
        for instruction in dis.get_instructions(code):
            name = instruction.argval
            if not isinstance(name, str):
                continue
            if instruction.opname in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM") and name == "effect":
                return True  # self.effect(), celery_guardrails.effect(), from celery_guardrails import effect
            if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                value = namespace.get(name)
                if value is effect:
                    return True
                # A helper of the same module the body calls: its blocks are the body's.
                if (
                    depth > 0
                    and isinstance(value, FunctionType)
                    and value.__module__ == function.__module__
                    and _uses_effect(value, seen, depth - 1)
                ):
                    return True
    return False


def marks_effects(options: TaskOptions) -> bool:
    """Whether the body of ``options.task`` marks its effects: ``marks_effects`` when set, else what its code
    shows."""
    declared = options["marks_effects"]
    task = options.task
    if declared is not None:
        return bool(declared)
    kind = type(task._get_current_object() if isinstance(task, Proxy) else task)
    found = _MARKS.get(kind)
    if found is None:
        try:
            found = _uses_effect(body_function(task), set(), FOLLOW_DEPTH)
        except Exception:  # code that cannot be read (a C function, a broken wrapper): taken as marking nothing
            logger.warning("Task %s: its code could not be read for effect() blocks", getattr(task, "name", task))
            found = False
        _MARKS[kind] = found
    return found


def reads_key(task: Any) -> bool:
    """Whether the task's own code reads ``idempotency_key`` off something (``self.request.idempotency_key``):
    what the audit can see of a body handing its key downstream (the run itself records the actual read)."""
    kind = type(task._get_current_object() if isinstance(task, Proxy) else task)
    found = _READS_KEY.get(kind)
    if found is None:
        function = body_function(task)
        try:
            found = isinstance(function, FunctionType) and any(
                instruction.argval == "idempotency_key"
                for code in code_objects(function.__code__)
                for instruction in dis.get_instructions(code)
                if instruction.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_CONST")
            )
        except Exception:
            found = False
        _READS_KEY[kind] = found
    return found


__all__ = ["GuardedContext", "effect", "guard_request", "marks_effects", "provider_key", "reads_key"]
