"""celery-guardrails' test kit: prove your own tasks against the rubric's bad days, on a real worker.

A pytest plugin, inert until enabled (any one of):

* the marker ``@pytest.mark.guardrails`` on a test, class or module (``pytestmark``);
* ``guardrails_kit = true`` in the pytest ini file (or ``--guardrails-kit``);
* ``pytest_plugins = ["celery_guardrails.testing"]`` in a ``conftest.py``.

It gives the fixtures ``guardrails_kit`` (a :class:`Kit`) and ``guarded_worker`` (its
:class:`GuardedWorker`), and, for the test that has a kit, these helpers (the kit's methods, importable as
functions):

* :func:`deliver_twice`, :func:`crash_mid_task`, :func:`poison`, :func:`out_of_order`,
  :func:`deploy_during_processing`, :func:`store_outage`;
* :func:`assert_single_effect`, :func:`assert_dead_lettered`, :func:`assert_no_loss`;
* :func:`assert_job` (needs no kit: any test with the Django app and a worker).

The guide is ``docs/testing.md``.
"""

from __future__ import annotations

from typing import Any

from celery_guardrails.testing.assertions import (
    assert_dead_lettered,
    assert_job,
    assert_no_loss,
    assert_single_effect,
)
from celery_guardrails.testing.current import current_kit
from celery_guardrails.testing.kit import Captured, Kit, KitError, Release, Report
from celery_guardrails.testing.worker import GuardedWorker, WorkerFailed

# Listing this package in pytest_plugins registers the fixtures and hooks.
pytest_plugins = ["celery_guardrails.testing.plugin"]


def deliver_twice(task: Any, *args: Any, concurrently: bool = False, **kwargs: Any) -> Report:
    """See :meth:`Kit.deliver_twice`."""
    return current_kit().deliver_twice(task, *args, concurrently=concurrently, **kwargs)


def crash_mid_task(task: Any, *args: Any, at: str | float, **kwargs: Any) -> Report:
    """See :meth:`Kit.crash_mid_task`."""
    return current_kit().crash_mid_task(task, *args, at=at, **kwargs)


def poison(task: Any, *args: Any, how: str = "crash", **kwargs: Any) -> Report:
    """See :meth:`Kit.poison`."""
    return current_kit().poison(task, *args, how=how, **kwargs)


def out_of_order(task: Any, messages: Any, *, order: Any = None) -> Report:
    """See :meth:`Kit.out_of_order`."""
    return current_kit().out_of_order(task, messages, order=order)


def deploy_during_processing(task: Any, *, old: Release, new: Release, replay: bool = True) -> Report:
    """See :meth:`Kit.deploy_during_processing`."""
    return current_kit().deploy_during_processing(task, old=old, new=new, replay=replay)


def store_outage(task: Any, *args: Any, seconds: float = 1.0, at: str = "start", **kwargs: Any) -> Report:
    """See :meth:`Kit.store_outage`."""
    return current_kit().store_outage(task, *args, seconds=seconds, at=at, **kwargs)


__all__ = [
    "Captured",
    "GuardedWorker",
    "Kit",
    "KitError",
    "Release",
    "Report",
    "WorkerFailed",
    "assert_dead_lettered",
    "assert_job",
    "assert_no_loss",
    "assert_single_effect",
    "crash_mid_task",
    "current_kit",
    "deliver_twice",
    "deploy_during_processing",
    "out_of_order",
    "poison",
    "store_outage",
]
