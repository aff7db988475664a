"""The claim with the pop: where the guardrails store is the broker's own Redis, the script that takes a keyed
message from its queue also claims its idempotency key, so a keyed delivery makes no round trip of its own before
its body. With its completion riding the ack (:mod:`celery_guardrails.guardrails.acks`), a keyed task whose
results are ignored makes the Redis round trips of an unkeyed one.

How. The publisher renders the key into the message's header (``idem``). The pop script
(:mod:`celery_guardrails.broker.atomic_pop`, through its :class:`~celery_guardrails.broker.atomic_pop.PopHook`)
reads the task name, the tenant and the key from the message it takes and claims ``task:tenant:key`` with the
store's own claim (one Lua text of the rule, ``CLAIM_FUNCTION``), with the shortest lease of the keyed tasks
(:func:`pop_lease`) and the app's retention, for an owner minted by the consumer as
:func:`~celery_guardrails.runtime.heartbeats.delivery_owner` mints one (``hostname:pid:task id:delivery
number``). Only an acquired claim is kept: a key completed, failed or held by another delivery is left for the
task to claim and answer as it always does. The delivery adopts the claim as it starts (:class:`ClaimOnPop`,
before any guardrail can end it): it is one of its holds from then on, released before a re-publish, and
Idempotency completes or fails it as any claim.

Why it is sound:

* The task checks what the pop claimed: a claim of another scoped key (a header the worker sanitises differently,
  a tenant it drops) is released, and the key is claimed the usual way; one made with another lease than the
  task's own ``idempotency_lease`` is asked for again under its owner, with the task's lease (one round trip, as
  without the pop's claim).
* A claim is taken as this delivery's without asking only for a third of its lease, less a second for the clocks
  of other workers (the store measures them to the second), after the pop: a message that waited longer (behind
  other tasks of a threads pool, at a rate limit) asks the store again under the same owner, which answers
  "acquired" only while no other delivery took the key over. Its first renewal comes a third of the lease after
  the body starts, as for any claim.
* A delivery that ends before a guardrail adopted its claim (revoked, expired, an unknown task, a body that cannot
  be decoded, given back at shutdown) has it released as the worker acks, rejects or restores its message; one
  that its guardrails end before Idempotency looks (a wait, a refusal, a dead letter) releases it with its holds,
  or in its last hook. A claim nobody releases (a worker killed after the pop) is taken over as any other: at once
  by a delivery that sees its process gone, else when its lease runs out.
* A message with an ETA or a countdown is not claimed at the pop: it waits in the worker's memory first.

Only the solo and threads pools, where the task runs in the process that pops its message (a prefork child cannot
see what its parent's pop kept), with the atomic pop and a Redis store on the broker's database (the test of
:func:`~celery_guardrails.guardrails.acks.shared_records`). ``claim_on_pop=False`` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from celery_guardrails.broker import atomic_pop
from celery_guardrails.guardrails.acks import shared_records
from celery_guardrails.guardrails.keys import STORED_MAX_LENGTH
from celery_guardrails.options import APP, Option, app_value, checks, declare
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import HeldKey, Hold, PopClaim, delivery, view
from celery_guardrails.runtime.heartbeats import delivery_number
from celery_guardrails.runtime.pipeline import Guardrail
from celery_guardrails.stores import get_store
from celery_guardrails.stores.redis_idempotency import CLAIM_FUNCTION, IDEM_PREFIX

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)

DECLARED = declare(
    Option(
        name="claim_on_pop",
        default=True,
        doc="Where the guardrails store is the broker's own Redis (solo and threads pools with broker_atomic_pop), "
        "a keyed message's idempotency key is claimed by the script that takes the message from its queue: no "
        "round trip of its own before the body. False: claimed as the task starts. See "
        "celery_guardrails.guardrails.pop_claims.",
        check=checks.boolean,
        scopes=frozenset({APP}),
    ),
)

#: The app attribute holding its worker's :class:`Claims` (set by :func:`enable` beside the transport option).
ATTRIBUTE = "guardrails_pop_claims"
#: Seconds taken off the time a claim is trusted, for the clocks of other workers.
CLOCK_MARGIN = 1.0
#: Claims kept at most for deliveries not yet started: past it (a delivery lost on the way between the pop and the
#: worker, kept until its ack), the oldest are released.
KEPT_MAX = 10_000

#: ``after_pop`` for :data:`~celery_guardrails.broker.atomic_pop.POP_LOOP`. ARGV[2..9]: the owner's prefix
#: (``hostname:pid:``), its delivery number, the lease's end, the retention, the store's key prefix, the longest
#: scoped key, the guardrails header's name, the time (the lease's end and the time on the server's clock, as the
#: store's own claims have them: :meth:`Claims.arguments`). Answers {scoped key, owner, takeover} for an acquired
#: claim, else nil.
STEP = (
    CLAIM_FUNCTION
    + """
