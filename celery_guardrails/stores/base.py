"""The store protocol: shared state that must be right across every worker (claims, budgets and breakers,
checkpoints, ordering, waits, slots, activity), and the records a store answers with.

Two real backends implement it: Redis (:mod:`celery_guardrails.stores.redis`, one Lua script per
operation, so each is atomic and one round trip) and the Django database (``django_celery_guardrails.store``).
The retry budget's and circuit breaker's rules both follow are in :mod:`celery_guardrails.stores.budget_rules`
(re-exported here); the same tests run against both stores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from celery_guardrails.scheduling.ledger import RunLedger
from celery_guardrails.stores.budget_rules import (  # re-exported: the protocol's vocabulary
    CLOSED as CLOSED,
)
from celery_guardrails.stores.budget_rules import (
    FAILURE as FAILURE,
)
from celery_guardrails.stores.budget_rules import (
    HALF_OPEN as HALF_OPEN,
)
from celery_guardrails.stores.budget_rules import (
    INTERNAL_KEY_PREFIX as INTERNAL_KEY_PREFIX,
)
from celery_guardrails.stores.budget_rules import (
    OPEN as OPEN,
)
from celery_guardrails.stores.budget_rules import (
    RELEASE as RELEASE,
)
from celery_guardrails.stores.budget_rules import (
    SUCCESS as SUCCESS,
)
from celery_guardrails.stores.budget_rules import (
    Admission as Admission,
)
from celery_guardrails.stores.budget_rules import (
    BudgetPolicy as BudgetPolicy,
)
from celery_guardrails.stores.budget_rules import (
    DependencyState as DependencyState,
)
from celery_guardrails.stores.budget_rules import (
    WindowCounts as WindowCounts,
)
from celery_guardrails.stores.budget_rules import (
    decide_admission as decide_admission,
)
from celery_guardrails.stores.budget_rules import (
    decide_outcome as decide_outcome,
)
from celery_guardrails.stores.budget_rules import (
    status as status,
)
from celery_guardrails.stores.budget_rules import (
    window_counts as window_counts,
)

ACQUIRED, BUSY, COMPLETED, FAILED = "acquired", "busy", "completed", "failed"


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """The answer to claiming an idempotency key.

    ``state``: ``"acquired"`` (this delivery runs the body; ``takeover`` when it took an expired lease, or
    the claim of the owner it ``replaces``), ``"busy"`` (``owner`` holds a live lease until ``lease_until``),
    ``"completed"`` (done before, by ``owner``: ``summary``), ``"failed"`` (failed permanently before, by
    ``owner``: ``reason``; a replay reopens it).
    """

    state: str
    takeover: bool = False
    lease_until: float = 0.0
    summary: str = ""
    reason: str = ""
    owner: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class BrokerAck:
    """The ack of one message on a Redis broker, made by a Redis store on the same server (see
    :mod:`celery_guardrails.guardrails.acks`): kombu's record of the delivery, removed as kombu's ack removes it."""

    #: kombu's hash of deliveries handed out and not acked (``unacked``, under its ``global_keyprefix``).
    unacked: str
    #: kombu's index of the same deliveries by time (``unacked_index``).
    index: str
    #: The delivery's tag.
    tag: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultWrite:
    """A task's result as Celery's Redis result backend writes it (its key, the encoded meta-data, its expiry),
    written by a Redis store on the same server with the completion and the ack it rides (see
    :mod:`celery_guardrails.guardrails.acks`)."""

    #: The result's key (the backend's ``get_key_for_task``), also the channel its waiters listen on.
    key: str
    #: The encoded meta-data, as the backend would store it.
    value: str | bytes
    #: Seconds the result is kept (the backend's ``result_expires``); None: for ever.
    expires: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredCheckpoint:
    """A long job's checkpoint as the store holds it (see :mod:`celery_guardrails.runtime.checkpoint`)."""

    #: Items done: a resumed run skips this many.
    position: int = 0
    #: The JSON text saved with the position ("" for none).
    state: str = ""
    #: The job's task succeeded: a redelivery of its message (the worker killed before the ack) runs no item.
    done: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderState:
    """An ordering key's counters, as a delivery found them (see :mod:`celery_guardrails.guardrails.ordering`).

    ``issued``: the last sequence number handed out at publish (0: the key is unknown: never used, or its
    counters lapsed after ``ordering_retention``); ``done``: the last sequence number whose turn is over (it
    succeeded, failed finally, or was given up as lost); ``gap_since``: when a message first found itself
    waiting on the current gap (epoch seconds; 0: none has since the key last moved); ``waiting``: the lowest
    sequence number seen waiting since then (0: none); ``skipped_from`` /
    ``skipped_to``: the last range of sequence numbers given up as lost (0, 0: none); ``stale``: deliveries
    found stale so far; ``skipped_since`` / ``skipped_at``: when the gap of that range opened and when it was
    given up (epoch seconds; 0: none); ``skip_owed``: that range's record (a dead letter
    ``ordering_gap_skipped``) is not written yet; ``alerted``: the ``gap_since`` of the last wait an alert
    was sent for (0: none).
    """

    issued: int = 0
    done: int = 0
    gap_since: float = 0.0
    waiting: int = 0
    skipped_from: int = 0
    skipped_to: int = 0
    stale: int = 0
    skipped_since: float = 0.0
    skipped_at: float = 0.0
    skip_owed: bool = False
    alerted: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderWait:
    """An ordering key whose messages wait for an earlier sequence number: ``waiting_for`` (its ``done`` + 1),
    the lowest number seen waiting (``lowest``) and since when (``since``, epoch seconds: the wait's start)."""

    key: str
    waiting_for: int
    lowest: int
    since: float


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderWaits:
    """The ordering keys that wait (:meth:`Store.order_waits`): how many, and the oldest waits, oldest first."""

    count: int
    oldest: tuple[OrderWait, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
    """A message the guardrails re-published with a countdown, waiting to be delivered again (see
    :mod:`celery_guardrails.guardrails.waiting`). Times are epoch seconds; ``tenant`` "" when it has none."""

    task_id: str
    task_name: str
    tenant: str = ""
    queue: str = ""
    #: Why it waits: one of :data:`celery_guardrails.guardrails.waiting.REASONS` ("retry", "budget", "circuit", ...).
    reason: str
    #: What it waits on: the error class of a retry, the dependency, the concurrency / ordering / idempotency key.
    detail: str = ""
    #: The attempt its next delivery makes (a wait that spends no attempt keeps the number).
    attempt: int = 1
    due: float
    since: float
    #: When the store forgets it although no delivery removed it (its message was lost): well after ``due``.
    expires: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Waits:
    """What :meth:`Store.waiting` found: how many wait, per reason, and the first ``limit`` by due time."""

    count: int
    by_reason: dict[str, int]
    soonest: tuple[Wait, ...] = ()


class Store(RunLedger, Protocol):
    """What a guardrails store does (each operation atomic across all workers).

    Idempotency keys: ``claim`` inserts the key as claimed by ``owner`` with a lease (or takes over an expired
    lease); ``extend`` renews the lease (heartbeat); ``complete`` / ``fail`` / ``release`` end the claim and
    succeed only for the current owner (a ``complete`` or ``fail`` repeated by the owner that made it succeeds
    again: a retry after a lost answer is safe); ``begin_complete`` starts a ``complete`` and returns the
    callable that waits for its answer (a store that cannot overlap the two does it all at once);
    ``reopen`` deletes a failed key for a deliberate replay; ``reopen_keys`` does it for many keys in one round
    trip (a replay of thousands of records), and says how many were failed.
    """

    def claim(
        self,
        key: str,
        *,
        owner: str,
        now: float,
        lease: float,
        retention: float,
        replaces: str = "",
        atomic: bool = False,
    ) -> Claim:
        """Claim ``key`` for ``owner``. ``replaces``: an owner known to be gone (its delivery gave up, its
        process is dead), whose claim is taken over at once, live lease or not. ``atomic``: the claim's
        completion will commit in one database transaction with the task's effect (``atomic=True``), so a
        store whose claim is a commit in that database need not wait for the claim to reach the disk (see
        ``django_celery_guardrails.store``)."""
        ...

    def extend(self, key: str, *, owner: str, now: float, lease: float) -> bool: ...

    def complete(self, key: str, *, owner: str, now: float, summary: str, retention: float) -> bool: ...

    def begin_complete(
        self, key: str, *, owner: str, now: float, summary: str, retention: float
    ) -> Callable[[], bool]: ...

    def fail(self, key: str, *, owner: str, now: float, reason: str, retention: float) -> bool: ...

    def release(self, key: str, *, owner: str) -> bool: ...

    def reopen(self, key: str) -> bool: ...

    def reopen_keys(self, keys: Iterable[str]) -> int: ...

    def inspect(self, key: str) -> dict[str, Any] | None: ...

    def reserve_publish(self, key: str, *, task_id: str, ttl: float) -> str | None: ...

    def count_delivery(self, message_id: str, *, ttl: float) -> int: ...

    def clear_delivery(self, message_id: str) -> None: ...

    def throttle(self, group: str, *, window: float, now: float, extend_for: float = 0.0) -> bool:
        """True: alert now (the first of a window of ``window`` seconds); False: counted for the window's summary.
        ``extend_for`` > 0: each counted alert pushes the window's end to ``now + window``, up to ``extend_for``
        seconds after the alert that opened it (an incident that goes on is one alert, then one summary)."""
        ...

    def due_summaries(self, *, now: float) -> list[tuple[str, int]]: ...

    def admit(self, dependency: str, policy: BudgetPolicy, *, retry: bool, now: float) -> Admission: ...

    def record_outcome(self, dependency: str, policy: BudgetPolicy, *, outcome: str, now: float) -> bool:
        """Report a run's outcome (SUCCESS, FAILURE, RELEASE) to the breaker; whether it opened the circuit."""
        ...

    def budget_status(self, dependency: str, policy: BudgetPolicy, *, now: float) -> dict[str, Any]: ...

    def reset(self, dependency: str) -> None: ...

    # Checkpoints of long jobs (``self.checkpoint``, :mod:`celery_guardrails.runtime.checkpoint`): per key, the position
    # reached (items done) and a small JSON state saved with it. ``save_checkpoint`` is a compare-and-set: it
    # writes only while the stored position is ``expected`` (0 when there is none), so two deliveries of one job
    # running at once cannot both move it (the second is told False). The Django store writes on the caller's
    # connection, inside its transaction, so a chunk's effects and its position commit together. ``ttl``:
    # seconds the checkpoint is kept after its last save (the Redis store; the database keeps it until pruned).
    # ``complete_checkpoint`` marks the job done (its task succeeded) instead of deleting it: the ack comes
    # later, and a redelivery in between (the worker killed) must find the job done, not start it at item 0.

    def load_checkpoint(self, key: str) -> StoredCheckpoint:
        """The checkpoint of ``key``; position 0, no state, not done when it has none."""
        ...

    def save_checkpoint(self, key: str, *, expected: int, position: int, state: str, ttl: float) -> bool: ...

    def complete_checkpoint(self, key: str, *, ttl: float) -> None:
        """Mark the job of ``key`` done (made if missing), kept ``ttl`` seconds more (Redis) or until pruned."""
        ...

    def clear_checkpoint(self, key: str) -> None: ...

    # Ordering per key (celery_guardrails.guardrails.ordering). Each operation is atomic and keeps the key's
    # counters ``retention`` seconds after it (a key idle for longer starts again at 1).

    def order_next(self, key: str, *, now: float, retention: float) -> int:
        """Hand out the next sequence number of ``key`` (1 for a new key)."""
        ...

    def order_check(self, key: str, *, sequence: int, now: float, retention: float) -> OrderState:
        """The counters of ``key`` for a delivery of ``sequence``: when it must wait (``sequence > done + 1``),
        ``gap_since`` is set to ``now`` unless a message waits already, and ``waiting`` to ``sequence`` if it
        is lower; when it is stale (``sequence <= done``), ``stale`` counts it. An unknown key is not made."""
        ...

    def order_advance(self, key: str, *, sequence: int, now: float, retention: float) -> bool:
        """``sequence``'s turn is over: ``done`` becomes ``sequence`` if it was ``sequence - 1`` (compare and
        set; ``gap_since`` and ``waiting`` cleared); whether it did."""
        ...

    def order_skip(self, key: str, *, done: int, to: int, now: float, retention: float) -> bool:
        """Give up ``done + 1 .. to`` as lost: ``done`` becomes ``to`` if it still is ``done`` (compare and set),
        the range is kept as the last skipped with the wait's start (``skipped_since``), ``now``
        (``skipped_at``) and ``skip_owed`` set, ``gap_since`` and ``waiting`` cleared; whether it did."""
        ...

    def order_recorded(self, key: str, *, to: int, now: float, retention: float) -> bool:
        """The record of the skipped range ending at ``to`` is written: ``skip_owed`` cleared if the last range
        skipped still ends at ``to`` and was owed; whether it was."""
        ...

    def order_alert(self, key: str, *, since: float, now: float, retention: float) -> bool:
        """Whether the wait that started at ``since`` alerts now: True once per wait (``alerted`` becomes
        ``since`` if the key still waits since then and was not alerted for it), False after."""
        ...

    def order_waits(self, *, now: float, limit: int) -> OrderWaits:
        """The keys waiting for an earlier number (``gap_since`` set): how many, and the ``limit`` oldest. Read
        from an index the wait's start writes once (a Redis sorted set; an indexed column), not from a scan."""
        ...

    # Waiting messages (celery_guardrails.guardrails.waiting): one row per task id, written as a message is
    # re-published with
    # a countdown, removed as its next delivery starts, forgotten after ``expires``.

    def wait_note(self, wait: Wait) -> None:
        """Keep ``wait`` for its task id, replacing the one kept (a key re-published many times is one row)."""
        ...

    def wait_done(self, task_id: str) -> None:
        """Forget the wait of ``task_id`` (none kept: nothing happens)."""
        ...

    def waiting(self, *, now: float, limit: int, tenants: frozenset[str] | None = None) -> Waits:
        """The waits not expired at ``now`` (those expired are removed): the count, per reason, and the ``limit``
        soonest due. ``tenants``: only those of these tenants ("" for none); None: every tenant."""
        ...

    # Concurrency slots (see the block below the protocol): per-key limits, holders' heartbeats, the reaper.

    def acquire_slot(
        self,
        key: str,
        *,
        holder: str,
        limit: int,
        now: float,
        reap_after: float,
        task_name: str = "",
        task_id: str = "",
        tenant: str = "",
    ) -> SlotAcquisition:
        """Reap the holders of ``key`` whose heartbeat is older than ``reap_after`` seconds (each recorded
        ``lost``), count the live ones and take a slot for ``holder`` when fewer than ``limit`` hold one: all
        in one atomic step (no count is cached anywhere). A holder asking again still holds its slot."""
        ...

    def heartbeat_slot(self, key: str, *, holder: str, now: float) -> bool:
        """Push ``holder``'s heartbeat to ``now``; False when it holds no slot of ``key`` (released, reaped)."""
        ...

    def release_slot(self, key: str, *, holder: str) -> bool:
        """Give ``holder``'s slot back; False when it held none (released before, or reaped: the record stays)."""
        ...

    def reap_slots(self, *, now: float) -> list[SlotHolder]:
        """The reaper on a timer: reap every key's stale holders (each key with the ceiling its last capacity
        check used); the holders reaped."""
        ...

    def slot_status(self, key: str, *, now: float) -> dict[str, Any]:
        """What :func:`celery_guardrails.concurrency_status` reports for ``key``."""
        ...

    # Activity per minute (celery_guardrails.operations.activity): delivery outcomes counted per (task, queue, outcome)
    # and
    # queue samples, kept ``retention`` seconds for the admin dashboard's charts and the status rates.

    def activity_add(self, counts: Iterable[OutcomeCount], *, batch: str, retention: float) -> None:
        """Add ``counts`` to the stored ones, all or none. ``batch``: the id of this set of counts; a batch
        added again (its first answer was lost) is not counted twice where the store can tell (Redis: the id is
        kept ``retention`` seconds; the Django store commits the batch in one transaction)."""
        ...

    def activity_sample(self, samples: Iterable[QueueSample], *, retention: float) -> None:
        """Keep each queue's sample for its minute (a second sample of a minute replaces the first)."""
        ...

    def activity_read(self, *, since: float, until: float) -> Activity:
        """Counts and samples of the minutes from ``since`` (included) to ``until`` (excluded)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class OutcomeCount:
    """Deliveries of ``task`` from ``queue`` that ended with ``outcome`` (see
    :mod:`celery_guardrails.operations.metrics`)
    in the minute starting at ``minute`` (epoch seconds, a multiple of 60)."""

    minute: float
    task: str
    queue: str
    outcome: str
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueSample:
    """``queue`` as read once in the minute starting at ``minute``: its depth and the age of its oldest message
    (None: unknown, see :class:`celery_guardrails.broker.queues.QueueDepth`)."""

    minute: float
    queue: str
    depth: int
    oldest_age: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Activity:
    """What :meth:`Store.activity_read` found, oldest minute first."""

    outcomes: list[OutcomeCount]
    queues: list[QueueSample]


#: States of a concurrency slot's holder: holding it, or reaped (its heartbeat stopped: the job is ``lost``).
HELD, LOST = "held", "lost"
#: Reaped holders' records kept per key on Redis (the newest), and for how long (seconds) after the last one.
LOST_RECORDS_KEPT = 100
LOST_RECORDS_TTL = 7 * 24 * 3600


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotHolder:
    """A holder of a concurrency slot: the delivery, what it runs, and its times (epoch seconds)."""

    key: str
    holder: str
    task_name: str = ""
    task_id: str = ""
    tenant: str = ""
    acquired_at: float = 0.0
    heartbeat_at: float = 0.0
    #: When the reaper took the slot away (``state`` ``lost``); None while it is held.
    reaped_at: float | None = None
    state: str = HELD


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotAcquisition:
    """The answer to :meth:`Store.acquire_slot`.

    ``acquired``: the slot is this holder's. ``holders``: how many hold one after this step (counted in it).
    ``reaped``: the holders this step reaped. ``retry_at``: when the oldest holder would be reaped if it
    stopped beating (epoch seconds; 0 with no holder): a waiting delivery need not look later than that.
    """

    acquired: bool
    holders: int
    reaped: tuple[SlotHolder, ...] = ()
    retry_at: float = 0.0
