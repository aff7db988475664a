"""What a re-published message may ask of its broker: the countdown it accepts, the headers it must not get back.

Every re-publish of a running message (a guarded retry, ``RetryLater``, the guardrails' own waits, a store
outage's backoff, a pending dead letter, the body's ``self.retry()``) passes :func:`countdown_for` and
:func:`republishable_headers` (see :func:`celery_guardrails.runtime.outcomes.republish`).

Countdowns:

* RabbitMQ with quorum queues: Celery (5.5+) sends a message with a countdown or an ETA through its native
  delayed delivery (the ``celery_delayed_*`` exchanges and queues its worker declares) when any of the app's
  queues is a quorum queue and the route's exchange is not a direct one. It takes whole seconds only:
  ``int(countdown)``, and kombu's ``calculate_routing_key`` raises ``ValueError("countdown must be a positive
  number")`` below 1 s (``send_task`` in celery/app/base.py, ``kombu.transport.native_delayed_delivery``;
  the guarded retry turned that refusal into a requeue loop). So on such an app every
  positive countdown is rounded UP to whole seconds, at least 1 s: a wait of 0.2 s becomes 1 s, 1.5 s becomes
  2 s (never a refused publish, never a message due before its time). On a direct exchange Celery publishes
  with the ETA and the worker holds the message until then; the delays are rounded there too (the rule is
  decided per app, not per route), which costs at most a second.
* Redis: at most nine tenths of the transport's ``visibility_timeout`` (a message held by a worker longer is
  delivered to another one as well: kombu takes it for lost).
* A countdown of 0 stays 0: Celery publishes it at once, with no delay exchange.

The rule is decided once per app and broker configuration (:func:`delay_rule`): whether the broker is Redis
(:func:`celery_guardrails.broker.kind.broker_kind`: ``redis://``, ``rediss://``, ``sentinel://``,
``redis+socket://`` and the guardrails' own Redis transport count) and the app's declared queues; no broker
round trip.

Headers: RabbitMQ adds its own to a message it dead-letters or redelivers (``x-death``,
``x-first-death-*``, ``x-last-death-*``, quorum queues' ``x-delivery-count``, and a shovel's or federation's
``x-received-from`` / ``x-shovelled``). Copied into the new message, ``x-death`` makes RabbitMQ see a
dead-letter cycle on the message's second trip through the delay queues, and the message stays parked in
``celery_delayed_*``: lost. They are never copied; a header of the application's own named ``x-...`` is kept.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Headers RabbitMQ sets on a message it dead-letters, redelivers from a quorum queue, shovels or federates.
BROKER_HEADERS = frozenset(
    {
        "x-death",
        "x-delivery-count",
        "x-received-from",
        "x-shovelled",
        "x-shovelled-timestamp",
    }
)
#: Prefixes of the other headers RabbitMQ sets (the first and last dead-lettering; AMQP 1.0 annotations).
BROKER_HEADER_PREFIXES = ("x-first-death-", "x-last-death-", "x-opt-")
#: Quorum queues: how many times the message was delivered before and given back (absent on a first delivery).
DELIVERY_COUNT = "x-delivery-count"
#: Share of Redis's ``visibility_timeout`` a countdown may take at most.
VISIBILITY_SHARE = 0.9
#: Seconds Redis's ``visibility_timeout`` is when the app sets none (kombu's default).
DEFAULT_VISIBILITY = 3600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DelayRule:
    """What countdowns an app's broker accepts.

    ``longest``: seconds a countdown may be at most (infinite where there is no bound). ``whole_seconds``: a
    positive countdown goes through RabbitMQ's native delayed delivery, which takes whole seconds of at least 1.
    """

    longest: float = math.inf
    whole_seconds: bool = False


_RULES: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], DelayRule]] = weakref.WeakKeyDictionary()


def _fingerprint(app: Any) -> tuple[Any, ...]:
    """What the rule depends on: the broker settings, and the declared queues (a queue may be added later)."""
    conf = app.conf
    options = conf.broker_transport_options or {}
    return (
        str(conf.broker_write_url or conf.broker_url or ""),
        str(conf.broker_transport or ""),
        options.get("visibility_timeout") if isinstance(options, Mapping) else None,
        len(app.amqp.queues),
    )


def delay_rule(app: Any) -> DelayRule:
    """The countdown rule of ``app`` (worked out once per app and broker configuration; see the module)."""
    fingerprint = _fingerprint(app)
    cached = _RULES.get(app)
    if cached is not None and cached[0] == fingerprint:
        return cached[1]
    rule = _work_out(app)
    _RULES[app] = (fingerprint, rule)
    return rule


def transport_class(app: Any) -> Any:
    """The kombu transport class of ``app``'s broker (None when kombu does not know it), from its settings alone.

    Not through ``app.connection_for_write()``: a kombu ``Connection`` for ``amqp://`` tries ``import
    librabbitmq`` each time it is made (``kombu.transport.supports_librabbitmq``; a failed import is not cached),
    and a prefork child that imports while a thread of its parent held that module's import lock at the fork
    waits for it for ever (seen: a child hung in its first retry while the outbox relay thread was connecting at
    the worker's start). Naming the transport imports only kombu's transport module, which the worker has.
    """
    from kombu.transport import resolve_transport

    from celery_guardrails.broker.kind import kind_of_url

    conf = app.conf
    # The first URL of a failover list, its scheme before a "+" as kombu reads it ("redis+socket" is "redis").
    scheme = kind_of_url(conf.broker_write_url or conf.broker_url).scheme.partition("+")[0]
    name = conf.broker_transport or scheme or "amqp"
    try:
        return resolve_transport(name)
    except (KeyError, ImportError, AttributeError, ValueError):
        return None


def _work_out(app: Any) -> DelayRule:
    from celery.utils.quorum_queues import detect_quorum_queues

    from celery_guardrails.broker.kind import broker_kind

    if broker_kind(app, write=True).redis:
        return DelayRule(longest=VISIBILITY_SHARE * visibility_timeout(app))
    driver = str(getattr(transport_class(app), "driver_type", "") or "")
    # The same test Celery's send_task makes before it routes a countdown through celery_delayed_27.
    return DelayRule(whole_seconds=bool(detect_quorum_queues(app, driver)[0]))


def visibility_timeout(app: Any) -> float:
    """Seconds of the Redis transport's ``visibility_timeout`` (``broker_transport_options``; unset or 0: kombu's
    default): the cap of a countdown here, the threshold of the audit's GA501 and the worker's start-up warning."""
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", DEFAULT_VISIBILITY) or DEFAULT_VISIBILITY)


def countdown_for(app: Any, countdown: float) -> float:
    """``countdown`` (seconds) as ``app``'s broker accepts it: not below 0, at most the rule's ``longest``, and
    rounded up to whole seconds (at least 1) where native delayed delivery carries it."""
    rule = delay_rule(app)
    seconds = min(max(0.0, float(countdown)), rule.longest)
    if rule.whole_seconds and seconds > 0:
        return float(max(1, math.ceil(seconds)))
    return seconds


def is_broker_header(name: Any) -> bool:
    """Whether a message header is one RabbitMQ set (see :data:`BROKER_HEADERS`)."""
    if not isinstance(name, str):
        return False
    lowered = name.lower()
    return lowered in BROKER_HEADERS or lowered.startswith(BROKER_HEADER_PREFIXES)


def republishable_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of a message's headers without those the broker set (never copied into a re-publish)."""
    return {name: value for name, value in (headers or {}).items() if not is_broker_header(name)}


def delivery_count(request: Any) -> int | None:
    """Quorum queues: how many times the broker delivered the running message before (``x-delivery-count``), or
    None where the broker does not count (a classic queue, Redis, a first delivery) or the value is not a whole
    number of at least 0."""
    value = (getattr(request, "headers", None) or {}).get(DELIVERY_COUNT)
    if value is None:
        value = vars(request).get(DELIVERY_COUNT) if hasattr(request, "__dict__") else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value
