"""One delivery's guardrail state: what the hooks of one run of one message hold and hand to each other.

``GuardedTask`` starts it as a delivery starts; every hook reads it with :func:`delivery`. It lives on
Celery's request (one request per delivery), typed and in one place, so that the hook that ends a
delivery (an after-hook, a re-publish, a final failure) can see everything the earlier hooks took: a claim
to complete or release, a run slot, a dependency admission to report.

What a task may read stays on ``self.request`` and is documented there: ``attempt``, ``attempt_history``,
``idempotency_key`` (the opaque key to hand downstream; reading it is recorded here, see
:mod:`celery_guardrails.runtime.effects`), ``schedule_name``, ``period``, ``period_key``, ``since``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery_guardrails.foundation.redaction import Redactor
from celery_guardrails.runtime.view import DeliveryView
from celery_guardrails.stores.base import BrokerAck, ResultWrite

logger = logging.getLogger(__name__)

#: The request attribute holding the state.
ATTRIBUTE = "guardrails_delivery"
#: The request attribute holding the delivery's view (:func:`view`).
VIEW = "guardrails_view"


@dataclass(frozen=True, slots=True)
class Hold:
    """Something a delivery holds in the store (a claim, a run slot), and how to let it go."""

    owner: str
    release: Callable[[], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldKey:
    """The idempotency key a delivery holds (its claim) (see :mod:`celery_guardrails.guardrails.idempotency`)."""

    #: The scoped key (``task:tenant:key``).
    key: str
    #: Who holds it: this delivery (:func:`celery_guardrails.guardrails.idempotency.delivery_owner`).
    owner: str
    #: Not claimed yet: it is written with the effect, in the body's transaction
    #: (:mod:`celery_guardrails.guardrails.effect_keys`).
    with_the_effect: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PopClaim:
    """An idempotency claim made by the pop of the delivery's message (see
    :mod:`celery_guardrails.guardrails.pop_claims`)."""

    #: The scoped key (``task:tenant:key``), as the pop read it from the message.
    key: str
    owner: str
    #: The pop took the key over from a delivery whose lease had run out.
    takeover: bool
    #: Monotonic time until which it is surely still this delivery's; later, the delivery asks the store again.
    trusted_until: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """The completion of a claimed key, sent as the body returned and settled before the ack."""

    key: str
    #: Reads the store's answer: whether the key was completed (False: another delivery had taken it over).
    answer: Callable[[], bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class RidingResult:
    """The task's result, encoded as Celery's result backend stores it, to be written with the completion and the
    ack (see :mod:`celery_guardrails.runtime.results`)."""

    write: ResultWrite
    #: Stores it as Celery would have (its backend's ``store_result``), when the ack cannot carry it.
    store: Callable[[], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class RidingCompletion:
    """The completion of a claimed key that rides the ack (see :mod:`celery_guardrails.guardrails.acks`): made
    with it, after every success hook, in one step on the store that is also the broker."""

    key: str
    owner: str
    summary: str
    #: Seconds the completed key is kept.
    retention: float
    #: Settles the completion when the store could not make it (the store error): the worker acks afterwards.
    settle: Callable[[BaseException], Any]
    #: Says that the key was taken over before its completion (the store did not complete it).
    lost: Callable[[], Any]
    #: The ack it rides.
    ack: BrokerAck
    #: The task's result, when it rides too (the result backend's Redis is the store's): Celery's ``mark_as_done``
    #: then lets it be (:mod:`celery_guardrails.runtime.results`). None: results ignored, or not stored here.
    result: RidingResult | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSlot:
    """A schedule's run slot a delivery holds (see :mod:`celery_guardrails.guardrails.scheduled_runs`)."""

    key: str
    owner: str
    #: Seconds the slot is held without a renewal.
    lease: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledPeriod:
    """The period of a schedule a delivery runs."""

    schedule: str
    #: The period's due instant (epoch seconds).
    period: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderingTurn:
    """The turn of an ordering key a delivery ends (its outcome moves the key on)."""

    #: The scoped ordering key.
    key: str
    sequence: int


