"""Named points in a task's body where the test kit can crash or pause a worker.

A task calls ``fault_point("charged")`` between two steps of its work; in production this is one global read
and nothing happens. A worker started by the test kit (:mod:`celery_guardrails.testing`) arms the points of
its processes, so that a test can SIGKILL the worker exactly there (``crash_mid_task(..., at="charged")``) or
hold the delivery there while it cuts the store (``store_outage(..., at="charged")``).
"""

from __future__ import annotations

from collections.abc import Callable

#: The handler a test worker's agent installs; None everywhere else.
_armed: Callable[[str], None] | None = None


def fault_point(name: str) -> None:
    """Mark a point of the running task's body the test kit can crash or pause it at."""
    if _armed is not None:
        _armed(name)


def arm(handler: Callable[[str], None] | None) -> None:
    """Install (or, with None, remove) the handler of this process's fault points (the test kit's agent)."""
    global _armed
    _armed = handler
