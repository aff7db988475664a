"""Backoff: how long to wait before the next attempt.

* ``full_jitter`` (default): ``random() * min(backoff_max, backoff_base * 2 ** (n - 1))`` after the n-th
  failed attempt: exponential growth, spread uniformly so that many workers failing at the same instant do
  not come back at the same instant.
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
        return float(self.random() * min(self.maximum, self.base * 2.0 ** min(failures - 1, 64)))


def backoff_for(task: Any, call: Mapping[str, Any]) -> Backoff:
    source = resolve(task, "backoff_random", call)
    return Backoff(
        strategy=resolve(task, "backoff", call),
        base=resolve(task, "backoff_base", call),
        maximum=resolve(task, "backoff_max", call),
        random=load(source) if source is not None else _random.random,
    )
