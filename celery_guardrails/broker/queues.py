"""Queue depth and the age of the oldest message, read from the broker without consuming anything.

:func:`read_queues` looks at the queues the app declares (``task_queues``, ``task_default_queue``) and any
names given, on the app's own broker connection (``app.connection_for_read()``: its URL, database, key prefix,
TLS and transport options), and returns one :class:`QueueDepth` per queue.

Redis (kombu's transport, kombu 5.7): a queue is one list per priority step, ``<queue>`` and
``<queue>\\x06\\x16<step>`` for each step of the channel's ``priority_steps`` after the first, under the
``global_keyprefix`` transport option. kombu LPUSHes and consumers pop from the right, so the oldest message of
each list is its tail (index -1). The depth is the sum of the lists' lengths; the oldest message is the one
whose ``pub`` (:func:`celery_guardrails.runtime.headers.published_at`) is earliest among the tails. All lists are read
in one script, so the lengths and tails are one consistent snapshot. (The script is sent with EVAL: kombu's
prefixing client prefixes LLEN but not LINDEX, so the keys are prefixed here, once, and EVAL is not touched.)

A tail that is not a kombu message, or carries no ``pub`` (published by plain Celery or another producer),
is counted in the depth and makes the age unknown (``oldest_age`` None, ``unknown_age`` True): never zero, and
never the age of a younger message, since the unknown one may be the oldest.

RabbitMQ: the depth is the ready-message count of a passive ``queue_declare`` (messages delivered and not yet
acked are not in it). The age of the oldest message cannot be had over AMQP without consuming it, so it is
always reported unknown (``oldest_age`` None, ``unknown_age`` True): that is the documented limit, not a
failure. A queue the broker does not have (declared by the app, never created) reads as empty, ``exists``
False. Other brokers are read the same way through kombu's passive declare when they support it.

An empty queue has no oldest message: ``oldest_age`` 0.0 and ``unknown_age`` False.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from celery_guardrails.broker.kind import is_redis_connection
from celery_guardrails.runtime.headers import HEADER, published_at

logger = logging.getLogger(__name__)

# KEYS: the queue's priority lists. Returns, per list, its length and its tail (false when empty).
_READ = """
local out = {}
for i, key in ipairs(KEYS) do
  out[2 * i - 1] = redis.call('LLEN', key)
  out[2 * i] = redis.call('LINDEX', key, -1)
end
return out
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueDepth:
    """One queue as the broker holds it now.

    ``depth``: messages waiting (not counting those delivered and not yet acked). ``oldest_age``: seconds since
    the oldest waiting message was published (0.0 when the queue is empty; None when unknown: see
    ``unknown_age``). ``oldest_published_at``: its ``pub`` (epoch seconds), None when unknown or empty.
    ``unknown_age``: the age cannot be told (a message without ``pub`` at a list's tail, or a RabbitMQ queue).
    ``exists``: False for a queue the broker does not have (RabbitMQ; a Redis queue always "exists").
    """

    queue: str
    depth: int
    oldest_age: float | None
    oldest_published_at: float | None
    unknown_age: bool
    exists: bool = True


def declared_queues(app: Any, extra: Iterable[str] = ()) -> list[str]:
    """The queue names of ``app`` (``task_default_queue``, then ``task_queues``) and ``extra``, once each."""
    names: list[str] = []
    default = app.conf.task_default_queue
    if default:
        names.append(str(default))
    queues = app.conf.task_queues or ()
    for queue in queues.values() if isinstance(queues, dict) else queues:
        name = getattr(queue, "name", queue)
        if name:
            names.append(str(name))
    names.extend(str(name) for name in extra if name)
    return list(dict.fromkeys(names))


def read_queues(app: Any, names: Iterable[str] = (), *, now: float | None = None) -> list[QueueDepth]:
    """Depth and oldest age of each of the app's queues and ``names`` (see the module docstring).

    ``now``: epoch seconds the ages are measured at (default ``time.time()``, the clock ``pub`` is written
    with). Raises the broker's connection error when it cannot be reached (a caller that must not fail, such as
    a metrics scrape, catches it).
    """
    queues = declared_queues(app, names)
    with app.connection_for_read() as connection:
        # One attempt: a status read or a scrape reports the broker down; it does not wait for it.
        connection.ensure_connection(max_retries=1)
        channel = connection.default_channel
        current = time.time() if now is None else now
        if is_redis_connection(connection):
            return [_read_redis(channel, name, current) for name in queues]
        return [_read_passive(connection, name) for name in queues]


def priority_keys(channel: Any, queue: str) -> list[str]:
    """The Redis keys of ``queue``'s lists, one per priority step, as kombu names them (no global prefix)."""
    return list(dict.fromkeys(channel._q_for_pri(queue, step) for step in channel.priority_steps))


def _read_redis(channel: Any, queue: str, now: float) -> QueueDepth:
    prefix = getattr(channel, "global_keyprefix", "") or ""
    keys = [prefix + key for key in priority_keys(channel, queue)]
    with channel.conn_or_acquire() as client:
        replies = client.eval(_READ, len(keys), *keys)
    depth, oldest, unknown = 0, None, False
    for length, tail in zip(replies[0::2], replies[1::2], strict=True):
        depth += int(length)
        if not length or not tail:
            continue
        published = tail_published_at(tail)
        if published is None:
            unknown = True
        elif oldest is None or published < oldest:
            oldest = published
    if depth == 0:
        return QueueDepth(queue=queue, depth=0, oldest_age=0.0, oldest_published_at=None, unknown_age=False)
    if unknown or oldest is None:
        return QueueDepth(queue=queue, depth=depth, oldest_age=None, oldest_published_at=None, unknown_age=True)
    # A publisher's clock ahead of this one would give a negative age: a message is at least 0 s old.
    return QueueDepth(
        queue=queue, depth=depth, oldest_age=max(0.0, now - oldest), oldest_published_at=oldest, unknown_age=False
    )


def tail_published_at(raw: bytes | str) -> float | None:
    """The ``pub`` of a raw kombu message as the Redis transport stores it (JSON with ``headers``); None when it
    is not such a message or has no valid ``pub``."""
    try:
        payload = json.loads(raw)
    except (TypeError, ValueError, UnicodeDecodeError):
        return None
    headers = payload.get("headers") if isinstance(payload, dict) else None
    header = headers.get(HEADER) if isinstance(headers, dict) else None
    return published_at(header) if isinstance(header, dict) else None


def _read_passive(connection: Any, queue: str) -> QueueDepth:
    """RabbitMQ (and any transport with a passive declare): the depth; the age is unknown."""
    channel = connection.channel()  # its own channel: a queue that does not exist closes the channel (404)
    try:
        _, depth, _ = channel.queue_declare(queue, passive=True)
    except connection.channel_errors:
        return QueueDepth(
            queue=queue, depth=0, oldest_age=0.0, oldest_published_at=None, unknown_age=False, exists=False
        )
    finally:
        _close(channel)
    depth = int(depth)
    if depth == 0:
        return QueueDepth(queue=queue, depth=0, oldest_age=0.0, oldest_published_at=None, unknown_age=False)
    return QueueDepth(queue=queue, depth=depth, oldest_age=None, oldest_published_at=None, unknown_age=True)


def _close(channel: Any) -> None:
    try:
        channel.close()
    except Exception:  # closed by the broker already (the 404 above)
        logger.debug("Queue read: closing a channel failed", exc_info=True)
