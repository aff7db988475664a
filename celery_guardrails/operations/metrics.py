"""Prometheus metrics a worker and a publisher record as things happen, and their exposition.

Switched on by the app option ``metrics`` (default False: nothing is recorded, each hook costs one settings
look-up). Needs ``prometheus-client`` (the ``prometheus`` extra). The metrics, all labelled by task name and
never by task id or tenant (a label per id would make a time series per message):

``celery_guardrails_task_duration_seconds`` (histogram; task, queue)
    How long a delivery took on the worker, from the first guardrail hook to the last (the body and every
    guardrail), whatever its ending. Buckets: the ``metrics_buckets`` option.
``celery_guardrails_task_outcomes_total`` (counter; task, outcome, detail)
    How each delivery ended, one outcome per delivery:

    ==================== ====================================================================================
    outcome              detail
    ==================== ====================================================================================
    succeeded            "" (the body ran and returned)
    skipped              "" (a success whose body did not run: a scheduled period skipped, a stale message)
    retried              ``transient`` (classified), ``manual`` (the body's ``self.retry()``),
                         ``store_unavailable`` (the store was out of reach), ``guardrail`` (another
                         re-publish: a dead letter waiting to be recorded)
    retry_later          "" (``RetryLater``, a held idempotency key, a run slot: no attempt spent)
    deferred_budget      "" (the dependency's retry budget put it off)
    deferred_circuit     "" (the dependency's open circuit put it off)
    dead_lettered        the dead letter's reason (``permanent``, ``attempts_exhausted``, ``poison``, ...)
    duplicate_skipped    the key's state (``completed``, ``failed``)
    failed               "" (a failure that no guardrail handed over; with every guardrail on, rare)
    ==================== ====================================================================================

    A final failure whose dead letter was already recorded (a redelivery after the record, before the ack)
    is not counted again. A delivery its hard time limit killed is counted by the main process (dead_lettered
    ``time_limit``, and completed), without a duration; one retried after the kill is counted published only.
``celery_guardrails_task_queue_wait_seconds`` (histogram; task, queue)
    From publish (the header field ``pub``; a retry's own re-publish sets it anew) to the start of the
    delivery, less the time the message was not due yet (its ETA or countdown): how long it waited for a worker.
``celery_guardrails_task_queue_wait_unknown_total`` (counter; task, queue)
    Deliveries whose publish time is unknown (a message from plain Celery or an older release): never
    observed as a wait of zero.
``celery_guardrails_messages_published_total`` (counter; task, queue)
    Messages this process published (guarded or not: arrival).
``celery_guardrails_messages_completed_total`` (counter; task, queue)
    Guarded deliveries that ended on a worker: success, final failure, or a retry published (throughput).
``celery_guardrails_job_time_to_terminal_seconds`` (histogram; task, state)
    From a job's submit to its final state (``succeeded``, ``failed``, ``dead_lettered``, ``cancelled``),
    observed by the job book once that state is committed (on the worker; for a cancel, where it was asked). A
    replayed job is observed again as it ends again, from the same submit. Buckets: 1 s to a day.

The gauge of jobs by task and state (``celery_guardrails_jobs``) is read from the database at scrape time by
:class:`celery_guardrails.operations.collectors.StateCollector`.

Label values are redacted (:func:`label_values`): a queue is the publisher's routing key and a dead letter's
reason may come from a message header, free text either way, so they lose what
:mod:`celery_guardrails.foundation.redaction` would take out of a log line (the app's ``redact_keys`` and
``redact_patterns``). So do the task and queue names the activity counts keep.

Recording never raises into a task: a failure is logged once per kind (then at DEBUG) and the task goes on.

Exposition. A prefork worker's children record in prometheus_client's multiprocess mode: set
``PROMETHEUS_MULTIPROC_DIR`` to an empty directory before the worker starts (and wipe it before each start of
the whole worker, as prometheus_client asks); a child that exits is marked dead. The opt-in HTTP endpoint
(``metrics_port``) is started by a worker bootstep in the main process only and serves
:func:`metrics_registry`: every child's metrics summed when the variable is set, else this process's own
(solo and threads pools). The Django view (``django_celery_guardrails.views.metrics``) serves the same.

This module holds the :class:`Metrics` guardrail (a delivery's wait, duration and ending); the families and
metric objects are in :mod:`.instruments`, the outcomes the signals tell in :mod:`.outcome_counts`, the
exposition in :mod:`.exposition`. Their public names stay importable from here.
"""

