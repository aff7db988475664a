"""The one lookup rule: every guardrail asks :func:`resolve` (or, for work that is not one task's,
:func:`app_value`) for an option, and gets, in this order:

1. the per-call option (``task.apply_async(..., tenant_required=True)``; it travels in the message header,
   so the worker sees it on every delivery and retry),
2. the task attribute (a decorator kwarg such as ``@shared_task(base=GuardedTask, tenant_required=True)``,
   or a class attribute of a ``GuardedTask`` subclass); ``None`` means "not set on this task"; unset, what
   Celery's own option of the same meaning says (:data:`CELERY_EQUIVALENTS`),
3. the app config (:mod:`celery_guardrails.options.config`),
4. the option's declared default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from celery.local import Proxy

from celery_guardrails.options import checks
from celery_guardrails.options.config import app_settings, checked
from celery_guardrails.options.schema import OPTIONS

# The package's name: the lines it logs keep the logger they had when the package was one module.
logger = logging.getLogger("celery_guardrails.options")


def task_attribute(task: Any, name: str) -> Any:
    """Attribute ``name`` of the task's class (None when unset); unset, what Celery's own option of the same
    meaning says, when the task sets one (:data:`CELERY_EQUIVALENTS`)."""
    # Read from the class: a function given as a decorator kwarg must not become a bound method. A task
    # from @app.task before the app is finalised is a proxy: look through it.
    if isinstance(task, Proxy):
        task = task._get_current_object()
    value = getattr(type(task), name, None)
    if value is None and name in CELERY_EQUIVALENTS:
        return celery_equivalent(type(task), name)
    return value


def _project_class_setting(kind: type, name: str) -> type | None:
    """The class of the project's (before Celery's and the extension's own) that sets ``name``, or None."""
    for klass in kind.__mro__:
        if klass.__module__.partition(".")[0] in ("celery", "celery_guardrails"):
            return None
        if name in vars(klass):
            return klass
    return None


def celery_option(kind: type, name: str) -> Any:
    """Celery task option ``name`` as the task itself sets it (a decorator kwarg or a class attribute of the
    project's), or None: Celery's and the extension's own defaults do not count."""
    klass = _project_class_setting(kind, name)
    return None if klass is None else vars(klass)[name]


def celery_option_set(kind: type, name: str) -> bool:
    """Whether the task sets Celery option ``name`` itself, even to None (``max_retries=None``: for ever)."""
    return _project_class_setting(kind, name) is not None


def _max_attempts_of_celery(kind: type) -> int | None:
    retries = (celery_option(kind, "retry_kwargs") or {}).get("max_retries", celery_option(kind, "max_retries"))
    if isinstance(retries, int) and not isinstance(retries, bool) and retries >= 0:
        return retries + 1
    return None  # unset, or None (Celery's "for ever"): the guardrails' bound applies


def _backoff_base_of_celery(kind: type) -> float | None:
    factor = celery_option(kind, "retry_backoff")
    if factor is True:
        return 1.0
    if isinstance(factor, int | float) and not isinstance(factor, bool) and factor > 0:
        return float(factor)
    return None


def _backoff_max_of_celery(kind: type) -> float | None:
    maximum = celery_option(kind, "retry_backoff_max")
    if isinstance(maximum, int | float) and not isinstance(maximum, bool) and maximum > 0:
        return float(maximum)
    return None


#: Guardrail options a task may set with Celery's own names instead (its autoretry and retry settings): a
#: GuardedTask retries through the guardrails, so Celery's settings are read as theirs.
CELERY_EQUIVALENTS: Mapping[str, Callable[[type], Any]] = {
    "max_attempts": _max_attempts_of_celery,
    "backoff_base": _backoff_base_of_celery,
    "backoff_max": _backoff_max_of_celery,
}
_EQUIVALENT: dict[tuple[type, str], Any] = {}


def celery_equivalent(kind: type, name: str) -> Any:
    """The guardrail option ``name`` as the task class ``kind`` sets it with Celery's own name (cached)."""
    key = (kind, name)
    if key not in _EQUIVALENT:
        _EQUIVALENT[key] = CELERY_EQUIVALENTS[name](kind)
    return _EQUIVALENT[key]


def resolve(task: Any, name: str, call: Mapping[str, Any]) -> Any:
    """The value of option ``name`` for ``task``: per call, then task, then app config, then default.

    Values are returned checked (exception classes loaded, patterns compiled). A per-call value that does
    not pass its check (a tampered or newer message) is logged and skipped, never fatal on the worker.
    """
    option = OPTIONS[name]
    if name in call:
        try:
            return option.check(call[name])
        except (TypeError, ValueError) as exc:
            # Its value is not logged: a per-call key is a value the caller made, and may hold anything.
            logger.warning("Ignoring per-call option %r (%s): %s", name, checks.kind(call[name]), exc)
    value = task_attribute(task, name)
    if value is not None:
        return checked(name, value)
    settings = app_settings(task.app)
    if name in settings:
        return settings[name]
    return option.default


def app_value(app: Any, name: str) -> Any:
    """Option ``name`` from the app config, else its default (for work that is not one task's)."""
    return app_settings(app).get(name, OPTIONS[name].default)


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskOptions:
    """The options of ``task`` for one call (its per-call options ``call``), each resolved once, when first asked:
    ``options["backoff_max"]``. A delivery's hooks share one (:mod:`celery_guardrails.runtime.view`)."""

    task: Any
    #: The per-call options (those the message carries; empty outside a call).
    call: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: Options resolved so far, by name.
    resolved: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        try:
            return self.resolved[name]
        except KeyError:
            value = self.resolved[name] = resolve(self.task, name, self.call)
            return value
