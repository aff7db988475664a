"""Per-key concurrency limits and mutual exclusion, enforced cluster-wide by the store, with a reaper.

* ``concurrency_key`` (a ``str.format`` template over the task's bound arguments and ``{tenant}``, the
  message's tenant; or a callable taking the task's arguments) with ``concurrency_limit=N``: at most N
  deliveries of tasks whose key renders the same run at once, across every worker. Keys are not scoped by
  task name: tasks that name one key (``"tenant:{tenant}"``, ``"payments-api"``) share its slots.
  ``exclusive_key``: the same with a limit of one (two jobs never act on one entity at once). Both may be
  set on one task: two slots, the concurrency slot taken first, released in reverse order.
* Publish: each key is rendered and checked (the rules of idempotency keys); a bad one raises
  :class:`~celery_guardrails.exceptions.ConcurrencyKeyError` in the caller; a key without a limit raises
  :class:`~celery_guardrails.exceptions.ConfigurationError`.
* Run: the key is rendered again (on the worker, as the message's tenant) and a slot asked of the store. Each
  such capacity check is one atomic step (a Lua script; a transaction under the key's row lock): it first
  reaps the holders whose heartbeat is older than ``concurrency_reap_after`` (each recorded as failed with
  reason ``lost``, ``holder_reaped`` sent, counted), then counts the live holders and takes a slot when one is
  free. No count is cached anywhere, so there is none to invalidate.

  - acquired: the body runs; the shared heartbeat thread renews the slot every quarter of the ceiling (at
    most every :data:`BEAT_MAX` seconds); the slot is released as the body ends, before a retry is published
    (inside a database transaction, the Django store's release waits for the transaction to end: the retry's
    re-publish, or the success or failure hook, releases it);
  - all taken: the delivery comes back later through ``RetryLater`` without spending an attempt. Waits are
    counted apart (header ``slot_wait``) and spend no ``retry_later_max`` for the first
    ``concurrency_max_waits``; past them each wait counts toward ``retry_later_max``, so a key that never
    frees ends in a final failure ``retry_later_exhausted``, not in a loop. The delay starts at
    ``retry_later_delay`` and doubles with each wait (at most 16 times it, half of it random), never later
    than the moment the oldest holder would be reaped;
  - the store cannot be reached: :class:`~celery_guardrails.exceptions.StoreUnavailableError`, and
    ``GuardedTask`` publishes the message again later, no attempt spent (a slot taken before is released).
* The reaper also runs on a timer: the watchdog's bootstep thread in every worker calls :func:`reap` every
  ``watchdog_interval`` seconds (each key reaped with the ceiling its last capacity check used).
* Fencing. A holder is reaped when silent past the ceiling, and a process that is only stopped (SIGSTOP, a
  paused VM) is silent too: it may resume after its slot was given away. The grant is this delivery's own (the
  holder id is unique per delivery; a reaped holder is never renewed: the store's set of live holders is the
  token, which a limit of N, where N grants are legitimate at once, needs rather than "the newest wins"), and
  :func:`fence` checks it at the body's boundaries: before the body, at each ``effect()`` block, each checkpoint
  save, in the Django effect helpers, and before the completion. A slot confirmed (acquired, beaten, checked)
  less than half the ceiling ago is taken as held without a round trip; else the check is a heartbeat, which
  says whether the holder still holds it. Where an effect lands inside a database transaction (Django store) the
  check is always the store's: its UPDATE locks the slot's row until the commit and the reaper skips locked
  rows, so no reap lands between the check and the commit. A reaped holder gets
  :class:`~celery_guardrails.exceptions.SlotLostError` (logged, ``holder_fenced`` sent); classified as a wait
  through the retry gate, its message comes back later under the limit when that is safe (the body never
  started, or the gate's rules: no effect before, an atomic body rolled back), else it is a final failure
  ``not_idempotent``. A body that returned outside a transaction has had its effects: its lost slot is
  reported, and the completion goes ahead.

It comes last in ``GuardedTask.guardrails``: a duplicate of a completed idempotency key, a delivery its
budget defers or a copy waiting behind a live claim never takes a slot.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

from celery_guardrails import signals
from celery_guardrails.exceptions import (
    ConcurrencyKeyError,
    ConfigurationError,
    RetryLater,
    SlotLostError,
    StoreError,
)
from celery_guardrails.foundation.context import current_tenant
from celery_guardrails.guardrails.keys import render_key
from celery_guardrails.guardrails.retries import retry_later
from celery_guardrails.options import APP, TASK, Option, TaskOptions, checks, declare
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import ATTRIBUTE, Delivery, Grant, Hold, delivery, view
from celery_guardrails.runtime.heartbeats import HEARTBEATS, delivery_owner
from celery_guardrails.runtime.outcomes import PERMANENT, attempt_record, fail_finally
from celery_guardrails.runtime.pipeline import Guardrail, Publication
from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import SlotHolder, Store

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)

#: Longest interval between two heartbeats of a slot, in seconds (a quarter of the ceiling when shorter).
BEAT_MAX = 10.0
#: Share of the ceiling within which a slot confirmed held (acquired, beaten, checked) is taken as still held at
#: a boundary without asking the store: no reaper can take it sooner than the ceiling after that step began,
#: and half of it leaves room for clocks that differ between workers.
TRUSTED = 0.5
#: Doublings of the wait for a slot at most (the delay stays under 16 times ``retry_later_delay``).
WAIT_DOUBLINGS = 4
#: The store key's namespace of each option (a concurrency key and an exclusive key never share slots).
NAMESPACES = (("concurrency_key", "limit"), ("exclusive_key", "exclusive"))


#: The options concurrency limits read, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="concurrency_key",
        default=None,
        doc="Tasks whose key renders the same share concurrency_limit slots across all workers: a str.format "
        "template over the task's bound arguments and {tenant} (the message's tenant), e.g. 'tenant:{tenant}' "
        "or a dependency name, or a callable taking the task's arguments. Not scoped by task name.",
        check=checks.key_spec,
        scopes=frozenset({TASK}),
    ),
    Option(
        name="concurrency_limit",
        default=None,
        doc="Deliveries of one concurrency_key that may run at once, across all workers (required with it). A "
        "delivery that finds them all taken comes back later (RetryLater), no attempt spent.",
        check=checks.positive_int,
        scopes=frozenset({TASK}),
    ),
    Option(
        name="exclusive_key",
        default=None,
        doc="Like concurrency_key with a limit of one: two tasks acting on one entity ('invoice:{invoice_id}') "
        "never run at once. Both may be set on one task (two slots, the concurrency slot taken first).",
        check=checks.key_spec,
        scopes=frozenset({TASK}),
    ),
    Option(
        name="concurrency_reap_after",
        default=300.0,
        doc="Seconds without a heartbeat after which a slot's holder is reaped (its worker died, or stalled): "
        "recorded as failed with reason 'lost', holder_reaped sent. A running holder beats every quarter of it "
        "(at most every 10 s). Reaping runs in every capacity check and on the watchdog's timer. A stalled "
        "holder that resumes is fenced at its next boundary (SlotLostError, holder_fenced).",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="concurrency_max_waits",
        default=100,
        doc="Waits for a slot that spend neither an attempt nor retry_later_max; past them each further wait "
        "counts toward retry_later_max (then a final failure retry_later_exhausted).",
        check=checks.positive_int,
        scopes=frozenset({TASK, APP}),
    ),
)


def store_key(namespace: str, key: str) -> str:
    """The store's name of a rendered key: ``limit:<key>`` or ``exclusive:<key>``."""
    return f"{namespace}:{key}"


