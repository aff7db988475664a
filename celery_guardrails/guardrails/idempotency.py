"""Idempotency keys, enforced where the effect lands: one claim per key in the store, taken atomically.

* Publish: the key is made from the task's ``idempotency_key`` (a ``str.format`` template over the bound
  arguments, or a callable taking the arguments; per call, the key itself) and checked (every template
  field present, 1 to 200 characters, no whitespace or control characters); a bad one raises
  :class:`~celery_guardrails.exceptions.IdempotencyKeyError` in the caller. It travels in the header, so
  every redelivery, retry and replay carries the same key. ``dedupe_on_publish`` optionally skips publishing a
  key seen within ``dedupe_ttl`` (an optimisation: the claim below is the guarantee).
* Run: the key, scoped by task name and tenant, is claimed in the store (the body reads an opaque key made from
  it, ``self.request.idempotency_key``, to hand downstream: see :mod:`celery_guardrails.runtime.effects`), or was
  claimed by the pop that took its message (:mod:`celery_guardrails.guardrails.pop_claims`):

  - acquired: the body runs; the claim's lease (``idempotency_lease``) is renewed by a heartbeat every third
    of it (the claim itself is the first beat); when the body returns, the key is completed with a short
    result summary (sent at once, its answer read before the ack: the round trip overlaps Celery storing the
    result), a retry or ``RetryLater`` releases it before the new message is published, a final failure
    marks it failed;
  - completed before: the body does not run, ``duplicate_skipped`` fires, the task returns the original's
    result (from the result backend while it keeps it, else the key's summary);
  - failed before: the body does not run, ``duplicate_skipped`` fires, the task fails with
    :class:`~celery_guardrails.exceptions.DuplicateOfFailureError`, so a client waiting on it sees the failure
    (a replay reopens the key deliberately);
  - held by a live delivery: this one comes back later through ``RetryLater`` (no attempt consumed);
  - held by a delivery whose lease ran out (its worker died): this one takes over.

Guarantees. With the Django store and ``atomic=True`` the body runs in ``transaction.atomic()`` and the
completion mark commits in the same transaction as the database effect: it happens exactly once (a delivery
that lost its lease rolls back); on PostgreSQL the key is written with the effect, claimed by the transaction's
first statement (:mod:`celery_guardrails.guardrails.effect_keys`). Otherwise (Redis, or effects outside the
database) a worker that dies after the effect and before the completion mark leaves a window: the next delivery
takes over and runs the body again. Close it with a natural key on the effect or the provider's own idempotency
key (pass it ``self.request.idempotency_key``): a body that hands its key on may also be retried after an
ambiguous failure (:mod:`celery_guardrails.runtime.gate`); a keyed body that does not is retried only before its
first effect.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

from celery.utils.saferepr import saferepr

from celery_guardrails import signals
from celery_guardrails.exceptions import DuplicateOfFailureError, IdempotencyKeyError, RetryLater, StoreError
from celery_guardrails.foundation.context import current_tenant
from celery_guardrails.foundation.redaction import redacted_error
from celery_guardrails.guardrails.acks import ride
from celery_guardrails.guardrails.completion import Completing, complete_alone, complete_when_back, taken_over
from celery_guardrails.guardrails.effect_keys import effect_store, with_the_effect
from celery_guardrails.guardrails.keys import render_key as render_key
from celery_guardrails.guardrails.keys import scoped_key as scoped_key
from celery_guardrails.guardrails.pop_claims import adopt
from celery_guardrails.guardrails.retries import retry_later
from celery_guardrails.options import APP, CALL, TASK, Option, checks, declare, resolve
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import Completion, HeldKey, Hold, RidingCompletion, delivery, view
from celery_guardrails.runtime.heartbeats import Heartbeats as Heartbeats
from celery_guardrails.runtime.heartbeats import delivery_owner as delivery_owner
from celery_guardrails.runtime.heartbeats import heartbeat as heartbeat
from celery_guardrails.runtime.outcomes import BAD_IDEMPOTENCY_KEY, attempt_record, fail_finally
from celery_guardrails.runtime.pipeline import Guardrail, Publication, SkipBody, SkipPublish
from celery_guardrails.scheduling.ledger import period_key
from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import ACQUIRED, BUSY, COMPLETED, FAILED, Claim, Store

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)

SUMMARY_MAX_LENGTH = 200


#: The options idempotency reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="idempotency_key",
        default=None,
        doc="str.format template over the task's bound arguments ('charge:{order_id}'), or a callable "
        "taking the task's arguments; per call, the key itself. Scoped by task name and tenant.",
        check=checks.key_spec,
        scopes=frozenset({CALL, TASK}),
    ),
    Option(
        name="idempotency_lease",
        default=60.0,
        doc="Seconds a claim lives without a heartbeat; a running task renews it every third of it. A "
        "delivery whose worker died is taken over this long after its last heartbeat.",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="idempotency_retention",
        default=7 * 24 * 3600.0,
        doc="Seconds a completed or failed key is kept (7 days): duplicates within it are skipped.",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="atomic",
        default=False,
        doc="Django store, keyed tasks: run the body in transaction.atomic() and commit the completion mark in "
        "the same transaction as the effect (exactly once for database effects). Without an idempotency_key it "
        "does nothing (audit GA203).",
        check=checks.boolean,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="dedupe_on_publish",
        default=False,
        doc="An optimisation, not the guarantee: do not publish a message whose key was published within "
        "dedupe_ttl; return the first one's AsyncResult instead.",
        check=checks.boolean,
        scopes=frozenset({CALL, TASK}),
    ),
    Option(
        name="dedupe_ttl",
        default=3600.0,
        doc="Seconds dedupe_on_publish remembers a published key.",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
)


def _summary(retval: Any) -> str:
    if retval is None or type(retval) in (int, bool, float):  # most tasks: saferepr's walk would cost more
        return repr(retval)[:SUMMARY_MAX_LENGTH]
    summary: str = saferepr(retval, SUMMARY_MAX_LENGTH)
    return summary[:SUMMARY_MAX_LENGTH]


def original_task_id(owner: str) -> str:
    """The task id of the delivery that completed or failed a key (its owner names it), or ""."""
    # hostname:pid:task id:delivery number; a task id may hold ":" itself
    parts = owner.split(":", 2)
    return parts[2].rpartition(":")[0] if len(parts) == 3 else ""


def original_result(task: Any, original: str, summary: str) -> Any:
    """What a duplicate of a completed key returns: the original's result, while the result backend keeps it;
    else the summary the key keeps (a repr of it, at most SUMMARY_MAX_LENGTH characters)."""
    if not original:
        return summary
    try:
        result = task.AsyncResult(original)
        if result.state == "SUCCESS":
            return result.result
    except Exception:  # a backend that cannot be read (or none): the summary says what it was
        logger.info("Task %s: the result of %s could not be read; returning its summary", task.name, original)
    return summary


def holder_gone(holder: str, request: Any, header: Mapping[str, Any]) -> bool:
    """Whether the delivery holding a claim is known to be over: it gave up without releasing (an earlier
    delivery of this message, named in its header), or it ran in a process of this worker that no longer exists
    (SIGKILLed, its pool child replaced). Unknown: False, and its lease decides. Only this worker's own processes
    are judged (its full node name): another worker of the same host name may live in another PID namespace
    (a container), where a pid seen missing here is alive."""
    if holder in header.get(headers.GAVE_UP, ()):
        return True
    node, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if not pid.isdigit() or not request.hostname or node != str(request.hostname):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, someone else's
        return False
    return False


def claim_key(
    task: GuardedTask, store: Store, scoped: str, *, owner: str, header: Mapping[str, Any], now: float
) -> tuple[Claim, bool]:
    """Claim ``scoped`` for this delivery, taking it over at once from a holder known to be over; returns the
    claim and whether it was such a takeover."""
    options = view(task).options
    claim_it = functools.partial(
        store.claim,
        scoped,
        owner=owner,
        now=now,
        lease=options["idempotency_lease"],
        retention=options["idempotency_retention"],
        atomic=bool(options["atomic"]),
    )
    claim = claim_it()
    gone = claim.state == BUSY and holder_gone(claim.owner, task.request, header)
    if gone:  # an earlier delivery that is known to be over: no need to wait out its lease
        claim = claim_it(replaces=claim.owner)
    elif claim.state == FAILED and claim.owner and header.get(headers.REPLAY_OF) == original_task_id(claim.owner):
        # The replay of the run that failed the key: its dead letter was durable (and replayed) before that run
        # wrote the key failed, so the replay's own reopen found nothing to reopen. Reopened now, as it meant.
        logger.info(
            "Task %s[%s]: key %s reopened for the replay of %s", task.name, task.request.id, scoped, claim.owner
        )
        store.reopen(scoped)
        claim = claim_it()
    return claim, gone


def _raise(error: BaseException) -> bool:
    raise error


def _taken_over(task: GuardedTask, key: str) -> None:
    taken_over(task.name, str(task.request.id), key)


def _wait_for_holder(task: GuardedTask, scoped: str, claim: Claim, *, now: float, until: float) -> NoReturn:
    """Held by another delivery: look again soon, then less and less often (retry_later_delay doubling), never
    later than just after its lease would run out if its worker has died. A wait behind a live lease spends no
    attempt and not retry_later_max (each wait is bounded by the holder's lease)."""
    header = view(task).header
    wait = RetryLater(f"idempotency key {scoped} is held by another delivery ({claim.owner or 'a transaction'})")
    soon = view(task).options["retry_later_delay"] * 2 ** min(headers.counter(header, headers.BUSY), 16)
    delay = max(0.1, min(soon, until - now + 0.5))
    retry_later(task, wait, delay=delay, rule="idempotency:busy", counter=headers.BUSY)


class Idempotency(Guardrail):
    """Makes, carries and enforces idempotency keys."""

    def on_publish(self, task: GuardedTask, publication: Publication) -> None:
        header = publication.header
        if headers.IDEMPOTENCY_KEY not in header:  # a retry or replay keeps the key it was published with
            spec = resolve(task, "idempotency_key", publication.call)
            if spec is None:
                return
            header[headers.IDEMPOTENCY_KEY] = render_key(task, spec, publication.args, publication.kwargs)
        # A replay is published on purpose under a new task id: never taken for a duplicate of its original.
        replay = headers.REPLAY_OF in header
        if resolve(task, "dedupe_on_publish", publication.call) and publication.task_id and not replay:
            key = scoped_key(task.name, header.get(headers.TENANT), header[headers.IDEMPOTENCY_KEY])
            earlier = get_store(task.app).reserve_publish(
                key, task_id=publication.task_id, ttl=resolve(task, "dedupe_ttl", publication.call)
            )
            if earlier is not None and earlier != publication.task_id:
                logger.info("Not publishing %s: key %s was published as %s", task.name, key, earlier)
                raise SkipPublish(earlier)

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = task.request
        options = view(task).options
        header = view(task).header
        key = header.get(headers.IDEMPOTENCY_KEY)
        if key is None and headers.SCHEDULE in header and headers.PERIOD in header:
            key = period_key(header[headers.SCHEDULE], header[headers.PERIOD])  # scheduled work: one run a period
        if key is None:  # published without the extension (send_task, plain Celery): make it here
            spec = options["idempotency_key"]
            if spec is None:
                return
            try:
                key = render_key(task, spec, args, kwargs)
            except IdempotencyKeyError as exc:
                fail_finally(
                    task,
                    exc,
                    reason=BAD_IDEMPOTENCY_KEY,
                    history=[attempt_record(task, kind="permanent", rule="idempotency_key", exc=exc)],
                )
        scoped = scoped_key(task.name, current_tenant(), key)
        delivery(task).key = scoped  # the body reads an opaque key made from it (celery_guardrails.runtime.effects)
        store = get_store(task.app)
        adopted = adopt(task, scoped, store)  # the owner of the claim its message's pop made (guardrails.pop_claims)
        if adopted is not None and delivery(task).claim is not None:
            return  # held since the pop: no round trip
        owner = adopted or delivery_owner(request)
        if with_the_effect(task, store):  # claimed as its body's transaction begins (guardrails.effect_keys)
            delivery(task).claim = HeldKey(key=scoped, owner=owner, with_the_effect=True)
            return
        self._claim(task, store, scoped, owner)

    def _claim(self, task: GuardedTask, store: Store, scoped: str, owner: str) -> None:
        """Claim ``scoped`` apart from the body; raises what ends the delivery unless it was acquired."""
        request = task.request
        header = view(task).header
        now = time.time()
        claim, gone = claim_key(task, store, scoped, owner=owner, header=header, now=now)
        if claim.state == ACQUIRED:
            if claim.takeover:
                logger.warning(
                    "Task %s[%s]: took over key %s from a delivery %s",
                    task.name,
                    request.id,
                    scoped,
                    "that is over (it gave up, or its process is gone)" if gone else "whose lease ran out",
                )
            state = delivery(task)
            state.claim = HeldKey(key=scoped, owner=owner)
            state.holds.append(Hold(owner, lambda: store.release(scoped, owner=owner)))
            return
        if claim.state in (COMPLETED, FAILED):
            logger.info(
                "Task %s[%s]: key %s already %s; not running it again", task.name, request.id, scoped, claim.state
            )
            signals.duplicate_skipped.send(
                sender=task, task_id=request.id, key=scoped, state=claim.state, summary=claim.summary
            )
            original = original_task_id(claim.owner)
            if claim.state == COMPLETED:
                raise SkipBody(original_result(task, original, claim.summary))
            # A client waiting on the duplicate sees the original's failure (its dead letter is the record).
            delivery(task).ended = "duplicate"
            raise DuplicateOfFailureError(scoped, original, claim.reason)
        _wait_for_holder(task, scoped, claim, now=now, until=claim.lease_until)

    def body_context(self, task: GuardedTask) -> AbstractContextManager[Any] | None:
        claim = delivery(task).claim
        if claim is None:
            return None
        return self._claimed(task, claim.key, claim.owner)

    @contextmanager
    def _claimed(self, task: GuardedTask, key: str, owner: str) -> Iterator[None]:
        options = view(task).options
        store = get_store(task.app)
        state = delivery(task)
        retention = options["idempotency_retention"]
        lease = options["idempotency_lease"]
        if not options["atomic"]:
            with heartbeat(store, key, owner, lease=lease):
                yield
            # The body returned: its effect happened, so the key is completed now, whatever Celery does with
            # the result (or with the ack, in one step, when nothing waits between: guardrails.acks). The answer
            # is read in on_success / on_failure, before the ack; a store that cannot take it now is asked again
            # there (never a reason to run the body again).
            summary = _summary(state.retval)
            state.forget(owner)  # the key is being completed: a later re-publish must not release it
            riding = functools.partial(
                RidingCompletion,
                key=key,
                owner=owner,
                summary=summary,
                retention=retention,
                settle=functools.partial(complete_alone, self._completing(task, key, owner, summary)),
                lost=functools.partial(taken_over, task.name, str(task.request.id), key),
            )
            if ride(task, state, riding):
                return  # completed with the ack, after every success hook (celery_guardrails.guardrails.acks)
            try:
                wait = store.begin_complete(key, owner=owner, now=time.time(), summary=summary, retention=retention)
            except StoreError as exc:
                wait = functools.partial(_raise, exc)
            state.completion = Completion(key=key, answer=wait)
            return
        held = state.claim
        if held is not None and held.with_the_effect:
            state.claim = None  # nothing held until the key is written
            with effect_store(store).written_with_the_effect(key, owner=owner, now=time.time()) as claim:
                if claim is not None and claim.state == ACQUIRED:
                    state.claim = held  # a final failure of the body writes it failed (on_failure)
                    yield  # the body, in the transaction that wrote its key completed
            if claim is not None and claim.state == ACQUIRED:
                state.claim = None  # committed: completed with the effect
                return
            if claim is not None:  # another delivery's transaction is writing it now: no lease to wait out
                _wait_for_holder(task, key, claim, now=time.time(), until=math.inf)
            self._claim(task, store, key, owner)  # the key exists: claimed the usual way (raises unless held)
        with heartbeat(store, key, owner, lease=lease):
            from django.db import DatabaseError, transaction

            from celery_guardrails.stores.database import failure

            committing = False
            try:
                with transaction.atomic():
                    yield
                    # The completion mark commits with the effect, or neither does (a store error here rolls
                    # the effect back, and the delivery comes back later to do both).
                    summary = _summary(state.retval)
                    done = store.complete(key, owner=owner, now=time.time(), summary=summary, retention=retention)
                    if not done:
                        _taken_over(task, key)
                        raise IdempotencyKeyError(f"lost the claim on {key} before committing; rolled back")
                    committing = True
            except DatabaseError as exc:
                if not committing:  # the body's own database error: classified like any other failure
                    raise
                # The commit failed: nothing was kept, as when the store's own write fails.
                raise failure("commit the effect with its completion", exc) from exc
            state.claim = None
            state.forget(owner)

    def _completed(self, task: GuardedTask) -> bool:
        """Settle the completion started as the body returned (durable before the ack); whether there was one.

        A store that cannot answer is asked again, a little later each time, for as long as the claim's lease:
        the effect happened, and a completion that never lands would let a duplicate run it again after the
        lease. The worker waits meanwhile (so does the ack).
        """
        state = delivery(task)
        pending = state.completion
        if pending is None:
            if state.riding is None:
                return False
            state.claim = None  # completed with the ack (celery_guardrails.guardrails.acks), after this hook
            return True
        state.completion = None
        owner = state.claim.owner if state.claim else ""
        state.claim = None
        try:
            done: bool | None = pending.answer()
        except StoreError as exc:
            done = complete_when_back(self._completing(task, pending.key, owner, _summary(state.retval)), exc)
        if done is False:
            _taken_over(task, pending.key)
        return True

    @staticmethod
    def _completing(task: GuardedTask, key: str, owner: str, summary: str) -> Completing:
        """The completion of ``key`` made on its own, should it be (read now: it may be made after the delivery)."""
        options = view(task).options
        return Completing(
            store=get_store(task.app),
            key=key,
            owner=owner,
            summary=summary,
            retention=options["idempotency_retention"],
            lease=options["idempotency_lease"],
            task_name=task.name,
            task_id=str(task.request.id),
        )

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        self._completed(task)

    def on_failure(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        # The body returned but Celery failed afterwards (its result could not be stored): the key stays
        # completed, since the effect happened and running it again would repeat it.
        if self._completed(task):
            return
        state = delivery(task)
        claim, state.claim = state.claim, None
        if claim is not None:
            key, owner = claim.key, claim.owner
            state.forget(owner)
            store = get_store(task.app)
            reason = redacted_error(task, exc, keep=200)  # kept in the key's row: redacted
            if claim.with_the_effect:  # rolled back with the effect: written failed now
                effect_store(store).fail_with_the_effect(key, owner=owner, now=time.time(), reason=reason)
                return
            retention = view(task).options["idempotency_retention"]
            store.fail(key, owner=owner, now=time.time(), reason=reason, retention=retention)
