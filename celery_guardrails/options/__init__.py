"""Guardrail options: one schema, one lookup rule, one checker.

Options are declared by the module that owns them (a guardrail in :mod:`celery_guardrails.guardrails`, the
runtime, scheduling, operations, broker or store module that reads them), into the one schema of
:mod:`~celery_guardrails.options.schema`; see there for the rule that keeps this free of import cycles.
Every option is read through :func:`resolve` (a task's) or :func:`app_value` (the app's), one rule everywhere:
per-call option, then task attribute, then app config, then the declared default
(:mod:`~celery_guardrails.options.lookup`). A delivery resolves each option once, through the
:class:`TaskOptions` its hooks share (:mod:`celery_guardrails.runtime.view`).

Keys are lowercase, like Celery's own settings. An unknown key or a bad value raises
:class:`~celery_guardrails.exceptions.ConfigurationError` naming the key (with a "did you mean"), when the worker
starts (see :mod:`celery_guardrails.runtime.install` and :mod:`~celery_guardrails.options.startup`), when a Django
project runs its system checks, and on first use (:mod:`~celery_guardrails.options.config`).

- :mod:`~celery_guardrails.options.schema`: ``Option``, the scopes, the registry and ``declare``;
- :mod:`~celery_guardrails.options.checks`: the value checks options share;
- :mod:`~celery_guardrails.options.config`: the app config, read once and validated;
- :mod:`~celery_guardrails.options.lookup`: the lookup rule;
- :mod:`~celery_guardrails.options.startup`: what a worker checks as it starts;
- :mod:`~celery_guardrails.options.loading`: dotted paths to callables.
"""

from __future__ import annotations

from celery_guardrails.options.checks import COUNT_MAX, SECONDS_MAX, masked
from celery_guardrails.options.config import (
    app_settings,
    check_call_options,
    django_settings,
    settings_snapshot,
    validate,
)
from celery_guardrails.options.loading import load
from celery_guardrails.options.lookup import (
    CELERY_EQUIVALENTS,
    TaskOptions,
    app_value,
    celery_equivalent,
    celery_option,
    celery_option_set,
    resolve,
    task_attribute,
)
from celery_guardrails.options.schema import APP, CALL, OPTIONS, TASK, Option, declare, task_check
from celery_guardrails.options.startup import Weakness, import_paths, validate_task, warnings_about, weak_settings

__all__ = [
    "APP",
    "CALL",
    "CELERY_EQUIVALENTS",
    "COUNT_MAX",
    "OPTIONS",
    "SECONDS_MAX",
    "TASK",
    "Option",
    "TaskOptions",
    "Weakness",
    "app_settings",
    "app_value",
    "celery_equivalent",
    "celery_option",
    "celery_option_set",
    "check_call_options",
    "declare",
    "django_settings",
    "import_paths",
    "load",
    "masked",
    "resolve",
    "settings_snapshot",
    "task_attribute",
    "task_check",
    "validate",
    "validate_task",
    "warnings_about",
    "weak_settings",
]
