"""Backoff: how long to wait before the next attempt.

* ``equal_jitter`` (default): after the n-th failed attempt, half of ``ceiling = min(backoff_max,
  backoff_base * 2 ** n)`` fixed and half random: ``ceiling / 2 + random() * ceiling / 2``. With the default
  ``backoff_base`` of 1 s the retries wait 1-2 s, 2-4 s, 4-8 s, 8-16 s, 16-32 s, ... then 300-600 s
  (``backoff_max`` 600 s). The fixed half is the floor: a first retry never comes sooner than ``backoff_base``
  (full jitter drew 0.013 s after a provider's 503: a hammer), and the random half still spreads the workers
  that failed at the same instant over a window as long as the floor.
* ``full_jitter``: ``random() * min(backoff_max, backoff_base * 2 ** (n - 1))``: exponential growth, spread
  uniformly from zero (the AWS "full jitter"; Celery's ``retry_backoff``): the widest spread, but any retry
  may come back at once.
* ``decorrelated_jitter``: ``min(backoff_max, backoff_base + random() * (3 * previous - backoff_base))``,
  ``previous`` being the last delay (``backoff_base`` at first).
* A ``Retry-After`` the error carries wins, capped by ``backoff_max``: the provider said when.

``random`` returns a float in [0, 1); inject a seeded one (``backoff_random``) to test exact sequences.
All values are seconds.
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable
from dataclasses import dataclass

from celery_guardrails.options import APP, CALL, TASK, Option, TaskOptions, checks, declare, load

#: The options backoff reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="backoff",
        default="equal_jitter",
        doc="After the n-th failed attempt, 'equal_jitter': half fixed, half random of min(backoff_max, "
        "backoff_base * 2**n), so the first retry waits backoff_base to twice that (1-2 s, then 2-4 s, 4-8 s, "
        "...); 'full_jitter': random(0, min(backoff_max, backoff_base * 2**(n-1))), which may retry at once; "
        "'decorrelated_jitter': min(backoff_max, random(backoff_base, 3 * previous delay)).",
        check=checks.choice("equal_jitter", "full_jitter", "decorrelated_jitter"),
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="backoff_base",
        default=1.0,
        doc="Seconds: the scale of the first retry delay (with equal_jitter, its floor: the first retry "
        "waits backoff_base to twice that). Unset on a task with Celery's retry_backoff: that (True: 1).",
        check=checks.seconds,
        scopes=frozenset({CALL, TASK, APP}),
    ),
    Option(
        name="backoff_max",
        default=600.0,
        doc="Seconds: no retry delay (Retry-After included) is longer. Keep it below the Redis "
        "visibility_timeout (1 hour by default). Unset on a task with Celery's retry_backoff_max: that.",
        check=checks.seconds,
        scopes=frozenset({CALL, TASK, APP}),
    ),
    Option(
        name="backoff_random",
        default=None,
        doc="Callable (or dotted path) returning a float in [0, 1); default random.random. Inject a "
        "seeded one to test exact delays.",
        check=checks.callable_or_path,
        scopes=frozenset({TASK, APP}),
    ),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    strategy: str
    base: float
    maximum: float
    random: Callable[[], float]

    def delay(self, *, failures: int, previous: float | None = None, retry_after: float | None = None) -> float:
        """Seconds to wait after the ``failures``-th failed attempt."""
        if retry_after is not None:
            return min(self.maximum, retry_after)
        if self.strategy == "decorrelated_jitter":
            last = self.base if previous is None else previous
            return float(min(self.maximum, self.base + self.random() * max(0.0, 3 * last - self.base)))
        # The exponent is capped: 2.0 ** 1100 overflows, and the maximum is reached long before anyway.
        if self.strategy == "full_jitter":
            return float(self.random() * min(self.maximum, self.base * 2.0 ** min(failures - 1, 64)))
        ceiling = min(self.maximum, self.base * 2.0 ** min(failures, 64))
        return float(ceiling / 2 + self.random() * ceiling / 2)


def backoff_for(options: TaskOptions) -> Backoff:
    """The backoff of ``options.task`` with these options."""
    source = options["backoff_random"]
    return Backoff(
        strategy=options["backoff"],
        base=options["backoff_base"],
        maximum=options["backoff_max"],
        random=load(source) if source is not None else _random.random,
    )
