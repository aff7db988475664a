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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_guardrails.options import load, resolve


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


def backoff_for(task: Any, call: Mapping[str, Any]) -> Backoff:
    source = resolve(task, "backoff_random", call)
    return Backoff(
        strategy=resolve(task, "backoff", call),
        base=resolve(task, "backoff_base", call),
        maximum=resolve(task, "backoff_max", call),
        random=load(source) if source is not None else _random.random,
    )
