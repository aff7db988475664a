"""The broker lease heartbeat: a delivery this worker holds is not redelivered while the worker lives.

kombu's Redis transport emulates acks (kombu/transport/redis.py, kombu 5.7): ``QoS.append`` stores each
delivered message in the ``unacked`` hash and its delivery tag in the ``unacked_index`` sorted set, scored with
the time of delivery; ``ack``/``reject`` remove both. Every worker's event loop calls
``MultiChannelPoller.maybe_restore_messages`` every ``unacked_restore_interval`` seconds (transport option,
default 10), and every ``unacked_restore_throttle``-th call (default 10) ``QoS.restore_visible`` gives back to
its queue each tag whose score is older than ``visibility_timeout`` (default 3600 s): whoever still runs it.
So a task longer than the visibility timeout runs twice, once more for each further timeout (the shortest
timeout of the apps sharing the broker wins: celery/celery#5935), and an ETA task waiting in a worker's timer
longer than it is delivered again to another worker (celery/celery#2599). A lease heartbeat is the cure: while
this worker holds a delivery, its score is pushed to now, so only a delivery whose worker died grows old, and
it is given back ``visibility_timeout`` plus at most one restore period after its worker's last heartbeat.

:class:`BrokerLeaseStep` (consumer bootstep, Redis broker, ``broker_lease`` on by default) runs ONE daemon thread
in the worker's main process. Every ``broker_lease_interval`` (default a third of the visibility timeout) it
sends, in one round trip,
``ZADD unacked_index XX <now> tag ...`` for the delivery tag of every request the worker holds:
``celery.worker.state.requests``, the main process's map of its reserved (prefetched, waiting for a pool slot),
ETA-scheduled and active (running) requests; with prefork the main process keeps these for its children
(``task_accepted`` / ``task_ready``), with solo and threads they are the same process's.

Why these choices:

* A thread, not the event loop's timer: with the solo pool the task runs in the loop's thread and the hub does
  not turn until it ends, which is when a heartbeat is needed most.
* Its own client on the channel's connection pool (``Channel.conn_or_acquire``, as kombu's QoS does; a
  ``global_keyprefix`` is applied by kombu's client class): the channel's own client is the consumer's (BRPOP
  state, not thread-safe); redis-py pools are. After a reconnection the consumer starts this step again and
  the thread moves to the new channel's pool.
* Not at each delivery: a delivery's score is the time it was delivered (kombu's ``QoS.append``, the atomic pop's
  script), and the next pass comes at most one interval later. An extension at each delivery (as this thread
  did until now) moved nothing but cost every task a thread switch and a round trip: a fifth of a plain task's
  CPU on a stream of short tasks.
* ``XX``: a tag is only moved, never re-created. A tag the worker acked or rejected, or that a restore has
  already given back, is not in the index any more, and an extension racing with an ack or a restore (each is
  one Redis command or transaction) either precedes it or does nothing.
* Every delivery the worker holds, not only guarded tasks': a plain task prefetched behind a long guarded
  one would be redelivered too. A delivery that a task acked early (``acks_late=False``) is not in the index.
* Never the worker's end: an error is logged (once per outage) and the next tick tries again. A Redis that
  hangs without closing the connection stalls the thread, not the worker: set the ``socket_timeout``
  transport option (kombu's advice too); meanwhile leases age as they would without the heartbeat.
* On a warm shutdown the consumer stops before the pool has finished its tasks: the thread goes on
  extending what is still held and ends when nothing is.

Not covered: a rate-limited request waiting for a token is in none of Celery's request maps (it is in its
token bucket), so it is not extended.

RabbitMQ acks for real, but closes the channel of a consumer that keeps a delivery unacked longer than its
``consumer_timeout`` (30 minutes by default, a server setting, or a queue's ``x-consumer-timeout`` argument):
the tasks of that channel are then delivered again. It cannot be read over AMQP, so
:func:`check_consumer_timeout` warns at start-up about each guarded task whose ``time_limit`` is unset or longer
than the timeout the app declares (``rabbitmq_consumer_timeout``, and any ``x-consumer-timeout`` of
``task_queues``); the audit grades the same rule (:func:`long_holders`) as GA504.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from celery import bootsteps
from celery.worker import state

from celery_guardrails.options import app_value

logger = logging.getLogger(__name__)

AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://", "librabbitmq://")
#: Seconds: the heartbeat never runs more often than this.
MIN_INTERVAL = 0.1


def held_tags() -> list[str]:
    """Delivery tags of the requests this worker process holds: reserved, ETA-scheduled and active."""
    # One C-level copy of the dict (atomic under the GIL), so the consumer thread can change it meanwhile.
    requests = list(state.requests.values())
    return [tag for request in requests if (tag := _tag(request))]


def _tag(request: Any) -> str | None:
    message = getattr(request, "message", None)
    tag = getattr(message, "delivery_tag", None)
    return tag if isinstance(tag, str) else None


def extend(client: Any, key: str, tags: Iterable[str]) -> int:
    """Score each of ``tags`` still in the sorted set ``key`` with now, in one command; return how many."""
    now = time.time()
    mapping = dict.fromkeys(tags, now)
    if not mapping:
        return 0
    # CH: count the members whose score changed (all that are there); XX: never add one that is not.
    return int(client.zadd(key, mapping, xx=True, ch=True))


class BrokerLease:
    """The heartbeat thread of one worker (see the module docstring)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.target: tuple[Any, str] | None = None  # (client, unacked index key) of the current channel
        self.wake = threading.Event()
        self.draining = threading.Event()
        self.failing = False
        self.thread: threading.Thread | None = None

    def point_at(self, client: Any, key: str) -> None:
        """Extend through ``client`` from now on; start the thread the first time."""
        self.target = (client, key)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="guardrails-broker-lease", daemon=True)
            self.thread.start()

    def drain(self) -> None:
        """The consumer shuts down: go on while requests are held (a warm shutdown lets them finish), then end."""
        self.draining.set()
        self.wake.set()

    def _run(self) -> None:
        last = 0.0
        while True:
            # Draining: look again every second, to end soon after the last held request is done.
            timeout = max(0.0, last + self.interval - time.monotonic())
            self.wake.wait(min(timeout, 1.0) if self.draining.is_set() else timeout)
            self.wake.clear()
            if self.draining.is_set() and not state.requests:
                return
            try:
                if time.monotonic() >= last + self.interval:
                    last = time.monotonic()
                    self.tick(held_tags())
            except Exception:  # a surprise in Celery's request map: the thread lives on, the next pass tries
                logger.exception("Broker lease: reading the held deliveries failed")

    def tick(self, tags: list[str]) -> int | None:
        """One extension of ``tags``; never raises. Returns how many were extended (None: it failed)."""
        target = self.target
        if target is None or not tags:
            return 0
        client, key = target
        try:
            extended = extend(client, key, tags)
        except Exception as exc:  # never the worker's end: the next tick tries again
            if not self.failing:
                logger.warning(
                    "Broker lease: extending %d delivery(ies) in %s failed (%r); trying again every %.1fs",
                    len(tags),
                    key,
                    exc,
                    self.interval,
                )
            self.failing = True
            return None
        if self.failing:
            logger.info("Broker lease: extending deliveries again (%d of %d extended)", extended, len(tags))
            self.failing = False
        logger.debug("Broker lease: extended %d of %d held delivery(ies)", extended, len(tags))
        return extended


