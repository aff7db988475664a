"""Logging: the task and request context on every record, and the redaction of what is logged.

**Context.** :class:`ContextFilter` puts it on each record; add it to the handlers whose format shows the
fields::

    LOGGING = {
        "filters": {"guardrails": {"()": "celery_guardrails.log.ContextFilter"}},
        "formatters": {"plain": {"format": "%(levelname)s %(name)s tenant=%(tenant)s "
                                           "cid=%(correlation_id)s task=%(task_name)s[%(task_id)s] %(message)s"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["guardrails"],
                                 "formatter": "plain"}},
        ...
    }

Fields: ``tenant``, ``correlation_id``, ``task_id``, ``task_name``; ``"-"`` where there is none (outside a
task, a request without tenant). When Celery configures the worker's logging itself, the filter is added to
its handlers automatically.

**Redaction.** :func:`install_filters` (run when :mod:`celery_guardrails` is imported, and again when Celery
sets up the worker's logging) puts a :class:`RedactingFilter` on

* Celery's trace logger (``celery.app.trace``: "Task ...[id] raised unexpected: <exception>" with its
  traceback, the retry, ignored and rejected lines, "succeeded ... : <return value>"), for records about a
  guarded task only: a plain Celery task's lines are left as they are;
* every logger of the extension (``celery_guardrails.*`` and ``django_celery_guardrails.*``).

A record's message is redacted by the task's (else the app's) ``redact_keys`` and ``redact_patterns``
(:mod:`celery_guardrails.foundation.redaction`): when something was redacted the record carries the redacted text
(``msg``, with no ``args``), else it is left as it was (its template too, for grouping). A mapping of named
arguments and Celery's ``data`` extra are redacted value by value. A traceback is formatted by the filter,
redacted, put in ``exc_text``, and ``exc_info`` is dropped: no handler formats the raw exception again, and a
handler that captures ``exc_info`` (Sentry's logging integration, which reads the record after the logger's
filters) gets the redacted text, not the exception with its frames' local variables.

A logger filter runs only for records made on that logger: a project's own loggers are not touched.

**Times.** A moment a person reads, in a log line or a command's output, is written one way, in UTC, to the
second: ``2026-12-02 10:31:05 UTC`` (:func:`moment_text`), with how far from now where it helps
(:func:`when`: ``2026-12-02 10:31:05 UTC (in 4 min)``); never a raw epoch, never ISO 8601's ``T`` and offset.
The admin's pages write it the same way, in the site's time zone (``django_celery_guardrails.display``).
What programs read keeps its machine form: ``--json`` output, signals' and alerts' structured fields, stored
records (ISO 8601 or epoch seconds).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pkgutil
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from celery._state import get_current_task

from celery_guardrails.foundation.context import current_correlation_id, current_tenant
from celery_guardrails.foundation.redaction import DEFAULT, WITHHELD, Redactor, for_app, for_task
from celery_guardrails.runtime.delivery import redaction
from celery_guardrails.runtime.pipeline import is_guarded

MISSING = "-"
#: Celery's loggers that write a task's exception, message and traceback.
CELERY_TRACE_LOGGERS = ("celery.app.trace",)
#: The extension's packages: each of their modules' loggers redacts what it writes.
PACKAGES = ("celery_guardrails", "django_celery_guardrails")


def duration(seconds: float) -> str:
    """Seconds as a log line shows them, rounded with a unit: ``0.4 s``, ``12 s``, ``4 min``, ``2.5 h``, ``3 d``."""
    seconds = max(0.0, float(seconds))
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


#: How a moment reads in log lines and command output (see "Times" above).
MOMENT_FORMAT = "%Y-%m-%d %H:%M:%S UTC"


def moment_text(instant: float | datetime) -> str:
    """An epoch instant or a datetime as a person reads it: ``2026-12-02 10:31:05 UTC`` (a naive datetime is
    taken as UTC, as the stores keep them)."""
    if isinstance(instant, datetime):
        value = instant if instant.tzinfo is not None else instant.replace(tzinfo=UTC)
    else:
        value = datetime.fromtimestamp(instant, UTC)
    return value.astimezone(UTC).strftime(MOMENT_FORMAT)


def when(instant: float, *, now: float | None = None) -> str:
    """An epoch instant as a log line shows it: :func:`moment_text`, and how far from now:
    ``2026-12-02 10:05:03 UTC (in 4 min)``, ``... (12 s ago)``. Never a raw epoch."""
    now = time.time() if now is None else now
    local = moment_text(instant)
    delta = instant - now
    if abs(delta) < 0.5:
        return f"{local} (now)"
    return f"{local} (in {duration(delta)})" if delta > 0 else f"{local} ({duration(-delta)} ago)"


def shown(value: Any) -> str:
    """A context value (tenant, correlation id, owner) as logs and the admin show it: ``-`` for none."""
    return MISSING if value is None or value == "" else str(value)


class ContextFilter(logging.Filter):
    """Adds ``tenant``, ``correlation_id``, ``task_id`` and ``task_name`` to each record; never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.tenant = current_tenant() or MISSING
        record.correlation_id = current_correlation_id() or MISSING
        task = get_current_task()
        request_id = getattr(getattr(task, "request", None), "id", None)
        record.task_id = request_id or MISSING
        record.task_name = task.name if task is not None and request_id else MISSING
        return True


