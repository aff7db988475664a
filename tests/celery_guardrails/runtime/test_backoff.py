"""Backoff sequences, exactly, with an injected random source."""

from __future__ import annotations

import random

from celery_guardrails.options import OPTIONS
from celery_guardrails.runtime.backoff import Backoff


def default_backoff(source: random.Random) -> Backoff:
    """The backoff a task gets when it sets nothing (the documented defaults)."""
    return Backoff(
        strategy=OPTIONS["backoff"].default,
        base=OPTIONS["backoff_base"].default,
        maximum=OPTIONS["backoff_max"].default,
        random=source.random,
    )


def test_default_delays_start_near_a_second_and_spread_without_collapsing_to_zero() -> None:
    # Given the default backoff (no option set anywhere) with real randomness, drawn 2,000 times per attempt
    backoff = default_backoff(random.Random(30))
    draws = {n: [backoff.delay(failures=n) for _ in range(2000)] for n in range(1, 12)}
    # Then every attempt's delays lie in [floor, 2 * floor): the first retry after 1 s at least, then 2, 4, ...
    # until backoff_max (600 s) caps the window at [300, 600]
    bounds = {n: (min(d), max(d)) for n, d in draws.items()}
    expected = {n: (min(300.0, 2.0 ** (n - 1)), min(600.0, 2.0**n)) for n in range(1, 12)}
    for n, (low, high) in bounds.items():
        assert expected[n][0] <= low < high <= expected[n][1], (n, low, high)
    # And the draws fill their window (spread, not one instant: the low and high tenths are both reached)
    for n, (floor, top) in expected.items():
        width = top - floor
        assert bounds[n][0] < floor + width / 10 and bounds[n][1] > top - width / 10, (n, bounds[n])
    # And no attempt is ever sooner than the one before it could be (the windows never go back)
    assert [expected[n][0] for n in range(1, 12)] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]


def test_equal_jitter_whole_sequence() -> None:
    # Given equal jitter over base 0.5 s, max 10 s, with a seeded source
    backoff = Backoff(strategy="equal_jitter", base=0.5, maximum=10.0, random=random.Random(3).random)
    rng = random.Random(3)
    # Then each delay is half fixed, half random of min(max, base * 2**n), for the whole sequence
    ceilings = [min(10.0, 0.5 * 2**n) for n in range(1, 8)]
    assert [backoff.delay(failures=n) for n in range(1, 8)] == [c / 2 + rng.random() * c / 2 for c in ceilings]
    # And the extremes: random 0 gives the floor, random ~1 the ceiling
    low = Backoff(strategy="equal_jitter", base=0.5, maximum=10.0, random=lambda: 0.0)
    assert [low.delay(failures=n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_full_jitter_whole_sequence() -> None:
    backoff = Backoff(strategy="full_jitter", base=1.0, maximum=30.0, random=random.Random(3).random)
    rng = random.Random(3)
    expected = [rng.random() * min(30.0, 2 ** (n - 1)) for n in range(1, 9)]
    assert [backoff.delay(failures=n) for n in range(1, 9)] == expected
    # the ceiling doubles and then stays at backoff_max
    top = Backoff(strategy="full_jitter", base=1.0, maximum=30.0, random=lambda: 0.999999)
    assert [round(top.delay(failures=n), 3) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_decorrelated_jitter_whole_sequence() -> None:
    backoff = Backoff(strategy="decorrelated_jitter", base=0.5, maximum=20.0, random=random.Random(5).random)
    rng, previous, expected, actual = random.Random(5), 0.5, [], []
    delay = None
    for n in range(1, 10):
        previous = min(20.0, 0.5 + rng.random() * (3 * previous - 0.5))
        expected.append(previous)
        delay = backoff.delay(failures=n, previous=delay)
        actual.append(delay)
    assert actual == expected
    assert all(0.5 <= d <= 20.0 for d in actual)


def test_retry_after_wins_capped_by_backoff_max() -> None:
    backoff = Backoff(strategy="full_jitter", base=1.0, maximum=60.0, random=lambda: 0.0)
    assert backoff.delay(failures=1, retry_after=7.0) == 7.0
    assert backoff.delay(failures=1, retry_after=3600.0) == 60.0


def test_a_thousand_failures_do_not_overflow_the_backoff() -> None:
    # Given a message that failed over a thousand times (2.0 ** 1100 does not fit a float)
    top = Backoff(strategy="full_jitter", base=1.0, maximum=600.0, random=lambda: 0.5)
    # Then its delay is the maximum's share, like the tenth failure's
    assert [top.delay(failures=n) for n in (11, 1025, 1100, 10**6)] == [300.0] * 4
    # And so with the default strategy
    equal = Backoff(strategy="equal_jitter", base=1.0, maximum=600.0, random=lambda: 0.5)
    assert [equal.delay(failures=n) for n in (11, 1025, 1100, 10**6)] == [450.0] * 4
