"""Concurrency slots on Redis (the slot half of the Redis store, mixed into
:class:`~celery_guardrails.stores.redis.RedisStore`).

Per key, four names sharing the hash tag ``{slots:<key>}`` (one slot of a Redis Cluster, so one script may
touch them all):

* ``guardrails:{slots:<key>}``: a sorted set, member = holder, score = its last heartbeat (epoch seconds,
  the Redis server's clock);
* ``...:info``: a hash, holder -> JSON of the task name, task id, tenant and acquisition time;
* ``...:meta``: a hash: ``reap_after`` (the ceiling the last capacity check used, for the reaper on a
  timer), ``checks`` and ``acquired`` (capacity checks made, slots taken) and ``reaped`` (holders reaped);
* ``...:lost``: a list of the reaped holders' records, newest first, the last
  :data:`~celery_guardrails.stores.base.LOST_RECORDS_KEPT` kept for
  :data:`~celery_guardrails.stores.base.LOST_RECORDS_TTL` seconds after the last one (the audit trail; the
  dead letter, if the job failed for good, is elsewhere).

Every operation is one Lua script: the acquire reaps the stale holders, counts the live ones and adds the new
one in one atomic step, so no count is cached anywhere and two workers can never both take the last slot.

The reaper on a timer needs the keys that have holders: a set ``guardrails:{slots}:keys`` (another slot of a
cluster, so kept beside the scripts, not in them): a key joins it when its first holder arrives and leaves it
when the timer finds it empty (and joins again if a holder arrived meanwhile). A key missing from it is still
reaped by its next capacity check.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from celery_guardrails.exceptions import StoreError
from celery_guardrails.stores.base import LOST, LOST_RECORDS_KEPT, LOST_RECORDS_TTL, SlotAcquisition, SlotHolder

SLOT_KEYS = "guardrails:{slots}:keys"
#: Seconds the names of a key outlive its last change beyond its ceiling (a key nobody uses any more goes).
IDLE_TTL = 24 * 3600


def slot_names(key: str) -> list[str]:
    """The sorted set, info hash, meta hash and lost list of ``key``. The tag is ``slots:`` and the key up to
    its first ``}``: the same in all four names whatever the key holds."""
    base = f"guardrails:{{slots:{key}}}"
    return [base, f"{base}:info", f"{base}:meta", f"{base}:lost"]


# Shared prologue: reap the holders whose heartbeat is older than the ceiling, each recorded lost.
# KEYS: zset, info, meta, lost. ARGV[1] now, ARGV[2] ceiling ('' : the one stored in meta), ARGV[3] the key.
_REAP = (
    """
local z, info, meta, lost = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now = tonumber(ARGV[1])
local reap_after = tonumber(ARGV[2])
if not reap_after then reap_after = tonumber(redis.call('HGET', meta, 'reap_after') or '300') end
local keep = IDLE_TTL + math.ceil(reap_after) * 10
local reaped = {}
local stale = redis.call('ZRANGEBYSCORE', z, '-inf', '(' .. string.format('%.6f', now - reap_after), 'WITHSCORES')
for i = 1, #stale, 2 do
  local holder = stale[i]
  local record = cjson.decode(redis.call('HGET', info, holder) or '{}')
  record['key'], record['holder'], record['heartbeat_at'] = ARGV[3], holder, stale[i + 1]
  record['reaped_at'], record['state'], record['reason'] = ARGV[1], 'LOST_STATE', 'lost'
  local text = cjson.encode(record)
  redis.call('ZREM', z, holder)
  redis.call('HDEL', info, holder)
  redis.call('LPUSH', lost, text)
  table.insert(reaped, text)
