"""A logging filter that puts the task and request context on every log record.

Add it to the handlers whose format shows the fields::

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
"""

from __future__ import annotations

import logging

from celery._state import get_current_task

from celery_guardrails.context import current_correlation_id, current_tenant

MISSING = "-"


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
