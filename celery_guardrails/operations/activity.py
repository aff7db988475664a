"""The last day of activity, kept in the store: what the admin dashboard charts and the status rates read.

Two series, per minute (the minute's start, epoch seconds, on the app's clock), kept ``activity_retention``
seconds (option ``activity``, default on):

* **Outcomes**: how many deliveries of each (task, queue) ended with each outcome, the outcomes of
  :mod:`celery_guardrails.operations.metrics` (succeeded, retried, dead_lettered, ...), whether or not the Prometheus
  metrics are on. Each worker process counts in memory (a dict increment per delivery) and a
  :class:`Recorder` thread adds the counts to the store every ``activity_flush_interval`` seconds, and once
  more as the process exits: one write per process per interval, whatever the number of tasks.
* **Queue samples**: each queue's depth and oldest message's age (:func:`celery_guardrails.broker.queues.read_queues`),
  read about once a minute by one worker of the cluster (:func:`sample_queues`, from the watchdog thread; a
  claim in the store with a lease of :data:`SAMPLE_LEASE` seconds lets one worker in).

The store keeps each batch of counts once: a batch carries an id, and one the store already added is not added
again, so a flush whose answer was lost is sent again, unchanged, at the next interval. A flush the store
refuses (down, cut) keeps its batch for the next one; batches older than the retention are dropped with a
warning. What a SIGKILLed process counted since its last flush is lost: these are statistics, not messages.
Nothing here raises into a task, and a worker never waits for the store to count.

Read back with :func:`read` (the store's minutes), :func:`hourly_outcomes` and :func:`hourly_queue_ages` (the
dashboard's charts) and :func:`rates` (the status command's in and out per minute).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from celery import bootsteps
from celery.signals import worker_process_shutdown, worker_shutdown

from celery_guardrails.foundation.clock import now
from celery_guardrails.foundation.forks import quiet
from celery_guardrails.options import APP, Option, app_value, checks, declare
from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import ACQUIRED, Activity, OutcomeCount, QueueSample

logger = logging.getLogger(__name__)

MINUTE = 60
HOUR = 3600
#: The claim that lets one worker sample the queues, and its lease (seconds): about one sample a minute.
SAMPLE_KEY = "guardrails:activity-sample"
SAMPLE_LEASE = 54.0


#: The options the activity record reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="activity",
        default=True,
        doc="Keep the last day of activity in the store: delivery outcomes per task, queue and minute (each "
        "worker process adds its counts every activity_flush_interval) and each queue's depth and oldest age "
        "once a minute (read by one worker's watchdog thread). The admin dashboard charts it and the status "
        "command's rates come from it. False: nothing is kept. See celery_guardrails.operations.activity.",
        check=checks.boolean,
        scopes=frozenset({APP}),
    ),
    Option(
        name="activity_flush_interval",
        default=30.0,
        doc="Seconds between two additions of a worker process's outcome counts to the store (and at its "
        "exit). A process SIGKILLed loses at most this long of its counts.",
        check=checks.seconds,
        scopes=frozenset({APP}),
    ),
    Option(
        name="activity_retention",
        default=2 * 24 * 3600.0,
        doc="Seconds the activity is kept (Redis: expiry; Django: guardrails_prune). The charts show 24 hours.",
        check=checks.seconds,
        scopes=frozenset({APP}),
    ),
)


def minute_of(moment: float) -> float:
    return float(int(moment // MINUTE) * MINUTE)


def enabled(app: Any) -> bool:
    """The ``activity`` option (False when it cannot be read: never an error in a task's hook)."""
    try:
        return bool(app_value(app, "activity"))
    except Exception:
        logger.debug("Activity: the activity option could not be read", exc_info=True)
        return False


@dataclass(slots=True)
class _Batch:
    id: str
    counts: Counter[tuple[float, str, str, str]]


class Recorder:
    """One process's outcome counts for one app, and the thread that adds them to the store.

    :meth:`count` is what a delivery's end calls (under a lock, a dict increment); :meth:`flush` sends what
    was counted as one batch (also called by the thread every ``activity_flush_interval`` and as the process
    exits). A batch the store did not take is kept, with its id, and sent first at the next flush.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._counts: Counter[tuple[float, str, str, str]] = Counter()
        self._unsent: list[_Batch] = []
        self._ids = itertools.count(1)
        self._prefix = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._failures = 0

    def count(self, task: str, queue: str, outcome: str, *, n: int = 1) -> None:
        key = (minute_of(now(self.app)), task, queue, outcome)
        with self._lock:
            self._counts[key] += n
            if self._thread is None:
                self._start()

    def _start(self) -> None:
        interval = float(app_value(self.app, "activity_flush_interval"))
        self._thread = threading.Thread(target=self._loop, args=(interval,), name="guardrails-activity", daemon=True)
        self._thread.start()

    def _loop(self, interval: float) -> None:
        while not self._stopping.wait(interval):
            try:
                with quiet():  # no pool child forked while a flush is inside the database driver
                    self.flush()
            except Exception:  # flush logs its own failures; this thread outlives anything else too
                logger.exception("Activity: a flush failed")

    def pending(self) -> int:
        """Deliveries counted and not yet in the store."""
        with self._lock:
            return sum(self._counts.values()) + sum(sum(batch.counts.values()) for batch in self._unsent)

    def flush(self) -> bool:
        """Send the unsent batches, then what was counted since, each batch once; True when all landed. Never
        raises: a failure is logged (at ERROR the first time in a row, then at DEBUG) and its batch kept."""
        with self._flushing:  # the thread and an exit flush never send one batch side by side
            with self._lock:
                if self._counts:
                    self._unsent.append(_Batch(id=f"{self._prefix}:{next(self._ids)}", counts=self._counts))
                    self._counts = Counter()
                batches = list(self._unsent)
            sent = 0
            try:
                store = get_store(self.app)
                retention = float(app_value(self.app, "activity_retention"))
                for batch in batches:
                    counts = [
                        OutcomeCount(minute=minute, task=task, queue=queue, outcome=outcome, count=n)
                        for (minute, task, queue, outcome), n in batch.counts.items()
                    ]
                    store.activity_add(counts, batch=batch.id, retention=retention)
                    sent += 1
            except Exception as error:
                self._failed(error, batches[sent:])
                return False
            finally:
                with self._lock:
                    del self._unsent[:sent]
                _close_thread(self.app)
            if self._failures:
                logger.info("Activity: %d batch(es) added after %d failed flush(es)", sent, self._failures)
                self._failures = 0
            return True

    def _failed(self, error: BaseException, left: list[_Batch]) -> None:
        self._failures += 1
        log = logger.error if self._failures == 1 else logger.debug
        log(
            "Activity: adding %d batch(es) of counts to the store failed (%s); kept for the next flush",
            len(left),
            error,
        )
        horizon = minute_of(now(self.app)) - float(app_value(self.app, "activity_retention"))
        with self._lock:
            for batch in self._unsent:
                old = [key for key in batch.counts if key[0] < horizon]
                for key in old:
                    del batch.counts[key]
                if old:
                    logger.warning("Activity: batch %s: %d count(s) past the retention dropped", batch.id, len(old))
            self._unsent[:] = [batch for batch in self._unsent if batch.counts]

    def stop(self) -> None:
        """Stop the thread and flush what is left (a process's exit)."""
        self._stopping.set()
        self.flush()


_recorders: dict[int, Recorder] = {}
_recorders_lock = threading.Lock()


def recorder(app: Any) -> Recorder:
    """This process's recorder of ``app`` (made on first use)."""
    made = _recorders.get(id(app))
    if made is not None and made.app is app:
        return made
    with _recorders_lock:
        made = _recorders.get(id(app))
        if made is None or made.app is not app:
            made = _recorders[id(app)] = Recorder(app)
        return made


def count(app: Any, task: str, queue: str, outcome: str) -> None:
    """Count one delivery's ``outcome`` (a no-op with ``activity`` off; never raises)."""
    if app is None or not enabled(app):
        return
    try:
        recorder(app).count(task, queue, outcome)
    except Exception:
        logger.debug("Activity: counting %s of %s failed", outcome, task, exc_info=True)


def flush_all() -> None:
    """Flush every recorder of this process (its exit)."""
    for made in list(_recorders.values()):
        made.stop()


def _forked() -> None:
    # A prefork child starts with a copy of its parent's counts and no thread: the counts are the parent's to
    # send, so the child starts empty.
    _recorders.clear()


def _close_thread(app: Any) -> None:
    try:
        close = getattr(get_store(app), "close_thread", None)
        if close is not None:
            close()  # the Django store: no connection held open by the recorder's thread between flushes
    except Exception:
        logger.debug("Activity: closing the store's connection of this thread failed", exc_info=True)


def _on_exit(**_: Any) -> None:
    try:
        flush_all()
    except Exception:
        logger.exception("Activity: the exit flush failed")


class ActivityStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: as the worker stops, its app's recorder in this process adds what it counted and its
    thread ends (a worker embedded in a test process stops without ``worker_shutdown``; its thread would
    otherwise outlive it)."""

    label = "Guardrails activity"

    def stop(self, parent: Any) -> None:
        app = parent.app
        with _recorders_lock:
            made = _recorders.get(id(app))
            if made is not None and made.app is app:
                del _recorders[id(app)]
            else:
                made = None
        if made is not None:
            made.stop()

    terminate = stop


os.register_at_fork(after_in_child=_forked)
worker_process_shutdown.connect(_on_exit, weak=False, dispatch_uid="celery_guardrails.operations.activity.child_exit")
worker_shutdown.connect(_on_exit, weak=False, dispatch_uid="celery_guardrails.operations.activity.exit")


# Queue samples


def sample_key(app: Any, names: list[str]) -> str:
    """The sampling claim of one set of queues (two apps with other queues on one store each sample theirs)."""
    return f"{SAMPLE_KEY}:{hashlib.sha256(chr(10).join(sorted(names)).encode()).hexdigest()[:16]}"


def sample_queues(app: Any, *, owner: str, names: list[str] | None = None) -> list[QueueSample] | None:
    """Read the app's queues (and ``names``) and keep the sample for this minute, unless another worker did
    within :data:`SAMPLE_LEASE` seconds (None then). Raises what the broker or the store raises."""
    from celery_guardrails.broker.queues import declared_queues, read_queues

    queues = declared_queues(app, names or ())
    store = get_store(app)
    claim = store.claim(
        sample_key(app, queues), owner=owner, now=time.time(), lease=SAMPLE_LEASE, retention=SAMPLE_LEASE
    )
    if claim.state != ACQUIRED:
        return None
    minute = minute_of(now(app))
    samples = [
        QueueSample(minute=minute, queue=q.queue, depth=q.depth, oldest_age=q.oldest_age)
        for q in read_queues(app, queues)
    ]
    store.activity_sample(samples, retention=float(app_value(app, "activity_retention")))
    return samples


# Reading back


def read(app: Any, *, since: float, until: float) -> Activity:
    return get_store(app).activity_read(since=since, until=until)


def hour_starts(current: float, hours: int) -> list[float]:
    """The starts of the last ``hours`` hours, oldest first, the last one the hour ``current`` falls in."""
    last = int(current // HOUR) * HOUR
    return [float(last - HOUR * (hours - 1 - k)) for k in range(hours)]


def hourly_outcomes(activity: Activity, starts: list[float]) -> dict[str, list[Counter[str]]]:
    """Per task, per hour of ``starts``: deliveries per outcome (queues added together)."""
    found: dict[str, list[Counter[str]]] = {}
    first = starts[0] if starts else 0.0
    for item in activity.outcomes:
        index = int((item.minute - first) // HOUR)
        if 0 <= index < len(starts):
            found.setdefault(item.task, [Counter() for _ in starts])[index][item.outcome] += item.count
    return found


def hourly_queue_ages(activity: Activity, starts: list[float]) -> dict[str, list[float | None]]:
    """Per queue, per hour of ``starts``: the largest oldest-message age sampled (None: no known age)."""
    found: dict[str, list[float | None]] = {}
    first = starts[0] if starts else 0.0
    for sample in activity.queues:
        index = int((sample.minute - first) // HOUR)
        if not 0 <= index < len(starts):
            continue
        hours = found.setdefault(sample.queue, [None] * len(starts))
        if sample.oldest_age is not None:
            known = hours[index]
            hours[index] = sample.oldest_age if known is None else max(known, sample.oldest_age)
    return found


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueRate:
    """One queue over a window of whole minutes: deliveries that ended (out) and messages that arrived (in),
    per minute. ``arrived`` is ``completed`` plus the depth's change between the window's first and last
    samples (None with fewer than two samples): a broker does not count arrivals, so they are derived."""

    queue: str
    completed: float
    arrived: float | None
    minutes: int


def rates(app: Any, *, current: float | None = None, minutes: int = 5) -> dict[str, QueueRate]:
    """Per queue, over the last ``minutes`` whole minutes before the current one (which the workers have not
    finished counting): see :class:`QueueRate`."""
    current = now(app) if current is None else current
    until = minute_of(current)
    since = until - minutes * MINUTE
    activity = read(app, since=since, until=until + MINUTE)  # this minute's sample, if taken, ends the window
    done: Counter[str] = Counter()
    for item in activity.outcomes:
        if item.minute < until:
            done[item.queue] += item.count
    samples: dict[str, list[QueueSample]] = {}
    for sample in activity.queues:
        samples.setdefault(sample.queue, []).append(sample)
    found = {}
    for queue in sorted(set(done) | set(samples)):
        if not queue:
            continue
        completed = done[queue] / minutes
        taken = samples.get(queue, [])
        arrived = None
        if len(taken) >= 2 and taken[-1].minute > taken[0].minute:
            change = (taken[-1].depth - taken[0].depth) / ((taken[-1].minute - taken[0].minute) / MINUTE)
            arrived = max(0.0, completed + change)
        found[queue] = QueueRate(queue=queue, completed=completed, arrived=arrived, minutes=minutes)
    return found