end
if #reaped > 0 then
  redis.call('LTRIM', lost, 0, LOST_KEPT - 1)
  redis.call('EXPIRE', lost, LOST_TTL)
  redis.call('HINCRBY', meta, 'reaped', #reaped)
  redis.call('EXPIRE', meta, keep)
end
""".replace("IDLE_TTL", str(IDLE_TTL))
    .replace("LOST_STATE", LOST)
    .replace("LOST_KEPT", str(LOST_RECORDS_KEPT))
    .replace("LOST_TTL", str(LOST_RECORDS_TTL))
)

# ARGV: now, ceiling, key, holder, limit, info JSON. Returns: acquired, holders, retry_at, was empty, reaped...
_ACQUIRE = (
    _REAP
    + """
local holder, limit = ARGV[4], tonumber(ARGV[5])
local empty = redis.call('ZCARD', z) == 0
local acquired = '0'
redis.call('HINCRBY', meta, 'checks', 1)
redis.call('HSET', meta, 'reap_after', ARGV[2])
if redis.call('ZSCORE', z, holder) then
  -- this holder asking again (its first answer was lost): it holds the slot
  redis.call('ZADD', z, ARGV[1], holder)
  acquired = '1'
elseif redis.call('ZCARD', z) < limit then
  redis.call('ZADD', z, ARGV[1], holder)
  redis.call('HSET', info, holder, ARGV[6])
  redis.call('HINCRBY', meta, 'acquired', 1)
  acquired = '1'
end
for _, name in ipairs({z, info, meta}) do redis.call('EXPIRE', name, keep) end
local oldest = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
local retry_at = '0'
if oldest[2] then retry_at = string.format('%.6f', tonumber(oldest[2]) + reap_after) end
local empty_flag = '0'
if empty then empty_flag = '1' end
local answer = {acquired, tostring(redis.call('ZCARD', z)), retry_at, empty_flag}
for _, text in ipairs(reaped) do table.insert(answer, text) end
return answer
"""
)

# ARGV: now, '' (the stored ceiling), key. Returns: holders left, reaped...
_REAP_ONLY = (
    _REAP
    + """
local answer = {tostring(redis.call('ZCARD', z))}
for _, text in ipairs(reaped) do table.insert(answer, text) end
return answer
"""
)

# KEYS: zset, info, meta. ARGV: holder, now. Only a holder still in the set is renewed (XX: never re-added).
_HEARTBEAT = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', ARGV[2], ARGV[1])
local keep = IDLE_TTL + math.ceil(tonumber(redis.call('HGET', KEYS[3], 'reap_after') or '300')) * 10
for _, name in ipairs(KEYS) do redis.call('EXPIRE', name, keep) end
return 1
""".replace("IDLE_TTL", str(IDLE_TTL))

# KEYS: zset, info. ARGV: holder.
_RELEASE = """
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return removed
"""


def _holder(raw: bytes | str) -> SlotHolder:
    data = json.loads(raw)
    reaped = data.get("reaped_at")
    return SlotHolder(
        key=str(data.get("key", "")),
        holder=str(data.get("holder", "")),
        task_name=str(data.get("task_name", "")),
        task_id=str(data.get("task_id", "")),
        tenant=str(data.get("tenant", "")),
        acquired_at=float(data.get("acquired_at") or 0),
        heartbeat_at=float(data.get("heartbeat_at") or 0),
        reaped_at=None if reaped is None else float(reaped),
        state=str(data.get("state", LOST)),
    )


class RedisSlots:
    """The concurrency-slot half of :class:`~celery_guardrails.stores.redis.RedisStore` (mixed in)."""

    client: Any
    _errors: tuple[type[BaseException], ...]
    _slot_scripts: dict[str, Any] | None = None

    _failure: Callable[[BaseException], StoreError]  # RedisIdempotency's
    _now: Callable[[float], float]  # RedisIdempotency's: ``now`` on the Redis server's clock

    def _slot_script(self, name: str) -> Any:
        scripts = self._slot_scripts
        if scripts is None:  # registered at first use (each is loaded on the server at its first call)
            scripts = self._slot_scripts = {
                "acquire": self.client.register_script(_ACQUIRE),
                "reap": self.client.register_script(_REAP_ONLY),
                "heartbeat": self.client.register_script(_HEARTBEAT),
                "release": self.client.register_script(_RELEASE),
            }
        return scripts[name]

    def _slot_call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return self._slot_script(name)(keys=keys, args=args)
        except self._errors as exc:
            raise self._failure(exc) from exc

    def acquire_slot(
        self,
        key: str,
        *,
        holder: str,
        limit: int,
        now: float,
        reap_after: float,
        task_name: str = "",
        task_id: str = "",
        tenant: str = "",
    ) -> SlotAcquisition:
        server_now = self._now(now)
        info = json.dumps(
            {"task_name": task_name, "task_id": task_id, "tenant": tenant, "acquired_at": repr(server_now)}
        )
        acquired, holders, retry_at, was_empty, *reaped = self._slot_call(
            "acquire", slot_names(key), [repr(server_now), repr(reap_after), key, holder, limit, info]
        )
        if was_empty == b"1" and acquired == b"1":
            self._index(key)
        return SlotAcquisition(
            acquired=acquired == b"1",
            holders=int(holders),
            reaped=tuple(_holder(text) for text in reaped),
            retry_at=float(retry_at) - (server_now - now) if float(retry_at) else 0.0,  # on the caller's clock
        )

    def _index(self, key: str) -> None:
        try:
            self.client.sadd(SLOT_KEYS, key)
        except self._errors as exc:
            raise self._failure(exc) from exc

    def heartbeat_slot(self, key: str, *, holder: str, now: float) -> bool:
        return bool(self._slot_call("heartbeat", slot_names(key)[:3], [holder, repr(self._now(now))]))

    def release_slot(self, key: str, *, holder: str) -> bool:
        return bool(self._slot_call("release", slot_names(key)[:2], [holder]))

    def reap_slots(self, *, now: float) -> list[SlotHolder]:
        try:
            keys = sorted(member.decode() for member in self.client.smembers(SLOT_KEYS))
        except self._errors as exc:
            raise self._failure(exc) from exc
        server_now = self._now(now)
        reaped: list[SlotHolder] = []
        for key in keys:
            left, *texts = self._slot_call("reap", slot_names(key), [repr(server_now), "", key])
            reaped += [_holder(text) for text in texts]
            if int(left) == 0:
                self._forget_if_empty(key)
        return reaped

    def _forget_if_empty(self, key: str) -> None:
        """Take ``key`` out of the index; back in when a holder arrived between the reap and now (its acquire
        may have found the key in the index and not added it again)."""
        try:
            self.client.srem(SLOT_KEYS, key)
            if self.client.zcard(slot_names(key)[0]):
                self.client.sadd(SLOT_KEYS, key)
        except self._errors as exc:
            raise self._failure(exc) from exc

    def slot_status(self, key: str, *, now: float) -> dict[str, Any]:
        zset, info, meta, lost = slot_names(key)
        try:
            beats = self.client.zrange(zset, 0, -1, withscores=True)
            infos = self.client.hgetall(info)
            counts = {k.decode(): v.decode() for k, v in self.client.hgetall(meta).items()}
            records = self.client.lrange(lost, 0, 9)
        except self._errors as exc:
            raise self._failure(exc) from exc
        holders = []
        for member, beat in beats:
            data = json.loads(infos.get(member) or "{}")
            holders.append(
                SlotHolder(
                    key=key,
                    holder=member.decode(),
                    task_name=data.get("task_name", ""),
                    task_id=data.get("task_id", ""),
                    tenant=data.get("tenant", ""),
                    acquired_at=float(data.get("acquired_at") or 0),
                    heartbeat_at=float(beat),
                )
            )
        reap_after = float(counts.get("reap_after", 0)) or None
        return status_of(key, holders, [_holder(text) for text in records], counts, reap_after, now)


def status_of(
    key: str,
    holders: list[SlotHolder],
    lost: list[SlotHolder],
    counts: dict[str, Any],
    reap_after: float | None,
    now: float,
) -> dict[str, Any]:
    """The status dict both stores report (see :func:`celery_guardrails.concurrency_status`)."""
    return {
        "key": key,
        "held": len(holders),
        "holders": holders,
        "reap_after": reap_after,
        "stale": sum(1 for h in holders if reap_after is not None and h.heartbeat_at < now - reap_after),
        "checks": int(counts.get("checks") or 0),
        "acquired": int(counts.get("acquired") or 0),
        "reaped": int(counts.get("reaped") or 0),
        "recent_lost": lost,
    }


__all__ = ["RedisSlots", "slot_names", "status_of"]