@dataclass(slots=True, kw_only=True)
class Grant:
    """A concurrency slot a delivery holds, and what its holder knows of it (see
    :mod:`celery_guardrails.guardrails.concurrency`). Its own: the heartbeat thread and the body's thread update it.
    """

    key: str
    holder: str
    #: The ceiling the slot was taken under (seconds): silent longer than this, the holder may be reaped.
    reap_after: float
    #: Monotonic time at which the last step that found the slot held (the acquire, a beat, a check) began.
    confirmed: float
    #: A beat or a check found the slot gone: it was reaped (every boundary now refuses, no round trip).
    lost: bool = False


@dataclass(slots=True, kw_only=True)
class Delivery:
    """The guardrails' state of one delivery."""

    #: When the delivery started (epoch seconds, real time): attempt records say when an attempt began.
    started: float = field(default_factory=time.time)
    #: When the delivery started on the monotonic clock: the duration metric (celery_guardrails.operations.metrics).
    monotonic_started: float = field(default_factory=time.perf_counter)
    #: The metrics counted this delivery's outcome already, from a signal (a retry, a dead letter, a duplicate):
    #: the after-hook counts it as succeeded or failed only when nothing more telling was counted.
    outcome_counted: bool = False
    #: How the body's failure was classified (:class:`celery_guardrails.runtime.classification.Verdict`), if it failed.
    verdict: Any = None
    #: Poison protection counted this start of a redelivered message (clear the count when the run ends).
    counted: bool = False
    #: The dependency whose budget admitted this run, when the run was admitted (its outcome is reported).
    dependency: str | None = None
    #: The guardrails' clock when the run was admitted.
    admitted: float | None = None
    #: The admission was a half-open circuit's probe: its outcome must be reported, whatever it is.
    probe: bool = False
    #: The idempotency claim held.
    claim: HeldKey | None = None
    #: The claim its message's pop made, until Idempotency adopts it (or it is released).
    popped: PopClaim | None = None
    #: The completion sent as the body returned.
    completion: Completion | None = None
    #: The completion that rides the ack instead (the store is the broker's Redis, nothing else to settle).
    riding: RidingCompletion | None = None
    #: The schedule's run slot held.
    slot: RunSlot | None = None
    #: The scheduled period this delivery runs.
    period: ScheduledPeriod | None = None
    #: Ordering: the turn this delivery ends (its outcome moves the key on).
    ordering: OrderingTurn | None = None
    #: Ordering looked at this delivery (else an earlier guardrail ended it first: its outcome still counts).
    ordering_checked: bool = False
    #: The concurrency slots held, in the order taken.
    concurrency: list[Grant] = field(default_factory=list)
    #: Set with the first slot taken: raises SlotLostError when a slot this delivery holds was reaped (the
    #: concurrency guardrail's fence, handed over here so that ``effect()`` asks it without importing a guardrail).
    fence: Callable[[str], None] | None = None
    #: What to give up before this delivery's message is published again (claims, run slots).
    holds: list[Hold] = field(default_factory=list)
    #: A guardrail is publishing the message again (so it is not taken for the body's own ``self.retry()``).
    republishing: bool = False
    #: Poison guard on a quorum queue: the starts the broker counted for this run (its ``x-delivery-count``, plus
    #: the count carried over a wait before the body ran); None where the store counts them.
    broker_starts: int | None = None
    #: How this delivery was settled so far: ``"recorded"`` (its dead letter is durably written) or
    #: ``"republished"`` (a retry or a wait is published). An exception that leaves ``GuardedTask`` with neither
    #: set was recorded by nothing: the task records it then (see ``GuardedTask.__call__``).
    ended: str | None = None
    #: The body ran (returned or raised): its effects may have happened.
    body_ran: bool = False
    #: What the body itself raised (a store error from the task's own code is the task's, not the guardrails').
    body_error: BaseException | None = None
    #: The job this delivery's message works for (see celery_guardrails.guardrails.jobs), once it runs.
    job: str | None = None
    #: The job's terminal state is written (in the effect's transaction, or by a signal): not again.
    job_written: bool = False
    #: ``self.job`` of the body (its progress reports are throttled across calls).
    job_handle: Any = None
    #: A store error the concurrency fence met inside the body (the guardrails' own outage, not the body's).
    fence_error: BaseException | None = None
    #: What the body returned.
    retval: Any = None
    #: The body is running: a ``self.retry()`` made now is the body's, and goes through the retry gate.
    in_body: bool = False
    #: The scoped idempotency key of this delivery (``task:tenant:key``), for the guardrails' own records; the
    #: body is handed an opaque key made from it (``self.request.idempotency_key``).
    key: str | None = None
    #: How many effect blocks had completed when the body first read ``self.request.idempotency_key`` (None:
    #: never read). Read before any effect, the key went downstream with them (a provider, a unique row): a
    #: run after a failure presents the same key, and the effect cannot land twice.
    key_read_at: int | None = None
    #: Effect blocks (``effect()``) that completed, or ended in an error that may have acted: a failure after
    #: one of them is not retried automatically (see celery_guardrails.runtime.effects).
    effects: int = 0

    def forget(self, owner: str) -> None:
        """The hold of ``owner`` is settled another way (its key completed or failed): nothing to release."""
        self.holds = [hold for hold in self.holds if hold.owner != owner]

    def give_up(self, task_id: str | None) -> list[str]:
        """Release every hold, each on its own; the owners of those that could not be released (the store may
        be what failed): the next delivery is told, and takes them over instead of waiting out their lease."""
        holds, self.holds = self.holds, []
        kept = []
        for hold in holds:
            try:
                hold.release()
            except Exception:
                logger.warning("Task %s: %s could not release its hold", task_id, hold.owner, exc_info=True)
                kept.append(hold.owner)
        return kept


