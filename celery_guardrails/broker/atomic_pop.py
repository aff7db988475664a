"""The atomic pop: on a Redis broker, a worker takes a message and records it as handed out in one step.

kombu's Redis transport (kombu/transport/redis.py, kombu 5.7) takes a message in two steps: ``BRPOP`` removes
it from its queue's list, and when the reply has been read, ``QoS.append`` writes it to the ``unacked`` hash
(the copy that ``restore_visible`` gives back to the queue if the worker never acks it). Between the two the
message exists only in flight and in the worker's memory, so a worker that dies there loses it for good
(celery/kombu#305, open since 2014). The window is not a few microseconds: kombu 5.7 stops reading a ``BRPOP``
reply while the worker's prefetch is full (``MultiChannelPoller._pause_brpop``), and a message may wait there
in the socket buffer for as long as a task runs. ``make soak``, which SIGKILLs a worker every 20 s, lost about
one message in ten kills that way.

:class:`Transport` closes the window. Its channel never pops with ``BRPOP``:

1. It waits with ``BLMOVE q q RIGHT RIGHT <wait>`` on the first of the queues it consumes: a move of the list's
   tail onto its own tail, which leaves the list as it was (Redis 6.2+) and returns as soon as the list holds a
   message, or after ``<wait>`` seconds (transport option ``guardrails_pop_wait``, default 0.25 s).
2. It then runs one Lua script (:data:`POP`) over every list ``BRPOP`` would have read, in the same order
   (priority, then queue): the script pops the first message and writes it to ``unacked`` and
   ``unacked_index``, in one atomic step on the server. A worker that dies after it finds its message in
   ``unacked``, from where kombu's ``restore_visible`` gives it back after the visibility timeout (as it does
   for any delivery whose worker died); a worker that dies before it never took the message.

A message waiting in any other list (a second queue, a priority list) is found by the next script, at most
``guardrails_pop_wait`` later when the worker is idle, at once when it is busy. A list item that is not a
kombu message (no JSON object with ``properties.delivery_tag`` and ``properties.delivery_info``), on which
kombu's ``BRPOP`` would raise after losing it, is moved to the list :data:`MALFORMED_KEY` and logged, not lost.
Redis's own JSON decoder refuses some messages Python reads (a lone surrogate escaped in a header, as Celery's
``argsrepr`` holds when an argument has one; nesting past 1,000 levels): the script moves those aside too, and
the worker, reading it with Python, takes back a real kombu message from that list and records it as handed out
in one more step (:data:`RESCUE`), then delivers it as any other (a worker that dies between the two steps
leaves it in :data:`MALFORMED_KEY`, not lost).

A :class:`PopHook` given in the transport options at worker start-up (:data:`HOOK_OPTION`) takes one more step
in the same script with each message taken, and hears when its delivery ends (acked, rejected, given back): the
claim of a keyed message's idempotency key (:mod:`celery_guardrails.guardrails.pop_claims`).

The worker uses it when ``broker_atomic_pop`` is on (the default) and the broker URL is ``redis://`` with no
``broker_transport`` set (:func:`configure`). Not covered: ``rediss://`` and ``sentinel://`` brokers (set
``broker_transport`` to this module's ``Transport`` for ``rediss://``), a Redis that refuses ``BLMOVE`` or the
script (older than 6.2, or an ACL without them: the channel logs a warning once and pops as kombu does), and
``basic_get`` (not used by workers: kombu's ``_get`` is
kept, since it cannot know whether the caller will ack).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from queue import Empty
from time import monotonic, time
from typing import Any, Protocol

from kombu.transport import redis as _kombu_redis
from kombu.transport import virtual as _virtual
from kombu.utils import encoding as _encoding
from kombu.utils import json as _json

# kombu is only partly typed: its Redis transport is used as an untyped module.
kombu_redis: Any = _kombu_redis
VirtualQoS: Any = _virtual.QoS
bytes_to_str: Any = _encoding.bytes_to_str
loads: Any = _json.loads
dumps: Any = _json.dumps

logger = logging.getLogger(__name__)

#: The value of ``broker_transport`` that selects this transport.
TRANSPORT = "celery_guardrails.broker.atomic_pop:Transport"
#: The Redis list a queue item that is not a kombu message is moved to (under kombu's ``global_keyprefix``).
MALFORMED_KEY = "guardrails.malformed_messages"
#: Seconds the channel waits for its first queue before it looks at every list again.
DEFAULT_WAIT = 0.25

#: The pop's loop. KEYS: the unacked hash, the unacked index, the malformed list, then the lists to pop from, in
#: order. ARGV[1]: the time to score the delivery with (the worker's clock, as kombu scores its index); the rest
#: are a hook's (:class:`PopHook`). Returns {list, item, ...} (the hook's ``after_pop`` answer appended; nothing
#: when the step raised), {"", list, item} for an item moved aside as malformed, or false when every list is
#: empty. Run after a definition of ``after_pop(message)`` (:data:`NO_STEP`, or a hook's).
POP_LOOP = """
for i = 4, #KEYS do
  local item = redis.call('RPOP', KEYS[i])
  if item then
    local ok, message = pcall(cjson.decode, item)
    local properties = ok and type(message) == 'table' and message['properties']
    local info = type(properties) == 'table' and properties['delivery_info']
    local tag = type(properties) == 'table' and properties['delivery_tag']
    if type(info) ~= 'table' or type(tag) ~= 'string' or tag == '' then
      redis.call('LPUSH', KEYS[3], item)
      return {'', KEYS[i], item}
    end
    local exchange, routing_key = info['exchange'] or '', info['routing_key'] or ''
    redis.call('ZADD', KEYS[2], ARGV[1], tag)
    local record = '[' .. item .. ',' .. cjson.encode(exchange) .. ',' .. cjson.encode(routing_key) .. ']'
    redis.call('HSET', KEYS[1], tag, record)
    -- The step never fails the pop: Redis keeps a script's writes up to its error, so the message would stay
    -- recorded as handed out and never reach the worker (its key not a hash: WRONGTYPE), each time it came back.
    local stepped, extra = pcall(after_pop, message)
    if stepped and extra then return {KEYS[i], item, unpack(extra)} end
    return {KEYS[i], item}
  end
