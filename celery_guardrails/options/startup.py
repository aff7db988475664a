"""What a worker checks as it starts (and ``manage.py check`` with it): each guarded task's options, the
dotted paths the options name, and the settings that are allowed but weaken a guardrail."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.options.checks import callable_or_path
from celery_guardrails.options.config import app_settings
from celery_guardrails.options.loading import load
from celery_guardrails.options.lookup import task_attribute
from celery_guardrails.options.schema import OPTIONS, TASK, TASK_CHECKS


def validate_task(task: Any) -> None:
    """Check the guardrail options set as attributes of a task class; raise naming task and key. Then the
    checks guardrails registered across options (:func:`~celery_guardrails.options.schema.task_check`: a key
    template that names a sensitive argument, see ``celery_guardrails.guardrails.contract``)."""
    for name, option in OPTIONS.items():
        value = task_attribute(task, name)
        if value is None:
            continue
        if TASK not in option.scopes:
            raise ConfigurationError(name, f"cannot be set on task {task.name!r}; set it in the app config")
        try:
            option.check(value)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(name, f"on task {task.name!r}: {exc}") from None
    for check in TASK_CHECKS:
        check(task)


@dataclass(frozen=True, slots=True, kw_only=True)
class Weakness:
    """A setting that is allowed but makes a guardrail weaker than it looks: ``subject`` (the setting, or the
    task's name) and one sentence saying what is lost."""

    subject: str
    message: str


def weak_settings(settings: Mapping[str, Any], tasks: Iterable[Any] = ()) -> list[Weakness]:
    """The one rule for an empty ``redact_keys`` (app or task): the worker's start-up warning and the audit's
    GA106 (:func:`celery_guardrails.operations.audit.redaction_rules`), ``manage.py check``'s guardrails.W003
    (:func:`warnings_about`)."""
    found = []
    if "redact_keys" in settings and not settings["redact_keys"]:
        found.append(
            Weakness(
                subject="redact_keys",
                message="redact_keys is empty: no value is redacted by its key name in dead letters and logs",
            )
        )
    for task in tasks:
        value = task_attribute(task, "redact_keys")
        if value is not None and not value:
            found.append(
                Weakness(
                    subject=task.name,
                    message=f"redact_keys is empty on task {task.name!r}: nothing of its dead letters is redacted "
                    "by name",
                )
            )
    return found


def warnings_about(settings: Mapping[str, Any], tasks: Iterable[Any] = ()) -> list[str]:
    """Settings that are allowed but make a guardrail weaker than it looks, one sentence each (``manage.py
    check`` shows them; the worker logs them at start-up as the audit's GA106): see :func:`weak_settings`."""
    return [weakness.message for weakness in weak_settings(settings, tasks)]


def import_paths(app: Any, tasks: list[Any]) -> None:
    """Import every option given as a dotted path (the app's and each task's), as a worker starts: a typo
    stops the worker naming the key, instead of surfacing the first time a retry needs it."""
    for name, option in OPTIONS.items():
        if option.check is not callable_or_path:
            continue
        values = [app_settings(app).get(name), *(task_attribute(task, name) for task in tasks)]
        for value in values:
            if isinstance(value, str):
                try:
                    load(value)
                except ConfigurationError as exc:
                    raise ConfigurationError(name, exc.problem) from None
