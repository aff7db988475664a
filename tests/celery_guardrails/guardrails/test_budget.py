"""Retry budget and circuit breaker on real workers over Redis (and the Django store on an embedded worker)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import re
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_guardrails import BudgetExhaustedError, PermanentError, budget_status, signals
from celery_guardrails.foundation.clock import set_file_clock
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

TIMEOUT = 60


def test_budget_holds_across_two_worker_processes_and_work_proceeds_after_recovery(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given two worker processes sharing a dependency whose budget is 2 + 0.5 * first attempts per 2 s window
    window, floor, ratio = 2.0, 2, 0.5
    dependency, flag = f"dep-{uuid.uuid4().hex[:8]}", f"{sink.key}:up"
    config = {
        "retry_budget_window": window,
        "retry_budget_floor": floor,
        "retry_budget_ratio": ratio,
        "circuit_threshold": 0,
        "retry_budget_max_deferrals": 50,
    }
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, **config}
    env = proj_env(
        queue=queue_name,
        GUARDRAILS_TEST_GUARDRAILS=json.dumps(config),
        GUARDRAILS_TEST_SIGNAL_SINK=f"{sink.key}:signals",
    )
    workers = [
        WorkerProcess(app=PROJ_APP, queue=queue_name, concurrency=2, log_path=tmp_path / f"w{i}.log", env=env)
        for i in range(2)
    ]
    for worker in workers:
        worker.start()
    try:
        # When 10 tasks hit the dependency while it is down, and it comes back after 5 s
        results = [
            tasks.behave.apply_async((sink.key, [f"until:{flag}"]), dependency=dependency, max_attempts=30)
            for _ in range(10)
        ]
        time.sleep(5)
        redis.Redis.from_url(REDIS_URL).set(flag, 1, ex=120)
        # Then every task eventually succeeds (the backlog drains at the budget's pace: no new traffic here)
        finals = [result.get(timeout=TIMEOUT) for result in results]
    finally:
        for worker in workers:
            worker.stop()
    assert len({f["pid"] for f in sink.items()}) >= 2  # both processes worked
    assert len(finals) == 10
    # And in every window the retries that ran stayed within floor + ratio * (first attempts of this window
    # and of the one before, which the sliding window can still count), by the store's own clock
    runs = sink.items()
    firsts = Counter(math.floor(r["admitted"] / window) for r in runs if r["attempt"] == 1)
    retries = Counter(math.floor(r["admitted"] / window) for r in runs if r["attempt"] > 1)
    assert retries, "the dependency was down: there were retries"
    for index, count in retries.items():
        assert count <= floor + ratio * (firsts[index] + firsts[index - 1]), (index, count, firsts, retries)
    # And the budget_exhausted signal fired, at most once per window
    fired = [json.loads(raw)["window_end"] for raw in sink.client.lrange(f"{sink.key}:signals", 0, -1)]
    assert fired and len(fired) == len(set(fired))
    # And deferred runs carry the deferral in their history
    assert any(r["class"] == "deferred_budget" for f in finals for r in f["history"])
    sink.client.delete(f"{sink.key}:signals", f"{sink.key}:runs")


def test_budget_policy_fail_ends_with_retry_budget_exhausted(
    celery_worker: Any, celery_app: Any, sink: Sink, received: Any
) -> None:
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "retry_budget_floor": 0,
        "retry_budget_ratio": 0,
        "retry_budget_policy": "fail",
    }
    finals = received(signals.final_failure)
    dependency = f"dep-{uuid.uuid4().hex[:8]}"
    with pytest.raises(BudgetExhaustedError, match="retry budget is spent"):
        tasks.behave.apply_async((sink.key, ["transient", "ok"]), dependency=dependency).get(timeout=30)
    assert [r["attempt"] for r in sink.items()] == [1]
    (final,) = [f["failure"] for f in finals]
    assert final.reason == "retry_budget_exhausted"
    assert [r["class"] for r in final.history] == ["transient", "deferred_budget"]
    assert budget_status(dependency, app=celery_app)["exhausted"] is True


def fail_twice(sink: Sink, dependency: str) -> None:
    """Two runs of ``dependency`` that fail transiently, with no retries left."""
    for i in range(2):
        with pytest.raises(Exception, match="failed"):
            tasks.behave.apply_async((f"{sink.key}:{i}", ["transient"]), dependency=dependency, max_attempts=1).get(
                timeout=30
            )


def test_circuit_opens_defers_first_attempts_and_closes_after_a_probe(
    celery_worker: Any, celery_app: Any, sink: Sink, received: Any
) -> None:
    # Given a breaker that opens after 2 consecutive transient failures, for 2 s of the guardrails' clock,
    # which stands still until the test moves it (at whole seconds: the store keeps times to the microsecond)
    clock = [float(int(time.time()))]
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "circuit_threshold": 2,
        "circuit_open_seconds": 2.0,
        "clock": lambda: clock[0],
    }
    opened = received(signals.circuit_opened)
    deferred = received(signals.retry_deferred)
    dependency = f"dep-{uuid.uuid4().hex[:8]}"
    # When two tasks fail transiently (no retries left), the circuit opens
    fail_twice(sink, dependency)
    # (its outcome is recorded by on_failure, which Celery calls after it stores the result: waited for)
    wait_for("the circuit opened", lambda: opened)
    assert budget_status(dependency, app=celery_app)["circuit"] == "open"
    assert [(o["dependency"], o["until"]) for o in opened] == [(dependency, clock[0] + 2.0)]
    # Then a new task is deferred for the whole open time (plus at most 10% jitter)
    result = tasks.behave.apply_async((sink.key, ["ok"]), dependency=dependency)
    wait_for("the deferral", lambda: deferred)
    # When the open time has passed
    clock[0] += 2.0
    # Then the deferred task is let through as the probe, runs once, and closes the circuit
    report = result.get(timeout=30)
    assert report["attempt"] == 1 and len(sink.items()) == 1
    # (Had its deferred copy come back before the clock moved, it was deferred again for the same time.)
    assert {r["class"] for r in report["history"]} == {"deferred_circuit"}
    assert {(d["dependency"], d["reason"]) for d in deferred} == {(dependency, "circuit")}
    assert all(2.0 <= d["delay"] <= 2.2 for d in deferred)
    # (the success is recorded by on_success, which Celery calls after it stores the result)
    wait_for("the circuit closed", lambda: budget_status(dependency, app=celery_app)["circuit"] == "closed")


def open_circuit(celery_app: Any, sink: Sink, dependency: str, clock: list[float], **settings: Any) -> None:
    """A breaker (2 failures, open for 2 s of a frozen clock) opened by two transient failures, then the
    clock moved past the open time: half-open, waiting for a probe."""
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "circuit_threshold": 2,
        "circuit_open_seconds": 2.0,
        "clock": lambda: clock[0],
        **settings,
    }
    fail_twice(sink, dependency)
    wait_for("the circuit open", lambda: budget_status(dependency, app=celery_app)["circuit"] == "open")
    clock[0] += 2.0


def a_healthy_call_probes_and_closes_it(celery_app: Any, sink: Sink, dependency: str) -> None:
    """A call that succeeds goes through at once (no deferral in its history) and closes the circuit."""
    report = tasks.behave.apply_async((f"{sink.key}:ok", ["ok"]), dependency=dependency).get(timeout=30)
    assert report["history"] == []
    wait_for("the circuit closed", lambda: budget_status(dependency, app=celery_app)["circuit"] == "closed")


@pytest.mark.parametrize(
    ("script", "ends"),
    [(["permanent"], "a permanent error"), (["later", "ok"], "RetryLater, then a success")],
)
def test_a_probe_that_ends_without_a_word_about_the_dependency_does_not_wedge_the_breaker(
    celery_worker: Any, celery_app: Any, sink: Sink, script: list[str], ends: str
) -> None:
    clock = [float(int(time.time()))]
    dependency = f"dep-{uuid.uuid4().hex[:8]}"
    open_circuit(celery_app, sink, dependency, clock)
    # Given the half-open circuit's probe is a run that ends with <ends>
    probe = tasks.behave.apply_async((f"{sink.key}:probe", script), dependency=dependency)
    with contextlib.suppress(PermanentError):
        probe.get(timeout=30)
    # When a healthy call comes next (the clock has not moved: no probe timeout helped), Then it goes through
    # at once, as the next probe, and closes the circuit
    a_healthy_call_probes_and_closes_it(celery_app, sink, dependency)


def test_a_duplicate_skipped_is_no_success_for_the_breaker(
    celery_worker: Any, celery_app: Any, sink: Sink, received: Any
) -> None:
    clock = [float(int(time.time()))]
    dependency, oid = f"dep-{uuid.uuid4().hex[:8]}", random.randrange(10**9)
    skipped = received(signals.duplicate_skipped)
    # Given a key completed while the dependency was healthy, then a circuit opened and half-open
    assert tasks.charge.apply_async((oid, sink.key), dependency=dependency).get(timeout=30) == f"charged {oid}"
    open_circuit(celery_app, sink, dependency, clock)
    # When the probe let through is a duplicate of that key (the body does not run, the dependency is not called)
    tasks.charge.apply_async((oid, sink.key), dependency=dependency).get(timeout=30)
    wait_for("the duplicate skipped", lambda: skipped)
    # Then the circuit is still half-open (the probe's slot released, not a success), and the next call probes
    assert budget_status(dependency, app=celery_app)["circuit"] == "half_open"
    a_healthy_call_probes_and_closes_it(celery_app, sink, dependency)


def test_a_probe_killed_with_its_worker_is_given_up_after_the_probe_timeout(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a prefork worker on a clock the test moves, and a half-open circuit (probe timeout 3 s)
    clock_file = tmp_path / "clock"
    set_file_clock(clock_file, float(int(time.time())))
    settings = {"circuit_threshold": 2, "circuit_open_seconds": 2.0, "circuit_probe_timeout": 3.0}
    env = proj_env(
        queue=queue_name,
        GUARDRAILS_CLOCK_FILE=str(clock_file),
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({**settings, "clock": "celery_guardrails.foundation.clock.file_clock"}),
    )
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, **settings, "clock": file_clock_of(clock_file)}
    dependency = f"dep-{uuid.uuid4().hex[:8]}"
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env) as worker:
        fail_twice(sink, dependency)
        wait_for("the circuit open", lambda: budget_status(dependency, app=celery_app)["circuit"] == "open")
        set_file_clock(clock_file, file_clock_of(clock_file)() + 2.0)
        # When the probe's worker process is killed mid-run (the probe never reports), and it comes back
        flag = f"{sink.key}:killed"
        probe = tasks.behave.apply_async((f"{sink.key}:probe", [f"kill_once:{flag}", "ok"]), dependency=dependency)
        # Then first attempts wait for the lost probe (the redelivery is deferred) ...
        wait_for("the redelivery deferred", lambda: "circuit open" in worker.log)
        # ... until its probe timeout is up: then one goes through as the new probe, and closes the circuit
        set_file_clock(clock_file, file_clock_of(clock_file)() + 3.0)
        report = probe.get(timeout=60)
        wait_for("the circuit closed", lambda: budget_status(dependency, app=celery_app)["circuit"] == "closed")
    assert report["run"] == 2 and "deferred_circuit" in {r["class"] for r in report["history"]}


def file_clock_of(path: Path) -> Any:
    return lambda: float(path.read_text())


@pytest.mark.django_db(transaction=True)
def test_the_django_store_on_a_real_worker(celery_worker: Any, celery_app: Any, sink: Sink) -> None:
    # Given the Django database as the store
    from django_celery_guardrails.models import DependencyState

    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "store": "django"}
    dependency = f"dep-{uuid.uuid4().hex[:8]}"
    # When a task of the dependency fails once and succeeds
    tasks.behave.apply_async((sink.key, ["transient", "ok"]), dependency=dependency).get(timeout=30)
    # Then its first attempt and its retry were counted in the database, and the success closed the circuit
    # (recorded by on_success, which Celery calls after it stores the result: waited for, not assumed)
    row = wait_for(
        "the success recorded", lambda: DependencyState.objects.filter(dependency=dependency, failures=0).first()
    )
    assert (row.first_current + row.first_previous, row.retries_current + row.retries_previous) == (1, 1)
    assert row.circuit == "closed"


def test_budget_and_circuit_lines_read_as_times_and_whole_retries(
    celery_worker: Any, celery_app: Any, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a dependency with no retry to spare (policy "fail") whose circuit opens after 2 transient failures
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "retry_budget_floor": 0,
        "retry_budget_ratio": 0,
        "retry_budget_policy": "fail",
        "retry_budget_window": 60,
        "circuit_threshold": 2,
        "circuit_open_seconds": 240,
    }
    dependency = f"dep-{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.INFO)
    # When a task without a tenant fails transiently and its retry is refused, then a second run fails too
    with pytest.raises(BudgetExhaustedError):
        tasks.behave.apply_async((sink.key, ["transient", "ok"]), dependency=dependency).get(timeout=30)
    with pytest.raises(Exception, match="failed"):
        tasks.behave.apply_async((f"{sink.key}:2", ["transient"]), dependency=dependency, max_attempts=1).get(
            timeout=30
        )

    # Then the worker's lines say when, in local ISO time and how far, with whole retries and units; no raw
    # epoch, no fraction; and "-" for the missing tenant, as the admin shows it
    # (the circuit's line follows the second result: Celery stores it before on_failure reports the outcome)
    def ours() -> list[str]:
        said = [r.getMessage() for r in caplog.records if r.name.startswith("celery_guardrails")]
        return [line for line in said if dependency in line or "failed finally" in line]

    wait_for("the circuit's line", lambda: any(line.startswith("Circuit of") for line in ours()))
    lines = ours()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"  # one format for people (celery_guardrails.log)
    exhausted = [line for line in lines if line.startswith(f"Retry budget of {dependency}")]
    assert len(exhausted) == 1 and re.fullmatch(
        f"Retry budget of {dependency} exhausted until {stamp} \\((in [\\d.]+ s|now)\\): 0 of 0 retries per 60 s",
        exhausted[0],
    ), lines
    opened = [line for line in lines if line.startswith(f"Circuit of {dependency}")]
    assert len(opened) == 1 and re.fullmatch(
        f"Circuit of {dependency} opened for 4 min \\(until {stamp} \\(in 4 min\\)\\)", opened[0]
    ), lines
    finals = [line for line in lines if "failed finally" in line]
    assert [re.search(r"\(tenant (\S+), correlation id", line).group(1) for line in finals] == ["-", "-"]  # type: ignore[union-attr]
    assert not [line for line in lines if re.search(r"\b1[0-9]{9}\b", line)]  # no raw epoch seconds
