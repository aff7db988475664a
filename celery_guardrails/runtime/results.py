"""What the result backend keeps of a guarded task's failure: redacted (``redact_results``, on by default).

Celery stores a failed task's exception and traceback in the result backend as they were raised
(``celery.app.trace``: ``handle_failure`` calls ``task.backend.mark_as_failure(id, exc, traceback)``,
``handle_retry`` calls ``mark_as_retry``; the worker's main process does the same for a lost worker or a
time limit). The backend serialises the exception there (``Backend.prepare_exception``: its type and
``exc.args`` as JSON, or the pickled object with its attributes) and passes it on to a chord's count
(``ChordError("Dependency ... raised <repr>")``), to the tasks chained after it and to the errbacks.

``GuardedTask.backend`` is this module's :class:`RedactingBackend` around the app's backend: everything is
passed through, except that ``mark_as_failure`` and ``mark_as_retry`` get, instead of the exception raised,
:func:`redacted_exception` (the same class, built without calling its ``__init__``, with its arguments
redacted as text and its plain attributes, strings, numbers and lists of them, redacted; other attributes
are dropped) and the traceback text redacted. ``AsyncResult.get()`` then raises the same type with the
redacted message, ``result.traceback`` is the redacted text, and a chord or an errback sees the redacted
exception. An exception that cannot be rebuilt that way (its ``__new__`` refuses, or its ``str`` needs an
attribute that was dropped) is stored as a plain ``Exception("<module.Class>: <redacted message>")``.

The guardrails' own hooks (``on_failure``, the dead letter) still see the exception as raised: only what
Celery keeps and passes on is redacted. Plain Celery tasks are not touched.

One more difference, for speed: the success of a keyed delivery whose completion rides the ack, on Celery's
Redis result backend on the store's own Redis, is not written by ``mark_as_done``. It was encoded as Celery encodes
it when the body returned (:func:`prepared_result`), and it is written by the script that completes the key and
acks the message (see :mod:`celery_guardrails.guardrails.acks`); ``mark_as_done`` lets it be (or, where Celery
would store nothing, drops it).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from celery import states

from celery_guardrails.foundation.redaction import Redactor, exception_name, exception_text
from celery_guardrails.options import APP, TASK, Option, checks, declare, resolve
from celery_guardrails.runtime.delivery import ATTRIBUTE, RidingResult, redaction
from celery_guardrails.stores.base import ResultWrite

logger = logging.getLogger(__name__)

#: Characters of an exception's message kept in the fallback exception.
FALLBACK_LIMIT = 2000


#: The options the redacting result backend reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="redact_results",
        default=True,
        doc="The result backend stores a guarded task's failure redacted: the exception (its type, with its "
        "arguments and plain attributes redacted; other attributes dropped) and the traceback text. False: "
        "Celery stores them as raised.",
        check=checks.boolean,
        scopes=frozenset({TASK, APP}),
    ),
)


def redacted_exception(exc: BaseException, redactor: Redactor) -> BaseException:
    """A copy of ``exc`` to store: the same class, its arguments and plain attributes redacted (module
    docstring). Never raises; never returns ``exc`` itself."""
    cls = type(exc)
    try:
        args = redactor.shown(list(exc.args)).value
        copy = cls.__new__(cls, *args)
        copy.args = tuple(args)
        for name, value in getattr(exc, "__dict__", {}).items():
            if name.startswith("__"):
                continue
            if value is None or isinstance(value, str | int | float | list | tuple | dict):
                kept = redactor.shown(value).value
                setattr(copy, name, tuple(kept) if isinstance(value, tuple) and isinstance(kept, list) else kept)
        str(copy), repr(copy)  # both must work: a chord's ChordError and the worker's log line need them
        return copy
    except Exception:
        text = redactor.text(exception_text(exc), keep=FALLBACK_LIMIT)
        return Exception(f"{exception_name(exc)}: {text}")


class RedactingBackend:
    """A task's result backend with its failures redacted (module docstring); anything else passes through."""

    __slots__ = ("_backend", "_task")

    def __init__(self, *, backend: Any, task: Any) -> None:
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_task", task)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._backend, name, value)

    def __repr__(self) -> str:
        return f"<RedactingBackend of {self._backend!r}>"

    def mark_as_done(
        self, task_id: str, result: Any, request: Any = None, store_result: bool = True, state: str = states.SUCCESS
    ) -> Any:
        # A keyed delivery whose completion rides the ack with its result (celery_guardrails.guardrails.acks): the
        # same script writes it. Where Celery would store nothing, the result rides no more.
        delivery_state: Any = getattr(request, ATTRIBUTE, None)
        riding = getattr(delivery_state, "riding", None)
        if riding is not None and riding.result is not None:
            if store_result and state == states.SUCCESS and not getattr(request, "ignore_result", False):
                return None
            delivery_state.riding = dataclasses.replace(riding, result=None)
        return self._backend.mark_as_done(task_id, result, request, store_result, state)

    # Only the exception and the traceback change; every other argument goes on as Celery gave it (its own
    # defaults stay Celery's).
    def mark_as_failure(
        self, task_id: str, exc: BaseException, traceback: str | None = None, *a: Any, **kw: Any
    ) -> Any:
        exc, traceback = self._redacted(exc, traceback)
        return self._backend.mark_as_failure(task_id, exc, traceback, *a, **kw)

    def mark_as_retry(self, task_id: str, exc: BaseException, traceback: Any = None, *a: Any, **kw: Any) -> Any:
        exc, traceback = self._redacted(exc, traceback)
        return self._backend.mark_as_retry(task_id, exc, traceback, *a, **kw)

    def _redacted(self, exc: Any, traceback: str | None) -> tuple[Any, str | None]:
        task = self._task
        try:
            if not resolve(task, "redact_results", {}):
                return exc, traceback
        except Exception:  # a setting that cannot be read: redacted, the default
            logger.warning("redact_results of %s could not be read; the failure is stored redacted", task.name)
        redactor = redaction(task)
        if isinstance(exc, BaseException):
            exc = redacted_exception(exc, redactor)
        if traceback:
            traceback = redactor.text(traceback)
        return exc, traceback


