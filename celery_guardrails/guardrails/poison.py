"""Poison messages: a message that kills its worker again and again is dead-lettered, not looped.

Only a redelivered message (``delivery_info["redelivered"]``: the broker gave it back because its worker
died holding it; first deliveries cost nothing) counts its starts in the store; the count is cleared when
a run ends (success, final failure, or a retry after the body ran), and kept when the message is only put
off before its body ran (a wait behind its own earlier delivery's claim, a deferral, a store outage). A
message redelivered more than ``max_deliveries`` times without its run ever ending is not run again: it is
dead-lettered with reason ``poison`` and the worker goes on with the queue. A keyed one does not wait out
the lease of the claim its dead delivery left: a holder whose process on this host is gone is taken over at
once (:func:`celery_guardrails.guardrails.idempotency.holder_gone`), and once the dead letter is recorded the key
is marked failed (a replay reopens it), not left claimed by a delivery that will never end.

On a RabbitMQ quorum queue the broker counts for itself: a redelivered message carries ``x-delivery-count``
(how many times it was delivered before and given back). There that count is the poison counter, with no store
write (and no store needed to stop a poison message); a message put off before its body ran carries its count to
the message that replaces it (header ``redeliv``), as the store's count is kept for it elsewhere. The broker
counts every delivery given back, a message prefetched by a worker that was killed before it started included:
a message can be dead-lettered poison sooner there than where the store counts starts only.

For the worker to give such a message back, ``GuardedTask`` acks late and rejects on a lost worker
(``acks_late``, ``reject_on_worker_lost``); with Redis the broker gives it back after the transport's
``visibility_timeout`` (see the README).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from celery_guardrails.broker.delays import delivery_count
from celery_guardrails.exceptions import IdempotencyKeyError, PoisonMessageError, StoreError
from celery_guardrails.foundation.context import current_tenant
from celery_guardrails.guardrails.idempotency import claim_key, original_task_id
from celery_guardrails.guardrails.keys import render_key, scoped_key
from celery_guardrails.options import APP, TASK, Option, checks, declare
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import ATTRIBUTE, Delivery, delivery, view
from celery_guardrails.runtime.heartbeats import delivery_owner
from celery_guardrails.runtime.outcomes import POISON, attempt_record, fail_finally
from celery_guardrails.runtime.pipeline import Guardrail, Publication
from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import ACQUIRED, BUSY

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)

#: Seconds a start count is kept (a message not seen again for a day starts counting afresh).
COUNT_TTL = 24 * 3600


#: The options poison-message protection reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="max_deliveries",
        default=3,
        doc="Redeliveries of a message that started and never finished (its worker died) before it is "
        "dead-lettered as poison instead of run again.",
        check=checks.positive_int,
        scopes=frozenset({TASK, APP}),
    ),
)


def fail_abandoned(task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any], *, reason: str) -> None:
    """Mark failed the key a message's dead deliveries left claimed, when the message is dead-lettered before
    it could claim (a poison message): left claimed, the key would say a run is still going, and a copy of the
    message would wait on it. A key held by a live delivery (another copy), completed or failed is left as it
    is. Raises StoreError like any claim."""
    request = task.request
    header = view(task).header
    key = header.get(headers.IDEMPOTENCY_KEY)
    if key is None:
        spec = view(task).options["idempotency_key"]
        if spec is None:
            return
        try:
            key = render_key(task, spec, args, kwargs)
        except IdempotencyKeyError:
            return
    scoped = scoped_key(task.name, current_tenant(), key)
    store = get_store(task.app)
    owner = delivery_owner(request)
    claim, _ = claim_key(task, store, scoped, owner=owner, header=header, now=time.time())
    if claim.state == BUSY and original_task_id(claim.owner) == request.id:
        # Held by an earlier delivery of this very message, on another worker (holder_gone judges only this
        # worker's processes): it is the message being dead-lettered, so that delivery is taken to be over.
        options = view(task).options
        claim = store.claim(
            scoped,
            owner=owner,
            now=time.time(),
            lease=options["idempotency_lease"],
            retention=options["idempotency_retention"],
            replaces=claim.owner,
        )
    if claim.state == ACQUIRED:
        retention = view(task).options["idempotency_retention"]
        store.fail(scoped, owner=owner, now=time.time(), reason=reason[:200], retention=retention)


class PoisonMessages(Guardrail):
    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = task.request
        state = delivery(task)
        redelivered = bool((request.delivery_info or {}).get("redelivered"))
        counted_by_broker = delivery_count(request)
        if counted_by_broker is not None:
            # A quorum queue's own count of this message's earlier deliveries, plus those of the messages it
            # replaces (put off before their body ran): nothing to write, nothing to clear. Only a redelivery's
            # count is the broker's: on a first delivery the header can only be a publisher's, not trusted.
            carried = headers.counter(view(task).header, headers.REDELIVERIES)
            starts = state.broker_starts = carried + (counted_by_broker if redelivered else 0)
            if not redelivered:
                return
        elif redelivered:
            starts = get_store(task.app).count_delivery(request.id, ttl=COUNT_TTL)
            state.counted = True
        else:
            return
        limit = view(task).options["max_deliveries"]
        if starts > limit:
            # The count stays: should this message come back once more (its ack lost), it is refused at once.
            state.counted = False
            error = PoisonMessageError(task.name, request.id, starts)
            record = attempt_record(task, kind="permanent", rule="max_deliveries", exc=error)
            try:
                fail_finally(task, error, reason=POISON, history=[record])
            except PoisonMessageError:
                # fail_finally raises the error itself once the dead letter is recorded (a Retry or a Reject
                # otherwise): the key its dead deliveries left claimed is failed, not left held
                try:
                    fail_abandoned(task, args, kwargs, reason=f"{POISON}: {error}")
                except StoreError as exc:  # the record stands; the claim's lease runs out on its own
                    logger.warning(
                        "Task %s[%s]: key of a poison message not marked failed: %s", task.name, request.id, exc
                    )
                raise

    def on_publish(self, task: GuardedTask, publication: Publication) -> None:
        # Only a re-publish of the running delivery (a retry, a wait) carries or drops the broker's count.
        state: Delivery | None = getattr(task.request, ATTRIBUTE, None)
        if state is None or not state.republishing:
            return
        if state.body_ran:  # the run ended: the next message counts afresh
            publication.header.pop(headers.REDELIVERIES, None)
        elif state.broker_starts is not None:
            publication.header[headers.REDELIVERIES] = state.broker_starts
        # else: a first delivery (the broker counted nothing yet) put off again keeps the count it carries

    def _clear(self, task: GuardedTask) -> None:
        state = delivery(task)
        if state.counted:
            state.counted = False
            get_store(task.app).clear_delivery(task.request.id)

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        self._clear(task)

    def on_failure(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        self._clear(task)

    def on_retry(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        # Put off before its body ran (a wait behind another delivery's claim, a budget deferral, a store
        # outage): nothing finished, so the count of starts that never finished stands.
        if delivery(task).body_ran:
            self._clear(task)
