"""The run ledger on Redis (the :class:`~celery_guardrails.scheduling.ledger.RunLedger` half of the Redis store).

Per schedule, one hash ``guardrails:{runs:<schedule>}`` maps a period (epoch seconds, as an integer string)
to its record (a JSON object, times as strings), and one sorted set ``guardrails:{runs:<schedule>}:index``
orders the periods. Every change is one Lua script, so "insert unless present" and "move from status A to B"
are atomic across beat processes and workers. Records older than :data:`~celery_guardrails.scheduling.ledger.RETENTION`
are dropped as new ones are written; both keys expire when a schedule has been quiet that long.

The braces are a Redis Cluster hash tag: both keys of a schedule hash to one slot, so one script may change
both on a cluster. Releases before it named them ``guardrails:runs:<schedule>`` and
``guardrails:runs-index:<schedule>``; on one server (or Sentinel's master) the script renames a schedule's
old keys to the new names the first time it touches a schedule that has no keys under the new names, and a
listing that finds nothing asks it to, so no history is lost on upgrade. A cluster never held the old names
(the old script could not run there), unless they were copied into it: see the README.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from celery_guardrails.exceptions import StoreError
from celery_guardrails.scheduling.ledger import (
    DISPATCHED,
    REASON_MAX_LENGTH,
    RETENTION,
    RUNNING,
    WAS_OVERDUE,
    Heads,
    Run,
)

#: The names of releases before the hash tag (read on one server only, to adopt them: see the docstring).
LEGACY_RUNS_PREFIX = "guardrails:runs:"
LEGACY_INDEX_PREFIX = "guardrails:runs-index:"


def runs_key(schedule: str) -> str:
    """The hash of ``schedule``'s records. The tag is ``runs:`` and the name up to its first ``}``: never
    empty, and the same in the index's name whatever the name holds."""
    return f"guardrails:{{runs:{schedule}}}"


def index_key(schedule: str) -> str:
    return f"{runs_key(schedule)}:index"


# KEYS: hash, index, and on one server the legacy hash and index. ARGV: op, schedule, period field, now,
# retention, then per op:
#   dispatch: task_id           record: status, reason          transition: to, reason, from...
#   start: task_id              finish: status, reason, prefix  undispatch: task_id
#   adopt: (nothing: only the renaming below)
LEDGER_SCRIPT = """
local runs, index = KEYS[1], KEYS[2]
local op, schedule, field, now, retention = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
if KEYS[4] and redis.call('EXISTS', runs, index) == 0 and redis.call('EXISTS', KEYS[3]) == 1 then
  -- a schedule written by a release before the hash tag: its keys take the new names, TTLs kept
  redis.call('RENAME', KEYS[3], runs)
  if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('RENAME', KEYS[4], index) end
end
if op == 'adopt' then return 0 end
local raw = redis.call('HGET', runs, field)
local r = nil
if raw then r = cjson.decode(raw) end
local function save(rec)
  redis.call('HSET', runs, field, cjson.encode(rec))
  redis.call('ZADD', index, tonumber(field), field)
  local horizon = tonumber(now) - retention
  local old = redis.call('ZRANGEBYSCORE', index, '-inf', '(' .. horizon)
  for _, f in ipairs(old) do redis.call('HDEL', runs, f) end
  redis.call('ZREMRANGEBYSCORE', index, '-inf', '(' .. horizon)
  redis.call('EXPIRE', runs, retention)
  redis.call('EXPIRE', index, retention)
end
local function fresh(status)
  return {schedule = schedule, period = field, status = status, task_id = '', reason = ''}
end
if op == 'dispatch' then
  if r then
    if r.status ~= 'missed' or r.task_id ~= '' then return 0 end
  else
    r = fresh('dispatched')
  end
  r.status, r.task_id, r.dispatched_at, r.finished_at = 'dispatched', ARGV[6], now, nil
  save(r)
  return 1
elseif op == 'undispatch' then
  if not r or r.status ~= 'dispatched' or r.task_id ~= ARGV[6] then return 0 end
  redis.call('HDEL', runs, field)
  redis.call('ZREM', index, field)
  return 1
elseif op == 'record' then
  if r then return 0 end
  r = fresh(ARGV[6])
  r.reason, r.finished_at = ARGV[7], now
  if ARGV[6] == 'missed' then r.missed_at = now end
  save(r)
  return 1
elseif op == 'transition' then
  if not r then return 0 end
  local allowed = false
  for i = 8, #ARGV do if r.status == ARGV[i] then allowed = true end end
  if not allowed then return 0 end
  r.status, r.reason = ARGV[6], ARGV[7]
  if ARGV[6] == 'overdue' and not r.overdue_at then r.overdue_at = now end
  local first = 1
  if ARGV[6] == 'missed' then
    -- A period is reported missed once: moved to missed again (a lost catch-up), it answers 0.
    if r.missed_at then first = 0 else r.missed_at = now end
  end
  save(r)
  return first
elseif op == 'start' then
  r = r or fresh('running')
  r.status, r.task_id, r.started_at, r.finished_at = 'running', ARGV[6], now, nil
  save(r)
  return 1
elseif op == 'finish' then
  r = r or fresh(ARGV[6])
  if ARGV[7] ~= '' then
    r.reason = ARGV[7]
  elseif r.status == 'overdue' then
    r.reason = ARGV[8] .. r.reason
  end
  r.status, r.finished_at = ARGV[6], now
  save(r)
  return 1
end
return redis.error_reply('unknown ledger operation ' .. op)
"""