def prepared_result(backend: Any, task_id: str, result: Any, request: Any) -> RidingResult | None:
    """A success's result encoded as ``backend`` would store it, to be written with the completion and the ack;
    None when it cannot be (then Celery's own ``mark_as_done`` stores it, or meets the same error and handles it as
    it does: an ``EncodeError`` fails the task). Celery's own steps up to the write (``store_result``,
    ``_store_result`` and the Redis backend's ``set``, Celery 5.5 to 5.7)."""
    if getattr(request, "chord", None) or getattr(request, "ignore_result", False):
        return None
    try:
        meta = backend._get_result_meta(
            result=backend.encode_result(result, states.SUCCESS), state=states.SUCCESS, traceback=None, request=request
        )
        meta["task_id"] = _text(task_id)
        value = backend.encode(meta)
        if isinstance(value, str) and len(value) > getattr(backend, "_MAX_STR_VALUE_SIZE", 512 * 2**20):
            return None  # Celery refuses it, as a failure of the task
        write = ResultWrite(key=_text(backend.get_key_for_task(task_id)), value=value, expires=backend.expires or None)
    except Exception:
        return None
    store = functools.partial(backend.store_result, task_id, result, states.SUCCESS, request=request)
    return RidingResult(write=write, store=store)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def redacting_backend(task: Any, backend: Any) -> Any:
    """``backend`` wrapped for ``task`` (one wrapper per task and backend, made on first use)."""
    if backend is None or isinstance(backend, RedactingBackend):
        return backend
    cached = task.__dict__.get("_guardrails_backend")
    if cached is not None and cached._backend is backend:
        return cached
    wrapped = RedactingBackend(backend=backend, task=task)
    task.__dict__["_guardrails_backend"] = wrapped
    return wrapped
