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
    assert state == OrderState(issued=6, done=3, skipped_from=1, skipped_to=3)
    # Then 4 is in turn, and 2 arriving late is below done, inside the range given up
    assert store.order_advance(key, sequence=4, now=T0 + 12, retention=DAY)
    late = check(store, key, 2, now=T0 + 13)
    assert (late.done, late.skipped_from, late.skipped_to, late.stale) == (4, 1, 3, 1)


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
