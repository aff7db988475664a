"""Is the broker Redis: one rule for every URL form, and the Sentinel cap on a real Sentinel.

The URL rule is a table (every Redis URL form, failover lists, lists, the other brokers); it agrees with the
transport rule kombu's own URL parsing leads to. The Sentinel test runs a real master, replica and Sentinel of its
own (``tests/support/redis_sentinel.py``), a worker whose broker is ``sentinel://``, and a task asking for a
retry far longer than the transport's ``visibility_timeout``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.signals import before_task_publish
from kombu import Connection

from celery_guardrails import GuardedTask, RetryLater
from celery_guardrails.broker import atomic_pop
from celery_guardrails.broker.delays import VISIBILITY_SHARE, countdown_for
from celery_guardrails.broker.kind import (
    BrokerKind,
    broker_kind,
    is_redis,
    is_redis_connection,
    is_redis_transport,
    is_sentinel,
    kind_of_url,
)
from celery_guardrails.operations.audit import audit, startup_rules
from celery_guardrails.runtime.install import warn_about
from tests.support.logs import Caught
from tests.support.redis_sentinel import MASTER_NAME, Sentinel
from tests.support.services import REDIS_URL, require
from tests.support.waiting import BOUND, wait_for


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


VISIBILITY = 4.0


def sentinel_app(setup: Sentinel, queue_name: str) -> Celery:
    app = Celery(f"sentinel-{queue_name}", set_as_current=False)
    app.conf.update(
        broker_url=f"sentinel://127.0.0.1:{setup.sentinel}",
        broker_transport_options={"master_name": MASTER_NAME, "visibility_timeout": VISIBILITY},
        result_backend=REDIS_URL,
        task_default_queue=queue_name,
        broker_connection_retry_on_startup=False,
        worker_hijack_root_logger=False,
        guardrails={
            "store": setup.url,
            "dead_letter_sinks": ["redis"],
            "activity": False,
            "outbox_relay": False,
            "watchdog": False,
            "owners": {"*": "platform"},
        },
    )
    return app


def test_a_long_retry_on_a_sentinel_broker_is_capped_below_the_visibility_timeout_and_runs_once(
    redis_sentinel: Sentinel, queue_name: str
) -> None:
    require("redis")  # the results
    # Given a worker on a real Sentinel (its own master, replica and Sentinel), a 4 s visibility timeout, and a
    # task that asks to be run again in 60 s (backoff_max 600 s by default: the task's own ask is kept)
    app = sentinel_app(redis_sentinel, queue_name)
    master = redis_sentinel.node(redis_sentinel.master_port())
    runs = f"runs:{queue_name}"

    @app.task(shared=False, name=f"tests.sentinel.{queue_name}", base=GuardedTask, bind=True, idempotent=True)
    def later(self: Any) -> str:
        if master.incr(runs) == 1:
            raise RetryLater("not yet", delay=60.0)
        return "done"

    etas: list[float] = []

    def published(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == later.name and (headers or {}).get("eta"):
            from datetime import datetime

            etas.append(datetime.fromisoformat(headers["eta"]).timestamp() - time.time())

    before_task_publish.connect(published, weak=False)
    caught = Caught()
    logger = logging.getLogger("celery_guardrails.runtime.install")
    level, logger.level = logger.level, logging.INFO
    logger.addHandler(caught)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=BOUND):
            # When it runs, and is retried
            result = later.delay()
            assert result.get(timeout=BOUND) == "done"
            # And the retried delivery is acked: nothing is left on the master that kombu could give back
            wait_for("the delivery acked", lambda: master.hlen("unacked") == 0)
    finally:
        before_task_publish.disconnect(published)
        logger.removeHandler(caught)
        logger.setLevel(level)
    # Then the retry was published with a countdown capped at 9/10 of the visibility timeout, not 60 s
    (countdown,) = etas
    assert countdown <= VISIBILITY_SHARE * VISIBILITY
    # And the task ran twice: its first attempt and the retry, once (no second delivery of the retry)
    assert int(master.get(runs) or 0) == 2
    assert master.llen(queue_name) == 0 and master.zcard("unacked_index") == 0
    # And the worker warned at start-up, as the audit grades it: the 600 s backoff_max and the retry_later waits
    # are not shorter than the Sentinel broker's visibility timeout (GA501)
    logged = [record.getMessage() for record in caught.records]
    assert any(f"GA501 {later.name}: backoff_max 600 s" in line for line in logged), logged


def test_a_sentinel_broker_gets_the_visibility_finding_in_the_audit_and_at_start_up(tmp_path: Any) -> None:
    # Given the same task on a redis:// broker, a sentinel:// one, and RabbitMQ, with a 300 s visibility timeout
    found = {}
    for url in ("redis://127.0.0.1:6379/0", "sentinel://127.0.0.1:26379", "amqp://guest@127.0.0.1//"):
        app = Celery(set_as_current=False, broker=url)
        app.conf.broker_transport_options = {"master_name": "m", "visibility_timeout": 300}
        app.conf.guardrails = {"store": "redis://127.0.0.1:6379/0"}

        @app.task(shared=False, name="kind.slow", base=GuardedTask, bind=True, idempotency_key="s:{n}")
        def slow(self: Any, n: int) -> None: ...

        report = audit(app, source=tmp_path)
        at_start = startup_rules(app)
        caught = Caught()
        logger = logging.getLogger("celery_guardrails.runtime.install")
        logger.addHandler(caught)
        try:
            warn_about(app, [slow])
        finally:
            logger.removeHandler(caught)
        found[url.split(":")[0]] = (
            [f.message for f in report.findings if (f.code, f.subject) == ("GA501", "kind.slow")],
            [f.message for f in at_start if (f.code, f.subject) == ("GA501", "kind.slow")],
            [r.getMessage() for r in caught.records if "GA501 kind.slow:" in r.getMessage()],
        )
    # Then Sentinel is graded as plain Redis is, at start-up as in the audit, and RabbitMQ is not
    message = "backoff_max 600 s: not shorter than the Redis visibility_timeout 300 s: the message is delivered twice"
    assert found["redis"][:2] == found["sentinel"][:2] == ([message], [message])
    assert found["sentinel"][2] == found["redis"][2] and len(found["redis"][2]) == 1
    assert found["amqp"] == ([], [], [])
