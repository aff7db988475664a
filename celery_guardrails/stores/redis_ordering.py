"""Ordering per key on Redis (the ordering half of :class:`~celery_guardrails.stores.redis.RedisStore`).

One hash per key, ``guardrails:{order:<scoped key>}``, fields ``issued`` (the last sequence number handed
out), ``done`` (the last whose turn is over), ``gap_since``, ``waiting``, ``skipped_from``, ``skipped_to``,
``stale``, ``skipped_since``, ``skipped_at``, ``skip_owed`` and ``alerted`` (see
:class:`~celery_guardrails.stores.base.OrderState`). Every operation is one Lua script on that one key:
atomic, one round trip. The braces are a Redis Cluster hash tag, so a later operation on two keys of one
ordering key (a list of waiters, say) still runs in one slot.

The keys that wait are indexed in a sorted set, ``guardrails:{order}:waiting`` (member the scoped key, score
the start of its wait), for the status command and the metrics: written when a wait starts and when it ends
(an advance or a skip), never by a message that only waits on. It is in a slot of its own on a cluster, so it
is written beside the script; an entry left behind (its removal lost) is taken out by the next read.

Retention: every operation but a read of an unknown key sets the hash to expire ``retention`` seconds later
(``ordering_retention``, 30 days by default). Should it lapse while messages of the key are still in flight
(a key quiet for longer than that, with a message parked for as long), the counters start again at 1: a
message whose sequence number is past the new ``issued`` is dead-lettered (``ordering_gap``: it cannot be put
in order any more), one below it runs in the new numbering, unordered against the old one. Both counters are
fields of one hash, so they can only lapse together: a ``done`` never survives its ``issued``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from celery_guardrails.exceptions import StoreError
from celery_guardrails.stores.base import OrderState, OrderWait, OrderWaits

# KEYS: the key's hash. ARGV: op, now, retention, then per op:  next: -  check: sequence  advance: sequence
# skip: done, to  recorded: to  alert: since. An unknown key is never made by check, advance, skip, recorded
# or alert: made there, it would have no ``issued``, and the next publish would hand out a number already done.
# check returns the fields, then "1" when this check started a wait (the caller indexes the key); advance and
# skip return 0 (not done), 1, or the start of the wait they ended (the caller takes the key out of the index).
# A check of a message that keeps waiting writes nothing: its re-publishes cost the key one write per wait.
ORDERING_SCRIPT = """
local key, op, now, retention = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
if op == 'next' then
  local issued = redis.call('HINCRBY', key, 'issued', 1)
  redis.call('EXPIRE', key, retention)
  return issued
end
local names = {'issued', 'done', 'gap_since', 'waiting', 'skipped_from', 'skipped_to', 'stale', 'skipped_since',
  'skipped_at', 'skip_owed', 'alerted'}
if redis.call('EXISTS', key) == 0 then
  if op == 'check' then return {'0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0'} end
  return 0
