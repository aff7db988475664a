"""The ack on the store: where the guardrails store is the broker's own Redis, a guarded task's message is acked
by the store, and a keyed task's completion rides that ack: one script, one round trip, instead of two.

A worker acks a message on a Redis broker by removing kombu's record of its delivery: the ``unacked`` hash and
its ``unacked_index`` (kombu's ``QoS.ack``, which makes a new client for each ack). A keyed delivery also
completes its key before that ack (:mod:`celery_guardrails.guardrails.idempotency`). When the store is a Redis
store on the broker's server and database (the same host, port, database and user in both URLs), the store makes
the ack itself, on its own connection, as the last success hook of a guarded delivery (:class:`StoreAck`); the
worker's own ack then only forgets the delivery (:class:`celery_guardrails.broker.atomic_pop.QoS`).

A keyed delivery's completion rides that ack (one script: the completion is durable before the message is
removed, and no worker can die between the two) where nothing else waits between the body's return and the ack,
so that moving the completion from the body's return to the ack moves it past nothing: no callback, chain or
chord to publish, no ordering turn, job, run slot, concurrency slot, budget admission or checkpoint to settle,
and results ignored, or stored on Celery's Redis result backend on the store's own server and database.

There the result rides too: encoded as Celery encodes it when the body returns
(:func:`celery_guardrails.runtime.results.prepared_result`; a result that cannot be encoded rides nothing), it is
written by the same script (SET, then PUBLISH to the clients waiting on it) between the completion and the ack,
and Celery's ``mark_as_done`` lets it be. A stored result then means a completed key and an
acked message, all or nothing, in one round trip where Celery makes three (its read of the stored state, its
write, its ack).

A worker killed between the body's return and this step leaves the key claimed by a process that is gone: the
redelivery takes it over and runs the body again, the window between the effect and the completion that the
Redis store always had (a body that hands ``self.request.idempotency_key`` to its provider closes it). Any other
keyed delivery sends its completion as its body returns, as before, and reads its answer before the ack.

Only where the task runs in the process that consumes its message: the solo and threads pools, with the atomic
pop (``broker_atomic_pop``); a prefork child's message is acked by the main process, as Celery does. Anywhere
else, and with ``store_acks=False``, the worker acks as Celery does. Only successes: a failure, a retry or a
dead letter is acked (or given back) by the worker as before. When the script cannot be run (the Redis cut
away), the completion is made on its own (asked again until the store answers), then the result is stored as
Celery stores it, then the worker acks.

The script is sent by the last success hook; on the solo pool its answer is read as the worker acks the message
(:func:`celery_guardrails.broker.atomic_pop.read_at_ack`), on the same thread, so that the round trip overlaps
Celery's own work after the hooks: the completion and the ack are one script, so the ack rule needs no answer to
hold. A sent script runs even if the worker is killed before reading it. An answer that cannot be read (a broken
connection, the script not loaded) is settled then, from values taken while the delivery ran
(:mod:`celery_guardrails.guardrails.completion`): the script is run again (a repeat is safe); failing that, the
completion is made on its own, the result stored by Celery's backend, and the worker's own ack removes the message.
On a threads pool the answer is read in the hook, as before. Task signal handlers that run after the success hooks
(``task_success``, ``after_return``, ``task_postrun``) run after the ack is sent (with Celery's ack, before it).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery_guardrails.broker import atomic_pop
from celery_guardrails.options import APP, Option, app_value, checks, declare
from celery_guardrails.runtime.checkpoint import REQUEST_ATTRIBUTE as CHECKPOINT
from celery_guardrails.runtime.delivery import Delivery, RidingCompletion, delivery
from celery_guardrails.runtime.pipeline import Guardrail
from celery_guardrails.runtime.results import prepared_result
from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import BrokerAck

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)

DECLARED = declare(
    Option(
        name="store_acks",
        default=True,
        doc="Where the guardrails store is the broker's own Redis (same host, port, database and user), the store "
        "acks a guarded task's message as it succeeds, and a keyed task completes its key and acks its message in "
        "one script, one round trip, with its result when the result backend is that Redis too (solo and threads "
        "pools with broker_atomic_pop). False: the completion as the body returns, Celery's result store and "
        "Celery's ack. See celery_guardrails.guardrails.acks.",
        check=checks.boolean,
        scopes=frozenset({APP}),
    ),
)

#: The connection settings that make two Redis URLs the same database for this purpose.
SAME = ("host", "port", "db", "username", "path")
#: kombu's names of its delivery records (transport options), and their defaults (kombu 5.7).
UNACKED, UNACKED_INDEX = "unacked", "unacked_index"


@functools.lru_cache(maxsize=64)
def shared_records(app: Any, store: Any) -> tuple[str, str] | None:
    """kombu's ``unacked`` and ``unacked_index`` keys when ``store`` is a Redis store on the database of ``app``'s
    broker, and that broker is consumed with the atomic pop (kombu's record layout); else None. Read once."""
    return _records(app, store)


def _records(app: Any, store: Any) -> tuple[str, str] | None:
    from celery_guardrails.stores.redis import RedisStore

    if not isinstance(store, RedisStore) or not store._lane.available:  # a cluster, green threads
        return None
    if app.conf.broker_transport != atomic_pop.TRANSPORT:
        return None
    url = app.conf.broker_read_url or app.conf.broker_url
    if not isinstance(url, str) or ";" in url or not url.startswith("redis://"):
        return None
    try:
        import redis

        broker = redis.ConnectionPool.from_url(url).connection_kwargs
    except Exception:  # a URL redis-py reads otherwise than kombu: not judged the same
        return None
    mine = store.client.connection_pool.connection_kwargs
    if any(broker.get(name) != mine.get(name) for name in SAME) or broker.get("password") != mine.get("password"):
        return None
    options = app.conf.broker_transport_options or {}
    prefix = str(options.get("global_keyprefix") or "")
    unacked = str(options.get("unacked_key", UNACKED))
    return prefix + unacked, prefix + str(options.get("unacked_index_key", UNACKED_INDEX))


def broker_ack(task: GuardedTask) -> BrokerAck | None:
    """The ack the store can make for the message of the delivery ``task`` runs, or None (see the module
    docstring)."""
    request = task.request
    if not atomic_pop.consumes_here() or request.called_directly or request.is_eager:
        return None
    if not getattr(task, "acks_late", False) or not app_value(task.app, "store_acks"):
        return None
    tag = (getattr(request, "properties", None) or {}).get("delivery_tag")
    if not isinstance(tag, str) or not tag:
        return None
    store: Any = get_store(task.app)  # a store instance: hashable by identity, like the app
    records = shared_records(task.app, store)
    if records is None:
        return None
    return BrokerAck(unacked=records[0], index=records[1], tag=tag)


def nothing_between(task: GuardedTask, state: Delivery) -> bool:
    """Whether nothing of this delivery has to be settled between its body's return and its ack but a result that
    can ride too (see the module docstring): its completion may then wait for the ack."""
    request = task.request
    if request.callbacks or request.chain or getattr(request, "chord", None):
        return False
    if not _results_ignored(task, request) and not result_rides(task):
        return False
    if state.ordering or state.job or state.slot or state.period or state.concurrency or state.dependency:
        return False
    return getattr(request, CHECKPOINT, None) is None


def _results_ignored(task: GuardedTask, request: Any) -> bool:
    """Whether Celery surely stores no result for this delivery: the task ignores results, and the message did not
    ask for one. (Celery 5.5.3's tracer reads only the task's ``ignore_result``; later ones let the message's own
    value win, ``celery.app.task.get_actual_ignore_result``: both store nothing then.)"""
    explicit = getattr(request, "__dict__", {}).get("ignore_result")
    return bool(getattr(task, "ignore_result", False)) and explicit is not False


def result_rides(task: GuardedTask) -> bool:
    """Whether the task's result can be written with its completion and ack: its result backend is Celery's Redis
    backend (that class itself: a subclass may write otherwise) on the store's server and database, storing JSON
    uncompressed (Celery's default; the script reads a stored result to keep a success, as Celery does)."""
    store: Any = get_store(task.app)  # a store instance: hashable by identity, like the backend
    return _shared_backend(_celery_backend(task), store)


def _celery_backend(task: GuardedTask) -> Any:
    """The task's result backend, Celery's own (inside the redacting wrapper ``GuardedTask.backend`` returns)."""
    backend = getattr(task, "backend", None)
    return getattr(backend, "_backend", backend)


@functools.lru_cache(maxsize=64)
def _shared_backend(backend: Any, store: Any) -> bool:
    from celery.backends.redis import RedisBackend

    from celery_guardrails.stores.redis import RedisStore

    if type(backend) is not RedisBackend or not isinstance(store, RedisStore):
        return False
    if backend.serializer != "json" or getattr(backend, "compression", None):  # (no compression before Celery 5.7)
        return False
    try:
        theirs = backend.client.connection_pool.connection_kwargs
    except Exception:  # a backend that cannot make its client: not judged the same
        return False
    mine = store.client.connection_pool.connection_kwargs
    return all(theirs.get(name) == mine.get(name) for name in (*SAME, "password"))


def ride(task: GuardedTask, state: Delivery, riding: Callable[..., RidingCompletion]) -> bool:
    """Let the completion ``riding(ack=...)`` makes wait for the ack when it can (True: it will be made there, by
    :class:`StoreAck`), with the task's result when it is stored."""
    try:
        ack = broker_ack(task) if nothing_between(task, state) else None
        result = None
        if ack is not None and not _results_ignored(task, task.request):
            # Encoded now: one that cannot be leaves the completion to be made as the body returns, before
            # Celery's mark_as_done meets the same error (the key completed before the task's failure is stored).
            request = task.request
            result = prepared_result(_celery_backend(task), request.id, state.retval, request)
            if result is None:
                return False
    except Exception:  # the body returned: whatever this meets, the key is completed the usual way
        logger.warning("Task %s[%s]: its completion cannot ride the ack", task.name, task.request.id, exc_info=True)
        return False
    if ack is None:
        return False
    state.riding = riding(ack=ack, result=result)
    return True


class StoreAck(Guardrail):
    """Acks a guarded delivery that succeeded on the store, with the completion that rides it, after every other
    success hook (it is first in the pipeline, so its after-hooks run last)."""

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        state = delivery(task)
        riding, state.riding = state.riding, None
        ack = riding.ack if riding is not None else broker_ack(task)
        if ack is None:
            return
        store: Any = get_store(task.app)  # a RedisStore: broker_ack made sure
        try:
            if riding is None:
                answer = store.send_ack(ack)
            else:
                answer = store.send_complete_and_ack(
                    riding.key,
                    owner=riding.owner,
                    now=time.time(),
                    summary=riding.summary,
                    retention=riding.retention,
                    ack=ack,
                    result=riding.result.write if riding.result is not None else None,
                )
        except Exception as exc:  # nothing sent: the message stays unacked (its completion settled first)
            _in_doubt(task.name, str(task.request.id), riding, exc)
            return
        # Read as the worker acks the message, where that is this thread (solo): the round trip overlaps Celery's
        # work after the hooks. The script completes and acks together, so no answer is needed to keep the ack rule.
        read = functools.partial(_answered, task.name, str(task.request.id), riding, answer)
        if atomic_pop.read_at_ack(ack.tag, read) or read():  # (else the worker acks)
            atomic_pop.ACKED_BY_STORE.add(ack.tag)

    def on_failure(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        # The body returned but the delivery failed afterwards (Celery, or a guardrail unwinding): the completion
        # is made without the ack, and the worker acks (or gives the message back) as it decided.
        self._settle(task, exc)

    def on_retry(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        self._settle(task, exc)

    @staticmethod
    def _settle(task: GuardedTask, exc: BaseException) -> None:
        state = delivery(task)
        riding, state.riding = state.riding, None
        if riding is not None:
            _settle(task.name, str(task.request.id), riding, exc)


def _answered(name: str, task_id: str, riding: RidingCompletion | None, answer: Callable[[], bool]) -> bool:
    """Read the answer of the store's ack; whether the store acked the message (False: the worker acks it, a
    completion that was to ride it made first). Made of values: it may run after the delivery's hooks."""
    try:
        done = answer()
    except Exception as exc:
        _in_doubt(name, task_id, riding, exc)
        return False
    if riding is not None and not done:
        riding.lost()
    return True


def _in_doubt(name: str, task_id: str, riding: RidingCompletion | None, exc: BaseException) -> None:
    """The store's ack is not known to have happened (``exc``): a completion that was to ride it is made on its
    own; the worker then acks. Never raises."""
    if riding is None:
        logger.info("Task %s[%s]: not acked on the store (%s); the worker acks it", name, task_id, exc)
        return
    try:
        _settle(name, task_id, riding, exc)
    except Exception:  # the worker acks all the same: a body that returned is not run again
        logger.exception("Task %s[%s]: key %s not settled without the ack", name, task_id, riding.key)


def _settle(name: str, task_id: str, riding: RidingCompletion, exc: BaseException) -> None:
    """The completion made without the ack (``exc``: why), then the result that rode stored as Celery stores it;
    the worker acks afterwards."""
    riding.settle(exc)
    if riding.result is None:
        return
    try:
        riding.result.store()
    except Exception:  # the key is completed: the body is not run again for a result that could not be stored
        logger.exception("Task %s[%s]: its result could not be stored", name, task_id)


__all__ = ["DECLARED", "StoreAck", "broker_ack", "nothing_between", "result_rides", "ride", "shared_records"]
