"""The Prometheus families the guardrails record, and this process's metric objects.

Their names, types and help (:data:`FAMILIES`, documented in :mod:`.metrics`), the delivery outcomes they count,
the objects made once per process in a registry of their own (:func:`instruments`; never prometheus_client's
global one, where a project's own metrics live), whether recording is on (:func:`enabled`), label values
redacted as a log line is (:func:`label_values`), and a recording failure logged once per kind, never raised
(:func:`recording_failed`).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

from celery_guardrails.foundation.redaction import Redactor, for_app
from celery_guardrails.options import app_value

try:
    import prometheus_client
    from prometheus_client import CollectorRegistry, Counter, Histogram
except ImportError:  # the prometheus extra is not installed: metrics cannot be switched on
    prometheus_client = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

PREFIX = "celery_guardrails_"
TASK_DURATION = f"{PREFIX}task_duration_seconds"
TASK_OUTCOMES = f"{PREFIX}task_outcomes_total"
QUEUE_WAIT = f"{PREFIX}task_queue_wait_seconds"
QUEUE_WAIT_UNKNOWN = f"{PREFIX}task_queue_wait_unknown_total"
MESSAGES_PUBLISHED = f"{PREFIX}messages_published_total"
MESSAGES_COMPLETED = f"{PREFIX}messages_completed_total"
JOB_TIME_TO_TERMINAL = f"{PREFIX}job_time_to_terminal_seconds"
#: The gauge of jobs by task and state, read from the job book at scrape time (:mod:`.collectors`).
JOBS = f"{PREFIX}jobs"

#: Buckets of the time from a job's submit to its final state, in seconds (1 s to a day): a job a user polls
#: takes seconds to hours, longer than one delivery (``metrics_buckets``), and waits and retries count in it.
JOB_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)

SUCCEEDED = "succeeded"
SKIPPED = "skipped"
RETRIED = "retried"
RETRY_LATER = "retry_later"
DEFERRED_BUDGET = "deferred_budget"
DEFERRED_CIRCUIT = "deferred_circuit"
DEAD_LETTERED = "dead_lettered"
DUPLICATE_SKIPPED = "duplicate_skipped"
FAILED = "failed"
OUTCOMES = (
    SUCCEEDED,
    SKIPPED,
    RETRIED,
    RETRY_LATER,
    DEFERRED_BUDGET,
    DEFERRED_CIRCUIT,
    DEAD_LETTERED,
    DUPLICATE_SKIPPED,
    FAILED,
)

#: Every family this module records, with its type and help: exposed (HELP and TYPE, no sample) from the first
#: scrape, before any task ran, so dashboards and alert rules find them (and a typo in a query shows as one).
FAMILIES: dict[str, tuple[str, str]] = {
    TASK_DURATION: (
        "histogram",
        "Time a guarded delivery took on the worker, guardrails included, whatever its outcome.",
    ),
    TASK_OUTCOMES: ("counter", "How guarded deliveries ended (outcome), with the classification or reason (detail)."),
    QUEUE_WAIT: ("histogram", "Time from publish (or from the ETA, when later) to the start of a delivery."),
    QUEUE_WAIT_UNKNOWN: (
        "counter",
        "Deliveries whose publish time is unknown (no pub header field): their wait is not observed.",
    ),
    MESSAGES_PUBLISHED: ("counter", "Task messages published by this process."),
    MESSAGES_COMPLETED: ("counter", "Guarded deliveries that ended: success, final failure, or a retry published."),
    JOB_TIME_TO_TERMINAL: (
        "histogram",
        "Time from a job's submit to its final state (succeeded, failed, dead_lettered, cancelled), by task and state.",
    ),
}

#: The environment variable that switches prometheus_client to multiprocess mode (read as it is imported).
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True, slots=True, kw_only=True)
class Instruments:
    """The metric objects of this process (made once, by :func:`instruments`)."""

    duration: Any
    outcomes: Any
    queue_wait: Any
    queue_wait_unknown: Any
    published: Any
    completed: Any
    job_time_to_terminal: Any


#: This process's metrics, apart from prometheus_client's global REGISTRY (a project's own metrics stay
#: there); :func:`metrics_registry` exposes them. None without prometheus-client.
REGISTRY: Any = CollectorRegistry(auto_describe=True) if prometheus_client is not None else None

_instruments: Instruments | None = None
_made = threading.Lock()
#: The kinds of recording failure already logged at ERROR (each is logged once, then at DEBUG).
_logged: set[str] = set()


def available() -> bool:
    """Whether prometheus-client can be imported."""
    return prometheus_client is not None


def enabled(app: Any) -> bool:
    """The ``metrics`` option of ``app`` (False when it cannot be read: never an error in a hook)."""
    try:
        return bool(app_value(app, "metrics")) and prometheus_client is not None
    except Exception as error:
        recording_failed(error, "settings", None)
        return False


def instruments(app: Any) -> Instruments:
    """The metric objects, made on first use with ``app``'s ``metrics_buckets`` (once per process: a
    histogram's buckets cannot change once it is registered)."""
    global _instruments
    made = _instruments
    if made is not None:
        return made
    with _made:
        if _instruments is None:
            buckets = app_value(app, "metrics_buckets")
            task_queue = ("task", "queue")
            _instruments = Instruments(
                duration=Histogram(
                    TASK_DURATION,
                    FAMILIES[TASK_DURATION][1],
                    task_queue,
                    buckets=buckets,
                    registry=REGISTRY,
                ),
                outcomes=Counter(
                    TASK_OUTCOMES,
                    FAMILIES[TASK_OUTCOMES][1],
                    ("task", "outcome", "detail"),
                    registry=REGISTRY,
                ),
                queue_wait=Histogram(
                    QUEUE_WAIT,
                    FAMILIES[QUEUE_WAIT][1],
                    task_queue,
                    buckets=buckets,
                    registry=REGISTRY,
                ),
                queue_wait_unknown=Counter(
                    QUEUE_WAIT_UNKNOWN,
                    FAMILIES[QUEUE_WAIT_UNKNOWN][1],
                    task_queue,
                    registry=REGISTRY,
                ),
                published=Counter(MESSAGES_PUBLISHED, FAMILIES[MESSAGES_PUBLISHED][1], task_queue, registry=REGISTRY),
                completed=Counter(
                    MESSAGES_COMPLETED,
                    FAMILIES[MESSAGES_COMPLETED][1],
                    task_queue,
                    registry=REGISTRY,
                ),
                job_time_to_terminal=Histogram(
                    JOB_TIME_TO_TERMINAL,
                    FAMILIES[JOB_TIME_TO_TERMINAL][1],
                    ("task", "state"),
                    buckets=JOB_BUCKETS,
                    registry=REGISTRY,
                ),
            )
        return _instruments


