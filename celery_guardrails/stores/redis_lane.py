"""A connection of the Redis store's own, one per thread, for the scripts a task runs on its way (idempotency
claims and completions, retry-budget admissions and outcomes).

Why: redis-py's pool checks each connection it hands out for unread data (a non-blocking read: two socket
timeout changes and a failed ``recv``, besides the pool's lock). On this path, two calls per task, that cost
as much CPU as the guardrails' own Python. A connection that only one thread uses, and whose every answer is
read, needs no such check.

One answer may be left in flight (:meth:`Lane.send`): the completion sent as the body returns. The next
command on the same thread reads it first, so answers are never mixed up; its waiter then gets the answer
that was read for it. Any error is the caller's to settle through the pooled client, which loads missing
scripts and retries broken connections, as redis-py retries its own: every idempotency transition is safe to
repeat for its owner (a budget count may count twice, as with redis-py's own retry).

Not under green threads: gevent and eventlet make ``threading.local`` local to a greenlet, and Celery's green
pools run each task in a new greenlet, so a lane there would open a connection per task. There
``Lane.available`` is False and the store uses its pooled client. So it is on a Redis Cluster, whose client
sends each command to the node that serves its key's slot (and follows that slot when it moves).
"""

from __future__ import annotations

import _thread
import os
import threading
from collections.abc import Callable
from typing import Any


def _connected(connection: Any) -> None:
    """Connect ``connection`` the way its class does (nothing when it is connected already).

    redis-py's ``send_command`` connects a closed connection by itself, but through the base class's
    ``connect_check_health``, past a subclass's ``connect``: a Sentinel-managed connection would connect to
    its default address (localhost:6379), not to the master the Sentinels name (redis-py 6.4,
    ``Connection.send_packed_command``). Its pool calls ``connect()`` first; so does the lane.
    """
    connection.connect()


class InFlight:
    """The answer of a command sent and not read yet."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.settled = False
        self.value: Any = None
        self.error: BaseException | None = None

    def settle(self) -> None:
        """Read the answer (once); an error is kept for :meth:`read`. Whatever interrupts the read (an error,
        or a soft time limit raised into the thread), the connection is dropped: an answer left unread on it
        would be taken for the next command's."""
        if self.settled:
            return
        self.settled = True
        try:
            self.value = self.connection.read_response()
        except BaseException as exc:
            self.connection.disconnect()
            if not isinstance(exc, Exception):
                raise
            self.error = exc  # raised to the waiter, whoever read it

    def read(self) -> Any:
        self.settle()
        if self.error is not None:
            raise self.error
        return self.value


class Lane:
    """Per-thread connections made with a pool's settings (they never enter the pool)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.local = threading.local()
        #: False when ``threading.local`` was patched for green threads (see the module docstring), or
        #: without a pool (a Redis Cluster: its client picks a node per command).
        self.available = pool is not None and threading.local is _thread._local

    def _ready(self) -> Any:
        local = self.local
        if getattr(local, "pid", None) != os.getpid():  # first use in this thread, or a forked child
            # A connection inherited across fork is the parent's socket: left alone, never closed here.
            local.connection = self.pool.connection_class(**self.pool.connection_kwargs)
            local.pid = os.getpid()
            local.in_flight = None
        in_flight: InFlight | None = local.in_flight
        if in_flight is not None:
            local.in_flight = None
            in_flight.settle()
        return local.connection

    def call(self, *command: Any) -> Any:
        """Send ``command`` and read its answer (redis-py's errors are raised). Anything that interrupts it
        between the send and the read (an error, a soft time limit raised into the thread) drops the
        connection: its answer, left unread, would be read as the next command's."""
        connection = self._ready()
        try:
            _connected(connection)
            connection.send_command(*command)
            return connection.read_response()
        except BaseException:
            connection.disconnect()
            raise

    def send(self, *command: Any) -> Callable[[], Any]:
        """Send ``command``; the callable reads its answer (call it from the same thread)."""
        connection = self._ready()
        try:
            _connected(connection)
            connection.send_command(*command)
        except BaseException:
            connection.disconnect()
            raise
        in_flight = self.local.in_flight = InFlight(connection)
        return in_flight.read
