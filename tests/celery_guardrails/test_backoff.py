"""Backoff sequences, exactly, with an injected random source."""

from __future__ import annotations

import random

from celery_guardrails.backoff import Backoff


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
