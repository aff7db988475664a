"""Is the broker Redis: one rule for every URL form, and the Sentinel cap on a real Sentinel.

The URL rule is a table (every Redis URL form, failover lists, lists, the other brokers); it agrees with the
transport rule kombu's own URL parsing leads to. The Sentinel test runs a real master, replica and Sentinel of its
own (``tests/support/redis_sentinel.py``), a worker whose broker is ``sentinel://``, and a task asking for a
retry far longer than the transport's ``visibility_timeout``.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from celery_guardrails.broker import atomic_pop
from celery_guardrails.broker.delays import countdown_for
from celery_guardrails.broker.kind import (
    BrokerKind,
    broker_kind,
    is_redis,
    is_redis_connection,
    is_redis_transport,
    is_sentinel,
    kind_of_url,
)


@pytest.mark.parametrize(
    ("url", "redis", "sentinel"),
    [
        ("redis://127.0.0.1:6379/0", True, False),
        ("REDIS://127.0.0.1:6379/0", True, False),
        ("rediss://:secret@cache:6380/1?ssl_cert_reqs=required", True, False),
        ("sentinel://127.0.0.1:26379", True, True),
        ("sentinel://h1:26379;sentinel://h2:26379/1", True, True),
        ("unix:///var/run/redis.sock?db=1", True, False),
        ("redis+socket:///var/run/redis.sock", True, False),
        ("redis://a:6379/0;redis://b:6379/0", True, False),
        (["redis://a:6379/0", "redis://b:6379/0"], True, False),
        ([" sentinel://a:26379 ", "sentinel://b:26379"], True, True),
        ("redis://a:6379/0;amqp://guest@b//", True, False),  # kombu connects with the first URL's transport
        ("amqp://guest:guest@127.0.0.1:5672//", False, False),
        ("amqp://guest@a//;redis://b:6379/0", False, False),
        ("pyamqp://guest@127.0.0.1//", False, False),
        ("sqs://", False, False),
        ("memory://", False, False),
        ("redis+cluster://h:7000", False, False),  # a store's Redis Cluster: kombu has no such broker transport
        ("redis", False, False),  # a transport name, not a URL
        ("", False, False),
        (None, False, False),
        ([], False, False),
    ],
)
def test_is_redis_knows_every_redis_url_form(url: Any, redis: bool, sentinel: bool) -> None:
    assert (is_redis(url), is_sentinel(url)) == (redis, sentinel)
    kind = kind_of_url(url)
    assert (kind.redis, kind.sentinel) == (redis, sentinel)


def test_a_failover_list_is_decided_by_its_first_url_and_says_whether_it_is_uniform() -> None:
    assert kind_of_url("redis://a;redis://b") == BrokerKind(
        scheme="redis", urls=("redis://a", "redis://b"), redis=True, uniform=True
    )
    assert kind_of_url(["redis://a", "rediss://b"]).uniform is False


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", "rediss://127.0.0.1:6380/0", "sentinel://127.0.0.1:26379", "redis+socket:///x.sock"],
)
def test_the_url_rule_and_the_connection_rule_agree_for_each_url_kombu_reads(url: str) -> None:
    # kombu reads the URL (no connection made): the transport it picks is kombu's Redis one, as the URL rule says
    connection = Connection(url)
    assert is_redis(url) and is_redis_transport(type(connection.transport))
    assert is_redis_connection(connection)
    assert not is_redis_connection(Connection("amqp://guest@127.0.0.1//"))


@pytest.mark.parametrize(
    ("conf", "redis", "sentinel"),
    [
        ({"broker_url": "sentinel://127.0.0.1:26379"}, True, True),
        ({"broker_url": "redis+socket:///x.sock"}, True, False),
        ({"broker_url": "redis://127.0.0.1:6379/0", "broker_transport": atomic_pop.TRANSPORT}, True, False),
        ({"broker_url": "amqp://guest@127.0.0.1//", "broker_transport": "redis"}, True, False),
        ({"broker_url": "redis://127.0.0.1:6379/0", "broker_transport": "pyamqp"}, False, False),
        ({"broker_url": "redis://127.0.0.1:6379/0", "broker_transport": "no.such:Transport"}, False, False),
        ({"broker_url": "amqp://guest@127.0.0.1//", "broker_read_url": "sentinel://h:26379"}, True, True),
    ],
)
def test_the_broker_kind_of_an_app_follows_a_set_transport(conf: dict[str, str], redis: bool, sentinel: bool) -> None:
    app = Celery(set_as_current=False)
    app.conf.update(conf)
    kind = broker_kind(app)
    assert (kind.redis, kind.sentinel) == (redis, sentinel)


def test_every_redis_broker_caps_a_countdown_below_its_visibility_timeout() -> None:
    # Given apps on each Redis broker form kombu reads, with a 100 s visibility timeout
    for url in ("redis://h:6379/0", "rediss://h:6380/0", "sentinel://h:26379", "redis+socket:///x.sock"):
        app = Celery(set_as_current=False, broker=url)
        app.conf.broker_transport_options = {"visibility_timeout": 100}
        # Then a 500 s countdown is capped at 9/10 of it (redis+socket:// was not capped before: its scheme was
        # looked up whole, "redis+socket", which kombu names no transport)
        assert countdown_for(app, 500.0) == 90.0, url


def test_the_atomic_pop_is_not_chosen_for_a_sentinel_broker() -> None:
    # Its channel talks to one Redis as kombu's plain Redis channel does: through Sentinel it would take the
    # Sentinel for the master. A Sentinel broker keeps kombu's SentinelTransport.
    for url in ("sentinel://127.0.0.1:26379", ["sentinel://a:26379", "sentinel://b:26379"], "redis://a;sentinel://b"):
        app = Celery(set_as_current=False)
        app.conf.broker_url = url
        assert atomic_pop.configure(app) is False
    app = Celery(set_as_current=False)
    app.conf.broker_url = ["redis://a:6379/0", "redis://b:6379/0"]
    assert atomic_pop.configure(app) is True