end
local f = redis.call('HMGET', key, unpack(names))
for i = 1, #names do f[i] = f[i] or '0' end
local done, gap_since = tonumber(f[2]), f[3]
redis.call('EXPIRE', key, retention)
if op == 'check' then
  local sequence = tonumber(ARGV[4])
  local started = '0'
  if sequence > done + 1 then
    local changed = false
    if tonumber(gap_since) == 0 then f[3] = now; started = '1'; changed = true end
    if tonumber(f[4]) == 0 or sequence < tonumber(f[4]) then f[4] = ARGV[4]; changed = true end
    if changed then redis.call('HSET', key, 'gap_since', f[3], 'waiting', f[4]) end
  elseif sequence <= done then
    f[7] = tostring(redis.call('HINCRBY', key, 'stale', 1))
  end
  f[#names + 1] = started
  return f
elseif op == 'advance' then
  if done ~= tonumber(ARGV[4]) - 1 then return 0 end
  redis.call('HSET', key, 'done', ARGV[4], 'gap_since', '0', 'waiting', '0')
  if tonumber(gap_since) ~= 0 then return gap_since end
  return 1
elseif op == 'skip' then
  local from, to = tonumber(ARGV[4]), tonumber(ARGV[5])
  if done ~= from or to <= from then return 0 end
  local since = gap_since
  if tonumber(since) == 0 then since = now end
  redis.call('HSET', key, 'done', ARGV[5], 'skipped_from', tostring(from + 1), 'skipped_to', ARGV[5],
    'skipped_since', since, 'skipped_at', now, 'skip_owed', '1', 'gap_since', '0', 'waiting', '0')
  return since
elseif op == 'recorded' then
  if tonumber(f[6]) ~= tonumber(ARGV[4]) or f[10] ~= '1' then return 0 end
  redis.call('HSET', key, 'skip_owed', '0')
  return 1
elseif op == 'alert' then
  local since = tonumber(ARGV[4])
  if tonumber(gap_since) ~= since or tonumber(f[11]) == since then return 0 end
  redis.call('HSET', key, 'alerted', ARGV[4])
  return 1
end
return redis.error_reply('unknown ordering operation ' .. op)
"""

# KEYS: the waiting index. ARGV: the ordering key, the start of the wait it no longer has. Taken out only when
# its score is still that start: a wait that started again meanwhile (a higher score, ZADD GT) stays indexed.
UNINDEX_SCRIPT = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and math.abs(tonumber(score) - tonumber(ARGV[2])) < 0.000001 then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
"""

ORDER_PREFIX = "guardrails:{order:"
#: The keys that wait, by the start of their wait: a sorted set, member the scoped key, score ``gap_since``.
#: Its own slot of a cluster, so it is written beside the scripts (once as a wait starts, once as it ends).
WAITING_INDEX = "guardrails:{order}:waiting"


def order_key(key: str) -> str:
    """The hash of an ordering key (scoped by task and tenant)."""
    return f"{ORDER_PREFIX}{key}}}"


def _since(value: Any) -> float:
    return float(value.decode() if isinstance(value, bytes) else value)


class RedisOrdering:
    """The ordering operations of :class:`~celery_guardrails.stores.redis.RedisStore` (mixed in)."""

    client: Any
    _ordering: Any
    _unindex: Any
    _errors: tuple[type[BaseException], ...]
    _eval: Callable[[Any, str, list[Any]], Any]  # RedisIdempotency's: on the lane, errors as the store's
    _failure: Callable[[BaseException], StoreError]

    def _order(self, op: str, key: str, now: float, retention: float, *args: Any) -> Any:
        return self._eval(self._ordering, order_key(key), [op, f"{now:.6f}", max(1, int(retention)), *args])

    def order_next(self, key: str, *, now: float, retention: float) -> int:
        return int(self._order("next", key, now, retention))

    def order_check(self, key: str, *, sequence: int, now: float, retention: float) -> OrderState:
        found = self._order("check", key, now, retention, sequence)
        issued, done, gap_since, waiting, skipped_from, skipped_to, stale, since, at, owed, alerted, started = found
        state = OrderState(
            issued=int(issued),
            done=int(done),
            gap_since=_since(gap_since),
            waiting=int(waiting),
            skipped_from=int(skipped_from),
            skipped_to=int(skipped_to),
            stale=int(stale),
            skipped_since=_since(since),
            skipped_at=_since(at),
            skip_owed=int(owed) == 1,
            alerted=_since(alerted),
        )
        if int(started) == 1:
            # GT: a later start replaces an earlier one whose removal is still on its way (see UNINDEX_SCRIPT).
            self._redis(lambda: self.client.zadd(WAITING_INDEX, {key: state.gap_since}, gt=True))
        return state

    def order_advance(self, key: str, *, sequence: int, now: float, retention: float) -> bool:
        return self._ended(key, self._order("advance", key, now, retention, sequence))

    def order_skip(self, key: str, *, done: int, to: int, now: float, retention: float) -> bool:
        return self._ended(key, self._order("skip", key, now, retention, done, to))

    def order_recorded(self, key: str, *, to: int, now: float, retention: float) -> bool:
        return bool(self._order("recorded", key, now, retention, to))

    def order_alert(self, key: str, *, since: float, now: float, retention: float) -> bool:
        return bool(self._order("alert", key, now, retention, f"{since:.6f}"))

    def order_waits(self, *, now: float, limit: int) -> OrderWaits:
        count = int(self._redis(lambda: self.client.zcard(WAITING_INDEX)))
        oldest: list[OrderWait] = []
        if count:
            # The oldest first; an entry whose key no longer waits (its removal was lost, its counters lapsed)
            # is taken out here and not counted.
            members = self._redis(lambda: self.client.zrange(WAITING_INDEX, 0, limit - 1, withscores=True))
            for member, score in members:
                key = member.decode()
                done, gap_since, waiting = (_since(value or b"0") for value in self._fields(key))
                if not gap_since:
                    count -= int(self._redis(partial(self._unindex, keys=[WAITING_INDEX], args=[key, score])))
                    continue
                oldest.append(OrderWait(key=key, waiting_for=int(done) + 1, lowest=int(waiting), since=gap_since))
        return OrderWaits(count=max(count, len(oldest)), oldest=tuple(sorted(oldest, key=lambda wait: wait.since)))

    def _fields(self, key: str) -> list[Any]:
        """``done``, ``gap_since`` and ``waiting`` of ``key`` (None each when it has none)."""
        return list(self._redis(partial(self.client.hmget, order_key(key), "done", "gap_since", "waiting")))

    def _ended(self, key: str, answer: Any) -> bool:
        """The answer of an advance or a skip: whether it moved the key; a wait it ended leaves the index."""
        if answer in (0, 1, b"0", b"1"):
            return bool(int(answer))
        self._redis(lambda: self._unindex(keys=[WAITING_INDEX], args=[key, _since(answer)]))
        return True

    def _redis(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except self._errors as exc:
            raise self._failure(exc) from exc
