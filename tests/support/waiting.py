"""Waiting for a condition, the one way tests wait: poll until it holds, fail after a bound.

The bound is for a machine that has stopped, not a measure of speed: nothing waited for here is expected to
take more than a few seconds, and a test never asserts how long it took.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
#: Seconds a condition may take before the test fails.
BOUND = 60.0


def wait_for(what: str, probe: Callable[[], T | None], *, timeout: float = BOUND, every: float = 0.05) -> T:
    """Poll ``probe`` until it returns something truthy, and return that; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (found := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)
    return found
