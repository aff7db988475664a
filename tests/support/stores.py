"""The real stores, by name, for tests that run the same rules against each."""

from __future__ import annotations

from typing import Any

import redis

from celery_guardrails.stores.redis import RedisStore
from tests.support import redis_cluster
from tests.support.services import REDIS_URL

#: "redis": the test Redis; "redis-cluster": the local three-node cluster; "django": the test database.
KINDS = ["redis", "redis-cluster", "django"]


def make_store(kind: str) -> Any:
    """A new store of ``kind`` (see :data:`KINDS`); a cluster store needs the ``redis_cluster`` fixture."""
    if kind == "redis":
        return RedisStore(REDIS_URL)
    if kind == "redis-cluster":
        assert redis_cluster.URL, "the redis_cluster fixture is not running"
        return RedisStore(redis_cluster.URL)
    from django_celery_guardrails.store import DjangoStore

    return DjangoStore()


def forget(kind: str, pattern: str) -> None:
    """Delete the Redis keys matching ``pattern`` (a test's leftovers: Redis outlives the test run, the
    database is rolled back), on every node of the cluster for the cluster store."""
    if kind == "redis":
        client: Any = redis.Redis.from_url(REDIS_URL)
    elif kind == "redis-cluster":
        client = make_store(kind).client.connected()
    else:
        return
    for key in client.scan_iter(match=pattern):
        client.delete(key)