def _redis_channel(connection: Any) -> Any:
    """The connection's default channel when the broker is Redis with kombu's ack emulation, else None."""
    from kombu.transport.redis import QoS

    from celery_guardrails.broker.kind import is_redis_connection

    if not is_redis_connection(connection):
        return None
    channel = connection.default_channel
    return channel if isinstance(channel.qos, QoS) else None


def interval_of(app: Any, visibility_timeout: float) -> float:
    """Seconds between two extensions: ``broker_lease_interval``, else a third of the visibility timeout."""
    configured = app_value(app, "broker_lease_interval")
    # A floor, so that a visibility_timeout of 0 (nonsense, but accepted by kombu) is no busy loop.
    return max(MIN_INTERVAL, float(configured) if configured is not None else visibility_timeout / 3)


class BrokerLeaseStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: the broker lease heartbeat on Redis; the ``consumer_timeout`` check on RabbitMQ."""

    label = "Guardrails broker lease"
    # After Tasks: the consumer consumes from its default channel, whose pool and keys the thread uses.
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.lease: BrokerLease | None = None
        check_consumer_timeout(c.app)
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        """The consumer (re)connected: point the heartbeat at its channel (consumer thread)."""
        if not app_value(c.app, "broker_lease"):
            return
        try:
            channel = _redis_channel(c.connection)
            if channel is None:
                return  # not Redis: RabbitMQ and SQS keep their own leases
            with channel.conn_or_acquire() as client:  # a client on the channel's pool, kept for the thread
                pass
            if self.lease is None:
                self.lease = BrokerLease(interval_of(c.app, float(channel.visibility_timeout)))
                logger.info(
                    "Broker lease: extending held deliveries every %.1fs (visibility_timeout %.0fs)",
                    self.lease.interval,
                    channel.visibility_timeout,
                )
            elif self.lease.target is not None:
                logger.info("Broker lease: extending through the new broker connection")
            self.lease.point_at(client, channel.unacked_index_key)
        except Exception:  # never the worker's end: kombu's visibility timeout still applies
            logger.exception("Broker lease: could not start the heartbeat; deliveries expire after visibility_timeout")

    def shutdown(self, c: Any) -> None:
        if self.lease is not None:
            self.lease.drain()


@dataclass(frozen=True, slots=True, kw_only=True)
class LongHolders:
    """RabbitMQ: the consumer timeout the app declares (seconds) and the guarded tasks that may hold a delivery
    longer (their names, sorted)."""

    timeout: float
    tasks: tuple[str, ...]


def long_holders(app: Any, tasks: Iterable[Any]) -> LongHolders | None:
    """The one rule for a task that may hold a delivery longer than RabbitMQ's consumer timeout: the worker's
    start-up warning (:func:`check_consumer_timeout`) and the audit's GA504. None off RabbitMQ.

    Checkable here: the task's ``time_limit`` (else the app's ``task_time_limit``) against the smallest of the
    app option ``rabbitmq_consumer_timeout`` and the ``x-consumer-timeout`` arguments (milliseconds) of the
    app's ``task_queues``. Not checkable: the server's real setting (not readable over AMQP), and how long a
    prefetched or ETA message waits in the worker before it runs (its time counts too).
    """
    if not str(app.conf.broker_url or "").startswith(AMQP_SCHEMES):
        return None
    from celery_guardrails.runtime.pipeline import is_guarded

    timeout = float(app_value(app, "rabbitmq_consumer_timeout"))
    for queue in app.conf.task_queues or ():
        declared = (getattr(queue, "queue_arguments", None) or {}).get("x-consumer-timeout")
        if isinstance(declared, int | float) and declared > 0:
            timeout = min(timeout, declared / 1000)
    names = sorted(
        task.name
        for task in tasks
        if is_guarded(task) and not 0 < float(task.time_limit or app.conf.task_time_limit or 0) <= timeout
    )
    return LongHolders(timeout=timeout, tasks=tuple(names))


def check_consumer_timeout(app: Any) -> list[str]:
    """RabbitMQ: warn at start-up about each guarded task that may hold a delivery longer than the consumer
    timeout (:func:`long_holders`, one line naming them all). Returns the names warned about."""
    found = long_holders(app, app.tasks.values())
    if found is None or not found.tasks:
        return []
    logger.warning(
        "celery-guardrails: %s may run longer than RabbitMQ's consumer_timeout (%.0fs): RabbitMQ then closes "
        "the channel and delivers its messages again. Set time_limit below it, or raise consumer_timeout "
        "(rabbitmq.conf, or the queue argument x-consumer-timeout) and rabbitmq_consumer_timeout with it",
        ", ".join(found.tasks),
        found.timeout,
    )
    return list(found.tasks)
