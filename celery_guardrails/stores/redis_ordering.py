"""Ordering per key on Redis (the ordering half of :class:`~celery_guardrails.stores.redis.RedisStore`).

One hash per key, ``guardrails:{order:<scoped key>}``, fields ``issued`` (the last sequence number handed
out), ``done`` (the last whose turn is over), ``gap_since``, ``waiting``, ``skipped_from``, ``skipped_to`` and
``stale``
(see :class:`~celery_guardrails.stores.base.OrderState`). Every operation is one Lua script on that one key:
atomic, one round trip. The braces are a Redis Cluster hash tag, so a later operation on two keys of one
ordering key (a list of waiters, say) still runs in one slot.

Retention: every operation but a read of an unknown key sets the hash to expire ``retention`` seconds later
(``ordering_retention``, 30 days by default). Should it lapse while messages of the key are still in flight
(a key quiet for longer than that, with a message parked for as long), the counters start again at 1: a
message whose sequence number is past the new ``issued`` is dead-lettered (``ordering_gap``: it cannot be put
in order any more), one below it runs in the new numbering, unordered against the old one. Both counters are
fields of one hash, so they can only lapse together: a ``done`` never survives its ``issued``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_guardrails.stores.base import OrderState

# KEYS: the key's hash. ARGV: op, now, retention, then per op:  next: -  check: sequence  advance: sequence
# skip: done, to. An unknown key is never made by check, advance or skip: made there, it would have no
# ``issued``, and the next publish would hand out a number already done.
ORDERING_SCRIPT = """
local key, op, now, retention = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
if op == 'next' then
  local issued = redis.call('HINCRBY', key, 'issued', 1)
  redis.call('EXPIRE', key, retention)
  return issued
end
if redis.call('EXISTS', key) == 0 then
  if op == 'check' then return {'0', '0', '0', '0', '0', '0', '0'} end
  return 0
end
local f = redis.call('HMGET', key, 'issued', 'done', 'gap_since', 'waiting', 'skipped_from', 'skipped_to', 'stale')
for i = 1, 7 do f[i] = f[i] or '0' end
local done = tonumber(f[2])
redis.call('EXPIRE', key, retention)
if op == 'check' then
  local sequence = tonumber(ARGV[4])
  if sequence > done + 1 then
    if tonumber(f[3]) == 0 then f[3] = now end
    if tonumber(f[4]) == 0 or sequence < tonumber(f[4]) then f[4] = ARGV[4] end
    redis.call('HSET', key, 'gap_since', f[3], 'waiting', f[4])
  elseif sequence <= done then
    f[7] = tostring(redis.call('HINCRBY', key, 'stale', 1))
  end
  return f
elseif op == 'advance' then
  if done ~= tonumber(ARGV[4]) - 1 then return 0 end
  redis.call('HSET', key, 'done', ARGV[4], 'gap_since', '0', 'waiting', '0')
  return 1
elseif op == 'skip' then
  local from, to = tonumber(ARGV[4]), tonumber(ARGV[5])
  if done ~= from or to <= from then return 0 end
  redis.call('HSET', key, 'done', ARGV[5], 'skipped_from', tostring(from + 1), 'skipped_to', ARGV[5],
    'gap_since', '0', 'waiting', '0')
  return 1
end
return redis.error_reply('unknown ordering operation ' .. op)
"""

ORDER_PREFIX = "guardrails:{order:"


def order_key(key: str) -> str:
    """The hash of an ordering key (scoped by task and tenant)."""
    return f"{ORDER_PREFIX}{key}}}"


class RedisOrdering:
    """The ordering operations of :class:`~celery_guardrails.stores.redis.RedisStore` (mixed in)."""

    _ordering: Any
    _eval: Callable[[Any, str, list[Any]], Any]  # RedisIdempotency's: on the lane, errors as the store's

    def _order(self, op: str, key: str, now: float, retention: float, *args: Any) -> Any:
        return self._eval(self._ordering, order_key(key), [op, f"{now:.6f}", max(1, int(retention)), *args])

    def order_next(self, key: str, *, now: float, retention: float) -> int:
        return int(self._order("next", key, now, retention))

    def order_check(self, key: str, *, sequence: int, now: float, retention: float) -> OrderState:
        found = self._order("check", key, now, retention, sequence)
        issued, done, gap_since, waiting, skipped_from, skipped_to, stale = found
        return OrderState(
            issued=int(issued),
            done=int(done),
            gap_since=float(gap_since),
            waiting=int(waiting),
            skipped_from=int(skipped_from),
            skipped_to=int(skipped_to),
            stale=int(stale),
        )

    def order_advance(self, key: str, *, sequence: int, now: float, retention: float) -> bool:
        return bool(self._order("advance", key, now, retention, sequence))

    def order_skip(self, key: str, *, done: int, to: int, now: float, retention: float) -> bool:
        return bool(self._order("skip", key, now, retention, done, to))
