"""The Redis store: one hash per dependency, each operation one Lua script (atomic, one round trip).

The scripts mirror :func:`celery_guardrails.stores.budget_rules.decide_admission` and
:func:`~celery_guardrails.stores.budget_rules.decide_outcome` line by line; the hash fields are the fields of
:class:`~celery_guardrails.stores.budget_rules.DependencyState`. Numbers travel as strings (Redis would truncate a
Lua float to an integer reply). Each hash expires when its dependency has been quiet for a while.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_guardrails.exceptions import StoreError
from celery_guardrails.stores.base import Admission, BudgetPolicy, DependencyState, status
from celery_guardrails.stores.redis_activity import RedisActivity
from celery_guardrails.stores.redis_checkpoint import (
    CHECKPOINT_CLEAR_SCRIPT,
    CHECKPOINT_COMPLETE_SCRIPT,
    CHECKPOINT_SAVE_SCRIPT,
    RedisCheckpoints,
)
from celery_guardrails.stores.redis_client import connect, is_cluster
from celery_guardrails.stores.redis_client import failure as failure
from celery_guardrails.stores.redis_idempotency import (
    _ACK,
    _CLAIM,
    _COMPLETE_ACK,
    _COUNT,
    _DUE,
    _IF_OWNER,
    _REOPEN,
    _THROTTLE,
    RedisIdempotency,
)
from celery_guardrails.stores.redis_idempotency import ALERT_PENDING as ALERT_PENDING
from celery_guardrails.stores.redis_idempotency import ALERT_PREFIX as ALERT_PREFIX
from celery_guardrails.stores.redis_idempotency import DELIVERIES_PREFIX as DELIVERIES_PREFIX
from celery_guardrails.stores.redis_idempotency import IDEM_PREFIX as IDEM_PREFIX
from celery_guardrails.stores.redis_idempotency import LEGACY_ALERT_PENDING as LEGACY_ALERT_PENDING
from celery_guardrails.stores.redis_idempotency import LEGACY_ALERT_PREFIX as LEGACY_ALERT_PREFIX
from celery_guardrails.stores.redis_idempotency import PUBLISH_PREFIX as PUBLISH_PREFIX
from celery_guardrails.stores.redis_lane import Lane
from celery_guardrails.stores.redis_ledger import LEDGER_SCRIPT, RedisRunLedger
from celery_guardrails.stores.redis_ordering import ORDERING_SCRIPT, UNINDEX_SCRIPT, RedisOrdering
from celery_guardrails.stores.redis_slots import RedisSlots
from celery_guardrails.stores.redis_waiting import WAIT_NOTE_SCRIPT, RedisWaiting

logger = logging.getLogger(__name__)

#: The hash of each dependency's retry budget and circuit breaker.
KEY_PREFIX = "guardrails:dependency:"

# Shared prologue: read the hash into locals, roll the two-bucket window.
_LOAD = """
local key = KEYS[1]
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local h = {}
local raw = redis.call('HGETALL', key)
for i = 1, #raw, 2 do h[raw[i]] = raw[i + 1] end
local function num(name, default) local v = h[name]; if v then return tonumber(v) end; return default end
local index = math.floor(now / window)
local window_index = num('window_index', index)
local first_current, retries_current = num('first_current', 0), num('retries_current', 0)
local first_previous, retries_previous = num('first_previous', 0), num('retries_previous', 0)
if window_index < index then
  if window_index == index - 1 then
    first_previous, retries_previous = first_current, retries_current
  else
    first_previous, retries_previous = 0, 0
  end
  first_current, retries_current, window_index = 0, 0, index
