"""The ordering-and-concurrency axis (GA5xx): what the broker does with a message held long. On Redis, a retry
delay or time limit not shorter than the ``visibility_timeout`` (:func:`visibility_rules`: delivered twice); on
RabbitMQ, a time limit past the consumer timeout (:func:`consumer_timeout_rules`); prefetching behind long
tasks; an ``ordering_key`` without an ``idempotency_key``. The two broker rules are also the worker's start-up
warnings.
"""

from __future__ import annotations

from typing import Any

from celery_guardrails.operations.audit.model import WARNING, Finding, finding
from celery_guardrails.operations.audit.tasks import time_limit
from celery_guardrails.options import app_value, resolve

#: Seconds above which a task counts as long for the prefetch finding (GA502).
LONG_TASK = 60.0


def visibility_rules(app: Any, tasks: list[Any]) -> list[Finding]:
    """GA501, on a Redis broker (any URL form, Sentinel's too: :func:`celery_guardrails.broker.kind.broker_kind`):
    a guarded task's ``backoff_max`` or ``retry_later_delay * retry_later_max``, or (``acks_late``, no
    ``broker_lease``) a task's ``time_limit``, not shorter than the transport's ``visibility_timeout``. The audit's
    finding, and the worker's start-up warning (:func:`celery_guardrails.runtime.install.warn_about`)."""
    from celery_guardrails.broker.delays import visibility_timeout
    from celery_guardrails.broker.kind import broker_kind
    from celery_guardrails.runtime.pipeline import is_guarded

    if not broker_kind(app).redis:
        return []
    found = []
    visibility = visibility_timeout(app)
    lease = app_value(app, "broker_lease")
    for task in tasks:
        longer = []
        if is_guarded(task):
            longer.append(("backoff_max", float(resolve(task, "backoff_max", {}))))
            later = float(resolve(task, "retry_later_delay", {})) * resolve(task, "retry_later_max", {})
            longer.append(("retry_later_delay * retry_later_max", later))
        limit = time_limit(app, task)
        if limit and task.acks_late and not lease:
            longer.append(("time_limit", limit))
        over = [f"{name} {value:g} s" for name, value in longer if value >= visibility]
        if over:
            found.append(
                finding(
                    "GA501",
                    WARNING,
                    task.name,
                    f"{', '.join(over)}: not shorter than the Redis visibility_timeout {visibility:g} s: the "
                    "message is delivered twice",
                    "lower them below broker_transport_options['visibility_timeout'] (or raise it; keep "
                    "broker_lease on)",
                )
            )
    return found


def consumer_timeout_rules(app: Any, guarded: list[Any]) -> list[Finding]:
    """GA504, RabbitMQ: a guarded task whose ``time_limit`` is unset or longer than the consumer timeout the app
    declares. The rule of :func:`celery_guardrails.broker.lease.long_holders`, which the worker logs at start-up
    (one line naming them all)."""
    from celery_guardrails.broker.lease import long_holders

    found = long_holders(app, guarded)
    if found is None:
        return []
    return [
        finding(
            "GA504",
            WARNING,
            name,
            f"its time_limit is unset or longer than RabbitMQ's consumer_timeout ({found.timeout:g} s): RabbitMQ "
            "closes the channel of a delivery held longer and delivers its messages again",
            "set time_limit below it, or raise consumer_timeout (rabbitmq.conf, or the queue argument "
            "x-consumer-timeout) and rabbitmq_consumer_timeout with it",
        )
        for name in found.tasks
    ]


def ordering_rules(app: Any, tasks: list[Any], guarded: list[Any]) -> list[Finding]:
    """Ordering and concurrency (GA5xx): the visibility rule, prefetching long tasks, an ordering key with
    no idempotency key, and RabbitMQ's consumer timeout."""
    found = visibility_rules(app, tasks)
    prefetch = app.conf.worker_prefetch_multiplier
    if prefetch is not None and prefetch > 1:
        long_tasks = [task.name for task in tasks if (time_limit(app, task) or float("inf")) > LONG_TASK]
        if long_tasks:
            shown = ", ".join(long_tasks[:10]) + (f" and {len(long_tasks) - 10} more" if len(long_tasks) > 10 else "")
            found.append(
                finding(
                    "GA502",
                    WARNING,
                    "worker_prefetch_multiplier",
                    f"worker_prefetch_multiplier is {prefetch} with tasks whose time_limit is unset or over "
                    f"{LONG_TASK:g} s ({shown}): messages wait behind a long task in a worker that holds them",
                    "set worker_prefetch_multiplier = 1 (or time_limit of 60 s or less on those tasks)",
                )
            )
    for task in guarded:
        if resolve(task, "ordering_key", {}) is not None and resolve(task, "idempotency_key", {}) is None:
            found.append(
                finding(
                    "GA503",
                    WARNING,
                    task.name,
                    "ordering_key without idempotency_key: a duplicate delivery of a message (a redelivery) runs again",
                    "set idempotency_key as well",
                )
            )
    found += consumer_timeout_rules(app, guarded)
    return found
