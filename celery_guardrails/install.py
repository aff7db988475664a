"""Wiring celery-guardrails into a Celery app.

``GuardedTask`` calls :func:`install` when it is bound to an app, so switching a task's base class is all a
project does. Installing adds :class:`GuardrailsBootstep` to the app's worker blueprint: it validates the
``guardrails`` config and every guarded task's options as the worker starts, so a typo stops the worker with
an error that names the key, instead of silently running without a guardrail.

The publish/run signal handlers of the context guardrail are connected when :mod:`celery_guardrails` is
imported; they do not depend on the app.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from celery.signals import after_setup_logger, after_setup_task_logger

from celery_guardrails import options
from celery_guardrails.log import ContextFilter

logger = logging.getLogger(__name__)


class GuardrailsBootstep(bootsteps.Step):  # type: ignore[misc]
    """Worker start-up: refuse to start on a bad guardrails config."""

    label = "Guardrails"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        from celery_guardrails.task import GuardedTask

        app = parent.app
        settings = options.app_settings(app)
        # Poison protection, idempotency keys and budgets need a store: no store is a start-up error.
        from celery_guardrails.stores import store_url

        store_url(app)
        guarded = [task for task in app.tasks.values() if isinstance(task, GuardedTask)]
        for task in guarded:
            options.validate_task(task)
        logger.info("celery-guardrails: %d guarded task(s), app settings %s", len(guarded), sorted(settings))
        super().__init__(parent, **kwargs)


def install(app: Any) -> None:
    """Add the guardrails start-up step to ``app`` (idempotent)."""
    if getattr(app, "_guardrails_installed", False):
        return
    app._guardrails_installed = True
    app.steps["worker"].add(GuardrailsBootstep)


def _add_context_filter(logger: logging.Logger | None = None, **_: Any) -> None:
    # Celery configured its own handlers (worker_hijack_root_logger=True): give their records the context
    # fields, so a format such as "%(tenant)s %(correlation_id)s" works there too.
    for handler in getattr(logger, "handlers", ()):
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter())


after_setup_logger.connect(_add_context_filter, weak=False, dispatch_uid="celery_guardrails.log.worker")
after_setup_task_logger.connect(_add_context_filter, weak=False, dispatch_uid="celery_guardrails.log.task")
