"""Idempotency claims on Redis (the idempotency half of :class:`~celery_guardrails.stores.redis.RedisStore`,
mixed in), with the delivery counters of poison protection, the publish reservations of ``dedupe_on_publish`` and
the alert throttles: one Lua script per operation, on the store's own lane (see
:mod:`~celery_guardrails.stores.redis_lane`). Mirrored by ``django_app/store/idempotency.py``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from celery_guardrails.exceptions import StoreError
from celery_guardrails.options import masked
from celery_guardrails.stores.base import BrokerAck, Claim, ResultWrite
from celery_guardrails.stores.redis_client import failure
from celery_guardrails.stores.redis_lane import Lane

logger = logging.getLogger(__name__)

#: Seconds between two measures of this host's clock against the Redis server's (leases use the server's).
SKEW_CHECK_SECONDS = 60.0


IDEM_PREFIX = "guardrails:idem:"
PUBLISH_PREFIX = "guardrails:published:"
DELIVERIES_PREFIX = "guardrails:deliveries:"

# Idempotency keys: a hash {state, owner, lease_until, summary, reason, completed_at}. The claim is a Lua function,
# so that the atomic pop can claim with it too (celery_guardrails.guardrails.pop_claims): one text of the rule. Its
# times come as text, made by the caller (``now`` on the server's clock, see RedisIdempotency._now; ``lease_until``
# formatted '%.6f'; ``retention`` whole seconds): Redis's TIME, string.format and a number handed to redis.call
# (formatted again by Redis) were a quarter of what a claim made the server do.
CLAIM_FUNCTION = """
local function claim(key, owner, now, lease_until, retention, replaces)
  local state = redis.call('HGET', key, 'state')
  if not state then
    redis.call('HSET', key, 'state', 'claimed', 'owner', owner, 'lease_until', lease_until)
    redis.call('EXPIRE', key, retention)
    return {'acquired', '0', '0', ''}
  end
  if state == 'completed' or state == 'failed' then
    local done = redis.call('HMGET', key, 'summary', 'reason', 'owner')
    local text = done[1]
    if state == 'failed' then text = done[2] end
    return {state, '0', '0', text or '', done[3] or ''}
  end
  local fields = redis.call('HMGET', key, 'lease_until', 'owner')
  if fields[2] == owner then
    -- this delivery asking again (its first answer was lost): it holds the claim
    redis.call('HSET', key, 'lease_until', lease_until)
    return {'acquired', '0', '0', ''}
  end
  if tonumber(fields[1]) > tonumber(now) and (replaces == '' or fields[2] ~= replaces) then
    return {'busy', '0', fields[1], fields[2] or ''}
  end
  redis.call('HSET', key, 'owner', owner, 'lease_until', lease_until)
  redis.call('EXPIRE', key, retention)
  return {'acquired', '1', '0', ''}
end
"""

# ARGV: owner, now, lease_until, retention, replaces (optional)
_CLAIM = CLAIM_FUNCTION + "return claim(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5] or '')\n"

# ARGV: owner, then the fields to set; succeeds only while ``owner`` holds the claim. A finish repeated by the
# owner that made it (its first answer was lost with the connection) succeeds again and changes nothing.
_IF_OWNER = """
local key = KEYS[1]
local fields = redis.call('HMGET', key, 'state', 'owner')
local action = ARGV[2]
if fields[2] ~= ARGV[1] then return 0 end
if fields[1] ~= 'claimed' then
  if action == 'finish' and fields[1] == ARGV[3] then return 1 end
  return 0
end
if action == 'release' then
  redis.call('DEL', key)
  return 1
end
if action == 'extend' then
  redis.call('HSET', key, 'lease_until', ARGV[3])
  -- The key must outlive its lease: a claim made with a short retention (a run slot) would expire under a
  -- run that is still beating.
  local ttl = redis.call('TTL', key)
  if ttl >= 0 and ttl < tonumber(ARGV[4]) then redis.call('EXPIRE', key, ARGV[4]) end
  return 1
