"""Background threads and fork: a prefork worker forks pool children from a process where the guardrails run
threads (the watchdog, the outbox relay, the activity recorder). A fork taken while one of them is inside a
database driver copies that driver's locks held: SQLite's global mutexes, for one, and the child then waits
for them for ever (seen as a child hung at its first query on SQLite; Python 3.12 warns about fork in a
multi-threaded process for this reason).

:func:`quiet` is the cure: a thread does its store and database work inside ``with quiet():``, and a fork
waits (``os.register_at_fork(before=...)``) until no such block runs, then lets them go on in the parent; in
the child the lock starts free. A block is one pass (a relay batch, a watchdog tick, a flush): a fork waits
for one at most, and never longer than :data:`WAIT` seconds (then it goes ahead: a pass blocked on something
the forking thread holds must not hang the worker).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.RLock()


@contextmanager
def quiet() -> Iterator[None]:
    """Hold off forks while the block runs (see the module docstring)."""
    with _lock:
        yield


#: Seconds a fork waits for a pass at most. A pass that waits for something the forking thread holds (a pool
#: lock of the main thread) would otherwise wait for the fork for ever: past this the fork goes ahead.
WAIT = 5.0
_held = threading.local()


def _before_fork() -> None:
    _held.acquired = _lock.acquire(timeout=WAIT)


def _after_in_parent() -> None:
    if getattr(_held, "acquired", False):
        _held.acquired = False
        _lock.release()


def _after_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # the parent's threads do not exist here: nothing holds it


os.register_at_fork(before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
