"""Which tasks the audit grades, and what they declare that several rules read: :func:`graded_tasks` leaves out
Celery's own tasks and the extension's (a finding names something the project can change), and
:func:`time_limit` is a task's hard time limit, its own or the app's (the retry, visibility and prefetch rules
read it).
"""

from __future__ import annotations

from typing import Any

#: Task-name prefixes that are not graded: Celery's own tasks and the extension's.
SKIPPED_PREFIXES = ("celery.", "django_celery_guardrails.")


def graded_tasks(app: Any) -> list[Any]:
    """The app's registered tasks the audit grades (not Celery's own, nor the extension's), by name."""
    return [task for name, task in sorted(app.tasks.items()) if not name.startswith(SKIPPED_PREFIXES)]


def time_limit(app: Any, task: Any) -> float | None:
    """The task's hard time limit in seconds (its own, else ``task_time_limit``); None when it has none."""
    limit = task.time_limit or app.conf.task_time_limit
    return float(limit) if limit else None
