"""Retry budget and circuit breaker per dependency, shared by every worker through the store.

Tasks that declare the same ``dependency="payments-api"`` share both:

* ``before_run`` asks the store to admit the delivery (see :mod:`celery_guardrails.stores.base`). A first
  attempt is counted, and deferred while the dependency's circuit is open; a retry must fit the budget
  (``retry_budget_floor + retry_budget_ratio * first attempts`` per ``retry_budget_window``). A refused
  delivery does not run: with ``retry_budget_policy="defer"`` it is re-published for the moment the store
  named (the next window, the end of the open period) plus up to 10% jitter, no attempt consumed, at most
  ``retry_budget_max_deferrals`` times; with ``"fail"`` (or past that bound) it fails finally
  (``retry_budget_exhausted`` / ``circuit_open``). ``budget_exhausted`` fires once per window.
* The outcome of each run feeds the circuit: a transient failure counts towards opening it
  (``circuit_threshold`` in a row), a success closes it.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from celery_guardrails import signals
from celery_guardrails.exceptions import BudgetExhaustedError
from celery_guardrails.foundation import clock
from celery_guardrails.log import duration, when
from celery_guardrails.options import APP, CALL, TASK, Option, TaskOptions, app_value, checks, declare
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.classification import Kind
from celery_guardrails.runtime.delivery import delivery, view
from celery_guardrails.runtime.outcomes import (
    CIRCUIT_OPEN,
    RETRY_BUDGET_EXHAUSTED,
    attempt_record,
    fail_finally,
    republish,
)
from celery_guardrails.runtime.pipeline import Guardrail
from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import FAILURE, RELEASE, SUCCESS, Admission, BudgetPolicy

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)


def _ratio(value: Any) -> float:
    if not checks.finite(value) or not 0 <= value <= 10:
        raise ValueError(f"must be a number from 0 to 10 (retries per first attempt), got {value!r:.80}")
    return float(value)


#: The options the retry budget and circuit breaker read, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="dependency",
        default=None,
        doc="Name of the provider the task depends on: tasks sharing it share a retry budget and a "
        "circuit breaker across all workers.",
        check=checks.name,
        scopes=frozenset({CALL, TASK}),
    ),
    Option(
        name="retry_budget_ratio",
        default=0.2,
        doc="Retries allowed per first attempt of the dependency within the sliding window.",
        check=_ratio,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="retry_budget_floor",
        default=3,
        doc="Retries always allowed per window, whatever the first attempts.",
        check=checks.non_negative_int,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="retry_budget_window",
        default=60.0,
        doc="Seconds: the sliding window of the retry budget.",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="retry_budget_policy",
        default="defer",
        doc="When the budget is spent: 'defer' the retry to the next window (retry_budget_max_deferrals "
        "times at most) or 'fail' it finally (retry_budget_exhausted).",
        check=checks.choice("defer", "fail"),
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="retry_budget_max_deferrals",
        default=10,
        doc="Budget or circuit deferrals of one message at most; one more is a final failure (retry_budget_exhausted).",
        check=checks.positive_int,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="circuit_threshold",
        default=5,
        doc="Consecutive transient failures of a dependency that open its circuit (0: no breaker).",
        check=checks.non_negative_int,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="circuit_open_seconds",
        default=30.0,
        doc="Seconds an open circuit delays new first attempts before letting probes through.",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="circuit_half_open_probes",
        default=1,
        doc="First attempts let through while the circuit is half-open.",
        check=checks.positive_int,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="circuit_probe_timeout",
        default=60.0,
        doc="Seconds a half-open probe may run without reporting (its worker killed) before another is let through.",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
)


def policy_from(lookup: Callable[[str], Any]) -> BudgetPolicy:
    return BudgetPolicy(
        window=lookup("retry_budget_window"),
        ratio=lookup("retry_budget_ratio"),
        floor=lookup("retry_budget_floor"),
        threshold=lookup("circuit_threshold"),
        open_seconds=lookup("circuit_open_seconds"),
        probes=lookup("circuit_half_open_probes"),
        probe_timeout=lookup("circuit_probe_timeout"),
    )


def policy_for(options: TaskOptions) -> BudgetPolicy:
    """The budget and breaker policy of ``options.task`` with these options."""
    return policy_from(options.__getitem__)


class RetryBudget(Guardrail):
    """Admission by retry budget and circuit breaker; outcomes recorded for the breaker."""

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        options = view(task).options
        request = task.request
        dependency = options["dependency"]
        if not dependency:
            return
        policy = policy_for(options)
        store = get_store(task.app)
        now = clock.now(task.app)
        admission = store.admit(dependency, policy, retry=request.attempt > 1, now=now)
        if admission.first_denial:
            status = store.budget_status(dependency, policy, now=now)
            logger.warning(
                "Retry budget of %s exhausted until %s: %s",
                dependency,
                when(admission.retry_at, now=now),
                budget_use(status),
            )
            signals.budget_exhausted.send(
                sender=task, dependency=dependency, window_end=admission.retry_at, status=status
            )
        if not admission.allowed:
            self._refuse(task, dependency, admission, policy, now)  # nothing ran: no outcome
        state = delivery(task)
        state.dependency, state.admitted = dependency, now  # the instant the store counted this run
        state.probe = admission.probe

    def _refuse(
        self, task: GuardedTask, dependency: str, admission: Admission, policy: BudgetPolicy, now: float
    ) -> NoReturn:
        """Defer the run (raises Celery's Retry), or, past ``retry_budget_max_deferrals`` (or with the ``fail``
        policy), end it as a final failure (raises: see :func:`fail_finally`)."""
        request = task.request
        seen = view(task)
        header, options = seen.header, seen.options
        deferred = headers.counter(header, headers.DEFERRED) + 1
        kind = f"deferred_{admission.reason}"
        reason = RETRY_BUDGET_EXHAUSTED if admission.reason == "budget" else CIRCUIT_OPEN
        error = BudgetExhaustedError(dependency, admission.reason)
        give_up = deferred > options["retry_budget_max_deferrals"] or (
            admission.reason == "budget" and options["retry_budget_policy"] == "fail"
        )
        if give_up:
            record = attempt_record(task, kind=kind, rule=reason, exc=error)
            fail_finally(task, error, reason=reason, history=[*request.attempt_history, record])
        wait = max(0.0, admission.retry_at - now)
        jitter = random.random() * 0.1 * (policy.window if admission.reason == "budget" else policy.open_seconds)
        # Never longer than backoff_max (kept below the broker's visibility timeout: see the start-up warning);
        # a deferral that comes back early is deferred again.
        delay = min(wait + jitter, options["backoff_max"])
        record = attempt_record(task, kind=kind, rule=reason, delay=delay)
        logger.info(
            "Task %s[%s] deferred for %s: %s of %s (deferral %d)",
            task.name,
            request.id,
            duration(delay),
            "retry budget spent" if admission.reason == "budget" else "circuit open",
            dependency,
            deferred,
        )
        signals.retry_deferred.send(
            sender=task, task_id=request.id, dependency=dependency, reason=admission.reason, delay=delay
        )
        republish(task, countdown=delay, header=headers.with_record(header, record, deferred=deferred))

    def _record(self, task: GuardedTask, outcome: str) -> None:
        state = delivery(task)
        dependency = state.dependency
        if not dependency or (outcome == RELEASE and not state.probe):
            return
        state.dependency = None  # reported once
        policy = policy_for(view(task).options)
        now = clock.now(task.app)
        if get_store(task.app).record_outcome(dependency, policy, outcome=outcome, now=now):
            logger.warning(
                "Circuit of %s opened for %s (until %s)",
                dependency,
                duration(policy.open_seconds),
                when(now + policy.open_seconds, now=now),
            )
            signals.circuit_opened.send(sender=task, dependency=dependency, until=now + policy.open_seconds)

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        # A run whose body did not run (a duplicate skipped, an overlapping period) did not call the
        # dependency: it is no success; a probe's slot is released.
        self._record(task, SUCCESS if delivery(task).body_ran else RELEASE)

    def on_failure(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        self._outcome_of_failure(task)

    def on_retry(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        self._outcome_of_failure(task)

    def _outcome_of_failure(self, task: GuardedTask) -> None:
        verdict = delivery(task).verdict
        # Only a transient failure says something about the dependency's health; any other ending (a
        # permanent error, RetryLater, a wait or a store outage before the body) releases a probe's slot,
        # so the breaker never waits for a probe that will not report.
        transient = verdict is not None and verdict.kind is Kind.TRANSIENT
        self._record(task, FAILURE if transient else RELEASE)


def budget_use(status: dict[str, Any]) -> str:
    """A dependency's retry budget as a person reads it: whole retries (the store's sliding window weighs the
    previous window's, hence fractions) against the whole retries allowed, per window: ``3 of 3 retries per
    60 s``."""
    return (
        f"{math.ceil(status['retries'] - 1e-9):d} of {math.floor(status['retries_allowed'] + 1e-9):d} retries per "
        f"{duration(status['window_seconds'])}"
    )


def budget_status(dependency: str, *, app: Any = None) -> dict[str, Any]:
    """The retry budget and circuit of ``dependency`` now, under ``app``'s settings (default: current app)."""
    from celery import current_app

    app = app or current_app
    policy = policy_from(lambda name: app_value(app, name))
    return get_store(app).budget_status(dependency, policy, now=clock.now(app))
