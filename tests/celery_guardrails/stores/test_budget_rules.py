"""Both real stores follow the same budget and circuit rules (clock controlled, whole sequences checked).

The Redis store runs them as a Lua script, the Django store as Python under a row lock; each scenario runs
against Redis, the local Redis Cluster and the Django database (PostgreSQL or SQLite, per GUARDRAILS_TEST_DB).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_guardrails.stores.base import FAILURE, RELEASE, SUCCESS, BudgetPolicy

# Every test may use the Django store from several threads: committed transactions, a real test database.
pytestmark = pytest.mark.django_db(transaction=True)

POLICY = BudgetPolicy(window=60.0, ratio=0.5, floor=2, threshold=3, open_seconds=30.0, probes=1)
T0 = 1_800_000_000.0  # a window boundary: 1_800_000_000 / 60 is a whole number


@pytest.fixture
def dependency(store: Any) -> Iterator[str]:
    name = f"dep-{uuid.uuid4().hex[:8]}"
    yield name
    store.reset(name)


def test_retries_fit_floor_plus_ratio_of_first_attempts(store: Any, dependency: str) -> None:
    # Given 4 first attempts in the window: 2 + 0.5 * 4 = 4 retries fit
    for second in range(4):
        assert store.admit(dependency, POLICY, retry=False, now=T0 + second).allowed
    decisions = [store.admit(dependency, POLICY, retry=True, now=T0 + 10 + i) for i in range(6)]
    assert [d.allowed for d in decisions] == [True, True, True, True, False, False]
    # the first refusal of the window is marked once, and says when the window ends
    assert [d.first_denial for d in decisions] == [False] * 4 + [True, False]
    assert decisions[4].reason == "budget" and decisions[4].retry_at == T0 + 60
    status = store.budget_status(dependency, POLICY, now=T0 + 20)
    assert (status["first_attempts"], status["retries"], status["retries_allowed"], status["exhausted"]) == (
        4,
        4,
        4,
        True,
    )


def test_the_window_slides(store: Any, dependency: str) -> None:
    for second in range(4):
        store.admit(dependency, POLICY, retry=False, now=T0 + second)
    for i in range(4):
        store.admit(dependency, POLICY, retry=True, now=T0 + 10 + i)
    # Half-way into the next window, the previous one weighs half: 2 firsts and 2 retries are still counted,
    # so 2 + 0.5 * 2 - 2 = 1 more retry fits, and a new first attempt makes room for half of another
    assert [store.admit(dependency, POLICY, retry=True, now=T0 + 90).allowed for _ in range(2)] == [True, False]
    assert store.admit(dependency, POLICY, retry=False, now=T0 + 91).allowed
    assert store.admit(dependency, POLICY, retry=True, now=T0 + 92).allowed is False
    # the refusal mark is per window: the next window's first refusal is marked again
    assert store.admit(dependency, POLICY, retry=True, now=T0 + 93).first_denial is False
    # two windows later everything old has slid out: the floor is there again
    assert [store.admit(dependency, POLICY, retry=True, now=T0 + 200).allowed for _ in range(3)] == [True, True, False]


def test_circuit_opens_after_consecutive_failures_then_probes(store: Any, dependency: str) -> None:
    # Given 3 consecutive transient failures (a success in between resets the count)
    outcomes = (FAILURE, FAILURE, SUCCESS, FAILURE, FAILURE)
    opened = [store.record_outcome(dependency, POLICY, outcome=o, now=T0) for o in outcomes]
    assert opened == [False] * 5
    assert store.record_outcome(dependency, POLICY, outcome=FAILURE, now=T0 + 1) is True
    # While open, new first attempts wait until it ends; retries are left to the budget
    refused = store.admit(dependency, POLICY, retry=False, now=T0 + 5)
    assert (refused.allowed, refused.reason, refused.retry_at) == (False, "circuit", T0 + 31)
    assert store.admit(dependency, POLICY, retry=True, now=T0 + 5).allowed
    assert store.budget_status(dependency, POLICY, now=T0 + 5)["circuit"] == "open"
    # After the open period one probe goes through, the others wait
    probe = store.admit(dependency, POLICY, retry=False, now=T0 + 31)
    assert (probe.allowed, probe.probe) == (True, True)
    waiting = store.admit(dependency, POLICY, retry=False, now=T0 + 32)
    assert (waiting.allowed, waiting.reason) == (False, "circuit")
    # A failed probe opens it again; a successful one closes it
    assert store.record_outcome(dependency, POLICY, outcome=FAILURE, now=T0 + 33) is True
    assert store.admit(dependency, POLICY, retry=False, now=T0 + 64).probe
    assert store.record_outcome(dependency, POLICY, outcome=SUCCESS, now=T0 + 65) is False
    after = [store.admit(dependency, POLICY, retry=False, now=T0 + 66) for _ in range(3)]
    assert [(a.allowed, a.probe) for a in after] == [(True, False)] * 3
    assert store.budget_status(dependency, POLICY, now=T0 + 66)["circuit"] == "closed"


def half_open(store: Any, dependency: str) -> None:
    """Open the circuit at T0 (3 failures): half-open from T0 + 30."""
    for _ in range(3):
        store.record_outcome(dependency, POLICY, outcome=FAILURE, now=T0)
    assert store.budget_status(dependency, POLICY, now=T0 + 30)["circuit"] == "half_open"


def test_a_probe_that_says_nothing_releases_its_slot(store: Any, dependency: str) -> None:
    # Given a half-open circuit whose one probe went out
    half_open(store, dependency)
    assert store.admit(dependency, POLICY, retry=False, now=T0 + 30).probe
    assert not store.admit(dependency, POLICY, retry=False, now=T0 + 31).allowed
    # When the probe ends without a word about the dependency (a permanent error, a duplicate skipped)
    assert store.record_outcome(dependency, POLICY, outcome=RELEASE, now=T0 + 32) is False
    # Then the circuit stays half-open, and the next first attempt goes through as the probe
    assert store.budget_status(dependency, POLICY, now=T0 + 33)["circuit"] == "half_open"
    again = store.admit(dependency, POLICY, retry=False, now=T0 + 33)
    assert (again.allowed, again.probe) == (True, True)
    # And a release outside half-open changes nothing (a closed circuit keeps its failure count)
    store.record_outcome(dependency, POLICY, outcome=SUCCESS, now=T0 + 34)
    store.record_outcome(dependency, POLICY, outcome=FAILURE, now=T0 + 35)
    store.record_outcome(dependency, POLICY, outcome=RELEASE, now=T0 + 36)
    assert store.budget_status(dependency, POLICY, now=T0 + 36)["consecutive_failures"] == 1


def test_a_probe_that_never_reports_is_given_up_after_the_probe_timeout(store: Any, dependency: str) -> None:
    # Given a half-open circuit whose probe went out at T0 + 30 and never reports (its worker was killed)
    policy = BudgetPolicy(window=60.0, ratio=0.5, floor=2, threshold=3, open_seconds=30.0, probes=1, probe_timeout=20)
    half_open(store, dependency)
    assert store.admit(dependency, policy, retry=False, now=T0 + 30).probe
    # Then first attempts wait until the probe's time is up (no longer than that) ...
    waiting = store.admit(dependency, policy, retry=False, now=T0 + 45)
    assert (waiting.allowed, waiting.retry_at) == (False, T0 + 50)
    # ... and then one goes through as a new probe, which closes the circuit when it succeeds
    late = store.admit(dependency, policy, retry=False, now=T0 + 50)
    assert (late.allowed, late.probe) == (True, True)
    store.record_outcome(dependency, policy, outcome=SUCCESS, now=T0 + 51)
    assert store.budget_status(dependency, policy, now=T0 + 51)["circuit"] == "closed"


def test_no_breaker_when_threshold_is_zero(store: Any, dependency: str) -> None:
    policy = BudgetPolicy(window=60.0, ratio=0.5, floor=2, threshold=0, open_seconds=30.0, probes=1)
    assert not any(store.record_outcome(dependency, policy, outcome=FAILURE, now=T0) for _ in range(10))
    assert store.admit(dependency, policy, retry=False, now=T0).allowed


def test_concurrent_retries_never_exceed_the_budget(store: Any, dependency: str) -> None:
    # Given 10 first attempts (2 + 0.5 * 10 = 7 retries fit), when 8 threads ask for 40 retries at once
    for second in range(10):
        store.admit(dependency, POLICY, retry=False, now=T0 + second)
    allowed: list[bool] = []
    barrier = threading.Barrier(8)

    def ask() -> None:
        barrier.wait()
        for _ in range(5):
            allowed.append(store.admit(dependency, POLICY, retry=True, now=T0 + 20).allowed)
        from django.db import connection

        connection.close()

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then exactly 7 were admitted
    assert (len(allowed), allowed.count(True)) == (40, 7)