end
-- complete / fail: ARGV[3] state, ARGV[4] field name, ARGV[5] value, ARGV[6] time, ARGV[7] retention
redis.call('HSET', key, 'state', ARGV[3], ARGV[4], ARGV[5], 'completed_at', ARGV[6])
redis.call('HDEL', key, 'lease_until')
redis.call('EXPIRE', key, ARGV[7])
return 1
"""


# The ack of a message on the broker's Redis (KEYS: kombu's unacked hash, its index; ARGV: the delivery tag), as
# kombu's QoS.ack removes it. Returns 1 when the delivery was still recorded.
_ACK = """
redis.call('ZREM', KEYS[#KEYS], ARGV[#ARGV])
return redis.call('HDEL', KEYS[#KEYS - 1], ARGV[#ARGV])
"""

# A completion (_IF_OWNER's, KEYS[1]) and the ack of its message (the last two KEYS; the last ARGV the tag) in one
# step: the message is removed only with the completion durable, and no worker can die between the two. The message
# is acked whatever the completion answers (a key taken over is only logged, as when the worker acks itself).
# With four KEYS, the task's result is written between the two, as Celery's Redis result backend writes it (KEYS[2];
# ARGV[8] the encoded meta-data, ARGV[9] its expiry in seconds or ''): SET, then PUBLISH to the clients waiting on
# it; a stored result then means a completed key and an acked message, all or nothing. As Celery's backend does
# (``_store_result``), a success already stored is kept (the results that ride are JSON: what cannot be read as
# JSON is not known to be one, and is written over). Returns {completed, acked}.
_COMPLETE_ACK = (
    "local function finish()\n"
    + _IF_OWNER
    + """
end
local done = finish()
if #KEYS == 4 then
  local stored = redis.call('GET', KEYS[2])
  local kept = false
  if stored then
    local readable, meta = pcall(cjson.decode, stored)
    kept = readable and type(meta) == 'table' and meta['status'] == 'SUCCESS'
  end
  if not kept then
    if ARGV[9] == '' then redis.call('SET', KEYS[2], ARGV[8])
    else redis.call('SET', KEYS[2], ARGV[8], 'EX', ARGV[9]) end
    redis.call('PUBLISH', KEYS[2], ARGV[8])
  end
end
local function ack()
"""
    + _ACK
    + "\nend\nreturn {done, ack()}\n"
)


# A delivery counter: one more, and its expiry, atomically (a script, not MULTI: a cluster client's pipeline
# is not a transaction, and a counter left without its expiry would outlive its message).
_COUNT = """
local count = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return count
"""


_REOPEN = """
if redis.call('HGET', KEYS[1], 'state') == 'failed' then return redis.call('DEL', KEYS[1]) end
return 0
"""


_THROTTLE = """
local key, pending, group = KEYS[1], KEYS[2], ARGV[1]
local now, window, extend = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local untill = tonumber(redis.call('HGET', key, 'until') or '0')
local ttl = math.floor(math.max(window, extend) * 10) + 60
if untill > now then
  redis.call('HINCRBY', key, 'suppressed', 1)
  redis.call('SADD', pending, group)
  if extend > 0 then
    local opened = tonumber(redis.call('HGET', key, 'opened') or tostring(now))
    local later = math.min(now + window, opened + extend)
    if later > untill then redis.call('HSET', key, 'until', string.format('%.6f', later)) end
    redis.call('EXPIRE', key, ttl)
  end
  return 0
end
redis.call('HSET', key, 'until', string.format('%.6f', now + window), 'opened', string.format('%.6f', now))
redis.call('EXPIRE', key, ttl)
return 1
"""

# KEYS: the pending set, then each group's throttle key; ARGV: now, then the groups (ARGV[i] is KEYS[i]'s).
# Each group still pending whose window is over is handed out once, with its count, and leaves the set. The
# caller read the set first (a script may touch only the keys it is given: a Redis Cluster routes it by them).
_DUE = """
local pending, now = KEYS[1], tonumber(ARGV[1])
local due = {}
for i = 2, #KEYS do
  local key, group = KEYS[i], ARGV[i]
  if redis.call('SISMEMBER', pending, group) == 1 then
    local untill = tonumber(redis.call('HGET', key, 'until') or '0')
    if untill <= now then
      local count = tonumber(redis.call('HGET', key, 'suppressed') or '0')
      -- only a live key is reset: HSET on an expired one would make a key that never expires
      if count > 0 then redis.call('HSET', key, 'suppressed', 0) end
      redis.call('SREM', pending, group)
      if count > 0 then table.insert(due, group); table.insert(due, tostring(count)) end
    end
  end
end
return due
"""

# Alert throttles share one hash tag, so the pending set and every group's key are in one slot of a cluster.
ALERT_PREFIX = "guardrails:{alerts}:group:"
ALERT_PENDING = "guardrails:{alerts}:pending"
#: The names of releases before the hash tag: summaries pending there are still handed out (one server only).
LEGACY_ALERT_PREFIX = "guardrails:alert:"
LEGACY_ALERT_PENDING = "guardrails:alert-pending"
#: Groups one due-summaries script is given at most (its keys travel in one command).
DUE_BATCH = 100


def _finish(owner: str, state: str, text: str, now: float, retention: float) -> list[Any]:
    """The _IF_OWNER arguments that end a claim: completed with a summary, or failed with a reason."""
    field = "summary" if state == "completed" else "reason"
    return [owner, "finish", state, field, text, repr(now), int(retention)]


class RedisIdempotency:
    """The idempotency half of :class:`RedisStore` (mixed in)."""

    client: Any
    url: str
    _lane: Lane
    _errors: tuple[type[BaseException], ...]
    _claim: Any
    _if_owner: Any
    _ack: Any
    _complete_ack: Any
    _reopen: Any
    _count: Any
    _throttle: Any
    _due: Any
    _cluster: bool
    _skew: float
    _skew_checked: float

    def _failure(self, exc: BaseException) -> StoreError:
        return failure("Redis store", self.url, exc)

    def _eval(self, script: Any, key: str | list[str], args: list[Any]) -> Any:
        """Run a registered script on this thread's lane (see :mod:`~celery_guardrails.stores.redis_lane`)."""
        keys = [key] if isinstance(key, str) else key
        try:
            if self._lane.available:
                try:
                    return self._lane.call("EVALSHA", script.sha, len(keys), *keys, *args)
                except self._errors:  # NOSCRIPT (nothing ran) or a broken connection: the client loads, retries
                    pass
            return script(keys=keys, args=args)
        except self._errors as exc:
            raise self._failure(exc) from exc

    def _run(self, script: Any, key: str, args: list[Any]) -> Any:
        return self._eval(script, IDEM_PREFIX + key, args)

    def _now(self, now: float) -> float:
        """``now`` on the Redis server's clock: leases are compared across workers, whose clocks drift. The
        offset is measured with ``TIME`` once a minute per store, and applied in whole seconds when it is a
        second or more (less is the noise of a round trip)."""
        if time.monotonic() >= self._skew_checked:
            self._skew_checked = time.monotonic() + SKEW_CHECK_SECONDS
            try:
                before = time.time()
                seconds, micros = self.client.time()
                local = (before + time.time()) / 2
            except self._errors:  # the operation itself will say what is wrong with the server
                return now + self._skew
            offset = seconds + micros / 1e6 - local
            self._skew = float(round(offset)) if abs(offset) >= 1.0 else 0.0
            if self._skew:
                logger.warning(
                    "Redis store at %s: this host's clock is %+.0fs off the server's", masked(self.url), -offset
                )
        return now + self._skew

    def server_now(self) -> float:
        """The time on the Redis server's clock, as this store's claims read it (:meth:`_now`): the claim with the
        pop hands it to its script (:mod:`celery_guardrails.guardrails.pop_claims`)."""
        return self._now(time.time())

    def claim(
        self,
        key: str,
        *,
        owner: str,
        now: float,
        lease: float,
        retention: float,
        replaces: str = "",
        atomic: bool = False,  # the effect commits in another database: nothing to gain here
    ) -> Claim:
        server_now = self._now(now)
        state, takeover, lease_until, text, *done_by = self._run(
            self._claim, key, [owner, repr(server_now), f"{server_now + lease:.6f}", int(retention), replaces]
        )
        state = state.decode()
        return Claim(
            state=state,
            takeover=takeover == b"1",
            lease_until=float(lease_until) - (server_now - now),  # on the caller's clock
            summary=text.decode() if state == "completed" else "",
            reason=text.decode() if state == "failed" else "",
            owner=text.decode() if state == "busy" else (done_by[0].decode() if done_by else ""),
        )

    def extend(self, key: str, *, owner: str, now: float, lease: float) -> bool:
        until = f"{self._now(now) + lease:.6f}"
        return bool(self._run(self._if_owner, key, [owner, "extend", until, math.ceil(lease) + 1]))

    def complete(self, key: str, *, owner: str, now: float, summary: str, retention: float) -> bool:
        args = _finish(owner, "completed", summary, self._now(now), retention)
        return bool(self._run(self._if_owner, key, args))

    def begin_complete(self, key: str, *, owner: str, now: float, summary: str, retention: float) -> Callable[[], bool]:
        """Send the completion; the callable reads its answer (once, from the same thread).

        The worker sends it as the body returns and reads it just before the ack, so this round trip overlaps
        Celery storing the result. Any doubt (the script not loaded yet, a broken connection) is settled by
        running it again through the pooled client, which a repeated finish by the same owner makes safe.
        """
        args = _finish(owner, "completed", summary, self._now(now), retention)
        return self._sent(self._if_owner, [IDEM_PREFIX + key], args, bool)

    def send_complete_and_ack(
        self,
        key: str,
        *,
        owner: str,
        now: float,
        summary: str,
        retention: float,
        ack: BrokerAck,
        result: ResultWrite | None = None,
    ) -> Callable[[], bool]:
        """Complete ``key`` and ack the message of ``ack`` in one script (see :data:`_COMPLETE_ACK`): the store is
        the broker's own Redis; with ``result``, the task's result is written between the two (the store is the
        result backend's Redis too). Sent now; the callable reads the answer (once, from the same thread): whether the
        key was completed (the message is acked either way), or StoreError. Whatever the read meets (the script not
        loaded, a broken connection) is settled by running the script again through the pooled client: a repeat is
        safe (a finish repeated by its owner completes nothing new, a success stored is kept, the message is found
        acked)."""
        keys, args = [IDEM_PREFIX + key], _finish(owner, "completed", summary, self._now(now), retention)
        if result is not None:
            keys.append(result.key)
            args += [result.value, int(result.expires) if result.expires else ""]
        keys += [ack.unacked, ack.index]
        args.append(ack.tag)
        return self._sent(self._complete_ack, keys, args, lambda answer: bool(answer[0]))

    def send_ack(self, ack: BrokerAck) -> Callable[[], bool]:
        """Ack the message of ``ack`` on the broker's Redis, as kombu does. Sent now; the callable reads the answer:
        whether it was still recorded (see :meth:`send_complete_and_ack`)."""
        return self._sent(self._ack, [ack.unacked, ack.index], [ack.tag], bool)

    def _sent(self, script: Any, keys: list[str], args: list[Any], answer: Callable[[Any], bool]) -> Callable[[], bool]:
        read: Callable[[], Any] | None = None
        if self._lane.available:
            with contextlib.suppress(*self._errors):
                read = self._lane.send("EVALSHA", script.sha, len(keys), *keys, *args)

        def wait() -> bool:
            if read is not None:
                try:
                    return answer(read())
                except self._errors:  # NOSCRIPT (nothing ran) or a broken connection: run again, loading it
                    pass
            return answer(self._eval(script, keys, args))

        return wait

    def fail(self, key: str, *, owner: str, now: float, reason: str, retention: float) -> bool:
        return bool(self._run(self._if_owner, key, _finish(owner, "failed", reason, self._now(now), retention)))

    def release(self, key: str, *, owner: str) -> bool:
        return bool(self._run(self._if_owner, key, [owner, "release"]))

    def reopen(self, key: str) -> bool:
        return bool(self._run(self._reopen, key, []))

    def reopen_keys(self, keys: Iterable[str]) -> int:
        # One round trip: the scripts pipelined (not a transaction; each script is atomic on its own). A cluster
        # client pipelines no scripts (redis-py refuses EVALSHA there): one call a key, each in its own slot.
        if self._cluster:
            return sum(1 for key in keys if self.reopen(key))
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                self._reopen(keys=[IDEM_PREFIX + key], args=[], client=pipe)
            return sum(1 for deleted in pipe.execute() if deleted)
        except self._errors as exc:
            raise self._failure(exc) from exc

    def inspect(self, key: str) -> dict[str, Any] | None:
        try:
            raw = self.client.hgetall(IDEM_PREFIX + key)
        except self._errors as exc:
            raise self._failure(exc) from exc
        return {k.decode(): v.decode() for k, v in raw.items()} or None

    def throttle(self, group: str, *, window: float, now: float, extend_for: float = 0.0) -> bool:
        """True: alert now (first of a window); False: counted for the window's summary (see the protocol)."""
        try:
            return bool(
                self._throttle(
                    keys=[ALERT_PREFIX + group, ALERT_PENDING], args=[group, repr(now), repr(window), repr(extend_for)]
                )
            )
        except self._errors as exc:
            raise self._failure(exc) from exc

    def due_summaries(self, *, now: float) -> list[tuple[str, int]]:
        """(group, count) of finished windows with suppressed alerts, each handed out once."""
        due = self._take_due(ALERT_PENDING, ALERT_PREFIX, now)
        if not self._cluster:  # windows a release before the hash tag left open (a cluster never had them)
            due += self._take_due(LEGACY_ALERT_PENDING, LEGACY_ALERT_PREFIX, now)
        return due

    def _take_due(self, pending: str, prefix: str, now: float) -> list[tuple[str, int]]:
        due: list[tuple[str, int]] = []
        try:
            groups = sorted(self.client.smembers(pending))
            for start in range(0, len(groups), DUE_BATCH):
                batch = groups[start : start + DUE_BATCH]
                keys = [pending, *(prefix.encode() + group for group in batch)]
                flat = self._due(keys=keys, args=[repr(now), *batch])
                due += [(flat[i].decode(), int(flat[i + 1])) for i in range(0, len(flat), 2)]
        except self._errors as exc:
            if not due:
                raise self._failure(exc) from exc
            # the groups already taken are handed out; the rest stay pending for the next flush
            logger.warning("Redis store at %s: alert summaries cut short: %s", masked(self.url), exc)
        return due

    def count_delivery(self, message_id: str, *, ttl: float) -> int:
        """One more start of a redelivered message; the starts so far (one round trip)."""
        return int(self._eval(self._count, DELIVERIES_PREFIX + message_id, [int(ttl)]))

    def clear_delivery(self, message_id: str) -> None:
        try:
            self.client.delete(DELIVERIES_PREFIX + message_id)
        except self._errors as exc:
            raise self._failure(exc) from exc

    def reserve_publish(self, key: str, *, task_id: str, ttl: float) -> str | None:
        """Record the first publish of ``key``; return the task id of an earlier one within ``ttl``."""
        try:
            if self.client.set(PUBLISH_PREFIX + key, task_id, nx=True, ex=max(1, int(ttl))):
                return None
            existing = self.client.get(PUBLISH_PREFIX + key)
        except self._errors as exc:
            raise self._failure(exc) from exc
        return existing.decode() if existing else None