end
return false
"""
#: The step of a pop with no hook: nothing.
NO_STEP = "local function after_pop(message) return nil end\n"
#: The pop script of a worker with no hook.
POP = NO_STEP + POP_LOOP

#: A message Redis's decoder refused and Python reads, taken back from the malformed list and recorded as handed
#: out. KEYS: the unacked hash, the unacked index, the malformed list. ARGV: the item, its delivery tag, its
#: unacked record, the time. Returns 1, or 0 when the item is no longer in the malformed list (nothing done).
RESCUE = """
if redis.call('LREM', KEYS[3], 1, ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[2])
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
"""


#: Tags of deliveries this process consumed whose message the guardrails store has acked already (with its
#: key's completion: see celery_guardrails.guardrails.acks): the worker's ack then only forgets them.
ACKED_BY_STORE: set[str] = set()
#: The store's acks sent and not read yet, by delivery tag: each reads its answer as the worker acks (or rejects)
#: that delivery, on the thread that sent it, and says whether the store acked the message (False: the worker's
#: own ack removes it). Never raises. See :func:`read_at_ack`.
UNREAD: dict[str, Callable[[], bool]] = {}
#: Answers left unread at most (a delivery the worker never acked): past it, the oldest are read at once.
UNREAD_MAX = 1_000


class PopHook(Protocol):
    """A step the pop takes with every message it takes, in the same script (the transport option
    :data:`HOOK_OPTION`, set at worker start-up: :mod:`celery_guardrails.guardrails.pop_claims`). Its methods run
    in the consumer and must not raise."""

    #: The pop script: its own ``after_pop(message)`` (a Lua function returning a table of values, or nil) and then
    #: :data:`POP_LOOP`.
    script: str

    def arguments(self) -> list[Any]:
        """ARGV for one pop, after the time."""

    def popped(self, tag: str, answer: list[str]) -> None:
        """What ``after_pop`` answered for the message of delivery ``tag`` (before the worker is handed it)."""

    def ended(self, tag: str) -> None:
        """The worker acked, rejected or gave back the delivery ``tag``."""


#: The transport option that hands a :class:`PopHook` to the channels of an app's connections (set at worker
#: start-up; the option, not a global, so that only that app's consumers take the step).
HOOK_OPTION = "guardrails_pop_hook"


def _ended(channel: Any, tag: str) -> None:
    hook: PopHook | None = getattr(channel, HOOK_OPTION, None)
    if hook is None:
        return
    try:
        hook.ended(tag)
    except Exception:  # an ack is never kept from happening by a hook
        logger.exception("The pop hook failed as delivery %s ended", tag)


#: The process whose channel consumes (set as it waits for messages): only there does the worker ack a delivery
#: itself (a prefork child's deliveries are acked by the main process, which cannot see a child's set).
_consumer_pid = 0


#: The thread that consumes: with the solo pool, the one that runs the tasks and acks their messages too.
_consumer_thread = 0


def consumes_here() -> bool:
    """Whether this process's worker consumes with :class:`Channel` (solo and threads pools: the tasks run where
    their messages are acked)."""
    return _consumer_pid == os.getpid()


def read_at_ack(tag: str, read: Callable[[], bool]) -> bool:
    """Have the store's answer for delivery ``tag`` read as the worker acks it (``read``: see :data:`UNREAD`), when
    this thread is the one that acks it (the solo pool: the consumer's): the round trip then overlaps Celery's work
    after the task's hooks. False: not here (a pool thread), to be read now."""
    if _consumer_pid != os.getpid() or _consumer_thread != threading.get_ident():
        return False
    while len(UNREAD) >= UNREAD_MAX:  # answers of deliveries never acked: read, in order, on this same thread
        _store_acked(next(iter(UNREAD)))
    UNREAD[tag] = read
    return True


def _read(read: Callable[[], bool], tag: str) -> bool:
    try:
        return read()
    except Exception:  # whatever it meets, the worker's own ack removes the message
        logger.exception("The store's ack of delivery %s could not be read; the worker acks it", tag)
        return False


def _store_acked(tag: str) -> bool:
    """Whether the store acked delivery ``tag``, its answer read first when it was left unread."""
    read = UNREAD.pop(tag, None)
    if read is None:
        return tag in ACKED_BY_STORE
    ACKED_BY_STORE.discard(tag)  # in doubt until read: whatever interrupts the read, the message is not forgotten
    if not _read(read, tag):
        return False
    ACKED_BY_STORE.add(tag)
    return True


class QoS(kombu_redis.QoS):  # type: ignore[misc]
    """kombu's QoS, except that a delivery the pop script already recorded is not written to Redis again, and a
    message the guardrails store acked (:data:`ACKED_BY_STORE`) is not removed again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: set[str] = set()

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in self.recorded:
            self.recorded.discard(delivery_tag)
            VirtualQoS.append(self, message, delivery_tag)  # only the in-memory map of held deliveries
            return
        super().append(message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        _ended(self.channel, delivery_tag)
        if _store_acked(delivery_tag):
            ACKED_BY_STORE.discard(delivery_tag)
            VirtualQoS.ack(self, delivery_tag)  # only the in-memory map: Redis holds nothing of it any more
            return
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        _ended(self.channel, delivery_tag)
        if _store_acked(delivery_tag):  # acked with its completion: there is nothing to give back
            ACKED_BY_STORE.discard(delivery_tag)
            VirtualQoS.ack(self, delivery_tag)
            return
        super().reject(delivery_tag, requeue=requeue)

    def restore_unacked(self, client: Any = None) -> None:
        for tag in list(self._delivered):  # given back at shutdown, never run here
            _ended(self.channel, tag)
            if _store_acked(tag):  # ran and acked with its completion (the worker's ack had not come yet): kept
                ACKED_BY_STORE.discard(tag)
                self._delivered.pop(tag, None)
        super().restore_unacked(client)


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    """kombu's Redis channel with the pop of :data:`POP` in place of ``BRPOP``."""

    QoS = QoS
    from_transport_options: tuple[str, ...] = (
        *kombu_redis.Channel.from_transport_options,
        "guardrails_pop_wait",
        HOOK_OPTION,
    )
    guardrails_pop_wait = DEFAULT_WAIT
    guardrails_pop_hook: PopHook | None = None

    #: False once the server refused BLMOVE or the pop script (Redis before 6.2, an ACL without them): kombu's pop.
    _atomic = True
    #: The pop script this channel loaded, and its SHA.
    _pop_sha: tuple[str, str] | None = None
    _waited_for: tuple[str, ...] = ()

    def _refused(self, error: Exception) -> bool:
        """Whether ``error`` is the server refusing BLMOVE or the script (unknown command, no permission): if so,
        this channel pops as kombu does from now on, and says so once. Nothing was taken: the refused command
        did not run."""
        text = str(error).lower()
        if "unknown command" not in text and "noperm" not in text and "no permission" not in text:
            return False
        self._atomic = False
        logger.warning(
            "The broker's Redis refused the atomic pop (%s): this worker pops as kombu does, and a worker killed "
            "between the pop and its record loses that message (celery/kombu#305). Needs Redis 6.2+ with BLMOVE, "
            "EVALSHA and SCRIPT allowed",
            error,
        )
        return True

    def _brpop_start(self, timeout: float | None = None) -> None:
        global _consumer_pid, _consumer_thread
        if not self._atomic:
            return super()._brpop_start(timeout)  # type: ignore[no-any-return]
        _consumer_pid, _consumer_thread = os.getpid(), threading.get_ident()
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return None
        # The lists BRPOP would read, in its order: every queue's list for the highest priority first.
        self._waited_for = tuple(self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues)
        wait = float(self.guardrails_pop_wait)
        if timeout is not None:
            wait = min(wait, float(timeout))
        first = self.global_keyprefix + queues[0]
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()
        # A blocking wait that takes nothing: the list's tail moved onto its own tail.
        self.client.connection.send_command("BLMOVE", first, first, "RIGHT", "RIGHT", wait)
        return None

    def _brpop_read(self, **options: Any) -> bool:
        if not self._atomic:
            return super()._brpop_read(**options)  # type: ignore[no-any-return]
        try:
            try:
                self.client.parse_response(self.client.connection, "BLMOVE", **options)
            except self.connection_errors:
                # As kombu does: disconnect, so that the next poll reconnects.
                self.client.connection.disconnect()
                raise
            except redis_errors().ResponseError as error:
                if self._refused(error):
                    raise Empty() from None
                raise
        finally:
            self._in_poll = None
            flush = getattr(self, "_flush_brpop_reauth", None)  # kombu 5.7: a pending re-auth, now the line is idle
            if flush is not None:
                flush()
        if self._closing:
            raise Empty()
        return self._pop()

    def _pop(self) -> bool:
        """Take the first message of the lists waited for, recorded as handed out in the same step."""
        prefix = self.global_keyprefix
        keys = [self.unacked_key, self.unacked_index_key, MALFORMED_KEY, *self._waited_for]
        hook = self.guardrails_pop_hook
        if hook is not None:
            try:
                extra = hook.arguments()
            except Exception:  # the pop goes on without its step
                logger.exception("The pop hook gave no arguments; popping without it")
                hook = None
        try:
            found = self._run_pop(
                [prefix + key for key in keys],
                [time(), *extra] if hook is not None else [time()],
                script=hook.script if hook is not None else POP,
            )
        except redis_errors().ResponseError as error:
            if self._refused(error):
                raise Empty() from None
            raise
        if not found:
            raise Empty()
        source, item, *rest = (bytes_to_str(part) for part in found)
        answer: list[str] = []  # the hook's
        if not source:
            payload = self._rescue(rest[0] if rest else None, keys=[prefix + key for key in keys[:3]])
            if payload is None:
                logger.error(
                    "Queue list %s held an item that is not a kombu message; moved to the Redis list %s (LRANGE it "
                    "to see it)",
                    item[len(prefix) :],
                    prefix + MALFORMED_KEY,
                )
                raise Empty()
            source = item
        else:
            payload, answer = loads(item), rest
        tag = payload["properties"]["delivery_tag"]
        queue = source[len(prefix) :].rsplit(self.sep, 1)[0]
        self._queue_cycle.rotate(queue)
        if answer and hook is not None:  # before the worker is handed the message: a solo pool runs it in _deliver
            try:
                hook.popped(tag, answer)
            except Exception:  # what the hook took lapses with its lease; the message is delivered all the same
                logger.exception("The pop hook failed for delivery %s", tag)
        self.qos.recorded.add(tag)
        try:
            self.connection._deliver(payload, queue)
        finally:
            # Delivered: QoS.append took it off. Not delivered: the record stays in unacked, and kombu gives the
            # message back to its queue after the visibility timeout.
            self.qos.recorded.discard(tag)
        return True

    def _rescue(self, item: str | None, *, keys: list[str]) -> Any:
        """The kombu message ``item``, taken back from the malformed list and recorded as handed out (see
        :data:`RESCUE`); None when it is not one (Python cannot read it either), or is no longer there."""
        if item is None:
            return None
        try:
            payload = loads(item)
            properties = payload["properties"]
            tag, info = properties["delivery_tag"], properties["delivery_info"]
            if not (isinstance(tag, str) and tag and isinstance(info, dict)):
                return None
            record = dumps([item, info.get("exchange") or "", info.get("routing_key") or ""])
        except Exception:  # not a kombu message (not JSON, not a mapping, no properties)
            return None
        import redis

        taken = redis.Redis.execute_command(self.client, "EVAL", RESCUE, len(keys), *keys, item, tag, record, time())
        return payload if taken else None

    def _run_pop(self, keys: list[str], arguments: list[Any], *, script: str) -> Any:
        # The channel's own client, on its own connection (idle now that the wait's reply is read); keys are
        # prefixed here, so the base class's command runs, not kombu's prefixing one (which prefixes one key).
        import redis  # here, not at the top: the module is imported on RabbitMQ too, where redis-py may be absent

        client = self.client
        execute = redis.Redis.execute_command
        try:
            if self._pop_sha is None or self._pop_sha[0] is not script:
                self._pop_sha = (script, bytes_to_str(execute(client, "SCRIPT", "LOAD", script)))
            try:
                return execute(client, "EVALSHA", self._pop_sha[1], len(keys), *keys, *arguments)
            except redis.exceptions.NoScriptError:  # the server restarted, or its script cache was flushed
                self._pop_sha = (script, bytes_to_str(execute(client, "SCRIPT", "LOAD", script)))
                return execute(client, "EVALSHA", self._pop_sha[1], len(keys), *keys, *arguments)
        except self.connection_errors:
            client.connection.disconnect()
            raise


def redis_errors() -> Any:
    """redis-py's exceptions module (imported when a Redis channel runs: redis-py may be absent elsewhere)."""
    import redis

    return redis.exceptions


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    """kombu's Redis transport whose consumers pop with :class:`Channel` (see the module docstring)."""

    Channel = Channel


def configure(app: Any) -> bool:
    """Worker start-up: select :class:`Transport` when ``broker_atomic_pop`` is on, the broker (the read
    broker, if set) is a ``redis://`` URL and ``broker_transport`` is unset. True when it did."""
    from celery_guardrails.broker.kind import kind_of_url
    from celery_guardrails.options import app_value

    if not app_value(app, "broker_atomic_pop") or app.conf.broker_transport:
        return False
    # Plain redis:// only, every URL of a failover list: the channel connects as kombu's Redis channel does, so
    # not through Sentinel (a sentinel:// broker keeps kombu's SentinelTransport, whose channel asks the
    # Sentinels for the master: this module's Transport would talk to a Sentinel as if it were the master).
    kind = kind_of_url(app.conf.broker_read_url or app.conf.broker_url)
    if not kind.urls or kind.scheme != "redis" or not kind.uniform:
        return False
    app.conf.broker_transport = TRANSPORT
    return True
