"""The broker patches and readers: kombu's Redis transport with an atomic pop, the broker lease heartbeat,
the consumer's restart guard, what a re-published message may ask of its broker (countdowns, headers), and
reading queue depths without consuming. Each replaces or extends one piece of kombu or Celery, and says which.
"""

from __future__ import annotations

from celery_guardrails.options import APP, Option, checks, declare

#: The options of the broker patches, declared here, in the layer's package, rather than in each patch: the schema is
#: complete without importing kombu's Redis transport (atomic_pop imports it).
DECLARED = declare(
    Option(
        name="broker_restart_guard",
        default=True,
        doc="Redis broker, Celery 5.7: a worker outlives a restart of the broker's Redis (else it stops with "
        "\"'NoneType' object has no attribute 'hostname'\"), and the messages it had prefetched are given "
        "back to their queues as it reconnects, not after the visibility_timeout. False: Celery's own "
        "behaviour. See celery_guardrails.broker.restart_guard.",
        check=checks.boolean,
        scopes=frozenset({APP}),
    ),
    Option(
        name="broker_atomic_pop",
        default=True,
        doc="Redis broker (redis:// URL, no broker_transport set): the worker takes a message and records it "
        "as handed out in one step on the server, so a worker killed in between cannot lose it (kombu's BRPOP "
        "does it in two: celery/kombu#305). False: kombu's pop. See celery_guardrails.broker.atomic_pop.",
        check=checks.boolean,
        scopes=frozenset({APP}),
    ),
    Option(
        name="broker_lease",
        default=True,
        doc="Redis broker: while a worker holds a delivery (running, prefetched, or waiting for its ETA), a "
        "thread pushes its entry in kombu's unacked index forward, so a task longer than the visibility_timeout "
        "is not delivered again while it runs, and is redelivered the visibility_timeout (plus one kombu "
        "restore period) after its worker died. False: kombu's fixed visibility_timeout. See "
        "celery_guardrails.broker.lease.",
        check=checks.boolean,
        scopes=frozenset({APP}),
    ),
    Option(
        name="broker_lease_interval",
        default=None,
        doc="Seconds between two extensions of the held deliveries; None: a third of the broker's "
        "visibility_timeout. Set it below a third of the shortest visibility_timeout of the apps sharing the "
        "broker's Redis (the shortest one restores for all: celery/celery#5935).",
        check=checks.optional(checks.seconds),
        scopes=frozenset({APP}),
    ),
    Option(
        name="rabbitmq_consumer_timeout",
        default=1800.0,
        doc="RabbitMQ broker: the server's consumer_timeout in seconds (RabbitMQ's default is 30 minutes; "
        "it cannot be read over AMQP). A worker warns at start-up about each guarded task whose time_limit is "
        "unset or longer than it (or than a task queue's x-consumer-timeout argument).",
        check=checks.seconds,
        scopes=frozenset({APP}),
    ),
)
