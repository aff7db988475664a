"""Both real stores enforce idempotency keys the same way (Redis Lua scripts; Django unique insert and
conditional updates), including under a real race between two processes."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.stores import make_store

pytestmark = pytest.mark.django_db(transaction=True)
T0 = 1_800_000_000.0


@pytest.fixture
def key() -> Iterator[str]:
    yield f"tests.rules:-:{uuid.uuid4().hex}"


def test_claim_lifecycle(store: Any, key: str) -> None:
    claim = store.claim(key, owner="a", now=T0, lease=10, retention=600)
    assert (claim.state, claim.takeover) == ("acquired", False)
    # a second delivery while the lease is live is told to wait until it ends
    busy = store.claim(key, owner="b", now=T0 + 1, lease=10, retention=600)
    assert (busy.state, busy.lease_until) == ("busy", T0 + 10)
    # the heartbeat renews the lease for its owner only
    assert store.extend(key, owner="b", now=T0 + 5, lease=10) is False
    assert store.extend(key, owner="a", now=T0 + 5, lease=10) is True
    assert store.claim(key, owner="b", now=T0 + 12, lease=10, retention=600).state == "busy"
    # completion by someone else is refused; by the owner it sticks, and duplicates get the summary
    assert store.complete(key, owner="b", now=T0 + 13, summary="nope", retention=600) is False
    assert store.complete(key, owner="a", now=T0 + 13, summary="charged", retention=600) is True
    done = store.claim(key, owner="c", now=T0 + 14, lease=10, retention=600)
    assert (done.state, done.summary) == ("completed", "charged")
    assert store.inspect(key)["state"] == "completed"
    assert store.reopen(key) is False  # only a failed key reopens


def test_a_finish_repeated_by_its_owner_succeeds_again_and_changes_nothing(store: Any, key: str) -> None:
    # Given a key completed by "a" (say its answer was lost with the connection)
    store.claim(key, owner="a", now=T0, lease=10, retention=600)
    assert store.complete(key, owner="a", now=T0 + 1, summary="charged", retention=600) is True
    # When "a" completes it again, and "b" tries
    again = store.complete(key, owner="a", now=T0 + 2, summary="other", retention=600)
    stranger = store.complete(key, owner="b", now=T0 + 2, summary="other", retention=600)
    # Then the owner is told it is done, the stranger is refused, and the first summary stays
    assert (again, stranger) == (True, False)
    assert store.claim(key, owner="c", now=T0 + 3, lease=10, retention=600).summary == "charged"
    # and a completed key cannot be failed, even by its owner
    assert store.fail(key, owner="a", now=T0 + 4, reason="late", retention=600) is False


def test_a_claim_repeated_by_its_owner_is_acquired_again(store: Any, key: str) -> None:
    # Given a key claimed by "a" until T0 + 10 (say its answer was lost with the connection)
    store.claim(key, owner="a", now=T0, lease=10, retention=600)
    # When "a" claims it again, and "b" tries
    again = store.claim(key, owner="a", now=T0 + 1, lease=10, retention=600)
    other = store.claim(key, owner="b", now=T0 + 2, lease=10, retention=600)
    # Then "a" holds it (no takeover, its lease renewed) and "b" waits for the renewed lease
    assert (again.state, again.takeover) == ("acquired", False)
    assert (other.state, other.lease_until) == ("busy", T0 + 11)


def test_begin_complete_completes_once_its_answer_is_read(store: Any, key: str) -> None:
    # Given a claimed key
    store.claim(key, owner="a", now=T0, lease=10, retention=600)
    # When its completion is started and its answer read
    wait = store.begin_complete(key, owner="a", now=T0 + 1, summary="charged", retention=600)
    # Then it is completed, and a stranger's started completion is refused
    assert wait() is True
    assert store.inspect(key)["state"] == "completed"
    assert store.begin_complete(key, owner="b", now=T0 + 2, summary="x", retention=600)() is False


def test_expired_lease_is_taken_over_once(store: Any, key: str) -> None:
    store.claim(key, owner="dead", now=T0, lease=5, retention=600)
    takeover = store.claim(key, owner="b", now=T0 + 6, lease=5, retention=600)
    assert (takeover.state, takeover.takeover) == ("acquired", True)
    assert store.claim(key, owner="c", now=T0 + 6.5, lease=5, retention=600).state == "busy"
    # the dead owner can no longer complete: its late completion is refused
    assert store.complete(key, owner="dead", now=T0 + 7, summary="late", retention=600) is False


def test_release_and_fail_and_reopen(store: Any, key: str) -> None:
    store.claim(key, owner="a", now=T0, lease=5, retention=600)
    assert store.release(key, owner="other") is False
    assert store.release(key, owner="a") is True
    assert store.claim(key, owner="b", now=T0 + 1, lease=5, retention=600).state == "acquired"
    assert store.fail(key, owner="b", now=T0 + 2, reason="PermanentError: card refused", retention=600) is True
    failed = store.claim(key, owner="c", now=T0 + 3, lease=5, retention=600)
    assert (failed.state, failed.reason) == ("failed", "PermanentError: card refused")
    assert store.reopen(key) is True
    assert store.claim(key, owner="d", now=T0 + 4, lease=5, retention=600).state == "acquired"


def test_many_keys_reopen_in_one_call_and_only_failed_ones(store: Any, key: str) -> None:
    # Given 600 failed keys (a replay of many dead letters), one completed and one claimed
    failed = [f"{key}:{n}" for n in range(600)]
    for name in failed:
        store.claim(name, owner="a", now=T0, lease=5, retention=600)
        store.fail(name, owner="a", now=T0 + 1, reason="card refused", retention=600)
    store.claim(f"{key}:done", owner="a", now=T0, lease=5, retention=600)
    store.complete(f"{key}:done", owner="a", now=T0 + 1, summary="charged", retention=600)
    store.claim(f"{key}:busy", owner="a", now=T0, lease=5, retention=600)
    # When all of them are reopened at once (and a key that does not exist)
    reopened = store.reopen_keys([*failed, f"{key}:done", f"{key}:busy", f"{key}:never"])
    # Then the failed ones are gone, the others are as they were
    assert reopened == 600
    assert [store.inspect(name) for name in failed[:3] + failed[-3:]] == [None] * 6
    assert store.claim(failed[0], owner="b", now=T0 + 2, lease=5, retention=600).state == "acquired"
    assert store.inspect(f"{key}:done")["state"] == "completed"
    assert store.inspect(f"{key}:busy")["state"] == "claimed"
    assert store.reopen_keys([]) == 0


def test_reserve_publish(store: Any, key: str) -> None:
    assert store.reserve_publish(key, task_id="t1", ttl=60) is None
    assert store.reserve_publish(key, task_id="t2", ttl=60) == "t1"


def _contender(kind: str, keys: list[str], barrier: Any, results: Any, owner: str) -> None:
    if kind == "django":
        from django.db import connections

        connections.close_all()  # never share the parent's connection across fork
    store = make_store(kind)
    wins = []
    for key in keys:
        barrier.wait()
        wins.append(store.claim(key, owner=owner, now=time.time(), lease=30, retention=600).state == "acquired")
    results.put((owner, wins))


def test_two_processes_claiming_the_same_key_at_the_same_moment_1000_times(kind: str) -> None:
    # Given 1000 keys and two processes that meet at a barrier before claiming each one
    keys = [f"tests.race:-:{uuid.uuid4().hex}" for _ in range(1000)]
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    if kind == "django":
        from django.db import connections

        connections.close_all()
    processes = [context.Process(target=_contender, args=(kind, keys, barrier, results, f"p{i}")) for i in (1, 2)]
    for process in processes:
        process.start()
    outcome = dict(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(30)
    # Then for every key exactly one of them acquired it
    assert [a + b for a, b in zip(outcome["p1"], outcome["p2"], strict=True)] == [1] * 1000
    assert 0 < sum(outcome["p1"]) < 1000  # both won some: they really raced
