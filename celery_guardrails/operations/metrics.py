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
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery import bootsteps
from celery.signals import after_task_publish, worker_process_shutdown

from celery_guardrails import signals
from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.foundation.redaction import Redactor, for_app
from celery_guardrails.operations import activity
from celery_guardrails.options import APP, Option, app_value, checks, declare
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import delivery
from celery_guardrails.runtime.outcomes import TIME_LIMIT
from celery_guardrails.runtime.pipeline import Guardrail

try:
    import prometheus_client
    from prometheus_client import CollectorRegistry, Counter, Histogram
except ImportError:  # the prometheus extra is not installed: metrics cannot be switched on
    prometheus_client = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)

PREFIX = "celery_guardrails_"
TASK_DURATION = f"{PREFIX}task_duration_seconds"
TASK_OUTCOMES = f"{PREFIX}task_outcomes_total"
QUEUE_WAIT = f"{PREFIX}task_queue_wait_seconds"
QUEUE_WAIT_UNKNOWN = f"{PREFIX}task_queue_wait_unknown_total"
MESSAGES_PUBLISHED = f"{PREFIX}messages_published_total"
MESSAGES_COMPLETED = f"{PREFIX}messages_completed_total"

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
}

#: The environment variable that switches prometheus_client to multiprocess mode (read as it is imported).
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Instruments:
    """The metric objects of this process (made once, by :func:`instruments`)."""

    duration: Any
    outcomes: Any
    queue_wait: Any
    queue_wait_unknown: Any
    published: Any
    completed: Any


#: This process's metrics, apart from prometheus_client's global REGISTRY (a project's own metrics stay
#: there); :func:`metrics_registry` exposes them. None without prometheus-client.
REGISTRY: Any = CollectorRegistry(auto_describe=True) if prometheus_client is not None else None

_instruments: Instruments | None = None
_made = threading.Lock()
#: Collector factories :func:`metrics_registry` adds to every registry it builds (state read from stores).
_collectors: list[Callable[[], Any]] = []
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
        _failed(error, "settings", None)
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
            )
        return _instruments


def _failed(error: BaseException, kind: str, task_id: str | None) -> None:
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
            published = headers.published_at(headers.from_request(request))
            if published is None:
                made.queue_wait_unknown.labels(*labels).inc()
            else:
                made.queue_wait.labels(*labels).observe(max(0.0, time.time() - max(published, _due_at(request))))
        except Exception as error:
            _failed(error, "queue wait", request.id)

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
        metrics_on, activity_on, told = enabled(task.app), _activity_on(task), _told(task)
        if not (metrics_on or activity_on or told):
            return
        try:
            state = delivery(task)
            first = not state.outcome_counted
            state.outcome_counted = True
            queue = queue_of(request)
            if told and first:
                _tell(task, request.id, task.name, queue, outcome, detail)
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
            _failed(error, "the end of a delivery", request.id)


def _activity_on(task: Any) -> bool:
    """Whether the activity counts ``task``'s deliveries: a worker's, not a call in the caller's process."""
    request = getattr(task, "request", None)
    if request is None or request.called_directly or request.is_eager:
        return False
    return activity.enabled(task.app)


def _count(
    task: Any, task_id: str | None, outcome: str, detail: str = "", *, name: str | None = None, queue: str = ""
) -> None:
    """Count ``outcome`` for the delivery ``task_id`` of ``task`` and mark it counted (when it is the delivery
    ``task`` runs now: a signal sent outside a run, for a message the consumer refused, marks nothing)."""
    app = getattr(task, "app", None)
    if app is None:
        return
    metrics_on, activity_on, told = enabled(app), activity.enabled(app), _told(task, task_id)
    if not (metrics_on or activity_on or told):
        return
    try:
        current = _mark(task, task_id)
        if told:
            _tell(task, task_id, name or task.name, queue_of(task.request) if current else queue, outcome, detail)
        where = queue_of(task.request) if current else queue
        name_label, queue_label, detail_label = label_values(app, name or task.name, where, detail)
        if metrics_on:
            instruments(app).outcomes.labels(name_label, outcome, detail_label).inc()
        if activity_on and (not current or _activity_on(task)):
            activity.count(app, name_label, queue_label, outcome)
    except Exception as error:
        _failed(error, f"outcome {outcome}", task_id)


def _told(task: Any, task_id: str | None = None) -> bool:
    """Whether ``delivery_ended`` has receivers for the delivery ``task_id`` of ``task`` (default: the one it
    runs now) on a worker: not a call in the caller's process, which no queue delivered. A message told of
    outside its run (refused by the consumer) is told."""
    if not signals.delivery_ended.receivers:
        return False
    request = getattr(task, "request", None)
    if request is None or (task_id is not None and getattr(request, "id", None) != task_id):
        return True
    return not (request.called_directly or request.is_eager)