end
local denied_window = num('denied_window', -1)
local failures = num('failures', 0)
local circuit = h['circuit'] or 'closed'
local open_until = num('open_until', 0)
local probes = num('probes', 0)
local probe_until = num('probe_until', 0)
local function save(ttl)
  redis.call('HSET', key, 'window_index', window_index, 'first_current', first_current,
    'retries_current', retries_current, 'first_previous', first_previous, 'retries_previous', retries_previous,
    'denied_window', denied_window, 'failures', failures, 'circuit', circuit,
    'open_until', string.format('%.6f', open_until), 'probes', probes,
    'probe_until', string.format('%.6f', probe_until))
  redis.call('EXPIRE', key, ttl)
end
"""

# ARGV: now, window, ratio, floor, retry (1/0), threshold, open_seconds, probes, ttl, probe_timeout
# Returns: allowed, reason, retry_at, first_denial, probe
_ADMIT = (
    _LOAD
    + """
local ratio, floor = tonumber(ARGV[3]), tonumber(ARGV[4])
local retry = ARGV[5] == '1'
local threshold, open_seconds, max_probes, ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]),
  tonumber(ARGV[9])
local weight = 1 - (now - index * window) / window
local firsts = first_current + first_previous * weight
local retries = retries_current + retries_previous * weight
if retry then
  if retries + 1 <= floor + ratio * firsts then
    retries_current = retries_current + 1
    save(ttl)
    return {'1', '', '0', '0', '0'}
  end
  local first_denial = '0'
  if denied_window ~= index then first_denial = '1' end
  denied_window = index
  save(ttl)
  return {'0', 'budget', string.format('%.6f', (index + 1) * window), first_denial, '0'}
end
if threshold > 0 then
  if circuit == 'open' and now >= open_until then circuit, probes = 'half_open', 0 end
  if circuit == 'open' then
    save(ttl)
    return {'0', 'circuit', string.format('%.6f', open_until), '0', '0'}
  end
  if circuit == 'half_open' then
    if probes >= max_probes and now < probe_until then
      save(ttl)
      return {'0', 'circuit', string.format('%.6f', math.min(now + open_seconds / 4, probe_until)), '0', '0'}
    end
    if probes >= max_probes then probes = 0 end
    probes = probes + 1
    probe_until = now + tonumber(ARGV[10])
    first_current = first_current + 1
    save(ttl)
    return {'1', '', '0', '0', '1'}
  end
end
first_current = first_current + 1
save(ttl)
return {'1', '', '0', '0', '0'}
"""
)

# ARGV: now, window, outcome (success / failure / release), threshold, open_seconds, ttl
_OUTCOME = (
    _LOAD
    + """
local outcome = ARGV[3]
local threshold, open_seconds, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if outcome == 'release' then
  if circuit == 'half_open' and probes > 0 then probes = probes - 1 end
  save(ttl)
  return '0'
end
if outcome == 'success' then
  failures, circuit, probes = 0, 'closed', 0
  save(ttl)
  return '0'
end
failures = failures + 1
if threshold > 0 and (circuit == 'half_open' or (circuit == 'closed' and failures >= threshold)) then
  circuit, open_until, probes = 'open', now + open_seconds, 0
  save(ttl)
  return '1'
