"""A worker outlives a restart of its Redis broker, and gets its prefetched messages run at once.

Celery 5.7 with kombu's Redis transport (reproduced in tests/celery_guardrails/broker/test_restart_guard.py): the
broker's Redis goes away while the consumer waits on BRPOP (it has not yet its fill of prefetched messages).
Celery's consumer handles the connection error in ``Consumer.on_connection_error_after_connected``: it calls
``connection.collect()``, then, new in Celery 5.7 (celery/celery#10242, for celery/celery#9705),
``connection.close()`` on the same connection.

1. ``collect()`` closes the default channel. kombu's Redis ``Channel.close`` first reads the pending BRPOP
   reply, which raises ``ConnectionError`` (the server is gone) before the channel is marked closed, and
   ``Connection.maybe_close_channel`` swallows it. ``collect()`` then sets the transport's ``client`` (the
   ``kombu.Connection`` it belongs to) to ``None``, and leaves ``_default_channel`` pointing at the
   half-closed channel.
2. ``close()`` closes that channel again. This time it drops its Redis pools and calls
   ``QoS.restore_unacked_once`` -> ``restore_unacked`` -> ``conn_or_acquire`` -> a new pool ->
   ``Channel._connparams``, which reads ``self.connection.client.hostname``: the transport's client is the
   ``None`` of step 1. An ``AttributeError`` is no connection error, so Celery's ``ignore_errors`` lets it out
   of the consumer and the worker stops: ``Unrecoverable error: AttributeError("'NoneType' object has no
   attribute 'hostname'")``. The same family as celery/kombu#582 and celery/kombu#970 (a Redis channel used
   after its connection was collected).

The restore could not have worked anyway: the broker is down. Whether the worker crashes or not (with its fill
of messages no BRPOP waits, and it survives), the messages it had delivered stay in kombu's ``unacked`` hash
in Redis (across the restart when Redis persists, AOF or RDB), and kombu gives them back only after
``visibility_timeout`` (an hour by default; celery/celery#1307 asked for a restore on reconnection).

What :class:`BrokerRestartGuard` does, on a worker whose broker is Redis (``broker_restart_guard``, default on):

* when the consumer loses the broker, its ``collect()`` forgets the default channel it tore down, so the
  ``close()`` after it has nothing to close a second time. The lost channel keeps its Redis pool: the tasks
  still running ack through it once Redis is back (an ack that fails leaves the message unacked, and kombu
  redelivers it after ``visibility_timeout``: never an ack with nothing done);
* once the consumer has reconnected, the messages the lost channel had delivered and that no task is running
  (prefetched, waiting for an ETA or a rate limit: Celery's ``on_close`` forgot them) are given back to their
  queues at once, as kombu's restore on close would have done had Redis been there. The restore is kombu's
  (``QoS.restore_by_tag``: one Redis transaction per message, nothing done for a message no longer unacked),
  so a message is queued again once at most.

It is installed for Celery >= 5.7, < 6 with kombu 5 (older Celery does not close what it collected); a newer
release gets no patch until it has been checked (the tests say which).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import celery
import kombu
from celery import bootsteps
from celery.worker.state import active_requests

from celery_guardrails.broker.kind import is_redis_connection
from celery_guardrails.options import app_value

logger = logging.getLogger(__name__)

#: Celery releases whose consumer closes the connection it has just collected (celery/celery#10242).
AFFECTED_CELERY = ((5, 7), (6,))
#: kombu releases checked to leave the half-closed default channel behind after ``collect()``.
AFFECTED_KOMBU = ((5, 0), (6,))


def _within(version: tuple[Any, ...], bounds: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    numbers = tuple(part for part in version[:3] if isinstance(part, int))
    return bounds[0] <= numbers < bounds[1]


def affected() -> bool:
    """Whether the installed Celery and kombu have the crash this step guards against."""
    return _within(tuple(celery.VERSION), AFFECTED_CELERY) and _within(tuple(kombu.VERSION), AFFECTED_KOMBU)


class BrokerRestartGuard(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: no crash when the Redis broker restarts, and prefetched messages given back."""

    label = "Guardrails broker restart"
    # After Tasks: the consumer has reconnected and consumes again when start() gives messages back.
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.orphans: list[Any] = []  # default channels of lost connections, until their messages are back
        if app_value(c.app, "broker_restart_guard") and affected():
            original = c.on_connection_error_after_connected
            # On this consumer only: nothing changes for other kombu connections in the process.
            c.on_connection_error_after_connected = lambda exc: self.on_connection_lost(c, original, exc)
        super().__init__(c, **kwargs)

    def on_connection_lost(self, c: Any, original: Callable[[Any], None], exc: Any) -> None:
        connection = c.connection
        if connection is not None and is_redis_connection(connection):
            channel = connection._default_channel
            collect = connection.collect

            def collect_and_forget(*args: Any, **kwargs: Any) -> None:
                try:
                    collect(*args, **kwargs)
                finally:
                    # What collect() tore down is not closed a second time by the close() after it.
                    connection._default_channel = None

            connection.collect = collect_and_forget
            if channel is not None:
                self.orphans.append(channel)
        original(exc)

    def start(self, c: Any) -> None:
        """The consumer has reconnected: give back what the lost channels delivered and no task is running."""
        if not self.orphans:
            return
        # Delivery tags are unique (kombu makes a uuid per message), whichever channel delivered them.
        running = {request.message.delivery_tag for request in tuple(active_requests)}
        try:
            qos = c.connection.default_channel.qos
            for orphan in tuple(self.orphans):
                give_back(qos, orphan, running)
                self.orphans.remove(orphan)
        except Exception:  # never the worker's end: kombu gives them back after visibility_timeout anyway
            logger.exception(
                "Could not give back the messages delivered before the broker connection was lost; kombu "
                "redelivers them after the visibility_timeout"
            )


def give_back(qos: Any, orphan: Any, running: set[Any]) -> None:
    """Restore, through ``qos`` (a live channel's), what ``orphan`` delivered and is neither running nor acked."""
    delivered = orphan.qos._delivered
    idle = [tag for tag in tuple(delivered) if tag not in running and tag not in orphan.qos._dirty]
    for tag in idle:
        qos.restore_by_tag(tag)
        delivered.pop(tag, None)  # nothing left of it for the lost channel's own restore at shutdown
    if idle:
        logger.warning("Gave back %d message(s) delivered before the broker connection was lost", len(idle))