_inside = threading.local()


class RedactingFilter(logging.Filter):
    """Redacts the message, its arguments and the traceback of each record (module docstring); never drops
    one. ``guarded_only``: only records about a guarded task are touched (Celery's own loggers)."""

    def __init__(self, *, guarded_only: bool = False) -> None:
        super().__init__()
        self.guarded_only = guarded_only

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(_inside, "busy", False):  # a line the redaction itself writes: fixed text, nothing to redact
            return True
        _inside.busy = True
        try:
            redactor = self._redactor(record)
            if redactor is not None:
                redact_record(record, redactor)
        except Exception:  # never a raw record for an error here: what it said is withheld
            _withhold(record)
        finally:
            _inside.busy = False
        return True

    def _redactor(self, record: logging.LogRecord) -> Redactor | None:
        task = get_current_task()
        if _guarded(task):
            return redaction(task)  # made once per delivery
        if self.guarded_only:
            # A line written outside the task's run that names it: Celery's lines carry the name in their args.
            name = record.args.get("name") if isinstance(record.args, Mapping) else None
            app = _current_app()
            found = app.tasks.get(name) if app is not None and isinstance(name, str) else None
            return for_task(found) if _guarded(found) else None
        app = _current_app()
        return for_app(app) if app is not None else DEFAULT


def redact_record(record: logging.LogRecord, redactor: Redactor) -> None:
    """Redact ``record`` in place (module docstring)."""
    if isinstance(record.args, Mapping) and record.args:
        record.args = redactor.shown(dict(record.args)).value
    try:
        message = record.getMessage()
    except Exception:  # arguments that do not fit the format: logging would print both; so does this, redacted
        message = f"{record.msg!s} {record.args!r}"
        record.msg, record.args = message, None
    redacted = redactor.text(message)
    if redacted != message:
        record.msg, record.args = redacted, None
    data = getattr(record, "data", None)
    if isinstance(data, Mapping):  # Celery's extra={"data": context}: the same values, for custom handlers
        record.data = redactor.shown(dict(data)).value
    if record.exc_info:
        text = record.exc_text or logging.Formatter().formatException(record.exc_info)
        record.exc_text, record.exc_info = redactor.text(text), None
    elif record.exc_text:
        record.exc_text = redactor.text(record.exc_text)
    if record.stack_info:
        record.stack_info = redactor.text(record.stack_info)


def _withhold(record: logging.LogRecord) -> None:
    record.msg, record.args = f"{WITHHELD}: a log line of {record.name}", None
    record.exc_info = record.exc_text = record.stack_info = None
    if hasattr(record, "data"):
        record.data = {}


def _guarded(task: Any) -> bool:
    return is_guarded(task)


def _current_app() -> Any:
    """The current Celery app, without making Celery's fallback default app when there is none."""
    from celery import _state

    return getattr(_state._tls, "current_app", None) or _state.default_app


def own_loggers() -> Iterator[str]:
    """The names of the extension's loggers: a module's logger is ``logging.getLogger(__name__)``. Read from the
    packages' folders without importing them (a module imported later finds its logger made already)."""
    for package in PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):  # a module in sys.modules without a spec: its loggers by name only
            yield package
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        yield package
        folders = [(package, path) for path in spec.submodule_search_locations]
        while folders:
            prefix, path = folders.pop()
            for module in pkgutil.iter_modules([path]):
                name = f"{prefix}.{module.name}"
                yield name
                if module.ispkg:
                    folders.append((name, os.path.join(path, module.name)))


def install_filters(**_: Any) -> None:
    """Put the redacting filters on Celery's trace logger and the extension's loggers (idempotent)."""
    for name in CELERY_TRACE_LOGGERS:
        _add(logging.getLogger(name), RedactingFilter(guarded_only=True))
    for name in own_loggers():
        _add(logging.getLogger(name), RedactingFilter())


def _add(target: logging.Logger, added: RedactingFilter) -> None:
    if not any(isinstance(f, RedactingFilter) for f in target.filters):
        target.addFilter(added)