local function after_pop(message)
  local fields = message['headers']
  if type(fields) ~= 'table' then return nil end
  local guard, task, id = fields[ARGV[8]], fields['task'], fields['id']
  if type(guard) ~= 'table' or type(task) ~= 'string' or type(id) ~= 'string' then return nil end
  if type(fields['eta']) == 'string' then return nil end
  local key, tenant = guard['idem'], guard['tenant']
  if tenant == nil or tenant == '' then tenant = '-' end
  if type(key) ~= 'string' or key == '' or type(tenant) ~= 'string' then return nil end
  local scoped = task .. ':' .. tenant .. ':' .. key
  if #scoped > tonumber(ARGV[7]) then return nil end
  local owner = ARGV[2] .. id .. ':' .. ARGV[3]
  local answer = claim(ARGV[6] .. scoped, owner, ARGV[9], ARGV[4], ARGV[5], '')
  if answer[1] ~= 'acquired' then return nil end
  return {scoped, owner, answer[2]}
end
"""
)


class Claims:
    """The consumer's side (the :class:`~celery_guardrails.broker.atomic_pop.PopHook`): the arguments of each pop,
    and the claims the pops made for deliveries not yet started, by delivery tag."""

    def __init__(self, *, store: Any, hostname: str, lease: float, retention: float) -> None:
        self.store = store
        self.hostname = hostname
        self.lease = float(lease)
        self.retention = int(retention)
        self.script = STEP + atomic_pop.POP_LOOP
        #: Seconds after the pop a claim is trusted without asking (none when the lease is that short).
        self.trusted_for = max(0.0, self.lease / 3 - CLOCK_MARGIN)
        self.kept: dict[str, PopClaim] = {}

    def arguments(self) -> list[Any]:
        prefix = f"{self.hostname}:{os.getpid()}:"
        number = delivery_number()
        now = self.store.server_now()
        lease_until = f"{now + self.lease:.6f}"
        return [prefix, number, lease_until, self.retention, IDEM_PREFIX, STORED_MAX_LENGTH, headers.HEADER, repr(now)]

    def popped(self, tag: str, answer: list[str]) -> None:
        key, owner, takeover = answer[:3]
        claim = PopClaim(
            key=key,
            owner=owner,
            takeover=takeover == "1",
            trusted_until=time.monotonic() + self.trusted_for,
        )
        earlier = self.kept.get(tag)
        if earlier is not None:  # the same message popped again before it started here: the first is over
            self.release(earlier)
        if len(self.kept) >= KEPT_MAX:
            for stale in list(self.kept)[: KEPT_MAX // 10]:
                self.release(self.kept.pop(stale))
        self.kept[tag] = claim

    def take(self, tag: str) -> PopClaim | None:
        """The claim the pop made for delivery ``tag``, handed to it once."""
        return self.kept.pop(tag, None)

    def ended(self, tag: str) -> None:
        claim = self.kept.pop(tag, None)
        if claim is not None:  # the delivery never started here: its claim is let go
            self.release(claim)

    def release(self, claim: PopClaim) -> None:
        """Let ``claim`` go (never raises: a claim that could not be released lapses with its lease)."""
        try:
            self.store.release(claim.key, owner=claim.owner)
        except Exception as exc:
            logger.warning("Key %s claimed by %s as it was popped not released (%s)", claim.key, claim.owner, exc)


def runs_where_it_pops(pool: Any) -> bool:
    """Whether the worker pool ``pool`` (its class, or a name Celery knows) runs each task in the process that pops
    its message: solo and threads (and pools derived from them)."""
    from celery import concurrency
    from celery.concurrency.solo import TaskPool as Solo
    from celery.concurrency.thread import TaskPool as Threads

    try:
        found = concurrency.get_implementation(pool) if isinstance(pool, str) else pool
    except Exception:  # a name Celery does not know: not judged one of them
        return False
    return isinstance(found, type) and issubclass(found, Solo | Threads)


def enable(app: Any, *, hostname: str, pool: Any) -> bool:
    """Worker start-up: claim with the pop where it is sound (see the module docstring); whether it does."""
    options = {**(app.conf.broker_transport_options or {})}
    options.pop(atomic_pop.HOOK_OPTION, None)
    app.conf.broker_transport_options = options
    setattr(app, ATTRIBUTE, None)
    if not runs_where_it_pops(pool) or not app_value(app, "claim_on_pop"):
        return False
    store: Any = get_store(app)
    if shared_records(app, store) is None:
        return False
    found = Claims(
        store=store,
        hostname=hostname,
        lease=pop_lease(app),
        retention=app_value(app, "idempotency_retention"),
    )
    options[atomic_pop.HOOK_OPTION] = found  # the channels' (kombu hands a channel its transport options)
    setattr(app, ATTRIBUTE, found)  # the tasks': read with every delivery, an attribute, not the app's conf
    return True


def pop_lease(app: Any) -> float:
    """The lease a pop claims with: the shortest of the keyed tasks' ``idempotency_lease`` (the app's when none is
    keyed), so that a claim left by a worker killed after its pop never outlives the lease of its task. A task
    whose lease is longer asks again under the pop's owner as it starts."""
    from celery_guardrails.options import resolve
    from celery_guardrails.runtime.pipeline import is_guarded

    leases = [
        float(resolve(task, "idempotency_lease", {}))
        for task in app.tasks.values()
        if is_guarded(task) and resolve(task, "idempotency_key", {}) is not None
    ]
    return min(leases, default=float(app_value(app, "idempotency_lease")))