def wanted_slots(
    options: TaskOptions, args: tuple[Any, ...], kwargs: dict[str, Any], tenant: str | None
) -> list[tuple[str, int]]:
    """The (store key, limit) of each slot a delivery of ``options.task`` needs, in the order they are taken.
    Raises ConcurrencyKeyError (a key that cannot be made) or ConfigurationError (a key without a limit)."""
    task = options.task
    wanted = []
    for option, namespace in NAMESPACES:
        spec = options[option]
        if spec is None:
            continue
        if namespace == "limit":
            limit = options["concurrency_limit"]
            if limit is None:
                raise ConfigurationError("concurrency_limit", f"task {task.name!r} sets concurrency_key without it")
        else:
            limit = 1
        key = render_key(task, spec, args, kwargs, option=option, error=ConcurrencyKeyError, extra={"tenant": tenant})
        wanted.append((store_key(namespace, key), limit))
    return wanted


def beat_interval(reap_after: float) -> float:
    return min(BEAT_MAX, reap_after / 4)


def report_reaped(sender: Any, reaped: tuple[SlotHolder, ...] | list[SlotHolder]) -> None:
    """Log and signal each holder a reaper took a slot from (its job is lost)."""
    for holder in reaped:
        logger.warning(
            "Concurrency key %s: holder %s (task %s[%s]) reaped, its last heartbeat at %.3f: recorded lost",
            holder.key,
            holder.holder,
            holder.task_name,
            holder.task_id,
            holder.heartbeat_at,
        )
        signals.holder_reaped.send(
            sender=sender,
            key=holder.key,
            holder=holder.holder,
            task_name=holder.task_name,
            task_id=holder.task_id,
            tenant=holder.tenant,
            heartbeat_at=holder.heartbeat_at,
            reaped_at=holder.reaped_at,
            reason="lost",
        )