from __future__ import annotations

import itertools
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery_guardrails.operations import activity
from celery_guardrails.operations.exposition import MetricsEndpoint, exposition, metrics_registry, register_collector
from celery_guardrails.operations.instruments import (
    DEAD_LETTERED,
    DEFERRED_BUDGET,
    DEFERRED_CIRCUIT,
    DUPLICATE_SKIPPED,
    FAILED,
    FAMILIES,
    JOB_TIME_TO_TERMINAL,
    JOBS,
    MESSAGES_COMPLETED,
    MESSAGES_PUBLISHED,
    MULTIPROC_DIR,
    OUTCOMES,
    PREFIX,
    QUEUE_WAIT,
    QUEUE_WAIT_UNKNOWN,
    REGISTRY,
    RETRIED,
    RETRY_LATER,
    SKIPPED,
    SUCCEEDED,
    TASK_DURATION,
    TASK_OUTCOMES,
    Instruments,
    available,
    enabled,
    instruments,
    job_finished,
    label_values,
    queue_of,
    recording_failed,
)
from celery_guardrails.operations.outcome_counts import _on_published, activity_counts, ending_told, tell_ended
from celery_guardrails.options import APP, Option, checks, declare
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import delivery, view
from celery_guardrails.runtime.pipeline import Guardrail

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask


#: Default histogram buckets in seconds: 5 ms to 5 minutes (task runs and queue waits alike).
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"must be a TCP port from 1 to 65535, got {value!r:.80}")
    return value


def _buckets(value: Any) -> tuple[float, ...]:
    items = tuple(value) if isinstance(value, list | tuple) else ()
    if not items or any(
        isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < float("inf") for v in items
    ):
        raise ValueError(f"must be a list of positive finite numbers of seconds, got {value!r:.80}")
    if any(a >= b for a, b in itertools.pairwise(items)):
        raise ValueError(f"must be increasing, got {value!r:.80}")
    return tuple(float(v) for v in items)


def _token(value: Any) -> str:
    if not isinstance(value, str) or len(value) < 16 or value != value.strip():
        raise ValueError("must be a string of at least 16 characters, no spaces around it")  # never echo a secret
    return value


#: The options the metrics read, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="metrics",
        default=False,
        doc="Record Prometheus metrics (task durations, outcomes, queue wait, published and completed "
        "messages; see celery_guardrails.operations.metrics) in workers and publishers."
        " Needs prometheus-client (the "
        "prometheus extra). False: nothing is recorded. A recording failure is logged, never the task's.",
        check=checks.boolean,
        scopes=frozenset({APP}),
    ),
    Option(
        name="metrics_port",
        default=None,
        doc="TCP port of the worker's HTTP metrics endpoint (all addresses), served by the main process only "
        "with every pool child's metrics summed when PROMETHEUS_MULTIPROC_DIR is set. None: no endpoint.",
        check=checks.optional(_port),
        scopes=frozenset({APP}),
    ),
    Option(
        name="metrics_buckets",
        default=DEFAULT_BUCKETS,
        doc="Upper bounds in seconds of the duration and queue-wait histogram buckets, increasing (+Inf is "
        "added). Read once per process, when the first metric is recorded.",
        check=_buckets,
        scopes=frozenset({APP}),
    ),
    Option(
        name="metrics_token",
        default=None,
        doc="Django: a bearer token that may read the metrics view (Authorization: Bearer <token>) besides "
        "staff users; None: staff only.",
        check=checks.optional(_token),
        scopes=frozenset({APP}),
    ),
)


