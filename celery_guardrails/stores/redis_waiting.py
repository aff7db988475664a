"""Waiting messages on Redis (the waiting half of the Redis store, mixed in; see
:mod:`celery_guardrails.guardrails.waiting`).

One hash, ``guardrails:{waiting}``: field the task id, value the wait as JSON. A note is one ``HSET`` (in a
script that also pushes the hash's expiry out to the latest ``expires`` written: a hash nobody writes for that
long goes away whole); the next delivery's start is one ``HDEL``. A read takes the whole hash (as many rows as
messages wait), drops the rows past their ``expires`` (a lost message's) and counts the rest.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from celery_guardrails.exceptions import StoreError
from celery_guardrails.stores.base import Wait, Waits

WAITING_KEY = "guardrails:{waiting}"

# KEYS: the hash. ARGV: task id, the wait as JSON, seconds the hash must live at least.
WAIT_NOTE_SCRIPT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local ttl = redis.call('TTL', KEYS[1])
if ttl < tonumber(ARGV[3]) then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return 1
"""


class RedisWaiting:
    """The waiting operations of :class:`~celery_guardrails.stores.redis.RedisStore` (mixed in)."""

    client: Any
    _wait_note: Any
    _errors: tuple[type[BaseException], ...]
    _failure: Callable[[BaseException], StoreError]
    _eval: Callable[[Any, str, list[Any]], Any]

    def wait_note(self, wait: Wait) -> None:
        ttl = max(1, math.ceil(wait.expires - wait.since))
        self._eval(self._wait_note, WAITING_KEY, [wait.task_id, json.dumps(asdict(wait)), ttl])

    def wait_done(self, task_id: str) -> None:
        try:
            self.client.hdel(WAITING_KEY, task_id)
        except self._errors as exc:
            raise self._failure(exc) from exc

    def waiting(self, *, now: float, limit: int, tenants: frozenset[str] | None = None) -> Waits:
        try:
            raw = self.client.hgetall(WAITING_KEY)
        except self._errors as exc:
            raise self._failure(exc) from exc
        kept: list[Wait] = []
        gone: list[bytes] = []
        for field, value in raw.items():
            try:
                wait = Wait(**json.loads(value))
            except (TypeError, ValueError):  # written by another release, or not by us: not a wait
                gone.append(field)
                continue
            if wait.expires <= now:
                gone.append(field)
            elif tenants is None or wait.tenant in tenants:
                kept.append(wait)
        if gone:
            try:
                self.client.hdel(WAITING_KEY, *gone)
            except self._errors as exc:
                raise self._failure(exc) from exc
        kept.sort(key=lambda wait: (wait.due, wait.task_id))
        return Waits(count=len(kept), by_reason=dict(Counter(w.reason for w in kept)), soonest=tuple(kept[:limit]))
