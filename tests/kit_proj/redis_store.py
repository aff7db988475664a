"""The kit test project on the Redis store (idempotency keys, checkpoints: the Redis database the results use),
with the handlers whose store the tests compare. Effects still land in the test app's tables."""

from __future__ import annotations

from celery_guardrails import GuardedTask
from tests.kit_proj.app import make_app
from tests.kit_proj.effects import chunked
from tests.support.services import REDIS_URL

app = make_app("kit_tests_redis_store", ["tests.kit_proj.redis_store"])
app.conf.guardrails = {**app.conf.guardrails, "store": REDIS_URL}


@app.task(base=GuardedTask, bind=True, name="kit_redis.chunks")
def chunks(self: GuardedTask, job: str, count: int, every: int = 100) -> dict[str, int]:
    """Resumable chunks without a key: the position saved in Redis after each chunk."""
    return chunked(self, job, count, every)


@app.task(base=GuardedTask, bind=True, name="kit_redis.chunks_keyed", idempotency_key="chunks:{job}")
def chunks_keyed(self: GuardedTask, job: str, count: int, every: int = 100) -> dict[str, int]:
    return chunked(self, job, count, every)