def _tell(task: Any, task_id: str | None, name: str, queue: str, outcome: str, detail: str) -> None:
    signals.delivery_ended.send(
        sender=task, task_id=task_id, task_name=name, queue=queue, outcome=outcome, detail=detail
    )


def _mark(task: Any, task_id: str | None) -> bool:
    """Mark the delivery ``task_id`` counted when ``task`` runs it now; whether it does."""
    request = getattr(task, "request", None)
    if task_id and getattr(request, "id", None) == task_id:
        delivery(task).outcome_counted = True
        return True
    return False


def _on_retry_scheduled(sender: Any = None, task_id: str | None = None, kind: str = "", **_: Any) -> None:
    if kind == "transient":
        _count(sender, task_id, RETRIED, "transient")
    else:
        _count(sender, task_id, RETRY_LATER)


def _on_retry_deferred(sender: Any = None, task_id: str | None = None, reason: str = "", **_: Any) -> None:
    _count(sender, task_id, DEFERRED_CIRCUIT if reason == "circuit" else DEFERRED_BUDGET)


def _on_store_unavailable(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    _count(sender, task_id, RETRIED, "store_unavailable")


def _on_duplicate_skipped(sender: Any = None, task_id: str | None = None, state: str = "", **_: Any) -> None:
    _count(sender, task_id, DUPLICATE_SKIPPED, str(state))


def _on_stale_skipped(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    _count(sender, task_id, SKIPPED)


def _on_dead_lettered(sender: Any = None, failure: Any = None, **_: Any) -> None:
    _count(sender, failure.task_id, DEAD_LETTERED, failure.reason, name=failure.task_name, queue=failure.queue or "")
    if failure.reason == TIME_LIMIT:
        _killed(sender, failure)


def _killed(task: Any, failure: Any) -> None:
    """A delivery its hard time limit killed ended in the main process, where no after-hook of the delivery
    runs: it is counted completed here (its duration, the time limit, is not observed)."""
    app = getattr(task, "app", None)
    if app is None or not enabled(app):
        return
    try:
        instruments(app).completed.labels(*label_values(app, failure.task_name, failure.queue or "")).inc()
    except Exception as error:
        _failed(error, "a killed delivery", failure.task_id)


def _on_final_failure(sender: Any = None, failure: Any = None, **_: Any) -> None:
    # Sent for every final failure whose dead letter is recorded; ``dead_lettered`` counts the new ones. One
    # recorded before (a redelivery after the record, before the ack) is not counted again, nor as failed.
    app = getattr(sender, "app", None)
    if app is not None and (enabled(app) or activity.enabled(app) or _told(sender, failure.task_id)):
        try:
            _mark(sender, failure.task_id)
        except Exception as error:
            _failed(error, "a final failure", getattr(failure, "task_id", None))


def _on_published(sender: Any = None, routing_key: str | None = None, headers: Any = None, **_: Any) -> None:
    from celery._state import get_current_app

    app = get_current_app()
    if not enabled(app):
        return
    try:
        name = sender if isinstance(sender, str) else getattr(sender, "name", str(sender))
        instruments(app).published.labels(*label_values(app, name, routing_key or "")).inc()
    except Exception as error:
        _failed(error, "a publish", (headers or {}).get("id") if isinstance(headers, dict) else None)


def _on_child_exit(pid: int | None = None, **_: Any) -> None:
    """A prefork child exits: its live gauges are dropped (prometheus_client's ``mark_process_dead``);
    its counters and histograms stay in the directory and keep counting in the sums."""
    if prometheus_client is None or not os.environ.get(MULTIPROC_DIR):
        return
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid or os.getpid())  # type: ignore[no-untyped-call]
    except Exception as error:
        _failed(error, "a child's exit", None)


signals.retry_scheduled.connect(
    _on_retry_scheduled, weak=False, dispatch_uid="celery_guardrails.operations.metrics.retry"
)
signals.retry_deferred.connect(
    _on_retry_deferred, weak=False, dispatch_uid="celery_guardrails.operations.metrics.deferred"
)
signals.store_unavailable.connect(
    _on_store_unavailable, weak=False, dispatch_uid="celery_guardrails.operations.metrics.store"
)
signals.duplicate_skipped.connect(
    _on_duplicate_skipped, weak=False, dispatch_uid="celery_guardrails.operations.metrics.dup"
)
signals.stale_skipped.connect(_on_stale_skipped, weak=False, dispatch_uid="celery_guardrails.operations.metrics.stale")
signals.dead_lettered.connect(_on_dead_lettered, weak=False, dispatch_uid="celery_guardrails.operations.metrics.dead")
signals.final_failure.connect(_on_final_failure, weak=False, dispatch_uid="celery_guardrails.operations.metrics.final")
after_task_publish.connect(_on_published, weak=False, dispatch_uid="celery_guardrails.operations.metrics.published")
worker_process_shutdown.connect(
    _on_child_exit, weak=False, dispatch_uid="celery_guardrails.operations.metrics.child_exit"
)


# Exposition


class _Declared:
    """Another collector's families, then each of :data:`FAMILIES` it did not yield, empty (HELP and TYPE lines,
    no sample): before the first task, and in multiprocess mode before a child recorded, the endpoint still
    names every family."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import Metric

        seen = set()
        for family in self.inner.collect():
            seen.add(family.name)
            yield family
        for name, (kind, doc) in FAMILIES.items():
            # prometheus_client names a counter's family without its "_total" (it adds it to the samples)
            family_name = name.removesuffix("_total") if kind == "counter" else name
            if family_name not in seen:
                yield Metric(family_name, doc, kind)


class _ThisProcess:
    """This process's metrics as a collector of another registry."""

    def collect(self) -> Iterable[Any]:
        return REGISTRY.collect()  # type: ignore[no-any-return]


def register_collector(factory: Callable[[], Any]) -> None:
    """Add a collector, made by ``factory``, to every registry :func:`metrics_registry` builds (state read
    from the stores at scrape time, say)."""
    _collectors.append(factory)


class _SizedFiles:
    """prometheus_client's multiprocess collector, without the files a process has created and not yet sized.

    A prefork child's metric file is opened (empty) and then grown to its first size (``MmapedDict.__init__``);
    a scrape between the two read zero bytes and failed whole (``struct.error``, a 500 for every metric), seen
    with ``--max-tasks-per-child=1``, where children start all the time. Such a file holds nothing yet.
    """

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):  # as prometheus_client's own: the scrape fails (503), never an empty 200
            raise ValueError(f"{MULTIPROC_DIR}={path!r} is not a directory")
        self.path = path

    def collect(self) -> Any:
        import glob

        from prometheus_client.multiprocess import MultiProcessCollector

        files = []
        for name in glob.glob(os.path.join(self.path, "*.db")):
            try:
                if os.path.getsize(name) >= 8:  # the 8-byte header that says how much of the file is used
                    files.append(name)
            except OSError:  # removed since (mark_process_dead of a live gauge's file)
                continue
        return MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]


