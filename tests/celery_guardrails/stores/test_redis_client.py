"""Store URLs: one server, a Redis Cluster, Sentinel (a real master, replica and Sentinel of the test's own)."""

from __future__ import annotations

import uuid

import pytest
import redis
from celery import Celery

from celery_guardrails import ConfigurationError
from celery_guardrails.exceptions import StoreUnavailableError
from celery_guardrails.options import validate
from celery_guardrails.stores import store_url
from celery_guardrails.stores.redis import IDEM_PREFIX, RedisStore
from celery_guardrails.stores.redis_client import LazyCluster, check_url, connect
from tests.support.redis_cluster import Cluster
from tests.support.redis_sentinel import MASTER_NAME, Sentinel
from tests.support.waiting import wait_for

T0 = 1_800_000_000.0


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/1",
        "unix:///run/redis.sock?db=2",
        "redis+cluster://127.0.0.1:7000",
        "rediss+cluster://user:secret@a:7000;rediss+cluster://b:7001?ssl_cert_reqs=none",
        "sentinel://127.0.0.1:26379/1;sentinel://127.0.0.2:26379/1?master_name=mymaster",
    ],
)
def test_store_urls_of_each_kind_are_accepted(url: str) -> None:
    assert validate({"store": url, "dead_letter_sinks": ["django", url]})["store"] == url


@pytest.mark.parametrize(
    ("url", "text"),
    [
        ("redis+cluster://127.0.0.1:7000/2", "only database 0"),
        ("redis+cluster://a:7000;redis://b:7000", "each node of a cluster URL"),
        ("sentinel://127.0.0.1:26379/1", "master_name"),
        ("sentinel://127.0.0.1:26379/one?master_name=m", "is a number"),
        ("sentinel://127.0.0.1:26379/1?master_name=m&ssl=true", "not ssl"),
        ("memcached://127.0.0.1:11211", "Redis URL"),
    ],
)
def test_a_bad_store_url_names_the_key_at_start_up(url: str, text: str) -> None:
    with pytest.raises(ConfigurationError, match=text) as caught:
        validate({"store": url})
    assert caught.value.key == "store"
    with pytest.raises(ValueError, match=text):
        check_url(url)


def test_a_sentinel_broker_is_the_default_store_with_its_master_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import celery_guardrails.stores

    # Given a plain Celery app (no Django app) on a Sentinel broker, its master named in the transport options
    monkeypatch.setattr(celery_guardrails.stores, "django_apps_installed", lambda *names: False)
    app = Celery("sentinel-default", set_as_current=False)
    app.conf.broker_url = "sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26379"
    app.conf.broker_transport_options = {"master_name": "my master"}
    # Then the store is the same Sentinel, its URL naming the master
    assert store_url(app) == "sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26379?master_name=my%20master"
    client = connect(store_url(app), timeout=1.0)
    pool = client.connection_pool
    sentinels = [sentinel.connection_pool.connection_kwargs for sentinel in pool.sentinel_manager.sentinels]
    assert pool.service_name == "my master"
    assert [(s["host"], s["port"]) for s in sentinels] == [("10.0.0.1", 26379), ("10.0.0.2", 26379)]


def test_clients_are_made_without_connecting() -> None:
    # Given URLs where nothing answers, When their clients are made, Then nothing was asked yet
    assert isinstance(connect("redis+cluster://127.0.0.1:1", timeout=1.0), LazyCluster)
    connect("sentinel://127.0.0.1:1?master_name=m", timeout=1.0)
    store = RedisStore("sentinel://127.0.0.1:1?master_name=m", timeout=1.0)
    # and the first operation is an outage (the message comes back later), not a refusal
    with pytest.raises(StoreUnavailableError):
        store.claim("tests.client:-:x", owner="a", now=T0, lease=10, retention=600)


def test_the_store_works_through_sentinel_and_follows_a_failover(redis_sentinel: Sentinel) -> None:
    # Given a store pointed at the Sentinel, and a key claimed on the master and copied to its replica
    store = RedisStore(redis_sentinel.url, timeout=5.0)
    key = f"tests.sentinel:-:{uuid.uuid4().hex}"
    assert store.claim(key, owner="a", now=T0, lease=60, retention=600).state == "acquired"
    master, replica = redis_sentinel.master, redis_sentinel.replica
    assert redis_sentinel.node(master).hget(IDEM_PREFIX + key, "owner") == b"a"
    wait_for("the claim on the replica", lambda: redis_sentinel.node(replica).exists(IDEM_PREFIX + key))
    # When the Sentinel fails the master over to the replica
    redis_sentinel.node(redis_sentinel.sentinel).execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
    wait_for("the replica promoted", lambda: redis_sentinel.master_port() == replica)
    wait_for("the old master demoted", lambda: redis_sentinel.role(master) == "slave")

    # Then the same store completes the key on the new master at once: the old master's READONLY answer
    # drops the connection, and the next one asks the Sentinel where the master is
    assert store.complete(key, owner="a", now=T0 + 1, summary="charged", retention=600) is True
    assert redis_sentinel.node(replica).hget(IDEM_PREFIX + key, "state") == b"completed"
    assert store.claim(key, owner="b", now=T0 + 2, lease=60, retention=600).summary == "charged"


def test_a_cluster_url_gives_a_cluster_client(redis_cluster: Cluster) -> None:
    # Given the local cluster's URL (its three nodes as seeds), When a client is made for it
    client = connect(redis_cluster.url, timeout=5.0)
    # Then it knows every node from the seeds, and follows a key to its node
    assert sorted(node.port for node in client.get_primaries()) == sorted(redis_cluster.ports)
    name = f"tests.client.{uuid.uuid4().hex}"
    client.set(name, "x", ex=60)
    assert redis_cluster.node(redis_cluster.port_of(name)).get(name) == b"x"
    assert isinstance(client.connected(), redis.cluster.RedisCluster)
