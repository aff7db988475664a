"""The outbox relay in every worker: a bootstep thread that publishes the transactional outbox's rows.

The outbox itself (rows written in the caller's transaction, the relay's claim, publish and delete) is Django's:
see :mod:`django_celery_guardrails.outbox`. This step runs :func:`~django_celery_guardrails.outbox.relay` every
``outbox_relay_interval`` seconds (at once again while batches come back full) in each worker's main process,
when ``outbox_relay`` is on (default) and the ``django_celery_guardrails`` app is installed. Workers share the
rows (SKIP LOCKED on PostgreSQL). A relay failure (the database away) is logged, never the worker's end: the rows
wait in the database. ``manage.py guardrails_outbox_relay`` runs the same loop where no worker should.

The relay publishes on a connection of its own (:class:`RelayPublisher`), held from pass to pass. On RabbitMQ
(kombu's py-amqp transport) it has publisher confirms on whatever ``broker_transport_options`` say: AMQP's
``basic.publish`` is asynchronous, and without confirms a publish the broker refuses (an exchange that does not
exist: a channel error 404 NOT_FOUND) returns as if it were sent; the row would be deleted, and the refusal,
read later on that channel, would fail the next publish instead. With confirms each publish waits for the
broker's ``basic.ack``, and a refusal raises in that publish, for that row. Its publishes are also
``mandatory``: a message no queue is bound to take comes back (``basic.return``, before the ack) and fails its
own publish instead of being confirmed and dropped. A channel that failed a publish (or timed out waiting for its
confirm) is not used again: the connection is closed and the next publish opens another, so that no late
confirm or return of one row is read as another's. Other transports (Redis) have no confirms: their publish is
a synchronous command that raises, or has stored the message, when it returns; the relay uses the app's own
producer pool there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import bootsteps

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.options import APP, Option, app_value, checks, declare
from celery_guardrails.stores import django_apps_installed

logger = logging.getLogger(__name__)

#: Seconds the relay waits for RabbitMQ to confirm one publish. Past it the publish counts as failed for want of
#: the broker (the row is kept, no attempt spent): it may have been stored all the same, so the row may be
#: published twice (at least once, as ever).
CONFIRM_TIMEOUT = 30.0


#: The options the outbox relay reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="outbox_relay",
        default=True,
        doc="Django: each worker runs the transactional outbox's relay in a thread, publishing the messages "
        "enqueued with enqueue_in_transaction / outbox=True once their transaction committed. False: run "
        "manage.py guardrails_outbox_relay instead.",
        check=checks.boolean,
        scopes=frozenset({APP}),
    ),
    Option(
        name="outbox_relay_interval",
        default=1.0,
        doc="Seconds between two relay passes when the outbox is empty (a full batch is followed by the next "
        "at once): the relay's lag when idle.",
        check=checks.seconds,
        scopes=frozenset({APP}),
    ),
    Option(
        name="outbox_relay_lease",
        default=60.0,
        doc="Seconds a relay's claimed outbox messages stay hidden from other relays while it publishes them; "
        "a relay that dies mid-batch leaves them to be published again after this (at least once).",
        check=checks.seconds,
        scopes=frozenset({APP}),
    ),
    Option(
        name="outbox_batch",
        default=100,
        doc="Outbox messages a relay pass claims and publishes at most.",
        check=checks.positive_int,
        scopes=frozenset({APP}),
    ),
    Option(
        name="outbox_max_attempts",
        default=12,
        doc="Publishes of one outbox message that may fail (an unknown task, a refused publish, arguments "
        "that do not encode) before it becomes a dead letter unpublishable, removed with the record's "
        "transaction. The waits between them double from 1 s to 5 minutes: 12 spans about 18 minutes, longer "
        "than a rolling deployment in which an older worker's relay may not know a new task yet. A broker "
        "that cannot be reached spends none.",
        check=checks.positive_int,
        scopes=frozenset({APP}),
    ),
)


def confirms_apply(app: Any) -> bool:
    """Whether ``app``'s broker is RabbitMQ through kombu's py-amqp transport (``amqp://``, ``amqps://``,
    ``pyamqp://``): the one transport with publisher confirms. Opens no connection."""
    from kombu.transport.pyamqp import Transport

    from celery_guardrails.broker.delays import transport_class

    transport = transport_class(app)  # no kombu Connection made (see transport_class: a fork-time import lock)
    return isinstance(transport, type) and issubclass(transport, Transport)


def confirms_off(app: Any) -> bool:
    """Whether ``app`` publishes to RabbitMQ without publisher confirms (``broker_transport_options`` without
    ``confirm_publish=True``, Celery's default): the app's own publishes are not confirmed. The outbox relay's
    are, whatever this says (:class:`RelayPublisher`). False when it cannot be told (a broker URL kombu cannot
    read is the worker's to say): the audit (GA005) and the deployment check (guardrails.W105) ask it."""
    try:
        options = app.conf.broker_transport_options or {}
        return confirms_apply(app) and not options.get("confirm_publish")
    except Exception:
        return False


class Unroutable(Exception):
    """RabbitMQ returned a relayed message (``basic.return``): no queue is bound to take it where it was sent."""


class RelayPublisher:
    """The outbox relay's producer (see the module docstring): on RabbitMQ, a connection of its own with
    publisher confirms, publishes ``mandatory``, and a fresh channel after any failure; elsewhere the app's pool.
    Used by one thread at a time; :meth:`close` when done."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.confirms = confirms_apply(app)
        self._connection: Any = None
        self._producer: Any = None
        self._returned: list[str] = []

    def send(self, publish: Callable[..., Any]) -> None:
        """Call ``publish(**extra)`` (a task's ``apply_async`` with its arguments bound), ``extra`` being the
        relay's producer and publish options; raises when the broker did not take the message."""
        if not self.confirms:
            publish()
            return
        self._returned.clear()
        try:
            publish(producer=self._ready(), mandatory=True, confirm_timeout=CONFIRM_TIMEOUT)
        except BaseException:
            # A channel the broker closed, or one whose confirm did not come in time: its late frames must not be
            # read as the next row's confirm. A connection of its own costs a reconnect per failure only.
            self.close()
            raise
        if self._returned:
            raise Unroutable("; ".join(self._returned))

    def _ready(self) -> Any:
        if self._producer is None:
            self._connection = self.app.connection_for_write(transport_options={"confirm_publish": True})
            # A channel, not the connection: kombu registers ``on_return`` only on a concrete channel (and again
            # on the channel a reconnect gives it).
            self._producer = self.app.amqp.Producer(self._connection.default_channel, on_return=self._on_return)
        return self._producer

    def _on_return(self, exc: BaseException, exchange: str, routing_key: str, message: Any) -> None:
        # py-amqp calls this while it waits for the publish's confirm: the return comes before the ack.
        self._returned.append(f"{exc} (exchange {exchange!r}, routing key {routing_key!r})")

    def close(self) -> None:
        producer, connection, self._producer, self._connection = self._producer, self._connection, None, None
        for closing in (producer, connection):
            if closing is not None:
                try:
                    closing.release()
                except Exception:  # a connection the broker dropped: nothing left to close
                    logger.debug("Outbox relay: closing its broker connection failed", exc_info=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Outbox:
    """The transactional outbox's operations, given to the core by the Django app as it is ready
    (:func:`register`): the core does not import the Django app."""

    #: ``enqueue(task, args, kwargs, task_id=..., **options)``: the message written in the caller's transaction,
    #: its ``AsyncResult`` (``apply_async(..., outbox=True)``).
    enqueue: Callable[..., Any]
    #: ``relay_loop(app, stopping)``: relay until ``stopping`` is set (the worker's bootstep runs it).
    relay_loop: Callable[[Any, threading.Event], None]
    #: ``backlog()``: (messages waiting, seconds since the oldest was written, None when there is none).
    backlog: Callable[[], tuple[int, float | None]]


_registered: Outbox | None = None


def register(outbox: Outbox) -> None:
    """Make ``outbox`` the one GuardedTask writes to and workers relay (``django_celery_guardrails``'
    ``AppConfig.ready`` calls this)."""
    global _registered
    _registered = outbox


def registered() -> Outbox:
    """The outbox the Django app registered; ConfigurationError when there is none (the app is not installed, or
    Django is not set up in this process)."""
    if _registered is None:
        raise ConfigurationError(
            "outbox",
            "the transactional outbox needs the Django app django_celery_guardrails in INSTALLED_APPS, set up "
            "(django.setup(), which a Django project's worker and web process do)",
        )
    return _registered


class OutboxRelayStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: the outbox relay thread (see the module docstring)."""

    label = "Guardrails outbox relay"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        super().__init__(parent, **kwargs)

    def start(self, parent: Any) -> None:
        app = parent.app
        outbox = _registered  # registered whenever the Django app is ready (django_apps_installed)
        if not app_value(app, "outbox_relay") or not django_apps_installed() or outbox is None:
            return
        self.thread = threading.Thread(
            target=outbox.relay_loop, args=(app, self.stopping), name="guardrails-outbox-relay", daemon=True
        )
        self.thread.start()

    def stop(self, parent: Any) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=10)  # a batch under way finishes; its rows are deleted

    terminate = stop
