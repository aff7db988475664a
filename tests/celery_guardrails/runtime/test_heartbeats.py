"""The heartbeat thread: holds added and removed without a lock are beaten in time, and no more once removed."""

from __future__ import annotations

import itertools
import time
from typing import Any

from celery_guardrails.runtime.heartbeats import Heartbeats

INTERVAL = 0.3
#: How late a beat may come on a busy machine (the thread's own scheduling, beside the suite's other processes on
#: two cores). Well under the 2.7 s a hold would wait without the thread's sleep cap (the first test), and over the
#: 0.3 s at which the old hold's schedule would beat again (the second): either fault still fails them.
SLACK = 1.0


def _recorder(into: list[float]) -> Any:
    def beat(now: float) -> bool:
        into.append(time.monotonic())
        return True

    return beat


def _hold(beats: Heartbeats, key: str, every: float) -> list[float]:
    """Hold ``key`` (owner "o") with a beat every ``every`` seconds; the times of its beats."""
    times: list[float] = []
    beats.add(None, key, "o", lease=0, beat=_recorder(times), every=every)  # type: ignore[arg-type]
    return times


def _until(condition: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_hold_added_while_the_thread_sleeps_is_beaten_on_time_without_waking_it() -> None:
    # Given a heartbeat thread that has seen a 0.3 s interval (a hold since removed) and now beats one hold every
    # 3 s: nothing of its own would wake it for 3 s
    beats = Heartbeats()
    short = _hold(beats, "short", INTERVAL)
    _until(lambda: len(short) >= 1)
    beats.remove("short", "o")
    _hold(beats, "long", 3.0)
    time.sleep(INTERVAL)

    # When a hold with the 0.3 s interval is added (no lock taken, the thread not woken)
    added = time.monotonic()
    second = _hold(beats, "second", INTERVAL)

    # Then it is beaten within its interval, and again at every interval after
    _until(lambda: len(second) >= 4)
    gaps = [later - earlier for earlier, later in itertools.pairwise([added, *second])]
    assert all(gap <= INTERVAL + SLACK for gap in gaps), gaps

    # And once removed, it is not beaten again (one beat already under way may still land)
    beats.remove("second", "o")
    beats.remove("long", "o")
    count = len(second)
    time.sleep(INTERVAL * 4)
    assert len(second) <= count + 1
    assert not beats.holds("second", "o") and not beats.holds("long", "o")


def test_a_pair_held_again_is_due_as_its_new_hold_says() -> None:
    # Given a hold beaten every 0.3 s, removed, then held again by the same key and owner with a 2 s interval
    beats = Heartbeats()
    calls = _hold(beats, "key", INTERVAL)
    _until(lambda: len(calls) >= 2)
    beats.remove("key", "o")
    added = time.monotonic()
    again = _hold(beats, "key", 2.0)

    # When the thread goes on beating for a second
    time.sleep(1.0)

    # Then the new hold was not beaten on the old one's schedule: its first beat is its own interval away
    assert again == [] or again[0] - added >= 2.0 - SLACK