def job_finished(app: Any, *, task: str, state: str, seconds: float, job_id: str = "") -> None:
    """A job reached its final ``state`` ``seconds`` after it was submitted: observed in the time-to-terminal
    histogram when ``metrics`` is on (the job book calls this once the state is committed). Never raises."""
    if not enabled(app):
        return
    try:
        instruments(app).job_time_to_terminal.labels(*label_values(app, task, state)).observe(max(0.0, seconds))
    except Exception as error:
        recording_failed(error, "a job's end", job_id or None)


def recording_failed(error: BaseException, kind: str, task_id: str | None) -> None:
    """A recording failed: log it (with the traceback the first time of its kind), never raise."""
    if kind in _logged:
        logger.debug("Metrics: recording %s failed (task %s)", kind, task_id, exc_info=error)
        return
    _logged.add(kind)
    logger.error(
        "Metrics: recording %s failed (task %s); the task goes on, further failures at DEBUG",
        kind,
        task_id,
        exc_info=error,
    )


def label_values(app: Any, *values: Any) -> tuple[str, ...]:
    """``values`` as label values: text, redacted by the app's settings (module docstring)."""
    redactor = for_app(app)
    return tuple(_label(redactor, str(value)) for value in values)


@functools.lru_cache(maxsize=4096)
def _label(redactor: Redactor, value: str) -> str:
    # Cached: a label value is one of few (task names, queues, reasons) and is redacted on every delivery.
    return redactor.text(value)


def queue_of(request: Any) -> str:
    """The queue label of a delivery: its routing key (the queue's name on the default exchange)."""
    info = getattr(request, "delivery_info", None) or {}
    return str(info.get("routing_key") or "")
