"""Both real stores follow the same ordering rules (whole sequences checked, times given).

Each scenario runs against Redis (a Lua script), the local Redis Cluster and the Django database (conditional
UPDATEs; PostgreSQL or SQLite, per GUARDRAILS_TEST_DB).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_guardrails.stores.base import OrderState
from tests.support.stores import forget

# Every test may use the Django store from several threads: committed transactions, a real test database.
pytestmark = pytest.mark.django_db(transaction=True)

T0 = 1_800_000_000.0
DAY = 24 * 3600.0


@pytest.fixture
def key(kind: str) -> Iterator[str]:
    name = f"tests.order:-:k-{uuid.uuid4().hex[:8]}"
    yield name
    forget(kind, f"*{name}*")


def check(store: Any, key: str, sequence: int, now: float = T0) -> OrderState:
    state: OrderState = store.order_check(key, sequence=sequence, now=now, retention=DAY)
    return state


def test_sequence_numbers_are_handed_out_one_by_one_per_key(store: Any, key: str) -> None:
    # Given two keys, When numbers are asked for alternately, Then each key counts on its own from 1
    other = key + "-other"
    numbers = [store.order_next(k, now=T0, retention=DAY) for k in (key, other, key, key, other)]
    assert numbers == [1, 1, 2, 3, 2]
    assert check(store, key, 1) == OrderState(issued=3, done=0)


def test_concurrent_publishers_never_get_the_same_number(store: Any, key: str) -> None:
    # Given 4 threads asking for 10 numbers each at once (a new key: the first INSERT races)
    got: list[int] = []
    lock = threading.Lock()

    def publish() -> None:
        for _ in range(10):
            number = store.order_next(key, now=T0, retention=DAY)
            with lock:
                got.append(number)
        close = getattr(store, "close_thread", None)
        if close:
            close()

    threads = [threading.Thread(target=publish) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then 1..40, each once
    assert sorted(got) == list(range(1, 41))


def test_advance_is_a_compare_and_set_from_the_previous_number(store: Any, key: str) -> None:
    for _ in range(3):
        store.order_next(key, now=T0, retention=DAY)
    advance = [
        store.order_advance(key, sequence=s, now=T0, retention=DAY)
        for s in (2, 1, 1, 3, 2, 3)  # out of turn, in turn, again, out of turn, in turn, in turn
    ]
    assert advance == [False, True, False, False, True, True]
    assert check(store, key, 4).done == 3


def test_check_marks_the_gap_and_the_lowest_waiter_and_counts_stale(store: Any, key: str) -> None:
    for _ in range(5):
        store.order_next(key, now=T0, retention=DAY)
    # Given done = 1 (1 ran)
    assert store.order_advance(key, sequence=1, now=T0, retention=DAY)
    # When 2 is its turn: nothing marked
    assert check(store, key, 2, now=T0 + 1) == OrderState(issued=5, done=1)
    # When 4 waits first, then 3, then 5: the gap's start is the first wait, the lowest waiter is 3
    assert check(store, key, 4, now=T0 + 2) == OrderState(issued=5, done=1, gap_since=T0 + 2, waiting=4)
    assert check(store, key, 3, now=T0 + 3) == OrderState(issued=5, done=1, gap_since=T0 + 2, waiting=3)
    assert check(store, key, 5, now=T0 + 4) == OrderState(issued=5, done=1, gap_since=T0 + 2, waiting=3)
    # When 1 comes again: stale, counted
    assert check(store, key, 1, now=T0 + 5).stale == 1
    assert check(store, key, 1, now=T0 + 5).stale == 2
    # When the key moves, the gap and the waiter are cleared; the next wait starts a new gap
    assert store.order_advance(key, sequence=2, now=T0 + 6, retention=DAY)
    assert check(store, key, 3, now=T0 + 7) == OrderState(issued=5, done=2, stale=2)
    assert check(store, key, 5, now=T0 + 8) == OrderState(issued=5, done=2, gap_since=T0 + 8, waiting=5, stale=2)


def test_skip_gives_up_a_range_once_and_remembers_it(store: Any, key: str) -> None:
    for _ in range(6):
        store.order_next(key, now=T0, retention=DAY)
    check(store, key, 4, now=T0)
    # When 4 gives up 1..3 (done still 0): it may; a second skip from the old done may not
    assert store.order_skip(key, done=0, to=3, now=T0 + 10, retention=DAY) is True
    assert store.order_skip(key, done=0, to=5, now=T0 + 10, retention=DAY) is False
    assert store.order_skip(key, done=3, to=3, now=T0 + 10, retention=DAY) is False  # nothing to give up
    state = check(store, key, 4, now=T0 + 11)
    assert state == OrderState(
        issued=6, done=3, skipped_from=1, skipped_to=3, skipped_since=T0, skipped_at=T0 + 10, skip_owed=True
    )
    # Then 4 is in turn, and 2 arriving late is below done, inside the range given up
    assert store.order_advance(key, sequence=4, now=T0 + 12, retention=DAY)
    late = check(store, key, 2, now=T0 + 13)
    assert (late.done, late.skipped_from, late.skipped_to, late.stale) == (4, 1, 3, 1)


def test_a_skipped_range_is_owed_its_record_until_recorded_once(store: Any, key: str) -> None:
    for _ in range(4):
        store.order_next(key, now=T0, retention=DAY)
    # Given 3 waited from T0 and gave up 1..2 at T0 + 100
    check(store, key, 3, now=T0)
    check(store, key, 3, now=T0 + 50)
    assert store.order_skip(key, done=0, to=2, now=T0 + 100, retention=DAY)
    # Then the key owes the range's record, with when the gap opened and when it was given up
    state = check(store, key, 3, now=T0 + 101)
    assert (state.skipped_from, state.skipped_to, state.skipped_since, state.skipped_at, state.skip_owed) == (
        1,
        2,
        T0,
        T0 + 100,
        True,
    )
    # When its record is written: owed no more; a second "recorded", or one for another range, changes nothing
    assert [store.order_recorded(key, to=t, now=T0 + 102, retention=DAY) for t in (1, 2, 2)] == [False, True, False]
    assert check(store, key, 3, now=T0 + 103).skip_owed is False
    # And an unknown key is not made
    assert store.order_recorded(key + "-none", to=2, now=T0, retention=DAY) is False


def test_a_wait_alerts_once_and_a_new_wait_alerts_again(store: Any, key: str) -> None:
    for _ in range(4):
        store.order_next(key, now=T0, retention=DAY)
    # Given 3 waits for 1 since T0
    assert check(store, key, 3, now=T0).gap_since == T0
    # Then the wait of T0 alerts once; a wait that is not the key's (another start) never
    alerts = [store.order_alert(key, since=s, now=T0 + 60, retention=DAY) for s in (T0 + 1, T0, T0, T0)]
    assert alerts == [False, True, False, False]
    assert check(store, key, 3, now=T0 + 61).alerted == T0
    # When the key moves on and a new wait starts (4 waits for 3 since T0 + 70), that wait alerts once again
    assert store.order_advance(key, sequence=1, now=T0 + 62, retention=DAY)
    assert store.order_advance(key, sequence=2, now=T0 + 63, retention=DAY)
    assert check(store, key, 4, now=T0 + 70).gap_since == T0 + 70
    assert [store.order_alert(key, since=T0 + 70, now=T0 + 99, retention=DAY) for _ in range(2)] == [True, False]
    assert store.order_alert(key + "-none", since=T0, now=T0, retention=DAY) is False


def waits_of(store: Any, keys: list[str]) -> list[tuple[str, int, int, float]]:
    """The waits ``order_waits`` lists for ``keys`` (the index is shared with whatever else runs on the store)."""
    found = store.order_waits(now=T0 + 1000, limit=10_000)
    assert found.count >= len(found.oldest)
    return [(w.key, w.waiting_for, w.lowest, w.since) for w in found.oldest if w.key in keys]


def test_the_keys_that_wait_are_listed_oldest_wait_first_until_they_move(store: Any, key: str) -> None:
    first, second, quiet = key, key + "-2", key + "-3"
    for name in (first, second, quiet):
        for _ in range(4):
            store.order_next(name, now=T0, retention=DAY)
    keys = [first, second, quiet]
    # Given 3 of ``second`` waits from T0 + 5, 4 of ``first`` from T0 + 10 then 2 of it too; ``quiet`` runs 1
    check(store, second, 3, now=T0 + 5)
    check(store, first, 4, now=T0 + 10)
    check(store, first, 2, now=T0 + 20)
    check(store, quiet, 1, now=T0 + 20)
    # Then both waiting keys are listed, the oldest wait first, with the number each waits for and since when
    assert waits_of(store, keys) == [(second, 1, 3, T0 + 5), (first, 1, 2, T0 + 10)]
    # When a waiter looks again, its wait keeps its start
    check(store, second, 3, now=T0 + 30)
    assert waits_of(store, keys)[0] == (second, 1, 3, T0 + 5)
    # When ``second`` moves (1 ran) and ``first`` gives up 1: neither waits any more
    assert store.order_advance(second, sequence=1, now=T0 + 40, retention=DAY)
    assert store.order_skip(first, done=0, to=1, now=T0 + 41, retention=DAY)
    assert waits_of(store, keys) == []
    # When ``second`` waits again (4 for 2, a new wait): listed again with the new start
    check(store, second, 4, now=T0 + 50)
    assert waits_of(store, keys) == [(second, 2, 4, T0 + 50)]
    store.order_advance(second, sequence=2, now=T0 + 60, retention=DAY)


def test_an_unknown_key_is_never_made_by_check_advance_or_skip(store: Any, key: str) -> None:
    # Given a key that was never used (or whose counters lapsed)
    assert check(store, key, 3) == OrderState()
    assert store.order_advance(key, sequence=1, now=T0, retention=DAY) is False
    assert store.order_skip(key, done=0, to=2, now=T0, retention=DAY) is False
    # Then the first publish still gets 1, not a number already done
    assert store.order_next(key, now=T0, retention=DAY) == 1
    assert check(store, key, 1) == OrderState(issued=1, done=0)


def test_redis_counters_expire_after_the_retention_together(kind: str, store: Any, key: str) -> None:
    if kind == "django":
        pytest.skip("the Django store keeps rows (updated_at says when a key was last used)")
    from celery_guardrails.stores.redis_ordering import order_key

    store.order_next(key, now=T0, retention=100)
    store.order_advance(key, sequence=1, now=T0, retention=50)
    client = store.client
    # One hash holds both counters; every change sets its expiry
    assert 0 < client.ttl(order_key(key)) <= 50
    assert client.type(order_key(key)) == b"hash"
