"""A Prometheus collector of state read at scrape time: queues, dead letters, dependencies, schedules.

:class:`StateCollector` reads :func:`celery_guardrails.operations.status.gather` on every ``collect()`` and yields
gauges
(label values are queue, owner, task, dependency and schedule names: few, and chosen by the deployment)::

    celery_guardrails_queue_depth{queue}                        messages waiting (unacked ones not counted)
    celery_guardrails_queue_oldest_age_seconds{queue}           age of the oldest waiting message (0: empty);
                                                                no sample when it is unknown (see below)
    celery_guardrails_queue_oldest_age_known{queue}             1, or 0: a message without ``pub`` (plain
                                                                Celery) at a list's tail, or RabbitMQ, which
                                                                cannot tell it without consuming
    celery_guardrails_dead_letters_open{owner,task}             open dead letters (owner "" when none)
    celery_guardrails_retry_budget_retries{dependency}          retries in the budget's sliding window
    celery_guardrails_retry_budget_allowed{dependency}          retries the budget allows in it
    celery_guardrails_circuit_state{dependency,state}           1 for the circuit's state, 0 for the others
    celery_guardrails_schedule_missed_runs{schedule}            runs missed in the last 7 days
    celery_guardrails_schedule_overdue_runs{schedule}           runs overdue in the last 7 days
    celery_guardrails_schedule_last_success_age_seconds{schedule}  since the newest successful period (no
                                                                sample when none is kept)
    celery_guardrails_outbox_messages                           outbox messages waiting for the relay (Django)
    celery_guardrails_outbox_oldest_age_seconds                 the oldest one's age: the relay's lag (0: none)
    celery_guardrails_ordering_keys_waiting                     ordering keys waiting for a missing earlier
                                                                message (a guarded task has ordering_key)
    celery_guardrails_ordering_oldest_wait_seconds              the longest wait's age (0: none waits)
    celery_guardrails_jobs{task,state}                          jobs kept in each state (task.submit(); with a
                                                                job book: the Django app), every state named
    celery_guardrails_collector_source_up{source}               1: the source was read in this scrape, 0: not
    celery_guardrails_collector_errors_total{source}            sources that could not be read, since start

A source that cannot be read (its store or broker down) is left out of that scrape with a logged warning,
``source_up`` 0 and the error counter counted; the other sources are exported. ``collect()`` never raises:
a scrape of a worker's metrics must never disturb the worker. Register it once per process::

    from prometheus_client import REGISTRY
    REGISTRY.register(StateCollector(app))

Each scrape reads the broker and the store (a few round trips, one database query per source): keep it to
one process of a deployment, or a scrape interval of seconds, not one per worker child.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from celery_guardrails.stores.base import CLOSED, HALF_OPEN, OPEN

logger = logging.getLogger(__name__)

PREFIX = "celery_guardrails_"
CIRCUIT_STATES = (CLOSED, OPEN, HALF_OPEN)
#: The source name of the job counts (read from the registered job book, not by status.gather).
JOBS_SOURCE = "jobs"


class StateCollector(Collector):
    """Gauges of the broker's queues and the guardrails' stores, read at scrape time (see the module docstring).

    ``queues``: queue names to read besides those the app declares. ``close_database``: with the Django app,
    close this thread's database connections after each scrape (unless in a transaction): an exposition server
    (``prometheus_client.start_http_server``) answers each scrape in a new thread, whose connection would
    otherwise stay open until the thread object is collected.
    """

    def __init__(self, app: Any, *, queues: Iterable[str] = (), close_database: bool = True) -> None:
        self.app = app
        self.queues = list(queues)
        self.close_database = close_database
        self.errors: Counter[str] = Counter()

    def describe(self) -> list[Metric]:
        # Nothing read at registration: the sources may be down when the process starts.
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            families = self._families()
        except Exception:  # a bug here must not fail the scrape of the other metrics
            logger.exception("Guardrails collector: the scrape failed")
            return
        finally:
            if self.close_database:
                _close_database()
        yield from families

    def _families(self) -> list[Metric]:
        from celery_guardrails.operations import status as status_module

        status = status_module.gather(self.app, queues=self.queues)
        for source in status.errors:
            self.errors[source] += 1
        families: list[Metric] = []
        if status_module.QUEUES not in status.errors:
            families += _queue_families(status)
        if status_module.DEAD_LETTERS not in status.errors:
            families += _dead_letter_families(status)
        if status_module.DEPENDENCIES not in status.errors:
            families += _dependency_families(status)
        if status_module.SCHEDULES not in status.errors:
            families += _schedule_families(status)
        if status.outbox is not None:
            families += _outbox_families(status.outbox)
        if status.ordering is not None:
            families += _ordering_families(status.ordering)
        sources = list(status_module.SOURCES)
        book = _job_book()
        if book is not None:
            sources.append(JOBS_SOURCE)
            counts = status_module.attempt(JOBS_SOURCE, book.counts, status.errors, app=self.app)
            if counts is None:
                self.errors[JOBS_SOURCE] += 1
            else:
                families += _job_families(counts)
        up = GaugeMetricFamily(
            PREFIX + "collector_source_up",
            "1: the source was read in this scrape; 0: it could not be",
            labels=["source"],
        )
        errors = CounterMetricFamily(
            PREFIX + "collector_errors", "Scrapes in which the source could not be read", labels=["source"]
        )
        for source in sources:
            up.add_metric([source], 0 if source in status.errors else 1)
            errors.add_metric([source], self.errors[source])
        return [*families, up, errors]


def _queue_families(status: Any) -> list[Metric]:
    depth = GaugeMetricFamily(PREFIX + "queue_depth", "Messages waiting in the queue", labels=["queue"])
    age = GaugeMetricFamily(
        PREFIX + "queue_oldest_age_seconds", "Seconds since the oldest waiting message was published", labels=["queue"]
    )
    known = GaugeMetricFamily(
        PREFIX + "queue_oldest_age_known", "1: the oldest message's age is known; 0: it is not", labels=["queue"]
    )
    for queue in status.queues:
        depth.add_metric([queue.queue], queue.depth)
        known.add_metric([queue.queue], 0 if queue.oldest_age is None else 1)
        if queue.oldest_age is not None:
            age.add_metric([queue.queue], queue.oldest_age)
    return [depth, age, known]


def _dead_letter_families(status: Any) -> list[Metric]:
    family = GaugeMetricFamily(
        PREFIX + "dead_letters_open", "Open dead letters per owner and task", labels=["owner", "task"]
    )
    for count in status.dead_letters.counts:
        family.add_metric([count.owner, count.task], count.open)
    return [family]


def _dependency_families(status: Any) -> list[Metric]:
    retries = GaugeMetricFamily(
        PREFIX + "retry_budget_retries", "Retries in the retry budget's window", labels=["dependency"]
    )
    allowed = GaugeMetricFamily(
        PREFIX + "retry_budget_allowed", "Retries the retry budget allows in its window", labels=["dependency"]
    )
    circuit = GaugeMetricFamily(
        PREFIX + "circuit_state", "1 for the circuit breaker's state", labels=["dependency", "state"]
    )
    for dependency in status.dependencies:
        retries.add_metric([dependency.dependency], dependency.retries)
        allowed.add_metric([dependency.dependency], dependency.retries_allowed)
        for state in CIRCUIT_STATES:
            circuit.add_metric([dependency.dependency, state], 1 if dependency.circuit == state else 0)
    return [retries, allowed, circuit]


def _schedule_families(status: Any) -> list[Metric]:
    missed = GaugeMetricFamily(PREFIX + "schedule_missed_runs", "Runs missed in the last 7 days", labels=["schedule"])
    overdue = GaugeMetricFamily(
        PREFIX + "schedule_overdue_runs", "Runs overdue in the last 7 days", labels=["schedule"]
    )
    success = GaugeMetricFamily(
        PREFIX + "schedule_last_success_age_seconds", "Seconds since the newest successful period", labels=["schedule"]
    )
    for schedule in status.schedules:
        missed.add_metric([schedule.schedule], schedule.missed)
        overdue.add_metric([schedule.schedule], schedule.overdue)
        if schedule.last_success_age is not None:
            success.add_metric([schedule.schedule], schedule.last_success_age)
    return [missed, overdue, success]


def _outbox_families(outbox: Any) -> list[Metric]:
    waiting = GaugeMetricFamily(PREFIX + "outbox_messages", "Outbox messages waiting for the relay")
    waiting.add_metric([], outbox.waiting)
    age = GaugeMetricFamily(
        PREFIX + "outbox_oldest_age_seconds", "Age of the oldest outbox message: the relay's lag (0: none waits)"
    )
    age.add_metric([], outbox.oldest_age or 0.0)
    return [waiting, age]


def _ordering_families(ordering: Any) -> list[Metric]:
    waiting = GaugeMetricFamily(
        PREFIX + "ordering_keys_waiting", "Ordering keys whose messages wait for a missing earlier message"
    )
    waiting.add_metric([], ordering.waiting)
    age = GaugeMetricFamily(
        PREFIX + "ordering_oldest_wait_seconds", "Seconds the longest-waiting ordering key has waited (0: none)"
    )
    age.add_metric([], ordering.oldest_age or 0.0)
    return [waiting, age]


def _job_book() -> Any:
    """The registered job book (the Django app's), or None: no gauge of jobs without one."""
    from celery_guardrails.guardrails.jobs import registered_book

    return registered_book()


def _job_families(counts: Any) -> list[Metric]:
    from celery_guardrails.guardrails.jobs import STATES

    family = GaugeMetricFamily(PREFIX + "jobs", "Jobs kept in each state, per task", labels=["task", "state"])
    found: dict[tuple[str, str], int] = {(count.task, count.state): count.jobs for count in counts}
    # Every state of every task that has jobs, 0 when none is in it: a rate or an alert on one state finds its
    # series before the first job reaches it.
    for task in sorted({task for task, _ in found}):
        for state in STATES:
            family.add_metric([task, state], found.get((task, state), 0))
    return [family]


def _close_database() -> None:
    """Close this thread's Django database connections that are not inside a transaction (never raises)."""
    from celery_guardrails.stores import django_apps_installed

    try:
        if not django_apps_installed():
            return
        from django.db import connections

        for connection in connections.all(initialized_only=True):
            if not connection.in_atomic_block:
                connection.close()
    except Exception:
        logger.warning("Guardrails collector: closing the database connection failed", exc_info=True)