def _due_at(request: Any) -> float:
    """When the message became due (its ETA, epoch seconds), 0.0 when it has none."""
    eta = getattr(request, "eta", None)
    if not eta:
        return 0.0
    if isinstance(eta, datetime):
        return eta.timestamp()
    return datetime.fromisoformat(str(eta)).timestamp()


class Metrics(Guardrail):
    """Records the queue wait as a delivery starts; its duration, completion and (unless a signal already
    told a more telling one) its outcome as it ends. First in the pipeline: its ``before_run`` runs before any
    guardrail can refuse the delivery, and its after-hooks last, so the duration covers every guardrail."""

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = task.request
        if request.called_directly or request.is_eager or not enabled(task.app):
            return  # a call in the caller's process (task(), apply()) waited in no queue
        try:
            made = instruments(task.app)
            labels = label_values(task.app, task.name, queue_of(request))
            published = headers.published_at(view(task).header)
            if published is None:
                made.queue_wait_unknown.labels(*labels).inc()
            else:
                made.queue_wait.labels(*labels).observe(max(0.0, time.time() - max(published, _due_at(request))))
        except Exception as error:
            recording_failed(error, "queue wait", request.id)

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        self._ended(task, SUCCEEDED if delivery(task).body_ran else SKIPPED, "")

    def on_failure(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        self._ended(task, FAILED, "")

    def on_retry(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        # A guardrail's re-publish with a signal of its own was counted by it; what is left is the body's own
        # self.retry() (no guardrail was re-publishing) or a re-publish without a signal.
        self._ended(task, RETRIED, "guardrail" if delivery(task).republishing else "manual")

    def _ended(self, task: GuardedTask, outcome: str, detail: str) -> None:
        request = task.request
        if request.id is None:
            # No delivery runs (Celery calls on_failure in the main process for a child its hard time limit
            # killed): the dead letter's signal counted it (see _on_dead_lettered); nothing to time here.
            return
        metrics_on, activity_on, told = enabled(task.app), activity_counts(task), ending_told(task)
        if not (metrics_on or activity_on or told):
            return
        try:
            state = delivery(task)
            first = not state.outcome_counted
            state.outcome_counted = True
            queue = queue_of(request)
            if told and first:
                tell_ended(task, request.id, task.name, queue, outcome, detail)
            if not (metrics_on or (activity_on and first)):
                return
            # Redacted once per delivery (a routing key and a detail are free text; the outcome is ours)
            name_label, queue_label, detail_label = label_values(task.app, task.name, queue, detail)
            if metrics_on:
                made = instruments(task.app)
                made.duration.labels(name_label, queue_label).observe(
                    max(0.0, time.perf_counter() - state.monotonic_started)
                )
                made.completed.labels(name_label, queue_label).inc()
                if first:
                    made.outcomes.labels(name_label, outcome, detail_label).inc()
            if activity_on and first:
                activity.count(task.app, name_label, queue_label, outcome)
        except Exception as error:
            recording_failed(error, "the end of a delivery", request.id)


# The names other modules and tests read from here (their code is in the modules named in the docstring).
__all__ = [
    "DEAD_LETTERED",
    "DEFERRED_BUDGET",
    "DEFERRED_CIRCUIT",
    "DUPLICATE_SKIPPED",
    "FAILED",
    "FAMILIES",
    "JOBS",
    "JOB_TIME_TO_TERMINAL",
    "MESSAGES_COMPLETED",
    "MESSAGES_PUBLISHED",
    "MULTIPROC_DIR",
    "OUTCOMES",
    "PREFIX",
    "QUEUE_WAIT",
    "QUEUE_WAIT_UNKNOWN",
    "REGISTRY",
    "RETRIED",
    "RETRY_LATER",
    "SKIPPED",
    "SUCCEEDED",
    "TASK_DURATION",
    "TASK_OUTCOMES",
    "Instruments",
    "Metrics",
    "MetricsEndpoint",
    "_on_published",
    "available",
    "enabled",
    "exposition",
    "instruments",
    "job_finished",
    "label_values",
    "metrics_registry",
    "queue_of",
    "register_collector",
]