def metrics_registry() -> Any:
    """A registry to expose: every process's metrics summed from ``PROMETHEUS_MULTIPROC_DIR`` when it is set
    (prefork children, a multi-process web server), else this process's own; plus :func:`register_collector`'s.
    Built anew for each call, as prometheus_client's multiprocess docs ask (never the registry the metrics
    were created in)."""
    if prometheus_client is None:
        raise ConfigurationError("metrics", "needs prometheus-client: pip install 'celery-guardrails[prometheus]'")
    registry = CollectorRegistry(auto_describe=False)
    if os.environ.get(MULTIPROC_DIR):
        registry.register(_Declared(_SizedFiles(os.environ[MULTIPROC_DIR])))
    else:
        registry.register(_Declared(_ThisProcess()))
    for factory in _collectors:
        registry.register(factory())
    return registry


def exposition(registry: Any = None) -> tuple[bytes, str]:
    """The text exposition of ``registry`` (default :func:`metrics_registry`) and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry if registry is not None else metrics_registry()), CONTENT_TYPE_LATEST


class MetricsEndpoint(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: the HTTP metrics endpoint on ``metrics_port``, in the main process only (a worker
    bootstep never runs in a pool child). Not being able to serve is logged, never a reason to stop the worker:
    its tasks matter more than their metrics."""

    label = "Guardrails metrics"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        self.server: Any = None
        app = parent.app
        if app_value(app, "metrics") and prometheus_client is None:
            raise ConfigurationError("metrics", "needs prometheus-client: pip install 'celery-guardrails[prometheus]'")
        super().__init__(parent, **kwargs)

    def start(self, parent: Any) -> None:
        app = parent.app
        port = app_value(app, "metrics_port")
        if port is None:
            return
        if not app_value(app, "metrics"):
            logger.warning("celery-guardrails: metrics_port %s is set but metrics is off: no endpoint", port)
            return
        pool = str(getattr(parent, "pool_cls", "") or "").lower()
        if "prefork" in pool and not os.environ.get(MULTIPROC_DIR):
            logger.warning(
                "celery-guardrails: prefork pool without %s: the endpoint on port %s cannot see what the pool "
                "children record (it serves the main process's metrics only). Start the worker with, for example: "
                "rm -rf /tmp/celery-metrics && mkdir /tmp/celery-metrics && "
                "%s=/tmp/celery-metrics celery -A proj worker ...  (an empty directory at each start of the whole "
                "worker: files left from an earlier run would be summed in; one directory per worker), or run "
                "--pool threads",
                MULTIPROC_DIR,
                port,
                MULTIPROC_DIR,
            )
        try:
            self.server, _ = prometheus_client.start_http_server(port, registry=metrics_registry())
        except Exception:
            logger.exception("celery-guardrails: metrics endpoint not started on port %s", port)
            return
        logger.info("celery-guardrails: metrics on port %s", port)

    def stop(self, parent: Any) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()
