"""The rules of retry budgets and circuit breakers that both stores follow (the store protocol, with the other
records a store keeps, is :mod:`celery_guardrails.stores.base`).

Two real backends implement it: Redis (:mod:`celery_guardrails.stores.redis`, one Lua script per
operation, so each is atomic and one round trip) and the Django database
(``django_celery_guardrails.store``, a row lock per dependency). Both follow the rules written out in
:func:`decide_admission` and :func:`decide_outcome`, which the Django store runs as they are and the Redis
script mirrors line by line; the same tests run against both.

Retry budget (per dependency): a sliding window of ``window`` seconds, approximated by two fixed buckets
(the current one, and the previous one weighted by how much of it still overlaps the window). A retry is
admitted while ``retries + 1 <= floor + ratio * first_attempts`` over the window.

Circuit breaker (per dependency): ``closed``; ``open`` for ``open_seconds`` after ``threshold`` consecutive
transient failures (new first attempts are deferred until it ends); then ``half_open``, which lets
``probes`` first attempts through: a success closes it, a transient failure opens it again. Every probe
reports: a probe whose run ends without saying anything about the dependency (a permanent error, a
duplicate skipped, a wait, a store outage) releases its slot (``outcome=RELEASE``); one that never reports
(its worker was killed) is given up after ``probe_timeout``, and another goes through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
#: Outcomes a run reports to its dependency's breaker.
SUCCESS, FAILURE, RELEASE = "success", "failure", "release"
#: Keys the guardrails claim for themselves (the watchdog's turn, a schedule's run slot) start with this; a
#: task's keys start with its name.
INTERNAL_KEY_PREFIX = "guardrails:"


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetPolicy:
    window: float
    ratio: float
    floor: int
    threshold: int
    open_seconds: float
    probes: int
    #: Seconds a half-open probe may take to report before its slot is given to another.
    probe_timeout: float = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission:
    """Whether an attempt may run now; if not, why (``"budget"`` / ``"circuit"``) and from when it may."""

    allowed: bool
    reason: str = ""
    retry_at: float = 0.0
    first_denial: bool = False  # the first refusal of this budget window (the signal fires once per window)
    probe: bool = False  # admitted as a half-open circuit's probe: its outcome must be reported


@dataclass(slots=True, kw_only=True)
class DependencyState:
    """The stored state of one dependency (a Redis hash, a database row)."""

    window_index: int = 0
    first_current: int = 0
    retries_current: int = 0
    first_previous: int = 0
    retries_previous: int = 0
    denied_window: int = -1
    failures: int = 0
    circuit: str = CLOSED
    open_until: float = 0.0
    probes: int = 0
    probe_until: float = 0.0


def _roll(state: DependencyState, index: int) -> None:
    if state.window_index < index:
        previous = state.window_index == index - 1
        state.first_previous = state.first_current if previous else 0
        state.retries_previous = state.retries_current if previous else 0
        state.first_current = state.retries_current = 0
        state.window_index = index


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowCounts:
    """A dependency's attempts over the sliding window ending at some moment."""

    #: First attempts (the previous window's weighted by how much of it the sliding window still covers).
    firsts: float
    #: Retries, weighted the same way.
    retries: float
    #: The number of the fixed window the moment falls in (``floor(now / window)``).
    index: int


def window_counts(state: DependencyState, policy: BudgetPolicy, now: float) -> WindowCounts:
    """The attempts over the sliding window ending ``now``; rolls ``state``."""
    index = math.floor(now / policy.window)
    _roll(state, index)
    weight = 1 - (now - index * policy.window) / policy.window
    return WindowCounts(
        firsts=state.first_current + state.first_previous * weight,
        retries=state.retries_current + state.retries_previous * weight,
        index=index,
    )


def decide_admission(state: DependencyState, policy: BudgetPolicy, *, retry: bool, now: float) -> Admission:
    """Admit (and count) an attempt, or say until when it must wait. Mutates ``state``."""
    counts = window_counts(state, policy, now)
    firsts, retries, index = counts.firsts, counts.retries, counts.index
    if retry:
        if retries + 1 <= policy.floor + policy.ratio * firsts:
            state.retries_current += 1
            return Admission(allowed=True)
        first_denial = state.denied_window != index
        state.denied_window = index
        return Admission(
            allowed=False, reason="budget", retry_at=(index + 1) * policy.window, first_denial=first_denial
        )
    if policy.threshold > 0:
        if state.circuit == OPEN and now >= state.open_until:
            state.circuit, state.probes = HALF_OPEN, 0
        if state.circuit == OPEN:
            return Admission(allowed=False, reason="circuit", retry_at=state.open_until)
        if state.circuit == HALF_OPEN:
            if state.probes >= policy.probes and now < state.probe_until:
                retry_at = min(now + policy.open_seconds / 4, state.probe_until)
                return Admission(allowed=False, reason="circuit", retry_at=retry_at)
            if state.probes >= policy.probes:  # the probes out did not report in time (killed): given up
                state.probes = 0
            state.probes += 1
            state.probe_until = now + policy.probe_timeout
            state.first_current += 1
            return Admission(allowed=True, probe=True)
    state.first_current += 1
    return Admission(allowed=True)


def decide_outcome(state: DependencyState, policy: BudgetPolicy, *, outcome: str, now: float) -> bool:
    """Count a success or a transient failure, or release a probe's slot (a run that said nothing about the
    dependency); return True when this opened the circuit. Mutates ``state``."""
    if outcome == RELEASE:
        if state.circuit == HALF_OPEN and state.probes > 0:
            state.probes -= 1
        return False
    if outcome == SUCCESS:
        state.failures, state.circuit, state.probes = 0, CLOSED, 0
        return False
    state.failures += 1
    if policy.threshold > 0 and (
        state.circuit == HALF_OPEN or (state.circuit == CLOSED and state.failures >= policy.threshold)
    ):
        state.circuit, state.open_until, state.probes = OPEN, now + policy.open_seconds, 0
        return True
    return False


def status(dependency: str, state: DependencyState, policy: BudgetPolicy, now: float) -> dict[str, Any]:
    """What :func:`celery_guardrails.budget_status` reports."""
    counts = window_counts(state, policy, now)
    firsts, retries, index = counts.firsts, counts.retries, counts.index
    allowed = policy.floor + policy.ratio * firsts
    circuit = state.circuit
    if circuit == OPEN and now >= state.open_until:
        circuit = HALF_OPEN
    return {
        "dependency": dependency,
        "window_seconds": policy.window,
        "first_attempts": round(firsts, 3),
        "retries": round(retries, 3),
        "retries_allowed": round(allowed, 3),
        "exhausted": retries + 1 > allowed,
        "window_end": (index + 1) * policy.window,
        "circuit": circuit,
        "consecutive_failures": state.failures,
        "open_until": state.open_until if circuit != CLOSED else None,
    }