def claims(app: Any) -> Claims | None:
    """The claims with the pop of ``app``'s worker, when its pops claim."""
    found: Claims | None = getattr(app, ATTRIBUTE, None)
    return found


def adopt(task: GuardedTask, scoped: str, store: Any) -> str | None:
    """The owner of the claim its message's pop made for this delivery, when it is a claim of ``scoped`` in
    ``store``: held (``delivery(task).claim`` set) while it is trusted and was made with the task's lease, else to
    be asked again under that owner (which sets the task's lease). None: no such claim (one of another key or
    store is released here)."""
    state = delivery(task)
    popped, state.popped = state.popped, None
    if popped is None:
        return None
    found = claims(task.app)
    if found is None or found.store is not store or popped.key != scoped:
        _let_go(task, popped)
        return None
    if popped.takeover:
        logger.warning(
            "Task %s[%s]: took over key %s as its message was popped, from a delivery whose lease ran out",
            task.name,
            task.request.id,
            scoped,
        )
    if popped.trusted_until > time.monotonic() and found.lease == view(task).options["idempotency_lease"]:
        state.claim = HeldKey(key=scoped, owner=popped.owner)
    else:  # asked again under its owner (the hold is made anew then)
        state.forget(popped.owner)
    return popped.owner


def _let_go(task: GuardedTask, popped: PopClaim) -> None:
    state = delivery(task)
    if not any(hold.owner == popped.owner for hold in state.holds):
        return  # let go already, with the holds of a re-publish
    state.forget(popped.owner)
    found = claims(task.app)
    if found is not None:
        logger.info("Task %s[%s]: key %s claimed as it was popped, let go", task.name, task.request.id, popped.key)
        found.release(popped)


class ClaimOnPop(Guardrail):
    """Adopts the claim its message's pop made, first of all: every path that ends the delivery lets it go."""

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        found = claims(task.app)
        if found is None:
            return
        tag = (getattr(task.request, "properties", None) or {}).get("delivery_tag")
        popped = found.take(tag) if isinstance(tag, str) else None
        if popped is None:
            return
        state = delivery(task)
        state.popped = popped
        state.holds.append(Hold(popped.owner, functools.partial(found.release, popped)))

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        self._unadopted(task)

    def on_failure(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        self._unadopted(task)

    def on_retry(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        self._unadopted(task)

    @staticmethod
    def _unadopted(task: GuardedTask) -> None:
        # Idempotency never looked at it (a guardrail before it ended the delivery, or none is in the pipeline).
        popped = delivery(task).popped
        if popped is not None:
            delivery(task).popped = None
            _let_go(task, popped)


__all__ = ["DECLARED", "ClaimOnPop", "Claims", "adopt", "claims", "enable", "pop_lease", "runs_where_it_pops"]