end
save(ttl)
return '0'
"""
)

_INT_FIELDS = (
    "window_index",
    "first_current",
    "retries_current",
    "first_previous",
    "retries_previous",
    "denied_window",
    "failures",
    "probes",
)


class RedisStore(
    RedisIdempotency, RedisRunLedger, RedisCheckpoints, RedisOrdering, RedisSlots, RedisActivity, RedisWaiting
):
    """Store on a Redis server, a Redis Cluster or the master a Sentinel names, given by URL
    (``redis://127.0.0.1:6379/1``; see :mod:`~celery_guardrails.stores.redis_client`)."""

    def __init__(self, url: str, *, timeout: float | None = None) -> None:
        try:
            import redis
        except ImportError as exc:  # the "redis" extra
            raise StoreError("the Redis store needs the redis package: pip install 'celery-guardrails[redis]'") from exc
        self.url = url
        # A timeout on every socket (the lane's too: it is made from the pool's settings): a half-open
        # connection fails in ``timeout`` seconds instead of stalling the heartbeat thread, whose leases lapse.
        self.client = connect(url, timeout=timeout)
        self._cluster = is_cluster(url)
        self._skew, self._skew_checked = 0.0, 0.0
        # Registered once: each is loaded on the server at its first call, then called by its SHA.
        self._admit = self.client.register_script(_ADMIT)
        self._outcome = self.client.register_script(_OUTCOME)
        self._claim = self.client.register_script(_CLAIM)
        self._if_owner = self.client.register_script(_IF_OWNER)
        self._ack = self.client.register_script(_ACK)
        self._complete_ack = self.client.register_script(_COMPLETE_ACK)
        self._reopen = self.client.register_script(_REOPEN)
        self._count = self.client.register_script(_COUNT)
        self._throttle = self.client.register_script(_THROTTLE)
        self._due = self.client.register_script(_DUE)
        self._ledger = self.client.register_script(LEDGER_SCRIPT)
        self._checkpoint_save = self.client.register_script(CHECKPOINT_SAVE_SCRIPT)
        self._checkpoint_complete = self.client.register_script(CHECKPOINT_COMPLETE_SCRIPT)
        self._checkpoint_clear = self.client.register_script(CHECKPOINT_CLEAR_SCRIPT)
        self._ordering = self.client.register_script(ORDERING_SCRIPT)
        self._unindex = self.client.register_script(UNINDEX_SCRIPT)
        self._wait_note = self.client.register_script(WAIT_NOTE_SCRIPT)
        # A cluster client routes each command to its slot's node: there is no one pool to make a lane from.
        self._lane = Lane(None if self._cluster else self.client.connection_pool)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, redis.exceptions.RedisClusterException)

    @staticmethod
    def _ttl(policy: BudgetPolicy) -> int:
        return int(3 * policy.window + 2 * policy.open_seconds) + 60

    def _call(self, script: Any, dependency: str, args: list[Any]) -> Any:
        return self._eval(script, KEY_PREFIX + dependency, args)

    def admit(self, dependency: str, policy: BudgetPolicy, *, retry: bool, now: float) -> Admission:
        allowed, reason, retry_at, first_denial, probe = self._call(
            self._admit,
            dependency,
            [
                repr(now),
                repr(policy.window),
                repr(policy.ratio),
                policy.floor,
                int(retry),
                policy.threshold,
                repr(policy.open_seconds),
                policy.probes,
                self._ttl(policy),
                repr(policy.probe_timeout),
            ],
        )
        return Admission(
            allowed=allowed == b"1",
            reason=reason.decode(),
            retry_at=float(retry_at),
            first_denial=first_denial == b"1",
            probe=probe == b"1",
        )

    def record_outcome(self, dependency: str, policy: BudgetPolicy, *, outcome: str, now: float) -> bool:
        opened = self._call(
            self._outcome,
            dependency,
            [
                repr(now),
                repr(policy.window),
                outcome,
                policy.threshold,
                repr(policy.open_seconds),
                self._ttl(policy),
            ],
        )
        return bool(opened == b"1")

    def budget_status(self, dependency: str, policy: BudgetPolicy, *, now: float) -> dict[str, Any]:
        try:
            raw = self.client.hgetall(KEY_PREFIX + dependency)
        except self._errors as exc:
            raise self._failure(exc) from exc
        fields = {key.decode(): value.decode() for key, value in raw.items()}
        state = DependencyState(
            **{name: int(fields[name]) for name in _INT_FIELDS if name in fields},
            circuit=fields.get("circuit", "closed"),
            open_until=float(fields.get("open_until", 0)),
            probe_until=float(fields.get("probe_until", 0)),
        )
        return status(dependency, state, policy, now)

    def reset(self, dependency: str) -> None:
        try:
            self.client.delete(KEY_PREFIX + dependency)
        except self._errors as exc:
            raise self._failure(exc) from exc
