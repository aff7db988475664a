"""The two real stores, by name, for tests that run the same rules against both."""

from __future__ import annotations

from typing import Any

from celery_guardrails.stores.redis import RedisStore
from tests.support.services import REDIS_URL


def make_store(kind: str) -> Any:
    """A new store: ``"redis"`` (the test Redis) or ``"django"`` (the test database)."""
    if kind == "redis":
        return RedisStore(REDIS_URL)
    from django_celery_guardrails.store import DjangoStore

    return DjangoStore()