def report_fenced(task: Any, grant: Grant, where: str) -> None:
    """Log and signal a holder that went on after its slot was reaped, stopped at ``where`` (its overlap)."""
    request = task.request
    logger.warning(
        "Task %s[%s]: concurrency slot %s of holder %s was reaped while it ran (silent past %.3fs: stalled); "
        "fenced at %s",
        task.name,
        request.id,
        grant.key,
        grant.holder,
        grant.reap_after,
        where,
    )
    signals.holder_fenced.send(
        sender=task,
        key=grant.key,
        holder=grant.holder,
        task_name=task.name,
        task_id=str(request.id or ""),
        tenant=current_tenant() or "",
        where=where,
    )


def _lost(task: Any, state: Delivery, where: str, *, landing: bool = True) -> Grant | None:
    """The first slot of ``state`` found reaped (reported), or None: every slot is still this delivery's.
    ``landing``: an effect is about to land in the transaction open now, if any."""
    store = get_store(task.app)
    in_transaction = getattr(store, "in_transaction", None)
    # Where an effect lands inside a database transaction (Django store) the check is always the store's: its
    # UPDATE of the slot's row joins the transaction and locks the row until it ends, and the reaper skips a
    # locked row: the slot cannot be taken away between the check and the commit.
    locking = landing and in_transaction is not None and bool(in_transaction())
    for grant in state.concurrency:
        if not grant.lost:
            started = time.monotonic()
            if not locking and started - grant.confirmed < grant.reap_after * TRUSTED:
                continue  # confirmed too recently for any reaper to have taken it: no round trip
            try:
                held = store.heartbeat_slot(grant.key, holder=grant.holder, now=time.time())
            except StoreError as exc:
                state.fence_error = exc  # an outage of the guardrails' store, not the body's error
                raise
            if held:
                if not locking:  # (a beat inside a transaction may still be rolled back)
                    grant.confirmed = started
                continue
            grant.lost = True
        report_fenced(task, grant, where)
        return grant
    return None


def fence(task: Any, where: str, *, landing: bool = True) -> None:
    """Raise :class:`~celery_guardrails.exceptions.SlotLostError` when a concurrency slot the running delivery
    of ``task`` holds was reaped (the holder stalled past ``concurrency_reap_after``); nothing when it holds
    none. Called at the body's boundaries (:class:`ConcurrencyLimit`) and by the effect helpers (``effect()``,
    the checkpoint's save, the Django effect helpers). ``landing=False``: no effect lands in the open
    transaction yet (before the body: the slot's row is not locked for the whole body). Raises StoreError like
    any store operation."""
    state: Delivery | None = getattr(task.request, ATTRIBUTE, None)
    if state is None or not state.concurrency:
        return
    grant = _lost(task, state, where, landing=landing)
    if grant is not None:
        raise SlotLostError(grant.key, grant.holder, where)


