"""The option schema: what an option is, and the one registry every module that owns options declares into.

A module declares the options it reads beside its own code (a guardrail in ``guardrails/``, a runtime, scheduling,
operations, broker or store module), the way Dramatiq's middleware declare their ``actor_options``::

    from celery_guardrails.options import APP, TASK, Option, checks, declare

    #: The options poison-message protection reads, declared into the one schema (celery_guardrails.options).
    DECLARED = declare(
        Option(name="max_deliveries", default=3, doc="...", check=checks.positive_int, scopes=frozenset({TASK, APP})),
    )

The rule that keeps this free of import cycles has two halves:

1. the options package imports no module that declares options: it depends on
   :mod:`celery_guardrails.exceptions` and Celery only, so every module may import it, at module level;
2. the registry is complete once the package ``celery_guardrails`` is imported (Python runs its ``__init__``
   before any of its modules is used): the ``__init__`` imports every declaring module, most through
   ``GuardedTask``, the others by name. Options are read at call time, never while modules are still being
   imported, so no lookup sees a partial registry.

tests/celery_guardrails/options/test_schema.py checks both halves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

#: Where an option may be set: per call (``apply_async(..., name=value)``), on the task, in the app config.
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


_REGISTRY: dict[str, Option] = {}
#: Every declared option by name (read-only: options are added with :func:`declare`).
OPTIONS: Mapping[str, Option] = MappingProxyType(_REGISTRY)

#: Checks of a task class beyond its options' own values (a guardrail's rule across options), run by
#: :func:`~celery_guardrails.options.startup.validate_task` after every option passed.
TASK_CHECKS: list[Callable[[Any], None]] = []


def declare(*options: Option) -> tuple[Option, ...]:
    """Add ``options`` to the schema; return them (the declaring module keeps them as its ``DECLARED``).

    A name declared twice is a programming error: two owners would give it two defaults."""
    for option in options:
        if option.name in _REGISTRY:
            raise ValueError(f"guardrail option {option.name!r} is declared twice")
        _REGISTRY[option.name] = option
    return options


def task_check(check: Callable[[Any], None]) -> Callable[[Any], None]:
    """Register ``check(task)`` (raises ConfigurationError) to run when a task's options are validated."""
    TASK_CHECKS.append(check)
    return check