def begin(request: Any) -> Delivery:
    """A fresh state for the delivery ``request`` stands for."""
    state = Delivery()
    setattr(request, ATTRIBUTE, state)
    return state


def delivery(task: Any) -> Delivery:
    """The state of the delivery ``task`` is running (made when a hook runs without one: a request Celery
    made on its own, e.g. for a worker that was lost)."""
    request = task.request
    state: Delivery | None = getattr(request, ATTRIBUTE, None)
    if state is None:
        state = begin(request)
    return state


def view(task: Any) -> DeliveryView:
    """The resolved view of the delivery ``task`` is running: its header and options, read once for every hook
    (see :mod:`celery_guardrails.runtime.view`).

    Kept on the request of a delivery (one Celery pushed for it: a worker's, an eager ``apply``'s), from the
    first hook that asks (Celery's ``task_prerun``, whose receiver restores the message's tenant, fires before
    ``GuardedTask.__call__`` begins the delivery) to the last after-hook. Outside one (the caller's process),
    the request is Celery's default one for as long as the process lives: a view is read afresh each time there,
    and never kept. A view is its request's only: ``Task.push_request`` copies the current request's attributes
    into the one it pushes, so a view found on a request that is not its own is read again.
    """
    request = getattr(task, "request", None)
    found: DeliveryView | None = getattr(request, VIEW, None)
    if found is not None and found.request is request:
        return found
    made = DeliveryView.read(task)
    stack = getattr(task, "request_stack", None)
    if stack is not None and stack.top is request:  # a delivery's request, not Celery's default one
        with contextlib.suppress(AttributeError):  # a request object that takes no attributes: read each time
            setattr(request, VIEW, made)
    return made


def redaction(task: Any) -> Redactor:
    """The redactor of ``task`` (its ``redact_keys`` and ``redact_patterns``): made once per delivery, for the
    log lines and records of every hook; outside a delivery, made as asked (:func:`view`)."""
    return view(task).redaction


__all__ = ["Delivery", "Hold", "begin", "delivery", "redaction", "view"]
