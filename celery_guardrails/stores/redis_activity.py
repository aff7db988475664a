"""Activity per minute on Redis (the activity half of the Redis store, mixed in).

One hash per hour, ``guardrails:{activity}:<hour>`` (the hour's start, epoch seconds), with a field per minute
and series: ``["o", minute, task, queue, outcome]`` (JSON text) holds a count of delivery outcomes,
``["q", minute, queue]`` a queue sample ``[depth, oldest_age]``. The braces are a Redis Cluster hash tag: every
hash of the activity is in one slot, so one script writes a whole batch and one pipeline reads a day. A day
is 25 hashes to read whatever the number of tasks; each hash expires ``retention`` seconds plus an hour after
its last write.

A batch of counts is added by one script, which first sets ``guardrails:{activity}:batch:<id>`` (NX, kept
``retention`` seconds): a batch sent again after its answer was lost finds its id and adds nothing, so a
recorder may resend a batch until it is told it landed.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

from celery_guardrails.exceptions import StoreError
from celery_guardrails.stores.base import Activity, OutcomeCount, QueueSample

logger = logging.getLogger(__name__)

ACTIVITY_PREFIX = "guardrails:{activity}:"
HOUR = 3600

# KEYS[1]: the batch's id marker; KEYS[2..]: the hours' hashes. ARGV[1]: the batch marker's ttl, ARGV[2]: the
# hashes' ttl, then (index into KEYS, field, count) per count. Returns 0 when the batch was added before.
_ADD = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for i = 3, #ARGV, 3 do
  redis.call('HINCRBY', KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2])
end
for k = 2, #KEYS do redis.call('EXPIRE', KEYS[k], ARGV[2]) end
return 1
"""

# KEYS: the hours' hashes. ARGV[1]: the hashes' ttl, then (index into KEYS, field, value) per sample.
_SAMPLE = """
for i = 2, #ARGV, 3 do
  redis.call('HSET', KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2])
end
for k = 1, #KEYS do redis.call('EXPIRE', KEYS[k], ARGV[1]) end
return 1
"""


def hour_key(minute: float) -> str:
    return f"{ACTIVITY_PREFIX}{int(minute // HOUR * HOUR)}"


def _field(*parts: Any) -> str:
    return json.dumps(parts, separators=(",", ":"))


def _ttl(retention: float) -> int:
    return max(1, math.ceil(retention)) + HOUR


class RedisActivity:
    """The activity operations of :class:`~celery_guardrails.stores.redis.RedisStore` (mixed in)."""

    client: Any
    _errors: tuple[type[BaseException], ...]
    _failure: Callable[[BaseException], StoreError]  # RedisIdempotency's

    def _activity_scripts(self) -> dict[str, Any]:
        scripts: dict[str, Any] | None = getattr(self, "_activity", None)
        if scripts is None:
            scripts = {"add": self.client.register_script(_ADD), "sample": self.client.register_script(_SAMPLE)}
            self._activity = scripts
        return scripts

    def _activity_write(self, script: str, keys: list[str], head: list[Any], rows: list[tuple[str, str, Any]]) -> Any:
        """Run ``script`` over ``rows`` (hash key, field, value): each row's key is named by its index in KEYS."""
        hashes = list(dict.fromkeys(key for key, _, _ in rows))
        index = {key: position + len(keys) + 1 for position, key in enumerate(hashes)}
        args = [*head]
        for key, name, value in rows:
            args += [index[key], name, value]
        try:
            return self._activity_scripts()[script](keys=[*keys, *hashes], args=args)
        except self._errors as exc:
            raise self._failure(exc) from exc

    def activity_add(self, counts: Iterable[OutcomeCount], *, batch: str, retention: float) -> None:
        rows = [
            (hour_key(c.minute), _field("o", int(c.minute), c.task, c.queue, c.outcome), int(c.count))
            for c in counts
            if c.count
        ]
        if rows:
            marker = f"{ACTIVITY_PREFIX}batch:{batch}"
            self._activity_write("add", [marker], [max(1, math.ceil(retention)), _ttl(retention)], rows)

    def activity_sample(self, samples: Iterable[QueueSample], *, retention: float) -> None:
        rows = [
            (hour_key(s.minute), _field("q", int(s.minute), s.queue), json.dumps([int(s.depth), s.oldest_age]))
            for s in samples
        ]
        if rows:
            self._activity_write("sample", [], [_ttl(retention)], rows)

    def activity_read(self, *, since: float, until: float) -> Activity:
        first, last = int(since // HOUR), math.ceil(until / HOUR)
        keys = [f"{ACTIVITY_PREFIX}{hour * HOUR}" for hour in range(first, last)]
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            hashes = pipe.execute()
        except self._errors as exc:
            raise self._failure(exc) from exc
        outcomes: list[OutcomeCount] = []
        queues: list[QueueSample] = []
        for key, fields in zip(keys, hashes, strict=True):
            for raw, value in fields.items():
                try:
                    part = json.loads(raw)
                    minute = float(part[1])
                    if not since <= minute < until:
                        continue
                    if part[0] == "o":
                        outcomes.append(
                            OutcomeCount(minute=minute, task=part[2], queue=part[3], outcome=part[4], count=int(value))
                        )
                    elif part[0] == "q":
                        depth, age = json.loads(value)
                        age = None if age is None else float(age)
                        queues.append(QueueSample(minute=minute, queue=part[2], depth=int(depth), oldest_age=age))
                except (TypeError, ValueError, IndexError, UnicodeDecodeError):
                    # Written by something else: skipped, never a reason the whole day cannot be read.
                    logger.warning("Activity: field %r of %s is not an activity record; skipped", raw, key)
        outcomes.sort(key=lambda c: (c.minute, c.task, c.queue, c.outcome))
        queues.sort(key=lambda s: (s.minute, s.queue))
        return Activity(outcomes=outcomes, queues=queues)
