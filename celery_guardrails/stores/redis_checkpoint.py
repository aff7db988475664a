"""Checkpoints of long jobs on Redis (the checkpoint half of the Redis store, mixed in).

One hash per job, ``guardrails:{checkpoint:<key>}`` = ``{position, state, done}``: the braces are a Redis Cluster
hash tag, so every operation on a checkpoint is one key in one slot. A save is one Lua script, a
compare-and-set on the position (see :class:`~celery_guardrails.stores.base.Store`), that also sets the key's
expiry: a checkpoint left by a job that never finished (dead-lettered, never replayed) goes away after the
idempotency retention, like its key. A job whose task succeeded is marked ``done`` (not deleted: the
acks-late ack comes after the task's success hook, and a worker killed in between must leave a redelivery
that finds the job done, not one that starts it at item 0); the mark expires after the same retention.

Guarantee: Redis cannot commit with the job's effects, so the position is written after each chunk: a worker
killed mid-chunk (or between the chunk's last item and the write) leaves the previous position, and the next
delivery runs that chunk again. At least once per chunk; the Django store gives exactly once for database
effects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from celery_guardrails.exceptions import StoreError
from celery_guardrails.stores.base import StoredCheckpoint

CHECKPOINT_PREFIX = "guardrails:{checkpoint:"

# KEYS: the checkpoint. ARGV: expected position, new position, state (JSON text), ttl (whole seconds).
CHECKPOINT_SAVE_SCRIPT = """
local current = tonumber(redis.call('HGET', KEYS[1], 'position') or '0')
if current ~= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'position', ARGV[2], 'state', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

# KEYS: the checkpoint. ARGV: ttl (whole seconds).
CHECKPOINT_COMPLETE_SCRIPT = """
redis.call('HSET', KEYS[1], 'done', '1')
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

CHECKPOINT_CLEAR_SCRIPT = "return redis.call('DEL', KEYS[1])"


def checkpoint_key(key: str) -> str:
    return f"{CHECKPOINT_PREFIX}{key}}}"


class RedisCheckpoints:
    """The checkpoint operations of :class:`~celery_guardrails.stores.redis.RedisStore` (mixed in)."""

    client: Any
    _errors: tuple[type[BaseException], ...]
    _checkpoint_save: Any
    _checkpoint_complete: Any
    _checkpoint_clear: Any

    _failure: Callable[[BaseException], StoreError]  # RedisIdempotency's
    _eval: Callable[[Any, str, list[Any]], Any]  # RedisIdempotency's: the script on this thread's lane

    def load_checkpoint(self, key: str) -> StoredCheckpoint:
        try:
            position, state, done = self.client.hmget(checkpoint_key(key), ["position", "state", "done"])
        except self._errors as exc:
            raise self._failure(exc) from exc
        return StoredCheckpoint(position=int(position or 0), state=(state or b"").decode(), done=bool(done))

    def save_checkpoint(self, key: str, *, expected: int, position: int, state: str, ttl: float) -> bool:
        saved = self._eval(
            self._checkpoint_save, checkpoint_key(key), [expected, position, state, max(1, math.ceil(ttl))]
        )
        return bool(saved)

    def complete_checkpoint(self, key: str, *, ttl: float) -> None:
        # On this thread's lane, like the save: in order after the chunks' last position.
        self._eval(self._checkpoint_complete, checkpoint_key(key), [max(1, math.ceil(ttl))])

    def clear_checkpoint(self, key: str) -> None:
        # On this thread's lane, as the idempotency key's completion was sent: its answer is read first, so the
        # checkpoint goes only after the completion reached the server.
        self._eval(self._checkpoint_clear, checkpoint_key(key), [])
