"""A guarded task's request stack on ``threading.local``: what ``task.request`` reads, dozens of times a delivery.

Celery keeps each task's requests on a ``celery.utils.threads.LocalStack``, a pure-Python ``Local`` keyed by the
current greenlet whenever greenlet is installed: each read of ``task.request`` costs a few microseconds (3-6 µs
on the bench's machine, measured with ``timeit``), and the guardrails' hooks read it about 50 times per delivery.
:class:`RequestStack` is the same stack on ``threading.local``, a C type, read in a fraction of that (Celery
ships one like it, chosen only when the ``USE_FAST_LOCALS`` environment variable is set; then it is kept).

Under Celery's green pools (gevent, eventlet) the worker monkey-patches ``threading`` before it imports the app,
and ``threading.local`` is then local to each greenlet, as Celery's stack is. Not covered: greenlets run
without monkey-patching inside one thread of a worker (Celery's own stack tells them apart; this one does not).
``GuardedTask.on_bound`` installs it in place of Celery's fresh stack.
"""

from __future__ import annotations

import threading
from typing import Any

from celery.utils.threads import LocalStack


class RequestStack(LocalStack):  # type: ignore[misc]
    """Celery's ``LocalStack`` API (push, pop, top, stack, len) on ``threading.local``."""

    def __init__(self) -> None:  # Celery's makes a Local: not called
        self._local = threading.local()

    def push(self, obj: Any) -> list[Any]:
        stack: list[Any] = self._local.__dict__.setdefault("stack", [])
        stack.append(obj)
        return stack

    def pop(self) -> Any:
        stack = self._local.__dict__.get("stack")
        if not stack:
            return None
        return stack.pop()

    @property
    def top(self) -> Any:
        stack = self._local.__dict__.get("stack")
        return stack[-1] if stack else None

    @property
    def stack(self) -> list[Any]:
        found: list[Any] = self._local.__dict__.get("stack", [])
        return found

    def __len__(self) -> int:
        return len(self._local.__dict__.get("stack", ()))

    def __release_local__(self) -> None:
        self._local.__dict__.pop("stack", None)


def install(task_class: Any) -> None:
    """Give ``task_class`` a :class:`RequestStack` in place of the empty ``LocalStack`` Celery's ``bind`` made."""
    current = task_class.__dict__.get("request_stack")
    if type(current) is LocalStack and not isinstance(current, threading.local) and not len(current):
        task_class.request_stack = RequestStack()


__all__ = ["RequestStack", "install"]
