"""Is this broker Redis? One answer, from a URL, an app's settings or a kombu connection.

A Redis broker changes what the extension does: a re-published message's countdown is capped below the
transport's ``visibility_timeout`` (:mod:`celery_guardrails.broker.delays`), the start-up warnings and the audit
grade the limits against it (GA501), the consumer's restart guard and the lease heartbeat act, and an unset
``store`` falls back to the broker's Redis. Each asks here, so a URL form cannot count as Redis for one and not
for another (``sentinel://`` was missed by two of four such tests: no warning, no finding).

The Redis URL forms (:data:`REDIS_SCHEMES`): ``redis://`` and ``rediss://`` (TLS), ``sentinel://`` (kombu's
``SentinelTransport``: the Sentinels name the master), ``redis+socket://`` (kombu: a unix socket) and
``unix://`` (redis-py: a unix socket; a store URL, which kombu does not read as a broker). A broker URL may be
a failover list (``"redis://a;redis://b"``, or a Python list): kombu connects with the first URL's transport and
tries the others in turn, so the first URL decides the kind, and :attr:`BrokerKind.uniform` says whether every
alternate has the same scheme.

A set ``broker_transport`` (a name such as ``"redis"`` or a class path such as the atomic pop's) wins over the
URL, as it does in kombu; a transport is Redis when its class is kombu's Redis ``Transport`` or a subclass
(:func:`is_redis_transport`: the same rule as for a connection, :func:`is_redis_connection`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: URL schemes (lower case) of a Redis server or of the Sentinels in front of one.
REDIS_SCHEMES = frozenset({"redis", "rediss", "sentinel", "redis+socket", "unix"})
#: URL schemes of Redis Sentinel: kombu's ``SentinelTransport``, the store's Sentinel client.
SENTINEL_SCHEMES = frozenset({"sentinel"})


@dataclass(frozen=True, slots=True, kw_only=True)
class BrokerKind:
    """What a broker is, from its settings alone (no connection made).

    ``scheme``: the first URL's scheme, lower case ("" when there is none). ``urls``: the URLs of a failover
    list, in order. ``redis``: kombu's Redis transport carries it (any of :data:`REDIS_SCHEMES`, or a
    ``broker_transport`` that is kombu's Redis transport or a subclass). ``sentinel``: through Redis Sentinel.
    ``uniform``: every URL of the list has the first one's scheme.
    """

    scheme: str = ""
    urls: tuple[str, ...] = ()
    redis: bool = False
    sentinel: bool = False
    uniform: bool = True


def urls_of(url: Any) -> tuple[str, ...]:
    """The URLs of a broker setting: a string (``;``-separated failover list) or a list of them; blanks dropped."""
    if url is None:
        return ()
    items: Iterable[Any] = url if isinstance(url, list | tuple) else [url]
    return tuple(part.strip() for item in items for part in str(item).split(";") if part.strip())


def scheme_of(url: str) -> str:
    """The scheme of one URL, lower case; "" when it has none."""
    head, separator, _ = url.strip().partition("://")
    return head.lower() if separator else ""


def is_redis(url: Any) -> bool:
    """Whether a broker (or store) URL is a Redis form (see the module docstring; a failover list: its first)."""
    urls = urls_of(url)
    return bool(urls) and scheme_of(urls[0]) in REDIS_SCHEMES


def is_sentinel(url: Any) -> bool:
    """Whether a URL (a failover list: its first) reaches Redis through Sentinel."""
    urls = urls_of(url)
    return bool(urls) and scheme_of(urls[0]) in SENTINEL_SCHEMES


def kind_of_url(url: Any) -> BrokerKind:
    """The :class:`BrokerKind` of a broker URL setting (a string, a ``;``-list or a list)."""
    urls = urls_of(url)
    schemes = [scheme_of(item) for item in urls]
    first = schemes[0] if schemes else ""
    return BrokerKind(
        scheme=first,
        urls=urls,
        redis=first in REDIS_SCHEMES,
        sentinel=first in SENTINEL_SCHEMES,
        uniform=all(scheme == first for scheme in schemes),
    )


def is_redis_transport(transport: Any) -> bool:
    """Whether a kombu transport class is kombu's Redis one (``SentinelTransport`` and the atomic pop's too)."""
    from kombu.transport import redis as kombu_redis

    return isinstance(transport, type) and issubclass(transport, kombu_redis.Transport)


def is_sentinel_transport(transport: Any) -> bool:
    from kombu.transport import redis as kombu_redis

    return isinstance(transport, type) and issubclass(transport, kombu_redis.SentinelTransport)


def is_redis_connection(connection: Any) -> bool:
    """Whether a kombu connection's transport is kombu's Redis one (the atomic pop's and Sentinel's included)."""
    return is_redis_transport(type(getattr(connection, "_transport", None)))


def broker_urls(app: Any, *, write: bool = False) -> Any:
    """The broker URL setting a worker reads with (``broker_read_url``) or publishes with (``write``)."""
    conf = app.conf
    return (conf.broker_write_url if write else conf.broker_read_url) or conf.broker_url


def broker_kind(app: Any, *, write: bool = False) -> BrokerKind:
    """The :class:`BrokerKind` of ``app``'s broker: its URL, unless ``broker_transport`` names the transport."""
    kind = kind_of_url(broker_urls(app, write=write))
    transport = app.conf.broker_transport
    if not transport:
        return kind
    from kombu.transport import resolve_transport

    try:
        resolved = resolve_transport(transport) if isinstance(transport, str) else transport
    except (KeyError, ImportError, AttributeError, ValueError):
        return BrokerKind(scheme=kind.scheme, urls=kind.urls, uniform=kind.uniform)
    return BrokerKind(
        scheme=kind.scheme,
        urls=kind.urls,
        redis=is_redis_transport(resolved),
        sentinel=is_sentinel_transport(resolved),
        uniform=kind.uniform,
    )
