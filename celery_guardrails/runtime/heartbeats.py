"""Who holds a claim, and the heartbeats that keep what a delivery holds alive while it runs: the claims of
idempotency keys, the run slots of scheduled work and the concurrency slots (one thread per process renews them
all; a holder whose worker dies stops beating, and its lease lapses). Used by every guardrail that holds
something in the store, so it sits in the runtime, below them.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_guardrails.stores.base import Store

logger = logging.getLogger(__name__)


class _Deliveries:
    """Numbers the deliveries of this process: a random prefix per process (made again after a fork) and a
    counter. Unique per delivery like a fresh UUID, without a call to the OS per task."""

    def __init__(self) -> None:
        self.pid = 0
        self.prefix = ""
        self.numbers = itertools.count()

    def next(self) -> str:
        if self.pid != os.getpid():
            self.pid, self.prefix = os.getpid(), uuid.uuid4().hex[:8]
        return f"{self.prefix}.{next(self.numbers)}"


_DELIVERIES = _Deliveries()


def delivery_owner(request: Any) -> str:
    """Who holds a claim: this delivery of this message in this worker process (unique per delivery)."""
    return f"{request.hostname}:{os.getpid()}:{request.id}:{_DELIVERIES.next()}"


def delivery_number() -> str:
    """The next delivery number of this process (the last part of :func:`delivery_owner`): an owner minted where
    the message is taken, before its request exists (:mod:`celery_guardrails.guardrails.pop_claims`)."""
    return _DELIVERIES.next()


#: A heartbeat of something other than a claim: called with the time, says whether it is still held.
Beat = Callable[[float], bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class Renewal:
    """What the heartbeat thread renews for one (key, owner), and when next."""

    store: Store
    #: Seconds the lease runs from each renewal.
    lease: float
    #: Seconds between two beats.
    interval: float
    #: Monotonic time of the first beat (the next ones: ``Heartbeats.next_beat``).
    due: float
    #: The beat of a hold that is not a claim (None: the claim's own renewal, ``store.extend``).
    beat: Beat | None = None


class Heartbeats:
    """One thread per worker process renews the leases of every claim running in it (and beats for the other
    holds of its deliveries: concurrency slots, see :mod:`celery_guardrails.guardrails.concurrency`).

    A claim's lease is renewed every third of it; the claim itself was the first beat, so a short lease
    cannot lapse before the first renewal. One shared thread instead of one per task: starting a thread per
    task would cost more than the task's two store round trips.

    Adding and removing a hold takes no lock and wakes nothing (every keyed delivery does both): ``claims`` is
    changed by single dict operations, atomic under the GIL, and the thread reads a copy of it. The thread never
    sleeps longer than the shortest beat interval it has seen (``idle``), so a hold whose interval is at least
    that is beaten in time without waking it; only a hold with a shorter interval than any before it takes the
    lock and wakes the thread (and the first one in a process, which starts it).
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.claims: dict[tuple[str, str], Renewal] = {}
        #: The next beat of each hold once it has had one, with the renewal it is for (a pair held again since is
        #: due as its new renewal says). The thread's own: only it writes here.
        self.next_beat: dict[tuple[str, str], tuple[Renewal, float]] = {}
        self.pid = 0
        self.idle = 60.0  # the longest the thread sleeps: the shortest beat interval seen

    def add(
        self, store: Store, key: str, owner: str, *, lease: float, beat: Beat | None = None, every: float = 0.0
    ) -> None:
        """Renew ``owner``'s claim of ``key`` every third of ``lease``; or, given ``beat``, call it every
        ``every`` seconds (False: the hold is lost)."""
        interval = every if beat is not None else lease / 3
        renewal = Renewal(store=store, lease=lease, interval=interval, due=time.monotonic() + interval, beat=beat)
        if interval >= self.idle and self.pid == os.getpid():
            self.claims[(key, owner)] = renewal  # the thread wakes within ``idle``: before this is due
            return
        with self.lock:
            if self.pid != os.getpid():  # first use, or a forked pool child: the parent's thread is not here
                self.pid = os.getpid()
                self.claims.clear()
                self.next_beat.clear()
                threading.Thread(target=self._run, name="guardrails-heartbeats", daemon=True).start()
            self.idle = min(self.idle, interval)
            self.claims[(key, owner)] = renewal
            self.lock.notify()

    def holds(self, key: str, owner: str) -> bool:
        return (key, owner) in self.claims

    def remove(self, key: str, owner: str) -> None:
        self.claims.pop((key, owner), None)

    def _due(self) -> list[tuple[tuple[str, str], Renewal]]:
        """The holds due for a beat now (their next beat set an interval on); sleeps until one is, at most
        ``idle``."""
        with self.lock:
            now = time.monotonic()
            held = list(self.claims.items())  # one C-level copy: adds and removes go on meanwhile
            next_beat = self.next_beat
            if len(next_beat) > len(held):  # forget the holds that were removed
                live = dict(held)
                for pair in [pair for pair in next_beat if pair not in live]:
                    del next_beat[pair]
            due = []
            upcoming = now + self.idle
            for pair, renewal in held:
                last = next_beat.get(pair)
                when = last[1] if last is not None and last[0] is renewal else renewal.due
                if when <= now:
                    due.append((pair, renewal))
                    when = now + renewal.interval
                    next_beat[pair] = (renewal, when)
                upcoming = min(upcoming, when)
            if not due:
                self.lock.wait(max(0.01, upcoming - now))
            return due

    def _run(self) -> None:
        while True:
            due = self._due()
            for (key, owner), renewal in due:
                beat = renewal.beat
                try:
                    if beat is not None:
                        held = beat(time.time())
                    else:
                        held = renewal.store.extend(key, owner=owner, now=time.time(), lease=renewal.lease)
                    if not held and self.holds(key, owner):
                        # (Not when the task finished meanwhile: a completed key has no lease to renew.)
                        logger.warning("%s %s: lease lost by %s", "Hold" if beat else "Idempotency key", key, owner)
                        self.remove(key, owner)
                except Exception:  # a heartbeat must never take the worker down; the lease may lapse
                    logger.exception("%s %s: heartbeat failed", "Hold" if beat else "Idempotency key", key)
            # Beats are rare (a third of a lease): do not keep a database connection open between them.
            stores = {id(renewal.store): renewal.store for _, renewal in due}
            for store in stores.values():
                close = getattr(store, "close_thread", None)
                if close is not None:
                    close()


HEARTBEATS = Heartbeats()


class heartbeat:  # lower case: used like the generator it replaced, ``with heartbeat(...):``
    """Beat for ``owner``'s claim of ``key`` while the block runs. A class rather than a generator: every keyed
    delivery enters one."""

    __slots__ = ("key", "lease", "owner", "store")

    def __init__(self, store: Store, key: str, owner: str, *, lease: float) -> None:
        self.store, self.key, self.owner, self.lease = store, key, owner, lease

    def __enter__(self) -> None:
        HEARTBEATS.add(self.store, self.key, self.owner, lease=self.lease)

    def __exit__(self, *exc_info: object) -> None:
        HEARTBEATS.remove(self.key, self.owner)