def _field(period: float) -> str:
    return str(round(period))


def _time(value: Any) -> float | None:
    return None if value in (None, "") else float(value)


def _run(raw: bytes | str) -> Run:
    record = json.loads(raw)
    return Run(
        schedule=record["schedule"],
        period=float(record["period"]),
        status=record["status"],
        task_id=record.get("task_id") or "",
        dispatched_at=_time(record.get("dispatched_at")),
        started_at=_time(record.get("started_at")),
        finished_at=_time(record.get("finished_at")),
        reason=record.get("reason") or "",
        missed_at=_time(record.get("missed_at")),
        overdue_at=_time(record.get("overdue_at")),
    )


class RedisRunLedger:
    """The run-ledger operations of :class:`~celery_guardrails.stores.redis.RedisStore` (mixed in)."""

    client: Any
    url: str
    _errors: tuple[type[BaseException], ...]
    _ledger: Any
    _cluster: bool

    _failure: Callable[[BaseException], StoreError]  # RedisIdempotency's

    def _keys(self, schedule: str) -> list[str]:
        keys = [runs_key(schedule), index_key(schedule)]
        if not self._cluster:  # the old names, to adopt (another slot on a cluster, which never had them)
            keys += [LEGACY_RUNS_PREFIX + schedule, LEGACY_INDEX_PREFIX + schedule]
        return keys

    def _change(self, op: str, schedule: str, period: float, now: float, *args: str) -> bool:
        try:
            changed = self._ledger(
                keys=self._keys(schedule),
                args=[op, schedule, _field(period), f"{now:.6f}", int(RETENTION), *args],
            )
        except self._errors as exc:
            raise self._failure(exc) from exc
        return bool(changed)

    def run_dispatch(self, schedule: str, period: float, *, task_id: str, now: float) -> bool:
        return self._change("dispatch", schedule, period, now, task_id)

    def run_undispatch(self, schedule: str, period: float, *, task_id: str) -> bool:
        return self._change("undispatch", schedule, period, 0.0, task_id)

    def run_record(self, schedule: str, period: float, *, status: str, now: float, reason: str) -> bool:
        return self._change("record", schedule, period, now, status, reason[:REASON_MAX_LENGTH])

    def run_transition(
        self, schedule: str, period: float, *, from_: tuple[str, ...], to: str, now: float, reason: str
    ) -> bool:
        return self._change("transition", schedule, period, now, to, reason[:REASON_MAX_LENGTH], *from_)

    def run_start(self, schedule: str, period: float, *, task_id: str, now: float) -> None:
        self._change("start", schedule, period, now, task_id)

    def run_finish(self, schedule: str, period: float, *, status: str, now: float, reason: str = "") -> None:
        self._change("finish", schedule, period, now, status, reason[:REASON_MAX_LENGTH], WAS_OVERDUE)

    def run_list(
        self,
        schedule: str,
        *,
        statuses: tuple[str, ...] | None = None,
        before: float | None = None,
        limit: int = 100,
    ) -> list[Run]:
        top = "+inf" if before is None else f"({_field(before)}"
        found: list[Run] = []
        offset, page = 0, max(limit, 100)
        adopt = not self._cluster  # a schedule with no record may have them under the legacy names
        try:
            while len(found) < limit:
                fields = self.client.zrevrangebyscore(index_key(schedule), top, "-inf", start=offset, num=page)
                if not fields and adopt and offset == 0:
                    adopt = False
                    self._change("adopt", schedule, 0.0, 0.0)
                    continue  # and read again
                if not fields:
                    break
                offset += len(fields)
                for raw in self.client.hmget(runs_key(schedule), fields):
                    if raw is None:
                        continue
                    run = _run(raw)
                    if statuses is None or run.status in statuses:
                        found.append(run)
        except self._errors as exc:
            raise self._failure(exc) from exc
        return found[:limit]

    def run_heads(self, schedules: Iterable[str], *, limit: int = 500) -> dict[str, Heads]:
        # Per schedule, as the watchdog read it before: records are kept in one hash per schedule.
        heads = {}
        for name in dict.fromkeys(schedules):
            newest = self.run_list(name, limit=1)
            pending = tuple(self.run_list(name, statuses=(DISPATCHED, RUNNING), limit=limit))
            heads[name] = Heads(newest_period=newest[0].period if newest else None, pending=pending)
        return heads
