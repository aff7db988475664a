"""The guardrails' clock: the time their policies are measured by.

One clock, the ``clock`` option (a callable, or its dotted path, returning epoch seconds; default
``time.time``), is read by the schedule guardrails (beat, the run ledger, the watchdog), the retry budget
and the circuit breaker, and the alert throttle. Leases are not: they tell whether a live process is still
beating (idempotency claims, overlap slots, the watchdog's turn), so they stay in real time, renewed by a
thread that sleeps real seconds.

Two clocks come with the package for demos, simulations and tests. Both read the environment, so beat,
every worker and a test process that share it read the same time:

* :func:`accelerated_clock`: ``GUARDRAILS_CLOCK="<t0>:<speed>"``; from the real instant ``t0`` on, time runs
  ``speed`` times faster (the demo runs a minute in 3 s);
* :func:`file_clock`: ``GUARDRAILS_CLOCK_FILE=<path>``; the instant written in the file. It stands still
  until :func:`set_file_clock` moves it, so a test decides exactly when a period is due, a window is over
  or a breaker may probe, however slow the machine is.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery_guardrails.options import APP, Option, app_value, checks, declare, load

#: The environment variable of :func:`accelerated_clock`.
CLOCK_ENV = "GUARDRAILS_CLOCK"
#: The environment variable of :func:`file_clock`.
CLOCK_FILE_ENV = "GUARDRAILS_CLOCK_FILE"


#: The options the clock reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="clock",
        default=None,
        doc="Callable (or dotted path) returning the current time as epoch seconds, read by the schedule "
        "guardrails (beat, ledger, watchdog), retry budgets and circuit breakers, and alert throttles; leases "
        "stay in real time. Default time.time. For demos, simulations and tests: see "
        "celery_guardrails.foundation.clock.",
        check=checks.callable_or_path,
        scopes=frozenset({APP}),
    ),
)


def now(app: Any) -> float:
    """The current time of ``app``'s guardrails (epoch seconds): its ``clock`` option, else ``time.time()``."""
    clock = app_value(app, "clock")
    return float(load(clock)()) if clock is not None else time.time()


def accelerated_clock() -> float:
    """Time running faster: ``GUARDRAILS_CLOCK="<t0>:<speed>"`` (unset: the real time)."""
    real = time.time()
    value = os.environ.get(CLOCK_ENV)
    if not value:
        return real
    t0, speed = (float(part) for part in value.split(":"))
    return t0 + (real - t0) * speed


def file_clock() -> float:
    """The instant written in the file named by ``GUARDRAILS_CLOCK_FILE`` (see :func:`set_file_clock`)."""
    path = os.environ.get(CLOCK_FILE_ENV)
    if not path:
        raise RuntimeError(f"file_clock: set {CLOCK_FILE_ENV} to the path of the clock's file")
    return float(Path(path).read_text())


def set_file_clock(path: str | os.PathLike[str], instant: float) -> None:
    """Move a :func:`file_clock` to ``instant``, at once for every process that reads the file.

    Written to a temporary file and renamed over the clock's, so a reader never sees half a number.
    """
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    partial.write_text(repr(float(instant)))
    os.replace(partial, target)


__all__ = ["accelerated_clock", "file_clock", "now", "set_file_clock"]
