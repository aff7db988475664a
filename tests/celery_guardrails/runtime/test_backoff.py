"""Backoff sequences, exactly, with an injected random source."""

from __future__ import annotations

import random
import re
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[3]


def windows(text: str) -> list[tuple[float, float]]:
    """The ``1-2 s, then 2-4 s, ...`` windows (a hyphen or an en dash) of a sentence or a table column."""
    return [(float(low), float(high)) for low, high in re.findall(r"([\d.]+)[-\u2013]([\d.]+) s", text)]


def test_the_default_delays_the_readme_and_the_retries_page_print_are_the_code_s() -> None:
    # Given the default backoff's windows as the code computes them: the n-th retry's least and greatest delay
    # (the random draw at 0 and at 1)
    def drawing(value: float) -> Backoff:
        return Backoff(
            strategy=OPTIONS["backoff"].default,
            base=OPTIONS["backoff_base"].default,
            maximum=OPTIONS["backoff_max"].default,
            random=lambda: value,
        )

    code = [(drawing(0.0).delay(failures=n), drawing(1.0).delay(failures=n)) for n in range(1, 6)]
    cap = OPTIONS["backoff_max"].default
    # When the README's sentence and the retries page's sentence and table are read
    readme = (ROOT / "README.md").read_text()
    said = re.search(r"Retries wait, by default, (.+?), \.\.\. up to (\d+) minutes", readme, flags=re.S)
    assert said, "README.md no longer states the default retry delays"
    page = (ROOT / "docs" / "guardrails" / "retries.md").read_text()
    sentence = re.search(r"the retries wait (.+?), \.\.\. up to\s+([\d.]+)-([\d.]+) s \(`backoff_max`\)", page)
    assert sentence, "docs/guardrails/retries.md no longer states the default retry delays"
    table = page.split("## Default retry delays", 1)[1]
    rows = re.findall(r"^\| (\d) \| ([^|]+) \| ([^|]+) \|", table, flags=re.M)
    (cap_row,) = re.findall(r"^\| cap \| `backoff_max` (\d+) s \|", table, flags=re.M)
    # Then each states the code's windows, retry by retry, and its cap
    assert windows(said[1]) == code
    assert float(said[2]) * 60 == cap
    assert windows(sentence[1]) == code
    assert (float(sentence[2]), float(sentence[3])) == (cap / 2, cap)
    assert [int(n) for n, _, _ in rows] == [1, 2, 3, 4, 5]
    assert [windows(ours)[0] for _, ours, _ in rows] == code
    assert float(cap_row) == cap
    # And Celery's column (retry_backoff=True, full jitter) is Celery's own formula: 0 to 2**(n-1) s
    from celery.utils.time import get_exponential_backoff_interval

    celery = [(0.0, float(get_exponential_backoff_interval(1, n - 1, 600, full_jitter=False))) for n in range(1, 6)]
    assert [windows(theirs)[0] for _, _, theirs in rows] == celery
    theirs_in_readme = re.search(r"\(Celery's\s+`retry_backoff`: ([^;]+);", readme)
    assert theirs_in_readme and windows(theirs_in_readme[1]) == celery[:3]
