"""Both real stores keep concurrency slots the same way (Redis Lua scripts; Django, a transaction under the
key's row lock): the limit, release, heartbeats, and the reaper that records a stale holder as lost. Time is
the caller's ``now``: a controllable clock, no sleeping. Includes a real race between processes."""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.stores import forget, make_store

pytestmark = pytest.mark.django_db(transaction=True)
T0 = 1_800_000_000.0
CEILING = 60.0


@pytest.fixture
def key(kind: str) -> Iterator[str]:
    key = f"limit:tests-{uuid.uuid4().hex}"
    yield key
    forget(kind, f"guardrails:{{slots:{key}}}*")


def acquire(store: Any, key: str, holder: str, *, now: float, limit: int = 2, **extra: Any) -> Any:
    return store.acquire_slot(key, holder=holder, limit=limit, now=now, reap_after=CEILING, **extra)


def test_the_limit_is_respected_and_a_release_frees_a_slot(store: Any, key: str) -> None:
    # Given a limit of 2: two holders take a slot each
    first = acquire(store, key, "a", now=T0, task_name="t", task_id="id-a", tenant="acme")
    second = acquire(store, key, "b", now=T0 + 1)
    assert (first.acquired, first.holders, second.acquired, second.holders) == (True, 1, True, 2)
    # When a third asks
    third = acquire(store, key, "c", now=T0 + 2)
    # Then it is refused, told when the oldest holder would be reaped were it dead, and nothing was reaped
    assert (third.acquired, third.holders, third.reaped) == (False, 2, ())
    assert third.retry_at == pytest.approx(T0 + CEILING)
    # and a holder asking again (its answer lost) still holds its slot, without taking a second one
    again = acquire(store, key, "a", now=T0 + 3)
    assert (again.acquired, again.holders) == (True, 2)
    # When one releases, the third gets its slot; a release repeated (or by a stranger) says so
    assert store.release_slot(key, holder="b") is True
    assert store.release_slot(key, holder="b") is False
    assert store.release_slot(key, holder="nobody") is False
    assert acquire(store, key, "c", now=T0 + 4).acquired is True
    status = store.slot_status(key, now=T0 + 5)
    assert (status["held"], status["checks"], status["acquired"], status["reaped"]) == (2, 5, 3, 0)
    assert sorted(h.holder for h in status["holders"]) == ["a", "c"]
    a = next(h for h in status["holders"] if h.holder == "a")
    assert (a.task_name, a.task_id, a.tenant, a.acquired_at) == ("t", "id-a", "acme", pytest.approx(T0))


def test_a_limit_of_one_is_mutual_exclusion(store: Any, key: str) -> None:
    # Given one holder of a key limited to one
    assert acquire(store, key, "a", now=T0, limit=1).acquired is True
    # Then nobody else gets in until it releases
    assert [acquire(store, key, h, now=T0 + 1, limit=1).acquired for h in ("b", "c")] == [False, False]
    store.release_slot(key, holder="a")
    assert acquire(store, key, "c", now=T0 + 2, limit=1).acquired is True
    assert acquire(store, key, "b", now=T0 + 3, limit=1).acquired is False


def test_a_beating_holder_is_never_reaped_and_a_stale_one_is_recorded_lost(store: Any, key: str) -> None:
    # Given two holders; "a" beats, "b" stops (its worker died) after T0
    acquire(store, key, "a", now=T0, task_name="job", task_id="id-a")
    acquire(store, key, "b", now=T0, task_name="job", task_id="id-b", tenant="acme")
    for t in range(10, 100, 10):
        assert store.heartbeat_slot(key, holder="a", now=T0 + t) is True
    # When a third asks just within b's ceiling: nothing is reaped, it is refused
    assert acquire(store, key, "c", now=T0 + CEILING).acquired is False
    # When it asks again after b's ceiling, a's heartbeat within it
    answer = acquire(store, key, "c", now=T0 + CEILING + 1)
    # Then b was reaped in the same step that gave c its slot
    assert (answer.acquired, answer.holders) == (True, 2)
    assert [(h.holder, h.task_id, h.tenant, h.state) for h in answer.reaped] == [("b", "id-b", "acme", "lost")]
    (lost,) = answer.reaped
    assert (lost.heartbeat_at, lost.reaped_at) == (pytest.approx(T0), pytest.approx(T0 + CEILING + 1))
    # and the record stays: status shows it, the counter counts it; b's heartbeat and release now fail
    status = store.slot_status(key, now=T0 + CEILING + 2)
    assert status["reaped"] == 1 and [h.holder for h in status["recent_lost"]] == ["b"]
    assert status["recent_lost"][0].task_id == "id-b"
    assert store.heartbeat_slot(key, holder="b", now=T0 + CEILING + 3) is False
    assert store.release_slot(key, holder="b") is False
    assert store.slot_status(key, now=T0 + CEILING + 4)["recent_lost"][0].holder == "b"


def test_the_reaper_on_a_timer_uses_the_ceiling_of_the_last_check(store: Any, key: str) -> None:
    # Given a holder that stops beating at T0
    acquire(store, key, "a", now=T0, task_id="id-a")
    # Then the timer leaves it within its ceiling, and reaps it after
    assert [h for h in store.reap_slots(now=T0 + CEILING - 1) if h.key == key] == []
    reaped = [h for h in store.reap_slots(now=T0 + CEILING + 1) if h.key == key]
    assert [(h.holder, h.task_id, h.state) for h in reaped] == [("a", "id-a", "lost")]
    # and only once
    assert [h for h in store.reap_slots(now=T0 + CEILING + 2) if h.key == key] == []
    status = store.slot_status(key, now=T0 + CEILING + 3)
    assert (status["held"], status["reaped"]) == (0, 1)
    # and the key is free again
    assert acquire(store, key, "b", now=T0 + CEILING + 4, limit=1).acquired is True


def _racer(kind: str, keys: list[str], barrier: Any, results: Any, holder: str) -> None:
    if kind == "django":
        from django.db import connections

        connections.close_all()  # never share the parent's connection across fork
    store = make_store(kind)
    wins = []
    for key in keys:
        barrier.wait()
        wins.append(acquire(store, key, holder, now=T0 + 1).acquired)
    results.put((holder, wins))


def test_processes_racing_for_the_last_slot_never_overshoot_the_limit(kind: str, store: Any) -> None:
    # Given 30 keys limited to two, one slot of each taken
    keys = [f"limit:tests-race-{uuid.uuid4().hex}" for _ in range(30)]
    for key in keys:
        assert acquire(store, key, "first", now=T0).acquired
    # When three processes meet at a barrier before asking for each key
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(3), context.Queue()
    if kind == "django":
        from django.db import connections

        connections.close_all()
    racers = [context.Process(target=_racer, args=(kind, keys, barrier, results, f"r{n}")) for n in range(3)]
    for racer in racers:
        racer.start()
    outcome = dict(results.get(timeout=120) for _ in racers)
    for racer in racers:
        racer.join(30)
    # Then for every key exactly one of them got the last slot, and two hold it
    assert [sum(wins) for wins in zip(*outcome.values(), strict=True)] == [1] * len(keys)
    assert {store.slot_status(key, now=T0 + 2)["held"] for key in keys} == {2}
    for key in keys:
        forget(kind, f"guardrails:{{slots:{key}}}*")
