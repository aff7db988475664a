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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
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
    #: Monotonic time of the next beat.
    due: float
    #: The beat of a hold that is not a claim (None: the claim's own renewal, ``store.extend``).
    beat: Beat | None = None


class Heartbeats:
    """One thread per worker process renews the leases of every claim running in it (and beats for the other
    holds of its deliveries: concurrency slots, see :mod:`celery_guardrails.guardrails.concurrency`).

    A claim's lease is renewed every third of it; the claim itself was the first beat, so a short lease
    cannot lapse before the first renewal. One shared thread instead of one per task: starting a thread per
    task would cost more than the task's two store round trips.
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.claims: dict[tuple[str, str], Renewal] = {}
        self.pid = 0
        self.wakes_at = 0.0  # monotonic time the thread wakes up next (0: it is not waiting)
        self.idle = 60.0  # how long the thread sleeps holding no claim: the shortest beat interval seen

    def _ensure_thread(self) -> None:
        if self.pid != os.getpid():  # first use, or a forked pool child: the parent's thread is not here
            self.pid = os.getpid()
            self.claims.clear()
            self.wakes_at = 0.0
            threading.Thread(target=self._run, name="guardrails-heartbeats", daemon=True).start()

    def add(
        self, store: Store, key: str, owner: str, *, lease: float, beat: Beat | None = None, every: float = 0.0
    ) -> None:
        """Renew ``owner``'s claim of ``key`` every third of ``lease``; or, given ``beat``, call it every
        ``every`` seconds (False: the hold is lost)."""
        interval = every if beat is not None else lease / 3
        with self.lock:
            self._ensure_thread()
            due = time.monotonic() + interval
            self.claims[(key, owner)] = Renewal(store=store, lease=lease, interval=interval, due=due, beat=beat)
            # Wake the thread only when this beat is due before it would wake anyway. Holding no claim, it
            # sleeps the shortest beat interval seen, so with one lease for all tasks a new claim never wakes
            # it: a thread switch per task cost a solo worker more than its guardrails' Python.
            self.idle = min(self.idle, interval)
            if due < self.wakes_at:
                self.lock.notify()

    def holds(self, key: str, owner: str) -> bool:
        with self.lock:
            return (key, owner) in self.claims

    def remove(self, key: str, owner: str) -> None:
        with self.lock:
            self.claims.pop((key, owner), None)

    def _run(self) -> None:
        while True:
            with self.lock:
                now = time.monotonic()
                due = [(k, v) for k, v in self.claims.items() if v.due <= now]
                for pair, renewal in due:
                    self.claims[pair] = replace(renewal, due=now + renewal.interval)
                upcoming = min((v.due for v in self.claims.values()), default=now + self.idle)
                if not due:
                    self.wakes_at = upcoming
                    self.lock.wait(max(0.01, upcoming - now))
                    self.wakes_at = 0.0
                    continue
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


@contextmanager
def heartbeat(store: Store, key: str, owner: str, *, lease: float) -> Iterator[None]:
    HEARTBEATS.add(store, key, owner, lease=lease)
    try:
        yield
    finally:
        HEARTBEATS.remove(key, owner)