def fence_running(where: str) -> None:
    """:func:`fence` for the guarded body running in this thread, if any (the helpers' entry point)."""
    from celery import current_task

    task = current_task._get_current_object()
    state: Delivery | None = getattr(task.request, ATTRIBUTE, None) if task is not None else None
    if state is not None and state.in_body and state.concurrency:
        fence(task, where)


def _beat(store: Store, grant: Grant, now: float) -> bool:
    started = time.monotonic()
    held = store.heartbeat_slot(grant.key, holder=grant.holder, now=now)
    if held:
        grant.confirmed = started
    else:
        grant.lost = True  # reaped: every boundary of the body now refuses at once
    return held


def _let_go(store: Store, state: Delivery, grant: Grant) -> None:
    """Release one slot: its beats stop and the delivery forgets it first (a beat after the release would find
    nothing, and say lost; a release the store fails is not tried again: the reaper takes the slot)."""
    HEARTBEATS.remove(grant.key, grant.holder)
    if grant in state.concurrency:
        state.concurrency.remove(grant)
    store.release_slot(grant.key, holder=grant.holder)


class ConcurrencyLimit(Guardrail):
    """Takes the slots of ``concurrency_key`` / ``exclusive_key`` before the body, gives them back after."""

    def on_publish(self, task: GuardedTask, publication: Publication) -> None:
        # A bad template (or a key without a limit) is the publisher's mistake: it hears of it now.
        wanted_slots(
            TaskOptions(task=task, call=publication.call),
            publication.args,
            publication.kwargs,
            publication.header.get(headers.TENANT),
        )

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        options = view(task).options
        request = task.request
        try:
            wanted = wanted_slots(options, args, kwargs, current_tenant())
        except ConcurrencyKeyError as exc:  # published without the extension, or the task changed since
            record = attempt_record(task, kind="permanent", rule="concurrency_key", exc=exc)
            fail_finally(task, exc, reason=PERMANENT, history=[*request.attempt_history, record])
        if not wanted:
            return
        store = get_store(task.app)
        state = delivery(task)
        holder = delivery_owner(request)
        reap_after = options["concurrency_reap_after"]
        for key, limit in wanted:
            started = time.monotonic()
            answer = store.acquire_slot(
                key,
                holder=holder,
                limit=limit,
                now=time.time(),
                reap_after=reap_after,
                task_name=task.name,
                task_id=str(request.id or ""),
                tenant=current_tenant() or "",
            )
            report_reaped(task, answer.reaped)
            if not answer.acquired:
                self._release(task)  # a slot taken before this one: not held while waiting
                self._wait(task, key, limit, answer.retry_at)
            grant = Grant(key=key, holder=holder, reap_after=reap_after, confirmed=started)
            state.concurrency.append(grant)
            state.fence = functools.partial(fence, task)
            state.holds.append(Hold(holder, functools.partial(_let_go, store, state, grant)))
            beat = functools.partial(_beat, store, grant)
            HEARTBEATS.add(store, key, holder, lease=reap_after, beat=beat, every=beat_interval(reap_after))

    def _wait(self, task: GuardedTask, key: str, limit: int, retry_at: float) -> NoReturn:
        """Come back when a slot may be free (raises Celery's Retry: see :func:`retry_later`)."""
        seen = view(task)
        options, header = seen.options, seen.header
        waits = headers.counter(header, headers.SLOT_WAIT)
        wait = RetryLater(f"concurrency key {key}: all {limit} slot(s) taken")
        soon = options["retry_later_delay"] * 2 ** min(waits, WAIT_DOUBLINGS)
        if retry_at:  # no later than the moment the oldest holder would be reaped, were it dead
            soon = min(soon, max(0.1, retry_at - time.time() + 0.1))
        delay = max(0.05, soon * (0.5 + random.random() / 2))  # spread: the waiters of one key do not come back at once
        counter = headers.SLOT_WAIT if waits < options["concurrency_max_waits"] else headers.LATER
        retry_later(task, wait, delay=delay, rule="concurrency:full", counter=counter)

    def body_context(self, task: GuardedTask) -> AbstractContextManager[Any] | None:
        if not delivery(task).concurrency:
            return None
        return self._holding(task)

    @contextmanager
    def _holding(self, task: GuardedTask) -> Iterator[None]:
        state = delivery(task)
        try:
            fence(task, "before the body", landing=False)
            yield
            self._completing(task)
        except StoreError as exc:
            if exc is state.fence_error:
                # The store failed under a fence check, not the task's own code: an outage GuardedTask settles
                # (the message comes back later, no attempt spent), not an error of the body to classify.
                state.body_error = None
            raise
        finally:
            # The body is over: its slots go back now, before a retry is published or the result stored.
            # Inside a database transaction (atomic=True on the Django store) a release would be rolled back
            # with it: the hooks after the transaction release them instead.
            in_transaction = getattr(get_store(task.app), "in_transaction", None)
            if in_transaction is None or not in_transaction():
                self._release(task)

    def _completing(self, task: GuardedTask) -> None:
        """The body returned: are its slots still its own? Inside a database transaction (``atomic=True`` on the
        Django store) a lost slot refuses the commit (SlotLostError rolls the body's work back). Outside one the
        body's effects have happened and running it again could repeat them: a lost slot is reported (logged,
        ``holder_fenced``) and the completion goes ahead."""
        state = delivery(task)
        in_transaction = getattr(get_store(task.app), "in_transaction", None)
        if in_transaction is not None and in_transaction():
            fence(task, "completion")
            return
        try:
            _lost(task, state, "completion (its effects had run)")
        except StoreError:  # a report only: an outage now must not send a finished body round again
            state.fence_error = None
            logger.warning(
                "Task %s[%s]: its concurrency slots could not be checked at completion", task.name, task.request.id
            )

    def _release(self, task: GuardedTask) -> None:
        """Release every slot held, in reverse order, each on its own (the store may be what fails: a slot
        left held is reaped after the ceiling)."""
        state = delivery(task)
        if not state.concurrency:
            return
        store = get_store(task.app)
        for grant in reversed(list(state.concurrency)):
            state.forget(grant.holder)
            try:
                _let_go(store, state, grant)
            except Exception:
                logger.warning(
                    "Task %s[%s]: concurrency slot %s not released; it is reaped after the ceiling",
                    task.name,
                    task.request.id,
                    grant.key,
                    exc_info=True,
                )

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        self._release(task)

    def on_failure(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        self._release(task)

    def on_retry(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        self._release(task)


def reap(app: Any) -> list[SlotHolder]:
    """The reaper on a timer (the watchdog's thread calls it): every key's stale holders reaped, recorded lost,
    signalled. Raises StoreError like any store operation."""
    reaped = get_store(app).reap_slots(now=time.time())
    report_reaped(app, reaped)
    return reaped


def concurrency_status(key: str, *, exclusive: bool = False, app: Any = None) -> dict[str, Any]:
    """The slots of a rendered ``concurrency_key`` (``exclusive=True``: of an ``exclusive_key``) now, under
    ``app`` (default: the current app): ``held`` and ``holders`` (:class:`~celery_guardrails.stores.base.
    SlotHolder`), ``stale`` (held past the ceiling, reaped at the next check), ``reap_after``, the counters
    ``checks``, ``acquired`` and ``reaped`` (holders reaped ever: the metric), and ``recent_lost`` (the
    newest reaped holders' records, at most 10)."""
    from celery import current_app

    app = app or current_app
    namespace = "exclusive" if exclusive else "limit"
    return get_store(app).slot_status(store_key(namespace, key), now=time.time())
