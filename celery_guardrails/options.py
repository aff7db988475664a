"""Guardrail options: the settings schema, its validation, and the one lookup rule.

This is the only module that reads settings. Every guardrail asks :func:`resolve` for an option, and
:func:`resolve` applies one rule everywhere:

1. the per-call option (``task.apply_async(..., tenant_required=True)``; it travels in the message header,
   so the worker sees it on every delivery and retry),
2. the task attribute (a decorator kwarg such as ``@shared_task(base=GuardedTask, tenant_required=True)``,
   or a class attribute of a ``GuardedTask`` subclass); ``None`` means "not set on this task",
3. the app config: ``app.conf.guardrails = {...}``, in Django ``CELERY_GUARDRAILS = {...}`` (Celery maps it to
   the same key when the app is configured with ``namespace="CELERY"``),
4. the documented default below.

Keys are lowercase, like Celery's own settings. An unknown key or a bad value raises
:class:`~celery_guardrails.exceptions.ConfigurationError` naming the key, when the worker starts (see
:mod:`celery_guardrails.install`), when a Django project runs its system checks, and on first use.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from celery_guardrails.exceptions import ConfigurationError

CALL = "call"
TASK = "task"
APP = "app"


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """One guardrail option: where it may be set, its default and how a value is checked."""

    name: str
    default: Any
    doc: str
    check: Callable[[Any], Any]
    scopes: frozenset[str]


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be True or False, got {value!r:.80}")
    return value


def _callable_or_path(value: Any) -> Any:
    if value is None or callable(value):
        return value
    if isinstance(value, str) and "." in value:
        return value
    raise ValueError(f"must be a callable or a dotted path 'package.module.name', got {value!r:.80}")


def _header_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"must be a list of HTTP header names, got {value!r:.80}")
    return tuple(value)


OPTIONS: Mapping[str, Option] = {
    option.name: option
    for option in (
        Option(
            name="tenant_required",
            default=False,
            doc="Refuse to publish or run the task without a tenant.",
            check=_boolean,
            scopes=frozenset({CALL, TASK, APP}),
        ),
        Option(
            name="tenant_activator",
            default=None,
            doc="Callable (or dotted path) taking a tenant id and returning a context manager entered "
            "around the task body, e.g. to switch a django-tenants schema. Not called without a tenant.",
            check=_callable_or_path,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="tenant_resolver",
            default=None,
            doc="Django: callable (or dotted path) taking the HttpRequest and returning its tenant id or None.",
            check=_callable_or_path,
            scopes=frozenset({APP}),
        ),
        Option(
            name="request_id_headers",
            default=("X-Request-ID", "X-Correlation-ID"),
            doc="Django: request headers read, in order, for the correlation id of a request.",
            check=_header_names,
            scopes=frozenset({APP}),
        ),
    )
}


def _unknown(key: str, known: Any) -> ConfigurationError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigurationError(key, "unknown key" + hint)


def _checked(key: str, value: Any) -> Any:
    try:
        return OPTIONS[key].check(value)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(key, str(exc)) from None


def validate(raw: Any, *, scope: str = APP) -> dict[str, Any]:
    """Check a mapping of options for ``scope``; return the checked values (unset keys are absent)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigurationError("guardrails", f"must be a dict, got {type(raw).__name__}")
    known = [name for name, option in OPTIONS.items() if scope in option.scopes]
    checked = {}
    for key, value in raw.items():
        if key not in known:
            if key in OPTIONS:
                raise ConfigurationError(key, f"cannot be set in {scope} scope")
            raise _unknown(str(key), known)
        checked[key] = _checked(key, value)
    return checked


def app_settings(app: Any) -> dict[str, Any]:
    """The validated ``guardrails`` mapping of a Celery app (cached until the mapping is replaced)."""
    raw = app.conf.get("guardrails")
    cached = getattr(app, "_guardrails_settings", None)
    if cached is not None and cached[0] is raw:
        return cached[1]  # type: ignore[no-any-return]
    checked = validate(raw)
    app._guardrails_settings = (raw, checked)
    return checked


def django_settings() -> dict[str, Any]:
    """The validated ``CELERY_GUARDRAILS`` of the Django settings (Django imported only when called)."""
    from django.conf import settings

    return validate(getattr(settings, "CELERY_GUARDRAILS", None))


def validate_task(task: Any) -> None:
    """Check the guardrail options set as attributes of a task class; raise naming task and key."""
    for name, option in OPTIONS.items():
        value = getattr(type(task), name, None)
        if value is None:
            continue
        if TASK not in option.scopes:
            raise ConfigurationError(name, f"cannot be set on task {task.name!r}; set it in the app config")
        try:
            option.check(value)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(name, f"on task {task.name!r}: {exc}") from None


def check_call_options(call: Mapping[str, Any]) -> dict[str, Any]:
    """Validate per-call options given to ``apply_async``."""
    return validate(call, scope=CALL)


def resolve(task: Any, name: str, call: Mapping[str, Any]) -> Any:
    """The value of option ``name`` for ``task``: per call, then task, then app config, then default."""
    if name in call:
        return call[name]
    # Read from the class: a function given as a decorator kwarg must not become a bound method.
    value = getattr(type(task), name, None)
    if value is not None:
        return value
    settings = app_settings(task.app)
    if name in settings:
        return settings[name]
    return OPTIONS[name].default


def load(value: Any) -> Any:
    """A callable given as a callable or as a dotted path ``package.module.attr``."""
    if not isinstance(value, str):
        return value
    module_name, _, attr = value.rpartition(".")
    try:
        return getattr(import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(value, f"cannot import {value!r}: {exc}") from None
