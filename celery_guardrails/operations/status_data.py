"""The shape of a status read: one frozen dataclass per source (queues are
:class:`~celery_guardrails.broker.queues.QueueDepth`, rates :class:`~celery_guardrails.operations.activity.QueueRate`),
the :class:`Status` that holds them all with the sources it could not read, the sources' names, and the limits a
read keeps to (how many stream entries, ledger records, waiting messages and ordering keys it reads or lists).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from celery_guardrails.broker.queues import QueueDepth
from celery_guardrails.operations.activity import QueueRate

#: Entries of the Redis dead-letter stream read at most per status read (the newest).
STREAM_SCAN = 10_000
#: Seconds of ledger records the missed and overdue counts look at (7 days, as the admin's schedule health).
WINDOW = 7 * 24 * 3600.0
#: Ledger records read per schedule at most (newest first) for the counts in the window.
LEDGER_SCAN = 2000

#: Whole minutes the rates in and out are averaged over.
RATE_MINUTES = 5

QUEUES, DEAD_LETTERS, DEPENDENCIES, SCHEDULES = "queues", "dead_letters", "dependencies", "schedules"
RATES, OUTBOX = "rates", "outbox"
ORDERING = "ordering"
WAITING = "waiting"
#: The sources, in the order they are read and shown.
SOURCES = (QUEUES, RATES, WAITING, DEAD_LETTERS, DEPENDENCIES, SCHEDULES, OUTBOX, ORDERING)
#: Waiting messages listed at most (the soonest due); the counts cover them all.
WAITING_SHOWN = 20
#: Waiting ordering keys listed at most (the oldest waits); the count covers them all.
ORDERING_SHOWN = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetterCount:
    """Open dead letters of one (owner, task); ``owner`` "" when the task names none."""

    owner: str
    task: str
    open: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetters:
    counts: list[DeadLetterCount]
    #: The Redis stream holds more entries than were read (the counts are of the newest STREAM_SCAN).
    truncated: bool = False

    def by_owner(self) -> dict[str, int]:
        totals: Counter[str] = Counter()
        for count in self.counts:
            totals[count.owner] += count.open
        return dict(sorted(totals.items()))


@dataclass(frozen=True, slots=True, kw_only=True)
class DependencyStatus:
    """Retry budget use and circuit state of one dependency (see :func:`celery_guardrails.budget_status`)."""

    dependency: str
    retries: float
    retries_allowed: float
    exhausted: bool
    circuit: str
    consecutive_failures: int
    window_seconds: float = 0.0  # the budget's window (retry_budget_window)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleStatus:
    """One guarded schedule's ledger, over the last WINDOW seconds. Times are epoch seconds."""

    schedule: str
    missed: int
    overdue: int
    #: Period of the newest ``ok`` record; None when none is kept.
    last_success: float | None
    #: Seconds since ``last_success`` (None with it).
    last_success_age: float | None
    #: Status of the newest record; None when the schedule has none.
    last_status: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxBacklog:
    """The transactional outbox (Django): messages waiting for the relay, and the age of the oldest (seconds;
    None when none waits): the relay's lag."""

    waiting: int
    oldest_age: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderingWait:
    """An ordering key whose messages wait for sequence number ``waiting_for`` (the lowest waiting is
    ``lowest``), since ``since`` (epoch seconds), ``age`` seconds before the read."""

    key: str
    waiting_for: int
    lowest: int
    since: float
    age: float


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderingWaits:
    """Ordering keys waiting for a missing earlier message: how many, the oldest wait's age (seconds; None when
    none waits) and the oldest waits (at most ORDERING_SHOWN, oldest first)."""

    waiting: int
    oldest_age: float | None
    oldest: list[OrderingWait]


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitingMessage:
    """A message waiting for its countdown (see :mod:`celery_guardrails.guardrails.waiting`); times are epoch seconds,
    ``reason_text`` and ``due_text`` as people read them ("budget payments-api", "in 4 min")."""

    task: str
    task_id: str
    tenant: str
    reason: str
    detail: str
    reason_text: str
    attempt: int
    due: float
    due_text: str
    since: float
    overdue: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Waiting:
    """The messages waiting for a countdown: how many, per reason, and the WAITING_SHOWN soonest due."""

    count: int
    by_reason: dict[str, int]
    soonest: list[WaitingMessage]


@dataclass(slots=True, kw_only=True)
class Status:
    """Everything :func:`gather` read; a source that failed is empty and named in ``errors``."""

    at: float
    queues: list[QueueDepth] = field(default_factory=list)
    dead_letters: DeadLetters = field(default_factory=lambda: DeadLetters(counts=[]))
    dependencies: list[DependencyStatus] = field(default_factory=list)
    schedules: list[ScheduleStatus] = field(default_factory=list)
    #: Source name -> why it could not be read.
    errors: dict[str, str] = field(default_factory=dict)
    #: Watch mode: net change of each queue's depth per second since the previous read (arrivals minus
    #: departures; a broker does not tell the two apart without consuming).
    depth_change: dict[str, float] = field(default_factory=dict)
    #: Per queue, deliveries ended and messages arrived per minute over the last RATE_MINUTES whole minutes,
    #: from the activity the workers keep (None: not read, ``activity`` is off or the read failed).
    rates: dict[str, QueueRate] | None = None
    #: The outbox's backlog (None: not read, the Django app is not installed).
    outbox: OutboxBacklog | None = None
    #: Ordering keys that wait (None: not read, no guarded task of the app has an ``ordering_key``).
    ordering: OrderingWaits | None = None
    #: Messages re-published with a countdown, waiting for it (None: not read, the app has no guarded task).
    waiting: Waiting | None = None
