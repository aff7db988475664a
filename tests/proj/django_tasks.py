"""Guarded tasks with database effects, for workers running with the test Django settings."""

from __future__ import annotations

import time

import redis
from celery import shared_task

from celery_guardrails import GuardedTask
from tests.proj.tasks import REDIS_URL, seen


@shared_task(base=GuardedTask, bind=True, idempotency_key="effect:{key}", atomic=True)
def write_effect(self: GuardedTask, key: str, sink: str, hold: float = 0.0) -> str:
    """Insert one Effect row; the first run may then hold (to be killed mid-transaction)."""
    from tests.testapp.models import Effect

    runs = redis.Redis.from_url(REDIS_URL).incr(f"{sink}:runs")
    seen(self, sink, run=runs, key=self.request.idempotency_key)
    Effect.objects.create(key=key)
    if hold and runs == 1:
        time.sleep(hold)
    return "written"
