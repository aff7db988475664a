"""Ordering per key (opt-in): the messages of one ``ordering_key`` run one after another, in publish order.

* Publish (:class:`SequenceStamp`, every path: ``delay``, ``apply_async``, signatures): the key is made from
  ``ordering_key`` as an idempotency key is (a ``str.format`` template over the bound arguments, or a
  callable; per call, the key itself; the same checks, :class:`~celery_guardrails.exceptions.OrderingKeyError`
  in the caller), scoped by task name and tenant, and the store hands out its next sequence number (1, 2, ...).
  Both travel in the header (``ord``, ``ord_seq``): a retry, a ``RetryLater``, a wait and a pending dead letter
  keep the number the message was published with. A store that cannot be reached raises
  :class:`~celery_guardrails.exceptions.StoreUnavailableError` in the caller: nothing is published.
* Run (:class:`Ordering`): the key's ``done`` (the last sequence number whose turn is over) decides:

  - ``seq == done + 1``: its turn, the run goes on;
  - ``seq <= done``: stale (a redelivery or duplicate of a message whose turn is over): the body does not run,
    the task returns None, ``stale_skipped`` fires, the key's ``stale`` count grows, logged with the ids;
  - ``seq > done + 1``: an earlier message has not finished: it comes back later through ``RetryLater``, no
    attempt spent, not counted against ``retry_later_max`` (header ``ord_wait`` counts its waits): after
    ``retry_later_delay`` when it is next in line, after k times that when k places further back (at most 50),
    or, when longer, after as long as the key has not moved (its wait's age): the looks of a key that stays
    stuck double (0.1, 0.1, 0.2, 0.4 ... s), up to ``ordering_wait_max`` (30 s), 75 to 100% of it (random), and
    never past the next moment the wait has something to do (alert, give up). Two stuck keys cost a few
    re-publishes a minute, not ten a second; a key that moves again resumes within about
    min(its wait so far, ``ordering_wait_max``). A backlog whose key keeps moving drains at about one message
    per ``retry_later_delay``: give ordered tasks a short one (a fraction of a second);
  - a malformed ``ord`` / ``ord_seq`` is dead-lettered ``malformed_message`` (running it unordered would break
    the order it was published to keep); a message without them runs unordered (published by plain Celery or
    a release without ordering; logged).
* Outcome: a success moves the key on (``done`` from ``seq - 1`` to ``seq``, compare and set), and so does a
  final failure of the message whose turn it is (its dead letter is the record), so one poison message does
  not stop its key for ever. A retry or a ``RetryLater`` does not: its successors wait, the order is kept.

A gap that never fills: an earlier number may never run (its publish failed after the number was handed out;
the message was lost, or failed finally before its turn, where it could not move the key). Dead-lettering
the messages that wait behind it would not help: each of them would wait and be dead-lettered in turn, and
the key would stop for ever. Instead, once the key has not moved for ``ordering_gap_timeout`` while messages
wait, the lowest waiting message gives up the numbers below it (``ordering_gap_skipped`` fires, logged) and
runs; the others follow in order. The numbers given up are recorded first: one dead letter
``ordering_gap_skipped`` per range (:func:`gap_record`: the task, the key, the numbers, when the gap opened and
when it was given up; no arguments: nothing to replay, a replay is refused saying so), counted and alerted as
every dead letter. The store marks the range owed until the record is written, so a sink that is down when
the range is given up holds the key's messages back (each comes back later) until one of them writes it.
Only numbers no message has been seen waiting with are given up, so a live waiter is never skipped (should
the lowest waiter itself vanish, any waiter gives up the numbers below it after twice the timeout). A skipped
message that turns up later is dead-lettered with reason ``ordering_gap`` (recorded, replayable), not dropped
as stale. Keep ``ordering_gap_timeout`` above the longest run plus retries of one message: a message slower
than that is taken for lost, and the next one runs beside it.

A wait is visible while it lasts: the store indexes the keys that wait (one write as a wait starts, one as it
ends; a message that only looks again writes nothing), read by ``celery -A proj guardrails status`` (the
"Ordering waits" table) and the metrics (``celery_guardrails_ordering_keys_waiting``,
``celery_guardrails_ordering_oldest_wait_seconds``); after ``ordering_gap_alert_after`` (5 minutes) the
task's owner is alerted once per wait (:func:`celery_guardrails.operations.alerts.ordering_wait`).

What ordering is not:

* Only messages of one key are ordered; different keys (and different tasks, and tenants: the key is scoped by
  both) run freely side by side. Global ordering (one order over all messages) is not offered: it would
  serialise every worker on one counter.
* Publish order is the order of the numbers handed out: two publishers racing on one key are ordered by
  which reached the store first.
* Duplicates of one message running at the same time (a redelivery beside the first delivery) are the
  idempotency key's business, not ordering's: an ordered task should normally also have an
  ``idempotency_key``. Ordering comes before the idempotency claim, so a message waits for its turn without
  holding its key, and a duplicate of a completed key skipped in its turn still moves the ordering key on.
* A replay of a dead-lettered ordered message takes a new number when it is published: its old turn is
  over (its successors have moved on), so it runs after everything published for its key before the replay,
  one at a time with them, never beside them.
* The task reads its place as ``self.request.ordering_key`` (scoped) and ``self.request.ordering_sequence``.
* Retention: the key's counters live ``ordering_retention`` (30 days) after their last use; see
  :mod:`celery_guardrails.stores.redis_ordering` for what happens if that lapses while messages are in flight.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from typing import TYPE_CHECKING, Any, NoReturn

from celery_guardrails import signals
from celery_guardrails.exceptions import OrderingError, OrderingKeyError, RetryLater, StoreError
from celery_guardrails.foundation.context import current_tenant
from celery_guardrails.guardrails.keys import render_key, scoped_key, validate_key
from celery_guardrails.guardrails.retries import retry_later
from celery_guardrails.operations import alerts
from celery_guardrails.options import APP, CALL, TASK, Option, TaskOptions, checks, declare, resolve
from celery_guardrails.runtime import dead_letters, headers
from celery_guardrails.runtime.delivery import OrderingTurn, delivery, view
from celery_guardrails.runtime.final_failure import FinalFailure
from celery_guardrails.runtime.outcomes import (
    MALFORMED_MESSAGE,
    ORDERING_GAP,
    ORDERING_GAP_SKIPPED,
    attempt_record,
    fail_finally,
    owner_of,
    timestamp,
)
from celery_guardrails.runtime.pipeline import Guardrail, Publication, SkipBody
from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import OrderState

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)

#: A waiting message looks again after ``retry_later_delay`` times its distance from its turn (the turns it has
#: to wait, each taking about that long), at most this many times.
WAIT_SCALE = 50
#: The part of a wait that is random: a waiting message stays away 75 to 100% of its delay.
WAIT_JITTER = 0.25
#: Header field of a gap's record (never of a message): the last sequence number given up with ``ord_seq``.
GAP_LAST = "ord_seq_last"
#: Pauses (seconds) between tries at moving a key on when the store does not answer after a run; then the
#: key's successors wait until ``ordering_gap_timeout`` gives the turn up.
ADVANCE_PAUSES = (0.1, 0.5, 1.0)


#: The options ordering reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="ordering_key",
        default=None,
        doc="Opt-in ordering per key: str.format template over the task's bound arguments ('account:{id}'), "
        "or a callable taking the task's arguments; per call, the key itself. Scoped by task name and tenant. "
        "Messages of one key run in the order they were published; different keys are not ordered.",
        check=checks.key_spec,
        scopes=frozenset({CALL, TASK}),
    ),
    Option(
        name="ordering_gap_timeout",
        default=3600.0,
        doc="Seconds the messages of an ordering key wait for a missing earlier one (lost before it was "
        "published, or gone where it could not say so) before the key moves past it; one that turns up later "
        "is dead-lettered (ordering_gap). Keep it above the longest run plus retries of one message.",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="ordering_gap_alert_after",
        default=300.0,
        doc="Seconds an ordering key may wait for a missing earlier message before its owner is alerted (once "
        "per wait, then throttled like dead letters): time to find the message before ordering_gap_timeout "
        "gives it up. 0: no alert.",
        check=checks.seconds_or_off,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="ordering_wait_max",
        default=30.0,
        doc="Seconds a message waiting for an earlier one of its key stays away at most: its looks back start "
        "at retry_later_delay and double while the key does not move. Also how late the key may resume once "
        "a long wait ends.",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="ordering_retention",
        default=30 * 24 * 3600.0,
        doc="Seconds an ordering key's counters are kept after its last message was published or done (30 "
        "days); a key idle for longer starts again at 1.",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
)


class SequenceStamp(Guardrail):
    """Publish side: hands out the message's sequence number. Last in the pipeline, so a publish another
    guardrail refuses or skips (``dedupe_on_publish``) takes no number."""

    def on_publish(self, task: GuardedTask, publication: Publication) -> None:
        header = publication.header
        if headers.ORDERING_KEY in header or headers.ORDERING_SEQUENCE in header:
            return  # a retry, a wait or a pending dead letter keeps the number it was published with
        spec = resolve(task, "ordering_key", publication.call)
        if spec is None:
            return
        args, kwargs = publication.args, publication.kwargs
        key = render_key(task, spec, args, kwargs, option="ordering_key", error=OrderingKeyError)
        scoped = scoped_key(task.name, header.get(headers.TENANT), key)
        retention = resolve(task, "ordering_retention", publication.call)
        sequence = get_store(task.app).order_next(scoped, now=time.time(), retention=retention)
        header[headers.ORDERING_KEY] = key
        header[headers.ORDERING_SEQUENCE] = sequence


class Ordering(Guardrail):
    """Run side: lets a message run in its turn, skips a stale one, puts off one that is early."""

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = task.request
        state = delivery(task)
        state.ordering_checked = True
        seen = view(task)
        header, options = seen.header, seen.options
        try:
            found = headers.ordering(header)
            if found is not None:
                validate_key(task.name, found[0], what="ordering key", error=OrderingKeyError)
        except (ValueError, OrderingError) as exc:
            self._refuse(task, OrderingError(f"malformed ordering header: {exc}"), MALFORMED_MESSAGE)
        if found is None:
            eager = request.called_directly or request.is_eager  # never published: nothing to order
            if not eager and options["ordering_key"] is not None:
                logger.warning(
                    "Task %s[%s]: ordered task delivered without a sequence number (not published through "
                    "GuardedTask); running it unordered",
                    task.name,
                    request.id,
                )
            return
        key, sequence = found
        scoped = scoped_key(task.name, current_tenant(), key)
        store = get_store(task.app)
        now = time.time()
        retention = options["ordering_retention"]
        found_state = store.order_check(scoped, sequence=sequence, now=now, retention=retention)
        done = found_state.done
        request.ordering_key, request.ordering_sequence = scoped, sequence
        if sequence > found_state.issued:
            error = OrderingError(
                f"sequence {sequence} of ordering key {scoped} is past the last one handed out "
                f"({found_state.issued}): the key's counters were lost while it was in flight (they lapsed after "
                f"ordering_retention, or the store was emptied), so it cannot be put in order"
            )
            self._refuse(task, error, ORDERING_GAP)
        if found_state.skip_owed:
            # The last range given up has no record yet (the sinks were down as it was given up): written
            # before anything else of the key goes on (a sink still down brings this message back later).
            self._record_skip(task, key, scoped, found_state, options)
        if sequence <= done:
            if found_state.skipped_from <= sequence <= found_state.skipped_to:
                error = OrderingError(
                    f"sequence {sequence} of ordering key {scoped} arrived after the key moved past it (numbers "
                    f"{found_state.skipped_from}..{found_state.skipped_to} were given up as lost after "
                    f"ordering_gap_timeout)"
                )
                self._refuse(task, error, ORDERING_GAP)
            logger.info(
                "Task %s[%s]: ordering key %s is done up to %d; sequence %d is stale, not run (stale deliveries "
                "of the key: %d)",
                task.name,
                request.id,
                scoped,
                done,
                sequence,
                found_state.stale,
            )
            signals.stale_skipped.send(sender=task, task_id=request.id, key=scoped, sequence=sequence, done=done)
            raise SkipBody(None)
        state.ordering = OrderingTurn(key=scoped, sequence=sequence)
        if sequence == done + 1:
            return
        since = found_state.gap_since or now  # (set by the check: never 0 here)
        waited = now - since
        timeout = options["ordering_gap_timeout"]
        alert_after = options["ordering_gap_alert_after"]
        # The key has not moved for the whole timeout, and no message below this one was seen waiting: the
        # numbers between are lost. Give them up and run (a lost race means the key moved: wait again). The
        # lowest waiter itself may vanish (dead-lettered as poison, say): past twice the timeout, any waiter
        # gives up the numbers below it, so no wait lasts for ever.
        lowest = sequence == found_state.waiting
        lost = waited >= timeout and (lowest or waited >= 2 * timeout)
        if lost and store.order_skip(scoped, done=done, to=sequence - 1, now=now, retention=retention):
            logger.warning(
                "Task %s[%s]: ordering key %s did not move for %.0fs; sequence numbers %d..%d given up as lost, "
                "running %d",
                task.name,
                request.id,
                scoped,
                waited,
                done + 1,
                sequence - 1,
                sequence,
            )
            signals.ordering_gap_skipped.send(
                sender=task, task_id=request.id, key=scoped, first=done + 1, last=sequence - 1, waited=waited
            )
            skipped = OrderState(skipped_from=done + 1, skipped_to=sequence - 1, skipped_since=since, skipped_at=now)
            self._record_skip(task, key, scoped, skipped, options)
            return
        # Once per wait (the store lets one delivery of the key through), whichever waiter looks first.
        alert = alert_after and waited >= alert_after and found_state.alerted != since
        if alert and store.order_alert(scoped, since=since, now=now, retention=retention):
            alerts.ordering_wait(task, key=scoped, waiting_for=done + 1, lowest=found_state.waiting, since=since)
        wait = RetryLater(f"ordering key {scoped}: sequence {sequence} waits for {done + 1}")
        retry_later(
            task,
            wait,
            delay=self._wait(options, sequence - done - 1, waited),
            rule="ordering:wait",
            counter=headers.ORDERING_WAITS,
        )

    @staticmethod
    def _wait(options: TaskOptions, distance: int, waited: float) -> float:
        """How long a waiting message stays away: ``retry_later_delay`` times its distance from its turn (it has
        that many turns to wait, each about one delay), or, when longer, as long as the key has not moved (so
        the looks of a key that stays stuck double: 0.2, 0.2, 0.4, 0.8 ... seconds), at most
        ``ordering_wait_max``; a quarter of it random (the waiters of many keys stuck at once do not come back
        together); never past the next moment the wait has something to do (alert, give up)."""
        distance = min(distance, WAIT_SCALE)
        ceiling = min(options["ordering_wait_max"], max(options["retry_later_delay"] * distance, waited))
        delay = ceiling * (1.0 - WAIT_JITTER * random.random())
        timeout = options["ordering_gap_timeout"]
        due = [at for at in (options["ordering_gap_alert_after"], timeout, 2 * timeout) if at > waited]
        if due:
            delay = min(delay, min(due) - waited + 0.01)
        return max(0.01, float(delay))

    def _record_skip(self, task: GuardedTask, key: str, scoped: str, skipped: OrderState, options: TaskOptions) -> None:
        """Write the record of the range ``skipped`` gave up (a dead letter ``ordering_gap_skipped``, once per
        range: its id is made from the key, the range and the wait's start), then tell the store it is written.
        A sink that cannot be reached raises (this message comes back later; the record stays owed)."""
        failure = gap_record(task, key=key, scoped=scoped, skipped=skipped)
        new = dead_letters.record(task, failure)
        if new:
            logger.error(
                "Task %s: ordering key %s: sequence number(s) %d..%d never came; recorded as dead letter %s (%s)",
                task.name,
                scoped,
                skipped.skipped_from,
                skipped.skipped_to,
                failure.task_id,
                ORDERING_GAP_SKIPPED,
            )
            try:  # alerts and metrics count it as they count every dead letter
                signals.dead_lettered.send(sender=task, failure=failure)
            except Exception:
                logger.exception("Task %s[%s]: a receiver of dead_lettered failed", task.name, task.request.id)
        retention = options["ordering_retention"]
        get_store(task.app).order_recorded(scoped, to=skipped.skipped_to, now=time.time(), retention=retention)

    def _refuse(self, task: GuardedTask, error: OrderingError, reason: str) -> NoReturn:
        """Dead-letter the message (its turn does not move the key); raise what fails the task."""
        delivery(task).ordering = None
        record = attempt_record(task, kind="permanent", rule="ordering", exc=error)
        fail_finally(task, error, reason=reason, history=[*task.request.attempt_history, record])

    def _advance(self, task: GuardedTask) -> None:
        """This delivery's turn is over: move its key on (compare and set: only from ``seq - 1``)."""
        state = delivery(task)
        turn = state.ordering
        if turn is None and not state.ordering_checked:
            # An earlier guardrail ended the delivery (a dead letter recorded late, a poison message): if it
            # was its turn, the key moves on all the same.
            try:
                found = headers.ordering(view(task).header)
            except ValueError:
                found = None
            if found is not None:
                turn = OrderingTurn(key=scoped_key(task.name, current_tenant(), found[0]), sequence=found[1])
        state.ordering = None
        if turn is None:
            return
        key, sequence = turn.key, turn.sequence
        retention = view(task).options["ordering_retention"]
        store = get_store(task.app)
        for pause in (*ADVANCE_PAUSES, None):
            try:
                store.order_advance(key, sequence=sequence, now=time.time(), retention=retention)
                return
            except StoreError as exc:
                if pause is None:
                    logger.error(
                        "Task %s[%s]: ordering key %s not moved past %d (%s); its successors wait until "
                        "ordering_gap_timeout gives this turn up",
                        task.name,
                        task.request.id,
                        key,
                        sequence,
                        exc,
                    )
                    return
                time.sleep(pause)

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        self._advance(task)

    def on_failure(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        self._advance(task)


def gap_record(task: GuardedTask, *, key: str, scoped: str, skipped: OrderState) -> FinalFailure:
    """The dead letter of sequence numbers given up as lost: the task, the key (``ord`` in its header, scoped in
    its message), the numbers (``ord_seq`` the first, ``ord_seq_last`` the last), when their gap opened (its
    first failure) and when it was given up (its last). No arguments, no attempts: no message ever came, so
    there is nothing to replay (a replay is refused, saying so)."""
    first, last = skipped.skipped_from, skipped.skipped_to
    name = f"celery-guardrails:ordering-gap:{scoped}:{first}:{last}:{skipped.skipped_since:.6f}"
    numbers = str(first) if first == last else f"{first} to {last}"
    message = (
        f"sequence number {numbers} of ordering key {scoped} never came: the key's messages waited for it from "
        f"{timestamp(skipped.skipped_since)} and gave it up as lost at {timestamp(skipped.skipped_at)} "
        f"(ordering_gap_timeout); the next message ran"
    )
    return FinalFailure(
        task_name=task.name,
        task_id=f"ordering-gap-{uuid.uuid5(uuid.NAMESPACE_URL, name)}",
        reason=ORDERING_GAP_SKIPPED,
        exc_type="",
        exc_message=message,
        tenant=current_tenant(),
        correlation_id=None,
        attempts=0,
        owner=owner_of(task),
        header={headers.ORDERING_KEY: key, headers.ORDERING_SEQUENCE: first, GAP_LAST: last},
        first_failed_at=timestamp(skipped.skipped_since),
        last_failed_at=timestamp(skipped.skipped_at),
    )
